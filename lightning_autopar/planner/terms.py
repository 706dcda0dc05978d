"""The per-rank factor tables the search assembles: for each representative pipeline rank (first, last, heaviest
middle), the mid-level terms (forward/backward time, the slot with recompute and TP/CP/EP/PP traffic, memory per
recompute option) and the dpc-level terms (data-parallel traffic, parameter work, model states), for a
transformer (``transformer_terms``) or a unit-form model (``unit_terms``), and the runtime's fixed costs
(``runtime_terms``). Measured block times replace the analytic ones here, scaled by the analytic ratio.

Pure numpy, vectorised over the smallest factor table each term depends on (space.Space); every term is a
cost-module function named there with its formula and source. search.Tables combines them per candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable

import numpy as np

from lightning_autopar.dims import dim_strides, runs_fsdp, runs_plain_ddp
from lightning_autopar.planner.cost import (
    BlockTimes, async_tp_exposed, compile_hardware, compiled_block_time, dense_block_time, embedding_time,
    grad_accumulate_time, head_time, host_optimizer_step_time, moe_block_time, offload_copy_time,
    ops_recompute_time, optimizer_time, scaled_measure, shard_copy_time)
from lightning_autopar.planner.cost_comm import (
    allgather_time, allreduce_time, cp_comm_by_kind, cp_logits_gather_time, ep_comm_per_block, p2p_time,
    reduce_scatter_time, tp_comm_per_block, vocab_loss_comm_time)
from lightning_autopar.planner.cost_memory import (
    activation_bytes_per_block, ddp_bucket_bytes, fsdp_buffer_bytes, fsdp_shard_copy_bytes, host_step_copy_bytes,
    logits_bytes, logits_split, model_state_parts, offloaded_state_bytes, vocab_split)
from lightning_autopar.planner.cost_pipeline import bubble_fraction, inflight_microbatches
from lightning_autopar.planner.cost_runtime import fsdp_unit_seconds, runtime_fixed_time
from lightning_autopar.planner.cost_units import (
    UnitArrays, sync_batchnorm_time, unit_activation_bytes, unit_selective_time, unit_time)
from lightning_autopar.planner.hardware import (
    ACT_BYTES, BASE_PREC, FP8, FRAGMENTATION, GRAD_REDUCE_BYTES, WEIGHT_BYTES, Hardware)
from lightning_autopar.planner.partition import (
    Stage, UnitStage, block_weights, stage_table, unit_stage_table, unit_weights)
from lightning_autopar.planner.space_table import THINNED_MODES, Space, distinct
from lightning_autopar.specs import (
    PRECISIONS, RECOMPUTE_MODES, SCHEDULES, V_SCHEDULES, BlockMeasure, Measured, ModelSpec)


N_REP = 3  # representative pipeline ranks priced per candidate: first, last, heaviest middle
V_CODES = [SCHEDULES.index(s) for s in V_SCHEDULES]  # two chunks per rank in a V


def _unit_reps(model: ModelSpec, units: UnitArrays, hw: Hardware, space: Space, pp: np.ndarray,
               vpp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit-form representative ranks for each row's (pp, vpp): masks (rows, N_REP, units), rows (rows, N_REP,
    UnitStage)."""
    weights = unit_weights(model, hw, space.weights_precision())[0]
    shape = (int(pp.max(initial=1)) + 1, int(vpp.max(initial=1)) + 1, N_REP)
    masks, rows = np.zeros(shape + (len(weights),)), np.zeros(shape + (len(UnitStage),))
    for code in distinct(pp * 4096 + vpp):
        p_, v_ = divmod(int(code), 4096)
        masks[p_, v_], rows[p_, v_] = unit_stage_table(units, weights, p_, v_, space.uneven)
    return masks[pp, vpp], rows[pp, vpp]


