"""Reference models used by the examples, tests and benchmarks (plain PyTorch, no parallelism inside)."""

from lightning_autopar.models.gpt import GPT, GPTConfig, MoE, lm_loss

__all__ = ["GPT", "GPTConfig", "MoE", "lm_loss", "LitGPT"]


def __getattr__(name: str):
    if name == "LitGPT":  # imports Lightning: only on demand
        from lightning_autopar.models.lit import LitGPT

        return LitGPT
    raise AttributeError(name)
