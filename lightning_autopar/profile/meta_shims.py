"""What real code does that a meta forward must survive or see (profile/trace.py's ``meta_forward`` runs under
both): ``meta_friendly`` (autocast with the tensor's device type, BatchNorm with one value per channel, Hugging
Face's fused experts) and ``collectives_seen`` (the model's own ``torch.distributed`` calls, recorded, not run)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_autopar.profile.records import one_class_children


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


def _value_check_on_meta(check: Callable[..., None], cond_at: int) -> Callable[..., None]:
    """``torch._check_tensor_all`` / ``_check_tensor_all_with`` that pass a meta condition: a runtime check of a
    tensor's values (Hugging Face's ``torch_compilable_check``: a VLM's image tokens = its image features) has no
    values to check on meta tensors; any other tensor is checked."""

    def call(*args: Any, **kwargs: Any) -> None:
        cond = args[cond_at] if len(args) > cond_at else kwargs.get("cond")
        if isinstance(cond, torch.Tensor) and cond.device.type == "meta":
            return None
        return check(*args, **kwargs)

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
      of itself, the same shapes and, but for that one op, the same FLOPs (``_batch_norm_two_rows``);
    - an experts container that loops over the experts its tokens were routed to (Switch Transformers' experts:
      the experts hit from ``nonzero``, each picked by a tensor's value) cannot run on meta tensors: where its
      forward fails for that, each expert runs once on the expected rows instead (``_expert_loop_stand_in``);
    - torch's checks of a tensor's values pass on meta tensors, which have none (``_value_check_on_meta``)."""
    import torch.nn.functional as F

    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_experts_implementation", None) not in (None, "batched_mm")}
    saved = {key: c._experts_implementation for key, c in configs.items()}
    autocasts = (torch.autocast, torch.amp.autocast)
    batch_norm = F.batch_norm
    loops = [m for name, m in model.named_modules() if name and _expert_container(m)]
    own = [m.__dict__.get("forward") for m in loops]  # a forward set on the instance, if any
    checks = torch._check_tensor_all, torch._check_tensor_all_with
    try:
        torch._check_tensor_all = _value_check_on_meta(checks[0], 0)
        torch._check_tensor_all_with = _value_check_on_meta(checks[1], 1)
        for c in configs.values():
            c._experts_implementation = "batched_mm"
        torch.autocast = torch.amp.autocast = _MetaAutocast
        F.batch_norm = _batch_norm_two_rows(batch_norm)
        for m in loops:
            m.forward = _expert_loop_stand_in(m, m.forward)
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation = saved[key]
        torch.autocast, torch.amp.autocast = autocasts
        torch._check_tensor_all, torch._check_tensor_all_with = checks
        F.batch_norm = batch_norm
        for m, previous in zip(loops, own):
            if previous is None:
                del m.forward
            else:
                m.forward = previous


def _expert_container(module: nn.Module) -> bool:
    """A module with a forward of its own whose children are >= 2 modules of one class, each with parameters:
    what holds a layer's experts and dispatches to them itself."""
    children = one_class_children(module)
    return bool(children) and type(module).forward is not nn.Module.forward \
        and all(any(True for _ in c.parameters()) for c in children)


def _data_dependent(err: BaseException) -> bool:
    """A failure a meta tensor causes by having no values (a count such as ``nonzero``, ``.item()``)."""
    return isinstance(err, NotImplementedError) or "meta" in str(err)


def _expert_loop_stand_in(container: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
    """``container``'s forward; where it is called as experts are (the tokens, rows x width, first, and the
    routing: at least one more tensor) and fails on meta tensors for want of values, each expert (child) runs
    once on the expected rows of the tokens: rows // E, a top-1 routing's share, added back into a result of the
    tokens' shape. Any other failure is the forward's own (a model of two Linears on one input is no experts)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- re-raised unless it is a meta tensor's lack of values
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            tokens = tensors[0] if tensors else None
            if not (tokens is not None and tokens.is_meta and tokens.dim() == 2 and len(tensors) >= 2
                    and _data_dependent(err)):
                raise
            experts = list(container.children())
            rows = max(1, tokens.shape[0] // len(experts))
            out = torch.zeros_like(tokens)
            for expert in experts:
                out = out.index_add(0, torch.arange(rows, device=tokens.device), expert(tokens[:rows]).to(out.dtype))
            return out

    return forward


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
