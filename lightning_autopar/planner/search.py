"""Feasibility, pricing and ranking (the pipeline partition it prices is partition.py): ``plan()`` searches the space, ``estimate()`` prices one plan.

Pure numpy: no torch import here (an ``nn.Module`` is turned into a ModelSpec by ``lightning_autopar.plan``).
Pricing is vectorised over the whole candidate space (see space.py for its two-level layout): terms.py builds
the per-rank factor tables from the cost terms (cost.py and the cost_*.py modules, each named there with its
formula and source); ``Tables`` below combines them per candidate and ranks them; bounded.py's GridSearch
combines them per grid block of an enumerated space, the same prices without a row per candidate.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lightning_autopar.errors import ConfigError, InfeasibleError
from lightning_autopar.planner.bounded import GridSearch, Scan
from lightning_autopar.planner.cost_comm import overlapped_exposed
from lightning_autopar.planner.cost_pipeline import bubble_fraction
from lightning_autopar.planner.forms import form_of
from lightning_autopar.planner.hardware import GIB, Hardware
from lightning_autopar.planner.partition import stage_chunks
from lightning_autopar.planner.report import PlanReport, explain
from lightning_autopar.planner.space import Space, enumerate_space, space_from_plans
from lightning_autopar.planner.terms import (DPC_TERMS, N_REP, ClassTerms, Dpc, Rc, Window, dp_rows,
                                             recompute_rows, runtime_terms)
from lightning_autopar.specs import (
    PRECISIONS,
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

CHUNK = 16384  # candidates per vectorised block (keeps the working set in cache)


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


def price(model: ModelSpec, hw: Hardware, space: Space, global_batch: int, seq: int,
          measured: Measured | None = None, fused: bool = True, detail: bool = True) -> dict[str, np.ndarray]:
    """Price every candidate: step time, memory per device and (``detail``) the breakdown, as arrays.

    Terms are computed on the smallest factor table they depend on (space.Space) and combined per candidate
    for each representative pipeline rank (first, last, heaviest middle); the slowest rank sets the pace and
    the fullest sets the memory. The model's form builds the tables (forms.ModelForm.terms: a transformer by its
    blocks, a unit-form model by the sums over each rank's units); both feed the same data-parallel terms and
    assembly.
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

    def __init__(self, hw: Hardware, space: Space, mid: dict[str, list], dpc: dict[str, list] | ClassTerms,
                 opt_lut: np.ndarray, opt_width: int, n_opts: int, fixed: dict[str, np.ndarray] | None,
                 dpc_row: np.ndarray | None = None) -> None:
        K, M = space.keys, space.mids
        mk = M["key"]
        ga, vpp_m = K["ga"].astype(float), M["vpp"].astype(float)
        pp = space.layouts["pp"][K["layout"]].astype(float)
        self.hw, self.space, self.mid, self.dpc, self.n_opts = hw, space, mid, dpc, n_opts
        self.opt_lut, self.opt_width = opt_lut, opt_width  # recompute code * width + every -> row (recompute_rows)
        # each dpc row's row of by_dpc (terms.dp_rows: rows the data-parallel terms see alike are priced once)
        self.dpc_row = np.arange(len(space.dpcs["zero"])) if dpc_row is None else dpc_row
        # three row-gathers per candidate (mid x recompute, mid, dpc), reduced over the representative ranks;
        # float32 (ranking needs ~1e-6 relative precision) and cache-sized chunks keep it memory-light;
        # the last axes are named by terms.Rc, terms.Window and terms.Dpc
        self.by_rc = pack32([mid[k.name.lower()] for k in Rc]).reshape(-1, N_REP, len(Rc))
        # compute windows that can hide data-parallel traffic (x the device's overlap share)
        self.by_mid = pack32([[hw.overlap * arr for arr in mid[k.name.lower()]] for k in Window])
        self.by_dpc = (pack32([[dpc.values[k]] for k in DPC_TERMS])[:, 0][dpc.pair] if isinstance(dpc, ClassTerms)
                       else pack32([dpc[k] for k in DPC_TERMS]))
        self.f_sm = np.float32(hw.comm_sm)
        # steady state + fill/drain: m * (1 + the schedule's bubble fraction) slots
        # (cost_pipeline.bubble_fraction; 1F1B: (m + (pp-1)/vpp), Narayanan et al. 2021), then the once-per-step tail
        self.ga_m = ga[mk]
        self.span = (self.ga_m + bubble_fraction(pp[mk], self.ga_m, vpp_m, M["schedule"]) * self.ga_m
                     ).astype(np.float32)
        self.fixed = fixed
        self.fixed_total = sum(fixed.values()) if fixed is not None else None

    @staticmethod
    def of(model: ModelSpec, hw: Hardware, space: Space, seq: int, measured: Measured | None = None,
           fused: bool = True) -> "Tables":
        form = form_of(model)
        opts, lut, width = recompute_rows(space)
        rows, dpc_row = dp_rows(space)
        distinct = dataclasses.replace(space, dpcs={k: v[rows] for k, v in space.dpcs.items()})
        mid, dpc = form.terms(model, hw, distinct, seq, measured, fused, opts)
        return Tables(hw, space, mid, dpc, lut, width, len(opts), runtime_terms(model, hw, space, form.stage_units),
                      dpc_row)

    # per-candidate columns, read from the space's candidate columns on first use: the exhaustive path and a
    # subset's pricing use them; the grid search (bounded.GridSearch) never does
    @functools.cached_property
    def cm(self) -> np.ndarray:
        """Each candidate's mid."""
        return self.space.cands["mid"]

    @functools.cached_property
    def cd(self) -> np.ndarray:
        """Each candidate's row of the dpc table (by_dpc)."""
        return self.dpc_row[self.space.cands["dpc"]]

    @functools.cached_property
    def mrc(self) -> np.ndarray:
        """Each candidate's row of the mid x recompute table (by_rc)."""
        opt_of = self.opt_lut[self.space.cands["recompute"] * self.opt_width + self.space.cands["recompute_every"]]
        return self.cm * self.n_opts + opt_of

    @functools.cached_property
    def step(self) -> np.ndarray:
        """Steps priced so far (inf: not yet)."""
        return np.full(self.space.size, np.inf)

    @functools.cached_property
    def done(self) -> np.ndarray:
        """Candidates whose step has been priced."""
        return np.zeros(self.space.size, dtype=bool)

    def step_memory(self, sl: Any, memory: bool = True) -> tuple[np.ndarray, ...]:
        """(step without the runtime's fixed terms[, memory, host]) of candidates ``sl`` (a slice or indices)."""
        cm = self.cm[sl]
        a, b, d = self.by_rc[self.mrc[sl]], self.by_mid[cm], self.by_dpc[self.cd[sl]]
        slot_r = slot_of(a, b, d, self.f_sm)
        tail = (overlapped_exposed(d[..., Dpc.A3], b[..., Window.TB], d[..., Dpc.B3], self.f_sm) + d[..., Dpc.C3]
                + d[..., Dpc.OPT])
        step = self.span[cm] * max3(slot_r) + max3(tail)
        return (step, max3(a[..., Rc.MEM] + d[..., Dpc.MEM]), max3(d[..., Dpc.HOST])) if memory else (step,)

    def memory_host(self) -> tuple[np.ndarray, np.ndarray]:
        """Device memory and host memory of every candidate, as ``step_memory`` sums them (the same float32
        values), gathered one rank column at a time: 1-D takes are several times faster than row gathers."""
        n = len(self.cm)
        memory, host = np.empty(n), np.empty(n)
        col = lambda arr: [np.ascontiguousarray(arr[:, r]) for r in range(N_REP)]  # noqa: E731
        mem_rc, mem_d = col(self.by_rc[..., Rc.MEM]), col(self.by_dpc[..., Dpc.MEM])
        host_d = col(self.by_dpc[..., Dpc.HOST])
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
        base = self.by_rc[..., Rc.BASE].reshape(-1, self.n_opts, N_REP).min(axis=1)
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


