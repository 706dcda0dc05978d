"""Pipeline cost terms: schedule codes, the bubble fraction of each schedule, the micro-batches in flight per
stage (activation memory), and the layer partition that balances the stages. Pure numpy; each docstring gives the
formula and its source."""

from __future__ import annotations

from typing import Any

import numpy as np


# Schedule codes (specs.SCHEDULES.index): gpipe, 1f1b, interleaved, interleaved-zb, zbv, dualpipev.
SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED, SCHED_IZB, SCHED_ZBV, SCHED_DUALPIPEV = range(6)
# Split backward: B (input gradients) and W (weight gradients) as shares of a micro-batch's F+B+W. The weight
# gradients are the forward's GEMMs again (dW = x^T dy), the input gradients the others: F = B = W = 1/3, the
# split Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", ICLR 2024, §2) assume; the FLOPs are unchanged.
WGRAD_SHARE = 1.0 / 3.0
FWD_SHARE = 1.0 / 3.0


def bubble_fraction(pp: Any, microbatches: Any, vpp: Any, schedule: Any = SCHED_1F1B) -> Any:
    """Idle share of the step, in micro-batch slots per micro-batch, by schedule code: GPipe/1F1B (pp-1)/m,
    interleaved 1F1B (pp-1)/(m*vpp) (Narayanan et al. 2021), interleaved zero bubble ``zero_bubble_fraction``,
    ZBV ``zbv_bubble_fraction``, DualPipeV ``dualpipev_bubble_fraction``."""
    pp, m, vpp, schedule = np.asarray(pp, dtype=float), np.asarray(microbatches, dtype=float), np.asarray(vpp), \
        np.asarray(schedule)
    plain = (pp - 1) / (m * vpp)  # vpp = 1 for GPipe and 1F1B
    out = np.select([schedule == SCHED_IZB, schedule == SCHED_ZBV, schedule == SCHED_DUALPIPEV],
                    [zero_bubble_fraction(pp, m, vpp), zbv_bubble_fraction(pp, m), dualpipev_bubble_fraction(pp, m)],
                    plain)
    return out if out.ndim else float(out)


def zero_bubble_fraction(pp: Any, microbatches: Any, vpp: Any) -> Any:
    """(p-1)(F+B-2W) / (m*v*(F+B)) with B the full backward: ZB-H1 / ZB1P, 1F1B's memory with the weight
    gradients filling the drain (Qi et al. 2023, §3.1; the DualPipe README's ZB1P row); over v round-robin chunks
    per rank the fill shrinks by v as for interleaved 1F1B (torch's ScheduleInterleavedZeroBubble runs ZB1P per
    chunk). F = B_input = W: (p-1)/(3*m*v)."""
    full = 1.0 - FWD_SHARE  # B + W
    return (pp - 1) * (FWD_SHARE + full - 2 * WGRAD_SHARE) / (microbatches * vpp)


def zbv_bubble_fraction(pp: Any, microbatches: Any) -> Any:
    """max(0, 2p-1-m)/m: ZB-V (Qi et al. 2023 §6; Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
    V-ZB) is bubble-free for F = B = W once the V is full; torch's ScheduleZBVZeroBubble fills it with 2p-1
    micro-batch slots, idle where m < 2p-1."""
    return np.maximum(0.0, 2 * pp - 1 - microbatches) / microbatches


def dualpipev_bubble_fraction(pp: Any, microbatches: Any) -> Any:
    """(PP/2-1)(F&B+B-3W) over a rank's m(F+B): DualPipe (DeepSeek-V3 technical report 2024, Table 2; README
    table), PP its stage count, F, B, W per chunk; DualPipeV (Sea AI Lab 2025, DualPipe cut in half: PP = 2p
    stages on p ranks, two chunks each) keeps the formula. F&B = F+B: our stages run the overlapped pair one
    after the other (torch without an overlap callback). Per rank (2 chunks): (p-1)(F+2B-3W)/(2m) with B the full
    backward; F = B_input = W: (p-1)/(3m)."""
    full = 1.0 - FWD_SHARE
    return (pp - 1) * (FWD_SHARE + 2 * full - 3 * WGRAD_SHARE) / (2 * microbatches)


def inflight_microbatches(schedule: Any, pp: Any, vpp: Any, microbatches: Any, stage: Any) -> Any:
    """Stage-sized activation sets held (a rank's whole stage per micro-batch): GPipe m; 1F1B min(pp-i, m);
    interleaved 1F1B and interleaved zero bubble (ZB1P keeps 1F1B's memory, Qi et al. 2023 §3.2)
    min(2(pp-i-1)+(v-1)pp+1, mv)/v (Megatron's warm-up + 1, capped by the mv chunk passes: measured,
    benchmarks/memory.py); ZBV min(pp, m) on every rank (V-ZB: 1F1B's peak, balanced over
    the V; Qi et al. 2024); DualPipeV min(pp + 1/2, m): PP+1 chunk sets with PP = 2p stages (DualPipe README)."""
    gpipe = microbatches
    one_f = np.minimum(pp - stage, microbatches)
    # the warm-up forwards plus the one in flight, never more than the rank's m*v chunk passes (m = pp: all of them)
    inter = np.minimum(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, microbatches * vpp) / vpp
    zbv = np.minimum(pp + 0.0 * stage, microbatches)
    dualv = np.minimum(pp + 0.5 + 0.0 * stage, microbatches)
    return np.select([schedule == SCHED_GPIPE, schedule == SCHED_1F1B, schedule == SCHED_ZBV,
                      schedule == SCHED_DUALPIPEV], [gpipe, one_f, zbv, dualv], inter)


def partition_layers(weights: np.ndarray, parts: int) -> list[int]:
    """Contiguous split of per-layer costs into `parts` stages minimising the slowest stage (linear-partition DP, O(parts*L^2))."""
    n = len(weights)
    if parts >= n:
        return [1] * n + [0] * (parts - n)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    span = prefix[None, :] - prefix[:, None]  # span[i, j] = sum of layers i..j-1
    idx = np.arange(n + 1)
    valid = idx[:, None] < idx[None, :]
    best = np.where(idx >= 1, prefix, np.inf)  # one part covering layers 0..j-1
    choice = []
    for _ in range(1, parts):
        cand = np.where(valid, np.maximum(best[:, None], span), np.inf)
        arg = np.argmin(cand, axis=0)
        best = cand[arg, idx]
        choice.append(arg)
    sizes, end = [], n
    for arg in reversed(choice):
        start = int(arg[end])
        sizes.append(end - start)
        end = start
    sizes.append(end)
    return sizes[::-1]
