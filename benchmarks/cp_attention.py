"""Context-parallel attention, one rank's work: the mask-free chunked attention (``parallel/context.py``,
``chunked_causal_attention``) against the explicit-mask attention it replaced, at a long sequence.

    python benchmarks/cp_attention.py [--seq-len 16384] [--cp 4] [--heads 4] [--head-dim 64] [--repeats 3]

Per cp rank (its two load-balanced query chunks over the whole gathered K/V, exactly the tensors a rank's
attention gets after the all-gather; the collectives are not part of it), one process, fp32, batch 1: forward +
backward time (median of ``--repeats``, the two versions alternating, every other round in reverse order),
the bytes autograd saves for backward (distinct storages, ``saved_tensors_hooks``; the masked version's cached
(S/cp) x S mask is among them), the largest single tensor the attention creates, and the largest output and
gradient difference to one device's causal attention at the same positions. Ratios are within one run. Writes
OUT/cp_attention.json (default OUT: outputs/benchmarks).
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
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", default="0,-1", help="cp ranks to measure (comma list; -1: the last)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "benchmarks"))
    return p.parse_args()


def masked_attention(q, keys, values, seq, cp, rank):
    """The replaced path: the additive (S/cp) x S position mask, SDPA keeping it for backward."""
    import torch
    import torch.nn.functional as F

    from lightning_autopar.parallel.context import gathered_positions, local_positions

    allowed = local_positions(seq, cp, rank)[:, None] >= gathered_positions(seq, cp)[None, :]
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def measure(fn, inputs, grad_out):
    """(seconds, saved bytes, largest saved tensor bytes, output, grads) of one forward + backward."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaves = [t.detach().requires_grad_() for t in inputs]
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return time.perf_counter() - start, sum(seen.values()), max(seen.values(), default=0), out.detach(), grads


def main() -> int:
    args = parse_args()
    import torch
    import torch.nn.functional as F

    from lightning_autopar.parallel.context import (CPGroup, chunked_causal_attention, gathered_positions,
                                                    local_positions)

    seq, cp = args.seq_len, args.cp
    torch.manual_seed(0)
    shape = (1, args.heads, seq, args.head_dim)
    q, k, v = (torch.randn(shape) for _ in range(3))
    order = gathered_positions(seq, cp)
    rows, load = [], {"load_at_start": load_average()}
    for rank in [int(r) % cp for r in args.ranks.split(",")]:
        mine = local_positions(seq, cp, rank)
        inputs = (q[:, :, mine].contiguous(), k[:, :, order].contiguous(), v[:, :, order].contiguous())
        grad_out = torch.randn(inputs[0].shape)
        versions = {
            "masked": lambda a, b, c, r=rank: masked_attention(a, b, c, seq, cp, r),
            "mask-free": lambda a, b, c, r=rank: chunked_causal_attention(a, b, c, CPGroup(None, cp, r), None),
        }
        times: dict[str, list[float]] = {name: [] for name in versions}
        facts: dict[str, tuple] = {}
        for round_ in range(args.repeats):
            for name in (list(versions) if round_ % 2 == 0 else list(versions)[::-1]):
                seconds, saved, largest, out, grads = measure(versions[name], inputs, grad_out)
                times[name].append(seconds)
                facts[name] = (saved, largest, out, grads)
        # one device's causal attention at this rank's positions: output rows and the gradient of this rank's
        # loss share (q, k, v restricted to the same rows / gathered order)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, is_causal=True)[:, :, mine]
        ref_grads = torch.autograd.grad(ref, leaves, grad_out)
        ref_grads = (ref_grads[0][:, :, mine], ref_grads[1][:, :, order], ref_grads[2][:, :, order])
        for name in versions:
            saved, largest, out, grads = facts[name]
            rows.append({"rank": rank, "version": name, "seconds": median(times[name]),
                         "saved_mib": saved / 2**20, "largest_saved_mib": largest / 2**20,
                         "max_abs_diff": max([(out - ref.detach()).abs().max().item()]
                                             + [(g - r).abs().max().item() for g, r in zip(grads, ref_grads)])})
            print(f"rank {rank} {name:9s}: {rows[-1]['seconds'] * 1e3:8.1f} ms  saved {rows[-1]['saved_mib']:7.1f} MiB"
                  f"  largest {rows[-1]['largest_saved_mib']:7.1f} MiB  max |diff| {rows[-1]['max_abs_diff']:.1e}")
        base, new = rows[-2], rows[-1]
        print(f"rank {rank}: mask-free / masked time {new['seconds'] / base['seconds']:.2f}x, "
              f"saved {new['saved_mib'] / base['saved_mib']:.3f}x")
    load["load_at_end"] = load_average()
    print(f"load average (1, 5, 15 min) at start {load['load_at_start']}, at end {load['load_at_end']}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cp_attention.json").write_text(json.dumps({"args": vars(args), "load": load, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
