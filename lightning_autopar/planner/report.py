"""The planner's report: ranked plans, the contract JSON, a rich table, a PNG, and the explanation of the winner."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lightning_autopar.planner.forms import form_of
from lightning_autopar.specs import ClusterSpec, ModelSpec, Plan, PricedPlan, RuntimeProfile, TrialResult

TERMS = (("compute_s", "compute"), ("recompute_s", "recompute"), ("comm_exposed_s", "exposed comm"),
         ("bubble_s", "pipeline bubble"), ("runtime_s", "runtime fixed costs"))
LAYOUT_FIELDS = ("dp", "tp", "pp", "cp", "ep")
# the memory panel's stacked terms (search._memory_terms, PricedPlan.memory_breakdown), bottom to top
MEMORY_TERMS = ("parameters", "gradients", "optimizer", "activations", "buffers", "reserved")
# Where the figures behind a printed step time come from (PlanReport.source): measured on this machine at set-up
# (profile / trials), a calibrated cluster file (a profile cache's cluster.yaml, `autopar probe`), or a preset
# (or discovered) cluster nobody measured.
SOURCE_MEASURED = "measured here"
SOURCE_CALIBRATED = "calibrated file"
SOURCE_PRESET = "preset (uncalibrated)"
# How far off uncalibrated presets typically are, as BENCHMARKS.md measured them: on CPU processes (gloo, shared
# cores) the `cpu` preset predicts steps 3-4x too fast ("Memory truth", "Sequence and context parallelism"); README's
# main job (a 0.9 M-parameter GPT, 4 processes) measured ~18x its preset prediction; on the published GPU runs of
# the dev set the presets' step time is off by a median 6.0%, at most 22.2% ("Published runs").
PRESET_ERROR = {"cpu": "on CPU processes presets predict steps 3-4x too fast, more for tiny models (BENCHMARKS.md)",
                "gpu": "on published GPU runs presets are off by a median 6%, at most 22% (BENCHMARKS.md)"}


def cluster_source(cluster: ClusterSpec) -> str:
    """SOURCE_CALIBRATED when the cluster carries measured runtime figures (calibrate / probe / a cache's
    cluster.yaml set ``runtime.source``), else SOURCE_PRESET: what the planner alone can tell."""
    return SOURCE_CALIBRATED if cluster.runtime.source else SOURCE_PRESET


def source_note(source: str, cluster: ClusterSpec) -> str:
    """One line on what the step times rest on; for a preset, how far off presets typically are and how to
    measure instead."""
    if source.startswith(SOURCE_PRESET):
        kind = "cpu" if "cpu" in cluster.device.name.lower() else "gpu"
        return (f"step times: {source}, {PRESET_ERROR[kind]}; measure them: the strategy's profile=True, or "
                "`autopar plan --cluster` on a calibrated cluster.yaml")
    return f"step times: {source}"


@dataclass
class PlanReport:
    best: PricedPlan
    candidates: list[PricedPlan]
    evaluated: int
    feasible: int
    rejected: dict[str, int]
    search_seconds: float
    model: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    seq_len: int
    explanation: list[str] = field(default_factory=list)
    memory_fraction: float = 0.9
    runner_up: PricedPlan | None = None  # best plan with another layout (dp/tp/pp/cp/ep), for the explanation
    # plan field -> why the runtime does not offer its other values for this model (set by the live strategy)
    excluded: dict[str, str] = field(default_factory=dict)
    profile: RuntimeProfile | None = None  # what the live strategy measured at set-up (profile/runtime.py)
    trials: list[TrialResult] = field(default_factory=list)  # plans run at set-up (trials=K), predicted vs measured
    # the plan needing the least device memory of the whole space searched (recompute, offload included), priced
    smallest: PricedPlan | None = None
    # where the step times' figures come from (SOURCE_*; cluster_source by default, the strategy after measuring)
    source: str = ""
    priced: int = 0  # candidates whose step time was computed (the search skips those that cannot rank)

    def __post_init__(self) -> None:
        self.source = self.source or cluster_source(self.cluster)

    def to_json_dict(self) -> dict[str, Any]:
        """The contract JSON: best, candidates, evaluated, feasible, search_seconds."""
        return {
            "best": self.best.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "evaluated": int(self.evaluated),
            "feasible": int(self.feasible),
            "search_seconds": float(self.search_seconds),
            "step_time_source": self.source,
            "step_time_note": source_note(self.source, self.cluster),
        }

    def print_table(self, console: Any = None) -> None:
        """Top-k plans with the step breakdown, then the search summary and the explanation (rich)."""
        from rich.console import Console
        from rich.table import Table

        if console is None:
            console = Console()
            if not console.is_terminal:  # logs and pipes: wide enough that the plan column does not wrap
                console = Console(width=max(console.width, 160))
        c = self.cluster
        form = form_of(self.model)  # unit form: a sample is one batch row, samples/s, no sequence length
        table = Table(title=f"autopar plan: {self.model.name} on {c.name} ({c.nodes} x {c.devices_per_node} "
                            f"{c.device.name}), global batch {self.global_batch}, "
                            f"{form.shape(self.model, self.seq_len)}")
        rate = form.rate
        runtime = any(p.breakdown.runtime_s for p in self.candidates)
        cols = ["#", "plan", "step s", rate, "MFU", "GiB/dev", "compute", "recompute", "comm", "bubble"]
        for col in cols + (["runtime"] if runtime else []):
            table.add_column(col, justify="left" if col == "plan" else "right")
        for i, group in enumerate(same_price_groups(self.candidates), 1):
            p, b = group[0], group[0].breakdown
            flag = "" if p.feasible else " [red](does not fit)[/red]"
            table.add_row(str(i), merged_short([g.plan for g in group]) + flag, f"{p.step_time_s:.4g}",
                          f"{p.tokens_per_s:,.0f}", f"{100 * p.mfu:.1f}%", f"{p.memory_gib_per_device:.2f}",
                          f"{b.compute_s:.3g}", f"{b.recompute_s:.3g}", f"{b.comm_exposed_s:.3g}", f"{b.bubble_s:.3g}",
                          *([f"{b.runtime_s:.3g}"] if runtime else []))
        console.print(table)
        console.print(source_note(self.source, self.cluster), highlight=False)
        if self.candidates and self.candidates[0].memory_breakdown:
            console.print(f"memory per device, plan #1: {memory_line(self.candidates[0])}", highlight=False)
        self._print_measured(console)
        rejected = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items(), key=lambda kv: -kv[1]))
        console.print(f"evaluated {self.evaluated:,} plans, {self.feasible:,} feasible, in "
                      f"{self.search_seconds:.3f} s" + (f"; rejected: {rejected}" if rejected else ""))
        for line in self.explanation:
            console.print(f"- {line}", highlight=False)
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.excluded.items():  # fields kept for one reason share a line
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            console.print(f"- not offered for this model: other {', '.join(names)} values ({reason})", highlight=False)

    def _print_measured(self, console: Any) -> None:
        """What the prediction rests on when it was measured: the calibrated figures, the set-up profile, the
        winner's runtime terms by name, and the trials (predicted vs measured)."""
        prof = self.profile
        if prof is not None:
            kinds = sorted({f"{b.kind}@mbs{b.mbs}" for b in prof.blocks})
            ops = sorted({f"{c.op}x{c.ranks}" for c in prof.collectives})
            console.print(f"measured at set-up in {prof.seconds:.2f} s (budget {prof.budget_s:.3g} s): blocks "
                          f"{', '.join(kinds) or 'none'}; collectives {', '.join(ops) or 'none'}"
                          + (f"; skipped: {'; '.join(prof.skipped)}" if prof.skipped else ""), highlight=False)
        if prof is not None or self.cluster.runtime.source:
            for line in describe_cluster(self.cluster):
                console.print(f"  {line}", highlight=False)
        terms = self.best.breakdown.terms
        if any(terms.values()):
            console.print("runtime terms of #1: " + ", ".join(f"{k} {1e3 * v:.3g} ms" for k, v in terms.items() if v),
                          highlight=False)
        if self.trials:
            from rich.table import Table

            table = Table(title="trials: the best distinct plans run on the live group before choosing")
            for col in ("plan", "predicted s", "measured s", "measured / predicted"):
                table.add_column(col, justify="left" if col == "plan" else "right")
            for t in self.trials:
                plan = Plan(**t.plan).short()
                ratio = f"{t.measured_s / t.predicted_s:.2f}" if t.measured_s > 0 and t.predicted_s > 0 else "-"
                table.add_row(plan, f"{t.predicted_s:.4g}", f"{t.measured_s:.4g}" if not t.error else t.error, ratio)
            console.print(table)

    def memory_bars(self) -> dict[str, dict[str, float]]:
        """The memory panel's bars, GiB per device by term (MEMORY_TERMS, then "host": offloaded states, drawn as
        a separate hatched bar): the winner ("#1 (winner)") and the smallest-memory plan ("smallest"), the
        latter only when it is another plan."""
        bars: dict[str, dict[str, float]] = {}
        plans = [("#1 (winner)", self.best)]
        if self.smallest is not None and self.smallest.plan != self.best.plan:
            plans.append(("smallest", self.smallest))
        for label, p in plans:
            terms = {name: float(p.memory_breakdown.get(name, 0.0)) for name in MEMORY_TERMS}
            terms["host"] = float(p.host_gib_per_device)
            bars[label] = terms
        return bars

    def _draw_memory_terms(self, ax: Any) -> None:
        """Stacked memory terms of the winner and of the smallest plan, the host bytes as a hatched bar beside."""
        bars = self.memory_bars()
        x = list(range(len(bars)))
        bottom = [0.0] * len(bars)
        for name in MEMORY_TERMS:
            vals = [b[name] for b in bars.values()]
            ax.bar([i - 0.2 for i in x], vals, width=0.4, bottom=bottom, label=name)
            bottom = [a + v for a, v in zip(bottom, vals)]
        ax.bar([i + 0.2 for i in x], [b["host"] for b in bars.values()], width=0.4, color="white",
               edgecolor="tab:gray", hatch="//", label="host (offload)")
        ax.set_xticks(x, list(bars))
        ax.axhline(self.cluster.device.memory_gib * self.memory_fraction, color="k", linestyle="--",
                   label="device limit")
        ax.set_ylabel("GiB per device")
        ax.set_title("memory by term")
        ax.legend(fontsize=7)

    def save_png(self, path: str | os.PathLike) -> Path:
        """Stacked time terms per candidate, memory per device against capacity, and the memory breakdown of the
        winner and of the smallest-memory plan (memory_bars); written atomically."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        names = [f"#{i}" for i in range(1, len(self.candidates) + 1)]
        fig, (ax_t, ax_m, ax_b) = plt.subplots(1, 3, figsize=(max(12, 1.1 * len(names) + 8), 4.5))
        bottom = [0.0] * len(names)
        for attr, label in TERMS:
            vals = [getattr(p.breakdown, attr) for p in self.candidates]
            ax_t.bar(names, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax_t.set_ylabel("seconds per step")
        ax_t.set_title("step time by term")
        ax_t.legend(fontsize=8)
        mem = [p.memory_gib_per_device for p in self.candidates]
        ax_m.bar(names, mem, color=["tab:blue" if p.feasible else "tab:red" for p in self.candidates])
        cap = self.cluster.device.memory_gib
        ax_m.axhline(cap, color="k", linestyle="-", label=f"capacity {cap:g} GiB")
        ax_m.axhline(cap * self.memory_fraction, color="k", linestyle="--", label=f"x {self.memory_fraction:g}")
        ax_m.set_ylabel("GiB per device")
        ax_m.set_title("memory per device")
        ax_m.legend(fontsize=8)
        self._draw_memory_terms(ax_b)
        fig.suptitle(f"{self.model.name} on {self.cluster.name}: best {self.best.plan.short()}", fontsize=9)
        fig.tight_layout()
        from lightning_autopar.files import atomic_file

        try:
            with atomic_file(path) as tmp:
                fig.savefig(tmp, format=(path.suffix.lstrip(".") or "png"), dpi=110)
        finally:
            plt.close(fig)
        return path


# ============================================================================================ table rows


def _price_key(p: PricedPlan) -> tuple:
    """What a table row shows of a plan's price: plans equal in it are one row."""
    b = p.breakdown
    return (p.feasible, f"{p.step_time_s:.4g}", f"{p.memory_gib_per_device:.2f}", f"{b.compute_s:.3g}",
            f"{b.recompute_s:.3g}", f"{b.comm_exposed_s:.3g}", f"{b.bubble_s:.3g}", f"{b.runtime_s:.3g}")


