"""Trial runs: plan P run for a few steps outside the user's fit loop, on the live process group, to measure its
step time (``AutoParallelStrategy(trials=K)`` times the K best plans before choosing). A trial leaves no state
behind: it works on a deep copy of the user's module (its parameters and optimizer untouched), restores every
RNG it may draw from, takes the batches it is given (the user's data order is not consumed), and destroys the
process sub-groups its mesh created."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.runtime.grads import restore_gradients
from lightning_autopar.runtime.group import DataParallelGroup, broadcast_module, dp_mesh
from lightning_autopar.runtime.pipeline_step import PipelineSteps
from lightning_autopar.runtime.step import Accumulation, StepEnv, training_step
from lightning_autopar.specs import Plan, TrialResult

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

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def step(self, batch: Any) -> None:
        """One optimizer step on the global ``batch``, as the Trainer strategy runs it."""
        if self.pipeline.pipe is not None:
            self.pipeline.train(batch, (0,), {}, self.plan.grad_accum)
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


@dataclass
class SharedAnalysis:
    """A transformer's analysis and its capabilities record, made by the first of several builds of identical
    copies of one model (a simulation builds a fresh copy per rank) and given to the others: the analysis traces
    the whole model and the plan's checks run meta forwards, each the same for every copy. Empty until the first
    build fills it; a model analysed from the user's call (unit form) is analysed by every build, its call's
    tensors belonging to that build."""

    path: str | None = None  # the analysed model's path in the root
    analysis: Any = None  # as analysed, before any build changed it
    capabilities: Any = None  # the first build's record, filled by its checks

    def seed(self, root: nn.Module, model: nn.Module, analysis: Any) -> None:
        """Start from an analysis made before the builds: ``model`` (a transformer analysed on token ids) in
        ``root``, a module the builds copy (the strategy's ``simulate=True`` has analysed the user's module)."""
        path = next((name for name, child in root.named_modules() if child is model), None)
        if path is not None:  # else the builds analyse as usual
            self.path, self.analysis, self.capabilities = path, copy.deepcopy(analysis), None

    def release_build(self) -> None:
        """Let the last build's model go: the record keeps its checks' outcomes and plain facts, not the memos
        holding that build's modules (``Capabilities.for_copy``), so a trial's copy is freed when its trial ends."""
        if self.capabilities is not None:
            self.capabilities = self.capabilities.for_copy()

    def analysed(self, module: nn.Module, batch: Any) -> tuple[nn.Module, Any, tuple[tuple, dict] | None, Any]:
        """(the model the plan applies to, its analysis, the user's call of it or None, the capabilities record
        to build with or None) for ``module``, a copy of the model the first build analysed."""
        from lightning_autopar.parallel.capabilities import Capabilities
        from lightning_autopar.runtime.analysis import analyse, step_model_call

        if self.path is not None:
            first = self.capabilities is None  # seeded (``seed``): this first build's checks fill the record
            if first:
                self.capabilities = Capabilities.of(self.analysis)
            return (module.get_submodule(self.path), copy.deepcopy(self.analysis), None,
                    self.capabilities if first else self.capabilities.for_copy())
        model, analysis, example = analyse(module, lambda: step_model_call(module, batch, "training_step"))
        if example is not None:
            return model, analysis, example, None
        self.path = next(name for name, child in module.named_modules() if child is model)
        self.analysis, self.capabilities = copy.deepcopy(analysis), Capabilities.of(analysis)
        return model, analysis, None, self.capabilities


def _build(module: nn.Module, plan: Plan, layout: Any, batch: Any, device: torch.device,
           layers_per_stage: Sequence[int] | None,
           shared: SharedAnalysis | None = None, fake: bool = False) -> tuple[_TrialModel, Any]:
    """The trial model: ``module`` analysed (or given ``shared``'s analysis), ``plan`` applied, its optimizer.
    ``fake``: ``module`` holds fake tensors (a simulation), whose values no broadcast need make the same."""
    from lightning_autopar.parallel.apply import apply_plan
    from lightning_autopar.parallel.precision import ShardedGradScaler
    from lightning_autopar.runtime.analysis import sequence_length

    model, analysis, example, capabilities = (shared or SharedAnalysis()).analysed(module, batch)
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
    if not fake:
        broadcast_module(module)
    applied = apply_plan(module, model, analysis, plan, layout, dp_mesh(layout, plan), device,
                         loss_fn=pipeline.loss, layers_per_stage=layers_per_stage, example=example,
                         capabilities=capabilities)
    if any(t.device != device for t in (*module.parameters(), *module.buffers())):
        module.to(device)  # (a simulation's fake tensors are on it: their DDP-wrapped parameters cannot be swapped)
    env.fsdp_roots = applied.fsdp_roots
    pipeline.pipe, pipeline.model = applied.pipeline, applied.pipeline_root or model
    optimizer = first_optimizer(module.configure_optimizers())
    trial = _TrialModel(env, pipeline, plan, optimizer, scaler)
    return trial, applied


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_trial(module: nn.Module, plan: Plan, batches: Sequence[Any], steps: int, device: torch.device | None = None,
              layers_per_stage: Sequence[int] | None = None, shared: SharedAnalysis | None = None) -> list[float]:
    """Run ``plan`` for ``steps`` optimizer steps on a copy of ``module`` (a LightningModule: its
    ``training_step`` and ``configure_optimizers``) from its current weights, on the global batches ``batches``
    (cycled), on the live process group; return each step's wall time in seconds (device synchronised).
    The module, its parameters and the RNG states are as before afterwards; the mesh's process groups stay for
    the next mesh of the same shape (topology.mesh.build_mesh). ``shared``: the model's analysis, for every
    trial of one set-up (``SharedAnalysis``; default: the copy is analysed)."""
    import torch.distributed as dist

    from lightning_autopar.topology.mesh import build_mesh

    if not batches or steps < 1:
        raise ValueError("a trial needs at least one batch and one step")
    device = device or next(module.parameters()).device
    rng = RngState.capture()
    try:
        trial_module = detached_copy(module)
        layout = build_mesh(plan, device.type)
        trial, _ = _build(trial_module, plan, layout, batches[0], device, layers_per_stage, shared)
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


# ------------------------------------------------------------------ set-up measurement: settings, trials, outcome

TRIAL_WARMUP, TRIAL_TIMED = 1, 3  # steps per trial: the first pays the lazy inits and allocator growth, untimed
AUTO_TRIALS_MAX = 3  # trials=None runs at most this many
# Below this much set-up budget nothing is measured automatically: a useful profile (collectives, blocks, fixed
# costs) of even a tiny GPT took 0.7 s on 4 CPU processes here, and short runs (tests, examples) start as before.
MIN_SETUP_S = 1.0
# When that share is below MIN_SETUP_S, a run of at least QUICK_MIN_STEPS steps still gets the quick measurement
# (issue 30: README's main job, 120 steps, was predicted at 0.0327 s/step from the preset and measured ~0.6 s):
# the best plan's collectives and the user's own training step at its micro-batch (profile_runtime on that one
# plan), then a trial of it if the budget has room; at most QUICK_SETUP_S. A run of 50 steps of a tiny model
# takes tens of seconds on CPU processes, so the quick measurement is a few steps' worth of it; shorter runs
# (tests, smoke runs) start at once and their report says the figures are the preset's.
QUICK_SETUP_S = 4.0
QUICK_MIN_STEPS = 50
# A trial's copy, plan apply and optimizer build before its first step, until a trial has measured it (a tiny GPT
# on 4 CPU processes here: 0.2-0.5 s); the automatic trial count uses it.
TRIAL_BUILD_GUESS_S = 0.5


def _setup_error(name: str, value: Any, problem: str) -> ConfigError:
    return ConfigError(name, f"{problem}, got {value!r}")


@dataclass(frozen=True)
class SetupSettings:
    """What the strategies measure at set-up (their constructor arguments; Hydra ``planner.*``).

    trials: plans run for a few steps before choosing (None: as many as fit the set-up budget, at most
    AUTO_TRIALS_MAX; 0: none). profile: runtime profiling (None: when the budget allows; False: never; True:
    always, within profile_budget_s). The automatic budget is min(profile_budget_s, profile_fraction x the
    planned run's predicted seconds). profile_cache: a directory (None: ``profile.runtime.cache_dir()``;
    False: no cache)."""

    trials: int | None = None
    profile: bool | None = None
    profile_budget_s: float = 10.0
    profile_fraction: float = 0.02
    profile_cache: str | bool | None = None

    def __post_init__(self) -> None:
        t = self.trials
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            raise _setup_error("trials", t, "must be an integer >= 0 (0: no trials) or None (automatic)")
        if self.profile is not None and not isinstance(self.profile, bool):
            raise _setup_error("profile", self.profile, "must be true, false or None (automatic)")
        for name, high in (("profile_budget_s", float("inf")), ("profile_fraction", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
                raise _setup_error(name, value, f"must be a number in [0, {high:g}]")
        cache = self.profile_cache
        if cache is not None and not isinstance(cache, (bool, str, os.PathLike)):
            raise _setup_error("profile_cache", cache, "must be a directory, false (no cache) or None (default)")

    @property
    def candidates(self) -> int:
        """Plans the planner must return so the trials have distinct ones."""
        return AUTO_TRIALS_MAX if self.trials is None else self.trials

    def budget_s(self, planned_run_s: float | None, steps: int | None = None) -> float:
        """Seconds set-up measurement may take: profile=True -> profile_budget_s; else min(profile_budget_s,
        profile_fraction x planned_run_s), 0 without a planned run (Fabric); below MIN_SETUP_S the quick
        measurement's budget for a run of ``steps`` >= QUICK_MIN_STEPS (``quick``), else 0."""
        if self.profile:
            return float(self.profile_budget_s)
        if planned_run_s is None:
            return 0.0
        budget = min(float(self.profile_budget_s), self.profile_fraction * planned_run_s)
        if budget >= MIN_SETUP_S:
            return budget
        return min(QUICK_SETUP_S, float(self.profile_budget_s)) if self.quick(planned_run_s, steps) else 0.0

    def quick(self, planned_run_s: float | None, steps: int | None) -> bool:
        """Whether the automatic budget is the quick measurement's: its share of the planned run is below
        MIN_SETUP_S, the run has at least QUICK_MIN_STEPS steps, and profiling is automatic and allowed."""
        if self.profile is not None or planned_run_s is None or steps is None or self.profile_budget_s <= 0:
            return False
        share = min(float(self.profile_budget_s), self.profile_fraction * planned_run_s)
        return share < MIN_SETUP_S and steps >= QUICK_MIN_STEPS

    def cache_dir(self) -> Path | None:
        if self.profile_cache is False:
            return None
        if self.profile_cache is None or self.profile_cache is True:
            from lightning_autopar.profile.runtime import cache_dir

            return cache_dir()
        return Path(self.profile_cache).expanduser()


@dataclass
class SetupOutcome:
    """What the set-up measurement did (``strategy.setup_outcome``): seconds per phase on this rank's clock
    (profile_s: the slowest rank's)."""

    budget_s: float = 0.0
    quick: bool = False  # the quick measurement (SetupSettings.quick): the best plan only, no runtime paths
    plan_s: float = 0.0  # the first planning, on the cluster as given / discovered
    profile_s: float = 0.0  # runtime profiling (0: cached or skipped)
    paths_s: float = 0.0  # the runtime paths' micro-trials (runtime/paths.py; 0: cached, given or skipped)
    calibrate_s: float = 0.0  # calibrate + the second planning
    trials_s: float = 0.0
    refit_s: float = 0.0  # refit + the third planning
    trials_run: int = 0
    cached: bool = False  # profile and calibrated cluster loaded from the cache: nothing measured
    cluster_file: str = ""  # the calibrated cluster.yaml in the cache ("" when none)
    skipped: str = ""  # why nothing was measured, one phrase

    def figures_source(self, planned: str) -> str:
        """Where the final planning's step times come from (planner.report SOURCE_*): measured at this set-up,
        the profile cache's calibrated file, else ``planned`` (the planner's label of the cluster it was given)."""
        from lightning_autopar.planner.report import SOURCE_CALIBRATED, SOURCE_MEASURED

        if self.profile_s or self.trials_run:
            parts = (["set-up profile"] if self.profile_s else []) + (
                [f"{self.trials_run} trial{'s' if self.trials_run != 1 else ''}"] if self.trials_run else [])
            return f"{SOURCE_MEASURED} ({' + '.join(parts)})"
        if self.cached:
            return f"{SOURCE_CALIBRATED} ({self.cluster_file})"
        return planned

    def line(self, best: Any, source: str = "") -> str:
        """The one line rank 0 prints after planning (``source``: where its step time comes from)."""
        if self.cached:
            head = f"set-up profile cached at {Path(self.cluster_file).parent}"
        elif self.profile_s:
            head = f"{'quick ' if self.quick else ''}set-up profile {self.profile_s:.2f}s of {self.budget_s:.3g}s"
            if self.paths_s:
                head += f" + runtime paths {self.paths_s:.2f}s"
        else:
            head = f"no set-up profile ({self.skipped or 'profile=False'})"
        head += f", {self.trials_run} trial{'s' if self.trials_run != 1 else ''}"
        if self.trials_s:
            head += f" in {self.trials_s:.2f}s"
        head += f"; predicted {best.step_time_s:.4g} s/step for {best.plan.short()}" + (f" [{source}]" if source else "")
        if self.cluster_file:
            head += (f"; calibrated cluster {self.cluster_file} (`autopar plan --cluster {self.cluster_file}` "
                     "predicts the same)")
        return head


def distinct_plans(candidates: Sequence[Any], count: int) -> list[Any]:
    """The first ``count`` PricedPlans of ``candidates`` (best first) whose plans differ. A compile=true plan
    priced the same as its eager twin (a cluster with neither fused-traffic physics nor a measured compile
    speed-up) is no distinct candidate: its trial would spend the compile warm-up to learn nothing priced."""
    out: list[Any] = []
    eager = {dataclasses.astuple(p.plan): p.step_time_s for p in candidates if not p.plan.compile}
    for priced in candidates:
        plan = priced.plan
        if plan.compile and eager.get(dataclasses.astuple(dataclasses.replace(plan, compile=False))) == \
                priced.step_time_s:
            continue
        if len(out) < count and all(plan != o.plan for o in out):
            out.append(priced)
    return out


def _one_trial(module: nn.Module, priced: Any, batch: Any, device: torch.device,
               shared: SharedAnalysis | None = None) -> tuple[TrialResult, float, float]:
    """(the trial's result, its wall seconds, the part before and between its steps: copy, apply, optimizer
    build), the slowest rank's."""
    from lightning_autopar.profile.runtime import slowest

    started = time.perf_counter()
    error, times = "", []
    try:
        times = run_trial(module, priced.plan, [batch], TRIAL_WARMUP + TRIAL_TIMED, device,
                          priced.layers_per_stage or None, shared)
    except (ConfigError, RuntimeError) as err:  # this plan cannot run here; the others still can
        error = " ".join(str(err).split())[:300] or type(err).__name__
    wall = time.perf_counter() - started
    timed = times[TRIAL_WARMUP:]
    local = statistics.median(timed) if timed else 0.0
    measured, failed, wall, build = slowest([local, float(bool(error)), wall, wall - sum(times)], device)
    if failed and not error:
        error = "failed on another rank"
    result = TrialResult(plan=priced.plan.to_dict(), predicted_s=float(priced.step_time_s),
                         measured_s=0.0 if failed else measured, steps=0 if failed else len(timed), error=error)
    return result, wall, build


def run_trials(module: nn.Module, candidates: Sequence[Any], batch: Any, device: torch.device, count: int | None,
               budget_s: float, shared: SharedAnalysis | None = None) -> list[TrialResult]:
    """Run the best distinct plans of ``candidates`` (PricedPlans, best first) for TRIAL_WARMUP + TRIAL_TIMED
    steps each on ``batch`` from ``module``'s current weights; measured = the timed steps' median, the slowest
    rank's. ``count``: run that many; None: while the next trial's estimate (its build, the largest so far or
    TRIAL_BUILD_GUESS_S, + its steps x its predicted step) fits in what is left of ``budget_s``, at most
    AUTO_TRIALS_MAX. Every rank takes the same decisions (the figures are max-reduced). A plan that fails gets
    TrialResult.error; the others go on. ``shared``: the model's analysis, read by every trial's copy (default:
    the first trial's, given to the others)."""
    shared = shared or SharedAnalysis()
    plans = distinct_plans(candidates, AUTO_TRIALS_MAX if count is None else count)
    results: list[TrialResult] = []
    spent, build = 0.0, TRIAL_BUILD_GUESS_S
    for priced in plans:
        if count is None and spent + build + (TRIAL_WARMUP + TRIAL_TIMED) * priced.step_time_s > budget_s:
            break
        result, wall, trial_build = _one_trial(module, priced, batch, device, shared)
        shared.release_build()
        build = trial_build if not results else max(build, trial_build)
        results.append(result)
        spent += wall
    return results


def fastest(trials: Sequence[TrialResult]) -> Plan | None:
    """The plan of the fastest trial that ran (None when none did)."""
    ran = [t for t in trials if not t.error and t.measured_s > 0]
    return Plan(**min(ran, key=lambda t: t.measured_s).plan) if ran else None
