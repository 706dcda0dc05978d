"""``StepMonitor``: measured step time, throughput, model TFLOP/s, MFU and peak memory next to the planner's
prediction, logged every step, checked against a tolerance, and drawn into a PNG report at the end.

Measured per optimizer step (rank-local, from ``on_train_batch_start`` of its first batch to
``on_train_batch_end`` of its last, with a device synchronise on accelerators):

* ``step_time_s`` and ``data_time_s`` (waiting for the DataLoader before the step);
* ``tokens_per_s`` from the batch (rows x sequence length of the first 2-D tensor);
* ``model_tflops`` and ``mfu``: the planner's per-device model FLOPs for the step over the measured time
  (the same FLOP count as the prediction, so measured/predicted compare time only);
* ``peak_mem_gib``: the device allocator's peak on accelerators; on CPU the process's peak RSS.

Every ``probe_every_n_steps`` one step runs under ``torch.profiler``: communication is the union of the
collective intervals (``gloo:``/``nccl:``/``hccl:`` ops, NCCL/HCCL kernels), exposed communication the part
of it not covered by compute (main-thread ATen ops on CPU, non-collective kernels on devices), compute
the rest of the step. That is what the planner's ``breakdown`` predicts as ``comm_exposed_s + bubble_s`` and
``compute_s + recompute_s + runtime_s``; when the measured step is more than ``tolerance`` off the prediction,
the warning names the side that is off. Without a probe it names the step time and the predicted proportions.

Predicted per step: every named term of the plan in effect, ``pred_<term>_s`` (STEP_TERMS: the Breakdown's
compute, recompute, comm_exposed, bubble and runtime, which add up to ``pred_step_time_s``, then the runtime
fixed costs of ``Breakdown.terms``, which add up to ``runtime``). The CSV has a column per term, the PNG a panel
of predicted vs measured per term.

The prediction is ``strategy.report.best`` (a ``PricedPlan``), read at every step so a re-plan
(``Rebalance``) is followed.

Stragglers: at every profiled step the ranks exchange their split (``RankTime``: step, compute, waiting in
collectives; one small ``all_gather_object``). Collectives make every rank's step as long as the slowest one's,
so a slow host shows as more compute than its peers (the ranks of the same pipeline stage, which do the same work)
while they wait for it. A rank whose compute exceeds its peers' median by more than ``straggler_threshold`` in
``straggler_probes`` profiled steps in a row is named in one warning (``find_stragglers``), and the PNG gets a
per-rank panel of the latest exchange.
"""

from __future__ import annotations

import csv
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable

import torch
import lightning.pytorch as L

from lightning_autopar.files import atomic_file
from lightning_autopar.planner.cost_runtime import RUNTIME_TERMS
from lightning_autopar.runtime.lightning_private import batches_that_stepped

GIB = float(2**30)
_COMM_PREFIXES = ("gloo:", "nccl:", "hccl:", "mpi:", "ucc:")
_COMM_KERNELS = ("nccl", "hccl", "allreduce", "allgather", "reducescatter")


@dataclass
class StepRecord:
    """One optimizer step; ``pred_*`` are the planner's figures for the plan in effect (None without one)."""

    step: int
    plan: str
    step_time_s: float
    data_time_s: float
    tokens: int
    tokens_per_s: float
    peak_mem_gib: float
    model_tflops: float | None = None
    mfu: float | None = None
    compute_s: float | None = None  # probed steps only
    comm_exposed_s: float | None = None
    comm_total_s: float | None = None
    pred_step_time_s: float | None = None
    pred_tokens_per_s: float | None = None
    pred_model_tflops: float | None = None
    pred_mfu: float | None = None
    pred_mem_gib: float | None = None
    pred_compute_s: float | None = None  # the compute term; with the ones below, pred_<term>_s for STEP_TERMS
    pred_comm_s: float | None = None  # exposed communication + pipeline bubble (the measured split's comm side)
    pred_recompute_s: float | None = None
    pred_comm_exposed_s: float | None = None
    pred_bubble_s: float | None = None
    pred_runtime_s: float | None = None  # the runtime's fixed costs, = the sum of the named ones below
    pred_step_s: float | None = None  # each of Breakdown.terms (cost_runtime.RUNTIME_TERMS) from here on
    pred_microbatch_s: float | None = None
    pred_fsdp_units_s: float | None = None
    pred_tp_dispatch_s: float | None = None
    pred_pipeline_actions_s: float | None = None
    pred_ep_dispatch_s: float | None = None
    pred_collective_sync_s: float | None = None


