"""Trial runs: plan P run for a few steps outside the user's fit loop, on the live process group, to measure its
step time (``AutoParallelStrategy(trials=K)`` times the K best plans before choosing). A trial leaves no state
behind: it works on a deep copy of the user's module (its parameters and optimizer untouched), restores every
RNG it may draw from, takes the batches it is given (the user's data order is not consumed), and destroys the
process sub-groups its mesh created."""

from __future__ import annotations

import contextlib
import copy
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_autopar.runtime.grads import restore_gradients
from lightning_autopar.runtime.group import DataParallelGroup, broadcast_module, dp_mesh
from lightning_autopar.runtime.pipeline_step import PipelineSteps
from lightning_autopar.runtime.step import Accumulation, StepEnv, training_step
from lightning_autopar.specs import Plan

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class RngState:
    """Every RNG a step may draw from (dropout, shuffles in user code)."""

    torch_cpu: torch.Tensor
    torch_devices: list[torch.Tensor]
    python: Any
    numpy: Any

    @classmethod
    def capture(cls) -> RngState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(torch.get_rng_state(), cuda, random.getstate(), _numpy_state())

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_devices:
            torch.cuda.set_rng_state_all(self.torch_devices)
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy

            numpy.random.set_state(self.numpy)


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()


def detached_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` that does not copy the Trainer / Fabric it is attached to (they stay shared by
    reference to nothing: the copy's references are None)."""
    memo: dict[int, Any] = {}
    for name in ("_trainer", "_fabric"):
        owner = module.__dict__.get(name)
        if owner is not None:
            memo[id(owner)] = None
    return copy.deepcopy(module, memo)


def first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The (first) optimizer of whatever ``configure_optimizers`` returned (an optimizer, a list or tuple of them
    or of ([optimizers], [schedulers]), or a dict with "optimizer")."""
    while not isinstance(configured, torch.optim.Optimizer):
        if isinstance(configured, dict):
            configured = configured["optimizer"]
        elif isinstance(configured, (list, tuple)) and configured:
            configured = configured[0]
        else:
            raise TypeError(f"configure_optimizers returned no optimizer: {configured!r}")
    return configured


@dataclass
class _TrialModel:
    """The copy with plan P applied, its optimizer and the step functions that drive it."""

    env: StepEnv
    pipeline: PipelineSteps
    plan: Plan
    optimizer: torch.optim.Optimizer
    scaler: Any
    global_batch: int

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def step(self, batch: Any) -> None:
        """One optimizer step on the global ``batch``, as the Trainer strategy runs it."""
        if self.pipeline.pipe is not None:
            self.pipeline.train(batch, (0,), {}, self.plan.grad_accum, self.global_batch)
            restore_gradients(self.env.hold.take_pipeline() or {})
        else:
            acc = Accumulation(self.plan.grad_accum)
            out = training_step(self.env, batch, (0,), {}, acc, lambda loss: self.scaled(loss).backward())
            loss = out["loss"] if isinstance(out, dict) else out
            self.env.hold.put_back_held()
            self.scaled(loss).backward()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()


def _build(module: nn.Module, plan: Plan, layout: Any, batch: Any, device: torch.device,
           layers_per_stage: Sequence[int] | None) -> tuple[_TrialModel, Any]:
    from lightning_autopar.parallel.apply import apply_plan
    from lightning_autopar.parallel.precision import ShardedGradScaler
    from lightning_autopar.runtime.analysis import analyse, sequence_length, step_model_call
    from lightning_autopar.runtime.batches import leading_size

    model, analysis, example = analyse(module, lambda: step_model_call(module, batch, "training_step"))
    if analysis.spec.unit_form:
        analysis.spec.seq_len = 1
    elif example is None:
        analysis.spec.seq_len = sequence_length(batch) or analysis.spec.seq_len
    dtype = _AUTOCAST.get(plan.precision)
    context: Callable[[], Any] = ((lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None
                                  else contextlib.nullcontext)
    env = StepEnv(module, DataParallelGroup(layout["dp_flat"], device), context, context)
    scaler = ShardedGradScaler(device=device.type) if plan.precision == "fp16-mixed" else None
    pipeline = PipelineSteps(env, lambda: scaler)
    broadcast_module(module)
    applied = apply_plan(module, model, analysis, plan, layout, dp_mesh(layout, plan), device,
                         loss_fn=pipeline.loss, layers_per_stage=layers_per_stage, example=example)
    module.to(device)
    env.fsdp_roots = applied.fsdp_roots
    pipeline.pipe, pipeline.model = applied.pipeline, applied.pipeline_root or model
    optimizer = first_optimizer(module.configure_optimizers())
    trial = _TrialModel(env, pipeline, plan, optimizer, scaler, leading_size(batch) or plan.global_batch)
    return trial, applied


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sub_groups(layout: Any, applied: Any) -> list[Any]:
    """The process groups the plan's meshes hold, less the default (world) group, which is never destroyed."""
    import torch.distributed as dist

    meshes = [layout.mesh, *layout.submeshes.values(), *(applied.expert_meshes.values() if applied else ())]
    seen: dict[int, Any] = {}
    for mesh in meshes:
        for group in mesh.get_all_groups():
            if group is not dist.group.WORLD:
                seen.setdefault(id(group), group)
    return list(seen.values())


def run_trial(module: nn.Module, plan: Plan, batches: Sequence[Any], steps: int, device: torch.device | None = None,
              layers_per_stage: Sequence[int] | None = None) -> list[float]:
    """Run ``plan`` for ``steps`` optimizer steps on a copy of ``module`` (a LightningModule: its
    ``training_step`` and ``configure_optimizers``) from its current weights, on the global batches ``batches``
    (cycled), on the live process group; return each step's wall time in seconds (device synchronised).
    The module, its parameters, the RNG states and the process groups are as before afterwards."""
    import torch.distributed as dist

    from lightning_autopar.topology.mesh import build_mesh

    if not batches or steps < 1:
        raise ValueError("a trial needs at least one batch and one step")
    device = device or next(module.parameters()).device
    rng = RngState.capture()
    layout = applied = None
    try:
        trial_module = detached_copy(module)
        layout = build_mesh(plan, device.type)
        trial, applied = _build(trial_module, plan, layout, batches[0], device, layers_per_stage)
        times = []
        for i in range(steps):
            dist.barrier()
            _synchronize(device)
            started = time.perf_counter()
            trial.step(batches[i % len(batches)])
            _synchronize(device)
            times.append(time.perf_counter() - started)
        return times
    finally:
        rng.restore()
        if layout is not None:
            for group in _sub_groups(layout, applied):
                dist.destroy_process_group(group)
