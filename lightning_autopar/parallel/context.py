"""Context parallelism (cp): the sequence split over the ranks of a cp group, from collectives that run on gloo.

All-gather based CP, as Llama 3 trains long contexts (Dubey et al. 2024, "The Llama 3 Herd of Models", sec.
3.3.2): each rank keeps a load-balanced part of the sequence -- the sequence cut into ``2 * cp`` chunks, rank
``i`` holding chunks ``i`` and ``2cp - 1 - i`` (so every rank gets the same share of the causal mask's work) --
and each attention all-gathers K and V along the sequence (backward: their gradients reduce-scattered), then
attends without a mask: each of the rank's two query chunks meets the earlier gathered chunks whole, its own chunk
causally and no later one (the causal skip), in kernels that return the log-sum-exp, merged by it
(``_ChunkedCausalAttention``; memory as one flash attention's, no (S/cp) x S mask). A padding mask or dropout
takes the model's own ``scaled_dot_product_attention`` with an explicit mask built from global positions.

Where it happens (the user's code unchanged):

* the transformer (``runtime.analysis.analyse``'s module: embeddings + blocks; for Hugging Face causal LMs the
  inner model, so the LM's own loss runs on the full sequence outside it) gets a forward pre-hook sharding the
  sequence inputs (tensors whose dim 1 is the sequence) and passing this rank's global positions: as
  ``position_ids`` when its forward takes them, else to the position ``nn.Embedding`` whose input is
  ``arange(local length)`` (our GPT's ``pos_emb(arange(T))``); a post-hook all-gathers the sequence outputs back
  into global order (backward: this rank's positions of the gradient, which every cp rank holds in full, since
  each computes the same loss on the same gathered output);
* ``torch.nn.functional.scaled_dot_product_attention`` is replaced while the transformer or one of its blocks
  runs (block hooks too: recompute re-runs a block alone in backward), restored after.

Each rank's parameter gradients are then its tokens' part of the loss's gradient: FSDP reduces them over the
data-parallel x cp ranks (``topology.mesh.MeshLayout.dp_mesh``), summed over cp and averaged over dp (divide factor ``dp``).

Real data (issue 18): a length ``2 * cp`` does not divide is zero-padded at its end before the split and the
padding dropped from the gathered outputs, where the attention is causal by itself in every block (a meta run,
``traced_attention``, recorded in the model's ``Capabilities.causal``): no real token sees a later one, so none sees the padding. A padding mask given as the
transformer's ``attention_mask`` is kept whole: each attention combines the position mask with the gathered
padding columns (``MaskAgreement``), after checking that the mask the model built from its local part equals it
on this rank's own keys.

What cannot be right is refused (``check_cp``, ``self_check``): MoE layers (their balance loss is not linear in
the tokens), a length ``2 * cp`` does not divide with attention not known to be causal, attention given a mask
other than causal + padding (one the model builds; left padding, where a query sees no key), an attention that is
not ``scaled_dot_product_attention`` in every block, and any model whose cp forward differs from its plain
forward on a short sequence (positions the runtime could not pass: RoPE from the sequence length).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.capabilities import Capabilities
from lightning_autopar.parallel.collectives import all_gather_along, reduce_scatter_along

if TYPE_CHECKING:
    from lightning_autopar.profile.analyze import ModelAnalysis


# ------------------------------------------------------------------------------------------- positions, chunks

def local_positions(seq: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """Global positions rank ``rank`` holds of a ``seq``-long sequence: chunks ``rank`` and ``2cp-1-rank`` of
    ``2cp`` (load balance of the causal mask: early and late tokens together)."""
    chunk = seq // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def gathered_positions(seq: int, cp: int, device: Any = None) -> torch.Tensor:
    """Global positions of a cp all-gather's result (the ranks' parts in rank order)."""
    return torch.cat([local_positions(seq, cp, r, device) for r in range(cp)])


def padded_length(seq: int, cp: int) -> int:
    """``seq`` rounded up to a multiple of ``2 * cp`` (the load-balanced chunks)."""
    return -(-seq // (2 * cp)) * (2 * cp)


@dataclass(frozen=True)
class CPGroup:
    """The cp process group and this rank's place in it."""

    group: Any
    size: int
    rank: int


