"""Calibration: turn what was measured on the live process group into a ClusterSpec the planner prices with.

Pure numpy, like the rest of the planner (profile/runtime.py measures; this module only fits). Three fits, each
keeping the cost model's own formulas and adjusting only the hardware figures they take:

* ``fit_device``: block forward/backward times (``RuntimeProfile.blocks``, every rank at once, so processes that
  share cores share their rates) -> the device's matmul rate, streaming bandwidth and per-op overhead, by
  non-negative least squares on the relative error of the analytic block times (cost.dense_block_time, ...).
* ``fit_links``: collective times (``RuntimeProfile.collectives``) -> each link level's latency and bandwidth, by
  least squares on the planner's own collective formulas (cost_comm.allreduce_time, allgather_time, ...).
* ``refit``: measured steps of whole plans (trials, the StepMonitor) -> a time scale on the profiled rates and the
  runtime's per-step and per-micro-batch costs (``RuntimeCosts.step_us``, ``microbatch_us``), ridge-regularised
  towards "the profile was right" so that one or two steps cannot move it far.

``calibrate`` applies the first two and the directly measured runtime costs; ``describe`` prints the result.
A calibrated cluster is a plain ClusterSpec: written to YAML, ``autopar plan --cluster FILE`` prices exactly what
the live strategy priced.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import numpy as np

from lightning_autopar.planner.cost import optimizer_time
from lightning_autopar.planner.cost_comm import (
    allgather_time, allreduce_time, alltoall_time, p2p_time, reduce_scatter_time)
from lightning_autopar.planner.forms import SHARED_KINDS, form_of
from lightning_autopar.planner.hardware import Hardware
from lightning_autopar.planner.report import describe_cluster as describe  # the figures, for reports
from lightning_autopar.specs import (
    PRECISIONS,
    BlockSample,
    ClusterSpec,
    CollectiveSample,
    ModelSpec,
    PeakTflops,
    Plan,
    RuntimeCosts,
    RuntimeProfile,
)

HUGE = 1e30  # a rate so high that its term vanishes (decomposing a time into its parts)
REFIT_PRIOR = 0.1  # ridge weight of "the profile was right" against one measured step, per parameter


# ============================================================================================ least squares


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||a x - y|| over x >= 0, for the few columns the fits have (every active set; exact)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y ** 2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.all(x >= 0):
                res = float(np.sum((a[:, cols] @ x - y) ** 2))
                if res < best_res - 1e-15:
                    best, best_res = np.zeros(n), res
                    best[list(cols)] = x
    return best


# ============================================================================================ device


def _block_times(hw: Hardware, model: ModelSpec, sample: BlockSample) -> tuple[float, float]:
    """The cost model's (fwd, bwd) seconds of one measured kind at the sample's shape, tp = cp = 1: one optimizer
    step over all parameters ("optimizer": its time as fwd, 0 as bwd), else what the model's form prices for it
    (forms.ModelForm.sample_times: a block, the embedding, the head + loss, a unit, the whole model)."""
    if sample.kind == "optimizer":
        return float(optimizer_time(hw, float(model.total_params()), PRECISIONS.index(sample.precision))), 0.0
    return form_of(model).sample_times(hw, model, sample)


def _known_kind(model: ModelSpec, sample: BlockSample) -> bool:
    return sample.kind in SHARED_KINDS or form_of(model).knows_kind(model, sample.kind)


def _rows(samples: Sequence[BlockSample]) -> list[tuple[int, int]]:
    """(sample index, 0 fwd | 1 bwd) of every measured time (an optimizer step has no backward)."""
    return [(i, j) for i, s in enumerate(samples) for j, t in enumerate((s.fwd_s, s.bwd_s)) if t > 0]


def _device_at(hw: Hardware, theta: np.ndarray) -> Hardware:
    """``hw`` with its compute time x theta[0], streaming time x theta[1] and per-op overhead theta[2] seconds."""
    return dataclasses.replace(hw, peak=hw.peak / max(theta[0], 1e-30), mem_bw=hw.mem_bw / max(theta[1], 1e-30),
                               overhead_s=theta[2], dispatch_s=0.0)


def device_parts(hw: Hardware, model: ModelSpec, samples: Sequence[BlockSample], theta: np.ndarray) -> np.ndarray:
    """Rows (fwd and bwd of each sample) x d time / d theta at ``theta`` (_device_at): what the matmul rate, the
    streaming bandwidth and the per-op overhead each contribute on the branch each roofline max() takes there.
    The analytic time is piecewise linear and homogeneous in theta, so time = parts @ theta (Euler)."""
    base = _times(hw, model, samples, theta)
    cols = []
    for j in range(3):
        step = np.zeros(3)
        step[j] = max(abs(theta[j]) * 1e-3, 1e-9)
        cols.append((_times(hw, model, samples, theta + step) - base) / step[j])
    return np.stack(cols, axis=1)


def _times(hw: Hardware, model: ModelSpec, samples: Sequence[BlockSample], theta: np.ndarray) -> np.ndarray:
    """The cost model's time of every measured row (_rows) on the device at ``theta``."""
    at = _device_at(hw, theta)
    times = [_block_times(at, model, s) for s in samples]
    return np.array([times[i][j] for i, j in _rows(samples)])


