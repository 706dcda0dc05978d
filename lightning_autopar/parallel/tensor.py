"""Tensor parallelism (Megatron layouts through DTensor), derived from the traced analysis.

Per block: q, k, v (or the MLP's up and gate) are split by columns (each rank owns whole heads / a slice of the
FFN), o and down by rows (partial sums all-reduced), so each block costs two all-reduces forward and two
backward. MoE experts are split the same way inside each expert; the router stays replicated. Experts stored as
fused 3-D weights (HF Mixtral's ``gate_up_proj`` fuses gate and up along dim 1) are not split: ``check_tp``
rejects tp > 1 for them and the strategy plans tp=1 (EP and FSDP shard them instead). Embeddings, norms and the
LM head stay replicated across the TP group.

Separate nn.Linear projections use torch's ``ColwiseParallel`` / ``RowwiseParallel``. Two layouts need their own
style (``LocalShard``), because torch's styles accept only nn.Linear and split a weight into contiguous blocks:

* fused projections (GPT-2's ``c_attn``, litgpt's and nanoGPT's ``qkv``, Phi-3's ``qkv_proj`` and
  ``gate_up_proj``): the model cuts the output into [q | k | v] (or [gate | up]) and then into heads, so TP rank
  r must hold rows r of *each* piece. That is DTensor's ``_StridedShard(dim, split_factor=pieces)``: the global
  tensor stays the single-device one (``full_tensor``, ``get_model_state_dict(full_state_dict=True)``) and the
  local shard is [q_r | k_r | v_r], so the model's own ``split`` works. Layouts interleaved per kv group (a view
  into (groups, q_per_kv + 2, head_dim)) are a plain ``Shard``. A fused bias stays replicated; each rank adds
  its slice and the slices' gradients are summed over the TP group in backward;
* transposed projections (GPT-2's Conv1D, weight [in, out]): column split is Shard(1) of the weight and Shard(0)
  of the bias, row split Shard(0) of the weight with the bias added once, after the sum.

A ``LocalShard`` module computes with its local shards as plain tensors (its own forward, unchanged), with the
collectives of Megatron's f / g around it. What the model's own code must see divided (a head count, GPT-2's
``split_size``, litgpt's ``config.n_head`` -- litgpt's config is shared, so each attention module gets its own
shallow copy) was found by the analysis's meta dry run (``AttentionInfo.tp_attrs``); when no division lets the
code run on local shapes (nanoGPT's ``view(B, T, n_head, C // n_head)`` with C the full width), ``check_tp``
refuses tp > 1 with that reason.

Checkpoints: ``_StridedShard`` DTensors give correct full tensors, but DCP writes a DTensor's local shard as one
contiguous chunk, which a strided shard is not. ``plain_shards`` redistributes such tensors (parameters and
optimizer states alike) to plain ``Shard`` placements before a DCP save or load, ``restore_layout`` back after a
load. FSDP on top must shard these parameters on another dim than the strided one (``fsdp_placement``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.profile.analyze import (AttentionInfo, BlockInfo, MLPInfo, ModelAnalysis, divide_attributes,
                                               leaf_width_attributes)

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
            raise ConfigError("plan.tp", f"{block.fqn}.{block.moe.fqn}: experts with a fused gate/up projection "
                              f"({block.moe.expert_mlp.gate_up}) are not split by TP", "use tp=1")
        if block.moe is not None and block.moe.fused:
            raise ConfigError("plan.tp", f"{block.fqn}.{block.moe.fqn}: experts stored as fused 3-D weights "
                              f"({', '.join(block.moe.fused_params)}) are not split by TP",
                              "use tp=1 (ep and dp shard these experts)")
    if structure_only:
        return
    if spec.heads % tp or spec.kv_heads % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide heads={spec.heads} and kv_heads={spec.kv_heads}",
                          f"choose tp among the common divisors of {spec.heads} and {spec.kv_heads}")
    if spec.ffn_hidden % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide ffn_hidden={spec.ffn_hidden}", "choose a divisor")


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
    [in, out]; ``pieces`` > 1: a fused [a | b | c] output, each rank holding its part of every piece."""

    kind: str
    transposed: bool = False
    pieces: int = 1


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
            if spec.kind == "col":
                w_place = _StridedShard(out_dim, split_factor=spec.pieces) if spec.pieces > 1 else Shard(out_dim)
                b_place = Replicate() if spec.pieces > 1 else Shard(0)
                for attr in leaf_width_attributes(module, out_features):
                    setattr(module, attr, getattr(module, attr) // tp)
            else:
                w_place, b_place = Shard(1 - out_dim), Replicate()
            for name, place in (("weight", w_place), ("bias", b_place)):
                param = getattr(module, name, None)
                if isinstance(param, nn.Parameter):
                    module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [place]),
                                                                 requires_grad=param.requires_grad))
            group = device_mesh.get_group()
            bias_index = None
            if spec.kind == "col" and spec.pieces > 1 and getattr(module, "bias", None) is not None:
                bias_index = piece_index(out_features, spec.pieces, tp, device_mesh.get_local_rank())
            module.register_forward_pre_hook(_pre_hook(spec, group, bias_index), with_kwargs=True)
            module.register_forward_hook(_post_hook(spec, group))
            return module

    return LocalShard