def same_price_groups(candidates: list[PricedPlan]) -> list[list[PricedPlan]]:
    """The candidates in rank order, each group holding the plans whose row would read the same (_price_key):
    a field the cost model prices at nothing here (zero 1 vs 2 without memory pressure, compile without a
    measured speed-up) is one row with its alternatives named, not four."""
    groups: dict[tuple, list[PricedPlan]] = {}
    for p in candidates:
        groups.setdefault(_price_key(p), []).append(p)
    return list(groups.values())


def _value(v: Any) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def merged_short(plans: list[Plan]) -> str:
    """One plan's ``short()``, or for plans priced the same the parts they share then the alternatives by field:
    "dp=4 mbs=4 ga=1; zero 1|2, compile off|on". When the group is not every combination of those values, the
    alternatives are the plans' own differences: "...; zero=1 | zero=2 compile"."""
    if len(plans) == 1:
        return plans[0].short()
    shorts = [p.short().split() for p in plans]
    common = [t for t in shorts[0] if all(t in s for s in shorts[1:])]
    dicts = [p.to_dict() for p in plans]
    differing = {k: list(dict.fromkeys(d[k] for d in dicts)) for k in dicts[0] if len({str(d[k]) for d in dicts}) > 1}
    combinations = 1
    for values in differing.values():
        combinations *= len(values)
    if combinations == len(plans):
        alternatives = ", ".join(f"{k} {'|'.join(_value(v) for v in vals)}" for k, vals in differing.items())
    else:
        alternatives = " | ".join(" ".join(t for t in s if t not in common) or "(base)" for s in shorts)
    return f"{' '.join(common)}; {alternatives}"


