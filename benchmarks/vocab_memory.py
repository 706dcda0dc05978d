"""Vocabulary parallelism's memory per rank, tp=4 against tp=1 (issue 29, item 1).

    python benchmarks/vocab_memory.py [--nproc 4] [--seq-len 512] [--vocab 32000]

One launch of ``--nproc`` CPU processes (gloo), a Llama-style GPT (vocabulary 32000, hidden 256, 4 heads, SwiGLU ffn
688, 2 layers, untied embedding and head, fp32, SGD), two training steps per plan pinned with ``fix=`` on
``AutoParallelStrategy(cluster="cpu")``: tp=1 (dp fills the world, zero=0: every rank whole) and tp=4 (dp=1),
mbs=1. Measured on rank 0:

* embedding + head: the bytes of the token embedding's and LM head's weights the rank holds (their local shards);
* logits: the bytes of the LM head's output on the rank (its local vocabulary shard under vocab parallelism);
* peak: MemTracker's peak of the second step (``profile.memory.peak_memory_callback``), everything the step holds.

Against them the planner's figures for the same plan: ``terms.rank_param_counts(held=True)`` (embedding + head
parameters per rank, x4 bytes), ``cost_memory.logits_bytes`` (the logits, their fp32 copy and the loss gradient:
T*V/split*(e + 8)) and the priced plan's memory per device less the reserved memory. Writes
OUT/vocab_memory.json (default OUT: outputs/benchmarks) and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_main, common_args, init_workers, token_loader, write_result  # noqa: E402

HIDDEN, HEADS, LAYERS, FFN = 256, 4, 2, 688
PLANS = {"tp1": 1, "tp4": 4}
MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.set_defaults(nproc=4)
    return p.parse_args()


def lit_module(seq_len: int, vocab: int, logits: list[int]) -> Any:
    """The Llama-style GPT; ``logits`` gets the bytes of each LM-head output on this rank (the last: the measured
    step's; the set-up's meta trace of the whole model runs before the vocabulary split)."""
    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    cfg = GPTConfig(vocab=vocab, seq_len=seq_len, layers=LAYERS, hidden=HIDDEN, heads=HEADS, ffn_hidden=FFN,
                    ffn_kind="swiglu")
    module = LitGPT(cfg, lr=0.01)
    module.model.lm_head.register_forward_hook(lambda m, a, out: logits.append(local_bytes(out)))
    return module


def local_bytes(t: Any) -> int:
    """Bytes of ``t`` on this rank (a DTensor's local shard; read with ``VocabLogits``' torch function off, which
    would otherwise gather the logits for a use it does not see through)."""
    from lightning_autopar.parallel.dtensor_private import torch_function_disabled

    with torch_function_disabled():
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()


def held_bytes(module: Any) -> int:
    """Bytes of the token embedding's and LM head's weights this rank holds (a tie once)."""
    weights = {id(w): w for w in (module.model.tok_emb.weight, module.model.lm_head.weight)}
    return sum(local_bytes(w) for w in weights.values())


def predicted(spec: Any, plan: Any, seq_len: int, priced: Any) -> dict[str, float]:
    """The planner's embedding + head bytes, logits bytes and memory per device (less the reserved) for ``plan``."""
    from lightning_autopar.planner.cost_memory import logits_bytes, logits_split
    from lightning_autopar.planner.terms import rank_param_counts

    _, _, _, emb, head = rank_param_counts(spec, float(plan.tp), float(plan.ep), float(plan.pp), False, held=True)
    split = logits_split(spec, plan.tp, plan.pp, plan.cp)
    return {"emb_head_bytes": float(emb + head - 2 * spec.hidden) * 4.0,  # the head's count holds the final norm
            "logits_bytes": float(logits_bytes(spec, plan.mbs, seq_len, split, plan.cp, 4.0)),
            "peak_bytes": (priced.memory_gib_per_device - priced.memory_breakdown.get("reserved", 0.0)) * 2**30}


def run_plan(args: argparse.Namespace, tp: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as L

    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.profile.memory import peak_memory_callback

    logits: list[int] = []
    module = lit_module(args.seq_len, args.vocab, logits)
    dp = world // tp
    fix = (f"tp={tp},dp={dp},zero=0,pp=1,cp=1,ep=1,sp=false,mbs=1,grad_accum=1,recompute=none,precision=fp32,"
           "offload=none,compile=false")
    strategy = AutoParallelStrategy(fix=fix, cluster="cpu", print_plan=False, profile=False)
    peak = peak_memory_callback((1,))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[peak])
    trainer.fit(module, token_loader(2 * dp, args.seq_len, dp, vocab=args.vocab))
    report = strategy.report
    return {"emb_head_bytes": held_bytes(module), "logits_bytes": logits[-1], "peak_bytes": peak.peak.peak_gib * 2**30,
            "plan": report.best.plan.short(),
            "predicted": predicted(report.model, report.best.plan, args.seq_len, report.best)}


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    rank, world = init_workers()
    started = time.perf_counter()
    rows = {name: run_plan(args, tp, world) for name, tp in PLANS.items()}
    if rank != 0:
        return
    base = rows["tp1"]
    for name, row in rows.items():
        p = row["predicted"]
        print(f"{name}: embedding+head {row['emb_head_bytes'] / MIB:.1f} MiB (planner {p['emb_head_bytes'] / MIB:.1f}, "
              f"x{row['emb_head_bytes'] / base['emb_head_bytes']:.3f} of tp1), logits "
              f"{row['logits_bytes'] / MIB:.1f} MiB (x{row['logits_bytes'] / base['logits_bytes']:.3f}; planner's "
              f"logits term {p['logits_bytes'] / MIB:.1f}), MemTracker peak {row['peak_bytes'] / MIB:.1f} MiB "
              f"(planner {p['peak_bytes'] / MIB:.1f}, measured/planner {row['peak_bytes'] / p['peak_bytes']:.3f}) "
              f"({row['plan']})", flush=True)
    write_result(args, "vocab_memory.json", {"world": world, "seq_len": args.seq_len, "vocab": args.vocab,
                                             "hidden": HIDDEN, "rows": rows},
                 time.perf_counter() - started, "vocab_memory")


if __name__ == "__main__":
    a = parse_args()
    sys.exit(bench_main(__file__, a, worker, "vocab_memory.json"))
