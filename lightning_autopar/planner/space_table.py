"""The candidate space's factor tables (``Space``): layouts -> keys -> mids and dpcs -> candidates, the columns the
pricing reads. space.py enumerates them; the model forms (forms.py) and the term tables (terms.py) read them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from lightning_autopar.specs import CP_KINDS, OFFLOAD_MODES, PRECISIONS, RECOMPUTE_MODES, SCHEDULES, Plan

LAYOUT_FIELDS = ("tp", "pp", "cp", "dp", "ep")
THINNED_MODES = (RECOMPUTE_MODES.index("full"), RECOMPUTE_MODES.index("ops"))  # modes recompute_every thins out


@dataclass
class Space:
    """The candidate space as factor tables, so shared work is priced once per distinct value:

    layouts (tp, pp, cp, dp, ep) -> keys (+ mbs, sp, compile, precision, cp_kind; ga derived) -> mids (+ schedule, vpp: pipeline
    stage contents) and dpcs (layout, precision, schedule, vpp, zero, dp_shard, offload: data-parallel traffic and
    model states) -> cands (mid, dpc, recompute, recompute_every). Categorical fields are indices into SCHEDULES,
    OFFLOAD_MODES etc.; dp_shard 0 = all of dp.
    """

    layouts: dict[str, np.ndarray]
    keys: dict[str, np.ndarray]
    mids: dict[str, np.ndarray]
    dpcs: dict[str, np.ndarray]
    cands: dict[str, np.ndarray]
    rejected: Counter = field(default_factory=Counter)
    uneven: bool = True
    partition_precision: int = -1  # the precision of the pipeline partition's layer weights (-1: the first key's)

    @property
    def size(self) -> int:
        grid = self.grid
        return grid.size if grid is not None else len(self.cands["mid"])

    @property
    def grid(self) -> "Grid | None":
        """The candidates' grid per mid (enumerate_space), or None where the columns are explicit (a subset)."""
        return self.cands.grid if isinstance(self.cands, GridColumns) else None

    def cand_columns(self, idx: Any) -> dict[str, np.ndarray]:
        """The candidate-level columns (mid, dpc, recompute, recompute_every) of candidates ``idx``; on a grid decoded
        for those alone, so a few candidates of a large space cost no full column."""
        grid = self.grid
        if grid is not None and not isinstance(idx, slice):
            at = np.asarray(idx, dtype=np.int64)
            cols = grid.decode(at.reshape(-1))
            return {k: v.reshape(at.shape) for k, v in cols.items()}
        return {k: v[idx] for k, v in self.cands.items()}

    def column(self, name: str, idx: Any = slice(None)) -> np.ndarray:
        """A plan field (or ga) for candidates ``idx``, gathered through the factor tables."""
        cand = self.cand_columns(idx)
        if name in ("recompute", "recompute_every"):
            return cand[name]
        if name in ("zero", "dp_shard", "offload"):
            return self.dpcs[name][cand["dpc"]]
        mid = cand["mid"]
        if name in ("schedule", "vpp"):
            return self.mids[name][mid]
        key = self.mids["key"][mid]
        if name in self.keys:
            return self.keys[name][key]
        return self.layouts[name][self.keys["layout"][key]]

    def subset(self, idx: Any) -> "Space":
        """Candidates ``idx`` with the factor tables cut down to the rows they use (cheap to price)."""
        cands = self.cand_columns(idx)
        mids, cands["mid"] = _compact(self.mids, cands["mid"])
        dpcs, cands["dpc"] = _compact(self.dpcs, cands["dpc"])
        keys, mids["key"] = _compact(self.keys, mids["key"])
        layouts, both = _compact(self.layouts, np.concatenate([keys["layout"], dpcs["layout"]]))
        keys["layout"], dpcs["layout"] = both[:len(keys["layout"])], both[len(keys["layout"]):]
        return Space(layouts, keys, mids, dpcs, cands, self.rejected, self.uneven, self.weights_precision())

    def weights_precision(self) -> int:
        """The precision the pipeline partition weighs layers at: the first key's, kept by ``subset`` so that a
        subset prices its candidates exactly as the whole space did."""
        if self.partition_precision >= 0:
            return self.partition_precision
        return int(self.keys["precision"][0]) if len(self.keys["precision"]) else 0

    def plan(self, i: int) -> Plan:
        """The Plan object of candidate ``i``."""
        get = lambda name: int(self.column(name, i))  # noqa: E731
        return Plan(dp=get("dp"), zero=get("zero"), dp_shard=get("dp_shard") or None, tp=get("tp"), sp=bool(get("sp")),
                    pp=get("pp"), schedule=SCHEDULES[get("schedule")], vpp=get("vpp"), ep=get("ep"), cp=get("cp"),
                    mbs=get("mbs"), grad_accum=get("ga"), recompute=RECOMPUTE_MODES[get("recompute")],
                    precision=PRECISIONS[get("precision")], compile=bool(get("compile")),
                    recompute_every=get("recompute_every"), offload=OFFLOAD_MODES[get("offload")],
                    cp_kind=CP_KINDS[get("cp_kind")])