def _pre_hook(spec: LocalShardSpec, group: Any, bias_index: torch.Tensor | None) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        params = module._parameters
        module._tp_stash = {name: params[name] for name in ("weight", "bias") if params.get(name) is not None}
        params["weight"] = module._tp_stash["weight"].to_local()
        bias = module._tp_stash.get("bias")
        if bias is not None:
            local = bias.to_local()
            if spec.kind == "row":  # added once, after the sum (post hook)
                params["bias"] = torch.zeros_like(local).detach()
            elif bias_index is not None:
                params["bias"] = _SliceOfReplicated.apply(local, bias_index.to(local.device), group)
            else:
                params["bias"] = local
        if spec.kind == "col" and args:
            args = (_CopyToTP.apply(args[0], group), *args[1:])
        return args, kwargs

    return hook


def _post_hook(spec: LocalShardSpec, group: Any) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor):
        module._parameters.update(module._tp_stash)
        module._tp_stash = {}
        if spec.kind != "row":
            return output
        output = _ReduceFromTP.apply(output, group)
        bias = module._parameters.get("bias")
        return output if bias is None else output + bias.to_local()

    return hook


# ------------------------------------------------------------------------------------------- layouts


def _style(name: str, kind: str, transposed: set[str], pieces: int = 1) -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name not in transposed and pieces == 1:
        return ColwiseParallel() if kind == "col" else RowwiseParallel()
    return _local_style()(LocalShardSpec(kind, name in transposed, pieces))


def _mlp_layout(prefix: str, mlp: MLPInfo) -> dict:
    join = (lambda n: f"{prefix}.{n}" if prefix else n)
    flipped = set(mlp.transposed)
    layout = {join(mlp.up): _style(mlp.up, "col", flipped, 2 if mlp.gate_up else 1),
              join(mlp.down): _style(mlp.down, "row", flipped)}
    if mlp.gate:
        layout[join(mlp.gate)] = _style(mlp.gate, "col", flipped)
    return layout


def _attention_layout(attn: AttentionInfo) -> dict:
    flipped = set(attn.transposed)
    if attn.qkv:
        pieces = 3 if attn.qkv_layout == "sequential" else 1
        layout = {f"{attn.fqn}.{attn.qkv}": _style(attn.qkv, "col", flipped, pieces)}
    else:
        layout = {f"{attn.fqn}.{name}": _style(name, "col", flipped) for name in (attn.q, attn.k, attn.v)}
    layout[f"{attn.fqn}.{attn.o}"] = _style(attn.o, "row", flipped)
    return layout


def block_layout(block: BlockInfo, num_experts_local: int | None = None) -> dict:
    """FQN (relative to the block) -> ParallelStyle for one block."""
    attn = block.attention
    assert attn is not None
    layout = _attention_layout(attn)
    if block.mlp is not None:
        layout.update(_mlp_layout(block.mlp.fqn, block.mlp))
    if block.moe is not None and block.moe.expert_mlp is not None:
        base = f"{block.moe.fqn}.{block.moe.experts}" if block.moe.fqn else block.moe.experts
        count = block.moe.num_experts if num_experts_local is None else num_experts_local
        for e in range(count):
            layout.update(_mlp_layout(f"{base}.{e}", block.moe.expert_mlp))
    return layout


def apply_tensor_parallel(transformer: nn.Module, analysis: ModelAnalysis, tp_mesh: DeviceMesh) -> None:
    """Shard every block of ``transformer`` over ``tp_mesh`` in place; parameter names are unchanged."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check_tp(analysis, tp)
    if tp == 1:
        return
    for info in analysis.blocks:
        block = transformer.get_submodule(info.fqn)
        moe_list = None
        if info.moe is not None:
            moe_mod = block.get_submodule(info.moe.fqn) if info.moe.fqn else block
            moe_list = len(moe_mod.get_submodule(info.moe.experts))  # EP may have removed remote experts
        parallelize_module(block, tp_mesh, block_layout(info, moe_list))
        divide_attributes(block.get_submodule(info.attention.fqn), info.attention.tp_attrs, tp)


# ------------------------------------------------------------------------------------------- FSDP and DCP


def _strided_dim(tensor: Any) -> int | None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return None
    return next((p.dim for p in tensor.placements if isinstance(p, _StridedShard)), None)


def fsdp_placement(shard_size: int) -> Callable[[nn.Parameter], Any]:
    """FSDP2 ``shard_placement_fn`` for TP-sharded fused projections: a parameter whose TP placement is a
    ``_StridedShard`` on dim d is sharded by FSDP on the other dim (FSDP's default, dim 0, would cut the rank's
    [q_r | k_r | v_r] rows again, which no placement pair describes); None (FSDP's default) otherwise."""
    from torch.distributed.tensor import Shard

    def place(param: nn.Parameter) -> Any:
        dim = _strided_dim(param)
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