def _stage_reps(model: ModelSpec, hw: Hardware, space: Space, seq: int, fused: bool, pp: np.ndarray,
                vpp: np.ndarray, schedule: np.ndarray) -> np.ndarray:
    """Representative ranks for each row's (pp, vpp, V placement or not): array (rows, N_REP, Stage) from one
    partition per distinct triple."""
    weights, emb_w, head_w = block_weights(model, hw, seq, space.weights_precision(), fused)
    v = np.isin(schedule, V_CODES).astype(np.int64)
    table = np.zeros((int(pp.max(initial=1)) + 1, int(vpp.max(initial=1)) + 1, 2, N_REP, len(Stage)))
    for code in distinct((pp * 4096 + vpp) * 2 + v):
        (p_, v_), shape = divmod(int(code) // 2, 4096), int(code) % 2
        table[p_, v_, shape] = stage_table(model, weights, emb_w, head_w, p_, v_, space.uneven, bool(shape))[0]
    return table[pp, vpp, v]


def recompute_table(space: Space) -> tuple[np.ndarray, np.ndarray]:
    """The (recompute code, recompute_every) pairs in ``space`` as rows, (none, 1) first (the no-recompute base of
    the breakdown), and each candidate's row: the mid-level terms are priced once per pair (O(n), no sort)."""
    opts, lut, width = recompute_rows(space)
    return opts, lut[space.cands["recompute"] * width + space.cands["recompute_every"]]


def recompute_rows(space: Space) -> tuple[np.ndarray, np.ndarray, int]:
    """``recompute_table``'s rows, with the lookup from a code (recompute * width + recompute_every) to its row
    and the width; on a grid from its options alone (no candidate column read)."""
    grid = space.grid
    r, k = (grid.opts[:, 0], grid.opts[:, 1]) if grid is not None else (space.cands["recompute"],
                                                                         space.cands["recompute_every"])
    width = int(k.max()) + 1 if len(k) else 2
    present = distinct(np.concatenate([[1], np.flatnonzero(np.bincount(r * width + k, minlength=2))]))  # 1: (none, 1)
    lut = np.zeros(int(present[-1]) + 1, dtype=np.int64)
    lut[present] = np.arange(len(present))
    return np.stack([present // width, present % width], axis=1), lut, width


def dp_rows(space: Space) -> tuple[np.ndarray, np.ndarray]:
    """The dpc rows the data-parallel terms price alike, once: (one row of each class, each row's class). A row's
    terms read its layout, precision, zero, dp_shard, offload and its stage's contents, which the schedule sets
    only through (vpp, V placement or not): 1f1b and gpipe, or interleaved and interleaved-zb at one vpp, or zbv
    and dualpipev, hold the same blocks per rank (partition.stage_table), so their rows are one class."""
    D = space.dpcs
    return row_classes([D["layout"], D["precision"], D["zero"], D["dp_shard"], D["offload"], D["vpp"],
                        np.isin(D["schedule"], V_CODES).astype(np.int64)])


def row_classes(cols: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows alike in every non-negative int column of ``cols``: (the first row of each class, each row's class)."""
    radix = [int(col.max(initial=0)) + 1 for col in cols]
    if math.prod(radix) >= 2**62:  # too wide for one int64 key: rows compared whole
        _, first, inverse = np.unique(np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    key = np.zeros(len(cols[0]), dtype=np.int64)
    for col, base in zip(cols, radix):  # mixed radix: one int64 per row, sorted once
        key = key * base + col
    _, inverse = np.unique(key, return_inverse=True)  # return_index would sort stably: several times slower
    inverse = inverse.reshape(-1)
    first = np.full(int(inverse.max(initial=-1)) + 1, len(inverse))
    np.minimum.at(first, inverse, np.arange(len(inverse)))
    return first, inverse


@dataclass
class ClassTerms:
    """Terms priced once per class of (row, representative rank) pairs (``rank_classes``): ``values[name]`` per
    class, ``pair`` (rows, N_REP) each pair's class. ``terms[name]`` is the per-rank list the other forms return;
    search.Tables packs the classes first, then gathers rows (cheaper than packing every pair)."""

    values: dict[str, np.ndarray]
    pair: np.ndarray

    def __getitem__(self, name: str) -> list[np.ndarray]:
        return [self.values[name][self.pair[:, r]] for r in range(N_REP)]


def rank_classes(row_cols: list[np.ndarray], contents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (row, representative rank) pairs whose terms read the same values, priced once: the row's fields
    ``row_cols`` and the rank's stage ``contents`` (rows, N_REP, columns; whole numbers >= 0) alike. Ranks share
    a stage where pp = 1 (one stage) or the middle rank is the first's, and rows differing only in vpp or the
    schedule often hold the same blocks per rank. Returns (row, rank) of one pair per class and each pair's
    class, (rows, N_REP)."""
    n = len(contents)
    flat = contents.transpose(1, 0, 2).reshape(n * N_REP, -1).astype(np.int64)  # rank-major: pair r * n + row
    first, inverse = row_classes([np.tile(col, N_REP) for col in row_cols] + list(flat.T))
    return first % n, first // n, inverse.reshape(N_REP, n).T


def thinned_share(blocks: np.ndarray, every: int) -> np.ndarray:
    """Share of a rank's blocks that recompute with recompute_every=k: ceil(n/k)/n (blocks i % k == 0 of the rank's
    local blocks, parallel.recompute); the others keep their activations as with none (torchtitan's per-layer AC)."""
    return np.ceil(blocks / every) / np.maximum(blocks, 1)


def _mix_options(opts: np.ndarray, blocks: np.ndarray, base: np.ndarray, trc: list, inflight: np.ndarray,
                 act: list, fixed_mem: np.ndarray, rebuild: np.ndarray, frag: float) -> tuple[np.ndarray, np.ndarray]:
    """(time, memory) per (mid, recompute option): option (mode i, k) runs ``trc[i]`` (extra forward work of all
    the rank's blocks) and saves ``act[i]`` (all blocks) on the thinned share of blocks, none's on the rest; full
    and ops rebuild one block's activations at a time in backward (``rebuild``)."""
    times, mems = [], []
    for mode, every in opts:
        share = thinned_share(blocks, int(every))
        times.append(base + share * trc[mode])
        kept = share * act[mode] + (1 - share) * act[0]
        mems.append((inflight * kept + fixed_mem + (rebuild if mode in THINNED_MODES else 0.0)) * frag)
    return np.stack(times, axis=1), np.stack(mems, axis=1)


def runtime_terms(model: ModelSpec, hw: Hardware, space: Space,
                  stage_units: Callable[[ModelSpec, np.ndarray], tuple]) -> dict[str, np.ndarray] | None:
    """The runtime's fixed costs per candidate by term (cost_runtime.runtime_fixed_time) on the busiest rank: the
    first pipeline stage, whose blocks, MoE blocks and FSDP units the model's form counts (``stage_units``:
    forms.ModelForm.stage_units); None when none is measured and none is priced from the device
    (cost_runtime.fsdp_unit_seconds)."""
    rt = hw.runtime
    if not any(rt.figures().values()) and not fsdp_unit_seconds(hw):
        return None
    K, M, Cn, D, Lt = space.keys, space.mids, space.cands, space.dpcs, space.layouts
    mid = Cn["mid"]
    key = M["key"][mid]
    lay = K["layout"][key]
    tp, pp, cp, dp, ep = (Lt[n][lay].astype(float) for n in ("tp", "pp", "cp", "dp", "ep"))
    ga, vpp = K["ga"][key].astype(float), M["vpp"][mid].astype(float)
    zero = D["zero"][Cn["dpc"]]
    slots = ga + bubble_fraction(pp, ga, vpp, M["schedule"][mid]) * ga  # micro-batches plus fill and drain
    blocks, moe_blocks, units, has_moe = stage_units(model, pp)
    plain_ddp = runs_plain_ddp(zero, dp, tp, pp, ep, cp, has_moe)
    grad_bytes = 4.0 * model.total_params() / (tp * pp)  # fp32 gradients (GRAD_REDUCE_BYTES), the rank's share
    return runtime_fixed_time(hw, slots, zero, ~plain_ddp, units, blocks, moe_blocks, tp, pp, vpp, ep, dp,
                                grad_bytes, M["schedule"][mid])


def transformer_terms(model: ModelSpec, hw: Hardware, space: Space, seq: int, measured: Measured | None,
                       fused: bool, opts: np.ndarray) -> tuple[dict[str, list], dict[str, list]]:
    """Per representative rank: mid-level (time, memory per recompute mode) and dpc-level (DP traffic, states) terms."""
    m = model
    Lt, K, M, D = space.layouts, space.keys, space.mids, space.dpcs
    f = lambda a: a.astype(float)  # noqa: E731

    # ---- key level: one block, embedding, head and their traffic per micro-batch
    kl = K["layout"]
    tp, pp, cp, dp, ep = (f(Lt[n][kl]) for n in ("tp", "pp", "cp", "dp", "ep"))
    mbs, ga, sp, prec = f(K["mbs"]), f(K["ga"]), K["sp"].astype(bool), K["precision"]
    kind = K["cp_kind"] if "cp_kind" in K else np.zeros(len(mbs), dtype=np.int64)  # specs.CP_KINDS code
    # fp8-mixed: GEMMs at the fp8 rate (fp8), the attention core, the LM head and the rest at bf16 (peak)
    peak, elem, fp8 = hw.peak[BASE_PREC[prec]], ACT_BYTES[prec], prec == FP8
    has_moe = m.moe_layers > 0

    def blocks(h: Hardware) -> tuple[BlockTimes, BlockTimes]:
        dense = dense_block_time(h, m, mbs, seq, tp, cp, sp, peak, elem, fused, fp8, kind)
        return dense, (moe_block_time(h, m, mbs, seq, tp, cp, ep, sp, peak, elem, fused, fp8) if has_moe else dense)

    dense, moe = blocks(hw)
    comp = K["compile"].astype(bool)
    if comp.any():  # plan.compile: the blocks priced compiled (cost.compiled_block_time)
        fz_dense, fz_moe = blocks(compile_hardware(hw)) if hw.compile_fuses else (None, None)
        dense, moe = compiled_block_time(hw, dense, fz_dense, comp), compiled_block_time(hw, moe, fz_moe, comp)
    emb_f, emb_b = embedding_time(hw, m, mbs, seq, cp, elem, tp)
    head_f, head_b = head_time(hw, m, mbs, seq, tp, cp, peak, elem)
    modes = range(len(RECOMPUTE_MODES))
    act = [activation_bytes_per_block(m, mbs, seq, tp, sp, cp, mode, elem, fused, cp_kind=kind) for mode in modes]
    act_moe = ([activation_bytes_per_block(m, mbs, seq, tp, sp, cp, mode, elem, fused, moe=True)
                for mode in modes] if has_moe else act)
    ops_rc = ops_recompute_time(hw, m, mbs, seq, tp, cp, sp, peak, elem, fp8)  # dense blocks (ops_rule: no MoE)
    if measured is not None:
        dense, moe, emb_f, emb_b, head_f, head_b, act, act_moe = _apply_measured(
            measured, m, hw, seq, fused, dense, moe, emb_f, emb_b, head_f, head_b, act, act_moe)
    tp_f, tp_b = tp_comm_per_block(hw, m, mbs, seq, tp, cp, elem)
    if hw.compile_fuses and comp.any():  # async TP: compiled blocks with tp > 1 and SP on a GPU preset
        tp_f, tp_b = async_tp_exposed(hw, tp_f, tp_b, dense, tp, comp & sp & (tp > 1))
    tp_edge = allreduce_time(hw, mbs * seq / cp * m.hidden * elem, tp, 1)  # embedding fwd / head bwd
    cp_f, cp_b = cp_comm_by_kind(hw, m, mbs, seq, tp, cp, elem, kind)
    zero_k = np.zeros_like(tp)
    ep_f, ep_b = ep_comm_per_block(hw, m, mbs, seq, tp, cp, ep, sp, elem) if has_moe else (zero_k, zero_k)
    p2p_inter = np.full(len(tp), hw.nodes > 1)  # pp is the outermost mesh dim: some stage boundary crosses nodes
    p2p = p2p_time(hw, mbs * seq / cp * m.hidden * elem / np.where(sp, tp, 1), p2p_inter)
    # the logits a rank holds: its vocabulary shard where the head is vocab-parallel, else the whole vocabulary's
    # (rank_param_counts' held layout; autopar simulate, issue 27); the loss's reductions where it is split
    buf_last = logits_bytes(m, mbs, seq, logits_split(m, tp, pp, cp), cp, elem)
    loss_comm = vocab_loss_comm_time(hw, mbs, seq, tp, cp, logits_split(m, tp, pp, cp)) \
        + cp_logits_gather_time(hw, m, mbs, seq, tp, cp, vocab_split(m, tp, pp), elem)
    buf_moe = 2 * mbs * seq / cp / np.where(sp, tp, 1) * m.top_k * m.hidden * elem if has_moe else zero_k
    buf_p2p = np.where(pp > 1, 2 * mbs * seq / cp * m.hidden * elem, 0.0)

    # ---- mid level (key x schedule/vpp): stage contents, per-micro-batch time and activations per rank
    mk = M["key"]
    g = lambda a: np.asarray(a)[mk] if np.ndim(a) else np.full(len(mk), float(a))  # noqa: E731
    vpp_m, sched_m = f(M["vpp"]), M["schedule"]
    # the mids' and the dpc rows' representative ranks from one partition per (pp, vpp, V) triple of either
    dl = D["layout"]
    n_m = len(mk)
    reps = _stage_reps(m, hw, space, seq, fused, np.concatenate([Lt["pp"][kl][mk], Lt["pp"][dl]]),
                       np.concatenate([M["vpp"], D["vpp"]]), np.concatenate([M["schedule"], D["schedule"]]))
    reps_m, reps_d = reps[:n_m], reps[n_m:]
    pp_m, ga_m = g(pp), g(ga)
    p2p_mb = np.where(pp_m > 1, 2 * vpp_m * g(p2p), 0.0)
    # the terms of a rank that read only its key and its blocks, once per distinct (key, stage contents): ranks
    # sharing a stage, and mids of a key differing only in schedule or vpp, often hold the same blocks
    at, rank, pair = rank_classes([mk], reps_m[..., :Stage.RANK])
    ck = mk[at]
    gc = lambda a: np.asarray(a)[ck] if np.ndim(a) else np.full(len(ck), float(a))  # noqa: E731  g per class
    nd, nm, he, hh = reps_m[at, rank, :Stage.RANK].T
    nb = nd + nm
    tf = nd * gc(dense.fwd) + nm * gc(moe.fwd) + he * gc(emb_f) + hh * gc(head_f)
    tb = nd * gc(dense.bwd) + nm * gc(moe.bwd) + he * gc(emb_b) + hh * gc(head_b)
    comm = nb * gc(tp_f + tp_b + cp_f + cp_b) + nm * gc(ep_f + ep_b) + (he + hh) * gc(tp_edge) + hh * gc(loss_comm)
    comm_rc = nb * gc(tp_f + cp_f) + nm * gc(ep_f)  # full and ops recompute re-run the forward's collectives
    trc = [0.0 * tf, nd * gc(dense.attn_fwd) + nm * gc(moe.attn_fwd), nd * gc(dense.fwd) + nm * gc(moe.fwd) + comm_rc,
           nb * gc(ops_rc) + comm_rc]
    bufs = hh * gc(buf_last) + np.where(nm > 0, gc(buf_moe), 0.0) + gc(buf_p2p)
    one_layer = np.where(nm > 0, gc(act_moe[0]), gc(act[0]))  # full recompute rebuilds one block at a time
    kept = [nd * gc(act[i]) + nm * gc(act_moe[i]) for i in modes]
    mid = {name: [] for name in ("tf", "tb", "base", "mem")}
    frag = 1 + FRAGMENTATION
    for r in range(N_REP):  # then per mid: its schedule's activations in flight and pipeline traffic
        c = pair[:, r]
        inflight = inflight_microbatches(sched_m, pp_m, vpp_m, ga_m, reps_m[:, r, Stage.RANK])
        mid["tf"].append(tf[c])
        mid["tb"].append(tb[c])
        base, mem = _mix_options(opts, nb[c], tf[c] + tb[c] + (comm[c] + p2p_mb), [t[c] for t in trc], inflight,
                                 [k[c] for k in kept], bufs[c], one_layer[c], frag)
        mid["base"].append(base)
        mid["mem"].append(mem)

    # ---- dpc level (layout x precision x schedule/vpp x zero/dp_shard): data-parallel traffic and model states
    tp_d, pp_d, cp_d, dp_d, ep_d = (f(Lt[n][dl]) for n in ("tp", "pp", "cp", "dp", "ep"))
    zero, prec_d = D["zero"], D["precision"]
    ds = np.where(D["dp_shard"] > 0, D["dp_shard"], Lt["dp"][dl]).astype(float)
    p_dense_blk, p_moe_shared, p_moe_expert, p_emb, p_head = rank_param_counts(m, tp_d, ep_d, pp_d, has_moe)
    h_dense, h_shared, _, h_emb, h_head = rank_param_counts(m, tp_d, ep_d, pp_d, has_moe, held=True)
    unit = np.maximum(p_dense_blk, p_moe_shared + p_moe_expert if has_moe else 0.0)
    # each distinct (dpc row's fields, rank's stage contents) priced once, as one vector
    content = reps_d[..., [Stage.DENSE, Stage.MOE, Stage.EMBEDDING, Stage.HEAD]]
    at, rank, pair = rank_classes([dl, prec_d, zero, D["dp_shard"], D["offload"]], content)
    nd, nm, he, hh = content[at, rank].T
    p_d = nd * p_dense_blk[at] + nm * p_moe_shared[at] + he * p_emb[at] + hh * p_head[at]
    p_e = nm * p_moe_expert[at]
    # one FSDP unit per block plus one for the stage's embedding / norm / head: the first unit's gather and
    # the last unit's reduction have no compute to hide behind
    edge = he * p_emb[at] + hh * p_head[at]
    tail = np.minimum(1.0, np.where(edge > 0, edge, unit[at]) / np.maximum(p_d + p_e, 1.0))
    kept = edge + np.where(nd > 0, p_dense_blk[at], p_moe_shared[at])  # the root unit and the last block
    held_d = nd * h_dense[at] + nm * h_shared[at] + he * h_emb[at] + hh * h_head[at]
    dpc: dict[str, list] = {name: [] for name in DPC_TERMS}
    _dp_rank_terms(hw, dpc, zero[at], prec_d[at], dp_d[at], cp_d[at], tp_d[at], ep_d[at], ds[at], p_d, p_e,
                   unit[at], tail, pp_d[at], D["offload"][at], m.trainable_share(), kept, held_d)
    return mid, ClassTerms({name: np.asarray(v[0]) for name, v in dpc.items()}, pair)


def unit_terms(model: ModelSpec, hw: Hardware, space: Space, seq: int, measured: Measured | None,
                fused: bool, opts: np.ndarray) -> tuple[dict[str, list], dict[str, list]]:
    """Unit form: per representative rank, the sums over its units of time, saved activations and parameters.

    tp = cp = ep = 1 (space.py offers no other); per micro-batch the rank runs its units' forward and backward
    (cost_units.unit_time), the SyncBatchNorm collectives of its BatchNorm units when dp > 1, and with pp > 1 sends and
    receives its boundary tensor (forward activation, backward gradient). Full recompute keeps each unit's input
    and rebuilds one unit's activations at a time (the rank's largest), re-running the forward and its SyncBN.
    """
    u = UnitArrays.of(model)
    Lt, K, M, D = space.layouts, space.keys, space.mids, space.dpcs
    f = lambda a: a.astype(float)  # noqa: E731
    frag = 1 + FRAGMENTATION

    # ---- key level (layout x mbs x precision): every unit's time and saved bytes per micro-batch
    kl = K["layout"]
    pp, dp = f(Lt["pp"][kl]), f(Lt["dp"][kl])
    mbs, ga, prec = f(K["mbs"]), f(K["ga"]), K["precision"]
    peak, elem = hw.peak[BASE_PREC[prec]], ACT_BYTES[prec]  # units do not single out their GEMMs: fp8-mixed at bf16
    uf, ub = unit_time(hw, u, mbs, peak, elem)
    if K["compile"].any():  # plan.compile: a measured speed-up only (units have no fused-traffic model)
        units = compiled_block_time(hw, BlockTimes(uf, ub, 0.0 * uf), None, K["compile"].astype(bool)[:, None])
        uf, ub = units.fwd, units.bwd
    act = [unit_activation_bytes(u, mbs, elem, mode) for mode in range(len(RECOMPUTE_MODES))]
    if measured is not None:
        uf, ub, act = _apply_measured_units(measured, model, u, hw, uf, ub, act)
    sel = unit_selective_time(hw, u, mbs, elem)
    ops_rc = unit_selective_time(hw, u, mbs, elem, every_unit=True)
    bn_f, bn_b = sync_batchnorm_time(hw, dp)

    # ---- mid level (key x schedule/vpp): sums over each representative rank's units
    mk = M["key"]
    vpp_m, sched_m, pp_m, ga_m = f(M["vpp"]), M["schedule"], pp[mk], ga[mk]
    masks, rows = _unit_reps(model, u, hw, space, Lt["pp"][kl][mk], M["vpp"])
    uf_m, ub_m, sel_m, ops_m, act_m = uf[mk], ub[mk], sel[mk], ops_rc[mk], [a[mk] for a in act]
    mid: dict[str, list] = {name: [] for name in ("tf", "tb", "base", "mem")}
    for r in range(N_REP):
        w, stage = masks[:, r, :], rows[:, r, UnitStage.RANK]
        boundary = rows[:, r, UnitStage.BOUNDARY] * mbs[mk] * elem[mk] / 4.0
        tf, tb = (uf_m * w).sum(axis=1), (ub_m * w).sum(axis=1)
        n_bn = w @ u.batchnorm.astype(float)
        p2p = np.where(pp_m > 1, 2 * vpp_m * p2p_time(hw, boundary, hw.nodes > 1), 0.0)
        comm = n_bn * (bn_f[mk] + bn_b[mk]) + p2p
        trc = [0.0 * tf, (sel_m * w).sum(axis=1), tf + n_bn * bn_f[mk], (ops_m * w).sum(axis=1) + n_bn * bn_f[mk]]
        inflight = inflight_microbatches(sched_m, pp_m, vpp_m, ga_m, stage)
        bufs = np.where(pp_m > 1, 2 * boundary, 0.0)
        one_unit = (act_m[0] * w).max(axis=1)  # full recompute rebuilds one unit at a time
        mid["tf"].append(tf)
        mid["tb"].append(tb)
        kept = [(a * w).sum(axis=1) for a in act_m]
        base, mem = _mix_options(opts, w.sum(axis=1), tf + tb + comm, trc, inflight, kept, bufs, one_unit, frag)
        mid["base"].append(base)
        mid["mem"].append(mem)

    # ---- dpc level: the rank's parameters through the shared data-parallel terms
    dl = D["layout"]
    tp_d, cp_d, dp_d, ep_d = (f(Lt[n][dl]) for n in ("tp", "cp", "dp", "ep"))
    ds = np.where(D["dp_shard"] > 0, D["dp_shard"], Lt["dp"][dl]).astype(float)
    masks_d, rows_d = _unit_reps(model, u, hw, space, Lt["pp"][dl], D["vpp"])
    dpc: dict[str, list] = {name: [] for name in DPC_TERMS}
    for r in range(N_REP):
        w = masks_d[:, r, :]
        p_d = w @ u.params
        unit = (w * u.params).max(axis=1)  # the largest FSDP unit: zero-3 gather buffers
        tail = np.minimum(1.0, rows_d[:, r, UnitStage.HEAD_PARAMS] / np.maximum(p_d, 1.0))
        trains = 1.0 - (w @ u.frozen) / np.maximum(p_d, 1.0)  # the stage's own frozen share
        _dp_rank_terms(hw, dpc, D["zero"], D["precision"], dp_d, cp_d, tp_d, ep_d, ds, p_d, 0.0 * p_d, unit, tail,
                       f(Lt["pp"][dl]), D["offload"], trains)
    return mid, dpc


def _apply_measured_units(meas: Measured, model: ModelSpec, u: UnitArrays, hw: Hardware, uf: np.ndarray,
                          ub: np.ndarray, act: list) -> tuple[np.ndarray, np.ndarray, list]:
    """Unit form: measured blocks named like units replace those units' terms, scaled by the analytic ratio."""
    ref_prec = PRECISIONS.index(meas.precision)
    rf, rb = unit_time(hw, u, float(meas.mbs), hw.peak[ref_prec], ACT_BYTES[ref_prec])
    ra = unit_activation_bytes(u, float(meas.mbs), ACT_BYTES[ref_prec], 0)
    uf, ub, act = uf.copy(), ub.copy(), [a.copy() for a in act]
    for j, unit in enumerate(model.units):
        got = meas.blocks.get(unit.name)
        if got is None:
            continue
        uf[:, j] = scaled_measure(got.fwd_s, uf[:, j], float(rf[j]))
        ub[:, j] = scaled_measure(got.bwd_s, ub[:, j], float(rb[j]))
        if got.activation_bytes:
            act[0][:, j] = act[1][:, j] = scaled_measure(got.activation_bytes, act[0][:, j], float(ra[j]))
    return uf, ub, act


class Rc(IntEnum):
    """The mid x recompute terms of a representative rank, by position on the last axis of search.Tables.by_rc."""

    BASE = 0  # seconds per micro-batch slot: compute, recompute, TP/CP/EP/PP traffic (the "base" list)
    MEM = 1  # bytes: saved activations, logits, pipeline and MoE buffers, with the fragmentation margin ("mem")


class Window(IntEnum):
    """The compute windows that can hide data-parallel traffic (x Hardware.overlap), by position on the last axis
    of search.Tables.by_mid."""

    TF = 0  # the rank's forward per micro-batch ("tf")
    TB = 1  # its backward ("tb")


class Dpc(IntEnum):
    """The dpc-level terms of a representative rank (_dp_rank_terms), by position on the last axis of
    search.Tables.by_dpc; seconds unless bytes. Per micro-batch the exposed DP traffic is
    overlapped_exposed(A1, tf, B1) + overlapped_exposed(A2, tb, B2); once per step overlapped_exposed(A3, tb, B3)
    + C3 + OPT (search.slot_of, Tables.step_memory)."""

    A1 = 0  # zero 3's forward all-gathers per micro-batch (outside a pipeline stage)
    B1 = 1  # the part of A1 no compute hides (the first unit's gather)
    A2 = 2  # zero 3's backward all-gathers per micro-batch
    B2 = 3  # the part of A2 no compute hides
    A3 = 4  # once per step: the gradient reduction (+ HSDP's all-reduce; + zero 3's one gather in a pipeline stage)
    B3 = 5  # the part of A3 no compute hides (the last unit's reduction)
    C3 = 6  # once per step: zero 1/2's one gather, exposed
    OPT = 7  # once per step: the optimizer step (device or host) and its parameter copies
    MEM = 8  # bytes: model states + DDP / FSDP2 buffers (with the margin) + the reserved memory
    MB = 9  # per micro-batch: memory-bound parameter work (fp32 gradient accumulation, zero 3's shard copies)
    M_PARAMS = 10  # bytes: the parameters' part of the model states (with FSDP2's shard copy)
    M_GRADS = 11  # bytes: the gradients' part
    M_OPTIM = 12  # bytes: the optimizer states' part
    HOST = 13  # bytes kept on the host per device (plan.offload)


DPC_TERMS = tuple(term.name.lower() for term in Dpc)  # the keys of the dpc dict, in Dpc order


def rank_param_counts(m: ModelSpec, tp: Any, ep: Any, pp: Any, has_moe: bool,
                      held: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    """Parameters on a rank before data-parallel sharding: (dense block, MoE block's shared part, MoE block's
    experts, embedding, LM head + final norm). Its traffic is priced on Megatron's layout, everything split over tp
    (the published runs the cost model is checked against are Megatron's); ``held``: what the runtime holds
    in memory: the norms whole on every TP rank (parallel/tensor.py; measured by ``autopar simulate``, issue 27),
    the embedding and the head split by vocabulary where the runtime does so (``cost_memory.vocab_split``:
    parallel/vocab.py), else whole. A tied head shares the embedding on one stage; with stages the last one keeps
    a copy (Megatron)."""
    norms = 4 * m.hidden
    keep = 1.0 if held else tp  # the divisor of what TP leaves whole in the runtime
    vocab = vocab_split(m, tp, pp) if held else tp  # the divisor of the embedding and head rows
    dense = (m.block_params() - norms) / tp + norms / keep
    shared = (m.attention_params() + m.hidden * m.experts) / tp + norms / keep
    expert = m.mlp_params() * m.experts / (tp * ep) if has_moe else 0.0 * tp
    emb = m.vocab * m.hidden / vocab + 0.0 * tp
    head = np.where(m.tied_embeddings & (np.asarray(pp) == 1), 0.0, m.vocab * m.hidden / vocab) + 2 * m.hidden + 0.0 * tp
    return dense, shared, expert, emb, head


def _dp_rank_terms(hw: Hardware, dpc: dict[str, list], zero: np.ndarray, prec_d: np.ndarray, dp_d: np.ndarray,
                   cp_d: np.ndarray, tp_d: np.ndarray, ep_d: np.ndarray, ds: np.ndarray, p_d: np.ndarray,
                   p_e: np.ndarray, unit: np.ndarray, tail: np.ndarray, pp: Any = 1.0, offload: Any = 0,
                   trains: Any = 1.0, kept: Any = 0.0, held_d: Any = None) -> None:
    """Append one representative rank's data-parallel traffic, parameter work and model-state memory to ``dpc``.

    ``p_d`` / ``p_e``: dense / expert parameters on the rank; ``unit``: the largest FSDP unit (zero-3 gather
    buffers); ``tail``: the share of the rank's gather/reduction that no compute hides (first / last unit);
    ``held_d``: the dense parameters the rank holds in memory when they differ from those its traffic moves
    (``rank_param_counts(..., held=True)``; None: ``p_d``); ``kept``: the parameters of the units zero 3 keeps
    gathered through the step (the last block and the root unit, outside a pipeline); ``pp``: the pipeline degree (a
    pipeline stage keeps its FSDP parameters gathered from one micro-batch's backward to the next one's forward:
    torch.distributed.pipelining turns reshard_after_backward off until the step's last); ``offload``: the
    OFFLOAD_MODES code (model states on the host: cost_memory.offloaded_state_bytes, their copies and the host
    optimizer step: offload_copy_time, host_optimizer_step_time); ``trains``: the share of the rank's parameters
    that train (frozen ones, requires_grad=False, have no gradient to reduce, accumulate or keep and no optimizer
    state or step: DDP and FSDP2 skip them). What it appends is named by ``Dpc``.
    """
    frag = 1 + FRAGMENTATION
    # context parallelism: FSDP runs over dp x cp (topology/mesh.MeshLayout.dp_mesh, torchtitan's dp_shard_cp); at zero 0
    # it replicates over dp and shards over cp, parameters kept gathered through the step: zero 2 over cp
    cp_zero0 = (zero == 0) & (cp_d > 1)
    ddp = runs_plain_ddp(zero, dp_d, tp_d, pp, ep_d, cp_d, np.asarray(p_e) > 0)  # else FSDP2: other buffers
    fsdp = runs_fsdp(zero, dp_d, tp_d, pp, ep_d, cp_d, np.asarray(p_e) > 0)
    zero, ds = np.where(cp_zero0, 2, zero), np.where(cp_zero0, 1.0, ds)
    wbytes = WEIGHT_BYTES[prec_d]
    gbytes = GRAD_REDUCE_BYTES[prec_d]  # gradients travel in fp32, parameters in the compute precision
    shard = ds * cp_d
    exp_shard = np.maximum(shard / ep_d, 1)
    replicas = dp_d / ds
    stride = dim_strides(replicas, ds, cp_d, tp_d, ep_d)  # the mesh's rank order (dims.py)
    z1, z2, z3 = zero == 1, zero == 2, zero == 3
    grad_d, grad_e = p_d * trains * gbytes, p_e * trains * gbytes
    shard_s = stride["dp_shard_cp"]  # FSDP's dp_shard x cp group
    edp_s = stride["edp"]  # the expert shards' group (ranks holding the same experts; MoE runs with cp = 1)
    rs = reduce_scatter_time(hw, grad_d, shard, shard_s) + reduce_scatter_time(hw, grad_e, exp_shard, edp_s)
    ag = (allgather_time(hw, p_d * wbytes, shard, shard_s)
          + allgather_time(hw, p_e * wbytes, exp_shard, edp_s))
    ar = (allreduce_time(hw, grad_d, dp_d * cp_d, shard_s)
          + allreduce_time(hw, grad_e, np.maximum(dp_d * cp_d / ep_d, 1), edp_s))
    hsdp = np.where(replicas > 1, allreduce_time(hw, grad_d / shard + grad_e / exp_shard, replicas,
                                                   stride["dp_replicate"]), 0.0)
    local = np.where(zero == 0, p_d + p_e, p_d / shard + p_e / exp_shard)
    # offload: the host-link copies ride with the gathers (shard copy-in) and the reductions (gradient copy-out),
    # prefetched and overlapped as those are; the updated parameters' copy back is exposed (with the step)
    h2d_gather, d2h_reduce, h2d_step = offload_copy_time(hw, local, prec_d, offload)
    ag, rs = ag + h2d_gather, rs + d2h_reduce
    # gradients are reduced once per step, after the last micro-batch (runtime.step turns gradient sync off for
    # the others: parallel.fsdp.set_gradient_sync): all-reduce at zero 0, reduce-scatter at 1-3 (+ HSDP's
    # all-reduce across replicas)
    staged = np.asarray(pp) > 1  # zero 3 in a pipeline stage: the forward gathers once per step, not per micro-batch
    once = np.where(zero == 0, ar, rs + hsdp) + np.where(z3 & staged, ag, 0.0)
    # per micro-batch exposed = max(a1 - tf, b1) + max(a2 - tb, b2); once per step = max(a3 - tb, b3) + c3
    # (plus the interference share of the hidden part, search.slot_of). zero 3 gathers every unit in forward and
    # again in backward per micro-batch; zero 1/2 gather once per step and keep the parameters until the last
    # micro-batch's backward (set_gradient_sync), priced as one exposed gather per step (c3).
    # zero 3 outside a pipeline: the runtime keeps the last block and the root unit (embedding, norm, head)
    # gathered from forward to backward and from one micro-batch to the next (parallel/fsdp.py, reshard only the
    # other blocks): ``kept``, gathered once per step; the other units in forward and again in backward per
    # micro-batch (autopar simulate counts these gathers: issue 27)
    ag_kept = np.where(z3 & ~staged, allgather_time(hw, np.minimum(kept, p_d) * wbytes, shard, shard_s), 0.0)
    ag_rest = np.maximum(ag - ag_kept, 0.0)
    once = once + ag_kept
    dpc["a1"].append(np.where(z3 & ~staged, ag_rest, 0.0))
    dpc["b1"].append(np.where(z3 & ~staged, ag_rest * tail, 0.0))
    dpc["a2"].append(np.where(z3, np.where(staged, ag, ag_rest), 0.0))
    dpc["b2"].append(np.where(z3, np.where(staged, ag, ag_rest) * tail, 0.0))
    dpc["a3"].append(once)
    dpc["b3"].append(once * tail)
    dpc["c3"].append(np.where(z1 | z2, ag, 0.0))
    # memory-bound parameter work: per micro-batch the fp32 gradient accumulation (every zero: unsharded gradients
    # accumulate locally until the step's reduction) and, for zero 3, two gathers' copy-in/out; per step the
    # reduction's cast and accumulation (zero 1-3) and zero 1/2's one gather copy
    copies = lambda g, red: (shard_copy_time(hw, p_d, shard, prec_d, g, red)  # noqa: E731
                             + shard_copy_time(hw, p_e, exp_shard, prec_d, g, red))
    dpc["mb"].append(grad_accumulate_time(hw, (p_d + p_e) * trains, prec_d) + np.where(z3, copies(2.0, 0.0), 0.0))
    step_on = np.where(np.asarray(offload) > 0, host_optimizer_step_time(hw, local * trains, prec_d),
                       optimizer_time(hw, local * trains, prec_d))
    dpc["opt"].append(step_on + h2d_step + np.where(zero > 0, copies(np.where(z1 | z2, 1.0, 0.0), 1.0), 0.0))
    # the runtime runs ZeRO-1 as ZeRO-2 (FSDP2 reduce-scatters the gradients; parallel/fsdp.py): priced so
    held = np.where(z1, 2, zero)
    mem_d = p_d if held_d is None else held_d  # what the rank holds (TP keeps embeddings, head, norms whole)
    parts = [a + b for a, b in zip(model_state_parts(mem_d, held, shard, prec_d),
                                   model_state_parts(p_e, held, exp_shard, prec_d))]
    parts[1], parts[2] = parts[1] * trains, parts[2] * trains  # gradients and optimizer states: trainable only
    replicated = zero == 0  # zero 0 on FSDP2: a (dp_replicate, dp_shard=1) mesh, the parameters whole
    shard_copy = fsdp_shard_copy_bytes(mem_d, zero, np.where(replicated, 1.0, shard), prec_d, fsdp) \
        + fsdp_shard_copy_bytes(p_e, zero, np.where(replicated, 1.0, exp_shard), prec_d, fsdp)
    parts[0] = parts[0] + shard_copy
    moved = offloaded_state_bytes(*parts, shard_copy, zero, offload)
    copies_w, copies_g = host_step_copy_bytes(local * trains, prec_d, offload)
    if hw.host_link:  # a host of its own: the moved states leave the device (else they stay: nothing is saved)
        parts = [part - out for part, out in zip(parts, moved)]
        dpc["host"].append(sum(moved) + copies_w + copies_g)
    else:  # the host step's copies are more of the same memory
        parts[0], parts[1] = parts[0] + copies_w, parts[1] + copies_g
        dpc["host"].append(0.0 * local)
    states = sum(parts)
    for name, part in zip(("m_params", "m_grads", "m_optim"), parts):
        dpc[name].append(part)
    fsdp_bufs = np.where(fsdp, fsdp_buffer_bytes(unit, zero, prec_d), 0.0)
    bufs = np.where(ddp, ddp_bucket_bytes(mem_d * gbytes + grad_e), fsdp_bufs)
    dpc["mem"].append(states + bufs * frag + hw.reserved)


def _apply_measured(meas: Measured, m: ModelSpec, hw: Hardware, seq: int, fused: bool, dense, moe,
                    emb_f, emb_b, head_f, head_b, act, act_moe):
    """Replace analytic block terms by measured ones, scaled to each key by the analytic ratio (cost.scaled_measure)."""
    ref_prec = PRECISIONS.index(meas.precision)
    peak, elem = hw.peak[ref_prec], ACT_BYTES[ref_prec]
    b, s = meas.mbs, meas.seq_len
    blocks = meas.blocks
    ref_dense = dense_block_time(hw, m, b, s, 1, 1, False, peak, elem, fused)

    def scale_block(now: BlockTimes, ref: BlockTimes, got: BlockMeasure | None) -> BlockTimes:
        if got is None:
            return now
        f = scaled_measure(got.fwd_s, now.fwd, float(ref.fwd))
        return BlockTimes(f, scaled_measure(got.bwd_s, now.bwd, float(ref.bwd)),
                            scaled_measure(got.fwd_s, now.attn_fwd, float(ref.fwd)))

    dense_new = scale_block(dense, ref_dense, blocks.get("dense"))
    moe_new = moe
    if m.moe_layers:
        ref_moe = moe_block_time(hw, m, b, s, 1, 1, 1, False, peak, elem, fused)
        moe_new = scale_block(moe, ref_moe, blocks.get("moe"))
    else:
        moe_new = dense_new
    if "embedding" in blocks:
        rf, rb = embedding_time(hw, m, b, s, 1, elem)
        emb_f = scaled_measure(blocks["embedding"].fwd_s, emb_f, float(rf))
        emb_b = scaled_measure(blocks["embedding"].bwd_s, emb_b, float(rb))
    if "head" in blocks:
        rf, rb = head_time(hw, m, b, s, 1, 1, peak, elem)
        head_f = scaled_measure(blocks["head"].fwd_s, head_f, float(rf))
        head_b = scaled_measure(blocks["head"].bwd_s, head_b, float(rb))

    def scale_act(acts: list, kind: str, is_moe: bool) -> list:
        got = blocks.get(kind)
        if got is None or not got.activation_bytes:
            return acts
        ref = float(activation_bytes_per_block(m, b, s, 1, False, 1, 0, elem, fused, moe=is_moe))
        return [scaled_measure(got.activation_bytes, a, ref) for a in acts]

    act = scale_act(act, "dense", False)
    act_moe = scale_act(act_moe, "moe", True) if m.moe_layers else act
    return dense_new, moe_new, emb_f, emb_b, head_f, head_b, act, act_moe
