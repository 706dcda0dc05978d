"""One ParallelDims: a plan's mesh dimensions, named sub-meshes, predicates, strides and groups (pure).

Rank order, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp`` (``MESH_DIMS``). TP is innermost so a
TP group is ``tp`` consecutive ranks, inside one node whenever ``tp <= devices_per_node`` (launchers number ranks
node by node); data-parallel groups stride by ``cp * tp``; pipeline stages are outermost, so stage-to-stage
traffic (the smallest volume) is what crosses the slowest links. An EP group is ``ep`` consecutive data-parallel
ranks; the expert-data-parallel ("edp") ranks holding the same experts are ``ep`` data-parallel ranks apart.

The rules are written once, vectorised over numpy arrays of candidates (``dim_strides``, ``group_placement``,
``runs_plain_ddp``, ``runs_fsdp``): the planner calls them on its candidate arrays, ``ParallelDims`` on one plan's
integers. ``topology/mesh.py`` builds the DeviceMesh and its sub-meshes from a ParallelDims. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import Plan

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Named groups: each MESH_DIMS entry, "dp" (replicate x shard) and "dp_flat" (the same ranks, one dim).
GROUP_DIMS: dict[str, tuple[str, ...]] = {**{d: (d,) for d in MESH_DIMS}, "dp": ("dp_replicate", "dp_shard"),
                                          "dp_flat": ("dp_replicate", "dp_shard")}
# Sub-meshes flattened from the world mesh beyond GROUP_DIMS: FSDP's mesh with context parallelism (torchtitan's
# dp_shard_cp), and the expert meshes carved from "dp_flat" (EXPERT_DIMS).
FLAT_DIMS: dict[str, tuple[str, ...]] = {"dp_flat": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp")}
EXPERT_DIMS = ("edp_replicate", "edp_shard", "ep")


def dim_strides(dp_replicate: Any, dp_shard: Any, cp: Any, tp: Any, ep: Any = 1) -> dict[str, Any]:
    """How many ranks apart neighbours of each named group are, in the rank order above (vectorised over
    candidates). A dimension's stride is the product of the sizes inside it; a group of several adjacent
    dimensions ("dp", "dp_flat", "dp_shard_cp") has its innermost one's stride; "ep" strides like the
    data-parallel ranks it is carved from, "edp" (the ranks holding the same experts) ``ep`` of those apart."""
    cp_s = np.asarray(tp)  # cp groups step over the tp ranks inside them, and so on outwards
    shard_s = cp_s * np.asarray(cp)
    replicate_s = shard_s * np.asarray(dp_shard)
    return {"tp": np.ones_like(cp_s), "cp": cp_s, "dp_shard": shard_s, "dp_replicate": replicate_s,
            "pp": replicate_s * np.asarray(dp_replicate), "dp": shard_s, "dp_flat": shard_s, "dp_shard_cp": cp_s,
            "ep": shard_s, "edp": shard_s * np.asarray(ep)}


def group_placement(size: Any, stride: Any, devices_per_node: Any, nodes: Any = 2) -> tuple[Any, Any]:
    """(members per node, nodes spanned) of a group of ``size`` ranks ``stride`` apart, ranks filling nodes of
    ``devices_per_node`` in order (vectorised; the placement ``ParallelDims.group_ranks`` produces). One node:
    every member is local."""
    size = np.asarray(size, dtype=float)
    per_node = np.where(stride < devices_per_node,
                        np.minimum(size, np.maximum(np.floor(devices_per_node / np.maximum(stride, 1)), 1)), 1)
    if nodes == 1:
        per_node = size
    return per_node, np.ceil(size / per_node)


def runs_plain_ddp(zero: Any, dp: Any, tp: Any, pp: Any, ep: Any, cp: Any, has_moe: Any) -> np.ndarray:
    """Whether the runtime runs plain DDP (``parallel.fsdp.apply_replicate``) rather than FSDP2: zero 0, data
    parallelism alone, no MoE layers. Their collectives and memory differ (the planner's runtime and memory
    terms). Vectorised over candidates."""
    return ((np.asarray(zero) == 0) & (np.asarray(dp) > 1) & (np.asarray(tp) == 1) & (np.asarray(pp) == 1)
            & (np.asarray(ep) == 1) & (np.asarray(cp) == 1) & ~np.asarray(has_moe, dtype=bool))


def runs_fsdp(zero: Any, dp: Any, tp: Any, pp: Any, ep: Any, cp: Any, has_moe: Any) -> np.ndarray:
    """Whether FSDP2 reduces gradients: more than one data-parallel x cp rank and not plain DDP."""
    return ~runs_plain_ddp(zero, dp, tp, pp, ep, cp, has_moe) & (np.asarray(dp) * np.asarray(cp) > 1)


@dataclass(frozen=True)
class ParallelDims:
    """A plan's parallel degrees as a mesh: sizes of MESH_DIMS, ``ep`` and ``zero``; built by ``from_plan``."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    zero: int = 0

    @classmethod
    def from_plan(cls, plan: Plan, world_size: int | None = None) -> ParallelDims:
        """Validate ``plan`` (its fields, the degrees' product against ``world_size`` when given, ep dividing dp;
        one ConfigError naming the field) and lay it out: zero=0 replicates over all of dp, zero>0 shards over
        ``plan.shard_size`` ranks."""
        plan.validate(world_size=world_size)
        if plan.ep < 1 or plan.dp % plan.ep:
            raise ConfigError("plan.ep", f"ep={plan.ep} does not divide dp={plan.dp}", "choose ep dividing dp")
        shard = plan.shard_size
        return cls(pp=plan.pp, dp_replicate=plan.dp // shard, dp_shard=shard, cp=plan.cp, tp=plan.tp, ep=plan.ep,
                   zero=plan.zero)

    # ------------------------------------------------------------------------------------------- sizes

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of MESH_DIMS."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def size(self, name: str) -> int:
        """Ranks in one group along ``name`` (a GROUP_DIMS or FLAT_DIMS key, "ep" or "edp")."""
        if name == "ep":
            return self.ep
        if name == "edp":
            return self.dp // self.ep
        sizes = dict(zip(MESH_DIMS, self.shape))
        return int(np.prod([sizes[d] for d in self._dims_of(name)]))

    @property
    def strides(self) -> dict[str, int]:
        """``dim_strides`` of this plan: each named group's neighbour distance in ranks."""
        return {k: int(v) for k, v in dim_strides(self.dp_replicate, self.dp_shard, self.cp, self.tp,
                                                  self.ep).items()}

    # ------------------------------------------------------------------------------------------- predicates

    def plain_ddp(self, has_moe: bool) -> bool:
        """``runs_plain_ddp`` for this plan on a model with or without MoE layers."""
        return bool(runs_plain_ddp(self.zero, self.dp, self.tp, self.pp, self.ep, self.cp, has_moe))

    def fsdp(self, has_moe: bool) -> bool:
        """``runs_fsdp`` for this plan."""
        return bool(runs_fsdp(self.zero, self.dp, self.tp, self.pp, self.ep, self.cp, has_moe))

    @property
    def cp_on(self) -> bool:
        return self.cp > 1

    @property
    def ep_on(self) -> bool:
        return self.ep > 1

    @property
    def replicates(self) -> bool:
        """Data parallelism replicates across shard groups (HSDP, and DDP as HSDP with shard groups of one)."""
        return self.dp_replicate > 1

    # ------------------------------------------------------------------------------------------- sub-meshes

    @property
    def dp_mesh_name(self) -> tuple[str, ...]:
        """The sub-mesh names the data-parallel wrapper runs over, as a (replicate, shard) pair when it
        replicates, else the shard dimension alone; with cp, the shard dimension is ``dp_shard_cp``."""
        shard = "dp_shard_cp" if self.cp_on else "dp_shard"
        return ("dp_replicate", shard) if self.replicates else (shard,)

    @property
    def expert_shape(self) -> tuple[int, int, int]:
        """Sizes of EXPERT_DIMS carved from "dp_flat": (dp/ep, 1, ep) at zero 0 (replicated like the dense mesh),
        else (1, dp/ep, ep)."""
        edp = self.dp // self.ep
        return (edp, 1, self.ep) if self.zero == 0 else (1, edp, self.ep)

    @property
    def edp_mesh_name(self) -> tuple[str, ...]:
        """FSDP's mesh for the experts: 2-D (replicate, shard of 1) at zero 0, else 1-D (shard). When every expert
        has one holder (dp = ep), the 1-D shard dimension of one rank: the same no-op as replicating over one, and
        each mesh dimension multiplies DTensor's sharding-propagation work on the expert weights (measured:
        ~0.2 s per propagation on the (1, 1, ep, tp) mesh, ~0.02 s on (1, ep, tp))."""
        return ("edp_replicate", "edp_shard") if self.zero == 0 and self.dp > self.ep else ("edp_shard",)

    # ------------------------------------------------------------------------------------------- groups

    @staticmethod
    def _dims_of(name: str) -> tuple[str, ...]:
        dims = GROUP_DIMS.get(name) or FLAT_DIMS.get(name)
        if dims is None:
            raise KeyError(f"no group {name!r}; have {sorted({*GROUP_DIMS, *FLAT_DIMS})}")
        return dims

    def group_ranks(self, dims: tuple[str, ...] | str) -> list[list[int]]:
        """All process groups along ``dims`` (e.g. "tp", or ("dp_replicate", "dp_shard") for the dp group)."""
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        unknown = [d for d in dims if d not in MESH_DIMS]
        if unknown:
            raise ValueError(f"unknown mesh dims {unknown}; known: {MESH_DIMS}")
        shape = self.shape
        strides = dim_strides(self.dp_replicate, self.dp_shard, self.cp, self.tp)
        inner = [MESH_DIMS.index(d) for d in dims]
        outer = [i for i in range(len(shape)) if i not in inner]

        def combos(idx: list[int]) -> list[int]:
            offsets = [0]
            for i in idx:
                offsets = [o + k * int(strides[MESH_DIMS[i]]) for o in offsets for k in range(shape[i])]
            return offsets

        return sorted(sorted(base + off for off in combos(inner)) for base in combos(outer))

    def ep_group_ranks(self) -> list[list[int]]:
        """Expert-parallel groups: ``ep`` consecutive data-parallel ranks, with the same pp, cp and tp
        coordinates."""
        groups = []
        for dp_group in self.group_ranks(GROUP_DIMS["dp"]):
            for i in range(0, len(dp_group), self.ep):
                groups.append(dp_group[i: i + self.ep])
        return sorted(groups)

    def groups(self, name: str) -> list[list[int]]:
        """Every group of a named kind: a GROUP_DIMS or FLAT_DIMS key, or "ep"."""
        return self.ep_group_ranks() if name == "ep" else self.group_ranks(self._dims_of(name))

    def all_group_ranks(self) -> dict[str, list[list[int]]]:
        """Every group of every GROUP_DIMS kind, plus "ep", as the cost model prices them."""
        return {name: self.groups(name) for name in (*GROUP_DIMS, "ep")}

    def placement(self, name: str, devices_per_node: int, nodes: int = 2) -> tuple[int, int]:
        """(members per node, nodes spanned) of a ``name`` group as the planner prices it (``group_placement``)."""
        local, spanned = group_placement(self.size(name), self.strides[name], devices_per_node, nodes)
        return int(local), int(spanned)


def nodes_spanned(ranks: Sequence[int], devices_per_node: int | Sequence[Sequence[int]]) -> int:
    """How many nodes a group's ranks live on: ``devices_per_node`` (ranks numbered node by node) or the ranks
    of each node."""
    if isinstance(devices_per_node, int):
        if devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node}")
        return len({r // devices_per_node for r in ranks})
    where = {rank: i for i, node in enumerate(devices_per_node) for rank in node}
    return len({where[r] for r in ranks})
