"""Two "nodes" on this machine: two torchrun agents x 2 gloo processes, one launch, several scenarios.

Scenarios (rank 0 records every rank's findings): discovery sees 2 x 2; `ranktable --from-env`
writes tables that validate and match the live ranks; RANK_TABLE_FILE is checked (a wrong one is refused on
every rank); a faked version mismatch names the odd rank; build_mesh(tp=2) keeps TP groups inside a node and
matches the priced groups; the probe measures both levels and writes a spec YAML that loads
(tests/dist/multinode_scenarios.py). The same launch then trains on the two nodes (Trainer(devices=2,
num_nodes=2)): DDP, HSDP (shard group inside a node), tp2 x dp2 and
pp2 x dp2, each equal to one device, then a rank of the second node is SIGKILLed under --max-restarts and the run
resumes exactly. The same two nodes as an srun step starts them (plain processes with SLURM_* variables) and
through `fabric run --num-nodes 2 --node-rank 0/1` train equal to one device too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import DIST, ROOT, background_launch, free_port, launch_environ  # tests/conftest.py
from lightning_autopar.specs import load_cluster_spec
from lightning_autopar.topology.ranktable import read_table

pytestmark = pytest.mark.slow  # launches of 2 agents x 2 processes

def two_agents(args: list[str], cwd: Path, timeout: int, restarts: int = 0, fabric: bool = False) -> list[str]:
    """Run ``args`` (a script and its arguments) under two torchrun agents, ``--nnodes 2 --node-rank 0/1`` x 2
    processes with one rendezvous endpoint on localhost, as a user starts a job on two nodes; their logs. With
    ``restarts``, the elastic form a job that survives a lost node uses: the c10d rendezvous, ``--max-restarts``.
    ``fabric``: Lightning's own launcher, ``fabric run --num-nodes 2 --node-rank 0/1`` (no ``--strategy``: the
    script asks for autopar)."""
    port = free_port()
    rendezvous = (["--master-addr", "127.0.0.1", "--master-port", str(port)] if not restarts else
                  ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two_nodes",
                   f"--max-restarts={restarts}"])
    env = {**launch_environ(), "AUTOPAR_PG_TIMEOUT": "60", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RANK_TABLE_FILE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    def command(node: int) -> list[str]:
        if fabric:
            return [str(Path(sys.executable).parent / "fabric"), "run", "--accelerator", "cpu", "--devices", "2",
                    "--num-nodes", "2", "--node-rank", str(node), "--main-address", "127.0.0.1", "--main-port",
                    str(port), *args]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "2", *rendezvous, *args]

    agents = [subprocess.Popen(command(node), cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True) for node in (0, 1)]
    return outputs(agents, timeout)


def outputs(procs: list[subprocess.Popen], timeout: int) -> list[str]:
    """Each process's output once all have ended; any still running after ``timeout`` s is killed with its
    session (its children too)."""
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return logs


# One launch on the two "nodes" (tests/dist/batch.py runs the scenarios as their own files' launches would): first
# what the ranks find about the two nodes (tests/dist/multinode_scenarios.py), then training: plain DDP, HSDP with
# the shard group inside a node, tp2 x dp2 and a pp2 x dp2 pipeline, each against one device; last,
# rank 3 (second node) SIGKILLed after step 5: both agents restart their workers (--max-restarts), the batch skips
# what every rank finished, and the run resumes from its step-4 checkpoint.
TRAINING = ["multinode_scenarios.py:discovery", "scenarios.py:dp_zero0", "scenarios.py:hsdp",
            "scenarios.py:tp2_dp2_zero3", "pp_scenarios.py:pp2_dp2_zero3", "callback_scenarios.py:killed_node1"]


@pytest.fixture(scope="module")
@background_launch
def two_node_training(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_node_training")
    logs = two_agents([str(DIST / "batch.py"), str(out), ",".join(TRAINING)], ROOT, timeout=600, restarts=2)
    for item in TRAINING:
        script, name = item.split(":")
        if not (out / Path(script).stem / f"{name}.pt").exists():
            pytest.fail(f"{item} wrote no result; logs:\n" + "\n".join(log[-4000:] for log in logs))
    return out


@pytest.fixture(scope="module")
def two_nodes(two_node_training) -> tuple[Path, list[dict]]:
    """The findings of the launch's first scenario (tests/dist/multinode_scenarios.py), one per rank."""
    import torch

    out = two_node_training / "multinode_scenarios"
    results = torch.load(out / "discovery.pt", weights_only=False)["results"]
    assert [res["rank"] for res in results] == [0, 1, 2, 3]
    for res in results:
        assert not res["errors"], "\n".join(res["errors"])
    return out, results


