"""The measured peak memory of a training step, per rank and by category (issue 17, "memory truth").

``measure_peak(step_fn, module, optimizer)`` runs one step under ``torch.distributed._tools.mem_tracker.MemTracker``
(a TorchDispatchMode: it sees every tensor storage the step allocates, CPU tensors too, and DTensor's local
shards, since it lets DTensor desugar first) and returns the peak with its split into parameters, gradients,
optimizer states, activations (forward outputs, recomputation included) and temporaries (backward and
collective buffers); on CUDA ``torch.cuda.max_memory_allocated`` is taken too (what the allocator held, which
counts what MemTracker does not see: cuBLAS workspaces, NCCL buffers). ``PeakMemory`` is the same measurement as
a Lightning callback around one training batch (whatever the strategy runs inside it: FSDP2, TP, pipelining).

What MemTracker sees: tensors created inside its context, plus the module's parameters / buffers and the
optimizer's states registered with ``track_external`` before the step. So the step measured must not be the first
(the optimizer's states are created by the first step), and tensors created before the step that are not
parameters, buffers or optimizer states (a pipeline schedule's persistent send/receive buffers) are not counted.
FSDP2's unsharded parameters are counted: it allocates them inside the step and grows them with
``UntypedStorage.resize_``, which MemTracker follows. DDP's gradient buckets are not (built with the reducer,
before the step): ``ddp_bucket_bytes`` gives them from the module, ``with_untracked`` adds them. Works under
DDP, FSDP2, TP / SP (DTensor), CP, EP and pipelining on gloo (benchmarks/memory.py); zero-bubble schedules split
backward with ``autograd.grad``, which MemTracker's backward hooks break: measure them with
``backward_hooks=False`` (peak right, backward temporaries counted as activations).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

GIB = 2**30
# MemTracker's reference types (torch.distributed._tools.mem_tracker._MemRefType values) -> our category names
CATEGORIES = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "temporaries", "Buffer": "buffers", "Other": "other"}


@dataclass
class MeasuredMemory:
    """One rank's peak of one step: ``peak_gib`` (MemTracker's total at its peak, all devices of the rank summed),
    ``by_category`` (GiB per CATEGORIES name at that peak), ``allocator_peak_gib`` (CUDA's max_memory_allocated
    over the step; 0 on CPU)."""

    peak_gib: float
    by_category: dict[str, float] = field(default_factory=dict)
    allocator_peak_gib: float = 0.0

    @property
    def states_gib(self) -> float:
        """Parameters + gradients + optimizer states at the peak (the planner's model states)."""
        return sum(self.by_category.get(k, 0.0) for k in ("parameters", "gradients", "optimizer"))

    @property
    def dynamic_gib(self) -> float:
        """Everything else at the peak: activations, temporaries, buffers."""
        return self.peak_gib - self.states_gib

    def to_dict(self) -> dict[str, Any]:
        return {"peak_gib": self.peak_gib, "by_category": dict(self.by_category),
                "allocator_peak_gib": self.allocator_peak_gib}


def _tracker_class() -> type:
    """MemTracker for a whole training step. (1) It accepts a root module called more than once in the step
    (torch's raises NotImplementedError: it takes a second root forward for the next iteration): a step of
    several micro-batches (grad_accum, a pipeline schedule) calls the root once per micro-batch; only the global
    peak is read here, so a repeated call just records its inputs and restarts the module's local peak
    (MemTracker's own case for a submodule called twice in one iteration). (2) Forward and backward run inside
    ``optimizer.step(closure)`` (Lightning's automatic optimization) count as activations / temporaries, not as
    optimizer states."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        def _register_global_optimizer_hook(self) -> None:
            # Lightning runs forward and backward inside optimizer.step(closure): torch's pre-hook would count
            # them as optimizer states; the closure runs with the optimizer flag off
            super()._register_global_optimizer_hook()
            outer = self._optimizer_hook_handles[0]
            outer.remove()

            def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> Any:
                self._in_opt = True
                return _closure_outside_opt(self, args, kwargs)

            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._optimizer_hook_handles = (register_optimizer_step_pre_hook(pre_hook),
                                            self._optimizer_hook_handles[1])

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if module not in self.memory_tracking or self._mod_tracker.is_bw:
                return super()._pre_fw_hook(module, inputs)
            stats = self.memory_tracking[module]
            stats.input_mem = self._track_inputs_or_outputs(inputs)
            snap = self.get_tracker_snapshot()
            stats.local_peak = {dev: dev_snap["Total"] for dev, dev_snap in snap.items()}

    return StepMemTracker


def _closure_outside_opt(tracker: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """optimizer.step's (args, kwargs) with its closure (``closure=`` or the argument after the optimizer: a step
    pre-hook gets ``(optimizer, closure, ...)``) wrapped to run with the tracker's optimizer flag off; None when
    there is no closure."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None

    def wrapped() -> Any:
        tracker._in_opt = False
        try:
            return closure()
        finally:
            tracker._in_opt = True

    if "closure" in kwargs:
        return args, {**kwargs, "closure": wrapped}
    return (args[0], wrapped, *args[2:]), kwargs


