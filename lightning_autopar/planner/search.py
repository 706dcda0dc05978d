"""Feasibility, pricing and ranking (the pipeline partition it prices is partition.py): ``plan()`` searches the space, ``estimate()`` prices one plan.

Pure numpy: no torch import here (an ``nn.Module`` is turned into a ModelSpec by ``lightning_autopar.plan``).
Pricing is vectorised over the whole candidate space (see space.py for its two-level layout); the
assembly below follows the cost terms of cost.py, each named there with its formula and source.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from lightning_autopar.errors import ConfigError, InfeasibleError
from lightning_autopar.planner import cost as C
from lightning_autopar.planner.partition import layer_weights, stage_chunks, stage_table, unit_stage_table
from lightning_autopar.planner.report import PlanReport, explain
from lightning_autopar.planner.space import THINNED_MODES, Space, enumerate_space, space_from_plans, unit_form_restrict
from lightning_autopar.specs import (
    PRECISIONS,
    RECOMPUTE_MODES,
    SCHEDULES,
    V_SCHEDULES,
    BlockMeasure,
    Breakdown,
    ClusterSpec,
    Measured,
    ModelSpec,
    Plan,
    PricedPlan,
    load_cluster_spec,
    load_model_spec,
    parse_fix,
)

N_REP = 3  # representative pipeline ranks priced per candidate: first, last, heaviest middle
CHUNK = 16384  # candidates per vectorised block (keeps the working set in cache)
V_CODES = [SCHEDULES.index(s) for s in V_SCHEDULES]  # two chunks per rank in a V


# ============================================================================================ inputs


def resolve_model(model: Any, seq_len: int | None = None) -> ModelSpec:
    """ModelSpec from a spec, preset name, YAML path or mapping. The planner takes specs only: an ``nn.Module`` is
    analysed one layer up (``lightning_autopar.plan`` / ``estimate``, ``profile.analyze.model_spec_from_module``)."""
    if isinstance(model, (ModelSpec, str, Mapping)):
        return load_model_spec(model)
    if hasattr(model, "parameters") and hasattr(model, "forward"):
        raise ConfigError("model", f"the planner takes specs, not a {type(model).__name__} module",
                          "call lightning_autopar.plan / estimate, which analyse the module first")
    raise ConfigError("model", f"cannot plan for a {type(model).__name__}",
                      "pass a ModelSpec, a preset name, a YAML path, a mapping or an nn.Module")


def resolve_precisions(cluster: ClusterSpec, precision: str | Sequence[str] | None) -> list[str]:
    """Explicit precision(s), else the fastest the device has: bf16-mixed, fp16-mixed, else fp32."""
    from lightning_autopar.specs import _coerce

    if precision is None:
        pk = cluster.device.peak_tflops
        if pk.bf16 > pk.fp32:
            return ["bf16-mixed"]
        return ["fp16-mixed"] if pk.fp16 > pk.fp32 else ["fp32"]
    values = [precision] if isinstance(precision, str) else list(precision)
    return [_coerce("precision", v) for v in values]


# ============================================================================================ pricing


def _unit_reps(model: ModelSpec, units: C.UnitArrays, hw: C.Hardware, space: Space, pp: np.ndarray,
               vpp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit-form representative ranks for each row's (pp, vpp): masks (rows, N_REP, units), rows (rows, N_REP, 3)."""
    weights = layer_weights(model, hw, 1, space.weights_precision(), True)[0]
    shape = (int(pp.max(initial=1)) + 1, int(vpp.max(initial=1)) + 1, N_REP)
    masks, rows = np.zeros(shape + (len(weights),)), np.zeros(shape + (3,))
    for code in np.unique(pp * 4096 + vpp):
        p_, v_ = divmod(int(code), 4096)
        masks[p_, v_], rows[p_, v_] = unit_stage_table(units, weights, p_, v_, space.uneven)
    return masks[pp, vpp], rows[pp, vpp]


