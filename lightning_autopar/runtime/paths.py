"""The runtime's fixed costs, measured on its own paths: micro-trials of a tiny GPT.

Each runtime path (DDP, micro-batch accumulation, FSDP2 units, DTensor tensor parallelism, a pipeline schedule)
costs host time per occurrence that no device term prices: hooks, copies, dispatch, schedule bookkeeping. They
do not depend on the user's model (only on how many occurrences a step has), so they are measured once per
cluster: each path is run for a few steps (``runtime.trial.run_trial``, the runtime's own step execution) on a
GPT so small that its device work is a few kernels, and what the cost model does not already price for it (on
the calibrated cluster, runtime terms at zero) is the path's fixed cost. Non-negative least squares over the
paths gives each ``RuntimeCosts`` figure, with its occurrences per step counted by the cost model itself
(``cost_runtime.runtime_fixed_time``). The Lightning loop around a step is not in a trial: trials of the user's plans and
the step monitor refit ``step_us`` (``planner.calibrate.refit``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_autopar.profile.runtime import slowest
from lightning_autopar.specs import ClusterSpec, ModelSpec, Plan, RuntimeCosts

FIELDS = ("step_us", "microbatch_us", "fsdp_unit_us", "tp_block_us", "pipeline_action_us")
FITTED = FIELDS[1:]  # step_us: one per step in every path, it is the fit's shared term (fit_costs)
ROWS_PER_RANK = 4  # global batch = 4 rows per rank: accumulation and pipelines get 4 micro-batches
STEPS = 4  # per path: one untimed, then the median of the rest
TINY = dict(vocab=64, seq_len=16, layers=4, hidden=32, heads=2, ffn_hidden=64)
SOURCE = "runtime paths"  # RuntimeCosts.source of figures fitted here
PATHS_MIN_S = 2.0  # set-up budget below which the paths are not measured (one path's micro-trial: ~1-1.5 s here)


@dataclass
class PathTiming:
    """One path's micro-trial: the plan, its measured and predicted (no runtime terms) step, the occurrences of
    each RuntimeCosts figure in its step (seconds per microsecond of that figure)."""

    name: str
    plan: dict[str, Any]
    measured_s: float
    predicted_s: float
    occurrences: dict[str, float] = field(default_factory=dict)


def path_plans(world: int) -> list[tuple[str, Plan]]:
    """The paths this world can run: plain data parallel (DDP), accumulation, FSDP2 zero 3, and with an even
    world tensor parallelism and a 1F1B pipeline over 2."""
    rows = ROWS_PER_RANK
    plans = [("ddp", Plan(dp=world, zero=0, mbs=rows, grad_accum=1)),
             ("accumulation", Plan(dp=world, zero=0, mbs=1, grad_accum=rows)),
             ("fsdp", Plan(dp=world, zero=3, mbs=rows, grad_accum=1))]
    if world % 2 == 0:
        half = world // 2
        plans += [("tp", Plan(dp=half, tp=2, zero=0, mbs=2 * rows, grad_accum=1)),
                  ("pipeline", Plan(dp=half, pp=2, zero=0, schedule="1f1b", mbs=2, grad_accum=rows))]
    return plans


def tiny_spec() -> ModelSpec:
    return ModelSpec(name="runtime-paths", **TINY)


def occurrences(cluster: ClusterSpec, spec: ModelSpec, plan: Plan, global_batch: int) -> dict[str, float]:
    """Per RuntimeCosts figure, the seconds it adds to ``plan``'s step per microsecond: the cost model's own count
    of its occurrences (one figure at 1 us, the others 0)."""
    from lightning_autopar.planner.search import estimate

    def runtime_s(figures: dict[str, float]) -> float:
        at = dataclasses.replace(cluster, runtime=RuntimeCosts(**figures))
        return estimate(spec, at, plan, global_batch=global_batch, seq_len=spec.seq_len).breakdown.runtime_s

    # the difference of 2 us and 1 us: a figure left at 0 may be priced from the device (cost_runtime.fsdp_unit_seconds),
    # the same in both, so it cancels
    return {name: runtime_s({name: 2.0}) - runtime_s({name: 1.0}) for name in FIELDS}


def fit_costs(timings: list[PathTiming]) -> RuntimeCosts:
    """RuntimeCosts >= 0 (us) by least squares on the relative error: measured - predicted ~ b + sum over FITTED of
    occurrences x figure, per path. b, of either sign, is what every path's step shares: the step's own host work
    (runtime.step, the optimizer's dispatch, the gradient sync's launch) and whatever the tiny model's device work
    is still mispriced by; its positive part is ``step_us`` (one per optimizer step in every path, so the paths
    cannot tell the two apart: the refit on the user's own steps adjusts it)."""
    from lightning_autopar.planner.calibrate import nnls

    a = np.array([[1.0, -1.0] + [t.occurrences[name] for name in FITTED] for t in timings])
    y = np.array([t.measured_s - t.predicted_s for t in timings])
    scale = np.array([t.measured_s for t in timings])
    x = nnls(a / scale[:, None], y / scale)
    step_us = max(x[0] - x[1], 0.0) * 1e6  # the intercept is in seconds; the figures in us per occurrence
    return RuntimeCosts(step_us=float(f"{step_us:.4g}"), **{name: float(f"{v:.4g}") for name, v in zip(FITTED, x[2:])},
                        source=f"{SOURCE} {time.strftime('%Y-%m-%d')}")


def measure_paths(cluster: ClusterSpec, device: torch.device, budget_s: float) -> tuple[RuntimeCosts, list[PathTiming]]:
    """Micro-trials of every path the world allows within ``budget_s`` (each priced at the pace of the first), on
    the live process group (every rank calls); the fitted RuntimeCosts (module docstring). ``cluster`` is the
    calibrated cluster: its device and links price what is not a fixed cost."""
    import torch.distributed as dist

    from lightning_autopar.models.gpt import GPTConfig
    from lightning_autopar.models.lit import LitGPT
    from lightning_autopar.runtime.trial import RngState, run_trial

    world = dist.get_world_size()
    spec = tiny_spec()
    global_batch = ROWS_PER_RANK * world
    rng = RngState.capture()
    try:
        torch.manual_seed(0)
        module = LitGPT(GPTConfig(**TINY), optimizer="adamw", lr=1e-3).to(device)
        ids = torch.randint(0, spec.vocab, (global_batch, spec.seq_len + 1), device=device)
    finally:
        rng.restore()
    batch = (ids[:, :-1], ids[:, 1:])
    started, pace = time.perf_counter(), 0.0
    cluster = tiny_device(cluster, module, spec, device)
    timings: list[PathTiming] = []
    for name, plan in path_plans(world):
        elapsed = slowest([time.perf_counter() - started], device)[0]
        if pace and elapsed + pace > budget_s:
            break
        tick = time.perf_counter()
        steps = run_trial(module, plan, [batch], STEPS, device)
        measured = slowest([statistics.median(steps[1:])], device)[0]
        predicted = _predicted(cluster, spec, plan, global_batch)
        timings.append(PathTiming(name, plan.to_dict(), measured, predicted,
                                  occurrences(cluster, spec, plan, global_batch)))
        pace = max(pace, slowest([time.perf_counter() - tick], device)[0])
    return fit_costs(timings) if timings else RuntimeCosts(), timings


def tiny_device(cluster: ClusterSpec, module: Any, spec: ModelSpec, device: torch.device) -> ClusterSpec:
    """``cluster`` with its device fitted to the tiny GPT's own passes (planner.calibrate.fit_device on whole
    forward + loss + backward passes at a few micro-batch sizes and one optimizer step, every rank at once): its
    device work is a few kernels each, priced by the per-op overhead more than by any rate, so the figures fitted
    to a large model (or a probe's matmuls) would misprice it and leave the error in the fixed costs."""
    from lightning_autopar.planner.calibrate import fit_device
    from lightning_autopar.profile.measure import optimizer_step_seconds, pass_seconds, token_forward
    from lightning_autopar.specs import BlockSample

    samples = []
    for mbs in (1, ROWS_PER_RANK):
        forward = token_forward(module.model, mbs, spec.seq_len, spec.vocab, "fp32", device)
        fwd, bwd = slowest(list(pass_seconds(forward, device, reps=3, warmup=1)), device)
        samples.append(BlockSample("model", mbs, spec.seq_len, "fp32", fwd, bwd))
    step = optimizer_step_seconds(list(module.parameters()), device, reps=3)
    samples.append(BlockSample("optimizer", 0, 0, "fp32", slowest([step], device)[0], 0.0))
    for p in module.parameters():
        p.grad = None  # the trials copy the module: no gradient from these passes
    return fit_device(cluster, spec, samples)[0]


def _predicted(cluster: ClusterSpec, spec: ModelSpec, plan: Plan, global_batch: int) -> float:
    from lightning_autopar.planner.search import estimate

    bare = dataclasses.replace(cluster, runtime=RuntimeCosts())
    priced = estimate(spec, bare, plan, global_batch=global_batch, seq_len=spec.seq_len)
    return priced.step_time_s - priced.breakdown.runtime_s  # what a preset prices from the device: not measured here