def test_discovery_sees_two_by_two(two_nodes):
    _, results = two_nodes
    for res in results:
        assert res["discovery"]["nodes"] == 2 and res["discovery"]["dpn"] == 2
        assert res["discovery"]["layout"] == [[0, 1], [2, 3]]
        assert res["group_rank"] == res["rank"] // 2 and res["local_world_size"] == 2


def test_from_env_tables_validate_and_match_the_ranks(two_nodes):
    out, results = two_nodes
    assert results[0]["ranktable"] == {"hccl": 0, "hccl_validate": 0, "generic": 0, "generic_validate": 0}
    for fmt in ("hccl", "generic"):
        table = read_table(out / f"{fmt}.json")
        assert table.node_groups() == results[0]["discovery"]["layout"]
        assert [[d.device_id for d in s.devices] for s in table.servers] == [[0, 1], [0, 1]]
    for res in results:
        assert res["rank_table_file"]["world"] == 4
        assert "RANK_TABLE_FILE" in res["rank_table_file"]["refused"]  # the swapped table, on every rank


def test_version_mismatch_stops_every_rank_naming_the_odd_one(two_nodes):
    _, results = two_nodes
    for res in results:
        assert res["versions"].startswith("versions.torch: rank 3 differs") and "0.0-fake on rank 3" in res["versions"]


def test_tp_groups_stay_inside_a_node(two_nodes):
    _, results = two_nodes
    for res in results:
        m = res["mesh"]
        assert m["tp"] == m["priced_tp"] == [[0, 1], [2, 3]] and m["dp"] == m["priced_dp"] == [[0, 2], [1, 3]]
        assert res["rank"] in m["my_tp"] and m["my_tp"] in m["tp"]
        assert m["crossing"]["tp"] is False and m["crossing"]["dp"] is True