def fit_device(cluster: ClusterSpec, model: ModelSpec, samples: Sequence[BlockSample]) -> tuple[ClusterSpec, float]:
    """(cluster with its device's rates fitted to the measured blocks, median relative error of the fit).

    Measured time ~ parts(theta) @ theta with theta = (compute scale c, memory scale m, per-op seconds o) >= 0
    (device_parts), by non-negative least squares on the relative error, repeated from the fitted theta until the
    roofline branches settle (Gauss-Newton on a piecewise-linear model); then peak_tflops / c,
    memory_bandwidth_gbs / m, kernel_overhead_us = o. Every precision's peak moves by the same c (one measured
    precision). Kinds the model does not have are ignored."""
    samples = [s for s in samples if _known_kind(model, s) and s.fwd_s > 0]
    if not samples:
        return cluster, float("nan")
    hw = Hardware.from_cluster(cluster)
    measured = np.array([(s.fwd_s, s.bwd_s)[j] for i, j in _rows(samples) for s in [samples[i]]])
    theta = np.array([1.0, 1.0, hw.overhead_s])
    for _ in range(4):
        parts = device_parts(hw, model, samples, theta)
        new = nnls(parts / measured[:, None], np.ones(len(measured)))
        if new[0] <= 0:  # nothing to scale the rates by: keep the device as it is
            break
        new[1] = max(new[1], 1e-6)
        settled = np.allclose(new, theta, rtol=1e-3, atol=1e-9)
        theta = new
        if settled:
            break
    if theta[0] <= 0:
        return cluster, float("nan")
    fitted = _times(hw, model, samples, theta)
    c, m, o = (float(x) for x in theta)
    dev = cluster.device
    rnd = lambda x: float(f"{x:.5g}")  # noqa: E731
    device = dataclasses.replace(
        dev, peak_tflops=PeakTflops(**{k: rnd(v / c) for k, v in vars(dev.peak_tflops).items()}),
        memory_bandwidth_gbs=rnd(dev.memory_bandwidth_gbs / m), kernel_overhead_us=rnd(o * 1e6), dispatch_us=0.0)
    return dataclasses.replace(cluster, device=device), float(np.median(np.abs(fitted / measured - 1)))


# ============================================================================================ links


def _collective_time(hw: Hardware, s: CollectiveSample) -> float:
    """The cost model's seconds for one measured collective (its own formula for that op)."""
    if s.op == "all_reduce":
        return float(allreduce_time(hw, float(s.nbytes), s.ranks, s.stride))
    if s.op == "all_gather":
        return float(allgather_time(hw, float(s.nbytes), s.ranks, s.stride))
    if s.op == "reduce_scatter":
        return float(reduce_scatter_time(hw, float(s.nbytes), s.ranks, s.stride))
    if s.op == "all_to_all":
        return float(alltoall_time(hw, float(s.nbytes), s.ranks, s.stride))
    if s.op == "p2p":
        inter = hw.nodes > 1 and s.stride >= hw.dpn
        return float(p2p_time(hw, float(s.nbytes), inter))
    raise ValueError(f"unknown collective {s.op!r}")


def _spans_nodes(cluster: ClusterSpec, s: CollectiveSample) -> bool:
    return cluster.nodes > 1 and (s.ranks - 1) * s.stride + 1 > cluster.devices_per_node


def _with_link(cluster: ClusterSpec, level: int, latency_s: float, inv_bw: float) -> ClusterSpec:
    links = [dataclasses.replace(link) for link in cluster.links]
    bw = 1.0 / inv_bw / 1e9 if inv_bw > 0 else links[level].bandwidth_gbs * 1e3
    links[level] = dataclasses.replace(links[level], latency_us=float(f"{latency_s * 1e6:.5g}"),
                                       bandwidth_gbs=float(f"{bw:.5g}"), efficiency=1.0)
    return dataclasses.replace(cluster, links=links)


