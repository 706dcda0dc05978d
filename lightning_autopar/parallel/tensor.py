"""Tensor parallelism (Megatron layouts through DTensor), derived from the traced analysis.

Per block: q, k, v (or the MLP's up and gate) are split by columns (each rank owns whole heads / a slice of the
FFN), o and down by rows (partial sums all-reduced), so each block costs two all-reduces forward and two
backward. The projections are addressed by their paths below the block wherever the analysis found them in the
dataflow (HF BERT: q/k/v in ``attention.self``, o in the sibling ``attention.output``, the MLP from
``intermediate.dense`` to ``output.dense``). TP leaves everything outside these projections alone (embeddings, a
ViT's patch Conv2d, CLS token and position embeddings, norms, heads: replicated across the TP group, sharded by
FSDP over the data-parallel mesh only), so no op of the model meets a TP DTensor next to a plain tensor. MoE
experts are split the same way inside each expert; the router stays replicated. Experts stored as fused 3-D
weights (HF Mixtral: ``gate_up_proj`` [E, 2*ffn, hidden] fusing [gate | up] along dim 1, ``down_proj``
[E, hidden, ffn]) too (``shard_fused_experts``): ``gate_up_proj`` is ``_StridedShard(1, split_factor=2)`` (the rank
keeps its part of gate and of up), ``down_proj`` ``Shard(2)``; the module's own forward runs on the local weights
between f (on its hidden states and routing weights) and g (on its output); a probe on tiny weights checks that
the forward's split sums to the whole before anything is sharded. With EP on top the weights become 2-D DTensors
(``Shard(0)`` on ep, the TP placement on tp). Embeddings, norms and the LM head stay replicated across the TP
group.

Separate nn.Linear projections use torch's ``ColwiseParallel`` / ``RowwiseParallel``. Two layouts need their own
style (``LocalShard``), because torch's styles accept only nn.Linear and split a weight into contiguous blocks:

* fused projections (GPT-2's ``c_attn``, litgpt's and nanoGPT's ``qkv``, Phi-3's ``qkv_proj`` and
  ``gate_up_proj``): the model cuts the output into [q | k | v] (or [gate | up]) and then into heads, so TP rank
  r must hold rows r of *each* piece. That is DTensor's ``_StridedShard(dim, split_factor=pieces)``: the global
  tensor stays the single-device one (``full_tensor``, ``get_model_state_dict(full_state_dict=True)``) and the
  local shard is [q_r | k_r | v_r], so the model's own ``split`` works. Layouts interleaved per kv group (a view
  into (groups, q_per_kv + 2, head_dim)) are a plain ``Shard``. A fused bias stays replicated; each rank adds
  its slice and the slices' gradients are summed over the TP group in backward;
* fused [q | k | v] with GQA (litgpt's ``qkv`` with n_query_groups < n_head, Phi-3's GQA ``qkv_proj``): the
  pieces have unequal widths, which no DTensor placement cuts into [q_r | k_r | v_r]. The weight is stored as
  ``Shard`` of a row-permuted global tensor P(W) = [q_0; k_0; v_0; q_1; k_1; v_1; ...] (``RowOrder``), so the
  local rows are the rank's own heads. Everything elementwise or blind to row order (optimizer steps, norms for
  clipping, FSDP's cut of the input dim on top) is unaffected; only the names -> values views show W instead:
  the module's state-dict hooks (``state_dict``, ``get_model_state_dict``, DCP) and the optimizer's (its
  states), which gather the TP dim, un-permute and return W replicated over TP (loading does the reverse);
* transposed projections (GPT-2's Conv1D, weight [in, out]): column split is Shard(1) of the weight and Shard(0)
  of the bias, row split Shard(0) of the weight with the bias added once, after the sum.

A ``LocalShard`` module computes with its local shards as plain tensors (its own forward, unchanged), with the
collectives of Megatron's f / g around it. What the model's own code must see divided (a head count, GPT-2's
``split_size``, litgpt's ``config.n_head`` -- litgpt's config is shared, so each attention module gets its own
shallow copy) was found by the analysis's meta dry run (``AttentionInfo.tp_attrs``); when no division lets the
code run on local shapes (nanoGPT's ``view(B, T, n_head, C // n_head)`` with C the full width), ``check_tp``
refuses tp > 1 with that reason.

Sequence parallelism (plan.sp, ``parallel.sequence``): every attention and dense-MLP projection is a ``LocalShard``
with ``sp`` set -- column projections without f (their module gathers the sequence), row projections reduce-scatter
along the sequence (``row_output_sp``) instead of g; the sequence collectives (``GatherSeq``, ``SplitSeq``) live
here. Experts keep f and g.

Checkpoints: a row-permuted weight (and its optimizer states) reaches a checkpoint as W, replicated over TP,
which DCP writes as is. ``_StridedShard`` DTensors give correct full tensors, but DCP writes a DTensor's local
shard as one contiguous chunk, which a strided shard is not. ``plain_shards`` redistributes such tensors (parameters and
optimizer states alike) to plain ``Shard`` placements before a DCP save or load, ``restore_layout`` back after a
load. FSDP on top must shard these parameters on another dim than the strided one (``fsdp_placement``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.profile.analyze import (AttentionInfo, BlockInfo, MLPInfo, ModelAnalysis, MoEInfo,
                                               divide_attributes, leaf_width_attributes)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def check_tp(analysis: ModelAnalysis, tp: int, structure_only: bool = False) -> None:
    """Raise one clear ConfigError when ``tp`` cannot shard this model. ``structure_only``: check only what the
    model's structure allows (the planner's divisibility rules handle head and FFN counts); this includes the
    analysis's meta dry run, so a model whose code cannot run on local heads is never offered tp > 1."""
    if tp == 1:
        return
    spec = analysis.spec
    for block in analysis.blocks:
        attn = block.attention
        if attn is None or attn.o is None or not (attn.q or attn.qkv):
            raise ConfigError("plan.tp", f"{block.fqn}: attention projections not recognised, so tp={tp} cannot "
                              "split it", "use tp=1, or separate q/k/v/o nn.Linear layers")
        if attn.tp_refusal:
            raise ConfigError("plan.tp", _located(block.fqn, attn.tp_refusal), "use tp=1")
        if block.mlp is None and block.moe is None:
            raise ConfigError("plan.tp", f"{block.fqn}: MLP not recognised", "use tp=1")
        if block.mlp is not None and block.mlp.tp_refusal:
            raise ConfigError("plan.tp", _located(block.fqn, block.mlp.tp_refusal), "use tp=1")
        if block.moe is not None and block.moe.expert_mlp is not None and block.moe.expert_mlp.gate_up:
            raise ConfigError("plan.tp", f"{_join(block.fqn, block.moe.fqn)}: experts with a fused gate/up projection "
                              f"({block.moe.expert_mlp.gate_up}) are not split by TP", "use tp=1")
        if block.moe is not None and block.moe.fused:
            _check_fused_experts(f"{block.fqn}.{block.moe.fqn}", block.moe, tp if not structure_only else None)
    if structure_only:
        return
    if spec.heads % tp or spec.kv_heads % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide heads={spec.heads} and kv_heads={spec.kv_heads}",
                          f"choose tp among the common divisors of {spec.heads} and {spec.kv_heads}")
    if spec.ffn_hidden % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide ffn_hidden={spec.ffn_hidden}", "choose a divisor")


