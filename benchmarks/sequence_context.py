"""Sequence and context parallelism at a long sequence: step time and memory of tp2 vs tp2+sp, and of cp1 vs cp2
(and cp4), each measured plan next to the planner's prediction for it.

    python benchmarks/sequence_context.py [--nproc 4] [--seq-len 2048] [--repeats 3] [--steps 4] [--warmup 1]

One launch of ``--nproc`` CPU processes (gloo, started as a user's are: no thread setting; ``_common``), our GPT
(hidden 256, 4 heads, 4 layers, vocab 256: activations dominate at a long sequence), AdamW. Two groups of plans,
each pinned whole with ``fix=`` on ``AutoParallelStrategy(cluster="cpu")``:

* ``sp``: global batch 2, dp=2 x tp=2, sequence parallel off and on;
* ``cp``: global batch 1 (one long sequence, where data parallelism cannot split the batch further): cp1 = tp=4
  (without and with sp), cp2 = tp=2 x cp=2, cp4 = cp=4.

Per plan: the median optimizer step (timed between two barriers after ``--warmup``) pooled over ``--repeats``
rounds, the plans of a group run next to each other, every other round in reverse order; memory per rank =
activations (the bytes autograd saved for backward during the step's forward, distinct storages, counted with
``torch.autograd.graph.saved_tensors_hooks``: what SP and CP shard) + model states (parameters, gradients and
optimizer states this rank holds); the planner's ``step_time_s`` and ``memory_gib_per_device`` of the same plan
on the same cluster, less the cluster's fixed per-process reserve (``device.reserved_gib``: Python and torch,
which the measured figure leaves out). Ratios are taken within a group, in one run. Writes OUT/sequence_context.json (default OUT:
outputs/benchmarks).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (bench_main, common_args, guarded_run, init_workers, load_summary, median, timed_fit,  # noqa: E402
                     token_loader, write_result)

HIDDEN = 256
BASE = "zero=0,pp=1,ep=1,mbs=1,grad_accum=1,recompute=none,precision=fp32"
GROUPS = {  # group -> (global batch, {name: plan fields})
    "sp": (2, {"tp2": "dp=2,tp=2,sp=false,cp=1", "tp2+sp": "dp=2,tp=2,sp=true,cp=1"}),
    "cp": (1, {"cp1 (tp4)": "dp=1,tp=4,sp=false,cp=1", "cp1 (tp4+sp)": "dp=1,tp=4,sp=true,cp=1",
               "cp2 (tp2 x cp2)": "dp=1,tp=2,sp=false,cp=2", "cp4": "dp=1,tp=1,sp=false,cp=4"}),
}


def parse_args() -> argparse.Namespace:
    p = common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args()


def lit_module(seq_len: int, saved: list[int]) -> Any:
    """Our GPT in its LightningModule; ``saved`` gets the bytes each training step's forward saved for backward."""
    import torch

    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    class Module(LitGPT):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen: dict[Any, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                if isinstance(t, torch.nn.Parameter):
                    return t
                local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
                try:  # one count per storage (views of one tensor are saved many times)
                    key, size = local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
                except RuntimeError:  # a tensor without a plain storage (a wrapper subclass)
                    key, size = id(local), local.numel() * local.element_size()
                seen[key] = max(seen.get(key, 0), size)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = super().training_step(batch, batch_idx)
            saved.append(sum(seen.values()))
            return out

    cfg = GPTConfig(vocab=256, seq_len=seq_len, layers=4, hidden=HIDDEN, heads=4, ffn_hidden=4 * HIDDEN)
    return Module(cfg, optimizer="adamw", lr=1e-3)


def state_bytes(module: Any, optimizer: Any) -> int:
    """Parameters, gradients and optimizer states this rank holds (local shards of DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    total = sum(local(p) + local(p.grad) if p.grad is not None else local(p) for p in module.parameters())
    for state in optimizer.state.values():
        total += sum(local(v) for v in state.values() if isinstance(v, (torch.Tensor, DTensor)) and v.dim() > 0)
    return total


def run(name: str, fields: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as L

    from lightning_autopar import AutoParallelStrategy

    def attempt() -> dict[str, Any]:
        L.seed_everything(0, verbose=False)
        saved: list[int] = []
        module = lit_module(args.seq_len, saved)
        strategy = AutoParallelStrategy(fix=f"{fields},{BASE}", cluster="cpu", print_plan=False, profile=False)
        loader = token_loader(batch * (args.steps + args.warmup), args.seq_len, batch)
        times, trainer = timed_fit(module, strategy, loader, args.steps, args.warmup)
        states = state_bytes(module, trainer.optimizers[0])
        best = strategy.report.best
        return {"times": times, "memory_gib": (max(saved) + states) / 2**30, "activation_gib": max(saved) / 2**30,
                "states_gib": states / 2**30, "predicted_s": best.step_time_s,
                "predicted_gib": best.memory_gib_per_device - strategy.report.cluster.device.reserved_gib,
                "plan": best.plan.short()}

    return guarded_run(attempt, args)


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    rank, world = init_workers()
    started = time.perf_counter()
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {g: {n: [] for n in plans} for g, (_, plans) in GROUPS.items()}
    for r in range(args.repeats):
        for group, (batch, plans) in GROUPS.items():
            names = list(plans) if r % 2 == 0 else list(plans)[::-1]
            for name in names:
                samples[group][name].append(run(name, plans[name], batch, args))
                if rank == 0:
                    last = samples[group][name][-1]
                    print(f"round {r + 1}/{args.repeats} {group} {name}: {1e3 * median(last['times']):.0f} ms/step, "
                          f"{1024 * last['memory_gib']:.1f} MiB ({last['plan']})", flush=True)
    if rank != 0:
        return
    result: dict[str, Any] = {"world": world, "seq_len": args.seq_len, "repeats": args.repeats, "steps": args.steps,
                              "groups": {}, "seconds": time.perf_counter() - started, "load": load_summary()}
    for group, (batch, plans) in GROUPS.items():
        rows = {}
        for name in plans:
            runs = samples[group][name]
            step = median([t for run_ in runs for t in run_["times"]])
            last = runs[-1]
            rows[name] = {"plan": last["plan"], "global_batch": batch, "measured_s": step,
                          "predicted_s": last["predicted_s"], "memory_gib": median([x["memory_gib"] for x in runs]),
                          "activation_gib": median([x["activation_gib"] for x in runs]),
                          "predicted_gib": last["predicted_gib"]}
        base = rows[next(iter(plans))]
        for name, row in rows.items():
            row["time_ratio"] = row["measured_s"] / base["measured_s"]
            row["predicted_time_ratio"] = row["predicted_s"] / base["predicted_s"]
            row["memory_ratio"] = row["memory_gib"] / base["memory_gib"]
            row["predicted_memory_ratio"] = row["predicted_gib"] / base["predicted_gib"]
            print(f"{group} {name}: step {1e3 * row['measured_s']:.0f} ms (x{row['time_ratio']:.2f}; predicted "
                  f"{1e3 * row['predicted_s']:.0f} ms, x{row['predicted_time_ratio']:.2f}); memory "
                  f"{1024 * row['memory_gib']:.1f} MiB (x{row['memory_ratio']:.2f}; activations "
                  f"{1024 * row['activation_gib']:.1f} MiB; predicted {1024 * row['predicted_gib']:.1f} MiB, "
                  f"x{row['predicted_memory_ratio']:.2f})", flush=True)
        result["groups"][group] = rows
    write_result(args, "sequence_context.json", result, result["seconds"], "sequence_context")


def main() -> int:
    return bench_main(__file__, parse_args(), worker, "sequence_context.json")


if __name__ == "__main__":
    sys.exit(main())
