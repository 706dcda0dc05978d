"""Context parallelism's two flavours, one attention layer over the live cp group: K/V all-gathered
(``parallel/context.py``, ``cp_kind=gather``) against the all-to-all over heads (``parallel/context_heads.py``,
``cp_kind=heads``, DeepSpeed-Ulysses), collectives included.

    torchrun --nproc-per-node 4 benchmarks/cp_flavours.py [--seq-len 4096] [--heads 8] [--kv-heads 8]
        [--head-dim 64] [--repeats 3]

Each rank holds its load-balanced part of q, k, v ([1, heads, S/cp, d], fp32) and runs the flavour's attention
(the function ``F.scaled_dot_product_attention`` is replaced by under cp, causal) forward + backward: the median
of ``--repeats`` (flavours alternating, every other round in reverse order; a barrier before each), the bytes
autograd saves for backward (distinct storages, ``saved_tensors_hooks``), max over ranks. Rank 0 prints and
writes OUT/cp_flavours.json (default OUT: outputs/benchmarks).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, load_average, median  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "outputs" / "benchmarks"))
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_autopar.parallel.context import CPGroup, MaskAgreement, cp_attention, local_positions
    from lightning_autopar.parallel.context_heads import heads_attention

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = CPGroup(dist.group.WORLD, cp, rank)
    torch.manual_seed(0)
    seq, d = args.seq_len, args.head_dim
    mine = local_positions(seq, cp, rank)
    q = torch.randn(1, args.heads, seq, d)[:, :, mine].contiguous()
    k, v = (torch.randn(1, args.kv_heads, seq, d)[:, :, mine].contiguous() for _ in range(2))
    grad_out = torch.randn(q.shape)
    gqa = args.heads != args.kv_heads
    flavours = {}
    for name, make in (("gather", cp_attention), ("heads", heads_attention)):
        masks = MaskAgreement(group, causal=True)
        flavours[name] = (make(F.scaled_dot_product_attention, group, "bench", masks), masks)
    times: dict[str, list[float]] = {n: [] for n in flavours}
    saved: dict[str, int] = {}
    for round_ in range(args.repeats):
        for name in (list(flavours) if round_ % 2 == 0 else list(flavours)[::-1]):
            fn, masks = flavours[name]
            masks.start(None)
            seen: dict[int, int] = {}

            def pack(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn(*leaves, is_causal=True, enable_gqa=gqa)
            torch.autograd.grad(out, leaves, grad_out)
            times[name].append(time.perf_counter() - start)
            saved[name] = sum(seen.values())
    rows = {}
    for name in flavours:
        stats = torch.tensor([median(times[name]), float(saved[name])], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        rows[name] = {"seconds": stats[0].item(), "saved_mib": stats[1].item() / 2**20}
    if rank == 0:
        for name, row in rows.items():
            print(f"{name:6s}: {row['seconds'] * 1e3:8.1f} ms fwd+bwd  saved {row['saved_mib']:7.1f} MiB per rank")
        g, h = rows["gather"], rows["heads"]
        print(f"heads / gather: time {h['seconds'] / g['seconds']:.2f}x, saved {h['saved_mib'] / g['saved_mib']:.2f}x;"
              f" load average {load_average()}")
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "cp_flavours.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
