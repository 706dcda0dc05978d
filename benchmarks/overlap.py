"""Measured effect of the overlap knobs (lightning_autopar.callbacks.Overlap) on CPU processes over gloo.

Every configuration trains the same GPT under strategy="autopar" with a ZeRO-3 plan over all processes (the plan
whose parameter all-gathers and gradient reduce-scatters the knobs act on), timed per optimizer step between
barriers after warm-up (_common.step_timer). In every round the baseline (FSDP2 defaults) runs first and last;
each configuration is a ratio against the mean of the two (their difference is the noise floor), and the
report gives the median ratio over rounds.

Usage: python benchmarks/overlap.py [--nproc 4] [--steps 10] [--warmup 4] [--rounds 2] [--out DIR]
(re-launches itself under torchrun; prints a table and writes DIR/overlap.json)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_main, common_args, init_workers, is_rank0, median, step_timer, token_loader  # noqa: E402

BASELINE = dict(forward_prefetch=0, backward_prefetch=0, reduce_scatter_buffers=1, separate_reduce_scatter_group=False)
CONFIGS: list[tuple[str, dict | None]] = [
    ("baseline: FSDP2 defaults", BASELINE),
    ("planner's choice", None),
    ("prefetch fwd/bwd 1", dict(BASELINE, forward_prefetch=1, backward_prefetch=1)),
    ("prefetch fwd/bwd 2", dict(BASELINE, forward_prefetch=2, backward_prefetch=2)),
    ("reshard_after_forward=False", dict(BASELINE, reshard_after_forward=False)),
    ("reduce-scatter buffers 2", dict(BASELINE, reduce_scatter_buffers=2)),
    ("separate reduce-scatter group", dict(BASELINE, separate_reduce_scatter_group=True)),
    ("baseline again", BASELINE),
]
RESULT_FILE = "overlap.json"


def parse_args() -> argparse.Namespace:
    p = common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per configuration")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="repeat all configurations (drift and noise)")
    return p.parse_args()


def run(knobs: dict | None, args: argparse.Namespace, world: int) -> tuple[float, list[str], str]:
    """(median step seconds, knobs applied, plan) of one configuration."""
    import lightning.pytorch as L

    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.callbacks import Overlap
    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    L.seed_everything(0, verbose=False)
    seq, batch = 64, 4 * world
    module = LitGPT(GPTConfig(vocab=512, seq_len=seq, layers=6, hidden=256, heads=4, ffn_hidden=1024))
    timer, overlap = step_timer(args.warmup), Overlap(verbose=False, **(knobs or {}))
    strategy = AutoParallelStrategy(fix=f"dp={world},zero=3,dp_shard={world}", cluster="cpu", print_plan=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=args.warmup + args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer, overlap])
    trainer.fit(module, token_loader(batch * (args.warmup + args.steps), seq, batch, vocab=512))
    return median(timer.times), overlap.applied or ["FSDP2 defaults"], strategy.plan.short()


def worker(args: argparse.Namespace) -> None:
    _, world = init_workers()
    started = time.perf_counter()
    results = {label: {"config": label, "ratios": [], "step_s": []} for label, _ in CONFIGS}
    for _ in range(args.rounds):
        times = {}
        for label, knobs in CONFIGS:
            times[label], applied, plan = run(knobs, args, world)
            results[label].update(knobs_applied=applied, plan=plan)
        base = (times[CONFIGS[0][0]] + times[CONFIGS[-1][0]]) / 2
        for label, t in times.items():
            results[label]["step_s"].append(t)
            results[label]["ratios"].append(t / base)
    if is_rank0():
        report(list(results.values()), args, world, time.perf_counter() - started)


def report(results: list[dict], args: argparse.Namespace, world: int, seconds: float) -> None:
    from _common import write_result

    noise = median([abs(a - b) for a, b in zip(results[0]["ratios"], results[-1]["ratios"])])
    print(f"\noverlap knobs on {world} CPU processes (gloo), plan {results[0]['plan']}, {args.rounds} round(s); "
          f"ratios against the mean of each round's first and last baseline (they differ by {100 * noise:.1f}%: "
          "the noise floor)")
    print(f"{'configuration':32s} {'ms/step':>9s} {'vs baseline':>12s} {'per round':>16s}  knobs applied")
    for r in results:
        r["ratio"] = median(r["ratios"])
        rounds = " ".join(f"{x:.2f}" for x in r["ratios"])
        print(f"{r['config']:32s} {1e3 * median(r['step_s']):9.1f} {r['ratio']:12.3f} {rounds:>16s}  "
              f"{', '.join(r['knobs_applied'])}")
    write_result(args, RESULT_FILE, {"world": world, "noise": noise, "results": results}, seconds, "overlap")


def main() -> int:
    return bench_main(__file__, parse_args(), worker, RESULT_FILE)


if __name__ == "__main__":
    raise SystemExit(main())
