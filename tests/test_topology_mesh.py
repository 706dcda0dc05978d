"""Mesh placement on node boundaries, the process groups of several plans' meshes in one process, the
process-group timeout and the missing-peer error."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, run_scenarios  # tests/conftest.py
from lightning_autopar.dims import GROUP_DIMS
from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import Plan
from lightning_autopar.topology import mesh


def test_all_group_ranks_and_node_crossing():
    plan = Plan(dp=2, tp=2, pp=2)
    groups = mesh.all_group_ranks(plan)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == groups["dp_flat"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["ep"] == [[0], [1], [2], [3], [4], [5], [6], [7]]
    crossing = mesh.groups_crossing_nodes(plan, 4)
    assert not crossing["tp"] and not crossing["dp"] and crossing["pp"]
    crossing = mesh.groups_crossing_nodes(plan, 2)
    assert not crossing["tp"] and crossing["dp"] and crossing["pp"]
    # a cyclic (non-contiguous) placement: TP pairs straddle the nodes
    cyclic = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.groups_crossing_nodes(plan, cyclic)["tp"] and not mesh.groups_crossing_nodes(plan, cyclic)["dp"]
    assert mesh.nodes_spanned([0, 1, 2, 3], 2) == 2 and mesh.nodes_spanned([6, 7], cyclic) == 2


def test_hybrid_shard_groups():
    plan = Plan(dp=4, zero=3, dp_shard=2, tp=2)
    groups = mesh.all_group_ranks(plan)
    assert groups["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups_crossing_nodes(plan, 4) == {"pp": False, "dp_replicate": True, "dp_shard": False, "cp": False,
                                                   "tp": False, "dp": True, "dp_flat": True, "ep": False}


def test_pg_timeout(monkeypatch):
    monkeypatch.delenv(mesh.PG_TIMEOUT_ENV, raising=False)
    assert mesh.pg_timeout() == timedelta(minutes=30)
    assert mesh.pg_timeout(5) == timedelta(seconds=5)
    monkeypatch.setenv(mesh.PG_TIMEOUT_ENV, "2.5")
    assert mesh.pg_timeout() == timedelta(seconds=2.5)
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv(mesh.PG_TIMEOUT_ENV, bad)
        with pytest.raises(ConfigError, match=mesh.PG_TIMEOUT_ENV):
            mesh.pg_timeout()


def test_rendezvous_check_names_missing_ranks():
    store = dist.HashStore()

    def peer(rank: int) -> threading.Thread:
        thread = threading.Thread(target=mesh.rendezvous_check, args=(store, rank, 4, timedelta(seconds=5), "t/"))
        thread.start()
        return thread

    early = peer(2)
    with pytest.raises(mesh.RendezvousTimeoutError, match=r"ranks 1,3 of 4 did not join within 0.3 s"):
        mesh.rendezvous_check(store, 0, 4, timedelta(seconds=0.3), "t/")
    late = [peer(1), peer(3)]  # the late ones arrive: everybody proceeds
    for thread in [early, *late]:
        thread.join(5)
        assert not thread.is_alive()


@pytest.mark.parametrize("rank, needle", [(0, "rank 1 of 2 did not join"), (1, "rank 0 (the store at 127.0.0.1")])
def test_peer_that_never_arrives(monkeypatch, rank, needle):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv(mesh.PG_TIMEOUT_ENV, "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(mesh.RendezvousTimeoutError, match="AUTOPAR_PG_TIMEOUT") as err:
        mesh.init_process_group_with_timeout("gloo")
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not dist.is_initialized()


def test_missing_master_address(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        mesh.init_process_group_with_timeout("gloo")


EXIT_BUSY = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from lightning_autopar.topology import worker
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
worker.destroy_at_exit()
worker.HEARTBEAT_S = worker.BEAT_GAP_S = 0.0  # the heartbeat thread is always inside a store call
worker.start_heartbeat()
time.sleep(0.3)
"""


def test_exit_while_the_heartbeat_is_in_a_store_call_is_clean():
    """The interpreter exits while the heartbeat thread is busy in store calls: it is stopped and joined at exit,
    so the process exits 0. A daemon thread left there aborts the exit ("terminate called without an active
    exception", -6): pthread_exit in pybind11's GIL re-acquisition, a noexcept frame (8 of 8 runs here)."""
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-c", EXIT_BUSY, str(free_port())], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def mesh_world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, ["mesh_groups"])


def test_plans_built_in_one_process_share_their_groups_by_dimension_and_ranks(mesh_world4):
    """Five plans' meshes built in one world-4 process (tests/dist/scenarios.py mesh_groups; as trials and
    re-planning build them): every dimension of size 1, of every mesh, runs on this rank's one single-rank group,
    and a dimension of several ranks on one group per dimension name and rank set, shared across the meshes
    (topology.mesh.mesh_groups_shared); within a mesh each such dimension has a group of its own, over the ranks the
    planner places it on, and an all-reduce over it sums exactly those ranks."""
    result = torch.load(mesh_world4 / "mesh_groups.pt", weights_only=False)
    assert "crash" not in result, result.get("crash")
    plans = {label: Plan(**fields) for label, fields in result["plans"].items()}
    for rank, view in enumerate(result["views"]):
        seen = view["seen"]
        single = {entry["name"] for entry in seen.values() if entry["ranks"] == [rank]}
        assert len(single) == 1, f"rank {rank}: single-rank groups {single}"
        by_dim: dict = {}
        for (label, dim), entry in seen.items():
            plan = plans[label]
            if dim.startswith("expert_"):
                groups = mesh.ep_group_ranks(plan) if dim == "expert_ep" else None
            else:
                groups = mesh.group_ranks(plan, GROUP_DIMS[dim])
            if groups is not None:
                assert entry["ranks"] == next(g for g in groups if rank in g), (label, dim)
            assert rank in entry["ranks"] and entry["sum"] == sum(entry["ranks"]), (label, dim, entry)
            if len(entry["ranks"]) > 1:
                by_dim.setdefault((dim, tuple(entry["ranks"])), set()).add(entry["name"])
        assert all(len(names) == 1 for names in by_dim.values()), by_dim
        assert seen[("tp2_dp2", "dp_replicate")]["name"] == seen[("cp2_hsdp", "dp_replicate")]["name"]
        for label in plans:  # within one mesh: a group of several ranks (short of the world) per dimension
            names = [e["name"] for (lab, d), e in seen.items() if lab == label and 1 < len(e["ranks"]) < 4]
            assert len(names) == len(set(names)), (label, names)