def distinct(values: Any) -> np.ndarray:
    """The sorted distinct values (np.unique), asked with return_index: the plain call reaches np.ma.is_masked,
    and importing numpy.ma costs a fresh ``autopar plan`` process about as much as planning a small model."""
    return np.unique(values, return_index=True)[0]


def _compact(table: dict[str, np.ndarray], refs: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Rows of ``table`` that ``refs`` points at, and ``refs`` renumbered into them."""
    used, inverse = np.unique(refs, return_inverse=True)
    return {k: v[used] for k, v in table.items()}, inverse.reshape(-1).astype(np.int64)


@dataclass
class Grid:
    """The candidates of an enumerated space as a grid per mid, never stored one row each: mid m's candidates are
    its ``nz[m]`` dpc rows (``dpc0[m]`` on) x its ``nr[m]`` recompute options, candidate ``offset[m] + j * nr[m] + r``
    running dpc row ``dpc0[m] + j`` with option ``opts[r]`` ((recompute code, recompute_every)); a mid whose
    schedule splits the backward (``split``) runs (none, 1) only (space.recompute_rule)."""

    dpc0: np.ndarray
    nz: np.ndarray
    nr: np.ndarray
    split: np.ndarray
    opts: np.ndarray

    def __post_init__(self) -> None:
        self.counts = self.nz * self.nr
        self.offset = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    @property
    def size(self) -> int:
        return int(self.offset[-1])

    def decode(self, idx: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Candidate columns (mid, dpc, recompute, recompute_every) of candidates ``idx`` (None: all, in order)."""
        if idx is None:
            mid = np.repeat(np.arange(len(self.nz)), self.counts)
            within = np.arange(len(mid)) - np.repeat(self.offset[:-1], self.counts)
        else:
            mid = np.searchsorted(self.offset, idx, side="right") - 1
            within = idx - self.offset[mid]
        nr = np.maximum(self.nr[mid], 1)
        opt = self.opts[within % nr]
        split = self.split[mid]
        return {"mid": mid, "dpc": self.dpc0[mid] + within // nr, "recompute": np.where(split, 0, opt[:, 0]),
                "recompute_every": np.where(split, 1, opt[:, 1])}


class GridColumns(Mapping):
    """Space.cands of an enumerated space: the grid, decoded into full columns only when a caller reads them (the
    exhaustive path, a space priced one candidate per row); the bounded search reads the grid itself."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self._cols: dict[str, np.ndarray] | None = None

    def _columns(self) -> dict[str, np.ndarray]:
        if self._cols is None:
            self._cols = self.grid.decode()
        return self._cols

    def __getitem__(self, name: str) -> np.ndarray:
        return self._columns()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(("mid", "dpc", "recompute", "recompute_every"))

    def __len__(self) -> int:
        return 4