def _link_rows(cluster: ClusterSpec, level: int, samples: Sequence[CollectiveSample]) -> np.ndarray:
    """Rows x [latency coefficient, inverse-bandwidth coefficient] of each sample under the planner's formula at
    the cluster's current figures: time = a * alpha + b / beta on the branch (ring, tree) the formula takes."""
    link = cluster.links[level]
    alpha = max(link.latency_us * 1e-6, 1e-9)
    inv = 1.0 / (link.bandwidth_gbs * 1e9 * link.efficiency)
    latency_only = Hardware.from_cluster(_with_link(cluster, level, alpha, 1.0 / HUGE))
    bandwidth_only = Hardware.from_cluster(_with_link(cluster, level, 0.0, inv))
    rows = []
    for s in samples:
        rows.append([_collective_time(latency_only, s) / alpha, _collective_time(bandwidth_only, s) / inv])
    return np.array(rows)


def reduce_scatter_factor(samples: Sequence[CollectiveSample]) -> float:
    """Median over the groups of (reduce-scatter time / all-gather time) at the largest size both were measured at
    on that group: how much slower the backend's reduce-scatter is than the ring it prices as (0: not measured)."""
    times = {(s.op, s.ranks, s.stride, s.nbytes): s.seconds for s in samples}
    ratios = []
    for ranks, stride in {(s.ranks, s.stride) for s in samples}:
        sizes = [n for (op, r, st, n) in times if op == "all_gather" and (r, st) == (ranks, stride)
                 and ("reduce_scatter", r, st, n) in times]
        if sizes:
            n = max(sizes)
            ratios.append(times[("reduce_scatter", ranks, stride, n)] / times[("all_gather", ranks, stride, n)])
    return float(f"{np.median(ratios):.4g}") if ratios else 0.0


def fit_links(cluster: ClusterSpec, samples: Sequence[CollectiveSample]) -> tuple[ClusterSpec, float]:
    """(cluster with each measured link level's latency and bandwidth fitted, median relative error).

    The reduce-scatter factor comes first (reduce_scatter_factor), so reduce-scatters are priced as the backend
    runs them. Per level (groups inside a node: level 0; across nodes: the outermost, the inner one held), time = a*alpha
    + b/beta with a, b the formula's coefficients on its active branch; non-negative least squares on the relative
    error, repeated three times because the branch (ring or tree) can change with the figures."""
    samples = [s for s in samples if s.seconds > 0 and s.ranks > 1]
    if not samples:
        return cluster, float("nan")
    factor = reduce_scatter_factor(samples)
    if factor:
        cluster = dataclasses.replace(cluster, links=[dataclasses.replace(link, reduce_scatter_factor=factor)
                                                      for link in cluster.links])
    for level, chosen in ((0, [s for s in samples if not _spans_nodes(cluster, s)]),
                          (len(cluster.links) - 1, [s for s in samples if _spans_nodes(cluster, s)])):
        if not chosen or (level == 0 and cluster.nodes > 1 and len(cluster.links) == 1 and
                          any(_spans_nodes(cluster, s) for s in samples)):
            continue
        measured = np.array([s.seconds for s in chosen])
        for _ in range(3):
            rows = _link_rows(cluster, level, chosen)
            alpha, inv = nnls(rows / measured[:, None], np.ones(len(chosen)))
            if inv <= 0:
                break
            cluster = _with_link(cluster, level, alpha, inv)
    hw = Hardware.from_cluster(cluster)
    err = [abs(_collective_time(hw, s) / s.seconds - 1) for s in samples]
    return cluster, float(np.median(err))


# ============================================================================================ the calibrated cluster


def merged_runtime(base: RuntimeCosts, measured: RuntimeCosts, source: str) -> RuntimeCosts:
    """``base`` with every figure ``measured`` has (> 0) taken from it, the compile speed-up too."""
    ours = measured.figures()
    return RuntimeCosts(**{name: ours[name] or value for name, value in base.figures().items()}, source=source,
                        compile_speedup=measured.compile_speedup or base.compile_speedup)


def calibrate(cluster: ClusterSpec, model: ModelSpec, profile: RuntimeProfile, precision: str = "fp32") -> ClusterSpec:
    """``cluster`` calibrated to a set-up profile: device rates from its blocks (fit_device), link figures from
    its collectives (fit_links), runtime costs it measured directly (runtime/paths.py measures the fixed costs per
    cluster; trials refit after: refit). ``precision`` is the plan's, for blocks measured without one."""
    out = dataclasses.replace(cluster, name=cluster.name.removesuffix("-calibrated") + "-calibrated")
    blocks = [b if b.precision in PRECISIONS else dataclasses.replace(b, precision=precision) for b in profile.blocks]
    out, _ = fit_device(out, model, blocks)
    out, _ = fit_links(out, profile.collectives)
    out = dataclasses.replace(out, runtime=merged_runtime(out.runtime, profile.runtime, "profile"))
    return out


# ============================================================================================ refit from measured steps