def _forward_only_mod_tracker() -> Any:
    """A ModTracker without the gradient hooks it puts on every module's inputs and outputs to see backward:
    those hooks fail under a split backward (a zero-bubble schedule's ``autograd.grad`` on the stage inputs,
    torch.distributed.pipelining._backward: "A leaf node was passed to _will_engine_execute_node"). Without them
    backward's temporaries are counted as activations; the peak total is unchanged."""
    from torch.distributed._tools.mod_tracker import ModTracker

    class ForwardOnlyModTracker(ModTracker):
        def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
            if not torch._dynamo.eval_frame._is_in_optimized_module():
                name, w_mod = self._get_mod_name(mod), weakref.ref(mod)
                self._get_append_fn(w_mod, name, False)()
                if self._user_pre_fw_hook is not None:
                    self._user_pre_fw_hook(mod, input)

        def _fw_post_hook(self, mod: nn.Module, input: Any, output: Any) -> None:
            if not torch._dynamo.eval_frame._is_in_optimized_module():
                if self._user_post_fw_hook is not None:
                    self._user_post_fw_hook(mod, input, output)
                self._get_pop_fn(weakref.ref(mod), self._get_mod_name(mod), False)()

    return ForwardOnlyModTracker()


def _tracker(module: nn.Module, optimizer: torch.optim.Optimizer | None, backward_hooks: bool = True,
             module_peaks: bool = True) -> Any:
    """A MemTracker with the module's parameters / buffers and the optimizer's states registered
    (``backward_hooks=False``: _forward_only_mod_tracker). ``module_peaks=False``: only the global peak is kept
    (MemTracker otherwise walks every module's statistics after every op: a cost of ops x modules, minutes for
    an 80-layer model's step under ``autopar simulate``)."""
    tracker = _tracker_class()()
    if not backward_hooks:
        tracker._mod_tracker = _forward_only_mod_tracker()
    if not module_peaks:
        tracker._update_peak_stats = lambda peak_state: _global_peak(tracker)
    tracker.track_external(module, *([optimizer] if optimizer is not None else []))
    if optimizer is not None:
        _track_host_copies(tracker, optimizer)
    return tracker


def _global_peak(tracker: Any) -> None:
    """MemTracker._update_peak_stats without the per-module part (torch 2.13's private fields)."""
    from copy import deepcopy

    for dev, dev_snap in tracker._curr_mem_snap.items():
        total = dev_snap["Total"]
        if tracker._peak_mem.get(dev, 0) < total:
            tracker._peak_mem[dev] = total
            tracker._peak_mem_snap[dev] = deepcopy(dev_snap)


