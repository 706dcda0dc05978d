"""Where the shards of TP-fused weights go when FSDP and DCP meet them.

``_StridedShard`` DTensors (``parallel.tensor``'s fused projections, ``parallel.tp_experts``) give correct full
tensors, but DCP writes a DTensor's local shard as one contiguous chunk, which a strided shard is not.
``plain_shards`` redistributes such tensors (parameters and optimizer states alike) to plain ``Shard`` placements
before a DCP save or load, ``restore_layout`` back after a load. A row-permuted weight (``parallel.row_order``)
reaches a checkpoint as W, replicated over TP, which DCP writes as is. FSDP on top must shard these parameters on
another dim than the strided or permuted one (``fsdp_placement``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.dtensor_private import plain_placements, strided_dim


def fsdp_placement(shard_size: int) -> Callable[[nn.Parameter], Any]:
    """FSDP2 ``shard_placement_fn`` for TP-sharded fused projections: a parameter whose TP placement is a
    ``_StridedShard`` on dim d, or a row-permuted one (``RowOrder``) sharded on dim d, is sharded by FSDP on the
    other dim (FSDP's default, dim 0, would cut the rank's [q_r | k_r | v_r] rows again, which no placement pair
    describes, or which the state-dict hooks' un-permuting would not expect); None (FSDP's default) otherwise."""
    from torch.distributed.tensor import Shard

    def place(param: nn.Parameter) -> Any:
        order = getattr(param, "_autopar_row_order", None)
        dim = order.dim if order is not None else strided_dim(param)
        if dim is None or param.dim() < 2:
            return None
        other = next((d for d in range(param.dim()) if d != dim and param.shape[d] % shard_size == 0), None)
        if other is None:  # FSDP's dim-0 cut of [q_r | k_r | v_r] would describe the wrong global tensor
            raise ConfigError("plan.dp_shard", f"a TP-fused weight of shape {tuple(param.shape)} has no dimension "
                              f"besides the fused one that {shard_size} data-parallel shards divide",
                              "choose dp_shard (or zero=0) so that the weight's input width divides")
        return Shard(other)

    return place


def _map_tree(tree: Any, fn: Callable[[Any, Any], Any], like: Any = None) -> Any:
    if isinstance(tree, dict):
        return {k: _map_tree(v, fn, like.get(k) if isinstance(like, dict) else None) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_map_tree(v, fn, like[i] if isinstance(like, (list, tuple)) and i < len(like) else None)
                 for i, v in enumerate(tree)]
        return type(tree)(items)
    return fn(tree, like)


def redistribute(value: Any, placements: tuple) -> Any:
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
        if strided_dim(value) is None:
            return value
        return redistribute(value, plain_placements(value.placements))

    return _map_tree(tree, convert)


def restore_layout(tree: Any, like: Any) -> Any:
    """Undo ``plain_shards`` after a DCP load: each DTensor of ``tree`` whose counterpart in ``like`` (the state
    before ``plain_shards``) has other placements is redistributed back to them."""
    from torch.distributed.tensor import DTensor

    def convert(value: Any, ref: Any) -> Any:
        if isinstance(value, DTensor) and isinstance(ref, DTensor) and value.placements != ref.placements:
            return redistribute(value, ref.placements)
        return value

    return _map_tree(tree, convert, like)
