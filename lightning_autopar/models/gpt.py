"""A small GPT (optionally MoE) written as single-device code: no parallelism, no autopar imports.

Shapes use ``-1`` for head counts in views so that tensor parallelism (which shrinks the local width)
only has to update ``n_heads`` / ``n_kv_heads``, as torchtitan's models do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 256
    seq_len: int = 64
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    ffn_kind: str = "gelu"  # gelu | swiglu
    experts: int = 0  # 0 = dense
    top_k: int = 2
    moe_every: int = 1
    tied_embeddings: bool = False
    dropout: float = 0.0
    aux_loss_coef: float = 0.01
    # a learned position table (seq_len x hidden); False: none (a spec whose positions hold no parameters, as
    # Llama's rotary ones: what ``autopar simulate`` builds for such a preset, so the model's parameters are the
    # spec's)
    learned_positions: bool = True

    def __post_init__(self) -> None:
        self.kv_heads = self.kv_heads or self.heads
        self.ffn_hidden = self.ffn_hidden or 4 * self.hidden


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        # GQA inside SDPA (each K/V head serves heads/kv_heads query heads): no repeated K/V is materialised, and
        # context parallelism gathers the model's own K/V heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        y = y.transpose(1, 2).reshape(bsz, seq, -1)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int, kind: str = "gelu") -> None:
        super().__init__()
        self.kind = kind
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        if kind == "swiglu":
            self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class MoE(nn.Module):
    """Top-k routed experts, no token dropped; ``aux_loss`` holds the Switch load-balancing loss of the last call."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_experts = cfg.experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden, cfg.ffn_hidden, cfg.ffn_kind) for _ in range(cfg.experts))
        self.aux_loss = torch.zeros(())

    def route(self, x: torch.Tensor, reduce_counts=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router math shared with the expert-parallel layer: (topk weights, topk expert ids, aux loss).

        ``reduce_counts`` (optional) maps this call's per-expert assignment counts to the counts over all the
        tokens the balance loss should cover (default: this call's tokens)."""
        logits = self.router(x)
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        # Switch Transformer balance loss: E * sum_e (fraction of tokens routed to e) * (mean prob of e)
        counts = torch.zeros(self.num_experts, device=x.device, dtype=torch.float32)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device))
        if reduce_counts is not None:
            counts = reduce_counts(counts)
        frac = counts / counts.sum()
        aux = self.num_experts * (frac * probs.mean(dim=0)).sum()
        return weights, ids, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids, self.aux_loss = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden, cfg.ffn_hidden, cfg.ffn_kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-norm blocks, LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.learned_positions else None
        self.blocks = nn.ModuleList(
            Block(cfg, moe=cfg.experts > 0 and (i + 1) % cfg.moe_every == 0) for i in range(cfg.layers)
        )
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE load-balancing losses of the last forward (0 for a dense model)."""
        losses = [m.aux_loss for m in self.modules() if isinstance(m, MoE)]
        return self.config.aux_loss_coef * sum(losses) if losses else torch.zeros(())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

