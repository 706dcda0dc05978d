"""Sequence parallelism's saved activations per block against Korthikanti et al. 2022 (issue 29, item 2).

    python benchmarks/sp_memory.py [--nproc 2] [--seq-len 512] [--batch 2] [--recompute none,selective]

One launch of ``--nproc`` CPU processes (gloo), our GPT (hidden 256, 4 heads, ffn 1024 GELU, 2 layers, vocab 256,
fp32, no dropout), one training step per plan, each pinned with ``fix=`` on ``AutoParallelStrategy(cluster="cpu")``:
tp=1, tp=2, tp=2+sp (dp fills the rest), per recompute mode. Measured per block, the mean over the rank's blocks:

* saved: the bytes of the distinct non-parameter storages autograd saves for backward while the block's forward
  runs (``torch.autograd.graph.saved_tensors_hooks``; the block's parameters, as FSDP2 has gathered them, left
  out); recompute none only (a checkpointed block's saves go to the checkpoint's own hooks; and an outer
  saved-tensor hook makes the checkpoint hand a recomputed block an untagged copy of its input, which SP's
  scatter hook then splits again);
* kept: the bytes of the storages the block's forward created that are still alive when the training step's
  forward ends (a dispatch mode notes them: what autograd or a selective-checkpoint cache keeps for backward).

Against it: the planner's ``activation_bytes_per_block`` for the same plan, and Korthikanti's per-layer formula,
sbh(10 + 24/t) without SP and 34sbh/t with SP (2-byte units, so x2 in fp32), less the two dropout masks (2sbh, or
2sbh/t with SP: the model has no dropout) -- the s^2 term does not apply: SDPA is fused. Writes
OUT/sp_memory.json (default OUT: outputs/benchmarks) and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_main, common_args, init_workers, timed_fit, token_loader, write_result  # noqa: E402

HIDDEN, HEADS, LAYERS = 256, 4, 2
PLANS = {"tp1": "tp=1,sp=false", "tp2": "tp=2,sp=false", "tp2+sp": "tp=2,sp=true"}


def parse_args() -> argparse.Namespace:
    p = common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=2, help="micro-batch per data-parallel rank")
    p.add_argument("--recompute", default="none,selective", help="recompute modes, a comma list")
    p.set_defaults(nproc=2)
    return p.parse_args()


def kept_tracker(inside: list[int], params: set[int]) -> Any:
    """A dispatch mode noting every storage an op creates while a block's forward runs, and ``kept()``: the bytes
    per block of those still alive (what the forward leaves for backward whatever keeps it: autograd, a
    selective-checkpoint cache), parameters left out."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Kept(TorchDispatchMode):
        created: list[tuple[Any, int]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if inside:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        t = getattr(t, "_local_tensor", t)
                        self.created.append((weakref.ref(t.untyped_storage()), inside[-1]))
            return out

        def kept(self, blocks: int) -> list[int]:
            per, seen = [0] * blocks, set()
            for ref, i in self.created:
                st = ref()
                if st is not None and st.data_ptr() not in seen and st.data_ptr() not in params:
                    seen.add(st.data_ptr())
                    per[i] += st.nbytes()
            return per

    return Kept()


def lit_module(seq_len: int, per_block: list[int], kept: list[int], count_saved: bool) -> Any:
    """Our GPT; ``per_block`` gets the bytes each block's forward saved for backward in the training step through
    autograd's saved-tensor hooks (``count_saved``), ``kept`` the bytes its forward left alive (``kept_tracker``)."""
    import contextlib

    import torch

    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    class Module(LitGPT):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen: dict[int, int] = {}
            inside: list[int] = []
            params: set[int] = set()

            def enter(block: torch.nn.Module, i: int) -> None:
                # the block's parameters as its forward sees them (FSDP2's unsharded ones, in place after its hook)
                params.update((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
                              for p in block.parameters())
                inside.append(i)

            def pack(t: torch.Tensor) -> torch.Tensor:
                local = t.to_local() if hasattr(t, "to_local") else t
                key = local.untyped_storage().data_ptr()
                if inside and key not in params and key not in seen:
                    seen[key] = inside[-1]
                    per_block_bytes[inside[-1]] += local.untyped_storage().nbytes()
                return t

            blocks = list(self.model.blocks)
            per_block_bytes = [0] * len(blocks)
            handles = [b.register_forward_pre_hook(lambda m, a, i=i: enter(m, i)) for i, b in enumerate(blocks)]
            handles += [b.register_forward_hook(lambda m, a, o: (inside.pop(), None)[1]) for b in blocks]
            tracker = kept_tracker(inside, params)
            try:
                hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved
                         else contextlib.nullcontext())
                with hooks, tracker:
                    out = super().training_step(batch, batch_idx)
            finally:
                for h in handles:
                    h.remove()
            per_block.extend(per_block_bytes)
            kept.extend(tracker.kept(len(blocks)))
            return out

    cfg = GPTConfig(vocab=256, seq_len=seq_len, layers=LAYERS, hidden=HIDDEN, heads=HEADS, ffn_hidden=4 * HIDDEN)
    return Module(cfg, optimizer="adamw", lr=1e-3)


def korthikanti(s: int, b: int, h: int, t: int, sp: bool) -> float:
    """Korthikanti et al. 2022 Table 2 per layer, fused attention (no s^2 term), in fp32 bytes, less the two
    dropout masks (the model has none)."""
    units = 34.0 * s * b * h / t if sp else s * b * h * (10.0 + 24.0 / t)
    masks = 2.0 * s * b * h / (t if sp else 1)
    return 2.0 * (units - masks)


def worker(args: argparse.Namespace) -> None:
    import warnings

    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.planner.cost import activation_bytes_per_block
    from lightning_autopar.specs import RECOMPUTE_MODES, ModelSpec

    warnings.filterwarnings("ignore")
    rank, world = init_workers()
    started = time.perf_counter()
    rows = {}
    for name, fields in PLANS.items():
        for mode in args.recompute.split(","):
            tp, sp = int(fields.split(",")[0].split("=")[1]), fields.endswith("true")
            per_block: list[int] = []
            kept: list[int] = []
            module = lit_module(args.seq_len, per_block, kept, mode == "none")
            dp = world // tp
            fix = (f"{fields},dp={dp},zero=0,pp=1,cp=1,ep=1,mbs={args.batch},grad_accum=1,recompute={mode},"
                   "precision=fp32")
            strategy = AutoParallelStrategy(fix=fix, cluster="cpu", print_plan=False, profile=False)
            loader = token_loader(args.batch * dp, args.seq_len, args.batch * dp)
            timed_fit(module, strategy, loader, 1, 0)
            spec: ModelSpec = strategy.report.model
            saved, left = sum(per_block) / len(per_block), sum(kept) / len(kept)
            code = RECOMPUTE_MODES.index(mode)
            planner = float(activation_bytes_per_block(spec, args.batch, args.seq_len, tp, sp, 1, code, 4.0, True))
            formula = korthikanti(args.seq_len, args.batch, HIDDEN, tp, sp)
            row = f"{name} rc={mode}"
            rows[row] = {"saved_bytes": saved, "kept_bytes": left, "planner_bytes": planner,
                         "korthikanti_bytes": formula, "plan": strategy.report.best.plan.short()}
            if rank == 0:
                print(f"{row}: per block saved {saved / 2**20:.2f} MiB, kept {left / 2**20:.2f} MiB, planner "
                      f"{planner / 2**20:.2f} MiB, Korthikanti {formula / 2**20:.2f} MiB (kept/formula "
                      f"{left / formula:.3f}) ({rows[row]['plan']})", flush=True)
    if rank == 0:
        write_result(args, "sp_memory.json", {"world": world, "seq_len": args.seq_len, "batch": args.batch,
                                              "hidden": HIDDEN, "heads": HEADS, "rows": rows},
                     time.perf_counter() - started, "sp_memory")


if __name__ == "__main__":
    a = parse_args()
    sys.exit(bench_main(__file__, a, worker, "sp_memory.json"))
