"""Context parallelism's second flavour (``plan.cp_kind = "heads"``): all-to-all over heads, DeepSpeed-Ulysses
(Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models", sec. 3).

Everything but the attention is ``parallel.context``'s: the load-balanced sequence layout (rank ``i`` holds chunks
``i`` and ``2cp-1-i`` of ``2cp``), the positions passed, the outputs gathered back, the padding-mask agreement, the
self-check. Only ``scaled_dot_product_attention`` differs: each rank holds its part of the sequence for all heads;
q, k and v are exchanged by one all-to-all each so that each rank holds the whole sequence for ``heads / cp`` of
them (in the all-gather's order: the ranks' parts in rank order), put in natural order (``context.chunk_slots``),
attended by the model's own SDPA call (its causal flag, its GQA, its dropout), put back in the layout order and
exchanged back by a fourth all-to-all. Backward: each all-to-all's gradient is the reverse all-to-all
(``_HeadsExchange``). Per layer 4 all-to-alls of ``b*s/cp*h`` elements each in forward, the same in backward
(``planner.cost_comm.cp_heads_comm_per_block``), against the all-gather flavour's K/V gathered whole; attention
memory: full-sequence q/k/v for ``heads / cp`` heads.

Where it cannot run it says so in one line (``check_heads``, before any collective): the query heads each rank
holds (``heads / tp``) must divide by cp; key/value heads that do not (GQA with few kv heads) are repeated to the
query heads before the exchange (more traffic, priced so).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.collectives import all_to_all_along
from lightning_autopar.parallel.context import (CPGroup, MaskAgreement, checked_call, chunk_slots, reorder_chunks,
                                               same_heads_on_every_rank)
from lightning_autopar.planner.space import heads_rule

HEADS, SEQ = -3, -2  # the dims of SDPA's [batch, heads, sequence, head_dim] inputs


def check_heads(model: str, heads: int, kv_heads: int, tp: int, cp: int) -> None:
    """One ConfigError ("plan.cp_kind") where ``planner.space.heads_rule`` refuses (the rule the search offers
    the flavour by)."""
    why = heads_rule(heads, kv_heads, tp, cp)
    if why:
        raise ConfigError("plan.cp_kind", f"{model}: {why}", "use cp_kind=gather, or a cp dividing heads/tp")


class _HeadsExchange(torch.autograd.Function):
    """All-to-all: sequence parts in, heads parts out (``to_heads``) or back; backward the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPGroup, to_heads: bool) -> torch.Tensor:
        ctx.cp, ctx.to_heads = cp, to_heads
        return _exchange(x, cp, to_heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _exchange(grad, ctx.cp, not ctx.to_heads), None, None


def _exchange(x: torch.Tensor, cp: CPGroup, to_heads: bool) -> torch.Tensor:
    if to_heads:  # [b, h, s/cp, d] -> [b, h/cp, s, d] (the ranks' parts in rank order)
        return all_to_all_along(x, HEADS, SEQ, cp.group, cp.size)
    return all_to_all_along(x, SEQ, HEADS, cp.group, cp.size)


def heads_attention(original: Callable[..., torch.Tensor], cp: CPGroup, model: str,
                    masks: MaskAgreement) -> Callable[..., torch.Tensor]:
    """``scaled_dot_product_attention`` over the cp group by heads (module doc). With a padding mask given to the
    transformer every call attends with the causal-and-padding mask over the whole sequence (after
    ``MaskAgreement.verify`` checked the model's own mask on this rank's queries, as the all-gather flavour)."""

    @functools.wraps(original)
    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **kwargs: Any) -> Any:
        if query.dim() != 4 or query.shape[HEADS] % cp.size:  # the same on every cp rank
            raise ConfigError("plan.cp_kind", f"{model}: an attention call with {query.shape[HEADS]} query heads "
                              f"per rank cannot deal them out over cp={cp.size} ranks",
                              "use cp_kind=gather, or a cp dividing heads/tp")
        seq = checked_call(query, key, attn_mask, is_causal, cp, model, masks)
        key, value = same_heads_on_every_rank(query, key, value, masks, kwargs)
        if key.shape[HEADS] % cp.size:  # GQA with fewer kv heads than cp: repeated to the query heads
            rep = query.shape[HEADS] // key.shape[HEADS]
            key, value = key.repeat_interleave(rep, HEADS), value.repeat_interleave(rep, HEADS)
        chunk = seq // (2 * cp.size)
        slots = chunk_slots(cp.size)
        whole = [reorder_chunks(_HeadsExchange.apply(t, cp, True), slots, chunk) for t in (query, key, value)]
        mask = None
        if masks.keys is not None:
            mask = _padding_mask(masks, seq, query.dtype)
            is_causal = False
        out = original(*whole, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)
        back = sorted(range(2 * cp.size), key=slots.__getitem__)  # global chunk order -> the all-gather's slots
        return _HeadsExchange.apply(reorder_chunks(out, back, chunk).contiguous(), cp, False)

    return sdpa


def _padding_mask(masks: MaskAgreement, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, S, S] additive mask in natural order: causal (where the model's attention is) and the real keys."""
    key = ("heads", seq, dtype)
    if key not in masks.built:
        keys = masks.keys
        chunk = seq // (2 * masks.cp.size)
        real = reorder_chunks(keys[:, :, None], chunk_slots(masks.cp.size), chunk)[:, :, 0]
        allowed = real[:, None, None, :].expand(-1, 1, seq, -1)
        if masks.causal:
            allowed = allowed & torch.ones(seq, seq, dtype=torch.bool, device=keys.device).tril()
        masks.built[key] = torch.zeros(allowed.shape, dtype=dtype, device=keys.device).masked_fill_(
            ~allowed, float("-inf"))
    return masks.built[key]
