"""The grid search: exactly the ranked result of pricing every candidate (search.plan(exhaustive=True)), at a
fraction of the work.

An enumerated space holds its candidates as a grid per mid (space_table.Grid: the mid's dpc rows x its recompute
options), never one row each. Mids of one shape (dpc rows, options, split backward) are priced together as dense
(mids, dpc rows, options) blocks by broadcasting the factor tables (search.Tables) instead of gathering a row per
candidate: the data-parallel terms of a dpc row are combined once for all its recompute siblings, the mid's
windows once for all its dpc rows. Memory comes first, for the feasible and rejected counts and the smallest
plan; a step only for mids whose lower bound (Tables.lower_bounds) is within the k-th best step found so far (or
the best of another layout, the runner-up). Every value is the float32 expression Tables.step_memory evaluates,
in the same order, so prices and ties are those of the exhaustive path bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from lightning_autopar.planner.cost_comm import overlapped_exposed
from lightning_autopar.planner.space_table import Grid, distinct
from lightning_autopar.planner.terms import Dpc, Rc, Window

FIRST_BATCH = 2048  # candidates priced before the first threshold (at least 4 k)


@dataclass
class Scan:
    """The memory pass over every candidate: counts, the feasible candidates per mid and as blocks (per shape: its
    mids in order, feasible or not per (mid, dpc row, option)), the smallest plan."""

    feasible: int
    over_memory: int  # candidates over the device memory limit
    over_host: int  # candidates within it whose offloaded states exceed the host limit
    ok_per_mid: np.ndarray  # feasible candidates per mid
    ok_blocks: dict[int, tuple[np.ndarray, np.ndarray]]
    smallest: int  # the candidate needing the least device memory (search.smallest_plan)

    def ok(self, shape: int, mids: np.ndarray) -> np.ndarray:
        """Feasible or not, (mids, dpc rows, options), for ``mids`` of one shape."""
        have, ok = self.ok_blocks[shape]
        return ok[np.searchsorted(have, mids)]


@dataclass
class Ranked:
    """Feasible candidates whose step was priced (any of the k fastest is among them), with their mids; the
    memory of the few that place is read on demand (``memory_of``), ties go to less memory, then to the earlier
    candidate (search.plan's order)."""

    idx: np.ndarray
    step: np.ndarray
    mid: np.ndarray
    memory_of: Callable[[np.ndarray], np.ndarray]

    def top(self, k: int) -> np.ndarray:
        """The k fastest, ties to less memory, then to the earlier candidate."""
        keep = np.isfinite(self.step)
        if keep.sum() > k:  # only steps up to the k-th smallest can place (ties at it included)
            keep &= self.step <= np.partition(self.step[keep], k - 1)[k - 1]
        idx, step = self.idx[keep], self.step[keep]
        return idx[np.lexsort((idx, self.memory_of(idx), step))[:k]]

    def fastest(self, mask: np.ndarray) -> tuple[int, float] | None:
        """(candidate, step) of the fastest where ``mask``, ties to the earlier candidate; None if there is none."""
        if not mask.any():
            return None
        step = self.step[mask]
        low = step.min()
        return int(self.idx[mask][step == low].min()), float(low)


def below(limit: float) -> np.float32:
    """The largest float32 that is <= ``limit``: ``x <= below(limit)`` in float32 decides ``float(x) <= limit``
    exactly, as the exhaustive path compares float64 copies of the float32 sums."""
    near = np.float32(limit)
    return np.nextafter(near, np.float32(-np.inf)) if float(near) > limit else near


def tile_reduce(ufunc: np.ufunc, values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``ufunc`` (np.minimum, np.maximum) over ``values[start:start + size]`` for each (start, size), size >= 1: a
    mid's dpc rows are one tile of the dpc table, shared by every mid of its layout, precision and schedule, so
    each tile is reduced once."""
    width = int(sizes.max(initial=0)) + 1
    tiles, at = np.unique(starts * width + sizes, return_inverse=True)  # one int key per (start, size)
    bounds = np.stack([tiles // width, tiles // width + tiles % width], axis=1).reshape(-1)
    padded = np.concatenate([values, values[:1]])  # a tile may end at the table's end: an index reduceat accepts
    return ufunc.reduceat(padded, bounds, axis=0)[0::2][at.reshape(-1)]


class GridSearch:
    """Prices an enumerated space's grid on one hardware's tables (``tables``); ``fit``: the tables whose memory
    decides feasibility (a what-if on other links keeps the first search's memory, as the exhaustive path does)."""

    def __init__(self, tables, grid: Grid, fit=None) -> None:
        self.t, self.grid, self.fit = tables, grid, fit or tables
        code = lambda opts: opts[:, 0] * tables.opt_width + opts[:, 1]  # noqa: E731  terms.recompute_rows' code
        self.opt_rows = tables.opt_lut[code(grid.opts)]  # a mid's option rows of by_rc; (none, 1) on a split one
        self.none_row = tables.opt_lut[1]
        self.layout = tables.space.keys["layout"][tables.space.mids["key"]]  # per mid
        # the memory columns alone, contiguous: the scan reads nothing else
        fit = self.fit
        self.mem_rc = np.ascontiguousarray(fit.by_rc[..., Rc.MEM])
        self.mem_d = np.ascontiguousarray(fit.by_dpc[..., Dpc.MEM])
        # and rank-major, (ranks, rows): a block gathers contiguous (mids, options) and (mids, dpc rows) per rank
        self.mem_rc_r, self.mem_d_r = np.ascontiguousarray(self.mem_rc.T), np.ascontiguousarray(self.mem_d.T)
        host = fit.by_dpc[..., Dpc.HOST]
        self.host_d = np.maximum(np.maximum(host[:, 0], host[:, 1]), host[:, 2])
        self.priced_mids = np.zeros(len(grid.nz), dtype=bool)
        shape = (grid.nz * 2 + grid.split) * (int(grid.nr.max(initial=0)) + 1) + grid.nr
        self.shape_of = shape  # mids priced together share it (their blocks stack)

    @property
    def priced(self) -> int:
        """Candidates whose step has been computed."""
        return int(self.grid.counts[self.priced_mids].sum())

    def _blocks(self, mids: np.ndarray) -> Iterator[np.ndarray]:
        """``mids`` (with candidates) grouped by shape, each group in mid order."""
        mids = mids[self.grid.counts[mids] > 0]
        shape = self.shape_of[mids]
        for s in distinct(shape):
            yield mids[shape == s]

    def _gather(self, tables, mids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The blocks of ``mids`` (one shape): by_rc rows (mids, options, ranks, Rc), by_dpc rows (mids, dpc rows,
        ranks, Dpc)."""
        g = self.grid
        m0 = int(mids[0])
        rows = np.array([self.none_row]) if g.split[m0] else self.opt_rows[:g.nr[m0]]
        a = tables.by_rc[(mids * tables.n_opts)[:, None] + rows[None, :]]
        d = tables.by_dpc[tables.dpc_row[g.dpc0[mids][:, None] + np.arange(g.nz[m0])[None, :]]]
        return a, d

    def _option_rows(self, mids: np.ndarray) -> np.ndarray:
        """by_rc rows (mids, options) of ``mids`` (one shape)."""
        split = self.grid.split[mids[0]]
        rows = np.array([self.none_row]) if split else self.opt_rows[:self.grid.nr[mids[0]]]
        return (mids * self.fit.n_opts)[:, None] + rows[None, :]

    def _dpc_rows(self, mids: np.ndarray) -> np.ndarray:
        """by_dpc rows (mids, dpc rows) of ``mids`` (one shape)."""
        g = self.grid
        return self.fit.dpc_row[g.dpc0[mids][:, None] + np.arange(g.nz[mids[0]])[None, :]]

    def _memory(self, mids: np.ndarray) -> np.ndarray:
        """Device memory (mids, dpc rows, options) of a block, float32, as Tables.step_memory sums it: summed rank
        by rank as (mids, options, dpc rows), the long axis innermost, and returned as a view."""
        a = self.mem_rc_r[:, self._option_rows(mids)][..., None]  # (ranks, mids, options, 1)
        d = self.mem_d_r[:, self._dpc_rows(mids)][:, :, None, :]  # (ranks, mids, 1, dpc rows)
        mem = a[0] + d[0]
        rank = np.empty_like(mem)
        for r in range(1, len(a)):
            np.maximum(mem, np.add(a[r], d[r], out=rank), out=mem)
        return mem.transpose(0, 2, 1)

    def _memory_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per mid, the least and the most memory any of its candidates can need: per rank the float32 sum of its
        options' least (most) and its dpc rows' least (most), which bounds every cell's sum (rounding is
        monotone), the largest over the ranks."""
        g, t = self.grid, self.fit
        a = self.mem_rc.reshape(len(g.nz), t.n_opts, 3)
        a_lo, a_hi = a[:, self.opt_rows].min(axis=1), a[:, self.opt_rows].max(axis=1)
        a_lo[g.split], a_hi[g.split] = a[g.split, self.none_row], a[g.split, self.none_row]
        d = self.mem_d[t.dpc_row]
        lo = a_lo + tile_reduce(np.minimum, d, g.dpc0, g.nz)
        hi = a_hi + tile_reduce(np.maximum, d, g.dpc0, g.nz)
        return lo.max(axis=1), hi.max(axis=1)

    def _step(self, mids: np.ndarray) -> np.ndarray:
        """Step (mids, dpc rows, options) of a block, float32, as Tables.step_memory: the dpc row's exposed
        data-parallel traffic and tail once for all its recompute siblings."""
        t = self.t
        a, d = self._gather(t, mids)
        b = t.by_mid[mids][:, None]  # (mids, 1, ranks, Window)
        slot = a[:, None, :, :, Rc.BASE] + d[:, :, None, :, Dpc.MB]
        slot += overlapped_exposed(d[..., Dpc.A1], b[..., Window.TF], d[..., Dpc.B1], t.f_sm)[:, :, None]
        slot += overlapped_exposed(d[..., Dpc.A2], b[..., Window.TB], d[..., Dpc.B2], t.f_sm)[:, :, None]
        tail = (overlapped_exposed(d[..., Dpc.A3], b[..., Window.TB], d[..., Dpc.B3], t.f_sm) + d[..., Dpc.C3]
                + d[..., Dpc.OPT])
        worst = np.maximum(np.maximum(slot[..., 0], slot[..., 1]), slot[..., 2])
        tail = np.maximum(np.maximum(tail[..., 0], tail[..., 1]), tail[..., 2])
        return t.span[mids][:, None, None] * worst + tail[:, :, None]

    def scan(self, limit: float, host_limit: float) -> Scan:
        """Memory of every candidate against the limits: counts, feasible per mid, the smallest plan. A mid whose
        memory bounds lie both within the device limit (or both over it) is counted from its dpc rows' host
        memory alone; only the mids across the limit are summed cell by cell."""
        lim, hlim = below(limit), below(host_limit)
        n = len(self.grid.nz)
        ok_per_mid = np.zeros(n, dtype=np.int64)
        host_fits = np.zeros(n, dtype=bool)  # some dpc row of the mid keeps its offloaded states within the host
        ok_blocks = {}
        feasible = over_memory = over_host = 0
        low, high = self._memory_bounds()
        for mids in self._blocks(np.arange(n)):
            lo, hi = low[mids], high[mids]
            fits_host = self.host_d[self._dpc_rows(mids)] <= hlim  # (mids, dpc rows)
            host_fits[mids] = fits_host.any(axis=1)
            fits_dev = np.zeros(fits_host.shape + (int(self.grid.nr[mids[0]]),), dtype=bool)
            fits_dev[hi <= lim] = True
            across = (lo <= lim) & (hi > lim)
            if across.any():
                fits_dev[across] = self._memory(mids[across]) <= lim
            ok = fits_dev & fits_host[:, :, None]
            ok_blocks[int(self.shape_of[mids[0]])] = (mids, ok)
            ok_per_mid[mids] = ok.reshape(len(mids), -1).sum(axis=1)
            n_fit, n_ok = int(np.count_nonzero(fits_dev)), int(ok_per_mid[mids].sum())  # count_nonzero: ~10x a sum
            feasible += n_ok
            over_memory += fits_dev.size - n_fit
            over_host += n_fit - n_ok  # within the device limit, over the host's
        host_only = bool(host_fits.any())  # else the smallest over all candidates (search.smallest_plan)
        smallest = self._least(np.flatnonzero(host_fits) if host_only else np.flatnonzero(self.grid.counts > 0),
                               low, high, hlim if host_only else np.float32(np.inf))
        return Scan(feasible, over_memory, over_host, ok_per_mid, ok_blocks, smallest)

    def _least(self, mids: np.ndarray, low: np.ndarray, high: np.ndarray, hlim: np.float32) -> int:
        """The candidate of ``mids`` (each with one whose host memory is within ``hlim``) needing the least memory
        among those within ``hlim``, ties to the earlier candidate: only mids whose least bound is within the
        smallest most-bound are summed."""
        best = (np.inf, -1)
        for block in self._blocks(mids[low[mids] <= high[mids].min()]):
            fits_host = self.host_d[self._dpc_rows(block)] <= hlim
            values = np.where(fits_host[:, :, None], self._memory(block), np.inf).reshape(len(block), -1)
            at = np.argmin(values, axis=1)
            least = values[np.arange(len(block)), at]
            i = int(np.argmin(least))  # the block's mids ascend: the first minimum is its earliest candidate
            cand = (float(least[i]), int(self.grid.offset[block[i]] + at[i]))
            if best[1] < 0 or cand < best:
                best = cand
        return best[1]

    def rank(self, scan: Scan, k: int, by_layout: bool) -> Ranked:
        """Price the mids that can hold one of the ``k`` fastest feasible candidates (``by_layout``: or the fastest
        of a layout other than the fastest's): cheapest bound first, a first batch sets the threshold (the k-th best
        step, or the best of another layout if larger), then every mid whose bound is within it."""
        present = np.flatnonzero(scan.ok_per_mid > 0)
        bound = np.full(len(self.grid.nz), np.inf)
        bound[present] = self.bounds(present)
        order = present[np.argsort(bound[present], kind="stable")]
        first = order[:int(np.searchsorted(np.cumsum(scan.ok_per_mid[order]), max(4 * k, FIRST_BATCH))) + 1]
        found = [self._price(first, scan)]
        limit_s = self._threshold(found[0], k, by_layout)
        rest = order[len(first):]
        found.append(self._price(rest[bound[rest] <= limit_s], scan))
        idx, step, mid = (np.concatenate(col) for col in zip(*found))
        return Ranked(idx, step, mid, self.memory_of)

    def bounds(self, mids: np.ndarray) -> np.ndarray:
        """Per mid, a step none of its candidates beats: Tables.lower_bounds' slot (the cheapest recompute option's
        base) plus, per rank, the least parameter work, exposed data-parallel traffic and once-per-step tail of
        its dpc rows, the exposed traffic at its floor b + f (a - b) (cost_comm.overlapped_exposed, whatever
        the window). Each piece is the float32 expression the step adds, or less, and float32 sums and products
        of non-negative terms are monotone, so the bound never exceeds a price ``_step`` computes."""
        t, g = self.t, self.grid
        d = t.by_dpc  # the distinct dpc rows, (rows, ranks, Dpc): the parts once per row, then every dpc row's
        floor = lambda a, b: b + t.f_sm * (a - b) if t.f_sm else b  # noqa: E731  overlapped_exposed's floor
        parts = np.stack([d[..., Dpc.MB], floor(d[..., Dpc.A1], d[..., Dpc.B1]), floor(d[..., Dpc.A2], d[..., Dpc.B2]),
                          floor(d[..., Dpc.A3], d[..., Dpc.B3]) + d[..., Dpc.C3] + d[..., Dpc.OPT]], axis=-1)
        least = tile_reduce(np.minimum, parts[t.dpc_row], g.dpc0[mids], g.nz[mids])  # (mids, ranks, 4)
        base = t.by_rc[..., Rc.BASE].reshape(-1, t.n_opts, 3).min(axis=1)[mids]
        slot = base + least[..., 0]
        slot += least[..., 1]
        slot += least[..., 2]
        worst = np.maximum(np.maximum(slot[:, 0], slot[:, 1]), slot[:, 2])
        tail = least[..., 3]
        return (t.span[mids] * worst + np.maximum(np.maximum(tail[:, 0], tail[:, 1]), tail[:, 2])).astype(float)

    def _price(self, mids: np.ndarray, scan: Scan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(candidate, step float64 as the exhaustive path keeps it, mid) of the feasible candidates of ``mids``."""
        out = [(np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64))]
        for block in self._blocks(np.sort(mids)):
            self.priced_mids[block] = True
            ok = scan.ok(int(self.shape_of[block[0]]), block)
            step = self._step(block)
            cells = ok[0].size
            cand = self.grid.offset[block][:, None, None] + np.arange(cells).reshape(ok.shape[1:])[None]
            out.append((cand[ok], step[ok].astype(float), np.repeat(block, ok.reshape(len(block), -1).sum(axis=1))))
        return tuple(np.concatenate(col) for col in zip(*out))  # type: ignore[return-value]

    def _threshold(self, found: tuple[np.ndarray, ...], k: int, by_layout: bool) -> float:
        """The k-th best step found (inf if fewer), or the best of another layout than the fastest's if larger."""
        idx, step, mid = found
        if len(step) < k:
            return float("inf")
        limit = float(np.partition(step, k - 1)[k - 1])
        if by_layout:
            lay = self.layout[mid]
            others = lay != lay[np.argmin(step)]
            limit = max(limit, float(step[others].min()) if others.any() else float("inf"))
        return limit

    def memory_of(self, idx: np.ndarray) -> np.ndarray:
        """Device memory of candidates ``idx`` (float64 of the float32 sum, as Tables.step_memory)."""
        cols = self.grid.decode(np.asarray(idx, dtype=np.int64))
        t = self.fit
        rows = cols["mid"] * t.n_opts + t.opt_lut[cols["recompute"] * t.opt_width + cols["recompute_every"]]
        mem = t.by_rc[rows][..., Rc.MEM] + t.by_dpc[t.dpc_row[cols["dpc"]]][..., Dpc.MEM]
        return np.maximum(np.maximum(mem[:, 0], mem[:, 1]), mem[:, 2]).astype(float)
