"""Context parallelism (cp): the sequence split over the ranks of a cp group, from collectives that run on gloo.

All-gather based CP, as Llama 3 trains long contexts (Dubey et al. 2024, "The Llama 3 Herd of Models", sec.
3.3.2): each rank keeps a load-balanced part of the sequence -- the sequence cut into ``2 * cp`` chunks, rank
``i`` holding chunks ``i`` and ``2cp - 1 - i`` (so every rank gets the same share of the causal mask's work) --
and each attention all-gathers K and V along the sequence (backward: their gradients reduce-scattered), then runs
the model's own ``scaled_dot_product_attention`` with an explicit mask built from global positions.

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
data-parallel x cp ranks (``data_mesh``), summed over cp and averaged over dp (divide factor ``dp``).

What cannot be right is refused (``check_cp``, ``self_check``): MoE layers (their balance loss is not linear in
the tokens), a sequence not split in ``2 * cp`` equal chunks, attention given a mask (padding), an attention
that is not ``scaled_dot_product_attention`` in every block, and any model whose cp forward differs from its
plain forward on a short sequence (positions the runtime could not pass: RoPE from the sequence length).
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
from lightning_autopar.parallel.collectives import all_gather_along, reduce_scatter_along

if TYPE_CHECKING:
    from lightning_autopar.profile.analyze import ModelAnalysis
    from lightning_autopar.specs import Plan
    from lightning_autopar.topology.mesh import MeshLayout


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
    """``scaled_dot_product_attention`` over the cp group: K and V all-gathered along the sequence (dim -2), the
    causal mask from global positions (query ``p`` sees key ``q`` iff ``p >= q``); GQA passed through.

    The mask is additive (0 / -inf) in the query's dtype, built once per (length, dtype, device) and shared by
    every layer and step: SDPA keeps the mask it is given for backward, so one tensor of
    ``seq / cp * seq`` elements is saved however many layers there are (the price of a mask-free kernel's
    absence: the causal flag alone cannot say which of the gathered keys a query sees)."""
    causal_masks: dict[tuple, torch.Tensor] = {}

    def causal_mask(seq: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (seq, dtype, device)
        if key not in causal_masks:
            q_pos = local_positions(seq, cp.size, cp.rank, device)
            allowed = q_pos[:, None] >= gathered_positions(seq, cp.size, device)[None, :]
            causal_masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
                ~allowed, float("-inf"))
        return causal_masks[key]

    @functools.wraps(original)
    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **kwargs: Any) -> Any:
        if masks.any(attn_mask is not None, query.device):
            raise ConfigError("plan.cp", f"{model}: the attention was given a mask (padding, or a mask the model "
                              "builds), which a sequence split over ranks cannot apply", "use cp=1")
        if query.shape[-2] != key.shape[-2]:
            raise ConfigError("plan.cp", f"{model}: an attention whose queries and keys differ in length "
                              "(cross-attention, a KV cache) cannot be split over the sequence", "use cp=1")
        keys = _AllGather.apply(key, key.dim() - 2, cp, True)
        values = _AllGather.apply(value, value.dim() - 2, cp, True)
        mask = causal_mask(query.shape[-2] * cp.size, query.dtype, query.device) if is_causal else None
        return original(query, keys, values, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale,
                        **kwargs)

    return sdpa


@dataclass
class MaskAgreement:
    """Whether any cp rank's attention got a mask, agreed once per transformer forward (a one-element all-reduce):
    a padding mask can vanish from one rank's part of the sequence (all ones there), and ranks that refused alone
    would leave the others waiting in the K/V all-gather."""

    cp: CPGroup
    agreed: bool | None = None  # None: not yet agreed in this forward

    def any(self, mine: bool, device: torch.device) -> bool:
        import torch.distributed as dist

        if self.agreed is None:
            flag = torch.tensor([float(mine)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.cp.group)
            self.agreed = bool(flag.item())
        return self.agreed or mine


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
    after: bool = False  # the transformer's output was gathered: what runs now runs on every cp rank alike
    inputs: set[int] = field(default_factory=set)  # ids of the sharded inputs: never taken for positions
    handles: list[Any] = field(default_factory=list)  # the hooks installed (removable)

    def shard_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Shard every tensor with the sequence in dim 1; positions passed as ``position_ids`` or kept for the
        position embeddings."""
        seq = sequence_of(args, kwargs)
        if seq is None:
            raise ConfigError("plan.cp", f"{self.model}: no sequence input (a tensor of 2+ dims) to split",
                              "use cp=1")
        check_divisible(self.model, seq, self.cp.size)

        def shard(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq:
                return shard_sequence(x, 1, self.cp)
            return x

        args, kwargs = tree_map(shard, args), tree_map(shard, kwargs)
        self.masks.agreed = None
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.inputs = {id(t) for t in leaves}
        device = leaves[0].device
        self.positions = local_positions(seq, self.cp.size, self.cp.rank, device)
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
        seq_local = self.positions.numel()

        def gather(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == seq_local:
                return all_gather_sequence(x, 1, self.cp)
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


def check_divisible(model: str, seq: int, cp: int) -> None:
    if seq % (2 * cp):
        raise ConfigError("plan.cp", f"{model}: sequence length {seq} does not split into 2*cp = {2 * cp} equal "
                          "chunks (the load-balanced layout)", f"use a sequence length divisible by {2 * cp}, or cp=1")


def _unset(forward: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> bool:
    """``forward`` takes input ``name`` and this call leaves it None (neither positional nor keyword)."""
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return False
    return name in params and params.index(name) >= len(args) and kwargs.get(name) is None


def apply_context_parallel(transformer: nn.Module, blocks: list[nn.Module], cp_group: Any, model: str,
                           root: nn.Module | None = None) -> ContextParallel:
    """Install the cp hooks on ``transformer`` (sequence in/out, positions), on ``blocks`` (attention) and on the
    modules of ``root`` outside the transformer that own parameters (``replicated_modules``)."""
    import torch.distributed as dist

    cp = CPGroup(cp_group, dist.get_world_size(cp_group), dist.get_rank(cp_group))
    masks = MaskAgreement(cp)
    patch = _Patch(cp_attention(F.scaled_dot_product_attention, cp, model, masks))
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

def check_cp(analysis: ModelAnalysis, transformer: nn.Module, cp: int, compile: bool = False) -> None:
    """Raise one ConfigError ("plan.cp") when cp > 1 cannot be applied to this model: unit form, MoE layers,
    a sequence length not split into ``2 * cp`` chunks, compile with it (compiled blocks would trace the
    attention replaced at run time), or a block whose attention does not call ``scaled_dot_product_attention``
    (a meta run on token ids). Sequence parallelism composes: it splits this rank's part further over tp."""
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
    check_divisible(name, analysis.spec.seq_len, cp)
    missing = _blocks_without_sdpa(transformer, [b.fqn for b in analysis.blocks], 2 * cp)
    if missing:
        raise ConfigError("plan.cp", f"{name}: block '{missing[0]}' does not call scaled_dot_product_attention, "
                          "the attention cp splits", "use cp=1 (or the model's SDPA attention)")


def _blocks_without_sdpa(transformer: nn.Module, block_fqns: list[str], seq: int) -> list[str]:
    """Blocks whose forward did not call ``F.scaled_dot_product_attention`` in a meta run on ``seq`` token ids."""
    from torch.func import functional_call

    from lightning_autopar.profile.analyze import meta_buffer

    called: set[str] = set()
    current: list[str] = []
    original = F.scaled_dot_product_attention

    def counting(*args: Any, **kwargs: Any) -> Any:
        if current:
            called.add(current[-1])
        return original(*args, **kwargs)

    def enter(fqn: str) -> Callable[..., None]:
        return lambda module, args: current.append(fqn)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        current.pop()

    handles = []
    for fqn in block_fqns:
        block = transformer.get_submodule(fqn)
        handles.append(block.register_forward_pre_hook(enter(fqn)))
        handles.append(block.register_forward_hook(leave, always_call=True))
    state = {n: torch.empty_like(p, device="meta") for n, p in transformer.named_parameters()}
    state.update({n: meta_buffer(b) for n, b in transformer.named_buffers()})
    F.scaled_dot_product_attention = counting
    try:
        with torch.no_grad():
            functional_call(transformer, state, (torch.zeros((1, seq), dtype=torch.long, device="meta"),))
    except Exception:  # noqa: BLE001 -- a model that cannot run on meta tensors: the live check decides
        return []
    finally:
        F.scaled_dot_product_attention = original
        for h in handles:
            h.remove()
    return [f for f in block_fqns if f not in called]


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


def data_mesh(layout: MeshLayout, plan: Plan) -> Any:
    """The mesh FSDP reduces gradients over with cp: data-parallel x cp ranks (torchtitan's ``dp_shard_cp``),
    parameters sharded over dp_shard x cp; 2-D (replicate, shard x cp) when dp replicates (HSDP, zero=0)."""
    mesh = layout.mesh
    if "dp_shard_cp" not in mesh._flatten_mapping:  # a root mesh flattens a name once
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if plan.shard_size < plan.dp:
        return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]