def _stage_reps(model: ModelSpec, hw: C.Hardware, space: Space, seq: int, fused: bool, pp: np.ndarray,
                vpp: np.ndarray, schedule: np.ndarray) -> np.ndarray:
    """Representative ranks for each row's (pp, vpp, V placement or not): array (rows, N_REP, 5) from one
    partition per distinct triple."""
    weights, emb_w, head_w = layer_weights(model, hw, seq, space.weights_precision(), fused)
    v = np.isin(schedule, V_CODES).astype(np.int64)
    table = np.zeros((int(pp.max(initial=1)) + 1, int(vpp.max(initial=1)) + 1, 2, N_REP, 5))
    for code in np.unique((pp * 4096 + vpp) * 2 + v):
        (p_, v_), shape = divmod(int(code) // 2, 4096), int(code) % 2
        table[p_, v_, shape] = stage_table(model, weights, emb_w, head_w, p_, v_, space.uneven, bool(shape))[0]
    return table[pp, vpp, v]


def price(model: ModelSpec, hw: C.Hardware, space: Space, global_batch: int, seq: int,
          measured: Measured | None = None, fused: bool = True, detail: bool = True) -> dict[str, np.ndarray]:
    """Price every candidate: step time, memory per device and (``detail``) the breakdown, as arrays.

    Terms are computed on the smallest factor table they depend on (space.Space) and combined per candidate
    for each representative pipeline rank (first, last, heaviest middle); the slowest rank sets the pace and
    the fullest sets the memory. A transformer is priced by its blocks, a unit-form model by the sums over
    each rank's units (_unit_terms); both feed the same data-parallel terms and assembly.
    """
    tables = Tables.of(model, hw, space, seq, measured, fused)
    out = _assemble(tables, detail)
    if tables.fixed is not None:
        out["step"] = out["step"] + tables.fixed_total
        if detail:
            out["runtime"] = tables.fixed_total
            out["terms"] = tables.fixed
    return out


class Tables:
    """One hardware's priced factor tables for a space, packed for the per-candidate assembly: the rows each
    candidate gathers (mid x recompute, mid, dpc), and the steps priced so far (NaN: not yet). ``steps`` prices
    only what can rank (the bounded search); ``price`` assembles every candidate (the exhaustive path)."""

    def __init__(self, hw: C.Hardware, space: Space, mid: dict[str, list], dpc: dict[str, list], opt_of: np.ndarray,
                 n_opts: int, fixed: dict[str, np.ndarray] | None) -> None:
        K, M, Cn = space.keys, space.mids, space.cands
        mk = M["key"]
        ga, vpp_m = K["ga"].astype(float), M["vpp"].astype(float)
        pp = space.layouts["pp"][K["layout"]].astype(float)
        self.hw, self.space, self.mid, self.dpc, self.n_opts = hw, space, mid, dpc, n_opts
        # three row-gathers per candidate (mid x recompute, mid, dpc), reduced over the representative ranks;
        # float32 (ranking needs ~1e-6 relative precision) and cache-sized chunks keep it memory-light
        self.cm, self.cd = Cn["mid"], Cn["dpc"]
        self.mrc = self.cm * n_opts + opt_of  # recompute_table's rows
        t32 = lambda arrs: np.ascontiguousarray(np.stack(arrs, axis=-1), dtype=np.float32)  # noqa: E731
        self.by_rc = t32([np.stack(mid["base"], axis=2), np.stack(mid["mem"], axis=2)]).reshape(-1, N_REP, 2)
        # compute windows that can hide data-parallel traffic (x the device's overlap share)
        self.by_mid = t32([hw.overlap * np.stack(mid["tf"], axis=1), hw.overlap * np.stack(mid["tb"], axis=1)])
        self.by_dpc = t32([np.stack(dpc[k], axis=1) for k in DPC_TERMS])
        self.f_sm = np.float32(hw.comm_sm)
        # steady state + fill/drain: m * (1 + the schedule's bubble fraction) slots (cost.bubble_fraction; 1F1B:
        # (m + (pp-1)/vpp), Narayanan et al. 2021), then the once-per-step tail
        self.ga_m = ga[mk]
        self.span = (self.ga_m + C.bubble_fraction(pp[mk], self.ga_m, vpp_m, M["schedule"]) * self.ga_m
                     ).astype(np.float32)
        self.fixed = fixed
        self.fixed_total = sum(fixed.values()) if fixed is not None else None
        self.step = np.full(len(self.cm), np.inf)
        self.done = np.zeros(len(self.cm), dtype=bool)

    @staticmethod
    def of(model: ModelSpec, hw: C.Hardware, space: Space, seq: int, measured: Measured | None = None,
           fused: bool = True) -> "Tables":
        terms = _unit_terms if model.unit_form else _transformer_terms
        opts, opt_of = recompute_table(space)
        mid, dpc = terms(model, hw, space, seq, measured, fused, opts)
        return Tables(hw, space, mid, dpc, opt_of, len(opts), _runtime_terms(model, hw, space))

    def step_memory(self, sl: Any, memory: bool = True) -> tuple[np.ndarray, ...]:
        """(step without the runtime's fixed terms[, memory, host]) of candidates ``sl`` (a slice or indices)."""
        cm = self.cm[sl]
        a, b, d = self.by_rc[self.mrc[sl]], self.by_mid[cm], self.by_dpc[self.cd[sl]]
        slot_r = slot_of(a, b, d, self.f_sm)
        tail = C.overlapped_exposed(d[..., 4], b[..., 1], d[..., 5], self.f_sm) + d[..., 6] + d[..., 7]
        step = self.span[cm] * max3(slot_r) + max3(tail)
        return (step, max3(a[..., 1] + d[..., 8]), max3(d[..., 13])) if memory else (step,)

    def memory_host(self) -> tuple[np.ndarray, np.ndarray]:
        """Device memory and host memory of every candidate, as ``step_memory`` sums them (the same float32
        values), gathered one rank column at a time: 1-D takes are several times faster than row gathers."""
        n = len(self.cm)
        memory, host = np.empty(n), np.empty(n)
        col = lambda arr: [np.ascontiguousarray(arr[:, r]) for r in range(N_REP)]  # noqa: E731
        mem_rc, mem_d, host_d = col(self.by_rc[..., 1]), col(self.by_dpc[..., 8]), col(self.by_dpc[..., 13])
        for lo in range(0, n, 8 * CHUNK):
            sl = slice(lo, min(lo + 8 * CHUNK, n))
            i, j = self.mrc[sl], self.cd[sl]
            mem, out = mem_rc[0].take(i) + mem_d[0].take(j), host_d[0].take(j)
            for r in range(1, N_REP):
                np.maximum(mem, mem_rc[r].take(i) + mem_d[r].take(j), out=mem)
                np.maximum(out, host_d[r].take(j), out=out)
            memory[sl], host[sl] = mem, out
        return memory, host

    def _price(self, idx: np.ndarray) -> None:
        todo = idx[~self.done[idx]]
        self.done[todo] = True
        for lo in range(0, len(todo), CHUNK):
            part = todo[lo:lo + CHUNK]
            self.step[part] = self.step_memory(part, memory=False)[0]
            if self.fixed_total is not None:
                self.step[part] += self.fixed_total[part]

    def lower_bounds(self) -> np.ndarray:
        """Per mid, a step no candidate of it beats: span x the slowest rank's base slot (compute, recompute and
        TP/CP/EP/PP traffic) at its cheapest recompute option. Every term a candidate adds to it (parameter work,
        exposed DP traffic, the once-per-step tail, the runtime's fixed costs) is a time >= 0, and float32
        rounding is monotone, so the bound never exceeds a price computed by ``step_memory``."""
        base = self.by_rc[..., 0].reshape(-1, self.n_opts, N_REP).min(axis=1)
        return self.span * max3(base)

    def compute_bounds(self) -> np.ndarray:
        """Per mid, a bound as ``lower_bounds`` from the compute alone (forward and backward of the slowest
        rank): no link enters it, so it holds on a cluster that differs only in its links (the what-ifs)."""
        return self.span * max3(np.stack(self.mid["tf"], 1) + np.stack(self.mid["tb"], 1)).astype(np.float32)

    def steps(self, eligible: np.ndarray, k: int, layout: np.ndarray | None = None,
              exhaustive: bool = False) -> np.ndarray:
        """Step per candidate, exact for every ``eligible`` one that can be among the ``k`` fastest (or, with
        ``layout``, the fastest whose layout differs from the fastest's), +inf for the others. Mids are taken cheapest bound first until the k-th best step found (or the best
        of another layout, if slower) is below every remaining mid's bound; ``exhaustive`` prices them all."""
        idx = np.flatnonzero(eligible)
        if exhaustive or not len(idx) or (self.fixed_total is not None and (self.fixed_total < 0).any()):
            self._price(idx)
            return np.where(eligible, self.step, np.inf)
        bound = self.lower_bounds().astype(float)
        cm = self.cm[idx]
        present = np.zeros(len(bound), dtype=bool)
        present[cm] = True
        order = np.flatnonzero(present)
        order = order[np.argsort(bound[order], kind="stable")]
        counts = np.bincount(cm, minlength=len(bound))[order]
        # a first batch of the most promising mids sets the threshold; then every mid under it is priced
        first = order[:int(np.searchsorted(np.cumsum(counts), max(4 * k, 2048))) + 1]
        take = np.zeros(len(bound), dtype=bool)
        take[first] = True
        self._price(idx[take[cm]])
        limit = self._threshold(idx, k, layout)
        take |= present & (bound <= limit)
        self._price(idx[take[cm]])
        return np.where(eligible, self.step, np.inf)

    def _threshold(self, idx: np.ndarray, k: int, layout: np.ndarray | None) -> float:
        """The k-th best priced step among ``idx`` (inf if fewer), or the best of another layout if larger."""
        done = self.done[idx]
        got, at = self.step[idx[done]], idx[done]
        if len(got) < k:
            return float("inf")
        limit = float(np.partition(got, k - 1)[k - 1])
        if layout is not None:
            others = layout[at] != layout[at[np.argmin(got)]]
            limit = max(limit, float(got[others].min()) if others.any() else float("inf"))
        return limit

    @property
    def priced(self) -> int:
        """Candidates whose step has been computed."""
        return int(self.done.sum())


def recompute_table(space: Space) -> tuple[np.ndarray, np.ndarray]:
    """The (recompute code, recompute_every) pairs in ``space`` as rows, (none, 1) first (the no-recompute base of
    the breakdown), and each candidate's row: the mid-level terms are priced once per pair (O(n), no sort)."""
    r, k = space.cands["recompute"], space.cands["recompute_every"]
    width = int(k.max()) + 1 if len(k) else 2
    codes = r * width + k
    present = np.union1d([1], np.flatnonzero(np.bincount(codes, minlength=2)))  # code 1 = (none, 1)
    lut = np.zeros(int(present[-1]) + 1, dtype=np.int64)
    lut[present] = np.arange(len(present))
    return np.stack([present // width, present % width], axis=1), lut[codes]


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


def _runtime_terms(model: ModelSpec, hw: C.Hardware, space: Space) -> dict[str, np.ndarray] | None:
    """The runtime's fixed costs per candidate by term (cost.runtime_fixed_time) on the busiest rank: the
    first pipeline stage (ceil(L/pp) blocks, plus the embedding's FSDP unit); None when none is measured and
    none is priced from the device (cost.fsdp_unit_seconds)."""
    rt = hw.runtime
    if not any(rt.figures().values()) and not C.fsdp_unit_seconds(hw):
        return None
    K, M, Cn, D, Lt = space.keys, space.mids, space.cands, space.dpcs, space.layouts
    mid = Cn["mid"]
    key = M["key"][mid]
    lay = K["layout"][key]
    tp, pp, cp, dp, ep = (Lt[n][lay].astype(float) for n in ("tp", "pp", "cp", "dp", "ep"))
    ga, vpp = K["ga"][key].astype(float), M["vpp"][mid].astype(float)
    zero = D["zero"][Cn["dpc"]]
    slots = ga + C.bubble_fraction(pp, ga, vpp, M["schedule"][mid]) * ga  # micro-batches plus fill and drain
    if model.unit_form:
        n_units = float(sum(1 for u in model.units if u.params > 0))
        blocks, moe_blocks, units = np.ceil(n_units / pp), 0.0 * pp, np.ceil(n_units / pp)
        has_moe = False
    else:
        blocks = np.ceil(model.layers / pp)
        moe_blocks = np.ceil(model.moe_layers / pp)
        units = blocks + 1.0  # the stage's blocks and its root (embedding / norm / head)
        has_moe = model.moe_layers > 0
    plain_ddp = runs_plain_ddp(zero, dp, tp, pp, ep, cp, has_moe)
    grad_bytes = 4.0 * model.total_params() / (tp * pp)  # fp32 gradients (GRAD_REDUCE_BYTES), the rank's share
    return C.runtime_fixed_time(hw, slots, zero, ~plain_ddp, units, blocks, moe_blocks, tp, pp, vpp, ep, dp,
                                grad_bytes, M["schedule"][mid])


def _transformer_terms(model: ModelSpec, hw: C.Hardware, space: Space, seq: int, measured: Measured | None,
                       fused: bool, opts: np.ndarray) -> tuple[dict[str, list], dict[str, list]]:
    """Per representative rank: mid-level (time, memory per recompute mode) and dpc-level (DP traffic, states) terms."""
    m = model
    Lt, K, M, D = space.layouts, space.keys, space.mids, space.dpcs
    f = lambda a: a.astype(float)  # noqa: E731

    # ---- key level: one block, embedding, head and their traffic per micro-batch
    kl = K["layout"]
    tp, pp, cp, dp, ep = (f(Lt[n][kl]) for n in ("tp", "pp", "cp", "dp", "ep"))
    mbs, ga, sp, prec = f(K["mbs"]), f(K["ga"]), K["sp"].astype(bool), K["precision"]
    # fp8-mixed: GEMMs at the fp8 rate (fp8), the attention core, the LM head and the rest at bf16 (peak)
    peak, elem, fp8 = hw.peak[C.BASE_PREC[prec]], C.ACT_BYTES[prec], prec == C.FP8
    has_moe = m.moe_layers > 0

    def blocks(h: C.Hardware) -> tuple[C.BlockTimes, C.BlockTimes]:
        dense = C.dense_block_time(h, m, mbs, seq, tp, cp, sp, peak, elem, fused, fp8)
        return dense, (C.moe_block_time(h, m, mbs, seq, tp, cp, ep, sp, peak, elem, fused, fp8) if has_moe else dense)

    dense, moe = blocks(hw)
    comp = K["compile"].astype(bool)
    if comp.any():  # plan.compile: the blocks priced compiled (cost.compiled_block_time)
        fz_dense, fz_moe = blocks(C.compile_hardware(hw)) if hw.compile_fuses else (None, None)
        dense, moe = C.compiled_block_time(hw, dense, fz_dense, comp), C.compiled_block_time(hw, moe, fz_moe, comp)
    emb_f, emb_b = C.embedding_time(hw, m, mbs, seq, cp, elem, tp)
    head_f, head_b = C.head_time(hw, m, mbs, seq, tp, cp, peak, elem)
    modes = range(len(RECOMPUTE_MODES))
    act = [C.activation_bytes_per_block(m, mbs, seq, tp, sp, cp, mode, elem, fused) for mode in modes]
    act_moe = ([C.activation_bytes_per_block(m, mbs, seq, tp, sp, cp, mode, elem, fused, moe=True)
                for mode in modes] if has_moe else act)
    ops_rc = C.ops_recompute_time(hw, m, mbs, seq, tp, cp, sp, peak, elem, fp8)  # dense blocks (ops_rule: no MoE)
    if measured is not None:
        dense, moe, emb_f, emb_b, head_f, head_b, act, act_moe = _apply_measured(
            measured, m, hw, seq, fused, dense, moe, emb_f, emb_b, head_f, head_b, act, act_moe)
    tp_f, tp_b = C.tp_comm_per_block(hw, m, mbs, seq, tp, cp, elem)
    if hw.compile_fuses and comp.any():  # async TP: compiled blocks with tp > 1 and SP on a GPU preset
        tp_f, tp_b = C.async_tp_exposed(hw, tp_f, tp_b, dense, tp, comp & sp & (tp > 1))
    tp_edge = C.allreduce_time(hw, mbs * seq / cp * m.hidden * elem, tp, 1)  # embedding fwd / head bwd
    cp_f, cp_b = C.cp_comm_per_block(hw, m, mbs, seq, tp, cp, elem)
    zero_k = np.zeros_like(tp)
    ep_f, ep_b = C.ep_comm_per_block(hw, m, mbs, seq, tp, cp, ep, sp, elem) if has_moe else (zero_k, zero_k)
    p2p_inter = np.full(len(tp), hw.nodes > 1)  # pp is the outermost mesh dim: some stage boundary crosses nodes
    p2p = C.p2p_time(hw, mbs * seq / cp * m.hidden * elem / np.where(sp, tp, 1), p2p_inter)
    buf_last = C.logits_bytes(m, mbs, seq, tp, cp, elem)
    buf_moe = 2 * mbs * seq / cp / np.where(sp, tp, 1) * m.top_k * m.hidden * elem if has_moe else zero_k
    buf_p2p = np.where(pp > 1, 2 * mbs * seq / cp * m.hidden * elem, 0.0)

    # ---- mid level (key x schedule/vpp): stage contents, per-micro-batch time and activations per rank
    mk = M["key"]
    g = lambda a: np.asarray(a)[mk] if np.ndim(a) else np.full(len(mk), float(a))  # noqa: E731
    vpp_m, sched_m = f(M["vpp"]), M["schedule"]
    reps_m = _stage_reps(m, hw, space, seq, fused, Lt["pp"][kl][mk], M["vpp"], M["schedule"])
    pp_m, ga_m = g(pp), g(ga)
    p2p_mb = np.where(pp_m > 1, 2 * vpp_m * g(p2p), 0.0)
    mid = {name: [] for name in ("tf", "tb", "base", "mem")}
    frag = 1 + C.FRAGMENTATION
    for r in range(N_REP):
        nd, nm, he, hh, stage = (reps_m[:, r, j] for j in range(5))
        nb = nd + nm
        tf = nd * g(dense.fwd) + nm * g(moe.fwd) + he * g(emb_f) + hh * g(head_f)
        tb = nd * g(dense.bwd) + nm * g(moe.bwd) + he * g(emb_b) + hh * g(head_b)
        comm = nb * g(tp_f + tp_b + cp_f + cp_b) + nm * g(ep_f + ep_b) + (he + hh) * g(tp_edge) + p2p_mb
        comm_rc = nb * g(tp_f + cp_f) + nm * g(ep_f)  # full and ops recompute re-run the forward's collectives
        trc = [0.0 * tf, nd * g(dense.attn_fwd) + nm * g(moe.attn_fwd), nd * g(dense.fwd) + nm * g(moe.fwd) + comm_rc,
               nb * g(ops_rc) + comm_rc]
        inflight = C.inflight_microbatches(sched_m, pp_m, vpp_m, ga_m, stage)
        bufs = hh * g(buf_last) + np.where(nm > 0, g(buf_moe), 0.0) + g(buf_p2p)
        one_layer = np.where(nm > 0, g(act_moe[0]), g(act[0]))  # full recompute rebuilds one block at a time
        mid["tf"].append(tf)
        mid["tb"].append(tb)
        kept = [nd * g(act[i]) + nm * g(act_moe[i]) for i in modes]
        base, mem = _mix_options(opts, nb, tf + tb + comm, trc, inflight, kept, bufs, one_layer, frag)
        mid["base"].append(base)
        mid["mem"].append(mem)

    # ---- dpc level (layout x precision x schedule/vpp x zero/dp_shard): data-parallel traffic and model states
    dl = D["layout"]
    tp_d, pp_d, cp_d, dp_d, ep_d = (f(Lt[n][dl]) for n in ("tp", "pp", "cp", "dp", "ep"))
    zero, prec_d = D["zero"], D["precision"]
    ds = np.where(D["dp_shard"] > 0, D["dp_shard"], Lt["dp"][dl]).astype(float)
    reps_d = _stage_reps(m, hw, space, seq, fused, Lt["pp"][dl], D["vpp"], D["schedule"])
    p_dense_blk = m.block_params() / tp_d
    p_moe_shared = (m.attention_params() + 4 * m.hidden + m.hidden * m.experts) / tp_d
    p_moe_expert = m.mlp_params() * m.experts / (tp_d * ep_d) if has_moe else 0.0 * tp_d
    p_emb = m.vocab * m.hidden / tp_d
    # LM head + final norm; a tied head shares the embedding on one stage, Megatron keeps a copy on the last one
    p_head = np.where(m.tied_embeddings & (pp_d == 1), 0.0, m.vocab * m.hidden / tp_d) + 2 * m.hidden
    unit = np.maximum(p_dense_blk, p_moe_shared + p_moe_expert if has_moe else 0.0)
    dpc: dict[str, list] = {name: [] for name in DPC_TERMS}
    for r in range(N_REP):
        nd, nm, he, hh, _ = (reps_d[:, r, j] for j in range(5))
        p_d = nd * p_dense_blk + nm * p_moe_shared + he * p_emb + hh * p_head
        p_e = nm * p_moe_expert
        # one FSDP unit per block plus one for the stage's embedding / norm / head: the first unit's gather and
        # the last unit's reduction have no compute to hide behind
        edge = he * p_emb + hh * p_head
        tail = np.minimum(1.0, np.where(edge > 0, edge, unit) / np.maximum(p_d + p_e, 1.0))
        _dp_rank_terms(hw, dpc, zero, prec_d, dp_d, cp_d, tp_d, ep_d, ds, p_d, p_e, unit, tail, pp_d, D["offload"])
    return mid, dpc


def _unit_terms(model: ModelSpec, hw: C.Hardware, space: Space, seq: int, measured: Measured | None,
                fused: bool, opts: np.ndarray) -> tuple[dict[str, list], dict[str, list]]:
    """Unit form: per representative rank, the sums over its units of time, saved activations and parameters.

    tp = cp = ep = 1 (space.py offers no other); per micro-batch the rank runs its units' forward and backward
    (cost.unit_time), the SyncBatchNorm collectives of its BatchNorm units when dp > 1, and with pp > 1 sends and
    receives its boundary tensor (forward activation, backward gradient). Full recompute keeps each unit's input
    and rebuilds one unit's activations at a time (the rank's largest), re-running the forward and its SyncBN.
    """
    u = C.UnitArrays.of(model)
    Lt, K, M, D = space.layouts, space.keys, space.mids, space.dpcs
    f = lambda a: a.astype(float)  # noqa: E731
    frag = 1 + C.FRAGMENTATION

    # ---- key level (layout x mbs x precision): every unit's time and saved bytes per micro-batch
    kl = K["layout"]
    pp, dp = f(Lt["pp"][kl]), f(Lt["dp"][kl])
    mbs, ga, prec = f(K["mbs"]), f(K["ga"]), K["precision"]
    peak, elem = hw.peak[C.BASE_PREC[prec]], C.ACT_BYTES[prec]  # units do not single out their GEMMs: fp8-mixed at bf16
    uf, ub = C.unit_time(hw, u, mbs, peak, elem)
    if K["compile"].any():  # plan.compile: a measured speed-up only (units have no fused-traffic model)
        units = C.compiled_block_time(hw, C.BlockTimes(uf, ub, 0.0 * uf), None, K["compile"].astype(bool)[:, None])
        uf, ub = units.fwd, units.bwd
    act = [C.unit_activation_bytes(u, mbs, elem, mode) for mode in range(len(RECOMPUTE_MODES))]
    if measured is not None:
        uf, ub, act = _apply_measured_units(measured, model, u, hw, uf, ub, act)
    sel = C.unit_selective_time(hw, u, mbs, elem)
    ops_rc = C.unit_selective_time(hw, u, mbs, elem, every_unit=True)
    bn_f, bn_b = C.sync_batchnorm_time(hw, dp)

    # ---- mid level (key x schedule/vpp): sums over each representative rank's units
    mk = M["key"]
    vpp_m, sched_m, pp_m, ga_m = f(M["vpp"]), M["schedule"], pp[mk], ga[mk]
    masks, rows = _unit_reps(model, u, hw, space, Lt["pp"][kl][mk], M["vpp"])
    uf_m, ub_m, sel_m, ops_m, act_m = uf[mk], ub[mk], sel[mk], ops_rc[mk], [a[mk] for a in act]
    mid: dict[str, list] = {name: [] for name in ("tf", "tb", "base", "mem")}
    for r in range(N_REP):
        w, stage = masks[:, r, :], rows[:, r, 0]
        boundary = rows[:, r, 1] * mbs[mk] * elem[mk] / 4.0
        tf, tb = (uf_m * w).sum(axis=1), (ub_m * w).sum(axis=1)
        n_bn = w @ u.batchnorm.astype(float)
        p2p = np.where(pp_m > 1, 2 * vpp_m * C.p2p_time(hw, boundary, hw.nodes > 1), 0.0)
        comm = n_bn * (bn_f[mk] + bn_b[mk]) + p2p
        trc = [0.0 * tf, (sel_m * w).sum(axis=1), tf + n_bn * bn_f[mk], (ops_m * w).sum(axis=1) + n_bn * bn_f[mk]]
        inflight = C.inflight_microbatches(sched_m, pp_m, vpp_m, ga_m, stage)
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
        tail = np.minimum(1.0, rows_d[:, r, 2] / np.maximum(p_d, 1.0))
        _dp_rank_terms(hw, dpc, D["zero"], D["precision"], dp_d, cp_d, tp_d, ep_d, ds, p_d, 0.0 * p_d, unit, tail,
                       f(Lt["pp"][dl]), D["offload"])
    return mid, dpc


def _apply_measured_units(meas: Measured, model: ModelSpec, u: C.UnitArrays, hw: C.Hardware, uf: np.ndarray,
                          ub: np.ndarray, act: list) -> tuple[np.ndarray, np.ndarray, list]:
    """Unit form: measured blocks named like units replace those units' terms, scaled by the analytic ratio."""
    ref_prec = PRECISIONS.index(meas.precision)
    rf, rb = C.unit_time(hw, u, float(meas.mbs), hw.peak[ref_prec], C.ACT_BYTES[ref_prec])
    ra = C.unit_activation_bytes(u, float(meas.mbs), C.ACT_BYTES[ref_prec], 0)
    uf, ub, act = uf.copy(), ub.copy(), [a.copy() for a in act]
    for j, unit in enumerate(model.units):
        got = meas.blocks.get(unit.name)
        if got is None:
            continue
        uf[:, j] = C.scaled_measure(got.fwd_s, uf[:, j], float(rf[j]))
        ub[:, j] = C.scaled_measure(got.bwd_s, ub[:, j], float(rb[j]))
        if got.activation_bytes:
            act[0][:, j] = act[1][:, j] = C.scaled_measure(got.activation_bytes, act[0][:, j], float(ra[j]))
    return uf, ub, act


DPC_TERMS = ("a1", "b1", "a2", "b2", "a3", "b3", "c3", "opt", "mem", "mb", "m_params", "m_grads", "m_optim", "host")


def runs_plain_ddp(zero: Any, dp: Any, tp: Any, pp: Any, ep: Any, cp: Any, has_moe: Any) -> np.ndarray:
    """Whether the runtime runs plain DDP (parallel.apply: zero 0, data parallelism alone, no MoE layers) rather
    than FSDP2: their collectives and memory differ (cost.runtime_fixed_time, ddp_bucket_bytes)."""
    return ((np.asarray(zero) == 0) & (np.asarray(dp) > 1) & (np.asarray(tp) == 1) & (np.asarray(pp) == 1)
            & (np.asarray(ep) == 1) & (np.asarray(cp) == 1) & ~np.asarray(has_moe, dtype=bool))


def _dp_rank_terms(hw: C.Hardware, dpc: dict[str, list], zero: np.ndarray, prec_d: np.ndarray, dp_d: np.ndarray,
                   cp_d: np.ndarray, tp_d: np.ndarray, ep_d: np.ndarray, ds: np.ndarray, p_d: np.ndarray,
                   p_e: np.ndarray, unit: np.ndarray, tail: np.ndarray, pp: Any = 1.0, offload: Any = 0) -> None:
    """Append one representative rank's data-parallel traffic, parameter work and model-state memory to ``dpc``.

    ``p_d`` / ``p_e``: dense / expert parameters on the rank; ``unit``: the largest FSDP unit (zero-3 gather
    buffers); ``tail``: the share of the rank's gather/reduction that no compute hides (first / last unit);
    ``pp``: the pipeline degree (a pipeline stage keeps its FSDP parameters gathered from one micro-batch's
    backward to the next one's forward: torch.distributed.pipelining turns reshard_after_backward off until the
    step's last); ``offload``: the OFFLOAD_MODES code (model states on the host: cost.offloaded_state_bytes, their
    copies and the host optimizer step: offload_copy_time, host_optimizer_step_time).
    """
    frag = 1 + C.FRAGMENTATION
    # context parallelism: FSDP runs over dp x cp (parallel/context.data_mesh, torchtitan's dp_shard_cp); at zero 0
    # it replicates over dp and shards over cp, parameters kept gathered through the step: zero 2 over cp
    cp_zero0 = (zero == 0) & (cp_d > 1)
    ddp = runs_plain_ddp(zero, dp_d, tp_d, pp, ep_d, cp_d, np.asarray(p_e) > 0)  # else FSDP2: other buffers
    fsdp = ~ddp & (dp_d * cp_d > 1)
    zero, ds = np.where(cp_zero0, 2, zero), np.where(cp_zero0, 1.0, ds)
    wbytes = C.WEIGHT_BYTES[prec_d]
    gbytes = C.GRAD_REDUCE_BYTES[prec_d]  # gradients travel in fp32, parameters in the compute precision
    shard = ds * cp_d
    exp_shard = np.maximum(shard / ep_d, 1)
    replicas = dp_d / ds
    z1, z2, z3 = zero == 1, zero == 2, zero == 3
    grad_d, grad_e = p_d * gbytes, p_e * gbytes
    rs = C.reduce_scatter_time(hw, grad_d, shard, tp_d) + C.reduce_scatter_time(hw, grad_e, exp_shard, tp_d * ep_d)
    ag = (C.allgather_time(hw, p_d * wbytes, shard, tp_d)
          + C.allgather_time(hw, p_e * wbytes, exp_shard, tp_d * ep_d))
    ar = (C.allreduce_time(hw, grad_d, dp_d * cp_d, tp_d)
          + C.allreduce_time(hw, grad_e, np.maximum(dp_d * cp_d / ep_d, 1), tp_d * ep_d))
    hsdp = np.where(replicas > 1, C.allreduce_time(hw, grad_d / shard + grad_e / exp_shard, replicas,
                                                   ds * cp_d * tp_d), 0.0)
    local = np.where(zero == 0, p_d + p_e, p_d / shard + p_e / exp_shard)
    # offload: the host-link copies ride with the gathers (shard copy-in) and the reductions (gradient copy-out),
    # prefetched and overlapped as those are; the updated parameters' copy back is exposed (with the step)
    h2d_gather, d2h_reduce, h2d_step = C.offload_copy_time(hw, local, prec_d, offload)
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
    dpc["a1"].append(np.where(z3 & ~staged, ag, 0.0))
    dpc["b1"].append(np.where(z3 & ~staged, ag * tail, 0.0))
    dpc["a2"].append(np.where(z3, ag, 0.0))
    dpc["b2"].append(np.where(z3, ag * tail, 0.0))
    dpc["a3"].append(once)
    dpc["b3"].append(once * tail)
    dpc["c3"].append(np.where(z1 | z2, ag, 0.0))
    # memory-bound parameter work: per micro-batch the fp32 gradient accumulation (every zero: unsharded gradients
    # accumulate locally until the step's reduction) and, for zero 3, two gathers' copy-in/out; per step the
    # reduction's cast and accumulation (zero 1-3) and zero 1/2's one gather copy
    copies = lambda g, red: (C.shard_copy_time(hw, p_d, shard, prec_d, g, red)  # noqa: E731
                             + C.shard_copy_time(hw, p_e, exp_shard, prec_d, g, red))
    dpc["mb"].append(C.grad_accumulate_time(hw, p_d + p_e, prec_d) + np.where(z3, copies(2.0, 0.0), 0.0))
    step_on = np.where(np.asarray(offload) > 0, C.host_optimizer_step_time(hw, local, prec_d),
                       C.optimizer_time(hw, local, prec_d))
    dpc["opt"].append(step_on + h2d_step + np.where(zero > 0, copies(np.where(z1 | z2, 1.0, 0.0), 1.0), 0.0))
    # the runtime runs ZeRO-1 as ZeRO-2 (FSDP2 reduce-scatters the gradients; parallel/fsdp.py): priced so
    held = np.where(z1, 2, zero)
    parts = [a + b for a, b in zip(C.model_state_parts(p_d, held, shard, prec_d),
                                   C.model_state_parts(p_e, held, exp_shard, prec_d))]
    replicated = zero == 0  # zero 0 on FSDP2: a (dp_replicate, dp_shard=1) mesh, the parameters whole
    shard_copy = C.fsdp_shard_copy_bytes(p_d, zero, np.where(replicated, 1.0, shard), prec_d, fsdp) \
        + C.fsdp_shard_copy_bytes(p_e, zero, np.where(replicated, 1.0, exp_shard), prec_d, fsdp)
    parts[0] = parts[0] + shard_copy
    moved = C.offloaded_state_bytes(*parts, shard_copy, zero, offload)
    copies_w, copies_g = C.host_step_copy_bytes(local, prec_d, offload)
    if hw.host_link:  # a host of its own: the moved states leave the device (else they stay: nothing is saved)
        parts = [part - out for part, out in zip(parts, moved)]
        dpc["host"].append(sum(moved) + copies_w + copies_g)
    else:  # the host step's copies are more of the same memory
        parts[0], parts[1] = parts[0] + copies_w, parts[1] + copies_g
        dpc["host"].append(0.0 * local)
    states = sum(parts)
    for name, part in zip(("m_params", "m_grads", "m_optim"), parts):
        dpc[name].append(part)
    fsdp_bufs = np.where(fsdp, C.fsdp_buffer_bytes(unit, zero, prec_d), 0.0)
    bufs = np.where(ddp, C.ddp_bucket_bytes(grad_d + grad_e), fsdp_bufs)
    dpc["mem"].append(states + bufs * frag + hw.reserved)


def _assemble(t: Tables, detail: bool) -> dict[str, np.ndarray]:
    """Combine the mid- and dpc-level terms of every candidate: step time, memory and (``detail``) the breakdown."""
    hw, mid, n_opts, cm = t.hw, t.mid, t.n_opts, t.cm
    by_rc, by_mid, by_dpc, f_sm, span, mrc, cd = t.by_rc, t.by_mid, t.by_dpc, t.f_sm, t.span, t.mrc, t.cd
    n = len(cm)
    step, memory, host = np.empty(n), np.empty(n), np.empty(n)
    for lo in range(0, n, CHUNK):
        sl = slice(lo, min(lo + CHUNK, n))
        step[sl], memory[sl], host[sl] = t.step_memory(sl)
    out = {"step": step, "memory": memory, "host": host}
    if detail:
        rows = np.arange(n)
        a, b, d = by_rc[mrc].astype(float), by_mid[cm].astype(float), by_dpc[cd].astype(float)
        worst = slot_of(a, b, d, f_sm).argmax(axis=1)
        w = lambda arr: arr[rows, worst]  # noqa: E731  the slowest rank's value
        ga_c, span_c = t.ga_m[cm], span[cm].astype(float)
        slot = w(slot_of(a, b, d, f_sm))
        out["bubble"] = (span_c - ga_c) * slot
        out["compute"] = ga_c * w(np.stack(mid["tf"], 1)[cm] + np.stack(mid["tb"], 1)[cm] + d[..., 9]) + w(d[..., 7])
        base0 = by_rc[cm * n_opts][..., 0].astype(float)  # the same mid without recompute (row 0)
        out["recompute"] = ga_c * (w(a[..., 0]) - w(base0))  # with the collectives full recompute re-runs
        out["comm"] = step - out["compute"] - out["recompute"] - out["bubble"]  # TP/CP/EP/PP/DP exposed
        out["memory_terms"] = _memory_terms(hw, a, d, rows)
    return out


def _memory_terms(hw: C.Hardware, a: np.ndarray, d: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Bytes by term on the rank with the largest memory: parameters, gradients, optimizer states (ZeRO model
    states + FSDP2's shard copy), activations (saved activations, logits, pipeline and MoE buffers, with the
    fragmentation margin: the mid level), buffers (DDP buckets / FSDP2 gather and reduce-scatter buffers, with
    the margin) and the cluster's reserved memory; they sum to the candidate's memory."""
    top = (a[..., 1] + d[..., 8]).argmax(axis=1)
    at = lambda arr: arr[rows, top]  # noqa: E731
    terms = {"parameters": at(d[..., 10]), "gradients": at(d[..., 11]), "optimizer": at(d[..., 12]),
             "activations": at(a[..., 1])}
    terms["buffers"] = at(d[..., 8]) - terms["parameters"] - terms["gradients"] - terms["optimizer"] - hw.reserved
    terms["reserved"] = np.full(len(rows), hw.reserved)
    return terms


def max3(x: np.ndarray) -> np.ndarray:
    """Max over the representative-rank axis (axis 1, length 3): elementwise, faster than a small-axis reduce."""
    return np.maximum(np.maximum(x[:, 0], x[:, 1]), x[:, 2])


def slot_of(a: np.ndarray, b: np.ndarray, d: np.ndarray, f_sm: float = 0.0) -> np.ndarray:
    """Per-rank micro-batch slot: base (compute, recompute, TP/CP/EP/PP traffic) + memory-bound parameter work + exposed
    DP traffic per micro-batch (b holds the forward and backward windows that can hide it; cost.overlapped_exposed)."""
    tf, tb = b[..., 0], b[..., 1]
    return (a[..., 0] + d[..., 9] + C.overlapped_exposed(d[..., 0], tf, d[..., 1], f_sm)
            + C.overlapped_exposed(d[..., 2], tb, d[..., 3], f_sm))


def _apply_measured(meas: Measured, m: ModelSpec, hw: C.Hardware, seq: int, fused: bool, dense, moe,
                    emb_f, emb_b, head_f, head_b, act, act_moe):
    """Replace analytic block terms by measured ones, scaled to each key by the analytic ratio (cost.scaled_measure)."""
    ref_prec = PRECISIONS.index(meas.precision)
    peak, elem = hw.peak[ref_prec], C.ACT_BYTES[ref_prec]
    b, s = meas.mbs, meas.seq_len
    blocks = meas.blocks
    ref_dense = C.dense_block_time(hw, m, b, s, 1, 1, False, peak, elem, fused)

    def scale_block(now: C.BlockTimes, ref: C.BlockTimes, got: BlockMeasure | None) -> C.BlockTimes:
        if got is None:
            return now
        f = C.scaled_measure(got.fwd_s, now.fwd, float(ref.fwd))
        return C.BlockTimes(f, C.scaled_measure(got.bwd_s, now.bwd, float(ref.bwd)),
                            C.scaled_measure(got.fwd_s, now.attn_fwd, float(ref.fwd)))

    dense_new = scale_block(dense, ref_dense, blocks.get("dense"))
    moe_new = moe
    if m.moe_layers:
        ref_moe = C.moe_block_time(hw, m, b, s, 1, 1, 1, False, peak, elem, fused)
        moe_new = scale_block(moe, ref_moe, blocks.get("moe"))
    else:
        moe_new = dense_new
    if "embedding" in blocks:
        rf, rb = C.embedding_time(hw, m, b, s, 1, elem)
        emb_f = C.scaled_measure(blocks["embedding"].fwd_s, emb_f, float(rf))
        emb_b = C.scaled_measure(blocks["embedding"].bwd_s, emb_b, float(rb))
    if "head" in blocks:
        rf, rb = C.head_time(hw, m, b, s, 1, 1, peak, elem)
        head_f = C.scaled_measure(blocks["head"].fwd_s, head_f, float(rf))
        head_b = C.scaled_measure(blocks["head"].bwd_s, head_b, float(rb))

    def scale_act(acts: list, kind: str, is_moe: bool) -> list:
        got = blocks.get(kind)
        if got is None or not got.activation_bytes:
            return acts
        ref = float(C.activation_bytes_per_block(m, b, s, 1, False, 1, 0, elem, fused, moe=is_moe))
        return [C.scaled_measure(got.activation_bytes, a, ref) for a in acts]

    act = scale_act(act, "dense", False)
    act_moe = scale_act(act_moe, "moe", True) if m.moe_layers else act
    return dense_new, moe_new, emb_f, emb_b, head_f, head_b, act, act_moe


# ============================================================================================ assembling results


def priced_plan(model: ModelSpec, cluster: ClusterSpec, hw: C.Hardware, space: Space, costs: dict[str, np.ndarray],
                i: int, global_batch: int, seq: int, limit: float) -> PricedPlan:
    """The PricedPlan (contract fields) of candidate ``i``."""
    plan = space.plan(i)
    step = float(costs["step"][i])
    prec = PRECISIONS.index(plan.precision)
    if model.unit_form:  # a sample is one batch row (seq 1): samples/s in tokens_per_s
        model_flops = global_batch * C.unit_model_flops_per_sample(model)
    else:
        model_flops = global_batch * seq * C.model_flops_per_token(model, seq)
    per_device = model_flops / step / cluster.world_size
    memory = float(costs["memory"][i])
    host = float(costs["host"][i])
    host_limit = host_limit_bytes(cluster)
    feasible = memory <= limit and host <= host_limit
    reason = "" if memory <= limit else (f"memory: needs {memory / C.GIB:.2f} GiB per device > "
                                         f"{limit / C.GIB:.2f} GiB allowed")
    if host > host_limit:
        reason = "; ".join(r for r in (reason, f"host memory: offload={plan.offload} keeps {host / C.GIB:.2f} GiB "
                                       f"per device on the host > host_memory_gib {host_limit / C.GIB:.2f} GiB") if r)
    chunks: list[int] = []
    if plan.pp > 1:
        weights, emb_w, head_w = layer_weights(model, hw, seq, prec, True)
        chunks = stage_chunks(weights, emb_w, head_w, plan.pp, plan.vpp, space.uneven)
    return PricedPlan(
        plan=plan,
        step_time_s=step,
        tokens_per_s=global_batch * seq / step,
        model_tflops_per_device=per_device / 1e12,
        mfu=per_device / float(hw.peak[prec]),
        memory_gib_per_device=memory / C.GIB,
        breakdown=Breakdown(compute_s=float(costs["compute"][i]), recompute_s=float(costs["recompute"][i]),
                            comm_exposed_s=float(costs["comm"][i]), bubble_s=float(costs["bubble"][i]),
                            runtime_s=float(costs["runtime"][i]) if "runtime" in costs else 0.0,
                            terms={k: float(v[i]) for k, v in costs.get("terms", {}).items()}),
        memory_breakdown={k: float(v[i]) / C.GIB for k, v in costs.get("memory_terms", {}).items()},
        host_gib_per_device=host / C.GIB,
        feasible=feasible,
        reason=reason,
        layers_per_stage=chunks,
    )


def host_limit_bytes(cluster: ClusterSpec) -> float:
    """Host bytes per device that offloaded model states may take: DeviceSpec.host_memory_gib where the device has
    a host of its own (host_link_gbs > 0; 0 GiB there refuses any offload), else unbounded (nothing is moved)."""
    dev = cluster.device
    return dev.host_memory_gib * C.GIB if dev.host_link_gbs > 0 else float("inf")


def fits(costs: dict[str, np.ndarray], limit: float, host_limit: float) -> np.ndarray:
    """Candidates within the device memory limit and the host memory limit (offloaded states)."""
    return (costs["memory"] <= limit) & (costs["host"] <= host_limit)


def _inputs(model: Any, cluster: Any, global_batch: int | None, seq_len: int | None):
    spec = resolve_model(model, seq_len)
    clus = load_cluster_spec(cluster)
    seq = 1 if spec.unit_form else int(seq_len or spec.seq_len)  # unit form: a sample is one row, seq_len unused
    if seq <= 0:
        raise ConfigError("seq_len", f"must be a positive integer, got {seq_len!r}")
    if global_batch is not None and (not isinstance(global_batch, (int, np.integer)) or global_batch <= 0):
        raise ConfigError("global_batch", f"must be a positive integer, got {global_batch!r}")
    return spec, clus, seq


def plan(model: Any, cluster: Any, global_batch: int, seq_len: int | None = None, fix: Any = None, top: int = 10,
         precision: str | Sequence[str] | None = None, restrict: Mapping[str, Sequence] | None = None,
         measured: Any = None, memory_fraction: float = 0.9, allow_infeasible: bool = False,
         explain_choice: bool = True, exhaustive: bool = False) -> PlanReport:
    """Search the whole plan space; return the top feasible plans, ranked fastest first, with an explanation.

    ``allow_infeasible``: when nothing fits, return the least-memory plans flagged instead of raising
    InfeasibleError (the CLI does this for ``--fix`` so a fixed plan that does not fit is still priced).
    Memory is computed for every candidate; step times only where one can rank (Tables.steps: a lower bound per
    pipeline configuration against the k-th best found). ``exhaustive``: price every step instead (the same
    result, slower; tests compare the two).
    """
    start = time.perf_counter()
    spec, clus, seq = _inputs(model, cluster, global_batch, seq_len)
    if not 0 < memory_fraction <= 1:
        raise ConfigError("memory_fraction", f"must be in (0, 1], got {memory_fraction}")
    fixed = parse_fix(fix)
    precisions = resolve_precisions(clus, precision)
    meas = Measured.coerce(measured)
    space = enumerate_space(spec, clus.world_size, global_batch, seq, precisions, fixed, restrict,
                            host_offload=clus.device.host_link_gbs > 0)
    if space.size == 0:
        reasons = ", ".join(f"{k} ({v})" for k, v in space.rejected.most_common(3)) or "restrict leaves no values"
        field = "fix" if fixed else "restrict" if restrict else "global_batch"
        raise ConfigError(field, f"no valid plan for {clus.world_size} devices, global batch {global_batch}, "
                          f"seq {seq}: rejected by {reasons}",
                          "loosen fix/restrict, or pick a global batch / device count with more divisors")
    hw = C.Hardware.from_cluster(clus)
    limit, host_limit = hw.capacity * memory_fraction, host_limit_bytes(clus)
    tables = Tables.of(spec, hw, space, seq, meas)
    memory, host = tables.memory_host()
    ok = (memory <= limit) & (host <= host_limit)
    layout = space.keys["layout"][space.mids["key"]][space.cands["mid"]]
    costs = {"memory": memory, "host": host, "step": tables.steps(ok, max(top, 1), layout, exhaustive)}
    rejected = dict(space.rejected)
    n_mem = int((costs["memory"] > limit).sum())
    if n_mem:
        rejected["memory"] = n_mem
    n_host = int(((costs["memory"] <= limit) & (costs["host"] > host_limit)).sum())
    if n_host:
        rejected["host memory (offload)"] = n_host
    feasible = int(ok.sum())
    if feasible:
        idx = np.flatnonzero(ok & np.isfinite(costs["step"]))  # the others cannot rank (Tables.steps)
        order = idx[np.lexsort((costs["memory"][idx], costs["step"][idx]))[:max(top, 1)]]  # ties: less memory
    elif allow_infeasible:
        order = np.argsort(costs["memory"], kind="stable")[:max(top, 1)]
    else:
        raise _infeasible(spec, clus, hw, space, costs, limit, memory_fraction, fixed)
    cands = _priced(spec, clus, hw, space, order, global_batch, seq, limit, meas)
    report = PlanReport(best=cands[0], candidates=cands, evaluated=space.size, feasible=feasible, rejected=rejected,
                        search_seconds=0.0, model=spec, cluster=clus, global_batch=global_batch, seq_len=seq,
                        memory_fraction=memory_fraction)
    report.priced = tables.priced
    if spec.unit_form:
        report.excluded = unit_form_restrict(spec, fixed, restrict or {})[1]
    small = smallest_plan(costs, host_limit)
    report.smallest = cands[0] if small == int(order[0]) else _priced(spec, clus, hw, space, [small], global_batch,
                                                                      seq, limit, meas)[0]
    if feasible:
        report.runner_up = _runner_up(spec, clus, hw, space, costs, ok & (layout != layout[order[0]]), global_batch,
                                      seq, limit, meas)
    if explain_choice and feasible:
        report.explanation = explain(report, lambda c, reprice: _what_if(spec, c, space, tables, costs, seq, meas,
                                                                         memory_fraction, reprice, exhaustive))
        report.priced = tables.priced
    report.search_seconds = time.perf_counter() - start
    return report


def _priced(model: ModelSpec, cluster: ClusterSpec, hw: C.Hardware, space: Space, idx: np.ndarray, global_batch: int,
            seq: int, limit: float, meas: Measured | None) -> list[PricedPlan]:
    """PricedPlans (with the breakdown) for candidates ``idx``, in that order."""
    sub = space.subset(np.asarray(idx, dtype=np.int64))
    costs = price(model, hw, sub, global_batch, seq, meas, detail=True)
    return [priced_plan(model, cluster, hw, sub, costs, j, global_batch, seq, limit) for j in range(sub.size)]


def _runner_up(model: ModelSpec, cluster: ClusterSpec, hw: C.Hardware, space: Space, costs: dict, mask: np.ndarray,
               global_batch: int, seq: int, limit: float, meas: Measured | None) -> PricedPlan | None:
    """Fastest feasible plan whose layout (tp, pp, cp, ep, hence dp) differs from the winner's (``mask``)."""
    if not mask.any():
        return None
    idx = np.flatnonzero(mask)
    return _priced(model, cluster, hw, space, [idx[np.argmin(costs["step"][idx])]], global_batch, seq, limit, meas)[0]


def _what_if(model: ModelSpec, cluster: ClusterSpec, space: Space, tables: Tables, costs: dict, seq: int,
             meas: Measured | None, memory_fraction: float, reprice: bool,
             exhaustive: bool = False) -> tuple[Plan, float] | None:
    """Best (plan, step) on a what-if cluster: a memory-only change reuses the priced tables, a link change
    re-prices (both by the bounded search, Tables.steps)."""
    hw = C.Hardware.from_cluster(cluster)
    ok = fits(costs, hw.capacity * memory_fraction, host_limit_bytes(cluster))
    if not ok.any():
        return None
    if not reprice:
        steps = tables.steps(ok, 1, exhaustive=exhaustive)
        j = int(np.argmin(steps))
        return space.plan(j), float(steps[j])
    if not exhaustive and _same_compute(hw, tables.hw):  # only mids whose compute alone is under a good plan's step
        top = np.flatnonzero(ok & tables.done)
        top = top[np.argsort(tables.step[top], kind="stable")[:8]]
        if len(top):
            best = float(Tables.of(model, hw, space.subset(top), seq, meas).steps(np.ones(len(top), bool), 1).min())
            ok &= (tables.compute_bounds() <= best)[tables.cm]
    idx = np.flatnonzero(ok)
    t = Tables.of(model, hw, space.subset(idx), seq, meas)
    steps = t.steps(np.ones(len(idx), dtype=bool), 1, exhaustive=exhaustive)
    j = int(np.argmin(steps))
    return space.plan(int(idx[j])), float(steps[j])


def _same_compute(a: C.Hardware, b: C.Hardware) -> bool:
    """Whether two hardware views price compute alike (they may differ in links, memory and host): the
    what-ifs' compute bound (Tables.compute_bounds) then holds for both."""
    fields = ("mem_bw", "gemm_eff", "units", "tile", "overhead_s", "attn_fwd", "attn_bwd", "dispatch_s", "conv_eff",
              "fused_ew", "compile_fuses", "runtime", "overlap", "comm_sm")
    return np.array_equal(a.peak, b.peak) and all(getattr(a, f) == getattr(b, f) for f in fields)


def smallest_plan(costs: dict[str, np.ndarray], host_limit: float) -> int:
    """The candidate needing the least device memory among those whose offloaded states fit the host (all of
    them if none does): the whole space searched, recompute (ops, recompute_every) and offload included."""
    memory = np.where(costs["host"] <= host_limit, costs["memory"], np.inf)
    return int(np.argmin(memory if np.isfinite(memory).any() else costs["memory"]))


def relax_hints(model: ModelSpec, cluster: ClusterSpec, smallest: Plan, fraction: float,
                fixed: Mapping[str, Any] | None = None, host_short: bool = False) -> list[str]:
    """What to relax when no plan fits: the pinned fields that hold memory (recompute, offload, zero, mbs), host
    memory where offload plans fit the device but not the host, offload where the cluster names no host, more
    devices, a smaller batch or sequence, a larger memory fraction, a device with more memory."""
    pinned = [k for k in ("recompute", "recompute_every", "offload", "zero", "dp_shard", "mbs", "tp", "pp", "cp")
              if k in (fixed or {})]
    relax = [f"unpin {', '.join(pinned)} (--fix)"] if pinned else []
    if model.unit_form and "grad_accum" in unit_form_restrict(model, {}, {})[1] and smallest.grad_accum == 1:
        relax.append("--fix grad_accum=K (a BatchNorm model keeps 1 unless fixed)")
    if host_short:
        relax.append("more host memory per device (host_memory_gib: offload plans fit the device, not the host)")
    if cluster.device.host_link_gbs <= 0:
        relax.append("a cluster whose devices have host memory (host_link_gbs, host_memory_gib: offload is searched)")
    relax += ["more devices (--nodes)", "a smaller --global-batch" + ("" if model.unit_form else " or --seq-len")]
    if fraction < 0.95:
        relax.append("a larger --memory-fraction")
    relax.append("a device with more memory")
    return relax


def smallest_line(plan: Plan, memory_gib: float, host_gib: float) -> str:
    """'2.50 GiB per device with dp=8 zero=3 ... offload=params (+ 9.1 GiB host)': the smallest plan and its needs."""
    host = f" (+ {host_gib:.2f} GiB per device on the host)" if host_gib else ""
    return f"{memory_gib:.2f} GiB per device{host}, with {plan.short()}"


def _infeasible(model: ModelSpec, cluster: ClusterSpec, hw: C.Hardware, space: Space, costs: dict, limit: float,
                fraction: float, fixed: Mapping[str, Any] | None = None) -> InfeasibleError:
    host_limit = host_limit_bytes(cluster)
    i = smallest_plan(costs, host_limit)
    host_short = bool(((costs["memory"] <= limit) & (costs["host"] > host_limit)).any())
    relax = relax_hints(model, cluster, space.plan(i), fraction, fixed, host_short)
    return InfeasibleError(
        f"no plan fits: the smallest memory any plan needs is "
        f"{smallest_line(space.plan(i), float(costs['memory'][i]) / C.GIB, float(costs['host'][i]) / C.GIB)} "
        f"(capacity {cluster.device.memory_gib:g} GiB x fraction {fraction:g} = {limit / C.GIB:.2f} GiB); "
        f"relax: {', '.join(relax)}")


def estimate(model: Any, cluster: Any, plan: Plan | Mapping | str, global_batch: int | None = None,
             seq_len: int | None = None, measured: Any = None, memory_fraction: float = 0.9) -> PricedPlan:
    """Price one plan (never raises for memory: an over-budget plan is returned with feasible=False)."""
    spec, clus, seq = _inputs(model, cluster, global_batch, seq_len)
    if isinstance(plan, Plan):
        p = plan
    else:
        fields = parse_fix(plan)
        p = Plan(**fields)
        if "dp" not in fields:  # fill dp from the world size when the caller gave only model-parallel degrees
            p.dp = max(1, clus.world_size // (p.tp * p.pp * p.cp))
        if global_batch is not None and "grad_accum" not in fields:
            p.grad_accum = max(1, int(global_batch) // (p.dp * p.mbs))
    gb = int(global_batch) if global_batch is not None else p.global_batch
    p.validate(world_size=clus.world_size, global_batch=gb)
    from lightning_autopar.planner.space import check_fix

    check_fix(spec, clus.world_size, gb, seq, p.to_dict())
    hw = C.Hardware.from_cluster(clus)
    space = space_from_plans([p])
    costs = price(spec, hw, space, gb, seq, Measured.coerce(measured))
    return priced_plan(spec, clus, hw, space, costs, 0, gb, seq, hw.capacity * memory_fraction)