@dataclass(frozen=True)
class RankTime:
    """One rank's profiled step: its pipeline stage, the step, compute (the step less exposed communication)
    and the time it waited in collectives not covered by its own compute."""

    rank: int
    stage: int
    step_time_s: float
    compute_s: float
    waiting_s: float


def find_stragglers(probes: list[list[RankTime]], threshold: float, consecutive: int,
                    min_excess_s: float = 0.0) -> list[tuple[int, float, float]]:
    """Ranks slower than their peers in each of the last ``consecutive`` probes: ``(rank, compute_s, peers'
    median compute_s)`` of the latest probe, for each rank whose compute exceeded ``(1 + threshold)`` x the
    median of the other ranks of its pipeline stage, and that median by at least ``min_excess_s``, every time (a
    rank with no peer is never named). The absolute floor keeps timer noise and rank 0's own bookkeeping (logging,
    the report) from naming a rank when steps take milliseconds."""
    recent = probes[-consecutive:] if consecutive > 0 else []
    if len(recent) < consecutive or not recent:
        return []

    def slow(probe: list[RankTime]) -> dict[int, tuple[float, float]]:
        out = {}
        for r in probe:
            peers = [p.compute_s for p in probe if p.stage == r.stage and p.rank != r.rank]
            if peers and r.compute_s > max((1 + threshold) * statistics.median(peers),
                                           statistics.median(peers) + min_excess_s):
                out[r.rank] = (r.compute_s, statistics.median(peers))
        return out

    flagged = [slow(p) for p in recent]
    common = set(flagged[0]).intersection(*flagged[1:])
    return [(rank, *flagged[-1][rank]) for rank in sorted(common)]


def straggler_message(rank: int, compute: float, peers: float, probes: int) -> str:
    return (f"autopar: rank {rank} is a straggler: {compute:.3g} s of compute per step vs {peers:.3g} s for its "
            f"peers (x{compute / peers if peers > 0 else float('inf'):.2f}, {probes} profiled steps in a row); "
            "the other ranks wait for it in collectives: check that rank's host (CPU load, throttling, its links)")


def _pipeline_stage(trainer: Any) -> int:
    layout = getattr(trainer.strategy, "mesh_layout", None)
    plan = getattr(trainer.strategy, "plan", None)
    if layout is None or plan is None or plan.pp <= 1:
        return 0
    return int(layout["pp"].get_local_rank())


# the cost model's step terms, in the order they are reported: Breakdown fields, then Breakdown.terms by name
BREAKDOWN_TERMS = ("compute", "recompute", "comm_exposed", "bubble", "runtime")
STEP_TERMS = BREAKDOWN_TERMS + RUNTIME_TERMS


# ============================================================================================ measuring


def _pred_busy(rec: StepRecord) -> float:
    """Predicted compute + recompute + runtime fixed costs of a record (the measured ``compute_s`` counterpart)."""
    return sum(v or 0.0 for v in (rec.pred_compute_s, rec.pred_recompute_s, rec.pred_runtime_s))


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _uncovered(cover: list[tuple[float, float]], by: list[tuple[float, float]]) -> float:
    """Length of the merged intervals ``cover`` not covered by the merged intervals ``by``."""
    total, j = 0.0, 0
    for start, end in cover:
        cursor = start
        while j < len(by) and by[j][1] <= cursor:
            j += 1
        k = j
        while k < len(by) and by[k][0] < end:
            if by[k][0] > cursor:
                total += by[k][0] - cursor
            cursor = max(cursor, by[k][1])
            k += 1
        total += max(0.0, end - cursor)
    return total


