"""A ~1B GPT under strategy="autopar" on the GPUs of one machine (written for one lent H200): analyse, plan,
train a few hundred bf16-mixed steps on synthetic data, then report measured MFU and predicted vs measured
step time and memory. Made to finish within 8 minutes including start-up (``--minutes`` caps training).

    python benchmarks/device/train_1b.py                  # every visible GPU, 300 steps (or --minutes)
    python benchmarks/device/train_1b.py --smoke          # CPU, tiny model, 2 processes: checks that it runs

The model (1.04 B parameters): 18 blocks, hidden 2048, 16 heads, GELU MLP 8192, vocab 32000, seq 2048, global
batch 8 sequences (16k tokens) per optimizer step. Data: random sequences repeating a 64-token motif, so the
loss falls once the model learns to copy. The model is built on the meta device (``trainer.init_module``) and
materialised by the strategy. Step time: median over the steps after ``--warmup``, each timed between a
device synchronise + barrier before and after. Memory: the allocator's peak (allocated and reserved) per
device against the planner's ``memory_gib_per_device``; on CPU the peak RSS. MFU: the planner's model FLOPs
per step (6N + attention, the prediction's own count) over measured time and the device's bf16 peak from the
cluster spec. Results: ``$OUT/train_1b.json`` (else ``--out``).

On the lent H200 image (python3 with torch, lightning, rich, matplotlib; no omegaconf) carry the wheels of
omegaconf and antlr4-python3-runtime 4.9.3 (see the device README) and run from the repository root:
``PYTHONUNBUFFERED=1 python3 benchmarks/device/train_1b.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

STARTED = time.time()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import ROOT, median, step_timer  # noqa: E402

sys.path.insert(1, str(ROOT))  # runs from a checkout without installing the package


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on 2 CPU processes: checks the script runs")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300; smoke 12)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 20; smoke 4)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default 8)")
    p.add_argument("--devices", type=int, default=None, help="default: every GPU (smoke: 2 CPU processes)")
    p.add_argument("--minutes", type=float, default=6.0, help="training time cap (Trainer max_time)")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--fix", default=None, help="pin plan fields, e.g. 'recompute=none,mbs=4'")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "outputs" / "benchmarks"))
    return p.parse_args()


def model_config(smoke: bool):
    from lightning_autopar.models import GPTConfig

    if smoke:
        return GPTConfig(vocab=256, seq_len=64, layers=2, hidden=64, heads=4, ffn_hidden=256)
    return GPTConfig(vocab=32000, seq_len=2048, layers=18, hidden=2048, heads=16, ffn_hidden=8192)


class MotifData:
    """Sequences of a random 64-token motif repeated: (inputs, targets); deterministic per index."""

    def __init__(self, rows: int, seq_len: int, vocab: int, period: int = 64) -> None:
        self.rows, self.seq_len, self.vocab, self.period = rows, seq_len, vocab, period

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int):
        import torch

        gen = torch.Generator().manual_seed(i)
        motif = torch.randint(0, self.vocab, (self.period,), generator=gen)
        tokens = motif.repeat(self.seq_len // self.period + 2)[: self.seq_len + 1]
        return tokens[:-1], tokens[1:]


def peak_memory_gib(device_type: str) -> tuple[float, float]:
    """(allocated, reserved) peak GiB on a GPU; on CPU the process's peak RSS twice."""
    import torch

    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return rss, rss


def analyse(cfg, global_batch: int) -> dict:
    """What the profiler sees before training: parameters, FLOPs per token, structure (model on meta)."""
    import torch

    from lightning_autopar.models import GPT
    from lightning_autopar.planner.cost import model_flops_per_token
    from lightning_autopar.profile.analyze import analyze

    with torch.device("meta"):
        model = GPT(cfg)
    analysis = analyze(model, seq_len=cfg.seq_len, trace=False)
    spec = analysis.spec
    return {"params": spec.total_params(), "layers": spec.layers, "hidden": spec.hidden, "heads": spec.heads,
            "vocab": spec.vocab, "seq_len": cfg.seq_len, "global_batch": global_batch,
            "model_flops_per_token": model_flops_per_token(spec, cfg.seq_len)}


