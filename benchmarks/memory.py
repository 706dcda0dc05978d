"""Memory truth: the planner's predicted peak per device against the measured peak, plan by plan (issue 17).

One launch, 4 CPU processes (gloo). Our GPT (hidden 256, 4 layers, seq 512, vocab 256; an MoE variant for ep),
each plan pinned with ``fix=``, trained ``--steps`` optimizer steps; the second (the first creates the optimizer's
states) is measured on every rank under MemTracker (profile/memory.peak_memory_callback: parameters, gradients,
optimizer states, activations, temporaries); the measured peak is the maximum over ranks. Predicted: the
planner's ``memory_gib_per_device`` for the same plan on the same cluster (``cpu``) less the cluster's
``reserved_gib``: a per-process constant (Python, torch, the allocator) that MemTracker does not see, so the two
are compared without it. A plan the runtime refuses (a ConfigError) is listed as refused. Writes
OUT/memory.json (default OUT: outputs/benchmarks) and prints a table: measured (by category), predicted, error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (bench_main, common_args, fresh_threads, init_workers, median, token_loader,  # noqa: E402
                     write_result)

HIDDEN = 256
BASE = dict(dp=4, zero=0, tp=1, pp=1, ep=1, cp=1, sp="false", mbs=1, grad_accum=1, recompute="none",
            precision="fp32", recompute_every=1, offload="none")
PLANS: dict[str, tuple[dict[str, Any], bool]] = {  # name -> (fields over BASE, MoE model)
    "dp4 zero0": ({}, False),
    "dp4 zero1": ({"zero": 1}, False),
    "dp4 zero2": ({"zero": 2}, False),
    "dp4 zero3": ({"zero": 3}, False),
    "tp2 x dp2": ({"dp": 2, "tp": 2, "mbs": 2}, False),
    "tp2+sp x dp2": ({"dp": 2, "tp": 2, "sp": "true", "mbs": 2}, False),
    "pp2 1f1b": ({"dp": 2, "pp": 2, "grad_accum": 2, "schedule": "1f1b"}, False),
    "pp2 gpipe": ({"dp": 2, "pp": 2, "grad_accum": 2, "schedule": "gpipe"}, False),
    "pp2 interleaved": ({"dp": 2, "pp": 2, "vpp": 2, "grad_accum": 2, "schedule": "interleaved"}, False),
    "pp2 zbv": ({"dp": 2, "pp": 2, "vpp": 2, "grad_accum": 2, "schedule": "zbv"}, False),
    "ep2 moe": ({"ep": 2}, True),
    "cp2 x dp2": ({"dp": 2, "cp": 2, "mbs": 2}, False),
    "dp4 recompute=selective": ({"recompute": "selective"}, False),
    "dp4 recompute=full": ({"recompute": "full"}, False),
    "dp4 recompute=ops": ({"recompute": "ops"}, False),
    "dp4 recompute=full/2": ({"recompute": "full", "recompute_every": 2}, False),
    "dp4 zero3 offload=params": ({"zero": 3, "offload": "params"}, False),
    "dp4 zero2 offload=optimizer": ({"zero": 2, "offload": "optimizer"}, False),
    "pp2 interleaved-zb": ({"dp": 2, "pp": 2, "vpp": 2, "grad_accum": 2, "schedule": "interleaved-zb"}, False),
    # dualpipev needs 2 * pp micro-batches: the 4 rows of the global batch at dp=1 (tp=2 fills the world)
    "pp2 x tp2 dualpipev": ({"dp": 1, "tp": 2, "pp": 2, "vpp": 2, "grad_accum": 4, "schedule": "dualpipev"}, False),
}
# issue 17's target: recompute=ops between none (the "dp4 zero0" row) and full in memory and in step time, measured
# as priced; these rows run TIMED_STEPS steps, the unmeasured ones after the first timed
RECOMPUTE_ROWS = ("dp4 zero0", "dp4 recompute=ops", "dp4 recompute=full")
TIMED_STEPS = 5
GLOBAL_BATCH = 4


def parse_args() -> argparse.Namespace:
    p = common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per plan; the second is measured")
    p.add_argument("--only", default="", help="comma-separated plan names (default: all)")
    return p.parse_args()


def fix_string(fields: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in {**BASE, **fields}.items())


def lit_module(seq_len: int, moe: bool) -> Any:
    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    cfg = GPTConfig(vocab=256, seq_len=seq_len, layers=4, hidden=HIDDEN, heads=4, ffn_hidden=4 * HIDDEN,
                    experts=4 if moe else 0)
    return LitGPT(cfg, optimizer="adamw", lr=1e-3)


def gather_max(measured: Any) -> dict[str, Any]:
    """The rank with the highest peak: its peak and categories (every rank gets the same)."""
    import torch.distributed as dist

    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, measured.to_dict())
    top = max(rows, key=lambda r: r["peak_gib"])
    return {**top, "per_rank_peak_gib": [r["peak_gib"] for r in rows]}


def run(fields: dict[str, Any], moe: bool, args: argparse.Namespace, timed: bool = False) -> dict[str, Any]:
    import lightning.pytorch as L

    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.errors import ConfigError
    from lightning_autopar.profile.memory import ddp_bucket_bytes, peak_memory_callback, with_untracked

    L.seed_everything(0, verbose=False)
    module = lit_module(args.seq_len, moe)
    # a split backward (zero-bubble schedules) breaks MemTracker's backward hooks: peak total only there
    split_backward = fields.get("schedule") in ("interleaved-zb", "zbv", "dualpipev")
    steps = max(args.steps, TIMED_STEPS) if timed else args.steps
    callback = peak_memory_callback(measure_batches=(1,), backward_hooks=not split_backward)
    clock = StepClock()
    strategy = AutoParallelStrategy(fix=fix_string(fields), cluster="cpu", print_plan=False, profile=False)
    loader = token_loader(GLOBAL_BATCH * steps, args.seq_len, GLOBAL_BATCH)
    try:
        fit(module, strategy, loader, steps, [callback, clock])
    except ConfigError as err:
        return {"refused": str(err)}
    best = strategy.report.best
    device = strategy.report.cluster.device
    reserved = device.reserved_gib
    # offloaded states: in memory_gib_per_device where the device has no host memory of its own (host_link_gbs
    # 0, as on this CPU cluster), else beside it (PricedPlan.host_gib_per_device); here they are in the same memory
    host = best.host_gib_per_device if device.host_link_gbs > 0 else 0.0
    measured = with_untracked(callback.peak, "ddp_buckets", ddp_bucket_bytes(module))
    row = {"plan": best.plan.short(), "measured": gather_max(measured),
           "predicted_gib": best.memory_gib_per_device - reserved + host, "reserved_gib": reserved,
           "predicted_terms_gib": dict(best.memory_breakdown)}
    if timed:
        row.update(predicted_step_s=best.step_time_s, measured_step_s=median(clock.seconds[2:]))
    return row


class StepClock:
    """Wall seconds of each training batch (a Lightning callback); the first two (warm-up, the MemTracker-measured
    one) are not step times."""

    def __init__(self) -> None:
        import lightning.pytorch as L

        self.seconds: list[float] = []
        self._start = 0.0
        clock = self

        class _Clock(L.Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                clock._start = time.perf_counter()

            def on_train_batch_end(self, *args: Any) -> None:
                clock.seconds.append(time.perf_counter() - clock._start)

        self.callback = _Clock()


def fit(module: Any, strategy: Any, loader: Any, steps: int, callbacks: list[Any]) -> None:
    """``steps`` optimizer steps with a fresh CPU Trainer carrying ``callbacks``, from the process's thread state."""
    import lightning.pytorch as L
    import torch.distributed as dist

    fresh_threads()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[getattr(c, "callback", c) for c in callbacks])
    trainer.fit(module, loader)