def communication_split(events: list[Any]) -> tuple[float, float]:
    """(exposed, total) communication seconds in a profiled window (``profile.events()``)."""
    comm, compute_cpu, compute_dev = [], [], []
    aten_threads: dict[int, int] = {}
    for e in events:
        if e.name.startswith("aten::"):
            aten_threads[e.thread] = aten_threads.get(e.thread, 0) + 1
    main = max(aten_threads, key=aten_threads.get) if aten_threads else None
    for e in events:
        span = (e.time_range.start * 1e-6, e.time_range.end * 1e-6)
        name = e.name
        on_device = str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1", "XPU", "MTIA"))
        if on_device:
            (comm if any(k in name.lower() for k in _COMM_KERNELS) else compute_dev).append(span)
        elif name.startswith(_COMM_PREFIXES):
            comm.append(span)
        elif name.startswith("aten::") and e.thread == main:
            compute_cpu.append(span)
    comm_m = _merge(comm)
    compute = _merge(compute_dev) if compute_dev else _merge(compute_cpu)
    return _uncovered(comm_m, compute), _length(comm_m)


def _tokens(batch: Any) -> int:
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    two_d = next((t for t in tensors if t.dim() >= 2), None)
    if two_d is not None:
        return int(two_d.shape[0] * two_d.shape[1])
    return int(tensors[0].shape[0]) if tensors else 0


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def predicted_terms(breakdown: Any) -> dict[str, float]:
    """Seconds per step of every named term of a ``Breakdown`` (STEP_TERMS order; a runtime term the plan does
    not pay is 0). The BREAKDOWN_TERMS add up to the predicted step, the RUNTIME_TERMS to its ``runtime``."""
    out = {name: float(getattr(breakdown, f"{name}_s")) for name in BREAKDOWN_TERMS}
    out.update({name: float(breakdown.terms.get(name, 0.0)) for name in RUNTIME_TERMS})
    return out


def prediction(trainer: Any) -> Any:
    """The PricedPlan in effect (``strategy.report.best``), or None for strategies without a planner."""
    report = getattr(trainer.strategy, "report", None)
    return getattr(report, "best", None)


# ============================================================================================ the callback


