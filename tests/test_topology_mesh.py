"""Mesh placement on node boundaries, the process-group timeout and the missing-peer error."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from conftest import free_port  # tests/conftest.py
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