class _AllGather(torch.autograd.Function):
    """All-gather ``x`` along ``dim`` over the cp group (ranks' parts in rank order). Backward: ``reduce`` --
    reduce-scatter the gradient (K/V: every rank's queries contributed) -- or this rank's part of a gradient
    every rank holds whole (the transformer's gathered output, the same loss computed on every cp rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, cp: CPGroup, reduce: bool) -> torch.Tensor:
        ctx.dim, ctx.cp, ctx.reduce = dim, cp, reduce
        return all_gather_along(x, dim, cp.group, cp.size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        cp, dim = ctx.cp, ctx.dim
        if ctx.reduce:
            return reduce_scatter_along(grad, dim, cp.group, cp.size), None, None, None
        return grad.chunk(cp.size, dim)[cp.rank], None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor`` (exact for the powers of two cp mostly is)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_grads(value: Any, factor: float) -> Any:
    """Every floating tensor in ``value`` with its gradient scaled by ``factor`` (values unchanged)."""
    def scale(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return _ScaleGrad.apply(x, factor)
        return x

    return tree_map(scale, value)


def all_gather_sequence(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    """This rank's part of a sequence tensor -> the whole sequence in global order (backward: this rank's part of
    the gradient every cp rank holds whole)."""
    seq = x.shape[dim] * cp.size
    order = torch.argsort(gathered_positions(seq, cp.size, x.device))
    return _AllGather.apply(x, dim, cp, False).index_select(dim, order)


def shard_sequence(x: torch.Tensor, dim: int, cp: CPGroup) -> torch.Tensor:
    """The whole sequence -> this rank's load-balanced part (``local_positions``)."""
    return x.index_select(dim, local_positions(x.shape[dim], cp.size, cp.rank, x.device))


# ------------------------------------------------------------------------------------------------- attention

def cp_attention(original: Callable[..., torch.Tensor], cp: CPGroup, model: str,
                 masks: MaskAgreement) -> Callable[..., torch.Tensor]:
    """``scaled_dot_product_attention`` over the cp group: K and V all-gathered along the sequence (dim -2);
    causal attention without a padding mask or dropout runs mask-free (``chunked_causal_attention``), the rest
    with the causal mask from global positions (query ``p`` sees key ``q`` iff ``p >= q``); GQA passed through.

    That mask is additive (0 / -inf) in the query's dtype, built once per (length, dtype, device) and shared by
    every layer and step: SDPA keeps the mask it is given for backward, so one tensor of
    ``seq / cp * seq`` elements is saved however many layers there are (the price of a mask-free kernel's
    absence: the causal flag alone cannot say which of the gathered keys a query sees).

    With a padding mask given to the transformer (``MaskAgreement.keys``), every call attends with the position
    mask (causal where the model's attention is) AND the gathered padding columns; the mask the model built from
    its local part of the padding mask must equal that on this rank's own keys (``MaskAgreement.verify``), else
    every cp rank refuses together."""
    causal_masks: dict[tuple, torch.Tensor] = {}

    def causal_mask(seq: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (seq, dtype, device)
        if key not in causal_masks:
            allowed = masks.allowed(seq, device, True)
            causal_masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
                ~allowed, float("-inf"))
        return causal_masks[key]

    @functools.wraps(original)
    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **kwargs: Any) -> Any:
        seq = checked_call(query, key, attn_mask, is_causal, cp, model, masks)
        key, value = same_heads_on_every_rank(query, key, value, masks, kwargs)
        keys = _AllGather.apply(key, key.dim() - 2, cp, True)
        values = _AllGather.apply(value, value.dim() - 2, cp, True)
        if masks.keys is None and is_causal and dropout_p == 0.0 and set(kwargs) <= {"enable_gqa"}:
            return chunked_causal_attention(query, keys, values, cp, scale)
        if masks.keys is not None:
            mask = masks.padded_mask(seq, query.dtype)
        else:
            mask = causal_mask(seq, query.dtype, query.device) if is_causal else None
        return original(query, keys, values, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale,
                        **kwargs)

    return sdpa



def checked_call(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                 cp: CPGroup, model: str, masks: MaskAgreement) -> int:
    """The whole sequence's length of this rank's attention call, after the refusals both cp flavours share
    (``cp_attention``, ``context_heads.heads_attention``): queries and keys of different lengths, and a mask no cp
    rank can apply (``MaskAgreement.verify``, agreed over the group so all refuse together)."""
    if query.shape[-2] != key.shape[-2]:
        raise ConfigError("plan.cp", f"{model}: an attention whose queries and keys differ in length "
                          "(cross-attention, a KV cache) cannot be split over the sequence", "use cp=1")
    seq = query.shape[-2] * cp.size
    why = masks.verify(attn_mask, is_causal, seq)
    if masks.any(why is not None, query.device):
        raise ConfigError("plan.cp", f"{model}: {why or 'another cp rank refused its attention mask'}, which a "
                          "sequence split over cp ranks cannot apply", "use cp=1")
    return seq


