"""Cluster discovery from gathered per-rank records (pure: no process group)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import ClusterSpec, DeviceSpec, LinkSpec, PeakTflops
from lightning_autopar.topology import discover as dc
from lightning_autopar.runtime.probe import spec_yaml
from lightning_autopar.topology.discover import table_from_records
from lightning_autopar.topology.ranktable import Device, RankTable, Server

H100 = "NVIDIA H100 80GB HBM3"
VERSIONS = {"torch": "2.13.0", "python": "3.11.9", "cuda": "12.8", "nccl": "2.27.3", "driver": "570.1"}


def records(nodes: int = 2, dpn: int = 4, *, name: str = H100, kind: str = "cuda", same_host: bool = False,
            node_ranks: bool = True) -> list[dc.RankRecord]:
    out = []
    for rank in range(nodes * dpn):
        node, local = divmod(rank, dpn)
        out.append(dc.RankRecord(
            rank=rank, world_size=nodes * dpn, local_rank=local, node_rank=node if node_ranks else 0,
            local_world_size=dpn, environment="torchelastic", hostname="box" if same_host else f"node{node:02d}",
            address="127.0.0.1" if same_host else f"10.0.0.{node + 1}", device_kind=kind, device_name=name,
            device_index=local if kind != "cpu" else None, device_memory_gib=79.1 if kind != "cpu" else 0.0,
            cpu_cores=32, host_memory_gib=2000.0, versions=dict(VERSIONS)))
    return out


def test_two_gpu_nodes_match_the_preset():
    spec = dc.cluster_from_records(records())
    assert (spec.nodes, spec.devices_per_node, spec.world_size) == (2, 4, 8)
    assert spec.name == "discovered-h100-sxm-dgx" and spec.device.name == H100
    assert spec.device.memory_gib == 79.1 and spec.device.peak_tflops.bf16 > 0
    assert [link.level for link in spec.links][0] == "node" and len(spec.links) >= 2


@pytest.mark.parametrize("name, preset", [("NVIDIA A100-SXM4-80GB", "a100-80g-dgx"), (H100, "h100-sxm-dgx"),
                                          ("NVIDIA H200", "h200-sxm-dgx"), ("Ascend910B2", "ascend-910b-atlas"),
                                          ("Tesla T4", None)])
def test_preset_by_device_name(name, preset):
    assert dc.preset_name(name) == preset
    if preset:
        assert dc.load_preset(preset).device.peak_tflops.bf16 > 0  # the YAML, or the built-in fallback


def test_missing_preset_yaml_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CONFIGS", str(tmp_path))  # no presets at all
    spec = dc.cluster_from_records(records())
    assert spec.device.peak_tflops.bf16 == 989 and spec.links[0].bandwidth_gbs == 450
    with pytest.warns(UserWarning, match="no preset"):
        spec = dc.cluster_from_records(records(name="Tesla T4"))
    assert spec.device.name == "Tesla T4" and spec.device.memory_gib == 79.1


def test_two_nodes_on_one_host_are_told_apart_by_node_rank():
    spec = dc.cluster_from_records(records(same_host=True))
    assert (spec.nodes, spec.devices_per_node) == (2, 4)


def test_without_node_rank_hosts_split_the_nodes():
    layout = dc.node_layout(records(3, 2, node_ranks=False))
    assert layout.nodes == [[0, 1], [2, 3], [4, 5]] and layout.hosts == ["node00", "node01", "node02"]
    assert layout.contiguous and layout.node_of(5) == 2


def test_uneven_nodes_and_launcher_disagreement():
    recs = records(2, 2)
    recs[3].hostname, recs[3].node_rank = "node09", 7
    with pytest.raises(ConfigError, match="different numbers of ranks"):
        dc.node_layout(recs)
    recs = records(2, 2)
    for r in recs:
        r.local_world_size = 4
    with pytest.raises(ConfigError, match="the launcher says"):
        dc.node_layout(recs)


def test_non_contiguous_ranks_warn():
    recs = records(2, 2)
    for r in recs:  # cyclic distribution: even ranks on node 0
        r.node_rank, r.hostname = r.rank % 2, f"node{r.rank % 2:02d}"
    with pytest.warns(UserWarning, match="not numbered node by node"):
        layout = dc.node_layout(recs)
    assert layout.nodes == [[0, 2], [1, 3]]


def test_version_mismatch_names_the_ranks():
    recs = records(2, 4)
    for r in recs[4:]:
        r.versions["nccl"] = "2.18.1"
    with pytest.raises(ConfigError) as err:
        dc.cluster_from_records(recs)
    msg = str(err.value)
    assert msg.startswith("versions.nccl: ranks 4-7 differ") and "2.27.3 on ranks 0-3" in msg and "\n" not in msg
    recs = records(1, 3)
    del recs[2].versions["driver"]
    with pytest.raises(ConfigError, match=r"versions.driver: rank 2 differs: 570.1 on ranks 0-1, missing on rank 2"):
        dc.check_versions(recs)
    assert dc.cluster_from_records(recs, versions=False).world_size == 3


def test_cpu_memory_is_per_process_and_probe_links_are_used(tmp_path):
    recs = records(1, 4, name="Intel Xeon", kind="cpu")
    for r in recs:
        r.host_memory_gib = 24.0
    spec = dc.cluster_from_records(recs)
    assert spec.device.memory_gib == 6.0 and spec.nodes == 1 and spec.devices_per_node == 4
    probed = ClusterSpec(name="probed-cpu", devices_per_node=4,
                         device=DeviceSpec(name="cpu", memory_gib=6, peak_tflops=PeakTflops(0.5, 0.1, 0.05)),
                         links=[LinkSpec("node", 0.6, 80.0), LinkSpec("cluster", 0.3, 200.0)])
    path = tmp_path / "probe.yaml"
    path.write_text(spec_yaml(probed))
    spec = dc.cluster_from_records(recs, probe=str(path))
    assert [(link.level, link.bandwidth_gbs) for link in spec.links] == [("node", 0.6), ("cluster", 0.3)]
    assert spec.device.peak_tflops.bf16 == 0.5 and spec.device.memory_gib == 6.0


def test_cpu_processes_beyond_the_cores_share_them():
    full = dc.cluster_from_records(records(1, 4, name="Intel Xeon", kind="cpu"))  # 32 cores, 4 processes
    recs = records(1, 4, name="Intel Xeon", kind="cpu")
    for r in recs:
        r.cpu_cores = 2  # this machine: 4 processes on 2 cores
    shared = dc.cluster_from_records(recs)
    assert shared.device.peak_tflops.fp32 == pytest.approx(full.device.peak_tflops.fp32 / 2)
    assert shared.device.memory_bandwidth_gbs == pytest.approx(full.device.memory_bandwidth_gbs / 2)


def test_mixed_devices_are_refused():
    recs = records(1, 2)
    recs[1].device_name = "NVIDIA A100-SXM4-80GB"
    with pytest.raises(ConfigError, match="different devices"):
        dc.cluster_from_records(recs)


def test_rank_table_is_checked_against_the_live_ranks():
    recs = records(2, 2)
    table = table_from_records(recs)
    dc.cluster_from_records(recs, rank_table=table)  # agrees

    def with_servers(servers):
        return RankTable(servers=servers)

    wrong_size = with_servers([Server("10.0.0.1", [Device(0, 0, "1.1.1.1")])])
    swapped = dataclasses.replace(table, servers=[dataclasses.replace(s, devices=list(s.devices)) for s in table.servers])
    swapped.servers[0].devices[1], swapped.servers[1].devices[0] = swapped.servers[1].devices[0], swapped.servers[0].devices[1]
    wrong_host = with_servers([Server("10.0.0.2", table.servers[0].devices), Server("10.0.0.1", table.servers[1].devices)])
    wrong_device = with_servers([Server("10.0.0.1", [Device(1, 0, "1.1.1.1"), Device(0, 1, "1.1.1.2")]),
                                 table.servers[1]])
    for bad, needle in ((wrong_size, "lists 1 ranks but the run has 4"), (swapped, "run on different nodes"),
                        (wrong_host, "holds ranks of host node00"), (wrong_device, "rank 0 is on device 0")):
        with pytest.raises(ConfigError, match="RANK_TABLE_FILE") as err:
            dc.cluster_from_records(recs, rank_table=bad)
        assert needle in str(err.value)


def test_discover_without_a_process_group(monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK_TABLE_FILE", "SLURM_NTASKS",
                "SLURM_JOB_NAME", "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = dc.discover_cluster()
    assert (spec.nodes, spec.devices_per_node) == (1, 1) and spec.device.memory_gib > 0
    rec = dc.local_record()
    assert rec.versions["torch"] and rec.cpu_cores >= 1 and rec.address.count(".") == 3
    table = tmp_path / "t.json"
    table.write_text(table_from_records([rec]).to_json("hccl"))
    monkeypatch.setenv("RANK_TABLE_FILE", str(table))
    assert dc.discover_cluster(check_versions=False).world_size == 1


def test_rank_ranges():
    assert dc.rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and dc.ranks_text([3]) == "rank 3"
