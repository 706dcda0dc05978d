"""The candidate space's factor tables (``Space``): layouts -> keys -> mids and dpcs -> candidates, the columns the
pricing reads. space.py enumerates them; the model forms (forms.py) and the term tables (terms.py) read them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_autopar.specs import OFFLOAD_MODES, PRECISIONS, RECOMPUTE_MODES, SCHEDULES, Plan

LAYOUT_FIELDS = ("tp", "pp", "cp", "dp", "ep")
THINNED_MODES = (RECOMPUTE_MODES.index("full"), RECOMPUTE_MODES.index("ops"))  # modes recompute_every thins out


@dataclass
class Space:
    """The candidate space as factor tables, so shared work is priced once per distinct value:

    layouts (tp, pp, cp, dp, ep) -> keys (+ mbs, sp, compile, precision; ga derived) -> mids (+ schedule, vpp: pipeline
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
        return len(self.cands["mid"])

    def column(self, name: str, idx: Any = slice(None)) -> np.ndarray:
        """A plan field (or ga) for candidates ``idx``, gathered through the factor tables."""
        if name in ("recompute", "recompute_every"):
            return self.cands[name][idx]
        if name in ("zero", "dp_shard", "offload"):
            return self.dpcs[name][self.cands["dpc"][idx]]
        mid = self.cands["mid"][idx]
        if name in ("schedule", "vpp"):
            return self.mids[name][mid]
        key = self.mids["key"][mid]
        if name in self.keys:
            return self.keys[name][key]
        return self.layouts[name][self.keys["layout"][key]]

    def subset(self, idx: Any) -> "Space":
        """Candidates ``idx`` with the factor tables cut down to the rows they use (cheap to price)."""
        cands = {k: v[idx] for k, v in self.cands.items()}
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
                    recompute_every=get("recompute_every"), offload=OFFLOAD_MODES[get("offload")])


def _compact(table: dict[str, np.ndarray], refs: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Rows of ``table`` that ``refs`` points at, and ``refs`` renumbered into them."""
    used, inverse = np.unique(refs, return_inverse=True)
    return {k: v[used] for k, v in table.items()}, inverse.reshape(-1).astype(np.int64)
