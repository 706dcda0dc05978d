"""The main job: a small GPT trained on the bundled sonnets with strategy="autopar".

Single-device Lightning code; the only autopar-specific lines are the import and the strategy. A Hydra app over
``configs/train.yaml`` (schema: ``lightning_autopar.config.TrainConfig``). Runs on 4 CPU processes here (gloo),
or on all GPUs when CUDA is present:

    python examples/train_gpt.py                                   # plan + train, 4 CPU processes
    python examples/train_gpt.py model=gpt_small cluster=cpu trainer.devices=4 planner.fix="tp=2"
    python examples/train_gpt.py planner=tp2 trainer.max_steps=50 data.batch_size=32
    python examples/train_gpt.py --cfg job                         # print the composed config

A bad override prints one line and exits with code 2. Hydra's run files go to outputs/ (the working directory
is unchanged).
"""

from __future__ import annotations

import lightning.pytorch as L
from torch.utils.data import DataLoader

import lightning_autopar  # noqa: F401  (registers strategy="autopar")
from lightning_autopar.config import TrainConfig, gpt_config, hydra_app, trainer_from_config
from lightning_autopar.data import ByteDataset
from lightning_autopar.errors import ConfigError
from lightning_autopar.models.lit import LitGPT


def byte_loader(cfg: TrainConfig) -> DataLoader:
    """The bundled corpus as (inputs, targets) windows; one batch is the global batch of an optimizer step."""
    if cfg.model.vocab < 256:
        raise ConfigError("model.vocab", f"{cfg.model.vocab} < 256 byte values of the bundled corpus",
                          "use a model preset with vocab >= 256, e.g. model=gpt_small")
    seq_len = cfg.data.seq_len or cfg.model.seq_len
    return DataLoader(ByteDataset(seq_len=seq_len), batch_size=cfg.data.batch_size, shuffle=cfg.data.shuffle,
                      drop_last=True)


def train(cfg: TrainConfig, module: L.LightningModule | None = None) -> L.Trainer:
    L.seed_everything(cfg.seed)
    data = byte_loader(cfg)
    if module is None:
        seq_len = cfg.data.seq_len or cfg.model.seq_len
        module = LitGPT(gpt_config(cfg.model, seq_len=seq_len), lr=cfg.optim.lr, optimizer=cfg.optim.name,
                        weight_decay=cfg.optim.weight_decay, momentum=cfg.optim.momentum)
    trainer = trainer_from_config(cfg, data)
    trainer.fit(module, data)
    if trainer.is_global_zero and "train_loss" in trainer.callback_metrics:  # planner.simulate=true trains nothing
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f}")
    return trainer


if __name__ == "__main__":
    hydra_app(train, config_name="train")