def error(row: dict[str, Any]) -> float:
    """(predicted - measured) / measured."""
    return (row["predicted_gib"] - row["measured"]["peak_gib"]) / row["measured"]["peak_gib"]


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    cats = ("parameters", "gradients", "optimizer", "activations", "temporaries", "ddp_buckets")
    head = (f"{'plan':26s} {'measured':>9s} " + " ".join(f"{c[:6]:>7s}" for c in cats)
            + f" {'predicted':>9s} {'error':>7s}")
    lines = [head + "   (MiB; measured = max over ranks, at that rank's peak)"]
    for name, row in rows.items():
        if "refused" in row:
            lines.append(f"{name:26s} refused: {row['refused']}")
            continue
        m = row["measured"]
        by = " ".join(f"{1024 * m['by_category'].get(c, 0.0):7.1f}" for c in cats)
        lines.append(f"{name:26s} {1024 * m['peak_gib']:9.1f} {by} {1024 * row['predicted_gib']:9.1f} "
                     f"{100 * error(row):+6.1f}%")
    return lines


TERMS = {  # predicted term -> the measured categories it stands for
    "parameters": ("parameters",), "gradients": ("gradients",), "optimizer": ("optimizer",),
    "activations+buffers": ("activations", "temporaries", "ddp_buckets", "buffers", "other"),
}


