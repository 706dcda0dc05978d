"""Sequence parallelism on top of tensor parallelism (Megatron SP, Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"), on local tensors, for ``plan.sp`` with tp > 1.

Between the TP regions each TP rank holds only its chunk of the sequence (dim 1 of batch-first [B, S, H] hidden
states), so the activations of norms, residual adds and dropout are divided by tp:

* each run of consecutive blocks present on this rank (with PP: each contiguous run of each chunk) scatters its
  hidden-state input along S at its first block (backward: all-gather of the gradients) and all-gathers its output
  at its last block (backward: this rank's chunk of the TP-replicated gradient). Between pipeline stages the
  sequence stays split: a non-last chunk sends its output as this rank's chunk and the next one takes it as such
  (Megatron-LM's p2p of the sequence shard, 1/tp of the bytes; ``StageEdges``). Other block arguments (masks,
  rotary cos/sin, position ids) stay whole;
* the attention module and a dense MLP module all-gather their hidden-state input (backward: reduce-scatter,
  summing the column projections' partial input gradients, which then run without Megatron's f). Their column
  projections save this rank's chunk of it, not the gathered sequence, and gather it again in backward
  (``tp_comm.ColumnFromChunk``, Megatron's; not in a recomputed block, whose recompute gathers it anyway); their row
  projection reduce-scatters its output along S instead of all-reducing it (``tp_comm.row_output_sp``), its bias
  added on this rank's tokens. Same traffic as TP's two all-reduces (all-reduce = reduce-scatter + all-gather);
* an MoE module gathers the sequence at entry (backward: this rank's chunk; inside, the experts' TP f/g leave the
  gradients TP-replicated) and keeps this rank's chunk of its output (backward: all-gather): the router sees the
  whole sequence, so routing and balance losses are those of one device;
* parameters outside those modules (norms, anything else in the block) see only this rank's tokens: while their
  module runs they are swapped for ``CopyToTP`` of themselves (identity forward, gradient summed over the TP group
  backward). The swap happens in the owning module's own hooks, after FSDP2 has put its unsharded parameters in
  place (FSDP unshards in the block's pre-hook); a recompute re-runs the hooks with the forward.

The stack's output is gathered, so the final norm, the head and the loss run on the whole sequence (a loss over the
sharded sequence is not done). A length tp does not divide is zero-padded at its end where a run scatters and the
padding dropped where it gathers, when that is exact (``check_length``, decided in ``check_sp``: attention causal
by itself in every block, no MoE router to see the padding, no other block input spanning the sequence). ``check_sp`` decides from what the code does whether a block allows this: a meta
dry run of a block with these hooks simulated shape-wise must give the block's output [B, S/tp, H] -- a BERT-style
post-norm module adding the residual inside (its output module takes the attention's input) fails it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.capabilities import NOT_CHECKED, Capabilities
from lightning_autopar.parallel.dtensor_private import own_parameters
from lightning_autopar.parallel.tensor import join_path
from lightning_autopar.parallel.recompute import recomputed
from lightning_autopar.parallel.tp_comm import (GatherSeq, SeqChunk, SeqComm, SplitSeq, row_output_sp,
                                               sum_grads_post, sum_grads_pre)
from lightning_autopar.profile.analyze import BlockInfo, ModelAnalysis

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_autopar.specs import Plan
    from torch.utils.hooks import RemovableHandle


@dataclass
class _SeqState:
    """Shared by one model's SP hooks: ``local`` is this rank's sequence length and ``length`` the real one, set
    where a run scatters; ``unpaddable`` why a length tp does not divide cannot be padded ('' where it can)."""

    comm: SeqComm
    hidden: int
    unpaddable: str = NOT_CHECKED
    local: int = 0
    length: int = 0


def _is_hidden(t: Any, state: _SeqState, length: int | None) -> bool:
    """``t`` is hidden states [B, length, H] (any length when None)."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 3 and t.shape[-1] == state.hidden
            and (length is None or t.shape[1] == length))