class StepMonitor(L.Callback):
    """Measured vs predicted per step, on the Trainer's loggers, with a warning and a PNG report.

    Args:
        every_n_steps: log every n optimizer steps (measurements are kept for every step).
        warmup_steps: steps excluded from the tolerance check and the report's medians.
        tolerance: relative disagreement of measured and predicted step time that triggers the warning.
        window: steps over which the median is compared with the prediction.
        probe_every_n_steps: profile one step in n to split compute and exposed communication (0: never);
            the first probe runs right after warm-up.
        report_path: PNG path (default ``<log_dir>/autopar_monitor.png``; a CSV with every step is written
            beside it). None of these are written when ``report_path=False``.
        straggler_threshold: how much more compute than its peers' median (relative) makes a rank slow.
        straggler_probes: in how many profiled steps in a row a rank must be slow to be named.
        straggler_min_excess_s: the least extra compute per step (seconds) that makes a rank slow, whatever
            the ratio: below it the difference is timer noise or rank 0's own bookkeeping.
    """

    def __init__(self, every_n_steps: int = 1, warmup_steps: int = 3, tolerance: float = 0.2, window: int = 10,
                 probe_every_n_steps: int = 50, report_path: str | Path | bool | None = None,
                 straggler_threshold: float = 0.25, straggler_probes: int = 3,
                 straggler_min_excess_s: float = 0.05) -> None:
        self.straggler_threshold = straggler_threshold
        self.straggler_min_excess_s = straggler_min_excess_s
        self.straggler_probes = max(1, straggler_probes)
        self.rank_times: list[list[RankTime]] = []  # one exchange per profiled step, every rank's split
        self.stragglers: list[int] = []
        self.every_n_steps = max(1, every_n_steps)
        self.warmup_steps = warmup_steps
        self.tolerance = tolerance
        self.window = max(1, window)
        self.probe_every_n_steps = probe_every_n_steps
        self.report_path = report_path
        self.records: list[StepRecord] = []
        self.warnings: list[str] = []
        self.png_path: Path | None = None
        self.csv_path: Path | None = None
        self._open: dict[str, Any] | None = None
        self._last_end: float | None = None
        self._profiler: Any = None
        self._steps_seen = 0
        self._warned: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ hooks

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.report_path is not False:
            base = Path(self.report_path) if self.report_path else Path(trainer.log_dir or trainer.default_root_dir) \
                / "autopar_monitor.png"
            self.png_path, self.csv_path = base, base.with_suffix(".csv")
        self._last_end = None
        self._open = None
        self._steps_seen = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        device = trainer.strategy.root_device
        if self._open is None:  # first batch of an optimizer step
            _sync(device)
            now = time.perf_counter()
            self._open = {"start": now, "step": trainer.global_step, "tokens": 0,
                          "data": now - self._last_end if self._last_end is not None else 0.0}
            if self._probe_due():
                self._profiler = torch.profiler.profile(activities=self._activities(device))
                self._profiler.__enter__()
        self._open["tokens"] += _tokens(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        opened = self._open
        if opened is None or trainer.global_step == opened["step"]:
            return  # Lightning is accumulating: the optimizer step is not done yet
        device = trainer.strategy.root_device
        _sync(device)
        end = time.perf_counter()
        split = None
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            split = communication_split(self._profiler.events())
            self._profiler = None
        self._open, self._last_end = None, end
        self._steps_seen += 1
        record = self._record(trainer, end - opened["start"], opened["data"], opened["tokens"], split, device)
        self.records.append(record)
        if split is not None:
            self._exchange(trainer, record)
        if trainer.global_step % self.every_n_steps == 0:
            self._log(trainer, record)
        self._check(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None
        if trainer.is_global_zero and self.png_path is not None and self.records:
            self.write_csv(self.csv_path)
            self.write_png(self.png_path, trainer)

    # ------------------------------------------------------------------ measuring

    def _probe_due(self) -> bool:
        n = self.probe_every_n_steps
        index = self._steps_seen - self.warmup_steps  # the step about to run, counted after warm-up
        return bool(n) and index >= 0 and index % n == 0

    @staticmethod
    def _activities(device: torch.device) -> list[Any]:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        return acts

    def _record(self, trainer: Any, step_time: float, data_time: float, tokens: int,
                split: tuple[float, float] | None, device: torch.device) -> StepRecord:
        plan = getattr(trainer.strategy, "plan", None)
        rec = StepRecord(step=trainer.global_step, plan=plan.short() if plan is not None else "",
                         step_time_s=step_time, data_time_s=data_time, tokens=tokens,
                         tokens_per_s=tokens / step_time if step_time > 0 else 0.0,
                         peak_mem_gib=_peak_memory_gib(device))
        if split is not None:
            rec.comm_exposed_s, rec.comm_total_s = split
            rec.compute_s = max(0.0, step_time - split[0])
        pred = prediction(trainer)
        if pred is not None and pred.step_time_s > 0:
            b = pred.breakdown
            pred_tokens = pred.tokens_per_s * pred.step_time_s
            work = tokens / pred_tokens if pred_tokens > 0 else 1.0  # Lightning accumulation: k loader batches
            rec.pred_step_time_s = pred.step_time_s * work
            rec.pred_tokens_per_s = pred.tokens_per_s
            rec.pred_model_tflops = pred.model_tflops_per_device
            rec.pred_mfu = pred.mfu
            rec.pred_mem_gib = pred.memory_gib_per_device
            for name, seconds in predicted_terms(b).items():
                setattr(rec, f"pred_{name}_s", seconds * work)
            rec.pred_comm_s = (b.comm_exposed_s + b.bubble_s) * work
            ratio = rec.pred_step_time_s / step_time
            rec.model_tflops = pred.model_tflops_per_device * ratio
            rec.mfu = pred.mfu * ratio
        return rec

    def _log(self, trainer: Any, rec: StepRecord) -> None:
        metrics = {f"autopar/{k}": float(v) for k, v in asdict(rec).items()
                   if v is not None and k not in ("step", "plan")}
        step = batches_that_stepped(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _exchange(self, trainer: Any, rec: StepRecord) -> None:
        """Every rank's split of this profiled step (all ranks profile the same steps), then the straggler check."""
        import torch.distributed as dist

        mine = RankTime(rank=trainer.global_rank, stage=_pipeline_stage(trainer), step_time_s=rec.step_time_s,
                        compute_s=rec.compute_s or 0.0, waiting_s=rec.comm_exposed_s or 0.0)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            self.rank_times.append([mine])
            return
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        self.rank_times.append(every)
        for rank, compute, peers in find_stragglers(self.rank_times, self.straggler_threshold,
                                                    self.straggler_probes, self.straggler_min_excess_s):
            if rank in self.stragglers:
                continue
            self.stragglers.append(rank)
            message = straggler_message(rank, compute, peers, self.straggler_probes)
            self.warnings.append(message)
            if trainer.is_global_zero:
                warnings.warn(message, stacklevel=2)

    # ------------------------------------------------------------------ the check

    def _current(self, last: int | None) -> list[StepRecord]:
        """The last ``last`` (all when None) post-warm-up records of the plan in effect."""
        recent = self.records[self.warmup_steps:]
        if not recent:
            return []
        plan = recent[-1].plan
        recent = [r for r in recent if r.plan == plan]
        return recent[-last:] if last else recent

    def summary(self, last: int | None = None) -> dict[str, float] | None:
        """Medians over the last ``last`` (default ``window``) post-warm-up steps of the current plan:
        measured and predicted step time, and compute / exposed communication from the probes among them
        (else from the latest probe of the same plan), each next to the predicted terms it measures:
        ``pred_compute_s`` compute + recompute + the runtime's fixed costs (host and device work the profiler
        sees as not communicating), ``pred_comm_s`` exposed communication + pipeline bubble (waiting in a
        collective or a p2p receive). None before enough steps."""
        recent = self._current(last or self.window)
        if not recent or recent[-1].pred_step_time_s is None:
            return None
        plan = recent[-1].plan
        probes = [r for r in recent if r.compute_s is not None] or \
                 [r for r in self.records if r.plan == plan and r.compute_s is not None][-1:]
        med = statistics.median
        out = {"steps": float(len(recent)),
               "step_time_s": med(r.step_time_s for r in recent),
               "pred_step_time_s": med(r.pred_step_time_s for r in recent),
               "pred_compute_s": med(_pred_busy(r) for r in recent),
               "pred_comm_s": med(r.pred_comm_s for r in recent)}
        if probes:
            # a probed step is slower (profiler overhead): keep its proportions, scale to the median step
            share = med(r.comm_exposed_s / r.step_time_s for r in probes)
            out["comm_s"] = share * out["step_time_s"]
            out["compute_s"] = out["step_time_s"] - out["comm_s"]
        return out

    def term_comparison(self) -> list[tuple[str, float, float | None]]:
        """(term, predicted, measured or None) medians over every post-warm-up step of the current plan: the
        step, the two sides of the measured split (``summary``), then each cost-model term (STEP_TERMS) with a
        non-zero prediction, which the monitor does not measure one by one."""
        recent = self._current(None)
        summary = self.summary(last=len(recent)) if recent else None
        if summary is None:
            return []
        rows = [("whole step", summary["pred_step_time_s"], summary["step_time_s"]),
                ("compute+recompute+runtime", summary["pred_compute_s"], summary.get("compute_s")),
                ("exposed comm+bubble", summary["pred_comm_s"], summary.get("comm_s"))]
        for name in STEP_TERMS:
            values = [v for r in recent if (v := getattr(r, f"pred_{name}_s")) is not None]
            if values and statistics.median(values) > 0:
                rows.append((name, statistics.median(values), None))
        return rows

    def disagreement(self, summary: dict[str, float]) -> str | None:
        """The warning text when measured and predicted step time differ by more than ``tolerance``."""
        meas, pred = summary["step_time_s"], summary["pred_step_time_s"]
        if pred <= 0 or abs(meas / pred - 1) <= self.tolerance:
            return None
        head = (f"autopar: measured step time {meas:.4g} s vs predicted {pred:.4g} s "
                f"({100 * (meas / pred - 1):+.0f}%, median of {int(summary['steps'])} steps)")
        if "compute_s" not in summary:
            share = summary["pred_compute_s"] / pred
            return (f"{head}; compute and communication not separately measured yet (probe_every_n_steps), "
                    f"the prediction is {100 * share:.0f}% compute")
        terms = [("compute (compute_s + recompute_s + runtime_s)", summary["compute_s"], summary["pred_compute_s"]),
                 ("exposed communication (comm_exposed_s + bubble_s)", summary["comm_s"], summary["pred_comm_s"])]
        name, m, p = max(terms, key=lambda t: abs(t[1] - t[2]))
        other = [t for t in terms if t[0] != name][0]
        factor = f"x{m / p:.2f}" if p > 0 else "predicted 0"
        return (f"{head}; the term off is {name}: measured {m:.4g} s vs predicted {p:.4g} s ({factor}); "
                f"{other[0].split(' (')[0]}: measured {other[1]:.4g} s vs predicted {other[2]:.4g} s")

    def _check(self, trainer: Any) -> None:
        if len(self.records) < self.warmup_steps + self.window:
            return
        summary = self.summary()
        message = self.disagreement(summary) if summary else None
        if message is None:
            return
        key = (self.records[-1].plan, message.split("; ", 1)[-1].split(":")[0])  # once per plan and term
        if key in self._warned:
            return
        self._warned.add(key)
        self.warnings.append(message)
        if trainer.is_global_zero:
            warnings.warn(message, stacklevel=2)

    # ------------------------------------------------------------------ the report

    def write_csv(self, path: str | Path) -> Path:
        path = Path(path)
        with atomic_file(path) as tmp, open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(StepRecord)])
            writer.writeheader()
            for rec in self.records:
                writer.writerow(asdict(rec))
        return path

    def write_png(self, path: str | Path, trainer: Any = None) -> Path:
        """Predicted vs measured over steps, the breakdown, a pipeline timeline when pp > 1, and predicted vs
        measured per term (atomic)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        pred = prediction(trainer) if trainer is not None else None
        pipeline = pred is not None and pred.plan.pp > 1
        per_rank = len(self.rank_times[-1]) > 1 if self.rank_times else False
        fig = plt.figure(figsize=(12, 16 if per_rank else 12))
        grid = fig.add_gridspec(4 if per_rank else 3, 2)
        ax_t, ax_x, ax_b, ax_4 = (fig.add_subplot(grid[i, j]) for i in range(2) for j in range(2))
        steps = [r.step for r in self.records]
        ax_t.plot(steps, [r.step_time_s for r in self.records], label="measured", marker=".")
        if any(r.pred_step_time_s is not None for r in self.records):
            ax_t.plot(steps, [r.pred_step_time_s for r in self.records], "--", label="predicted")
        probes = [r for r in self.records if r.compute_s is not None]
        if probes:
            ax_t.scatter([r.step for r in probes], [r.step_time_s for r in probes], marker="x", color="k",
                         label="profiled step", zorder=3)
        ax_t.set(title="step time", xlabel="optimizer step", ylabel="seconds")
        _log_scale_if_spread(ax_t)
        ax_t.legend(fontsize=8)
        self._plot_throughput(ax_x, steps)
        self._plot_breakdown(ax_b, pred)
        if pipeline:
            draw_pipeline(ax_4, pred)
        else:
            ax_4.plot(steps, [r.peak_mem_gib for r in self.records], label="measured peak")
            if any(r.pred_mem_gib is not None for r in self.records):
                ax_4.plot(steps, [r.pred_mem_gib for r in self.records], "--", label="predicted")
            ax_4.set(title="memory per device" + (" (CPU: peak RSS)" if trainer is not None and
                                                  trainer.strategy.root_device.type == "cpu" else ""),
                     xlabel="optimizer step", ylabel="GiB")
            ax_4.legend(fontsize=8)
        self._plot_terms(fig.add_subplot(grid[2, :]))
        if per_rank:
            self._plot_ranks(fig.add_subplot(grid[3, :]))
        title = self.records[-1].plan if self.records else ""
        fig.suptitle(f"autopar monitor: {title}", fontsize=10)
        fig.tight_layout()
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        return path

    def _plot_throughput(self, ax: Any, steps: list[int]) -> None:
        ax.plot(steps, [r.tokens_per_s for r in self.records], label="tokens/s measured", marker=".")
        if any(r.pred_tokens_per_s is not None for r in self.records):
            ax.plot(steps, [r.pred_tokens_per_s for r in self.records], "--", label="tokens/s predicted")
        ax.set(title="throughput", xlabel="optimizer step", ylabel="tokens/s")
        _log_scale_if_spread(ax)
        ax.legend(fontsize=8, loc="upper left")
        if any(r.mfu is not None for r in self.records):
            twin = ax.twinx()
            twin.plot(steps, [100 * (r.mfu or 0) for r in self.records], color="tab:green", alpha=0.6,
                      label="MFU measured")
            twin.plot(steps, [100 * (r.pred_mfu or 0) for r in self.records], "--", color="tab:green",
                      alpha=0.6, label="MFU predicted")
            twin.set_ylabel("MFU %")
            _log_scale_if_spread(twin)
            twin.legend(fontsize=8, loc="upper right")

    def _plot_breakdown(self, ax: Any, pred: Any) -> None:
        """Predicted and measured seconds of the measured split's two sides (medians after warm-up)."""
        summary = self.summary(last=len(self.records))
        terms = ["compute (+recompute, runtime)", "exposed comm (+bubble)"]
        series = []
        if pred is not None:
            b = pred.breakdown
            series.append(("predicted", [b.compute_s + b.recompute_s + b.runtime_s, b.comm_exposed_s + b.bubble_s]))
        if summary is not None and "comm_s" in summary:
            series.append(("measured", [summary["compute_s"], summary["comm_s"]]))
        elif summary is not None:
            terms.append("whole step (not split)")
            series = [(label, values + [sum(values)]) for label, values in series]
            series.append(("measured", [0.0, 0.0, summary["step_time_s"]]))
        _bars(ax, terms, series)
        ax.set(title="step breakdown (median, seconds per step)", ylabel="seconds")
        _log_scale_if_spread(ax)

    def _plot_terms(self, ax: Any) -> None:
        """Predicted vs measured per term (``term_comparison``), side by side; a term without a measured bar is
        one the monitor does not time on its own."""
        rows = self.term_comparison()
        # wrapped tick labels; the runtime's fixed costs marked as such ("step" is one of them)
        names = [f"runtime:\n{n}" if n in RUNTIME_TERMS else n.replace("+", "+\n").replace(" ", "\n", 1)
                 for n, _, _ in rows]
        series = [("predicted", [p for _, p, _ in rows]), ("measured", [m or 0.0 for _, _, m in rows])]
        _bars(ax, names, series)
        ax.set(title="predicted vs measured per term (median after warm-up, seconds per step; "
                     "no measured bar: not timed on its own)", ylabel="seconds")
        _log_scale_if_spread(ax)


    def _plot_ranks(self, ax: Any) -> None:
        """Each rank's compute and waiting in the latest profiled step; named stragglers marked."""
        latest = sorted(self.rank_times[-1], key=lambda r: r.rank)
        names = [f"rank {r.rank}" + (f"\nstage {r.stage}" if any(x.stage for x in latest) else "")
                 + ("\nSTRAGGLER" if r.rank in self.stragglers else "") for r in latest]
        _bars(ax, names, [("compute", [r.compute_s for r in latest]), ("waiting in collectives",
                                                                        [r.waiting_s for r in latest])])
        ax.set(title="per rank, latest profiled step (seconds): a straggler computes longer while its peers wait",
               ylabel="seconds")


def _bars(ax: Any, categories: list[str], series: list[tuple[str, list[float]]]) -> None:
    """Grouped bars: one group per category, one bar per (label, values) series, each bar labelled."""
    width = 0.8 / max(len(series), 1)
    for j, (label, values) in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(xs, values, width=width, label=label)
        for x, v in zip(xs, values):
            if v > 0:
                ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(categories)), categories, fontsize=8)
    if series and categories:
        ax.legend(fontsize=8)