def term_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Per term: predicted / measured MiB at the measured peak (activations+buffers: the dynamic rest)."""
    lines = [f"{'plan':26s} " + " ".join(f"{t:>24s}" for t in TERMS) + "   (predicted / measured MiB)"]
    for name, row in rows.items():
        if "refused" in row or not row.get("predicted_terms_gib"):
            continue
        pred, by = row["predicted_terms_gib"], row["measured"]["by_category"]
        pred = {**pred, "activations+buffers": pred.get("activations", 0.0) + pred.get("buffers", 0.0)}
        cells = [f"{1024 * pred[t]:10.1f} / {1024 * sum(by.get(c, 0.0) for c in cats):10.1f}"
                 for t, cats in TERMS.items()]
        lines.append(f"{name:26s} " + " ".join(f"{c:>24s}" for c in cells))
    return lines


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    rank, world = init_workers()
    started = time.perf_counter()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(PLANS)
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        fields, moe = PLANS[name]
        rows[name] = run(fields, moe, args, timed=name in RECOMPUTE_ROWS)
        if rank == 0:
            print(table({name: rows[name]})[-1], flush=True)
    if rank != 0:
        return
    errors = [abs(error(r)) for r in rows.values() if "refused" not in r]
    result = {"world": world, "seq_len": args.seq_len, "global_batch": GLOBAL_BATCH, "cluster": "cpu",
              "plans": rows, "median_abs_error": median(errors), "max_abs_error": max(errors, default=float("nan")),
              "seconds": time.perf_counter() - started}
    print("\n".join(table(rows) + [""] + term_table(rows)), flush=True)
    print(f"|predicted - measured| / measured over {len(errors)} plans: median {100 * result['median_abs_error']:.1f}%,"
          f" max {100 * result['max_abs_error']:.1f}% (predicted without the cluster's reserved_gib)", flush=True)
    for line in recompute_check(rows):
        print(line, flush=True)
    write_result(args, "memory.json", result, result["seconds"], "memory")


def recompute_check(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Issue 17's target: recompute=ops between none and full in memory and in step time, measured and priced."""
    none, ops, full = (rows.get(n) for n in RECOMPUTE_ROWS)
    if not all(r is not None and "measured_step_s" in r for r in (none, ops, full)):
        return []
    values = {"measured memory": [r["measured"]["peak_gib"] for r in (none, ops, full)],
              "predicted memory": [r["predicted_gib"] for r in (none, ops, full)],
              "measured step s": [r["measured_step_s"] for r in (none, ops, full)],
              "predicted step s": [r["predicted_step_s"] for r in (none, ops, full)]}
    lines = ["recompute none / ops / full (dp4):"]
    for what, (n, o, f) in values.items():
        between = min(n, f) < o < max(n, f)
        lines.append(f"  {what:17s} {n:9.4g} {o:9.4g} {f:9.4g}   ops between: {'yes' if between else 'NO'}")
    return lines


def main() -> int:
    return bench_main(__file__, parse_args(), worker, "memory.json")


if __name__ == "__main__":
    sys.exit(main())