# ============================================================================================ measured inputs


def describe_cluster(cluster: ClusterSpec) -> list[str]:
    """The figures the planner priced with, one line each: device rates, links, the runtime's fixed costs."""
    dev = cluster.device
    pk = dev.peak_tflops
    lines = [f"device {dev.name}: matmul {pk.fp32:.4g} TFLOP/s fp32, {pk.bf16:.4g} bf16 (x{dev.gemm_efficiency:g} "
             f"sustained), stream {dev.memory_bandwidth_gbs * dev.memory_efficiency:.4g} GB/s, "
             f"{dev.kernel_overhead_us:.3g} us per op"]
    for link in cluster.links:
        rs = f", reduce-scatter x{link.reduce_scatter_factor:.3g}" if link.reduce_scatter_factor != 1 else ""
        lines.append(f"link {link.level}: {link.latency_us:.4g} us latency, "
                     f"{link.bandwidth_gbs * link.efficiency:.4g} GB/s per device{rs}")
    rt = cluster.runtime
    measured = ", ".join(f"{name.removesuffix('_us')} {value:.4g} us" for name, value in rt.figures().items() if value)
    if measured:
        lines.append(f"runtime fixed costs ({rt.source or 'given'}): {measured}")
    if rt.compile_speedup > 0:
        lines.append(f"compiled blocks (plan.compile): {rt.compile_speedup:.3g}x the eager block's speed (measured)")
    return lines


