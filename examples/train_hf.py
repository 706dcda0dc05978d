"""A Hugging Face model trained with strategy="autopar", the model unchanged (extra ``hf``: transformers).

LlamaForCausalLM (dense presets) or MixtralForCausalLM (MoE presets), randomly initialised from the model preset,
inside a thin LightningModule computing the next-token loss (lightning_autopar.models.hf.LitCausalLM). A Hydra app
over configs/train_hf.yaml, the main job's config with model=llama_tiny:

    python examples/train_hf.py                                    # tiny Llama, 4 CPU processes
    python examples/train_hf.py model=mixtral_tiny                 # tiny Mixtral (4 experts, top-2)
    python examples/train_hf.py model=mixtral_tiny planner.fix="ep=2"   # its experts split over 2 ranks
    python examples/train_hf.py trainer.devices=2 planner.fix="zero=3"
"""

from __future__ import annotations

from train_gpt import train  # the main job's loop: data, Trainer(strategy=autopar)

from lightning_autopar.config import TrainConfig, hydra_app
from lightning_autopar.models.hf import LitCausalLM, causal_lm


def train_hf(cfg: TrainConfig) -> None:
    import lightning.pytorch as L

    L.seed_everything(cfg.seed)
    model = causal_lm(cfg.model)  # LlamaForCausalLM / MixtralForCausalLM, as Hugging Face ships them
    module = LitCausalLM(model, lr=cfg.optim.lr, optimizer=cfg.optim.name, weight_decay=cfg.optim.weight_decay,
                         momentum=cfg.optim.momentum)
    train(cfg, module)


if __name__ == "__main__":
    hydra_app(train_hf, config_name="train_hf")