def _check_fused_experts(fqn: str, moe: MoEInfo, tp: int | None) -> None:
    """Fused 3-D experts are split inside each expert (``FusedExpertsTP``): ``tp`` must divide their FFN width
    (the planner's rules check it for ``ffn_hidden``, so only with ``tp`` given). Their weights' layout is
    checked on the module when applied (``_fused_split_dims``, ``_probe_fused_split``)."""
    if tp is not None and moe.ffn_hidden % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide the experts' ffn width {moe.ffn_hidden} of {fqn}",
                          "choose tp dividing it")


def _located(block_fqn: str, refusal: str) -> str:
    """A refusal "<path in the block>: why" (the path may be empty: the block itself) located in the model."""
    where, _, why = refusal.partition(": ")
    return f"{block_fqn}.{where}: {why}" if where else f"{block_fqn}: {why}"


# ------------------------------------------------------------------------------------------- collectives


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input gradient over the TP group (each rank's column
    shard contributed part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward sums the row shards' partial outputs over the TP group; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


@dataclass(frozen=True)
class SeqComm:
    """The TP group as sequence parallelism uses it (``parallel.sequence``): ``group`` None simulates the
    collectives shape-wise for a meta dry run (gather = ``tp`` copies concatenated, split = chunk 0)."""

    group: Any
    tp: int
    rank: int = 0


def _all_gather_seq(x: torch.Tensor, comm: SeqComm) -> torch.Tensor:
    """The TP ranks' pieces of ``x`` concatenated along the sequence dim (1), in rank order."""
    if comm.group is None:
        return torch.cat([x] * comm.tp, 1)
    from lightning_autopar.parallel.collectives import all_gather_along

    return all_gather_along(x, 1, comm.group, comm.tp)


def _split_seq(x: torch.Tensor, comm: SeqComm, summed: bool) -> torch.Tensor:
    """This rank's chunk of ``x`` along the sequence dim (1); ``summed``: of the sum of ``x`` over the TP group (a
    reduce-scatter)."""
    if comm.group is None:
        return x.chunk(comm.tp, 1)[0]
    if not summed:
        return x.chunk(comm.tp, 1)[comm.rank].contiguous()
    from lightning_autopar.parallel.collectives import reduce_scatter_along

    return reduce_scatter_along(x, 1, comm.group, comm.tp)


class GatherSeq(torch.autograd.Function):
    """Forward: all-gather along the sequence dim. Backward: this rank's chunk of the gradient, summed over the TP
    group (``summed_grad``: each rank's gradient is a partial sum, as after column projections without f) or
    not (the gradient is the same on every TP rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: SeqComm, summed_grad: bool) -> torch.Tensor:
        ctx.comm, ctx.summed = comm, summed_grad
        return _all_gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_seq(grad, ctx.comm, ctx.summed), None, None


class SplitSeq(torch.autograd.Function):
    """Forward: this rank's chunk along the sequence dim (``summed``: of the sum over the TP group, a
    reduce-scatter). Backward: all-gather of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: SeqComm, summed: bool) -> torch.Tensor:
        ctx.comm = comm
        return _split_seq(x, comm, summed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_seq(grad, ctx.comm), None, None


def row_output_sp(output: torch.Tensor, comm: SeqComm, where: str) -> torch.Tensor:
    """A row-parallel projection's partial output [B, S, H] reduce-scattered to this rank's tokens [B, S/tp, H]
    (Megatron SP's g-bar; backward all-gather)."""
    if output.dim() != 3 or output.shape[1] % comm.tp:
        raise ConfigError("plan.sp", f"{where}: output {tuple(output.shape)} is not [batch, seq, hidden] with the "
                          f"sequence divisible by tp={comm.tp}", "use sp=false")
    return SplitSeq.apply(output, comm, True)


class _SliceOfReplicated(torch.autograd.Function):
    """This rank's slice of a TP-replicated tensor (a fused bias); backward sums the ranks' slice gradients, so
    every rank's replicated gradient is the full, identical one."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, index: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.shape = group, full.shape
        ctx.save_for_backward(index)
        return full.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        (index,) = ctx.saved_tensors
        full = grad.new_zeros(ctx.shape).index_copy_(0, index, grad.contiguous())
        dist.all_reduce(full, group=ctx.group)
        return full, None, None


# ------------------------------------------------------------------------------------------- LocalShard


def piece_index(width: int, pieces: int, tp: int, rank: int) -> torch.Tensor:
    """Indices of rank ``rank``'s part of each of ``pieces`` equal pieces of ``width`` ([q_r | k_r | v_r])."""
    piece = width // pieces
    step = piece // tp
    return torch.cat([torch.arange(p * piece + rank * step, p * piece + (rank + 1) * step) for p in range(pieces)])


@dataclass(frozen=True)
class LocalShardSpec:
    """How one projection is split: ``kind`` "col" (outputs) or "row" (inputs); ``transposed``: weight stored
    [in, out]; ``pieces`` > 1: a fused [a | b | c] output, each rank holding its part of every piece;
    ``widths``: a fused output of pieces with these unequal widths (GQA's [q | k | v]), stored row-permuted."""

    kind: str
    transposed: bool = False
    pieces: int = 1
    widths: tuple[int, ...] = ()
    # sequence parallelism (``parallel.sequence``): the input of a column projection is the sequence gathered by
    # its module (no f: that gather's backward reduce-scatters the partial input gradients); a row projection
    # reduce-scatters its output along the sequence (no g) and adds its bias on this rank's tokens
    sp: bool = False


@dataclass(frozen=True)
class RowOrder:
    """The permutation that lets ``Shard(dim)`` give each TP rank its own part of every piece of a fused output
    whose pieces have unequal ``widths``: the stored global tensor is P(W) = W.index_select(dim, permutation()),
    the rank chunks [a_0; b_0; c_0; a_1; b_1; c_1; ...], each ``width // tp`` rows of every piece."""

    widths: tuple[int, ...]
    tp: int
    dim: int

    def local_index(self, rank: int) -> torch.Tensor:
        """Rows of W that TP rank ``rank`` holds, in its local order [a_r; b_r; c_r]."""
        starts = [sum(self.widths[:i]) for i in range(len(self.widths))]
        return torch.cat([torch.arange(start + rank * (w // self.tp), start + (rank + 1) * (w // self.tp))
                          for start, w in zip(starts, self.widths)])

    def permutation(self) -> torch.Tensor:
        return torch.cat([self.local_index(r) for r in range(self.tp)])

    def inverse(self) -> torch.Tensor:
        return torch.argsort(self.permutation())


def _local_style() -> type:
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class LocalShard(ParallelStyle):
        """Shard a linear-like module's weight (and bias) as ``spec`` says; its forward runs on the local shards
        as plain tensors, between Megatron's f (column) or g (row) collectives. Parameter names are unchanged."""

        def __init__(self, spec: LocalShardSpec) -> None:
            super().__init__()
            self.spec = spec

        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor
            from torch.distributed.tensor.placement_types import _StridedShard

            spec, tp = self.spec, device_mesh.size()
            out_dim = 1 if spec.transposed else 0
            weight = module.weight
            out_features = weight.shape[out_dim]
            fused = spec.pieces > 1 or bool(spec.widths)
            order = RowOrder(spec.widths, tp, out_dim) if spec.widths else None
            if spec.kind == "col":
                w_place = _StridedShard(out_dim, split_factor=spec.pieces) if spec.pieces > 1 else Shard(out_dim)
                b_place = Replicate() if fused else Shard(0)
                for attr in leaf_width_attributes(module, out_features):
                    setattr(module, attr, getattr(module, attr) // tp)
            else:
                w_place, b_place = Shard(1 - out_dim), Replicate()
            for name, place in (("weight", w_place), ("bias", b_place)):
                param = getattr(module, name, None)
                if isinstance(param, nn.Parameter):
                    value = param
                    if order is not None and name == "weight":
                        value = param.detach().index_select(out_dim, order.permutation().to(param.device))
                    module.register_parameter(name, nn.Parameter(distribute_tensor(value, device_mesh, [place]),
                                                                 requires_grad=param.requires_grad))
            if order is not None:
                _keep_row_order(module, order)
            group = device_mesh.get_group()
            bias_index = None
            if spec.kind == "col" and fused and getattr(module, "bias", None) is not None:
                rank = device_mesh.get_local_rank()
                bias_index = order.local_index(rank) if order is not None else \
                    piece_index(out_features, spec.pieces, tp, rank)
            comm = SeqComm(group, tp, device_mesh.get_local_rank()) if spec.sp else None
            module.register_forward_pre_hook(_pre_hook(spec, group, bias_index), with_kwargs=True)
            module.register_forward_hook(_post_hook(spec, group, comm))
            return module

    return LocalShard


def _swap_in_local(module: nn.Module, names: list[str]) -> dict[str, Any]:
    """Put the local tensors of ``module``'s DTensor parameters ``names`` in their place for one forward (the
    model's own code then computes on this rank's slice, autograd reaching the DTensors); returns the stash
    ``_swap_back`` restores."""
    from torch.distributed.tensor import DTensor

    params = module._parameters
    module._tp_stash = {n: params[n] for n in names if params.get(n) is not None}
    params.update({n: p.to_local() if isinstance(p, DTensor) else p for n, p in module._tp_stash.items()})
    return module._tp_stash


def _swap_back(module: nn.Module) -> None:
    module._parameters.update(module._tp_stash)
    module._tp_stash = {}


def _pre_hook(spec: LocalShardSpec, group: Any, bias_index: torch.Tensor | None) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        params = module._parameters
        bias = _swap_in_local(module, ["weight", "bias"]).get("bias")
        if bias is not None:
            local = bias.to_local()
            if spec.kind == "row":  # added once, after the sum (post hook)
                params["bias"] = torch.zeros_like(local).detach()
            elif bias_index is not None:
                params["bias"] = _SliceOfReplicated.apply(local, bias_index.to(local.device), group)
            else:
                params["bias"] = local
        if spec.kind == "col" and args and not spec.sp:
            args = (_CopyToTP.apply(args[0], group), *args[1:])
        return args, kwargs

    return hook


def _post_hook(spec: LocalShardSpec, group: Any, comm: SeqComm | None) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor):
        _swap_back(module)
        if spec.kind != "row":
            return output
        if comm is None:
            output = _ReduceFromTP.apply(output, group)
        else:
            output = row_output_sp(output, comm, type(module).__name__)
        bias = module._parameters.get("bias")
        if bias is None:
            return output
        # with SP the bias meets only this rank's tokens: its gradient is summed over the TP group (f)
        return output + (bias.to_local() if comm is None else _CopyToTP.apply(bias.to_local(), group))

    return hook


# ------------------------------------------------------------------------------------------- layouts


def _style(name: str, kind: str, transposed: set[str], pieces: int = 1, sp: bool = False) -> Any:
    """torch's style for a plain nn.Linear without SP, else ``LocalShard`` (SP needs its sequence collectives)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name not in transposed and pieces == 1 and not sp:
        return ColwiseParallel() if kind == "col" else RowwiseParallel()
    return _local_style()(LocalShardSpec(kind, name in transposed, pieces, sp=sp))


def _mlp_layout(prefix: str, mlp: MLPInfo, sp: bool = False) -> dict:
    """The MLP's projections below ``prefix`` (relative to the block; "" when the MLP spans the block's own
    children, as HF BERT's ``intermediate.dense`` -> ``output.dense``)."""
    join = (lambda n: _join(prefix, n))
    flipped = set(mlp.transposed)
    layout = {join(mlp.up): _style(mlp.up, "col", flipped, 2 if mlp.gate_up else 1, sp),
              join(mlp.down): _style(mlp.down, "row", flipped, sp=sp)}
    if mlp.gate:
        layout[join(mlp.gate)] = _style(mlp.gate, "col", flipped, sp=sp)
    return layout


def _join(*names: str) -> str:
    """A module path from parts relative to each other; empty parts (the block itself) drop out."""
    return ".".join(n for n in names if n)


def _attention_layout(attn: AttentionInfo, sp: bool = False) -> dict:
    """The attention's projections relative to the block. ``attn.fqn`` is the innermost module holding all of them,
    which need not be their parent: HF BERT's "attention" with q "self.query" and o "output.dense"."""
    flipped = set(attn.transposed)
    if attn.qkv and attn.qkv_layout == "sequential" and len(set(attn.qkv_pieces)) > 1:  # GQA: row-permuted
        layout = {_join(attn.fqn, attn.qkv): _local_style()(LocalShardSpec("col", attn.qkv in flipped,
                                                                            widths=tuple(attn.qkv_pieces), sp=sp))}
    elif attn.qkv:
        pieces = 3 if attn.qkv_layout == "sequential" else 1
        layout = {_join(attn.fqn, attn.qkv): _style(attn.qkv, "col", flipped, pieces, sp)}
    else:
        layout = {_join(attn.fqn, name): _style(name, "col", flipped, sp=sp) for name in (attn.q, attn.k, attn.v)}
    layout[_join(attn.fqn, attn.o)] = _style(attn.o, "row", flipped, sp=sp)
    return layout


def block_layout(block: BlockInfo, num_experts_local: int | None = None, sp: bool = False) -> dict:
    """FQN (relative to the block) -> ParallelStyle for one block. ``sp``: the attention's and the dense MLP's
    projections run between sequence-parallel collectives (``parallel.sequence``); experts keep f and g (the MoE
    module sees the whole sequence)."""
    attn = block.attention
    assert attn is not None
    layout = _attention_layout(attn, sp)
    if block.mlp is not None:
        layout.update(_mlp_layout(block.mlp.fqn, block.mlp, sp))
    if block.moe is not None and block.moe.expert_mlp is not None:
        base = f"{block.moe.fqn}.{block.moe.experts}" if block.moe.fqn else block.moe.experts
        count = block.moe.num_experts if num_experts_local is None else num_experts_local
        for e in range(count):
            layout.update(_mlp_layout(f"{base}.{e}", block.moe.expert_mlp))
    return layout


def apply_tensor_parallel(transformer: nn.Module, analysis: ModelAnalysis, tp_mesh: DeviceMesh,
                          sp: bool = False) -> None:
    """Shard every block of ``transformer`` over ``tp_mesh`` in place; parameter names are unchanged. ``sp``: the
    projections' layout for sequence parallelism, whose hooks ``parallel.sequence.apply_sequence_parallel``
    adds."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check_tp(analysis, tp)
    if tp == 1:
        return
    for info in analysis.blocks:
        block = transformer.get_submodule(info.fqn)
        moe_list = None
        if info.moe is not None and not info.moe.fused:
            moe_mod = block.get_submodule(info.moe.fqn) if info.moe.fqn else block
            moe_list = len(moe_mod.get_submodule(info.moe.experts))  # EP may have removed remote experts
        parallelize_module(block, tp_mesh, block_layout(info, moe_list, sp))
        divide_attributes(block.get_submodule(info.attention.fqn), info.attention.tp_attrs, tp)
        if info.moe is not None and info.moe.fused:
            moe_mod = block.get_submodule(info.moe.fqn) if info.moe.fqn else block
            shard_fused_experts(moe_mod.get_submodule(info.moe.experts), info.moe, tp_mesh,
                                f"{info.fqn}.{info.moe.fqn}")


# ------------------------------------------------------------------------------------------- fused 3-D experts


def _fused_split_dims(experts: nn.Module, moe: MoEInfo, where: str) -> dict[str, tuple[int, int]]:
    """name -> (dim split over TP, pieces) for each fused expert weight: the input projections ([E, out, in],
    read ``hidden``) by their output dim -- in ``pieces`` = 2 (a ``_StridedShard``, so the rank keeps its part of
    gate AND of up) when one weight fuses gate and up, 2 * ffn wide --, the output projection ([E, hidden, ffn])
    by its input dim; transposed weights ([E, in, out], ``is_transposed``) the other way round."""
    flip = bool(getattr(experts, "is_transposed", False))
    out_dim, in_dim = (2, 1) if flip else (1, 2)
    dims = {}
    for name in moe.fused_params:
        param = experts._parameters[name]
        if param.dim() != 3:  # a per-expert bias of the output would be added by every TP rank's partial sum
            raise ConfigError("plan.tp", f"{where}.{name}: fused experts with parameters other than 3-D weights "
                              f"({tuple(param.shape)}) are not split by TP", "use tp=1 (ep and dp shard them)")
        width = param.shape[out_dim]
        if param.shape[in_dim] == moe.ffn_hidden and width != moe.ffn_hidden:
            dims[name] = (in_dim, 1)
        elif width in (moe.ffn_hidden, 2 * moe.ffn_hidden):
            dims[name] = (out_dim, width // moe.ffn_hidden if moe.gated else 1)
        else:
            raise ConfigError("plan.tp", f"{where}.{name}: a fused expert weight of shape {tuple(param.shape)} is "
                              f"neither an input nor the output projection of the {moe.ffn_hidden}-wide experts",
                              "use tp=1")
    return dims


def _local_slice(full: torch.Tensor, dim: int, pieces: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` split ``tp`` ways along ``dim``, inside each of its ``pieces`` equal
    pieces (what ``_StridedShard(dim, split_factor=pieces)`` holds locally)."""
    return torch.cat([p.chunk(tp, dim)[rank] for p in full.chunk(pieces, dim)], dim)


def _probe_fused_split(experts: nn.Module, moe: MoEInfo, dims: dict[str, tuple[int, int]], tp: int,
                       where: str) -> None:
    """Check from what the experts' forward does (not from names) that the split is exact: on tiny random weights
    (the module's expert count, 4 FFN columns per rank), the sum over ranks of the forward with each rank's
    slices must equal the forward with the whole weights. A forward that cuts a fused gate/up otherwise
    than [gate | up] (interleaved, say) fails here instead of training apart from one device."""
    E, hidden, ffn = moe.num_experts, 4, 4 * tp  # widths of 16 bytes: grouped_mm needs aligned strides
    gen = torch.Generator().manual_seed(0)
    saved = dict(experts._parameters)
    shapes = {}
    for name, (dim, pieces) in dims.items():
        shape = list(saved[name].shape)
        shape[dim] = ffn * pieces
        shape[3 - dim] = hidden  # the other non-expert dim
        shapes[name] = shape
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    x = torch.randn(5, hidden, generator=gen)
    ids = torch.stack([torch.arange(5) % E, (torch.arange(5) + 1) % E], 1)
    weights = torch.rand(5, 2, generator=gen)
    try:
        with torch.no_grad():
            experts._parameters.update(full)
            want = type(experts).forward(experts, x, ids, weights)
            got = torch.zeros_like(want)
            for rank in range(tp):
                experts._parameters.update({n: _local_slice(full[n], *dims[n], tp, rank) for n in dims})
                got += type(experts).forward(experts, x, ids, weights)
    except Exception as err:  # noqa: BLE001 -- any failure means the forward does not run on local widths
        why = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError("plan.tp", f"{where}: the fused experts' forward does not run on TP-local widths "
                          f"({type(err).__name__}: {why})", "use tp=1") from err
    finally:
        experts._parameters.update(saved)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise ConfigError("plan.tp", f"{where}: the fused experts' forward split over TP ranks does not sum to the "
                          "whole (their fused gate/up is not cut [gate | up])", "use tp=1")


def shard_fused_experts(experts: nn.Module, moe: MoEInfo, tp_mesh: DeviceMesh, where: str) -> None:
    """Megatron's split inside each expert of a fused 3-D experts module: input projections by output features
    (a fused [gate | up] as ``_StridedShard(1, split_factor=2)``, so the global tensor stays the single-device
    one), the output projection by input features (``Shard(2)``); the router stays replicated. The module's own
    forward (whichever ``experts_implementation``: all read the weights' shapes) runs on the local weights,
    between Megatron's f on its floating inputs (hidden states and routing weights: each rank's partial output
    contributes part of their gradients) and g on its output (a partial sum). Hooks, not a new forward, so expert
    parallelism (which replaces the forward) and FSDP (whose hooks wrap these) compose with it."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = tp_mesh.size()
    dims = _fused_split_dims(experts, moe, where)
    _probe_fused_split(experts, moe, dims, tp, where)
    for name, (dim, pieces) in dims.items():
        param = experts._parameters[name]
        place = _StridedShard(dim, split_factor=pieces) if pieces > 1 else Shard(dim)
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), tp_mesh, [place]),
                                                      requires_grad=param.requires_grad))
    group = tp_mesh.get_group()
    experts.register_forward_pre_hook(_fused_pre_hook(list(dims), group), with_kwargs=True)
    experts.register_forward_hook(_fused_post_hook(group))


def _fused_pre_hook(names: list[str], group: Any) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        _swap_in_local(module, names)
        f = (lambda t: _CopyToTP.apply(t, group) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

    return hook


def _fused_post_hook(group: Any) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor):
        _swap_back(module)
        return _ReduceFromTP.apply(output, group)

    return hook


# ------------------------------------------------------------------------------------------- row-permuted weights


def _keep_row_order(module: nn.Module, order: RowOrder) -> None:
    """Make every names -> values view of ``module.weight`` (stored as P(W)) show W: state-dict hooks on the
    module (optimizers holding the weight get theirs from ``keep_optimizer_row_order``). FSDP later replaces the
    parameter object, so the order is kept on the module; the attribute on the parameter tells
    ``fsdp_placement`` which dim it must leave alone."""
    module._autopar_row_order = order
    module.weight._autopar_row_order = order
    module._register_state_dict_hook(_weight_as_single_device)
    module.register_load_state_dict_pre_hook(_weight_from_single_device)


def _tp_mesh_dim(param: Any, order: RowOrder) -> int:
    """The mesh dim of ``param`` (a DTensor, maybe also FSDP-sharded) holding the row-permuted TP shard: the only
    one with a plain ``Shard(order.dim)`` (``fsdp_placement`` shards another dim)."""
    from torch.distributed.tensor import Shard

    dims = [i for i, p in enumerate(param.placements) if type(p) is Shard and p.dim == order.dim]
    if len(dims) != 1:
        raise ConfigError("plan.tp", f"a row-permuted fused weight has placements {param.placements}: no single "
                          f"TP shard of dim {order.dim}", "use tp=1 for this model")
    return dims[0]


def _rows_taken_over_tp(value: Any, order: RowOrder, like: Any, rows: torch.Tensor) -> Any:
    """``value`` (a DTensor on ``like``'s mesh) replicated over the TP mesh dim, other mesh dims as they were, with
    its rows along ``order.dim`` taken in the order ``rows``."""
    from torch.distributed.tensor import DTensor, Replicate

    placements = list(value.placements)
    placements[_tp_mesh_dim(like, order)] = Replicate()
    gathered = _redistribute(value, tuple(placements))
    local = gathered.to_local()
    local = local.index_select(order.dim, rows.to(local.device))
    return DTensor.from_local(local, value.device_mesh, gathered.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def to_single_device_order(value: Any, order: RowOrder, like: Any) -> Any:
    """``value`` (laid out like ``like``, the parameter: TP shard of P(W)) as a DTensor of W replicated over the
    TP mesh dim, other mesh dims as they were; what state dicts and checkpoints hold."""
    return _rows_taken_over_tp(value, order, like, order.inverse())


def to_row_order(value: Any, order: RowOrder, like: Any) -> Any:
    """The inverse of ``to_single_device_order``: W (a DTensor of any placements on ``like``'s mesh, or a plain
    full tensor on every rank) laid out like ``like`` (the parameter), holding P(W)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, DTensor):
        permuted = value.index_select(order.dim, order.permutation().to(value.device))
        return distribute_tensor(permuted, like.device_mesh, like.placements)
    return _redistribute(_rows_taken_over_tp(value, order, like, order.permutation()), like.placements)


def _weight_as_single_device(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    from torch.distributed.tensor import DTensor

    key, param = prefix + "weight", module._parameters.get("weight")
    if isinstance(state_dict.get(key), DTensor) and isinstance(param, DTensor):
        state_dict[key] = to_single_device_order(state_dict[key], module._autopar_row_order, param)


def _weight_from_single_device(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    from torch.distributed.tensor import DTensor

    key, param = prefix + "weight", module._parameters.get("weight")
    if isinstance(state_dict.get(key), torch.Tensor) and isinstance(param, DTensor) \
            and state_dict[key].shape == param.shape:
        state_dict[key] = to_row_order(state_dict[key], module._autopar_row_order, param)


def _row_ordered_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[int, tuple[RowOrder, Any]]:
    """id(parameter) -> (its row order, the parameter) for the row-permuted weights of ``model`` that
    ``optimizer`` steps."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = {}
    for module in model.modules():
        if getattr(module, "_autopar_row_order", None) is None:
            continue
        param = module._parameters.get("weight")
        if param is not None and id(param) in stepped:
            found[id(param)] = (module._autopar_row_order, param)
    return found


def _convert_optimizer_states(optimizer: torch.optim.Optimizer, state_dict: dict, convert: Callable,
                              model: nn.Module) -> dict:
    """``state_dict`` (an optimizer state dict keyed by index or name) with the states of row-permuted weights
    passed through ``convert(value, order, param)``; the optimizer's live states are left alone."""
    from torch.distributed.tensor import DTensor

    ordered = _row_ordered_params(optimizer, model)
    if not ordered or "state" not in state_dict:
        return state_dict
    states = dict(state_dict["state"])
    for saved, group in zip(state_dict.get("param_groups", []), optimizer.param_groups):
        for key, param in zip(saved["params"], group["params"]):
            if id(param) not in ordered or key not in states:
                continue
            order, like = ordered[id(param)]
            states[key] = {name: convert(v, order, like) if isinstance(v, DTensor) and v.shape == like.shape else v
                           for name, v in states[key].items()}
    return {**state_dict, "state": states}


def keep_optimizer_row_order(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """An optimizer holding a row-permuted weight (``RowOrder``: its states are P(W)-ordered too) gets state-dict
    hooks that show (and take) its states in W's order, so optimizer checkpoints reshard across plans. Called by
    the strategies on the optimizers built on the sharded parameters; a no-op for any other optimizer."""
    if not _row_ordered_params(optimizer, model):
        return
    optimizer.register_state_dict_post_hook(
        lambda opt, state: _convert_optimizer_states(opt, state, to_single_device_order, model))
    optimizer.register_load_state_dict_pre_hook(
        lambda opt, state: _convert_optimizer_states(opt, state, to_row_order, model))


# ------------------------------------------------------------------------------------------- FSDP and DCP


def _strided_dim(tensor: Any) -> int | None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return None
    return next((p.dim for p in tensor.placements if isinstance(p, _StridedShard)), None)


def fsdp_placement(shard_size: int) -> Callable[[nn.Parameter], Any]:
    """FSDP2 ``shard_placement_fn`` for TP-sharded fused projections: a parameter whose TP placement is a
    ``_StridedShard`` on dim d, or a row-permuted one (``RowOrder``) sharded on dim d, is sharded by FSDP on the
    other dim (FSDP's default, dim 0, would cut the rank's [q_r | k_r | v_r] rows again, which no placement pair
    describes, or which the state-dict hooks' un-permuting would not expect); None (FSDP's default) otherwise."""
    from torch.distributed.tensor import Shard

    def place(param: nn.Parameter) -> Any:
        order = getattr(param, "_autopar_row_order", None)
        dim = order.dim if order is not None else _strided_dim(param)
        if dim is None or param.dim() < 2:
            return None
        other = next((d for d in range(param.dim()) if d != dim and param.shape[d] % shard_size == 0), None)
        if other is None:  # FSDP's dim-0 cut of [q_r | k_r | v_r] would describe the wrong global tensor
            raise ConfigError("plan.dp_shard", f"a TP-fused weight of shape {tuple(param.shape)} has no dimension "
                              f"besides the fused one that {shard_size} data-parallel shards divide",
                              "choose dp_shard (or zero=0) so that the weight's input width divides")
        return Shard(other)

    return place


def _plain(placements: tuple) -> tuple:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)


def _map_tree(tree: Any, fn: Callable[[Any, Any], Any], like: Any = None) -> Any:
    if isinstance(tree, dict):
        return {k: _map_tree(v, fn, like.get(k) if isinstance(like, dict) else None) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_map_tree(v, fn, like[i] if isinstance(like, (list, tuple)) and i < len(like) else None)
                 for i, v in enumerate(tree)]
        return type(tree)(items)
    return fn(tree, like)


def _redistribute(value: Any, placements: tuple) -> Any:
    """``value.redistribute`` that also serves a state dict offloaded to the CPU (``cpu_offload=True``) on an
    accelerator mesh: the collective runs on the mesh's device, the result goes back where it was."""
    mesh = value.device_mesh
    where = value.to_local().device
    if where.type == mesh.device_type:
        return value.redistribute(mesh, placements)
    module = getattr(torch, mesh.device_type)
    moved = value.to(torch.device(mesh.device_type, module.current_device()))
    return moved.redistribute(mesh, placements).to(where)


def plain_shards(tree: Any) -> Any:
    """``tree`` (a state dict, nested) with every DTensor that has a ``_StridedShard`` placement redistributed to
    plain ``Shard`` placements (same global values, contiguous local chunks), which DCP writes and reads right."""

    def convert(value: Any, _: Any) -> Any:
        if _strided_dim(value) is None:
            return value
        return _redistribute(value, _plain(value.placements))

    return _map_tree(tree, convert)


def restore_layout(tree: Any, like: Any) -> Any:
    """Undo ``plain_shards`` after a DCP load: each DTensor of ``tree`` whose counterpart in ``like`` (the state
    before ``plain_shards``) has other placements is redistributed back to them."""
    from torch.distributed.tensor import DTensor

    def convert(value: Any, ref: Any) -> Any:
        if isinstance(value, DTensor) and isinstance(ref, DTensor) and value.placements != ref.placements:
            return _redistribute(value, ref.placements)
        return value

    return _map_tree(tree, convert, like)