def _log_scale_if_spread(ax: Any) -> None:
    """Log y axis when the plotted values span more than a decade (prediction and measurement far apart)."""
    values = [v for line in ax.get_lines() for v in line.get_ydata() if v is not None and v > 0]
    values += [p.get_y() + p.get_height() for p in ax.patches if p.get_height() > 0]
    if values and max(values) > 10 * min(values):
        ax.set_yscale("log")


def pipeline_schedule(pp: int, microbatches: int, schedule: str, fwd: float, bwd: float) \
        -> list[tuple[int, int, str, float, float]]:
    """(stage, micro-batch, "F"/"B", start, end) of a GPipe or 1F1B schedule with uniform stage times
    (interleaved, zero-bubble and V schedules are drawn as 1F1B). A dependency simulation: F(s, i) after
    F(s-1, i), B(s, i) after B(s+1, i), each stage one op at a time in its schedule's order."""
    orders = []
    for s in range(pp):
        if schedule == "gpipe":
            order = [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
        else:
            warm = min(pp - s - 1, microbatches)
            order = [("F", i) for i in range(warm)]
            f, b = warm, 0
            while b < microbatches:
                if f < microbatches:
                    order.append(("F", f))
                    f += 1
                order.append(("B", b))
                b += 1
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    out = []
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if pos[s] >= len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            dep = ("F", s - 1, i) if kind == "F" and s > 0 else ("B", s + 1, i) if kind == "B" and s < pp - 1 \
                else ("F", s, i) if kind == "B" else None
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done.get(dep, 0.0) if dep else 0.0)
            end = start + (fwd if kind == "F" else bwd)
            done[(kind, s, i)] = free[s] = end
            out.append((s, i, kind, start, end))
            pos[s] += 1
            progressed = True
        if not progressed:  # cannot happen for these schedules; guards against an endless loop
            break
    return out