def same_heads_on_every_rank(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, masks: MaskAgreement,
                             kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with as many heads on every cp rank (both flavours exchange them): with a padding mask, the model
    may repeat K/V itself where it passes a mask, not where it passes none (Hugging Face), and the padding can
    vanish from one rank's part -- so GQA's K/V (``enable_gqa``, popped from ``kwargs``) are repeated to the
    query's head count on every rank."""
    if masks.keys is not None and kwargs.pop("enable_gqa", False):
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    return key, value


# ------------------------------------------------------------------------------------- mask-free causal attention

def chunk_slots(cp: int) -> list[int]:
    """The all-gather's slot of each global chunk, in global order: the sequence is ``2cp`` chunks, rank ``r``
    holds chunks ``r`` and ``2cp-1-r`` (``local_positions``) and the all-gather lays rank ``j``'s two chunks at
    slots ``2j`` and ``2j+1``."""
    return [2 * b if b < cp else 2 * (2 * cp - 1 - b) + 1 for b in range(2 * cp)]


def reorder_chunks(x: torch.Tensor, slots: list[int], chunk: int) -> torch.Tensor:
    """Chunks of ``x`` (dim -2) taken in the order ``slots``: one copy."""
    return torch.cat([x[..., s * chunk:(s + 1) * chunk, :] for s in slots], -2)


def _flash_cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_cpu_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float | None) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk pair in fp32 matmuls (devices without a log-sum-exp kernel here): the chunk's scores only."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return ((s - lse[..., None]).exp() @ v.float()).to(q.dtype), lse


def _math_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float | None) -> tuple[torch.Tensor, ...]:
    """FlashAttention's backward for one chunk pair from the merged output and log-sum-exp (Dao 2023, alg. 2):
    P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K * scale, dK = dS^T Q * scale."""
    factor = scale if scale is not None else q.shape[-1] ** -0.5
    p = (_scores(q, k, causal, scale) - lse[..., None]).exp()
    g = grad.float()
    ds = p * (g @ v.float().transpose(-1, -2) - (g * out.float()).sum(-1, keepdim=True))
    return ((ds @ k.float()) * factor).to(q.dtype), ((ds.transpose(-1, -2) @ q.float()) * factor).to(k.dtype), \
        (p.transpose(-1, -2) @ g).to(v.dtype)