def pack32(terms: Sequence[Sequence[Any]]) -> np.ndarray:
    """(rows[, options], ranks, terms) float32 from each term's per-rank arrays, cast as they are written: no
    float64 stack of the whole table first (the same values as stacking, then casting)."""
    first = np.asarray(terms[0][0])
    out = np.empty(first.shape + (len(terms[0]), len(terms)), dtype=np.float32)
    for i, per_rank in enumerate(terms):
        for r, arr in enumerate(per_rank):
            out[..., r, i] = arr
    return out


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
        out["compute"] = (ga_c * w(np.stack(mid["tf"], 1)[cm] + np.stack(mid["tb"], 1)[cm] + d[..., Dpc.MB])
                          + w(d[..., Dpc.OPT]))
        base0 = by_rc[cm * n_opts][..., Rc.BASE].astype(float)  # the same mid without recompute (row 0)
        out["recompute"] = ga_c * (w(a[..., Rc.BASE]) - w(base0))  # with the collectives full recompute re-runs
        out["comm"] = step - out["compute"] - out["recompute"] - out["bubble"]  # TP/CP/EP/PP/DP exposed
        out["memory_terms"] = _memory_terms(hw, a, d, rows)
    return out


def _memory_terms(hw: Hardware, a: np.ndarray, d: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Bytes by term on the rank with the largest memory: parameters, gradients, optimizer states (ZeRO model
    states + FSDP2's shard copy), activations (saved activations, logits, pipeline and MoE buffers, with the
    fragmentation margin: the mid level), buffers (DDP buckets / FSDP2 gather and reduce-scatter buffers, with
    the margin) and the cluster's reserved memory; they sum to the candidate's memory."""
    top = (a[..., Rc.MEM] + d[..., Dpc.MEM]).argmax(axis=1)
    at = lambda arr: arr[rows, top]  # noqa: E731
    terms = {"parameters": at(d[..., Dpc.M_PARAMS]), "gradients": at(d[..., Dpc.M_GRADS]),
             "optimizer": at(d[..., Dpc.M_OPTIM]), "activations": at(a[..., Rc.MEM])}
    terms["buffers"] = at(d[..., Dpc.MEM]) - terms["parameters"] - terms["gradients"] - terms["optimizer"] - hw.reserved
    terms["reserved"] = np.full(len(rows), hw.reserved)
    return terms


def max3(x: np.ndarray) -> np.ndarray:
    """Max over the representative-rank axis (axis 1, length 3): elementwise, faster than a small-axis reduce."""
    return np.maximum(np.maximum(x[:, 0], x[:, 1]), x[:, 2])


def slot_of(a: np.ndarray, b: np.ndarray, d: np.ndarray, f_sm: float = 0.0) -> np.ndarray:
    """Per-rank micro-batch slot: base (compute, recompute, TP/CP/EP/PP traffic) + memory-bound parameter work + exposed
    DP traffic per micro-batch (b holds the forward and backward windows that can hide it;
    cost_comm.overlapped_exposed)."""
    tf, tb = b[..., Window.TF], b[..., Window.TB]
    return (a[..., Rc.BASE] + d[..., Dpc.MB] + overlapped_exposed(d[..., Dpc.A1], tf, d[..., Dpc.B1], f_sm)
            + overlapped_exposed(d[..., Dpc.A2], tb, d[..., Dpc.B2], f_sm))


# ============================================================================================ assembling results


def priced_plan(model: ModelSpec, cluster: ClusterSpec, hw: Hardware, space: Space, costs: dict[str, np.ndarray],
                i: int, global_batch: int, seq: int, limit: float) -> PricedPlan:
    """The PricedPlan (contract fields) of candidate ``i``."""
    plan = space.plan(i)
    step = float(costs["step"][i])
    prec = PRECISIONS.index(plan.precision)
    model_flops = form_of(model).model_flops(model, global_batch, seq)  # unit form: samples/s in tokens_per_s
    per_device = model_flops / step / cluster.world_size
    memory = float(costs["memory"][i])
    host = float(costs["host"][i])
    host_limit = host_limit_bytes(cluster)
    feasible = memory <= limit and host <= host_limit
    reason = "" if memory <= limit else (f"memory: needs {memory / GIB:.2f} GiB per device > "
                                         f"{limit / GIB:.2f} GiB allowed")
    if host > host_limit:
        reason = "; ".join(r for r in (reason, f"host memory: offload={plan.offload} keeps {host / GIB:.2f} GiB "
                                       f"per device on the host > host_memory_gib {host_limit / GIB:.2f} GiB") if r)
    chunks: list[int] = []
    if plan.pp > 1:
        weights, emb_w, head_w = form_of(model).layer_weights(model, hw, seq, prec, True)
        chunks = stage_chunks(weights, emb_w, head_w, plan.pp, plan.vpp, space.uneven)
    return PricedPlan(
        plan=plan,
        step_time_s=step,
        tokens_per_s=global_batch * seq / step,
        model_tflops_per_device=per_device / 1e12,
        mfu=per_device / float(hw.peak[prec]),
        memory_gib_per_device=memory / GIB,
        breakdown=Breakdown(compute_s=float(costs["compute"][i]), recompute_s=float(costs["recompute"][i]),
                            comm_exposed_s=float(costs["comm"][i]), bubble_s=float(costs["bubble"][i]),
                            runtime_s=float(costs["runtime"][i]) if "runtime" in costs else 0.0,
                            terms={k: float(v[i]) for k, v in costs.get("terms", {}).items()}),
        memory_breakdown={k: float(v[i]) / GIB for k, v in costs.get("memory_terms", {}).items()},
        host_gib_per_device=host / GIB,
        feasible=feasible,
        reason=reason,
        layers_per_stage=chunks,
    )


def host_limit_bytes(cluster: ClusterSpec) -> float:
    """Host bytes per device that offloaded model states may take: DeviceSpec.host_memory_gib where the device has
    a host of its own (host_link_gbs > 0; 0 GiB there refuses any offload), else unbounded (nothing is moved)."""
    dev = cluster.device
    return dev.host_memory_gib * GIB if dev.host_link_gbs > 0 else float("inf")


def fits(costs: dict[str, np.ndarray], limit: float, host_limit: float) -> np.ndarray:
    """Candidates within the device memory limit and the host memory limit (offloaded states)."""
    return (costs["memory"] <= limit) & (costs["host"] <= host_limit)


def _inputs(model: Any, cluster: Any, global_batch: int | None, seq_len: int | None):
    spec = resolve_model(model, seq_len)
    clus = load_cluster_spec(cluster)
    seq = form_of(spec).seq(spec, seq_len)
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
    Memory is decided for every candidate; step times only where one can rank (bounded.GridSearch on an enumerated
    space; Tables.steps where the runtime's fixed costs are priced per candidate: a lower bound per mid against
    the k-th best found). ``exhaustive``: price every step instead (the same result, slower; tests compare the two).
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
    hw = Hardware.from_cluster(clus)
    limit, host_limit = hw.capacity * memory_fraction, host_limit_bytes(clus)
    tables = Tables.of(spec, hw, space, seq, meas)
    k = max(top, 1)
    found = None
    if space.grid is not None and not exhaustive and tables.fixed_total is None:  # per-candidate fixed costs:
        found = _grid_search(spec, space, tables, seq, meas, limit, host_limit, memory_fraction, k)  # priced whole
    if found is None:  # the exhaustive path, a space with per-candidate fixed costs, or nothing fits
        found = _full_search(spec, space, tables, seq, meas, limit, host_limit, memory_fraction, k, exhaustive)
    rejected = dict(space.rejected)
    if found.over_memory:
        rejected["memory"] = found.over_memory
    if found.over_host:
        rejected["host memory (offload)"] = found.over_host
    feasible = found.feasible
    if feasible:
        order = found.order
    elif allow_infeasible:
        order = np.argsort(found.costs["memory"], kind="stable")[:k]
    else:
        raise _infeasible(spec, clus, hw, space, found.costs, limit, memory_fraction, fixed)
    # the top, the smallest plan and the runner-up priced with their breakdown in one subset
    small, rival = found.smallest, found.runner_up
    extra = [i for i in (small, rival) if i is not None and i not in order]
    cands = _priced(spec, clus, hw, space, np.concatenate([order, extra]).astype(np.int64), global_batch, seq,
                    limit, meas)
    by_index = dict(zip((int(i) for i in np.concatenate([order, extra])), cands))
    cands = cands[:len(order)]
    report = PlanReport(best=cands[0], candidates=cands, evaluated=space.size, feasible=feasible, rejected=rejected,
                        search_seconds=0.0, model=spec, cluster=clus, global_batch=global_batch, seq_len=seq,
                        memory_fraction=memory_fraction)
    report.priced = found.priced()
    report.excluded = form_of(spec).restrict(spec, fixed, restrict or {})[1]
    report.smallest = by_index[small]
    report.runner_up = None if rival is None else by_index[rival]
    if explain_choice and feasible:
        report.explanation = explain(report, found.what_if)
        report.priced = found.priced()
    report.search_seconds = time.perf_counter() - start
    return report


@dataclass
class Found:
    """What a search found: the counts, the ranked top (feasible, fastest first), the runner-up (the fastest of
    another layout), the smallest plan, the what-if re-plans for the explanation (cluster, reprice) -> (plan,
    step) | None, the number of steps priced; ``costs``: memory and host of every candidate (the full path)."""

    feasible: int
    over_memory: int
    over_host: int
    order: np.ndarray
    runner_up: int | None
    smallest: int
    what_if: Callable[[ClusterSpec, bool], tuple[Plan, float] | None]
    priced: Callable[[], int]
    costs: dict[str, np.ndarray] | None = None


def _full_search(spec: ModelSpec, space: Space, tables: Tables, seq: int, meas: Measured | None, limit: float,
                 host_limit: float, memory_fraction: float, k: int, exhaustive: bool) -> Found:
    """Memory of every candidate as one column each, steps by Tables.steps (all of them when ``exhaustive``):
    the reference the grid search is checked against, and the path of spaces it does not take."""
    memory, host = tables.memory_host()
    ok = (memory <= limit) & (host <= host_limit)
    layout = space.keys["layout"][space.mids["key"]][space.cands["mid"]]
    costs = {"memory": memory, "host": host, "step": tables.steps(ok, k, layout, exhaustive)}
    feasible = int(ok.sum())
    order, runner_up = np.zeros(0, dtype=np.int64), None
    if feasible:
        idx = np.flatnonzero(ok & np.isfinite(costs["step"]))  # the others cannot rank (Tables.steps)
        order = idx[np.lexsort((costs["memory"][idx], costs["step"][idx]))[:k]]  # ties: less memory
        others = np.flatnonzero(ok & (layout != layout[order[0]]))
        runner_up = int(others[np.argmin(costs["step"][others])]) if len(others) else None
    return Found(feasible, int((memory > limit).sum()), int(((memory <= limit) & (host > host_limit)).sum()),
                 order, runner_up, smallest_plan(costs, host_limit),
                 lambda c, reprice: _what_if(spec, c, space, tables, costs, seq, meas, memory_fraction, reprice,
                                             exhaustive),
                 lambda: tables.priced, costs)


def _grid_search(spec: ModelSpec, space: Space, tables: Tables, seq: int, meas: Measured | None, limit: float,
                 host_limit: float, memory_fraction: float, k: int) -> Found | None:
    """The grid search (bounded.GridSearch) of an enumerated space; None when no candidate fits (the full path
    then lists the least-memory plans and says what to relax)."""
    search = GridSearch(tables, space.grid)
    scan = search.scan(limit, host_limit)
    if not scan.feasible:
        return None
    ranked = search.rank(scan, k, by_layout=True)
    order = ranked.top(k)
    lay = search.layout[search.grid.decode(order[:1])["mid"][0]]
    rival = ranked.fastest(search.layout[ranked.mid] != lay)
    runner_up = None if rival is None else rival[0]
    return Found(scan.feasible, scan.over_memory, scan.over_host, order, runner_up, scan.smallest,
                 lambda c, reprice: _grid_what_if(spec, c, search, scan, (limit, host_limit), seq, meas,
                                                  memory_fraction, reprice),
                 lambda: search.priced)


def _grid_what_if(model: ModelSpec, cluster: ClusterSpec, search: GridSearch, scan: Scan,
                  limits: tuple[float, float], seq: int, meas: Measured | None, memory_fraction: float,
                  reprice: bool) -> tuple[Plan, float] | None:
    """Best (plan, step) on a what-if cluster by the grid search: feasibility from the first search's memory
    (its scan again where the limits are the same), steps from the same tables (a memory-only change) or from
    tables re-priced on the what-if's hardware (a link change); ties to the earlier candidate."""
    hw = Hardware.from_cluster(cluster)
    new = (hw.capacity * memory_fraction, host_limit_bytes(cluster))
    space = search.t.space
    if reprice:
        search = GridSearch(Tables.of(model, hw, space, seq, meas), space.grid, fit=search.t)
    if new != limits:
        scan = search.scan(*new)
    if not scan.feasible:
        return None
    ranked = search.rank(scan, 1, by_layout=False)
    best, step = ranked.fastest(np.ones(len(ranked.idx), dtype=bool))
    return space.plan(best), step


def _priced(model: ModelSpec, cluster: ClusterSpec, hw: Hardware, space: Space, idx: np.ndarray, global_batch: int,
            seq: int, limit: float, meas: Measured | None) -> list[PricedPlan]:
    """PricedPlans (with the breakdown) for candidates ``idx``, in that order."""
    sub = space.subset(np.asarray(idx, dtype=np.int64))
    costs = price(model, hw, sub, global_batch, seq, meas, detail=True)
    return [priced_plan(model, cluster, hw, sub, costs, j, global_batch, seq, limit) for j in range(sub.size)]


def _what_if(model: ModelSpec, cluster: ClusterSpec, space: Space, tables: Tables, costs: dict, seq: int,
             meas: Measured | None, memory_fraction: float, reprice: bool,
             exhaustive: bool = False) -> tuple[Plan, float] | None:
    """Best (plan, step) on a what-if cluster: a memory-only change reuses the priced tables, a link change
    re-prices (both by the bounded search, Tables.steps)."""
    hw = Hardware.from_cluster(cluster)
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


def _same_compute(a: Hardware, b: Hardware) -> bool:
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
    form = form_of(model)
    relax += form.relax_hints(model, smallest)
    if host_short:
        relax.append("more host memory per device (host_memory_gib: offload plans fit the device, not the host)")
    if cluster.device.host_link_gbs <= 0:
        relax.append("a cluster whose devices have host memory (host_link_gbs, host_memory_gib: offload is searched)")
    relax += ["more devices (--nodes)", form.batch_hint]
    if fraction < 0.95:
        relax.append("a larger --memory-fraction")
    relax.append("a device with more memory")
    return relax


def smallest_line(plan: Plan, memory_gib: float, host_gib: float) -> str:
    """'2.50 GiB per device with dp=8 zero=3 ... offload=params (+ 9.1 GiB host)': the smallest plan and its needs."""
    host = f" (+ {host_gib:.2f} GiB per device on the host)" if host_gib else ""
    return f"{memory_gib:.2f} GiB per device{host}, with {plan.short()}"


def _infeasible(model: ModelSpec, cluster: ClusterSpec, hw: Hardware, space: Space, costs: dict, limit: float,
                fraction: float, fixed: Mapping[str, Any] | None = None) -> InfeasibleError:
    host_limit = host_limit_bytes(cluster)
    i = smallest_plan(costs, host_limit)
    host_short = bool(((costs["memory"] <= limit) & (costs["host"] > host_limit)).any())
    relax = relax_hints(model, cluster, space.plan(i), fraction, fixed, host_short)
    return InfeasibleError(
        f"no plan fits: the smallest memory any plan needs is "
        f"{smallest_line(space.plan(i), float(costs['memory'][i]) / GIB, float(costs['host'][i]) / GIB)} "
        f"(capacity {cluster.device.memory_gib:g} GiB x fraction {fraction:g} = {limit / GIB:.2f} GiB); "
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
    hw = Hardware.from_cluster(clus)
    space = space_from_plans([p])
    costs = price(spec, hw, space, gb, seq, Measured.coerce(measured))
    return priced_plan(spec, clus, hw, space, costs, 0, gb, seq, hw.capacity * memory_fraction)