def main() -> int:
    args = parse_args()
    import torch
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    import lightning_autopar  # noqa: F401  (registers strategy="autopar")
    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.models.lit import LitGPT

    cuda = torch.cuda.is_available() and not args.smoke
    steps = args.steps or (12 if args.smoke else 300)
    warmup = args.warmup if args.warmup is not None else (4 if args.smoke else 20)
    gb = args.global_batch or 8
    devices = args.devices or (torch.cuda.device_count() if cuda else 2)
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke on CPU")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    else:
        torch.set_num_threads(1)
    cfg = model_config(args.smoke)
    rank0 = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0
    info = analyse(cfg, gb)
    if rank0:
        print(f"analysis: {info['params'] / 1e6:,.1f} M parameters, {info['layers']} layers x hidden {info['hidden']}, "
              f"{info['heads']} heads, vocab {info['vocab']}, seq {info['seq_len']}, global batch {gb}; "
              f"{info['model_flops_per_token'] / 1e9:.2f} GFLOP per token (fwd+bwd)", flush=True)

    L.seed_everything(0, verbose=False)
    strategy = AutoParallelStrategy(fix=args.fix, cluster=None if cuda else "cpu", print_plan=True)
    timer = step_timer(warmup)
    trainer = L.Trainer(strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=devices,
                        precision=args.precision, max_steps=steps, max_time={"minutes": args.minutes},
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])
    with trainer.init_module(empty_init=True):
        module = LitGPT(cfg, optimizer="adamw", lr=3e-4)
    loader = DataLoader(MotifData(gb * steps, cfg.seq_len, cfg.vocab), batch_size=gb, drop_last=True,
                        num_workers=2 if cuda else 0, persistent_workers=cuda)
    fit_start = time.time()
    trainer.fit(module, loader)
    fit_s = time.time() - fit_start
    alloc, reserved = peak_memory_gib("cuda" if cuda else "cpu")
    if not trainer.is_global_zero:
        return 0

    best = strategy.report.best
    measured = median(timer.times)
    pred = best.step_time_s
    tokens = gb * cfg.seq_len
    peak_flops = best.model_tflops_per_device * 1e12 / best.mfu if best.mfu else float("nan")
    mfu = info["model_flops_per_token"] * tokens / trainer.world_size / measured / peak_flops
    losses = timer.losses
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "world": trainer.world_size,
        "precision": args.precision, "plan": best.plan.short(), "analysis": info,
        "steps_run": len(timer.all), "timed_steps": len(timer.times),
        "step_time_s": {"predicted": pred, "measured_median": measured, "measured/predicted": measured / pred},
        "tokens_per_s": {"predicted": tokens / pred, "measured": tokens / measured},
        "mfu": {"predicted": best.mfu, "measured": mfu, "peak_tflops_per_device": peak_flops / 1e12},
        "memory_gib_per_device": {"predicted": best.memory_gib_per_device, "peak_allocated": alloc,
                                  "peak_reserved": reserved},
        "breakdown_predicted_s": vars(best.breakdown),
        "loss": {"first": losses[0] if losses else None, "last": losses[-1] if losses else None},
        "fit_s": fit_s, "total_s": time.time() - STARTED,
    }
    print(f"plan {best.plan.short()} on {trainer.world_size} x {result['device']}: {len(timer.all)} steps in "
          f"{fit_s:.0f} s (script {result['total_s']:.0f} s)")
    print(f"step time: predicted {1e3 * pred:.1f} ms, measured {1e3 * measured:.1f} ms (median of "
          f"{len(timer.times)}; measured/predicted {measured / pred:.2f})")
    print(f"throughput: {tokens / measured:,.0f} tokens/s; MFU measured {100 * mfu:.1f}% vs predicted "
          f"{100 * best.mfu:.1f}% (peak {peak_flops / 1e12:g} TFLOP/s per device)")
    print(f"memory per device: predicted {best.memory_gib_per_device:.2f} GiB, peak allocated {alloc:.2f} GiB, "
          f"reserved {reserved:.2f} GiB" + ("" if cuda else " (CPU: peak RSS)"))
    if losses:
        print(f"loss: {losses[0]:.3f} -> {losses[-1]:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "train_1b_smoke.json" if args.smoke else "train_1b.json"
    (out / name).write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