def _map_hidden(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], test: Callable[[Any], bool]) -> Any:
    """``value`` (a tensor, or a tuple / list of them, one level) with ``fn`` applied to the tensors ``test`` picks."""
    if isinstance(value, (tuple, list)):
        return type(value)(fn(v) if test(v) else v for v in value)
    return fn(value) if test(value) else value


def _map_call(args: tuple, kwargs: dict, fn: Callable, test: Callable[[Any], bool]) -> tuple[tuple, dict]:
    return tuple(fn(a) if test(a) else a for a in args), {k: fn(v) if test(v) else v for k, v in kwargs.items()}


# ------------------------------------------------------------------------------------------- hooks


def _scatter_hook(state: _SeqState, where: str) -> Callable:
    """First block of a run: its whole-sequence hidden-state input -> this rank's chunk, zero-padded at the end to
    a multiple of tp first where that is exact (``check_length``). The chunk is tagged, so the re-run of a
    recomputed block (called again with its chunked input) leaves it alone. (A run whose input is the previous
    pipeline stage's output, already this rank's chunk: ``_received_hook``.)"""

    def split(t: torch.Tensor) -> torch.Tensor:
        seq, tp = t.shape[1], state.comm.tp
        state.length, state.local = seq, -(-seq // tp)
        if seq % tp:
            t = torch.cat([t, t.new_zeros((t.shape[0], state.local * tp - seq, t.shape[2]))], 1)
        out = SplitSeq.apply(t, state.comm, False)
        out._autopar_sp_local = True
        return out

    test = (lambda t: _is_hidden(t, state, None) and not getattr(t, "_autopar_sp_local", False))

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = next((t for t in tree_flatten((args, kwargs))[0] if test(t)), None)
        if hidden is not None and hidden.shape[1] % state.comm.tp:
            check_length(where, hidden.shape[1], state.comm.tp, state.unpaddable or _spanning(args, kwargs, hidden))
        return _map_call(args, kwargs, split, test)

    return hook


def _received_hook(state: _SeqState) -> Callable:
    """First block of a non-first pipeline chunk: the received activation is this rank's sequence chunk (the
    previous stage sent its run's output split: Megatron's p2p of the sequence shard under SP, 1/tp of the
    bytes); only the lengths are set, the whole one from the hidden state the activation stands for (what the
    stage computed before its blocks: ``pipeline.standins.STANDS_FOR``). A recompute, outside the stage's
    forward, keeps the lengths its forward set."""
    from lightning_autopar.parallel.pipeline.standins import STANDS_FOR

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = next((t for t in tree_flatten((args, kwargs))[0] if _is_hidden(t, state, None)), None)
        if hidden is None:
            return
        whole = STANDS_FOR.get()
        state.local = hidden.shape[1]
        if whole is not None and len(whole) > 1:
            state.length = whole[1]
        elif -(-state.length // state.comm.tp) != state.local:
            state.length = state.local * state.comm.tp

    return hook


def _spanning(args: tuple, kwargs: dict, hidden: torch.Tensor) -> str:
    """Why padding ``hidden`` alone would not do: another block input spans its sequence ('' when none does)."""
    seq = hidden.shape[1]
    other = next((t for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t is not hidden and seq in t.shape[1:]), None)
    if other is None:
        return ""
    return (f"the blocks also take a sequence-long input of shape {tuple(other.shape)} (rotary tables, a mask) "
            "that the padding would not reach")


def padding_note(plan: Plan, seq: int) -> str:
    """The set-up line saying ``plan`` pads a ``seq``-long sequence at its split ('' when it does not)."""
    splits = ([f"tp={plan.tp} (sp)"] if plan.sp and plan.tp > 1 and seq % plan.tp else []) + \
        ([f"2*cp={2 * plan.cp}"] if plan.cp > 1 and seq % (2 * plan.cp) else [])
    if not splits:
        return ""
    return (f"autopar: sequence length {seq} is padded at the end to a multiple of {' and '.join(splits)} where "
            "it is split; the attention is causal, so no real token sees the padding, dropped where the sequence "
            "is gathered back")


def check_length(where: str, seq: int, tp: int, unpaddable: str) -> None:
    """A ``seq``-long sequence splits over ``tp`` ranks, or is padded at its end to do so: exact for causal
    attention, no real token seeing the padding, which is dropped where the sequence is gathered back.
    ``unpaddable``: why padding is not exact for this model ('' where it is)."""
    if seq % tp and unpaddable:
        raise ConfigError("plan.sp", f"{where}: sequence length {seq} is not a multiple of tp={tp}, and padding it "
                          f"is not exact ({unpaddable})", f"use a sequence length that is a multiple of {tp}, or "
                          "sp=false")


def _gather_hook(state: _SeqState, summed_grad: bool, block: nn.Module | None = None) -> Callable:
    """A module's [B, S/tp, H] inputs gathered to the whole sequence (the attention and dense MLP: gradients
    reduce-scattered, ``summed_grad``; an MoE module: this rank's chunk of the replicated gradient). The
    attention's and dense MLP's gathered input is tagged (``SeqChunk``) so that their column projections keep
    this rank's chunk for backward and gather it again there (``tp_comm.keep_chunk_forward``), except in a
    recomputed ``block`` or module, whose recompute gathers it again anyway, and in a block torch.compile traces
    (kept as before: not checked under Dynamo)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        keep_chunk = summed_grad and not (recomputed(module) or (block is not None and recomputed(block))
                                          or torch.compiler.is_compiling())

        def gather(t: torch.Tensor) -> torch.Tensor:
            whole = GatherSeq.apply(t, state.comm, summed_grad)
            return SeqChunk.tag(whole, t, state.comm) if keep_chunk else whole

        return _map_call(args, kwargs, gather, lambda t: _is_hidden(t, state, state.local))

    return hook


def _gather_output_hook(state: _SeqState) -> Callable:
    """Last block of a run: its output gathered to the whole sequence, the padding dropped (backward: this rank's
    chunk)."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        whole = GatherSeq.apply(t, state.comm, False)
        return whole if whole.shape[1] == state.length else whole[:, :state.length].contiguous()

    return lambda module, args, output: _map_hidden(output, gather, lambda t: _is_hidden(t, state, state.local))


def _split_output_hook(state: _SeqState) -> Callable:
    """An MoE module's whole-sequence output -> this rank's chunk (backward: all-gather)."""
    split = (lambda t: SplitSeq.apply(t, state.comm, False))
    return lambda module, args, output: _map_hidden(
        output, split, lambda t: _is_hidden(t, state, state.local * state.comm.tp))


# ------------------------------------------------------------------------------------------- structure


def _regions(block: BlockInfo) -> list[tuple[str, bool]]:
    """(path in the block, is MoE) of the modules that run on the whole sequence."""
    found = [(block.attention.fqn, False)] if block.attention is not None else []
    if block.mlp is not None:
        found.append((block.mlp.fqn, False))
    if block.moe is not None:
        found.append((block.moe.fqn, True))
    return found


def _check_structure(block: BlockInfo) -> None:
    """Attention and MLP/MoE must be distinct proper submodules of the block, neither inside the other, and no
    other attention (cross-attention) in the block."""
    if block.attention is None or (block.mlp is None and block.moe is None):
        raise ConfigError("plan.sp", f"{block.fqn}: attention or MLP not recognised", "use sp=false")
    (attn, _), (ffn, _) = _regions(block)[:2]
    if not attn or not ffn:
        raise ConfigError("plan.sp", f"{block.fqn}: the {'attention' if not attn else 'MLP'} spans the block "
                          "itself (not a submodule whose output the block adds to its residual)", "use sp=false")
    if attn == ffn or attn.startswith(ffn + ".") or ffn.startswith(attn + "."):
        raise ConfigError("plan.sp", f"{block.fqn}: attention '{attn}' and MLP '{ffn}' are not distinct modules",
                          "use sp=false")
    if block.other_attention:
        raise ConfigError("plan.sp", f"{block.fqn}.{block.other_attention[0]}: a second attention in the block (an "
                          "encoder-decoder's cross-attention), which TP leaves whole, would see the sequence SP "
                          "splits", "use sp=false")


def block_runs(transformer: nn.Module, analysis: ModelAnalysis,
               chunks: list[list[nn.Module]] | None = None) -> list[list[str]]:
    """The blocks of ``analysis`` (those present on this rank) as runs of consecutive indices, cut also between
    pipeline chunks (``chunks``: each chunk's block modules; a V schedule gives one rank two adjacent chunks)."""
    chunk_of = {id(m): i for i, chunk in enumerate(chunks or []) for m in chunk}
    runs: list[list[BlockInfo]] = []
    for info in analysis.blocks:
        chunk = chunk_of.get(id(transformer.get_submodule(info.fqn)))
        if runs and runs[-1][-1].index + 1 == info.index and chunk == chunk_of.get(
                id(transformer.get_submodule(runs[-1][-1].fqn))):
            runs[-1].append(info)
        else:
            runs.append([info])
    return [[b.fqn for b in run] for run in runs]


def install(transformer: nn.Module, analysis: ModelAnalysis, comm: SeqComm, runs: list[list[str]],
            gather_runs: bool = True, unpaddable: str = NOT_CHECKED,
            edges: StageEdges | None = None) -> list[RemovableHandle]:
    """Add the SP hooks (module doc) to the blocks of ``analysis`` in ``transformer``; ``runs``: the block paths of
    each contiguous run (``block_runs``); ``gather_runs`` False leaves the runs' outputs split (the dry run);
    ``unpaddable``: why a length tp does not divide cannot be padded ('' where it can: ``check_sp``); ``edges``:
    the runs that a pipeline stage receives split and those it sends split. Returns the hooks' handles."""
    state = _SeqState(comm, analysis.spec.hidden, unpaddable)
    edges = edges or StageEdges()
    handles = []
    for run in runs:
        first, last = transformer.get_submodule(run[0]), transformer.get_submodule(run[-1])
        enter = _received_hook(state) if id(first) in edges.received else _scatter_hook(state, run[0])
        handles.append(first.register_forward_pre_hook(enter, with_kwargs=True))
        if gather_runs and id(last) not in edges.sent:
            handles.append(last.register_forward_hook(_gather_output_hook(state)))
    for info in analysis.blocks:
        _check_structure(info)
        block = transformer.get_submodule(info.fqn)
        handles += _region_hooks(block, info, state)
        if comm.group is not None:  # a shape-only dry run has no gradients to sum
            handles += _grad_sum_hooks(block, info, comm.group)
    return handles


def _region_hooks(block: nn.Module, info: BlockInfo, state: _SeqState) -> list[RemovableHandle]:
    """The attention / dense MLP gather their input (backward reduce-scatter); an MoE module gathers it (backward:
    this rank's chunk) and keeps this rank's chunk of its output."""
    handles = []
    for path, moe in _regions(info):
        module = block.get_submodule(path)
        handles.append(module.register_forward_pre_hook(_gather_hook(state, not moe, block), with_kwargs=True))
        if moe:
            handles.append(module.register_forward_hook(_split_output_hook(state)))
    return handles


def _grad_sum_hooks(block: nn.Module, info: BlockInfo, group: Any) -> list[RemovableHandle]:
    """``sum_grads_pre`` / ``sum_grads_post`` on every module of ``block`` owning parameters outside the regions
    that run on the whole sequence (norms, the block's own parameters)."""
    paths = [p for p, _ in _regions(info)]
    inside = tuple(p + "." for p in paths)
    handles = []
    for name, module in block.named_modules():
        if name in paths or name.startswith(inside) or not own_parameters(module):
            continue
        handles.append(module.register_forward_pre_hook(sum_grads_pre(group)))
        handles.append(module.register_forward_hook(sum_grads_post))
    return handles


@dataclass(frozen=True)
class StageEdges:
    """A pipeline's sequence-split edges on this rank (ids of block modules): ``received``, the first block of each
    non-first chunk, whose input arrives as this rank's sequence chunk; ``sent``, the last block of each non-last
    chunk, whose output leaves split (the stage sends 1/tp of the sequence, as Megatron-LM does under SP)."""

    received: frozenset[int] = frozenset()
    sent: frozenset[int] = frozenset()

    @classmethod
    def of(cls, chunks: list[tuple[list[nn.Module], bool, bool]]) -> StageEdges:
        """From each chunk's (block modules, is first, is last)."""
        return cls(frozenset(id(blocks[0]) for blocks, first, _ in chunks if blocks and not first),
                   frozenset(id(blocks[-1]) for blocks, _, last in chunks if blocks and not last))


def apply_sequence_parallel(transformer: nn.Module, analysis: ModelAnalysis, tp_mesh: DeviceMesh,
                            chunks: list[tuple[list[nn.Module], bool, bool]] | None = None,
                            unpaddable: str = NOT_CHECKED) -> None:
    """SP on the blocks of ``analysis`` present in ``transformer`` (``chunks``: the pipeline chunks' block modules,
    and whether each is the first / last chunk), after ``tensor.apply_tensor_parallel`` with ``sp=True`` laid out
    their projections; ``unpaddable``: the model's ``Capabilities.unpaddable_at(tp)`` (``check_sp``)."""
    if tp_mesh.size() > 1:
        comm = SeqComm(tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank())
        runs = block_runs(transformer, analysis, [blocks for blocks, _, _ in chunks] if chunks else None)
        install(transformer, analysis, comm, runs, unpaddable=unpaddable, edges=StageEdges.of(chunks or []))


# ------------------------------------------------------------------------------------------- check


def _block_call(transformer: nn.Module, analysis: ModelAnalysis, block: nn.Module, seq: int,
                runner: nn.Module | None = None) -> tuple[tuple, dict]:
    """``block``'s (args, kwargs) in a meta forward of ``transformer`` on [1, seq] token ids, stopped there
    (``StopAtModule``); a transformer without a forward of its own (litgpt's and nanoGPT's ``transformer``
    ModuleDict) runs through its innermost ancestor in ``runner`` that has one, as the analysis traces it."""
    from lightning_autopar.profile.analyze import _traced_module
    from lightning_autopar.profile.trace import StopAtModule, meta_forward, token_ids

    _, model = _traced_module(transformer, runner)
    trace = meta_forward(model, token_ids(1, seq), [StopAtModule(block)], grad=False)
    if trace.stopped is not None:
        return trace.stopped.args, trace.stopped.kwargs
    why = f" ({trace.failure})" if trace.failure is not None else ""  # a model not run on token ids alone
    raise ConfigError("plan.sp", f"{analysis.spec.name}: block {analysis.blocks[0].fqn} did not run in a meta forward "
                      f"on token ids{why}, so the sequence split cannot be checked", "use sp=false")


def _dry_run(transformer: nn.Module, analysis: ModelAnalysis, info: BlockInfo, tp: int,
            runner: nn.Module | None = None) -> tuple[tuple, dict]:
    """Run block ``info`` alone on meta tensors with the SP hooks simulated (gather = concatenation, split = chunk,
    row projections' reduce-scatter = chunk): it must run and give hidden states [1, S/tp, H]. Returns the block's
    (args, kwargs) in the model's forward on S = 4 tp tokens."""
    from lightning_autopar.profile.trace import Output, meta_forward

    seq = 4 * tp  # S/tp > 1: a residual added across the split cannot broadcast
    block = transformer.get_submodule(info.fqn)
    call = _block_call(transformer, analysis, block, seq, runner)
    comm = SeqComm(None, tp)
    handles = install(transformer, dataclasses.replace(analysis, blocks=[info]), comm, [[info.fqn]],
                      gather_runs=False)
    attn = info.attention
    rows = [join_path(attn.fqn, attn.o)] + ([join_path(info.mlp.fqn, info.mlp.down)] if info.mlp is not None else [])
    for path in rows:
        handles.append(block.get_submodule(path).register_forward_hook(
            lambda m, a, out, p=path: row_output_sp(out, comm, f"{info.fqn}.{p}")))
    try:
        trace = meta_forward(block, call, [Output()], grad=False)
    finally:
        for handle in handles:
            handle.remove()
    err = trace.error
    if isinstance(err, ConfigError):
        raise err
    if err is not None:  # the block's own code refusing the split is the answer
        why = str(err).splitlines()[0][:160] if str(err) else ""
        raise ConfigError("plan.sp", f"{info.fqn}: the block does not run on a sequence split over TP "
                          f"({type(err).__name__}: {why}); a module adding the residual inside (post-norm) "
                          "cannot", "use sp=false") from err
    out = trace.output
    first = out[0] if isinstance(out, (tuple, list)) else out
    want = (1, seq // tp, analysis.spec.hidden)
    if not isinstance(first, torch.Tensor) or tuple(first.shape) != want:
        raise ConfigError("plan.sp", f"{info.fqn}: with the sequence split over TP the block gives "
                          f"{getattr(first, 'shape', None)} instead of {want}", "use sp=false")
    return call


def check_sp(analysis: ModelAnalysis, transformer: nn.Module, tp: int = 2, runner: nn.Module | None = None,
             capabilities: Capabilities | None = None) -> None:
    """Raise one ConfigError ("plan.sp") when sequence parallelism cannot apply to this model: every block's
    attention and MLP/MoE must be distinct proper submodules, and the first dense block (the dry run needs no
    data-dependent routing; the MoE module itself sees the whole sequence) must run with the sequence split
    (``_dry_run``). tp=2 is the smallest split: what refuses it refuses every tp > 1. Also records in
    ``capabilities`` (the model's record; a throwaway one when None) whether a length tp does not divide can be
    padded (``Capabilities.unpaddable``), and checks the model's length (the first batch's, ``spec.seq_len``)
    against it. The dry run runs once per model and tp."""
    if tp == 1:
        return
    caps = capabilities if capabilities is not None else Capabilities.of(analysis)

    def run() -> None:
        if analysis.spec.unit_form:
            raise ConfigError("plan.sp", f"{analysis.spec.name}: no block stack to split the sequence of",
                              "use sp=false")
        for info in analysis.blocks:
            _check_structure(info)
        dense = next((b for b in analysis.blocks if b.moe is None), None)
        call = _dry_run(transformer, analysis, dense, tp, runner) if dense is not None else None
        caps.unpaddable[tp] = _unpaddable(analysis, transformer, call, 4 * tp, caps)

    caps.checked("sp", tp, run)
    check_length(analysis.spec.name, analysis.spec.seq_len, tp, caps.unpaddable[tp])


def _unpaddable(analysis: ModelAnalysis, transformer: nn.Module, call: tuple[tuple, dict] | None, seq: int,
                caps: Capabilities) -> str:
    """Why zero-padding the hidden states at the end of the sequence would change a real token's result ('' when
    it would not): MoE layers (the router would see the padding: its balance loss changes), attention not causal
    by itself in every block (``context.traced_attention``, one meta run on token ids per model: is_causal set, no
    mask), or
    block inputs besides the hidden states that span the sequence (``call``: a block's inputs on ``seq`` tokens)."""
    from lightning_autopar.parallel.context import causal_blocks, traced_attention

    if call is None or any(b.moe is not None for b in analysis.blocks):
        return "MoE layers would route the padded tokens"
    fqns = [b.fqn for b in analysis.blocks]
    if not causal_blocks(traced_attention(transformer, fqns, caps), fqns):
        return "the attention is not causal, or not known to be: a meta run did not see SDPA with is_causal=True " \
               "and no mask in every block"
    state = _SeqState(SeqComm(None, 1), analysis.spec.hidden)
    hidden = next((t for t in tree_flatten(call)[0] if _is_hidden(t, state, seq)), None)
    return "the blocks' hidden-state input was not found" if hidden is None else _spanning(*call, hidden)
