"""The main job with a mixture-of-experts GPT: models.GPTConfig(experts=4, top_k=2) in every block.

Nothing MoE-specific here: strategy="autopar" plans it, and may choose expert parallelism (``ep``) where the
runtime supports it. A Hydra app over configs/train_moe.yaml (the main job's config with model=gpt_moe_small):

    python examples/train_moe.py                                   # 4 CPU processes (all GPUs with CUDA)
    python examples/train_moe.py model.experts=8 planner.fix="ep=4"
    python examples/train_moe.py model=mixtral-8x7b cluster=h100-sxm-dgx trainer.num_nodes=8   # on a cluster
"""

from __future__ import annotations

from train_gpt import train  # the main job's loop: data, LitGPT from cfg.model, Trainer(strategy=autopar)

from lightning_autopar.config import TrainConfig, hydra_app


def train_moe(cfg: TrainConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    hydra_app(train_moe, config_name="train_moe")