# ============================================================================================ explanation


def memory_line(p: PricedPlan) -> str:
    """The predicted memory per device by term (PricedPlan.memory_breakdown), GiB: "parameters 1.2, ... = 9.8",
    and the offloaded states' host GiB where there are any."""
    terms = ", ".join(f"{name} {gib:.3g}" for name, gib in p.memory_breakdown.items())
    host = f"; host {p.host_gib_per_device:.3g} GiB (offload={p.plan.offload})" if p.host_gib_per_device else ""
    return f"{terms} = {p.memory_gib_per_device:.3g} GiB{host}"


def _dominant(p: PricedPlan) -> str:
    step = max(p.step_time_s, 1e-30)
    parts = sorted(((getattr(p.breakdown, a), n) for a, n in TERMS), reverse=True)
    return ", ".join(f"{n} {100 * v / step:.0f}%" for v, n in parts if v > 0.005 * step)


def plan_diff(new: Plan, old: Plan) -> str:
    """The fields where ``new`` differs from ``old``: 'pp=4 (was 2), mbs=1 (was 2)'."""
    a, b = new.to_dict(), old.to_dict()
    out = [f"{k}={a[k]} (was {b[k]})" for k in a if a[k] != b[k]]
    return ", ".join(out) or "same plan"


def _scaled_links(cluster: ClusterSpec, level: int, factor: float) -> ClusterSpec:
    links = [dataclasses.replace(l) for l in cluster.links]
    links[level] = dataclasses.replace(links[level], bandwidth_gbs=links[level].bandwidth_gbs * factor)
    return dataclasses.replace(cluster, links=links)


