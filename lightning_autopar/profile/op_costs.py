"""What aten ops cost on meta tensors, for the ``OpCosts`` recorder of the meta forward (profile/trace.py): FLOPs as
``FlopCounterMode`` counts them (its formulas, plus those its registry lacks), memory-bound bytes, op counts and
kinds, charged to the stack of module forwards running each op."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ELEMENT_BYTES = 4  # unit sizes are counted at 4-byte elements (the planner scales to the plan's precision)
aten = torch.ops.aten


def _cpu_sdpa_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """SDPA's CPU kernel, missing from torch's registry: the same count as the other SDPA kernels."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def flop_formulas() -> dict[Any, Any]:
    """FLOP formulas beyond torch's registry, as ``FlopCounterMode(custom_mapping=...)`` takes them."""
    return {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop}


def _registry() -> dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    return {**flop_registry, **{k: shape_wrapper(v) for k, v in flop_formulas().items()}}


CONV_OPS = {aten.convolution, aten._convolution, aten.cudnn_convolution, aten.convolution_overrideable,
            aten._slow_conv2d_forward}
# what FlopCounterMode leaves to the tensor subclass (nested tensors); never counted
SKIPPED_OPS = {aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
               aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default, aten.size.default,
               aten.sym_size.default, aten.stride.default, aten.sym_stride.default, aten.storage_offset.default,
               aten.sym_storage_offset.default, aten.numel.default, aten.sym_numel.default, aten.dim.default,
               torch.ops.prim.layout.default}
FREE_OPS = {aten._unsafe_view.default, aten.lift_fresh.default}  # metadata only, though not marked as views
OP_KINDS = {"native_batch_norm": "batchnorm", "_native_batch_norm_legit": "batchnorm",
            "_native_batch_norm_legit_no_training": "batchnorm", "cudnn_batch_norm": "batchnorm",
            "native_group_norm": "groupnorm", "native_layer_norm": "layernorm", "_fused_rms_norm": "norm",
            "embedding": "embedding", "convolution": "conv"}


def _op_kind(name: str) -> str | None:
    if "pool" in name:
        return "pool"
    if name.startswith("_scaled_dot_product") or name in ("_flash_attention_forward", "_efficient_attention_forward"):
        return "attention"
    return OP_KINDS.get(name)


def _nbytes(t: torch.Tensor, numel: int | None = None) -> int:
    """Bytes at 4-byte elements for floating tensors (the planner scales to the plan's precision), as they are
    for masks and indices."""
    n = t.numel() if numel is None else numel
    return n * (ELEMENT_BYTES if t.is_floating_point() else t.element_size())


@dataclass
class OpCost:
    """What the ops run under one stack of module forwards cost (forward, per sample)."""

    flops: float = 0.0
    conv_flops: float = 0.0
    memory_bytes: float = 0.0
    ops: int = 0
    saved_bytes: float = 0.0
    kinds: set[str] = field(default_factory=set)

    def add(self, other: OpCost) -> None:
        self.flops += other.flops
        self.conv_flops += other.conv_flops
        self.memory_bytes += other.memory_bytes
        self.ops += other.ops
        self.saved_bytes += other.saved_bytes
        self.kinds |= other.kinds


class _CostMode(TorchDispatchMode):
    """Charges each aten op to the stack of module forwards running it: FLOPs as FlopCounterMode counts them
    (same formulas, same decomposition), memory-bound bytes, op count and kinds."""

    def __init__(self, costs: OpCosts) -> None:
        super().__init__()
        self.trace = costs
        self.registry = _registry()
        self.kinds: dict[Any, str | None] = {}
        self.decomposes: dict[Any, bool] = {}  # op -> has a CompositeImplicitAutograd kernel (``_can_decompose``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SKIPPED_OPS:
            return NotImplemented
        decomposes = self.decomposes.get(func)
        if decomposes is None:  # what func.decompose tries first; without such a kernel it returns NotImplemented
            decomposes = self.decomposes[func] = func is not torch.ops.prim.device.default and func._can_decompose()
        if decomposes:
            with self:
                r = func.decompose(*args, **kwargs)
                if r is not NotImplemented:
                    return r
        out = func(*args, **kwargs)
        if func.is_view or func in FREE_OPS:
            return out
        cost = self.trace.here()
        cost.ops += 1
        packet = func._overloadpacket
        formula = self.registry.get(packet)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            cost.flops += flops
            if packet in CONV_OPS:
                cost.conv_flops += flops
        else:
            leaves = tree_flatten((args, kwargs, out))[0]
            cost.memory_bytes += sum(_nbytes(t) for t in leaves if isinstance(t, torch.Tensor))
        if func not in self.kinds:
            self.kinds[func] = _op_kind(packet.__name__)
        kind = self.kinds[func]
        if kind is None and packet in (aten._softmax, aten._safe_softmax) and args[0].dim() == 4:
            kind = "attention"
        if kind:
            cost.kinds.add(kind)
        return out