def _estimate(model: ModelSpec, cluster: ClusterSpec, plan: Plan, global_batch: int, seq_len: int) -> Any:
    from lightning_autopar.planner.search import estimate

    return estimate(model, cluster, plan, global_batch=global_batch, seq_len=seq_len)


def scaled(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    """Every time the cost model derives from ``cluster`` x ``factor``: device rates and link bandwidths / factor,
    latencies and fixed costs x factor (a machine uniformly slower or faster than profiled)."""
    factor = float(factor)  # plain floats: the cluster is written to YAML and into checkpoints
    dev = cluster.device
    device = dataclasses.replace(
        dev, peak_tflops=PeakTflops(**{k: v / factor for k, v in vars(dev.peak_tflops).items()}),
        memory_bandwidth_gbs=dev.memory_bandwidth_gbs / factor, kernel_overhead_us=dev.kernel_overhead_us * factor,
        dispatch_us=dev.dispatch_us * factor)
    links = [dataclasses.replace(link, bandwidth_gbs=link.bandwidth_gbs / factor, latency_us=link.latency_us * factor)
             for link in cluster.links]
    rt = cluster.runtime
    runtime = RuntimeCosts(**{name: float(value * factor) for name, value in rt.figures().items()}, source=rt.source,
                           compile_speedup=rt.compile_speedup)  # a ratio: the same on a uniformly slower machine
    return dataclasses.replace(cluster, device=device, links=links, runtime=runtime)


def refit(cluster: ClusterSpec, model: ModelSpec, observations: Sequence[tuple[Plan, float]], global_batch: int,
          seq_len: int) -> ClusterSpec:
    """``cluster`` refit to measured step times of whole plans: measured ~ s * predicted' + t_step + slots * t_mb,
    where predicted' is the plan's step without the per-step and per-micro-batch runtime terms and slots its
    micro-batch slots; s (a uniform time scale on the profiled figures), t_step, t_mb by ridge least squares on the
    relative error with prior s = 1, t = the cluster's figures (REFIT_PRIOR per parameter, so one step splits the
    difference between them instead of forcing it onto one), clipped to s > 0, t >= 0."""
    obs = [(p, float(t)) for p, t in observations if t > 0]
    if not obs:
        return cluster
    rt = cluster.runtime
    rows, meas = [], []
    for plan, measured in obs:
        priced = _estimate(model, cluster, plan, global_batch, seq_len)
        terms = priced.breakdown.terms
        fixed = terms.get("step", 0.0) + terms.get("microbatch", 0.0)
        slots = plan.grad_accum + (plan.pp - 1) / plan.vpp if plan.pp > 1 else plan.grad_accum
        rows.append([priced.step_time_s - fixed, 1.0, float(slots)])
        meas.append(measured)
    a = np.array(rows) / np.array(meas)[:, None]
    y = np.ones(len(meas))
    # prior scales: s around 1; fixed costs around the median step (per step) / per slot
    med = float(np.median(meas))
    sigma = np.array([1.0, med, med / max(float(np.median([r[2] for r in rows])), 1.0)])
    prior = np.array([1.0, rt.step_us * 1e-6, rt.microbatch_us * 1e-6])
    reg = REFIT_PRIOR * np.diag(1.0 / sigma)
    a_aug = np.vstack([a, reg])
    y_aug = np.concatenate([y, reg @ prior])
    x = _clipped_solve(a_aug, y_aug, lambda v: np.array([max(v[0], 0.05), max(v[1], 0.0), max(v[2], 0.0)]))
    factor, step_s, mb_s = (float(v) for v in x)
    out = scaled(cluster, factor)
    runtime = dataclasses.replace(out.runtime, step_us=float(f"{step_s * 1e6:.5g}"),
                                  microbatch_us=float(f"{mb_s * 1e6:.5g}"),
                                  source=f"refit on {len(obs)} measured plan{'s' if len(obs) > 1 else ''}: "
                                         f"x{factor:.3g} on the profiled figures")
    return dataclasses.replace(out, runtime=runtime)


def _clipped_solve(a: np.ndarray, y: np.ndarray, clip: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Least squares, then each variable that left its bounds fixed at the bound and the rest solved again."""
    x, *_ = np.linalg.lstsq(a, y, rcond=None)
    fixed = np.zeros(len(x), dtype=bool)
    for _ in range(len(x)):
        bounded = clip(x)
        out = ~np.isclose(bounded, x) & ~fixed
        if not out.any():
            return bounded
        fixed |= out
        x = bounded.copy()
        free = ~fixed
        if free.any():
            x[free], *_ = np.linalg.lstsq(a[:, free], y - a[:, fixed] @ x[fixed], rcond=None)
    return clip(x)