def _scaled_memory(cluster: ClusterSpec, factor: float) -> ClusterSpec:
    device = dataclasses.replace(cluster.device, memory_gib=cluster.device.memory_gib * factor)
    return dataclasses.replace(cluster, device=device, links=[dataclasses.replace(l) for l in cluster.links])


WhatIf = Callable[[ClusterSpec, bool], "tuple[Plan, float] | None"]


def explain(report: PlanReport, what_if: WhatIf) -> list[str]:
    """Why the winner wins: its dominant term, what the runner-up loses and where, and what would flip the choice."""
    best = report.best
    lines = [f"winner {best.plan.short()}: {best.step_time_s:.4g} s/step, MFU {100 * best.mfu:.1f}%, "
             f"{best.memory_gib_per_device:.1f} GiB/device; time goes to {_dominant(best)}"]
    rival = report.runner_up or (report.candidates[1] if len(report.candidates) > 1 else None)
    if rival is not None:
        slower = rival.step_time_s / best.step_time_s - 1
        deltas = sorted(((getattr(rival.breakdown, a) - getattr(best.breakdown, a), n) for a, n in TERMS),
                        reverse=True)
        loses = ", ".join(f"{'+' if d >= 0 else ''}{d:.3g} s {n}" for d, n in deltas if abs(d) > 1e-3 * best.step_time_s)
        lines.append(f"runner-up {rival.plan.short()} is {100 * slower:.1f}% slower ({loses or 'same terms'}); "
                     f"it differs in {plan_diff(rival.plan, best.plan)}")
    c = report.cluster
    scenarios: list[tuple[str, ClusterSpec, bool]] = []
    if c.nodes > 1:
        scenarios.append(("2x inter-node bandwidth", _scaled_links(c, len(c.links) - 1, 2.0), True))
    if c.devices_per_node > 1 and (c.nodes == 1 or len(c.links) > 1):
        scenarios.append(("2x intra-node bandwidth", _scaled_links(c, 0, 2.0), True))
    scenarios.append(("2x device memory", _scaled_memory(c, 2.0), False))
    for label, cluster, reprice in scenarios:
        got = what_if(cluster, reprice)
        if got is None:
            continue
        plan, step = got
        gain = 100 * (1 - step / best.step_time_s)
        if plan == best.plan:
            lines.append(f"with {label}, the winner stays ({gain:.1f}% faster)")
        else:
            lines.append(f"with {label}, {plan_diff(plan, best.plan)} wins: {plan.short()} ({gain:.1f}% faster)")
    return lines
