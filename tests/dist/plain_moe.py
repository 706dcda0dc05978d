"""A MoE GPT written the usual single-device way, for the expert-parallel tests: each MoE layer is a router
``nn.Linear``, an ``nn.ModuleList`` of expert MLPs and the top-k loop over the experts inside ``forward`` (no
``route()`` method, nothing autopar-specific). Experts that no token chose are skipped, as plain loops often do,
so ranks call different experts. The layer keeps a router z-loss (mean over tokens of logsumexp(logits)^2,
ST-MoE) on ``self.aux_loss``: a token mean, so the data-parallel average of the ranks' values is the global one.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from common import LitLM
from torch import nn


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, ffn)
        self.fc_out = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class PlainMoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(hidden, ffn) for _ in range(experts))
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        self.aux_loss = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        weights, chosen = torch.topk(logits.softmax(dim=-1, dtype=torch.float), self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in self.numbered_experts():
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)

    def numbered_experts(self):
        return enumerate(self.experts)


class DictExpertsMoE(PlainMoE):
    """PlainMoE with its experts in an ``nn.ModuleDict`` under names of their own, looped over by ``items()``:
    expert and tensor parallelism find experts by what the forward calls, whatever container holds them."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__(hidden, ffn, experts, top_k)
        self.experts = nn.ModuleDict({f"expert_{e}": expert for e, expert in enumerate(self.experts)})

    def numbered_experts(self):
        return ((int(name.rpartition("_")[2]), expert) for name, expert in self.experts.items())


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.n_heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, top_k: int,
                 moe: type[PlainMoE] = PlainMoE) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.norm_2 = nn.LayerNorm(hidden)
        self.moe = moe(hidden, ffn, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.moe(self.norm_2(x))


class PlainMoEGPT(nn.Module):
    def __init__(self, vocab: int = 64, seq_len: int = 16, hidden: int = 32, heads: int = 4, layers: int = 2,
                 ffn: int = 64, experts: int = 4, top_k: int = 2, moe: type[PlainMoE] = PlainMoE) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, ffn, experts, top_k, moe) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def aux_loss(self) -> torch.Tensor:
        return sum(m.aux_loss for m in self.modules() if isinstance(m, PlainMoE))


class LitPlainMoE(LitLM):
    """The shared wrapper's next-token loss plus the model's own balance loss."""

    def __init__(self, model: PlainMoEGPT, aux_coef: float = 0.1) -> None:
        super().__init__(model)
        self.aux_coef = aux_coef

    def loss(self, batch) -> torch.Tensor:
        return super().loss(batch) + self.aux_coef * self.model.aux_loss()


def make_plain_moe_module(**overrides) -> LitPlainMoE:
    """The plain-loop MoE GPT (tiny: hidden 32, 2 layers, 4 experts, top-2) in a LightningModule."""
    from common import SEQ, VOCAB

    aux_coef = overrides.pop("aux_coef", 0.1)
    return LitPlainMoE(PlainMoEGPT(**{"vocab": VOCAB, "seq_len": SEQ, **overrides}), aux_coef=aux_coef)


def make_dict_moe_module(**overrides) -> LitPlainMoE:
    """The plain-loop MoE GPT with its experts in a ModuleDict (``DictExpertsMoE``)."""
    return make_plain_moe_module(moe=DictExpertsMoE, **overrides)


def make_litgpt_moe_module(**_: object) -> L.LightningModule:
    """litgpt's own GPT with its ``LLaMAMoE`` (gate Linear, ModuleList of LLaMAMLP experts, the loop in forward),
    tiny: 2 layers, hidden 32, 4 experts, top-2; only the loss is ours (common.LitLM)."""
    from common import SEQ, VOCAB
    from litgpt.config import Config
    from litgpt.model import GPT
    config = Config(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                    block_size=SEQ, bias=False, mlp_class_name="LLaMAMoE", intermediate_size=64,
                    moe_intermediate_size=64, n_expert=4, n_expert_per_token=2, norm_class_name="RMSNorm",
                    rotary_percentage=1.0, parallel_residual=False)
    return LitLM(GPT(config))
