"""The plan space: every valid combination of the contract's plan fields, as numpy columns.

Candidates are built as factor tables (see Space) so the search prices shared work once per distinct value.
Divisibility rules (contract): heads and kv_heads by tp, experts by ep, global batch by dp*mbs, layers over
pp*vpp (interleaved and interleaved-zb need layers % (pp*vpp) == 0 and micro-batches % pp == 0; zbv and
dualpipev run vpp == 2 chunks per rank in a V with layers % (2*pp) == 0, dualpipev with micro-batches >= 2*pp
(``microbatch_rule``); plain 1F1B/GPipe may split layers unevenly unless ``restrict={"uneven": [False]}``),
seq by 2*cp (load-balanced causal ring attention).
EP groups are carved from the data-parallel ranks (ep divides dp).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

from lightning_autopar.errors import ConfigError
from lightning_autopar.planner.forms import check_unit_fix, form_of, unit_form_restrict  # noqa: F401  re-exported
from lightning_autopar.planner.space_table import (LAYOUT_FIELDS, THINNED_MODES, Grid, GridColumns,  # noqa: F401
                                                   Space)  # Space, LAYOUT_FIELDS, THINNED_MODES re-exported
from lightning_autopar.specs import (CP_KINDS, INTERLEAVED_SCHEDULES, OFFLOAD_MODES, PRECISIONS, RECOMPUTE_MODES, SCHEDULES,
                                      V_SCHEDULES, ModelSpec, Plan)

SPLIT_BACKWARD = ("interleaved-zb",) + V_SCHEDULES  # input and weight gradients in two passes (zero bubble)
# recompute_every searched by default: the mode on every block or on every 2nd (torchtitan's per-layer selective
# AC); offered for full and ops, the modes whose saving is large enough to be worth thinning out. Two values keep
# the space at 6 recompute options (the planner-speed budget, benchmarks/planner_speed.py); restrict
# recompute_every to [1, 2, 4] (or fix it) to search more.
RECOMPUTE_EVERY = (1, 2)
EXTRA_RESTRICT = ("uneven",)  # restrict-only switch: allow uneven pipeline partitions (default True)


@lru_cache(maxsize=None)  # asked per layout for a few distinct n; callers only read the list
def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def space_from_plans(plans: Sequence[Plan], uneven: bool = True) -> Space:
    """A space holding exactly these plans, one row per level each (used by estimate() and tests)."""
    n = len(plans)
    ar = np.arange(n, dtype=np.int64)
    col = lambda f: np.array([f(p) for p in plans], dtype=np.int64)  # noqa: E731
    layouts = {k: col(lambda p, k=k: getattr(p, k)) for k in LAYOUT_FIELDS}
    prec = col(lambda p: PRECISIONS.index(p.precision))
    sched, vpp = col(lambda p: SCHEDULES.index(p.schedule)), col(lambda p: p.vpp)
    keys = {"layout": ar, "mbs": col(lambda p: p.mbs), "sp": col(lambda p: int(p.sp)), "precision": prec,
            "ga": col(lambda p: p.grad_accum), "compile": col(lambda p: int(p.compile)),
            "cp_kind": col(lambda p: CP_KINDS.index(p.cp_kind) if p.cp > 1 else 0)}
    mids = {"key": ar, "schedule": sched, "vpp": vpp}
    dpcs = {"layout": ar, "precision": prec, "schedule": sched, "vpp": vpp, "zero": col(lambda p: p.zero),
            "dp_shard": col(lambda p: 0 if p.dp_shard in (None, p.dp) else p.dp_shard),
            "offload": col(lambda p: OFFLOAD_MODES.index(p.offload))}
    cands = {"mid": ar, "dpc": ar, "recompute": col(lambda p: RECOMPUTE_MODES.index(p.recompute)),
             "recompute_every": col(lambda p: p.recompute_every)}
    return Space(layouts, keys, mids, dpcs, cands, Counter(), uneven)


# ============================================================================================ allowed values


def _allowed(name: str, default: Sequence, fix: Mapping[str, Any], restrict: Mapping[str, Sequence] | None) -> list:
    """Default values of one field, narrowed by ``restrict`` and pinned by ``fix`` (fix wins)."""
    if name in fix:
        return [fix[name]]
    values = list(default)
    if restrict and name in restrict:
        allowed = list(restrict[name])
        if name == "precision":
            from lightning_autopar.specs import _coerce

            allowed = [_coerce("precision", v) for v in allowed]
        values = [v for v in values if v in allowed]
    return values


def check_fix(model: ModelSpec, world: int, global_batch: int, seq_len: int, fix: Mapping[str, Any]) -> None:
    """Reject fixed values that can never form a valid plan, naming the field and the fix (ConfigError)."""
    form_of(model).check_fix(model, fix)
    tp = fix.get("tp")
    if tp is not None:
        for attr in ("heads", "kv_heads"):
            n = getattr(model, attr)
            if n % tp:
                ok = [d for d in divisors(n) if world % d == 0 and (model.heads % d == 0 and model.kv_heads % d == 0)]
                raise ConfigError("fix.tp", f"tp={tp} does not divide {attr}={n}", f"choose tp in {ok}")
    ep = fix.get("ep")
    if ep is not None and ep > 1:
        if not model.experts:
            raise ConfigError("fix.ep", f"ep={ep} needs an MoE model (experts=0)", "set ep=1")
        if model.experts % ep:
            raise ConfigError("fix.ep", f"ep={ep} does not divide experts={model.experts}",
                              f"choose ep in {divisors(model.experts)}")
    cp = fix.get("cp")
    if cp is not None and cp > 1 and seq_len % (2 * cp):
        raise ConfigError("fix.cp", f"seq_len={seq_len} is not divisible by 2*cp={2 * cp}",
                          "choose cp with seq_len % (2*cp) == 0")
    if fix.get("cp_kind") == "heads" and "cp" in fix:
        reason = heads_rule(model.heads, model.kv_heads, fix.get("tp", 1), fix["cp"]) if "tp" in fix else None
        if reason or fix["cp"] == 1:
            raise ConfigError("fix.cp_kind", reason or "cp_kind=heads needs cp > 1",
                              "use cp_kind=gather, or a cp dividing heads/tp")
    for name in ("dp", "tp", "pp", "cp"):
        if name in fix and world % fix[name]:
            raise ConfigError(f"fix.{name}", f"{name}={fix[name]} does not divide the world size {world}",
                              f"choose {name} in {divisors(world)}")
    if all(k in fix for k in ("dp", "tp", "pp", "cp")):
        prod = fix["dp"] * fix["tp"] * fix["pp"] * fix["cp"]
        if prod != world:
            raise ConfigError("fix", f"dp*tp*pp*cp = {prod} != world size {world}",
                              "choose degrees whose product is the world size, or fix fewer of them")
    if "pp" in fix and fix["pp"] > model.layers:
        raise ConfigError("fix.pp", f"pp={fix['pp']} exceeds layers={model.layers}", "use pp <= layers")
    if fix.get("sp") and fix.get("tp") == 1:
        raise ConfigError("fix.sp", "sequence parallel needs tp > 1", "set tp >= 2 or sp=false")
    reason = offload_rule(fix.get("offload", "none"), fix.get("zero", 1))
    if reason:
        raise ConfigError("fix.offload", reason, "set zero >= 1 or offload=none")
    check_schedule_fix(model, fix)
    for name in ("dp", "mbs", "grad_accum"):
        if name in fix and global_batch % fix[name]:
            raise ConfigError(f"fix.{name}", f"{name}={fix[name]} does not divide global batch {global_batch}",
                              f"choose {name} dividing the global batch")
    if all(k in fix for k in ("dp", "mbs", "grad_accum")) and fix["dp"] * fix["mbs"] * fix["grad_accum"] != global_batch:
        raise ConfigError("fix.grad_accum", f"dp*mbs*grad_accum = {fix['dp'] * fix['mbs'] * fix['grad_accum']} "
                          f"!= global batch {global_batch}", "choose mbs and grad_accum with dp*mbs*grad_accum == global batch")
    if fix.get("dp_shard") and "dp" in fix and fix["dp"] % fix["dp_shard"]:
        raise ConfigError("fix.dp_shard", f"{fix['dp_shard']} does not divide dp={fix['dp']}", "choose a divisor of dp")


@lru_cache(maxsize=None)  # pure; asked per layout with few distinct arguments
def microbatch_rule(schedule: str, pp: int, microbatches: int) -> str | None:
    """Why ``microbatches`` per step cannot run ``schedule`` over ``pp`` ranks, or None. Interleaved schedules:
    micro-batches % pp == 0 (Megatron's rule; it also meets torch's "a multiple of max(1, m // pp) rounds" of
    ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble); dualpipev: micro-batches >= 2*pp stages (torch's
    ScheduleDualPipeV). GPipe, 1F1B (the runtime runs fewer than pp as GPipe) and ZBV (torch fills
    the V with empty slots) take any count."""
    if pp == 1:
        return None
    if schedule in INTERLEAVED_SCHEDULES and microbatches % pp:
        return f"schedule={schedule} needs micro-batches (grad_accum={microbatches}) divisible by pp={pp}"
    if schedule == "dualpipev" and microbatches < 2 * pp:
        return f"schedule=dualpipev needs micro-batches (grad_accum={microbatches}) >= 2*pp={2 * pp} stages"
    return None


def recompute_rule(schedule: str, recompute: str) -> str | None:
    """Why ``recompute`` cannot run with ``schedule``, or None. The zero-bubble schedules split the backward into
    two autograd passes (input gradients, then weight gradients: torch's stage_backward_input / _weight); a
    checkpointed block recomputes its forward in each, and the composable checkpoint's recompute context
    (torch.distributed._composable.checkpoint) can be entered only once per forward."""
    if schedule in SPLIT_BACKWARD and recompute != "none":
        return (f"schedule={schedule} splits the backward into input and weight passes, and recompute={recompute} "
                "(composable checkpoint) can recompute a block only once per forward")
    return None


def context_compile_rule(cp: int, compile: bool) -> str | None:
    """Why ``compile`` cannot run with context parallelism, or None: the cp attention swaps
    scaled_dot_product_attention for an all-gathering one while the transformer runs (parallel/context.py), which
    a compiled block would trace once and keep."""
    if compile and cp > 1:
        return "context parallelism swaps the attention call at run time, which compiled blocks would not see"
    return None


@lru_cache(maxsize=None)  # pure; asked per layout with few distinct arguments
def heads_rule(heads: int, kv_heads: int, tp: int, cp: int) -> str | None:
    """Why context parallelism by heads (``plan.cp_kind = "heads"``, parallel/context_heads.py) cannot run at
    (``tp``, ``cp``), or None: each rank's query heads (``heads / tp``) are dealt out over the cp ranks. Key/value
    heads that do not divide are repeated to the query heads before the exchange (priced so:
    cost_comm.cp_heads_comm_per_block), so ``kv_heads`` never refuses."""
    if cp > 1 and (heads % tp or (heads // tp) % cp):
        return (f"cp_kind=heads deals each rank's query heads (heads={heads} / tp={tp}) out over cp={cp} ranks, "
                "which does not divide them")
    return None


@lru_cache(maxsize=None)  # pure; asked per layout with few distinct arguments
def heads_searched(heads: int, kv_heads: int, tp: int, cp: int) -> bool:
    """Whether the search offers the heads flavour at (``tp``, ``cp``) beside the gather one (a fixed
    ``cp_kind`` is always honoured): where ``heads_rule`` allows it and it moves no more bytes per rank or keeps
    no more for backward than the all-gather of K/V -- per local token and head_dim, all-to-alls of
    (h + kv')(cp-1)/cp^2 x2 against an all-gather of 2kv(cp-1)/cp, and saved 2h + 4(kv' - kv) against
    4kv(cp-1) (cost_comm.cp_heads_comm_per_block, cost_memory.cp_heads_saved_elements; kv' = kv, or h where cp
    does not divide kv/tp). Elsewhere (GQA with few kv heads at a small cp: Llama 3 at cp < 5) it is dearer in
    both, and would only grow the space."""
    if heads_rule(heads, kv_heads, tp, cp):
        return False
    kv = kv_heads // tp
    sent = kv if kv % cp == 0 else heads // tp
    h = heads // tp
    return h + sent <= cp * kv or 2 * h + 4 * (sent - kv) <= 4 * kv * (cp - 1)


@lru_cache(maxsize=None)  # pure; asked per layout with few distinct arguments
def compile_rule(schedule: str, pp: int, compile: bool) -> str | None:
    """Why ``compile`` cannot run with ``schedule``, or None: torch's zero-bubble schedules refuse compiled stage
    modules (schedules._check_torch_compile_compatibility: no input/weight backward split under torch.compile)."""
    if compile and pp > 1 and schedule in SPLIT_BACKWARD:
        return f"schedule={schedule} splits the backward into input and weight passes, which torch.compile cannot"
    return None


def check_schedule_fix(model: ModelSpec, fix: Mapping[str, Any]) -> None:
    """Fixed schedule, vpp, pp and grad_accum that no plan can run (one ConfigError): vpp > 1 needs an interleaved
    or V schedule, a V schedule runs vpp == 2, the chunks must divide the layers, and ``microbatch_rule``."""
    schedule, vpp, pp = fix.get("schedule"), fix.get("vpp"), fix.get("pp")
    if (vpp or 1) > 1 and schedule is not None and schedule not in INTERLEAVED_SCHEDULES + V_SCHEDULES:
        raise ConfigError("fix.vpp", f"vpp={vpp} needs an interleaved or V schedule, got schedule={schedule}",
                          "set schedule=interleaved, interleaved-zb, zbv or dualpipev, or vpp=1")
    if schedule in V_SCHEDULES and vpp is not None and vpp != 2 and pp != 1:
        raise ConfigError("fix.vpp", f"schedule={schedule} runs two stages per pipeline rank (a V), got vpp={vpp}",
                          "set vpp=2")
    chunks = 2 if schedule in V_SCHEDULES and pp != 1 else (vpp or 1)
    if pp is not None and chunks > 1 and model.layers % (pp * chunks):
        raise ConfigError("fix.vpp", f"layers={model.layers} is not divisible by pp*vpp={pp * chunks}",
                          "choose pp*vpp dividing the layer count")
    reason = recompute_rule(schedule, fix["recompute"]) if schedule and "recompute" in fix and pp != 1 else None
    if reason:
        raise ConfigError("fix.recompute", reason, "use recompute=none, or schedule=1f1b or interleaved")
    reason = compile_rule(schedule, pp, bool(fix["compile"])) if schedule and pp and "compile" in fix else None
    if reason:
        raise ConfigError("fix.compile", reason, "use compile=false, or schedule=1f1b or interleaved")
    reason = context_compile_rule(fix.get("cp", 1), bool(fix.get("compile")))
    if reason:
        raise ConfigError("fix.compile", reason, "use compile=false, or cp=1")
    if schedule is not None and pp is not None and "grad_accum" in fix:
        reason = microbatch_rule(schedule, pp, fix["grad_accum"])
        if reason:
            raise ConfigError("fix.grad_accum", reason, "choose grad_accum accordingly, or another schedule")


# ============================================================================================ enumeration


def enumerate_space(model: ModelSpec, world: int, global_batch: int, seq_len: int, precisions: Sequence[str],
                    fix: Mapping[str, Any] | None = None, restrict: Mapping[str, Sequence] | None = None,
                    host_offload: bool = False) -> Space:
    """All valid candidates for ``world`` devices; divisibility rejections are counted per reason (layouts).
    ``host_offload``: the devices have host memory of their own to offload to (``offload_searched``)."""
    fix = dict(fix or {})
    restrict = dict(restrict or {})
    check_fix(model, world, global_batch, seq_len, fix)
    restrict = form_of(model).restrict(model, fix, restrict)[0]
    uneven = True in list(restrict.get("uneven", [True]))
    rejected: Counter = Counter()
    L = model.layers

    precs = sorted({PRECISIONS.index(p) for p in _allowed("precision", precisions, fix, restrict)})
    recomputes = [RECOMPUTE_MODES.index(r) for r in _allowed("recompute", _recompute_modes(model, fix, restrict),
                                                              fix, restrict)]
    rc_opts = recompute_options(recomputes, _allowed("recompute_every", RECOMPUTE_EVERY, fix, restrict), fix)
    zeros = _allowed("zero", [0, 1, 2, 3], fix, restrict)
    offloads = [OFFLOAD_MODES.index(o) for o in _allowed("offload", offload_searched(host_offload), fix, restrict)]
    schedules = _allowed("schedule", SCHEDULES, fix, restrict)
    sps = _allowed("sp", [False, True], fix, restrict)
    compiles = [int(c) for c in _allowed("compile", [False, True], fix, restrict)]  # eager first: wins ties
    cp_kinds = [CP_KINDS.index(k) for k in _allowed("cp_kind", CP_KINDS, fix, restrict)]  # gather first: wins ties

    # asked once per layout, answered once per distinct (dp, cp) and pp
    zero_rows = lru_cache(maxsize=None)(lambda dp, cp: with_offload(_zero_shards(dp, cp, zeros, fix, restrict),
                                                                    offloads))
    schedule_rows = lru_cache(maxsize=None)(lambda pp: _schedules(L, pp, schedules, fix, restrict))
    lay_rows: list[tuple] = []
    key_rows: list[tuple] = []
    mid_rows: list[tuple] = []
    dpc_rows: list[tuple] = []
    n_lay = n_key = n_dpc = 0
    for tp in _allowed("tp", divisors(world), fix, restrict):
        if model.heads % tp or model.kv_heads % tp:
            rejected["tp: heads or kv_heads not divisible"] += 1
            continue
        for pp in _allowed("pp", divisors(world // tp) if world % tp == 0 else [], fix, restrict):
            if pp > L:
                rejected["pp > layers"] += 1
                continue
            if not uneven and L % pp:
                rejected["layers % pp (uneven disabled)"] += 1
                continue
            for cp in _allowed("cp", divisors(world // (tp * pp)) if world % (tp * pp) == 0 else [], fix, restrict):
                if cp > 1 and seq_len % (2 * cp):
                    rejected["seq_len % (2*cp)"] += 1
                    continue
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                if dp not in _allowed("dp", [dp], fix, restrict):
                    rejected["dp not allowed by fix/restrict"] += 1
                    continue
                if global_batch % dp:
                    rejected["global_batch % dp"] += 1
                    continue
                eps = [e for e in divisors(dp) if (model.experts % e == 0 if model.experts else e == 1)]
                for ep in _allowed("ep", eps, fix, restrict):
                    if dp % ep or (model.experts % ep if model.experts else ep != 1):
                        rejected["ep: experts or dp not divisible"] += 1
                        continue
                    mbss = [m for m in _allowed("mbs", divisors(global_batch // dp), fix, restrict)
                            if (global_batch // dp) % m == 0]
                    gas = _allowed("grad_accum", [global_batch // (dp * m) for m in mbss], fix, restrict)
                    mbss = [m for m in mbss if global_batch // (dp * m) in gas]
                    if not mbss:
                        rejected["global_batch % (dp*mbs)"] += 1
                        continue
                    zds, scheds = zero_rows(dp, cp), schedule_rows(pp)
                    sp_vals = [int(s) for s in sps if tp > 1 or not s]
                    if not zds or not scheds or not sp_vals:
                        rejected["zero/dp_shard, schedule/vpp or sp"] += 1
                        continue
                    kinds = [0] if cp == 1 else [k for k in cp_kinds if not k or (
                        not heads_rule(model.heads, model.kv_heads, tp, cp) if "cp_kind" in fix
                        else heads_searched(model.heads, model.kv_heads, tp, cp))]
                    if not kinds or (cp == 1 and 0 not in cp_kinds):
                        rejected["cp_kind=heads: heads/tp % cp, or cp = 1"] += 1
                        continue
                    keys, mids_l, dpcs_l, events = _layout_rows(n_lay, pp, cp, dp, global_batch, mbss, sp_vals,
                                                                 compiles, precs, scheds, zds, len(rc_opts), kinds)
                    for _, name, count in sorted(events):  # the order the reasons first arise (the report's ties)
                        rejected[name] += count
                    mid_rows.append(mids_l + np.array([n_key, 0, 0, n_dpc, 0]))
                    key_rows.append(keys)
                    dpc_rows.append(dpcs_l)
                    n_key, n_dpc = n_key + len(keys), n_dpc + len(dpcs_l)
                    lay_rows.append((tp, pp, cp, dp, ep))
                    n_lay += 1
    cols = lambda rows, width: np.ascontiguousarray(  # noqa: E731
        np.concatenate(rows).T if rows else np.zeros((width, 0), dtype=np.int64))
    mids = cols(mid_rows, 5)
    lay_arr = np.array(lay_rows, dtype=np.int64).reshape(-1, 5)
    # candidates: each mid's grid of its layout's (zero, dp_shard, offload) rows x the recompute options
    # (a split-backward schedule runs without recompute only: ``recompute_rule``), never stored one row each
    key_arr = cols(key_rows, 7)
    pp_of_mid = lay_arr[:, 1][key_arr[0]][mids[0]]
    split = np.isin(mids[1], [SCHEDULES.index(s) for s in SPLIT_BACKWARD]) & (pp_of_mid > 1)
    nr_m = np.where(split, int((0, 1) in rc_opts), len(rc_opts))
    rejected["recompute with a split backward (zero-bubble)"] += int((mids[4] * (len(rc_opts) - nr_m)).sum())
    grid = Grid(mids[3], mids[4], nr_m, split, np.array(rc_opts, dtype=np.int64).reshape(-1, 2))
    return Space(dict(zip(LAYOUT_FIELDS, np.ascontiguousarray(lay_arr.T))),
                 dict(zip(("layout", "mbs", "sp", "precision", "ga", "compile", "cp_kind"), key_arr)),
                 dict(zip(("key", "schedule", "vpp"), np.ascontiguousarray(mids[:3]))),
                 dict(zip(("layout", "precision", "schedule", "vpp", "zero", "dp_shard", "offload"),
                          cols(dpc_rows, 7))),
                 GridColumns(grid), rejected, uneven)


def _layout_rows(lay: int, pp: int, cp: int, dp: int, global_batch: int, mbss: Sequence[int], sp_vals: Sequence[int],
                 compiles: Sequence[int], precs: Sequence[int], scheds: Sequence[tuple[int, int]],
                 zds: Sequence[tuple[int, int, int]], n_rc: int,
                 kinds: Sequence[int] = (0,)) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """One layout's rows, in the enumeration's order, as int64 arrays (numbered from 0 within the layout):
    keys (mbs x (sp, compile) x cp_kind x precision: layout, mbs, sp, precision, ga, compile, cp_kind), mids (key x (schedule, vpp)
    that torch's micro-batch and compile rules allow: key, schedule, vpp, first dpc row, dpc rows) and dpc rows
    (precision x (schedule, vpp) x (zero, dp_shard, offload)); and the rejections as (where in the loop over
    mbs, (sp, compile), precision, schedule the reason first arises, reason, candidates)."""
    nv, nz, npr, nk = len(scheds), len(zds), len(precs), len(kinds)
    pairs = [(sp, c) for sp in sp_vals for c in compiles]
    kept = [j for j, (_, c) in enumerate(pairs) if not (c and cp > 1)]  # context_compile_rule
    names = [SCHEDULES[sched] for sched, _ in scheds]
    mbs = np.array(mbss, dtype=np.int64)
    ga = global_batch // (dp * mbs)
    batch_ok = np.array([[not microbatch_rule(n, pp, int(g)) for n in names] for g in ga], dtype=bool)
    comp_ok = np.array([[not compile_rule(n, pp, bool(pairs[j][1])) for n in names] for j in kept],
                       dtype=bool).reshape(len(kept), nv)
    ok = batch_ok[:, None, :] & comp_ok[None, :, :]  # (mbs, kept pair, schedule)
    events = []
    skipped = [j for j in range(len(pairs)) if j not in kept]
    if skipped:
        events.append(((0, skipped[0], -1, -1), "compile with cp > 1", len(mbs) * len(skipped) * npr * nv * nz * n_rc))
    bad = ~ok.reshape(-1, nv)  # rows (mbs, kept pair) in loop order
    counts = bad.sum(axis=0).tolist() if bad.size else [0] * nv
    firsts = bad.argmax(axis=0).tolist() if bad.size else [0] * nv  # each schedule's first rejected row
    for name in dict.fromkeys(names):  # where the loop first meets it: the least row, then the least schedule
        vs = [v for v in range(nv) if names[v] == name and counts[v]]
        if vs:
            v = min(vs, key=lambda u: (firsts[u], u))
            i, j = divmod(firsts[v], len(kept))
            events.append(((i, kept[j], 0, v), f"grad_accum or compile ({name})",
                           sum(counts[u] for u in vs) * nk * npr * nz * n_rc))
    # each kept (sp, compile) pair once per cp_kind (gather first)
    nq = len(kept) * nk
    i, j, p = np.unravel_index(np.arange(len(mbs) * nq * npr), (len(mbs), nq, npr))
    pair = np.array([pairs[k] for k in kept], dtype=np.int64).reshape(-1, 2)
    kind = np.array(kinds, dtype=np.int64)
    prec = np.array(precs, dtype=np.int64)
    keys = np.array([np.full(len(i), lay), mbs[i], pair[j // nk, 0], prec[p], ga[i], pair[j // nk, 1],
                     kind[j % nk]]).T
    ok = np.repeat(ok, nk, axis=1)
    mi, mj, mp, mv = np.nonzero(np.broadcast_to(ok[:, :, None, :], (len(mbs), nq, npr, nv)))
    sv = np.array(scheds, dtype=np.int64).reshape(-1, 2)
    mids = np.array([(mi * nq + mj) * npr + mp, sv[mv, 0], sv[mv, 1], (mp * nv + mv) * nz,
                     np.full(len(mi), nz)]).T
    dp_, dv, dz = np.unravel_index(np.arange(npr * nv * nz), (npr, nv, nz))
    z = np.array(zds, dtype=np.int64).reshape(-1, 3)
    dpcs = np.array([np.full(len(dp_), lay), prec[dp_], sv[dv, 0], sv[dv, 1], z[dz, 0], z[dz, 1], z[dz, 2]]).T
    return keys, mids, dpcs, events  # (rows, columns) views: np.array(...).T is several times cheaper than stack


def _recompute_modes(model: ModelSpec, fix: Mapping[str, Any], restrict: Mapping[str, Sequence]) -> list[str]:
    """The recompute modes searched: all, less ops on an MoE model (``ops_rule``) unless fixed (then refused)."""
    reason = ops_rule(model, fix.get("recompute", "ops"))
    if reason and "recompute" in fix:
        raise ConfigError("fix.recompute", reason, "use recompute=full or selective")
    return [r for r in RECOMPUTE_MODES if not ops_rule(model, r)]


def ops_rule(model: ModelSpec, recompute: str) -> str | None:
    """Why ``recompute`` cannot run on ``model``, or None: op-level selective checkpointing (ops) replays a block's
    ops under a saved-tensor policy, which the MoE blocks' experts -- FSDP units of their own, with their own
    gather hooks (parallel/expert.py) -- cannot be replayed through."""
    if recompute == "ops" and model.moe_layers > 0:
        return f"recompute=ops replays each block op by op, which {model.name}'s MoE experts (own FSDP units) cannot"
    return None


def recompute_options(recomputes: Sequence[int], every: Sequence[int], fix: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(recompute code, recompute_every) pairs searched: k = 1 for each mode, and k > 1 for full and ops
    (THINNED_MODES; any mode but none when the user fixes recompute_every). A fixed k > 1 with recompute=none
    cannot run (Plan.validate): refused here in one line."""
    thinned = [r for r in recomputes if r != 0] if "recompute_every" in fix else \
        [r for r in recomputes if r in THINNED_MODES]
    opts = [(r, 1) for r in recomputes if 1 in every]
    opts += [(r, k) for k in every if k > 1 for r in thinned]
    if not opts:
        raise ConfigError("fix.recompute_every", f"recompute_every={list(every)} needs recompute=full or ops",
                          "set recompute=full or ops, or recompute_every=1")
    return opts


def offload_searched(host_offload: bool) -> list[str]:
    """The offload modes searched by default: all of OFFLOAD_MODES where the devices have host memory of their
    own (``host_offload``: DeviceSpec.host_link_gbs > 0), else none only -- on a CPU the host memory *is* the
    device memory, so offloading saves nothing (a fixed offload is still honoured, ``_allowed``). "none" comes
    first so a tie keeps it."""
    return list(OFFLOAD_MODES) if host_offload else ["none"]


def offload_rule(offload: str, zero: int) -> str | None:
    """Why ``offload`` cannot run with ``zero``, or None: offload moves this rank's shard of the model states to
    the host (FSDP2's CPUOffloadPolicy, ZeRO-Offload), and zero 0 shards nothing (as Plan.validate)."""
    if offload != "none" and zero == 0:
        return f"offload={offload} moves this rank's shard of the model states to the host; zero=0 shards nothing"
    return None


def with_offload(zero_shards: Sequence[tuple[int, int]], offloads: Sequence[int]) -> list[tuple[int, int, int]]:
    """(zero, dp_shard, offload code) triples: each (zero, dp_shard) pair with every offload mode that
    ``offload_rule`` allows (zero 0 with none only), so the space grows only where offload is searched."""
    return [(z, ds, o) for z, ds in zero_shards for o in offloads if not offload_rule(OFFLOAD_MODES[o], z)]


def _zero_shards(dp: int, cp: int, zeros: Sequence[int], fix: Mapping[str, Any],
                 restrict: Mapping[str, Sequence]) -> list[tuple[int, int]]:
    """(zero, dp_shard) pairs; dp_shard 0 means all of dp. Sharding over one rank is zero=0 and is skipped."""
    out = []
    for z in zeros:
        if z == 0:
            if "dp_shard" not in fix or fix["dp_shard"] in (None, dp):
                out.append((0, 0))
            continue
        if dp * cp == 1 and "zero" not in fix:
            continue
        shards = [d for d in divisors(dp) if d * cp > 1] or [dp]
        if "dp_shard" in restrict:  # None there means all of dp
            restrict = {**restrict, "dp_shard": [dp if v is None else v for v in restrict["dp_shard"]]}
        for ds in _allowed("dp_shard", shards, fix, restrict):
            if ds is None:
                ds = dp
            if dp % ds:
                continue
            out.append((z, 0 if ds == dp else ds))
    return sorted(set(out))


def _schedules(layers: int, pp: int, schedules: Sequence[str], fix: Mapping[str, Any],
               restrict: Mapping[str, Sequence]) -> list[tuple[int, int]]:
    """(schedule, vpp) pairs: pp=1 -> 1f1b only; interleaved and interleaved-zb need vpp >= 2 and
    layers % (pp*vpp) == 0; zbv and dualpipev run vpp == 2 (a V) with layers % (2*pp) == 0."""
    if pp == 1:
        if fix.get("vpp", 1) > 1:
            return []
        if "schedule" in fix:
            return [(SCHEDULES.index(fix["schedule"]), 1)]
        return [(SCHEDULES.index("1f1b"), 1)]
    out = []
    for s in schedules:
        if s in V_SCHEDULES:
            if fix.get("vpp", 2) == 2 and layers % (2 * pp) == 0:
                out.append((SCHEDULES.index(s), 2))
            continue
        if s not in INTERLEAVED_SCHEDULES:
            if fix.get("vpp", 1) == 1:
                out.append((SCHEDULES.index(s), 1))
            continue
        vpps = [v for v in range(2, layers // pp + 1) if layers % (pp * v) == 0]
        for v in _allowed("vpp", vpps, fix, restrict):
            if v >= 2 and layers % (pp * v) == 0:
                out.append((SCHEDULES.index(s), v))
    return out