def _track_host_copies(tracker: Any, optimizer: torch.optim.Optimizer) -> None:
    """offload=optimizer: the host mirrors of the parameters and their gradient buffers, made before the measured
    step, counted as parameters and gradients. The step's owner declares them (``parallel.offload.HostStep.
    host_copies``); an optimizer without one holds none."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    step_owner = getattr(getattr(optimizer, "_optimizer", optimizer).step, "__self__", None)
    declared = getattr(step_owner, "host_copies", None)
    if declared is None:
        return
    params, grads = declared()
    for tensors, kind in ((params, _MemRefType.PARAM), (grads, _MemRefType.GRAD)):
        for t in tensors:
            tracker._update_and_maybe_create_winfos(t, kind)


def _from_tracker(tracker: Any, allocator_peak: int = 0) -> MeasuredMemory:
    """The peak snapshot summed over the rank's devices, split by category."""
    snap = tracker.get_tracker_snapshot("peak")
    by: dict[str, float] = {}
    total = 0
    for dev_snap in snap.values():
        for key, nbytes in dev_snap.items():
            if key == "Total":
                total += nbytes
                continue
            name = CATEGORIES.get(str(getattr(key, "value", key)), str(key))
            by[name] = by.get(name, 0.0) + nbytes / GIB
    return MeasuredMemory(peak_gib=total / GIB, by_category=by, allocator_peak_gib=allocator_peak / GIB)


def _cuda_reset(on_cuda: bool) -> None:
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _cuda_peak(on_cuda: bool) -> int:
    if not on_cuda:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _on_cuda(module: nn.Module) -> bool:
    return any(p.device.type == "cuda" for p in module.parameters())


def measure_peak(step_fn: Callable[[], Any], module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 backward_hooks: bool = True) -> MeasuredMemory:
    """Run ``step_fn()`` (forward, backward, optimizer step) once under MemTracker; its peak by category. Run a
    step before this one, so that the optimizer's states exist and are counted from the start.
    ``backward_hooks=False`` for a split backward (zero-bubble pipeline schedules): see _forward_only_mod_tracker."""
    on_cuda = _on_cuda(module)
    tracker = _tracker(module, optimizer, backward_hooks)
    _cuda_reset(on_cuda)
    with tracker:
        step_fn()
    return _from_tracker(tracker, _cuda_peak(on_cuda))


def peak_memory_callback(measure_batches: tuple[int, ...] = (1,), backward_hooks: bool = True) -> Any:
    """A Lightning callback measuring the training batches ``measure_batches`` (indices in the fit; the first is
    not measured by default: it creates the optimizer's states) with MemTracker around on_train_batch_start ..
    on_train_batch_end, which holds the strategy's whole step (every micro-batch, the gradient reduction and the
    optimizer step). ``.measured``: one MeasuredMemory per measured batch. ``backward_hooks``: as measure_peak."""
    import lightning.pytorch as L

    class PeakMemory(L.Callback):
        def __init__(self) -> None:
            self.measured: list[MeasuredMemory] = []
            self._tracker: Any = None
            self._on_cuda = False

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step not in measure_batches:
                return
            self._on_cuda = _on_cuda(pl_module)
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            self._tracker = _tracker(pl_module, optimizer, backward_hooks)
            _cuda_reset(self._on_cuda)
            self._tracker.__enter__()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self._tracker is None:
                return
            self._tracker.__exit__(None, None, None)
            self.measured.append(_from_tracker(self._tracker, _cuda_peak(self._on_cuda)))
            self._tracker = None

        @property
        def peak(self) -> MeasuredMemory:
            """The measured batch with the highest peak."""
            return max(self.measured, key=lambda m: m.peak_gib)

    return PeakMemory()


def ddp_bucket_bytes(module: nn.Module) -> int:
    """Bytes of DDP's gradient buckets in ``module`` (composable ``replicate`` units): MemTracker does not see them
    (the reducer allocates them when it is built, before any measured step, outside the parameters, gradients and
    optimizer states it can register). With ``gradient_as_bucket_view=False`` (parallel.fsdp.apply_replicate)
    they hold a copy of every gradient: the bytes of the replicated parameters that require grad."""
    from torch.distributed._composable.contract import _get_registry

    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        if "replicate" not in (_get_registry(sub) or {}):
            continue
        for p in sub.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def with_untracked(measured: MeasuredMemory, name: str, nbytes: int) -> MeasuredMemory:
    """``measured`` plus memory held through the whole step that MemTracker did not see (``name``: its category)."""
    if nbytes <= 0:
        return measured
    by = {**measured.by_category, name: measured.by_category.get(name, 0.0) + nbytes / GIB}
    return MeasuredMemory(measured.peak_gib + nbytes / GIB, by, measured.allocator_peak_gib)