def _chunk_kernels(device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The (forward, backward) of one query-chunk x key-chunk attention returning / taking the log-sum-exp: the
    CPU flash kernel, else exact fp32 math on the chunk pair."""
    return (_flash_cpu_forward, _flash_cpu_backward) if device.type == "cpu" else (_math_forward, _math_backward)


class _ChunkedCausalAttention(torch.autograd.Function):
    """Causal attention of this rank's two query chunks over the gathered K/V without a mask. K/V are put in
    global order once (``chunk_slots``); query chunk ``a`` (global) then sees the keys before chunk ``a`` whole
    (one unmasked kernel call on that prefix), chunk ``a`` causally (the diagonal block: equal lengths, so the
    kernel's own causal flag is exact) and no later key (skipped: the causal skip an explicit mask lacks). Each
    call returns its log-sum-exp and the two partial outputs are merged by it (Milakov & Gimelshein 2018; ring
    attention, Liu et al. 2023). Backward reruns each call's kernel backward with the merged output and
    log-sum-exp, which makes each call's gradient its exact share of the whole softmax's. Saved: q, the
    reordered k and v, the output and the log-sum-exp -- what one flash attention saves. GQA: k and v keep the
    model's K/V heads (saved so); each kernel call gets its keys repeated to the query heads, and their gradients
    are summed back per K/V head."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, rank: int,
                scale: float | None) -> torch.Tensor:
        chunk, rep = q.shape[-2] // 2, q.shape[-3] // k.shape[-3]
        slots = chunk_slots(cp)
        k, v = reorder_chunks(k, slots, chunk), reorder_chunks(v, slots, chunk)
        fwd, _ = _chunk_kernels(q.device)
        outs, lses = [], []
        for q_slot, a in enumerate((rank, 2 * cp - 1 - rank)):
            qc = q[..., q_slot * chunk:(q_slot + 1) * chunk, :]
            diag = slice(a * chunk, (a + 1) * chunk)
            out, lse = fwd(qc, _repeated(k[..., diag, :], rep), _repeated(v[..., diag, :], rep), True, scale)
            if a:  # merge: out = sum_i exp(lse_i - lse) out_i, lse = log sum_i exp(lse_i)
                o2, l2 = fwd(qc, _repeated(k[..., :a * chunk, :], rep), _repeated(v[..., :a * chunk, :], rep), False,
                             scale)
                l1, l2 = lse.float(), l2.float()
                lse = torch.logaddexp(l1, l2)
                out = (out.float() * (l1 - lse).exp()[..., None] + o2.float() * (l2 - lse).exp()[..., None]).to(q.dtype)
            outs.append(out)
            lses.append(lse.float())
        out, lse = torch.cat(outs, -2), torch.cat(lses, -1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.rank, ctx.scale = cp, rank, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        cp, chunk, rep = ctx.cp, q.shape[-2] // 2, q.shape[-3] // k.shape[-3]
        _, bwd = _chunk_kernels(q.device)
        grad = grad.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q_slot, a in enumerate((ctx.rank, 2 * cp - 1 - ctx.rank)):
            qs = slice(q_slot * chunk, (q_slot + 1) * chunk)
            g, qc, oc, lc = grad[..., qs, :], q[..., qs, :], out[..., qs, :], lse[..., qs].contiguous()
            diag = slice(a * chunk, (a + 1) * chunk)
            gq, gk, gv = bwd(g, qc, _repeated(k[..., diag, :], rep), _repeated(v[..., diag, :], rep), oc, lc, True,
                             ctx.scale)
            dq[..., qs, :] = gq
            dk[..., diag, :] += _summed(gk, rep)
            dv[..., diag, :] += _summed(gv, rep)
            if a:
                gq, gk, gv = bwd(g, qc, _repeated(k[..., :a * chunk, :], rep), _repeated(v[..., :a * chunk, :], rep),
                                 oc, lc, False, ctx.scale)
                dq[..., qs, :] += gq
                dk[..., :a * chunk, :] += _summed(gk, rep)
                dv[..., :a * chunk, :] += _summed(gv, rep)
        # back to the all-gather's order: gathered slot s holds global chunk order[s]
        order = sorted(range(2 * cp), key=chunk_slots(cp).__getitem__)
        return dq, reorder_chunks(dk, order, chunk), reorder_chunks(dv, order, chunk), None, None, None


def _repeated(t: torch.Tensor, rep: int) -> torch.Tensor:
    """GQA's K or V heads repeated to the query heads (head i of the result is K/V head i // rep)."""
    return t if rep == 1 else t.repeat_interleave(rep, -3)


def _summed(grad: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of ``_repeated``: each K/V head's repeats summed."""
    if rep == 1:
        return grad
    *lead, heads, length, dim = grad.shape
    return grad.reshape(*lead, heads // rep, rep, length, dim).sum(-3)


def chunked_causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cp: CPGroup,
                             scale: float | None) -> torch.Tensor:
    """Mask-free causal attention of this rank's queries over the gathered K/V (GQA: the gather and what the
    attention keeps for backward are the model's own K/V heads; each kernel call repeats them to the query
    heads)."""
    return _ChunkedCausalAttention.apply(query, keys, values, cp.size, cp.rank, scale)


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """A boolean / additive attention mask as "query may see key" (None: an additive mask with values other than
    0 and -inf, a bias that cannot be rebuilt from positions and padding)."""
    if mask.dtype == torch.bool:
        return mask
    allowed, blocked = mask == 0, mask <= torch.finfo(mask.dtype).min / 2
    return allowed if bool((allowed | blocked).all()) else None


@dataclass
class MaskAgreement:
    """The attention masks of one transformer forward on this cp rank: the padding mask given to the transformer
    (``keys``: which keys are real, [B, S] in the all-gather's order; None without one) and whether any cp rank's
    attention got a mask it cannot apply, agreed once per forward (a one-element all-reduce: ranks that refused
    alone would leave the others waiting in the K/V all-gather)."""

    cp: CPGroup
    causal: bool = False  # the model's attention is causal by itself (a meta run: ``attention_calls``)
    agreed: bool | None = None  # None: not yet agreed in this forward
    keys: torch.Tensor | None = None
    built: dict[tuple, torch.Tensor] = field(default_factory=dict)  # this forward's masks (SDPA saves them)

    def start(self, keys: torch.Tensor | None) -> None:
        """A new transformer forward, with the padding mask's key columns (gathered order) or None."""
        self.agreed, self.keys, self.built = None, keys, {}

    def any(self, mine: bool, device: torch.device) -> bool:
        import torch.distributed as dist

        if self.agreed is None:
            flag = torch.tensor([float(mine)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.cp.group)
            self.agreed = bool(flag.item())
        return self.agreed or mine

    def allowed(self, seq: int, device: torch.device, causal: bool) -> torch.Tensor:
        """[S/cp, S] "this rank's query sees the gathered key": by global position when ``causal``, else all."""
        q_pos = local_positions(seq, self.cp.size, self.cp.rank, device)
        k_pos = gathered_positions(seq, self.cp.size, device)
        if not causal:
            return torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=device)
        return q_pos[:, None] >= k_pos[None, :]

    def padded_bool(self, seq: int, device: torch.device) -> torch.Tensor:
        """[B, 1, S/cp, S]: the position mask and the padding mask's key columns."""
        return self.allowed(seq, device, self.causal)[None, None] & self.keys[:, None, None, :].to(device)

    def padded_mask(self, seq: int, dtype: torch.dtype) -> torch.Tensor:
        key = (seq, dtype)
        if key not in self.built:
            allowed = self.padded_bool(seq, self.keys.device)
            self.built[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self.built[key]

    def verify(self, mask: torch.Tensor | None, is_causal: bool, seq: int) -> str | None:
        """Why this call's (``mask``, ``is_causal``) is not what the wrapper applies (None: it is). Without a
        padding mask: a mask at all. With one: the mask the model built from its local part of the sequence must
        be the position mask and the padding columns on this rank's own keys (no mask: the call causal by itself
        exactly when the model's attention was found to be), and every query must see some key (left padding
        leaves early padded queries none, which one device handles its own way)."""
        if mask is None and self.keys is None:
            return None
        if self.keys is None:
            return "the attention was given a mask (one the model builds, not a padding mask the transformer got)"
        full = self.padded_bool(seq, self.keys.device)
        if not bool(full.any(-1).all()):
            return "the attention was given a mask under which a query sees no key (left padding)"
        if mask is None:
            return None if is_causal == self.causal else "the attention's causal flag differs from its meta run"
        allowed, local = _allowed(mask), seq // self.cp.size
        want = full[..., self.cp.rank * local:(self.cp.rank + 1) * local].to(mask.device)
        try:
            shape = torch.broadcast_shapes(allowed.shape, want.shape) if allowed is not None else None
        except RuntimeError:
            shape = None
        if is_causal or shape is None or not torch.equal(allowed.expand(shape), want.expand(shape)):
            return "the attention mask is not the causal mask combined with the padding mask"
        return None


@dataclass
class _Patch:
    """``F.scaled_dot_product_attention`` replaced while any hooked module runs (a depth count: the transformer
    and its blocks nest; recompute re-runs a block alone), the original restored when the outermost ends.
    Thread-unsafe, like the module hooks that drive it."""

    replacement: Callable[..., Any]
    depth: int = 0
    original: Callable[..., Any] | None = None

    def enter(self) -> None:
        if self.depth == 0:
            self.original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = self.replacement
        self.depth += 1

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            F.scaled_dot_product_attention = self.original


# ---------------------------------------------------------------------------------------------- the hooks

@dataclass(eq=False)
class ContextParallel:
    """The cp hooks of one transformer; ``enabled`` False runs it as without them (the self-check)."""

    cp: CPGroup
    model: str
    patch: _Patch
    masks: MaskAgreement
    forward: Callable[..., Any]  # the transformer's forward: which inputs it takes
    enabled: bool = True
    positions: torch.Tensor | None = None  # this rank's global positions during a forward (position embeddings)
    length: int = 0  # the real sequence length of this forward (before padding)
    after: bool = False  # the transformer's output was gathered: what runs now runs on every cp rank alike
    inputs: set[int] = field(default_factory=set)  # ids of the sharded inputs: never taken for positions
    handles: list[Any] = field(default_factory=list)  # the hooks installed (removable)

    def shard_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Shard every tensor with the sequence in dim 1 (padded at the end to a multiple of ``2 * cp`` first,
        where the attention is causal: ``check_length``); positions passed as ``position_ids`` or kept for the
        position embeddings; a padding mask given as the forward's ``attention_mask`` kept whole for the
        attention (``MaskAgreement``)."""
        seq = sequence_of(args, kwargs)
        if seq is None:
            raise ConfigError("plan.cp", f"{self.model}: no sequence input (a tensor of 2+ dims) to split",
                              "use cp=1")
        check_length(self.model, seq, self.cp.size, self.masks.causal)
        padded = padded_length(seq, self.cp.size)
        given = _given(self.forward, "attention_mask", args, kwargs)

        def shard(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq:
                return shard_sequence(_pad_sequence(x, padded), 1, self.cp)
            return x

        keys = None
        if isinstance(given, torch.Tensor) and given.dim() == 2 and given.shape[1] == seq:
            order = gathered_positions(padded, self.cp.size, given.device)
            keys = _pad_sequence(given, padded).bool().index_select(1, order)
        args, kwargs = tree_map(shard, args), tree_map(shard, kwargs)
        self.masks.start(keys)
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.inputs = {id(t) for t in leaves}
        device = leaves[0].device
        # padded tokens take the last real position (a position table sized to the real length fits): causal
        # attention never shows them to a real token, whose mask is built from the padded order
        self.positions = local_positions(padded, self.cp.size, self.cp.rank, device).clamp(max=seq - 1)
        self.length = seq
        rows = leaves[0].shape[0]
        if _unset(self.forward, "position_ids", args, kwargs):
            kwargs = {**kwargs, "position_ids": self.positions[None].expand(rows, -1)}
            if _unset(self.forward, "attention_mask", args, kwargs):
                # an explicit no-padding mask: Hugging Face reads position ids with a jump (the second chunk) as
                # packed sequences when none is given, and would mask attention across them
                kwargs["attention_mask"] = torch.ones((rows, self.positions.numel()), dtype=torch.long,
                                                      device=device)
        return args, kwargs

    def gather_outputs(self, output: Any) -> Any:
        """Sequence outputs gathered back into global order, the padding (if any) dropped: the real length."""
        seq_local = self.positions.numel()

        def gather(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq_local:
                whole = all_gather_sequence(x, 1, self.cp)  # a view would not be a stage's own output
                return whole if whole.shape[1] == self.length else whole[:, :self.length].contiguous()
            return x

        return tree_map(gather, output)

    def global_positions(self, index: torch.Tensor) -> torch.Tensor | None:
        """A position embedding's input ``arange(local length)`` -> this rank's global positions (None: not)."""
        pos = self.positions
        if pos is None or id(index) in self.inputs or index.dtype not in (torch.int32, torch.int64):
            return None
        flat = index.reshape(-1)
        if flat.numel() != pos.numel() or index.dim() > 2 or (index.dim() == 2 and index.shape[0] != 1):
            return None
        if not torch.equal(flat, torch.arange(pos.numel(), device=flat.device, dtype=flat.dtype)):
            return None
        return pos.to(index.dtype).reshape(index.shape)


_INSTALLED: weakref.WeakSet = weakref.WeakSet()  # every ContextParallel of this process (``hooks_off``)


@contextmanager
def hooks_off() -> Iterator[None]:
    """The cp hooks idle: a call whose inputs are only captured, not run (the pipeline's capture of the user's
    model call; the stages then call the model with them and the hooks split them once)."""
    states = [s for s in _INSTALLED if s.enabled]
    for state in states:
        state.enabled = False
    try:
        yield
    finally:
        for state in states:
            state.enabled = True


def sequence_of(args: tuple, kwargs: dict) -> int | None:
    """The sequence length: dim 1 of the first tensor input with two or more dims (token ids)."""
    return next((int(t.shape[1]) for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and t.dim() >= 2), None)


def check_length(model: str, seq: int, cp: int, causal: bool) -> None:
    """A ``seq``-long sequence splits into ``2 * cp`` equal chunks, or is padded at its end to do so: exact only
    where the attention is causal (no real token sees the padding), known from a meta run (``attention_calls``)."""
    if seq % (2 * cp) and not causal:
        raise ConfigError("plan.cp", f"{model}: sequence length {seq} is not a multiple of 2*cp = {2 * cp}, and "
                          "padding it is exact only for causal attention (this model's is not, or not known to be)",
                          f"use a sequence length that is a multiple of {2 * cp}, or cp=1")


def priced_length(causal: bool | None, name: str, seq: int, cp: int) -> int:
    """The length a plan with a fixed ``cp`` runs the model at (what the planner prices): ``seq`` padded to a
    multiple of ``2 * cp`` where ``check_cp`` found its attention causal (``causal``: the model's
    ``Capabilities.causal``, None where it was not traced); one ConfigError (``check_length``) where the length
    cannot be padded, before the planner's own divisibility check."""
    if cp <= 1 or causal is None:
        return seq
    check_length(name, seq, cp, causal)
    return padded_length(seq, cp)


def _pad_sequence(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` zero-padded at the end of dim 1 to ``length`` (unchanged when it has that length)."""
    if x.shape[1] == length:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))], 1)


def _given(forward: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> Any:
    """The value this call passes for ``forward``'s input ``name`` (None when not passed or not taken)."""
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None
    if name in kwargs:
        return kwargs[name]
    index = params.index(name) if name in params else len(args)
    return args[index] if index < len(args) else None


def _unset(forward: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> bool:
    """``forward`` takes input ``name`` and this call leaves it None (neither positional nor keyword)."""
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return False
    return name in params and params.index(name) >= len(args) and kwargs.get(name) is None


def apply_context_parallel(transformer: nn.Module, blocks: list[nn.Module], cp_group: Any, model: str,
                           root: nn.Module | None = None, causal: bool = False,
                           attention: Callable[..., Callable[..., torch.Tensor]] | None = None) -> ContextParallel:
    """Install the cp hooks on ``transformer`` (sequence in/out, positions), on ``blocks`` (attention) and on the
    modules of ``root`` outside the transformer that own parameters (``replicated_modules``). ``causal``: the
    attention is causal by itself in every block (``Capabilities.causal``, from ``check_cp``). ``attention``: the
    flavour, ``(original sdpa, CPGroup, model, MaskAgreement) -> sdpa`` -- ``cp_attention`` (K/V all-gathered,
    the default) or ``context_heads.heads_attention`` (all-to-all over heads, ``plan.cp_kind="heads"``)."""
    import torch.distributed as dist

    cp = CPGroup(cp_group, dist.get_world_size(cp_group), dist.get_rank(cp_group))
    masks = MaskAgreement(cp, causal=causal)
    patch = _Patch((attention or cp_attention)(F.scaled_dot_product_attention, cp, model, masks))
    state = ContextParallel(cp, model, patch, masks, transformer.forward)
    _INSTALLED.add(state)

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not state.enabled:
            return None
        sharded = state.shard_inputs(args, kwargs)
        state.after = False
        patch.enter()
        return sharded

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not state.enabled:
            return None
        patch.exit()
        state.after = True
        return state.gather_outputs(output)

    def embedding_pre(module: nn.Module, args: tuple) -> tuple | None:
        if not state.enabled or not args or not isinstance(args[0], torch.Tensor):
            return None
        pos = state.global_positions(args[0])
        return None if pos is None else (pos, *args[1:])

    def block_pre(module: nn.Module, args: tuple) -> None:
        if state.enabled:
            patch.enter()

    def block_post(module: nn.Module, args: tuple, output: Any) -> None:
        if state.enabled:
            patch.exit()

    handles = state.handles
    handles.append(transformer.register_forward_pre_hook(pre, with_kwargs=True))
    handles.append(transformer.register_forward_hook(post, with_kwargs=True, always_call=True))
    handles += [m.register_forward_pre_hook(embedding_pre) for m in transformer.modules() if isinstance(m, nn.Embedding)]
    for block in blocks:
        handles.append(block.register_forward_pre_hook(block_pre))
        handles.append(block.register_forward_hook(block_post, always_call=True))
    for module in replicated_modules(root, transformer, model) if root is not None else []:
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k: (scale_grads(a, cp.size), scale_grads(k, cp.size)) if state.enabled and state.after
            else None, with_kwargs=True))
        handles.append(module.register_forward_hook(
            lambda m, a, out: scale_grads(out, 1.0 / cp.size) if state.enabled and state.after else None))
    return state


def replicated_modules(root: nn.Module, transformer: nn.Module, model: str) -> list[nn.Module]:
    """Modules of ``root`` outside ``transformer`` owning parameters (an LM head outside a Hugging Face inner
    model). Run on the gathered sequence, they compute their parameters' whole gradient on every cp rank, which
    the reduction then sums over cp: while they run after the transformer their output gradient is scaled by
    1/cp and their input gradient by cp back (a module's backward is linear in its output gradient), so their
    parameters get 1/cp of it on each rank and what flows back stays whole; a tie with a parameter inside the
    transformer (summed partials) then adds up right too. A module that owns parameters and calls the
    transformer (an ancestor) cannot be scaled that way: refused."""
    inside = {id(m) for m in transformer.modules()}
    ancestors = {id(m) for m in root.modules() if any(c is transformer for c in m.modules()) and m is not transformer}
    out = []
    for name, module in root.named_modules():
        if id(module) in inside or not any(True for _ in module.parameters(recurse=False)):
            continue
        if id(module) in ancestors:
            raise ConfigError("plan.cp", f"{model}: '{name or type(root).__name__}' owns parameters and calls the "
                              "transformer, so cp cannot tell their sequence part", "use cp=1")
        out.append(module)
    return out


# ------------------------------------------------------------------------------------------------ the checks

def check_cp(analysis: ModelAnalysis, transformer: nn.Module, cp: int, compile: bool = False,
             capabilities: Capabilities | None = None) -> None:
    """Raise one ConfigError ("plan.cp") when cp > 1 cannot be applied to this model: unit form, MoE layers,
    compile with it (compiled blocks would trace the attention replaced at run time), a block whose attention does
    not call ``scaled_dot_product_attention`` (``traced_attention``: one meta run on token ids per model, which also
    records in ``capabilities.causal`` whether every call is causal by itself), or a sequence length ``2 * cp``
    does not divide where that is not causal (``check_length``). Sequence parallelism composes: it splits this
    rank's part further over tp. ``capabilities``: the model's record (a throwaway one when None)."""
    from lightning_autopar.planner.space import context_compile_rule
    from lightning_autopar.profile.analyze import implements_forward

    if cp <= 1:
        return
    name = analysis.spec.name
    if analysis.spec.unit_form:
        raise ConfigError("plan.cp", f"{name}: not a transformer on token ids, no sequence to split", "use cp=1")
    if any(b.moe is not None for b in analysis.blocks):
        raise ConfigError("plan.cp", f"{name}: MoE layers (their balance loss is not a sum over tokens, and "
                          "expert gradients are reduced over expert groups without cp)", "use cp=1")
    why = context_compile_rule(cp, compile)
    if why:
        raise ConfigError("plan.cp", f"{name}: {why}", "use compile=false, or cp=1")
    if not implements_forward(transformer):
        raise ConfigError("plan.cp", f"{name}: its embeddings and blocks are not one module whose forward runs "
                          f"({type(transformer).__name__}), so the sequence and its positions cannot be split there",
                          "use cp=1")
    caps = capabilities if capabilities is not None else Capabilities.of(analysis)
    fqns = [b.fqn for b in analysis.blocks]
    calls = traced_attention(transformer, fqns, caps)
    missing = [] if calls is None else [f for f in fqns if f not in calls]
    if missing:
        raise ConfigError("plan.cp", f"{name}: block '{missing[0]}' does not call scaled_dot_product_attention, "
                          "the attention cp splits", "use cp=1 (or the model's SDPA attention)")
    caps.causal = causal_blocks(calls, fqns)
    check_length(name, analysis.spec.seq_len, cp, caps.causal)


# the length of the meta run that finds each block's attention calls (``traced_attention``): a few tokens (> 1:
# Hugging Face's attention sets is_causal only for more than one query), whatever the degree checked
ATTENTION_SEQ = 8


def traced_attention(transformer: nn.Module, block_fqns: list[str],
                     capabilities: Capabilities) -> dict[str, list[bool]] | None:
    """``attention_calls`` of ``transformer`` on ``ATTENTION_SEQ`` tokens, run once per model (its
    ``capabilities``): the cp check and SP's padding rule both read it."""
    return capabilities.memo("attention calls", lambda: attention_calls(transformer, block_fqns, ATTENTION_SEQ))


def causal_blocks(calls: dict[str, list[bool]] | None, block_fqns: list[str]) -> bool:
    """Every block of ``block_fqns`` calls SDPA, each call causal by itself (``calls``: ``attention_calls``)."""
    return calls is not None and all(calls.get(f) and all(calls[f]) for f in block_fqns)


def attention_calls(transformer: nn.Module, block_fqns: list[str], seq: int) -> dict[str, list[bool]] | None:
    """Per block, whether each ``F.scaled_dot_product_attention`` call of its forward is causal by itself, in a
    meta run on ``seq`` token ids (blocks that call none are absent; None: the model does not run on meta
    tensors, so the live check decides): ``profile.trace.meta_forward`` with its ``AttentionCalls`` recorder."""
    from lightning_autopar.profile.trace import AttentionCalls, meta_forward, token_ids

    blocks = {fqn: transformer.get_submodule(fqn) for fqn in block_fqns}
    trace = meta_forward(transformer, token_ids(1, seq), [AttentionCalls(blocks)], grad=False)
    return None if trace.failure is not None else trace.sdpa


def self_check(transformer: nn.Module, state: ContextParallel, vocab: int, seq_len: int) -> None:
    """Run the transformer on a short sequence with the cp hooks and without, on every cp rank; a difference
    (positions the runtime could not pass, attention it does not see) raises one ConfigError on every rank."""
    import torch.distributed as dist

    cp = state.cp.size
    seq = 2 * cp * max(1, min(2, seq_len // (2 * cp)))
    device = next((p.device for p in transformer.parameters()), torch.device("cpu"))
    ids = torch.randint(0, max(1, vocab), (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    modes = {m: m.training for m in transformer.modules()}
    transformer.eval()
    try:
        with torch.no_grad():
            split = _first_tensor(transformer(ids))
            state.enabled = False
            try:
                plain = _first_tensor(transformer(ids))
            finally:
                state.enabled = True
    finally:
        for m, mode in modes.items():
            m.training = mode
    bad = torch.tensor([0.0 if split.shape == plain.shape and torch.allclose(split, plain, rtol=1e-4, atol=1e-5)
                        else 1.0], device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=state.cp.group)
    if bad.item():
        raise ConfigError("plan.cp", f"{state.model}: its forward split over the sequence differs from the plain "
                          "forward (positions computed from the sequence length, or an attention cp does not "
                          "see)", "use cp=1")


def _first_tensor(output: Any) -> torch.Tensor:
    return next(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))

