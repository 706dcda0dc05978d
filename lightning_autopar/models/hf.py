"""Hugging Face causal LMs under autopar: small random-init Llama / Mixtral built from a ModelSpec, and a thin
LightningModule computing the next-token loss. The HF model itself is used unchanged (extra ``hf``:
``pip install lightning-autopar[hf]``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch

from lightning_autopar.errors import ConfigError
from lightning_autopar.models.gpt import lm_loss
from lightning_autopar.specs import ModelSpec


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("transformers", "not installed", "pip install 'lightning-autopar[hf]'") from None
    return transformers


def hf_config(spec: ModelSpec) -> Any:
    """A LlamaConfig (dense) or MixtralConfig (``experts > 0``) of the spec's shape (SwiGLU, RMSNorm, RoPE)."""
    tf = _transformers()
    if spec.ffn_kind != "swiglu":
        raise ConfigError("model.ffn_kind", f"{spec.ffn_kind!r}: Llama and Mixtral use SwiGLU MLPs",
                          "use a swiglu preset, e.g. model=llama_tiny or model=mixtral_tiny")
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn_hidden,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  max_position_embeddings=spec.seq_len, tie_word_embeddings=spec.tied_embeddings,
                  attn_implementation="sdpa")
    if spec.experts:
        return tf.MixtralConfig(num_local_experts=spec.experts, num_experts_per_tok=spec.top_k,
                                output_router_logits=True, **common)
    return tf.LlamaConfig(**common)


def causal_lm(spec: ModelSpec) -> torch.nn.Module:
    """A randomly initialised LlamaForCausalLM / MixtralForCausalLM (seed with ``L.seed_everything`` first)."""
    tf = _transformers()
    config = hf_config(spec)
    cls = tf.MixtralForCausalLM if spec.experts else tf.LlamaForCausalLM
    return cls(config)


class LitCausalLM(L.LightningModule):
    """Any HF causal LM on (inputs, targets) batches: cross-entropy on the logits, plus the router's
    load-balancing loss when the model returns one (Mixtral). Logs ``train_loss`` (and ``val_loss``)."""

    def __init__(self, model: torch.nn.Module, lr: float = 3e-3, optimizer: str = "adamw",
                 weight_decay: float = 0.0, momentum: float = 0.9) -> None:
        super().__init__()
        self.model = model
        self.lr, self.optimizer_name, self.weight_decay, self.momentum = lr, optimizer, weight_decay, momentum

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits

    def loss(self, batch: Any) -> torch.Tensor:
        idx, targets = batch
        out = self.model(input_ids=idx, use_cache=False)
        loss = lm_loss(out.logits, targets)
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            loss = loss + self.model.config.router_aux_loss_coef * aux
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
