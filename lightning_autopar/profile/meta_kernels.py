"""Meta kernels run once per signature: ``MetaKernelCache``, the innermost dispatch mode of every meta forward
(profile/trace.py).

Many aten ops have a Python meta kernel (a reference decomposition: BatchNorm's costs ~3 ms a call, an elementwise
op's ~0.2-0.5 ms), and a model repeats the same op on the same shapes block after block. A meta kernel reads only
its inputs' metadata (shapes, strides, dtypes, the other arguments), so an op's outputs are known once the same
op has run on the same metadata: the cache answers a repeated call with fresh empty tensors of the recorded
shapes, strides, dtypes and storage sizes, never calling the kernel again. What it serves is what the kernel
returns: fresh outputs, no aliasing. Only ops that cannot alias or mutate (no alias annotation in the schema),
on strided, non-complex meta tensors and arguments of plain types, returning tensors, are cached; the first call
of each signature runs the kernel and is kept only if its outputs are fresh (no input's storage, none shared)
and rebuilt exactly (same strides, zero offset, same storage size). Anything else runs the kernel as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
_UNCACHED = object()  # a signature whose outputs the cache cannot rebuild: the kernel runs each time
_NO_KEY = object()  # an argument the cache does not key on: the kernel runs


def _key(value: Any, storages: list[int]) -> Any:
    """A hashable description of an argument: a tensor by its metadata (its storage noted in ``storages``), a
    plain value with its type (1, 1.0 and True promote differently), lists and tuples element-wise; ``_NO_KEY``
    for anything else."""
    if isinstance(value, torch.Tensor):
        if not value.is_meta or value.layout is not torch.strided or value.is_complex() or \
                type(value) not in (torch.Tensor, torch.nn.Parameter):
            return _NO_KEY
        storages.append(value.untyped_storage()._cdata)
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        keys = tuple(_key(v, storages) for v in value)
        return _NO_KEY if any(k is _NO_KEY for k in keys) else (type(value), keys)
    if type(value) in _PLAIN:
        return (type(value), value)
    return _NO_KEY


def _cacheable(func: Any) -> int:
    """0: an op whose outputs may alias its inputs (a view, an in-place or ``out=`` op, a non-Tensor return);
    1: its outputs are fresh tensors by its schema; 2: they are, and it writes to an argument (BatchNorm's running
    statistics: data, which meta tensors lack; that it leaves their metadata as it was is checked)."""
    schema = func._schema
    if func.is_view or not schema.returns or any(r.alias_info is not None or r.type.kind() != "TensorType"
                                                 for r in schema.returns):
        return 0
    return 2 if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments) else 1


class MetaKernelCache(TorchDispatchMode):
    """Answers an op on meta tensors it has seen with the same metadata from the recorded outputs (module doc).
    One mode per meta forward; what they record is shared by the process (the kernels do not change)."""

    ops: dict[Any, int] = {}  # op -> cacheable by its schema (``_cacheable``)
    outputs: dict[Any, Any] = {}  # (op, default dtype, arguments' key) -> the outputs' metadata, or _UNCACHED

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cacheable = self.ops.get(func)
        if cacheable is None:
            cacheable = self.ops[func] = _cacheable(func)
        if not cacheable:
            return func(*args, **kwargs)
        storages: list[int] = []
        key = (func, torch.get_default_dtype(), _key(args, storages), _key(tuple(sorted(kwargs.items())), storages))
        if key[2] is _NO_KEY or key[3] is _NO_KEY or not storages:
            # not keyed; or a factory op: its device comes from the arguments, which may not be meta
            return func(*args, **kwargs)
        recorded = self.outputs.get(key)
        if recorded is _UNCACHED:
            return func(*args, **kwargs)
        if recorded is not None:
            outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in recorded]
            return outs[0] if len(func._schema.returns) == 1 else tuple(outs)
        out = func(*args, **kwargs)
        if cacheable == 2 and key[2:] != (_key(args, []), _key(tuple(sorted(kwargs.items())), [])):
            self.outputs[key] = _UNCACHED  # it changed an argument's metadata: the kernel runs each time
        else:
            self.outputs[key] = self._record(out, storages)
        return out

    @staticmethod
    def _record(out: Any, inputs: list[int]) -> Any:
        """The outputs' (shape, stride, dtype), or ``_UNCACHED`` when a rebuilt one would differ from the kernel's:
        an input's or another output's storage, an offset, a larger storage than the strides need."""
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        seen = set(inputs)
        recorded = []
        for t in outs:
            if not isinstance(t, torch.Tensor) or not t.is_meta or t.layout is not torch.strided or \
                    type(t) is not torch.Tensor or t.storage_offset():
                return _UNCACHED
            storage = t.untyped_storage()
            if storage._cdata in seen:
                return _UNCACHED
            seen.add(storage._cdata)
            shape, stride = tuple(t.shape), t.stride()
            rebuilt = torch.empty_strided(shape, stride, dtype=t.dtype, device="meta")
            if rebuilt.untyped_storage().nbytes() != storage.nbytes():
                return _UNCACHED
            recorded.append((shape, stride, t.dtype))
        return recorded