def test_probe_figures(two_nodes):
    out, results = two_nodes
    probe = results[0]["probe_run"]
    assert probe["levels"] == ["node", "cluster"]
    assert {(m["level"], m["op"]) for m in probe["measurements"]} == {
        (level, op) for level in ("node", "cluster") for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    for m in probe["measurements"]:
        assert m["seconds"] > 0 and m["busbw"] > 0 and m["algbw"] > 0
    series: dict[tuple[str, str], list[dict]] = {}
    for m in probe["measurements"]:
        series.setdefault((m["level"], m["op"]), []).append(m)
    for key, ms in series.items():  # lenient: the 1 MiB message is not far slower per byte than 4 KiB
        small, large = min(ms, key=lambda m: m["nbytes"]), max(ms, key=lambda m: m["nbytes"])
        assert large["busbw"] >= 0.25 * small["busbw"], (key, ms)
    spec = load_cluster_spec(str(out / "probe.yaml"))
    assert (spec.nodes, spec.devices_per_node) == (2, 2) and [link.level for link in spec.links] == ["node", "cluster"]
    assert all(link.bandwidth_gbs > 0 and link.latency_us > 0 for link in spec.links)
    assert spec.device.peak_tflops.fp32 > 0


@pytest.mark.parametrize("name", ["dp_zero0", "hsdp", "tp2_dp2_zero3"])
def test_two_nodes_train_equal_to_one_device(two_node_training, name):
    from common import reference_run
    from test_strategy import assert_equivalent, load

    result = load(two_node_training / "scenarios", name)
    assert result["nodes"] == 2
    assert_equivalent(result, *reference_run())


def test_two_node_pipeline_trains_equal_to_one_device(two_node_training):
    from test_pipeline_expert import reference
    from test_strategy import assert_equivalent, load

    assert_equivalent(load(two_node_training / "pp_scenarios", "pp2_dp2_zero3"), *reference("pp2_dp2_zero3"))


def test_two_node_groups_keep_the_shard_and_tp_groups_inside_a_node(two_node_training):
    from test_strategy import load

    hsdp = load(two_node_training / "scenarios", "hsdp")["groups"]
    assert hsdp["dp_shard"] == [[0, 1], [2, 3]] and hsdp["dp_replicate"] == [[0, 2], [1, 3]]  # HSDP across nodes
    tp = load(two_node_training / "scenarios", "tp2_dp2_zero3")["groups"]
    assert tp["tp"] == [[0, 1], [2, 3]] and tp["dp_shard"] == [[0, 2], [1, 3]]


def test_a_killed_node_restarts_and_resumes_exactly(two_node_training):
    from common import STEPS, reference_run
    from test_strategy import assert_equivalent, load

    from callback_scenarios import KILL_AT

    result = load(two_node_training / "callback_scenarios", "killed_node1")
    assert result["restarts"] >= 1 and result["resumed_from"].endswith("step=00000004")
    assert len(result["losses"]) == STEPS - 4 and KILL_AT > 4
    assert_equivalent(result, *reference_run(), first_step=4)


SLURM_WORKER = textwrap.dedent('''
    import os, sys
    import torch
    sys.path.insert(0, sys.argv[2])
    from scenarios import fit, full_state

    trainer, module, losses, plan = fit("dp=4,zero=3,dp_shard=2")
    state = full_state(module)
    if trainer.global_rank == 0:
        torch.save({"losses": losses, "state": state, "plan": plan, "nodes": trainer.num_nodes,
                    "environment": type(trainer.strategy.cluster_environment).__name__,
                    "groups": trainer.strategy.mesh_layout.groups()}, os.path.join(sys.argv[1], "slurm.pt"))
''')


def _free_port_in(low: int, high: int) -> int:
    import random
    import socket

    for port in random.sample(range(low, high), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


@pytest.fixture(scope="module")
@background_launch
def slurm_step(tmp_path_factory) -> Path:
    """Four tasks started as ``srun --nodes 2 --ntasks-per-node 2 python train.py`` starts them: plain processes,
    each with the SLURM_* variables of its task (no torchrun); Lightning's SLURMEnvironment takes rank and node
    from them and its port from the job id."""
    out = tmp_path_factory.mktemp("slurm_step")
    script = out / "train.py"
    script.write_text(SLURM_WORKER)
    port = _free_port_in(15000, 25000)  # Lightning's SLURM port is 15000 + the job id's last 4 digits
    env = {k: v for k, v in launch_environ().items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", SLURM_JOB_ID=f"7{port - 15000:04d}", SLURM_JOB_NAME="train",
               SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="2", SLURM_JOB_NUM_NODES="2",
               SLURM_NODELIST="127.0.0.1", SLURM_STEP_ID="0")
    tasks = [subprocess.Popen([sys.executable, str(script), str(out), str(DIST)], cwd=out, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2),
                                   "SLURM_NODEID": str(r // 2)}) for r in range(4)]
    logs = outputs(tasks, timeout=300)
    if not (out / "slurm.pt").exists():
        pytest.fail("the srun-style job wrote no result; logs:\n" + "\n".join(log[-3000:] for log in logs))
    return out


def test_srun_style_tasks_train_hsdp_across_two_nodes_equal_to_one_device(slurm_step):
    import torch
    from common import reference_run
    from test_strategy import assert_equivalent

    result = torch.load(slurm_step / "slurm.pt", weights_only=False)
    assert result["environment"] == "SLURMEnvironment" and result["nodes"] == 2
    assert result["groups"]["dp_shard"] == [[0, 1], [2, 3]] and result["groups"]["dp_replicate"] == [[0, 2], [1, 3]]
    assert_equivalent(result, *reference_run())


@pytest.fixture(scope="module")
@background_launch
def fabric_two_nodes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fabric_two_nodes")
    logs = two_agents([str(DIST / "batch.py"), str(out), "ecosystem_scenarios.py:fabric_dp"], ROOT, timeout=300,
                      fabric=True)
    if not (out / "ecosystem_scenarios" / "fabric_dp.pt").exists():
        pytest.fail("fabric run wrote no result; logs:\n" + "\n".join(log[-4000:] for log in logs))
    return out


def test_fabric_run_on_two_nodes_trains_equal_to_one_device(fabric_two_nodes):
    """`fabric run --num-nodes 2 --node-rank 0/1`, the user's Fabric loop with strategy autopar at dp=4 zero=3."""
    from common import reference_run
    from test_strategy import assert_equivalent, load

    result = load(fabric_two_nodes / "ecosystem_scenarios", "fabric_dp")
    assert (result["plan"]["dp"], result["plan"]["zero"]) == (4, 3)
    assert_equivalent(result, *reference_run())
