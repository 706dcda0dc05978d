"""ParallelDims (lightning_autopar/dims.py): validation, names, strides and groups of a plan's mesh, and its
predicates and placement equal to the vectorised forms the planner prices candidates with."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_autopar.dims import (GROUP_DIMS, MESH_DIMS, ParallelDims, dim_strides, group_placement,
                                    nodes_spanned, runs_fsdp, runs_plain_ddp)
from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import Plan


@pytest.mark.parametrize("plan, world, field", [
    (Plan(dp=2, tp=2), 8, "plan"),  # degrees do not multiply to the world size
    (Plan(dp=4, ep=3), None, "plan.ep"),  # ep does not divide dp
    (Plan(dp=4, zero=3, dp_shard=3), None, "plan.dp_shard"),
    (Plan(dp=2, tp=0), None, "plan.tp"),
])
def test_validation_names_the_field(plan, world, field):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_plan(plan, world_size=world)
    assert err.value.field == field and "\n" not in str(err.value)


def test_names_strides_and_groups():
    dims = ParallelDims.from_plan(Plan(dp=2, tp=2, pp=2), world_size=8)
    assert dims.shape == (2, 2, 1, 1, 2) and dims.world_size == 8 and MESH_DIMS[1] == "dp_replicate"
    assert dims.strides == {"tp": 1, "cp": 2, "dp_shard": 2, "dp_replicate": 2, "pp": 4, "dp": 2, "dp_flat": 2,
                            "dp_shard_cp": 2, "ep": 2, "edp": 2}
    assert dims.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.replicates and dims.dp_mesh_name == ("dp_replicate", "dp_shard") and dims.plain_ddp(False) is False

    hybrid = ParallelDims.from_plan(Plan(dp=4, zero=3, dp_shard=2, cp=2, ep=2))
    assert hybrid.shape == (1, 2, 2, 2, 1)
    assert hybrid.groups("dp_shard_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hybrid.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hybrid.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hybrid.dp_mesh_name == ("dp_replicate", "dp_shard_cp") and hybrid.fsdp(True)
    assert hybrid.expert_shape == (1, 2, 2) and hybrid.edp_mesh_name == ("edp_shard",)

    ddp = ParallelDims.from_plan(Plan(dp=4))
    assert ddp.plain_ddp(False) and not ddp.plain_ddp(True) and not ddp.fsdp(False) and ddp.fsdp(True)
    assert ddp.expert_shape == (4, 1, 1) and ddp.edp_mesh_name == ("edp_replicate", "edp_shard")
    one_holder = ParallelDims.from_plan(Plan(dp=2, ep=2, tp=2, zero=0))  # no replica of an expert to sync with
    assert one_holder.expert_shape == (1, 1, 2) and one_holder.edp_mesh_name == ("edp_shard",)
    with pytest.raises(KeyError):
        ddp.groups("dq")


def _candidates(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    pick = lambda *xs: rng.choice(xs, n)  # noqa: E731
    c = {"tp": pick(1, 2, 4), "pp": pick(1, 2), "cp": pick(1, 2), "zero": pick(0, 1, 2, 3), "dp": pick(1, 2, 4, 8)}
    c["ep"] = np.array([rng.choice([e for e in (1, 2, 4) if dp % e == 0]) for dp in c["dp"]])
    c["dp_shard"] = np.array([rng.choice([s for s in (1, 2, 4, 8) if dp % s == 0]) for dp in c["dp"]])
    c["moe"] = pick(False, True)
    for name in ("tp", "pp", "cp", "ep"):  # a quarter data-parallel alone (plain DDP's candidates)
        c[name][: n // 4] = 1
    return c


def test_predicates_and_strides_match_the_vectorised_planner_form():
    c = _candidates(np.random.default_rng(0), 300)
    ddp = runs_plain_ddp(c["zero"], c["dp"], c["tp"], c["pp"], c["ep"], c["cp"], c["moe"])
    fsdp = runs_fsdp(c["zero"], c["dp"], c["tp"], c["pp"], c["ep"], c["cp"], c["moe"])
    shard = np.where(c["zero"] == 0, 1, c["dp_shard"])
    strides = dim_strides(c["dp"] // shard, shard, c["cp"], c["tp"], c["ep"])
    assert ddp.any() and (~ddp).any()
    for i in range(len(ddp)):
        plan = Plan(dp=int(c["dp"][i]), zero=int(c["zero"][i]), dp_shard=int(c["dp_shard"][i]), tp=int(c["tp"][i]),
                    pp=int(c["pp"][i]), cp=int(c["cp"][i]), ep=int(c["ep"][i]))
        dims = ParallelDims.from_plan(plan)
        assert dims.plain_ddp(bool(c["moe"][i])) == ddp[i] and dims.fsdp(bool(c["moe"][i])) == fsdp[i]
        assert dims.strides == {k: int(v[i]) for k, v in strides.items()}


def test_placement_prices_the_groups_built():
    """group_placement (the planner's group_nodes) gives the nodes the groups of group_ranks really span."""
    c = _candidates(np.random.default_rng(1), 120)
    for i in range(len(c["dp"])):
        plan = Plan(dp=int(c["dp"][i]), zero=int(c["zero"][i]), dp_shard=int(c["dp_shard"][i]), tp=int(c["tp"][i]),
                    pp=int(c["pp"][i]), cp=int(c["cp"][i]), ep=int(c["ep"][i]))
        dims = ParallelDims.from_plan(plan)
        for dpn in (1, 2, 4, 8):
            nodes = -(-dims.world_size // dpn)
            for name in (*GROUP_DIMS, "dp_shard_cp", "ep"):
                spanned = {nodes_spanned(g, dpn) for g in dims.groups(name)}
                assert spanned == {dims.placement(name, dpn, nodes)[1]}, (plan.short(), dpn, name)
    assert [float(x) for x in group_placement(4, 8, 8, 4)] == [1, 4]