def draw_pipeline(ax: Any, pred: Any) -> None:
    """The predicted pipeline timeline of ``pred`` (a PricedPlan with pp > 1)."""
    plan = pred.plan
    slot = (pred.breakdown.compute_s + pred.breakdown.recompute_s) / max(plan.grad_accum, 1)
    ops = pipeline_schedule(plan.pp, plan.grad_accum, plan.schedule, slot / 3, 2 * slot / 3)
    for stage, mb, kind, start, end in ops:
        ax.barh(stage, end - start, left=start, color="tab:blue" if kind == "F" else "tab:orange",
                edgecolor="k", linewidth=0.3)
        if plan.grad_accum <= 16:
            ax.text((start + end) / 2, stage, str(mb), ha="center", va="center", fontsize=6)
    # the zero-bubble and V schedules are drawn in 1F1B's order (their B/W split and V placement are not drawn)
    drawn = plan.schedule if plan.schedule in ("gpipe", "1f1b") else f"{plan.schedule} drawn as 1f1b"
    ax.set(title=f"predicted pipeline: {drawn}, pp={plan.pp}, {plan.grad_accum} micro-batches (F blue, B orange)",
           xlabel="seconds", ylabel="stage")
    ax.set_yticks(range(plan.pp))
    ax.invert_yaxis()
