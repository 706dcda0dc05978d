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
from lightning_autopar.planner.space_table import Grid
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


class GridSearch:
    """Prices an enumerated space's grid on one hardware's tables (``tables``); ``fit``: the tables whose memory
    decides feasibility (a what-if on other links keeps the first search's memory, as the exhaustive path does)."""

    def __init__(self, tables, grid: Grid, fit=None) -> None:
        self.t, self.grid, self.fit = tables, grid, fit or tables
        code = lambda opts: opts[:, 0] * tables.opt_width + opts[:, 1]  # noqa: E731  terms.recompute_rows' code
        self.opt_rows = tables.opt_lut[code(grid.opts)]  # a mid's option rows of by_rc; (none, 1) on a split one
        self.none_row = tables.opt_lut[1]
        self.layout = tables.space.keys["layout"][tables.space.mids["key"]]  # per mid
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
        for s in np.unique(shape):
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

    def _memory(self, mids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Device memory (mids, dpc rows, options) and host memory (mids, dpc rows) of a block, float32."""
        a, d = self._gather(self.fit, mids)
        mem = a[:, None, :, :, Rc.MEM] + d[:, :, None, :, Dpc.MEM]
        host = d[..., Dpc.HOST]
        return (np.maximum(np.maximum(mem[..., 0], mem[..., 1]), mem[..., 2]),
                np.maximum(np.maximum(host[..., 0], host[..., 1]), host[..., 2]))

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
        """Memory of every candidate against the limits: counts, feasible per mid, the smallest plan (the least
        memory among those whose host memory fits, else among all; ties to the earlier candidate)."""
        lim, hlim = below(limit), below(host_limit)
        ok_per_mid = np.zeros(len(self.grid.nz), dtype=np.int64)
        ok_blocks = {}
        feasible = over_memory = over_host = 0
        best = {True: (np.inf, -1), False: (np.inf, -1)}  # host fits: (memory, candidate)
        for mids in self._blocks(np.arange(len(self.grid.nz))):
            mem, host = self._memory(mids)
            fits_dev, fits_host = mem <= lim, (host <= hlim)[:, :, None]
            ok = fits_dev & fits_host
            ok_blocks[int(self.shape_of[mids[0]])] = (mids, ok)
            ok_per_mid[mids] = ok.reshape(len(mids), -1).sum(axis=1)
            feasible += int(ok_per_mid[mids].sum())
            over_memory += int(mem.size - fits_dev.sum())
            over_host += int((fits_dev & ~fits_host).sum())
            for host_ok, values in ((True, np.where(fits_host, mem, np.inf)), (False, mem)):
                values = values.reshape(len(mids), -1)
                at = np.argmin(values, axis=1)
                low = values[np.arange(len(mids)), at]
                i = int(np.argmin(low))  # mids ascend, so the first minimum is the earliest candidate
                cand = int(self.grid.offset[mids[i]] + at[i])
                seen = best[host_ok]
                if seen[1] < 0 or (float(low[i]), cand) < seen:
                    best[host_ok] = (float(low[i]), cand)
        small = best[True] if np.isfinite(best[True][0]) else best[False]
        return Scan(feasible, over_memory, over_host, ok_per_mid, ok_blocks, small[1])

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
        d = t.by_dpc[t.dpc_row]  # every dpc row, (rows, ranks, Dpc)
        floor = lambda a, b: b + t.f_sm * (a - b) if t.f_sm else b  # noqa: E731  overlapped_exposed's floor
        parts = np.stack([d[..., Dpc.MB], floor(d[..., Dpc.A1], d[..., Dpc.B1]), floor(d[..., Dpc.A2], d[..., Dpc.B2]),
                          floor(d[..., Dpc.A3], d[..., Dpc.B3]) + d[..., Dpc.C3] + d[..., Dpc.OPT]], axis=-1)
        starts, at = np.unique(g.dpc0[mids], return_inverse=True)  # a mid's dpc rows: its tile of the dpc table
        least = np.minimum.reduceat(parts, starts, axis=0)[at.reshape(-1)]  # (mids, ranks, 4)
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
