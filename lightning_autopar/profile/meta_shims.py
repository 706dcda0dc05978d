"""What real code does that a meta forward must survive or see (profile/trace.py's ``meta_forward`` runs under
both): ``meta_friendly`` (autocast with the tensor's device type, BatchNorm with one value per channel, Hugging
Face's fused experts) and ``collectives_seen`` (the model's own ``torch.distributed`` calls, recorded, not run)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn


class _MetaAutocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast`` that takes ``device_type="meta"`` (code calling ``autocast(x.device.type)``, as
    torchtitan's MoE router does) as the CPU's: its casts apply to CPU tensors only, so on meta tensors it is a
    no-op, and the user's arguments (enabled, dtype) are kept."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


def _batch_norm_two_rows(batch_norm: Any) -> Any:
    """``F.batch_norm`` that normalises a meta input with one value per channel as two copies of it (the rows of
    the result: the input's)."""

    def call(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.device.type == "meta" and input.dim() >= 2 and input.numel() == input.shape[1]:
            return batch_norm(torch.cat((input, input)), *args, **kwargs)[:1]
        return batch_norm(input, *args, **kwargs)

    return call


@contextmanager
def meta_friendly(model: nn.Module) -> Iterator[None]:
    """What every meta forward runs under, so the trace survives what real code does on meta tensors:

    - Hugging Face fused experts run as ``batched_mm``: the same math and FLOPs (each routed token through its
      experts), and, unlike ``grouped_mm`` (meta kernel: bf16 only) or ``eager`` (``nonzero``), it runs on meta
      tensors of any dtype;
    - ``torch.autocast(device_type="meta")`` is accepted (``_MetaAutocast``);
    - BatchNorm in train mode does not refuse one value per channel (a trace of one row through a 1x1 feature
      map, a CIFAR-size ResNet; the meta kernel divides by n - 1): such an input is normalised as two copies
      of itself, the same shapes and, but for that one op, the same FLOPs (``_batch_norm_two_rows``)."""
    import torch.nn.functional as F

    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_experts_implementation", None) not in (None, "batched_mm")}
    saved = {key: c._experts_implementation for key, c in configs.items()}
    autocasts = (torch.autocast, torch.amp.autocast)
    batch_norm = F.batch_norm
    try:
        for c in configs.values():
            c._experts_implementation = "batched_mm"
        torch.autocast = torch.amp.autocast = _MetaAutocast
        F.batch_norm = _batch_norm_two_rows(batch_norm)
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation = saved[key]
        torch.autocast, torch.amp.autocast = autocasts
        F.batch_norm = batch_norm


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "broadcast", "broadcast_object_list", "all_to_all",
               "all_to_all_single", "gather", "scatter", "barrier", "send", "recv", "isend", "irecv")


class _Done:
    """What an async collective's stand-in returns: a work already done."""

    def wait(self, *_: Any, **__: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextmanager
def collectives_seen(stack: Any, found: list[str]) -> Iterator[None]:
    """The model's own ``torch.distributed`` collectives (``COLLECTIVES``, called as ``dist.<name>``) during a meta
    forward: recorded in ``found`` with the module calling them (the top of ``stack``, the trace's ModuleStack),
    and not run (meta tensors, and no process group needed; the tensors keep their values, which a meta tensor
    has none of). Calls from this package's or torch's own code run as they are."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def stand_in(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            import sys

            if sys._getframe(1).f_globals.get("__name__", "").startswith(("lightning_autopar.", "torch.")):
                return saved[name](*args, **kwargs)  # ours or torch's own (a parallelised module): not the model's
            where = stack.stack[-1] if stack.stack else ""
            line = f"torch.distributed.{name} in '{where or '(the model)'}'"
            if line not in found:
                found.append(line)
            return _Done() if kwargs.get("async_op") or name in ("isend", "irecv") else None

        return call

    try:
        for name in saved:
            setattr(dist, name, stand_in(name))
        yield
    finally:
        for name, func in saved.items():
            setattr(dist, name, func)
