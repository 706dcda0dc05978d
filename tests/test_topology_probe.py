"""Probe arithmetic (nccl-tests bus bandwidth), sizes, pairs, the spec it writes, and a one-process run."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import LinkSpec, load_cluster_spec
from lightning_autopar.runtime import probe
from lightning_autopar.topology.discover import cluster_from_records, local_record


def test_bus_bandwidth_as_nccl_tests_defines_it():
    assert probe.bus_factor("all_reduce", 4) == 1.5
    assert probe.bus_factor("all_gather", 4) == probe.bus_factor("reduce_scatter", 4) == 0.75
    assert probe.bus_factor("p2p", 2) == 1.0
    algbw, busbw = probe.bandwidths("all_reduce", 8_000_000, 0.004, 8)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(3.5)
    with pytest.raises(ValueError):
        probe.bus_factor("broadcast", 2)


def test_parse_sizes():
    assert probe.parse_sizes("512,4K,64k,1M,1MiB") == [512, 4096, 65536, 1 << 20]
    for bad in ("", "4X", "0", "1.5M"):
        with pytest.raises(ConfigError, match="--sizes"):
            probe.parse_sizes(bad)


def test_level_pairs():
    nodes = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert probe.level_pairs(nodes, "node") == [(0, 1), (3, 4), (6, 7)]
    assert probe.level_pairs(nodes, "cluster") == [(0, 3), (1, 4), (2, 5)]


def test_links_from_measurements_and_yaml_roundtrip(tmp_path):
    base = cluster_from_records([local_record()], versions=False)
    result = probe.ProbeResult(spec=base, measured_levels=["node"], measurements=[
        probe.Measurement("node", "all_reduce", 4, 4096, 1e-3), probe.Measurement("node", "all_reduce", 4, 1 << 20, 2e-3),
        probe.Measurement("node", "p2p", 2, 4096, 80e-6), probe.Measurement("node", "p2p", 2, 1 << 20, 1e-3)])
    links = probe._links(result, [LinkSpec("node", 9.0, 9.0, topology="mesh", efficiency=0.5), LinkSpec("cluster", 1, 50)])
    assert links[0].level == "node" and links[0].bandwidth_gbs == pytest.approx(1.5 * (1 << 20) / 2e-3 / 1e9, rel=1e-3)
    assert links[0].latency_us == 80.0 and links[0].efficiency == 1.0 and links[0].topology == "switch"
    assert links[1] == LinkSpec("cluster", 1, 50)  # not measured: the preset's
    result.spec = base
    path = tmp_path / "c.yaml"
    path.write_text(probe.spec_yaml(base, result))
    assert load_cluster_spec(str(path)) == base
    assert len(probe.render(result)) == 2


def test_one_process_probe(monkeypatch, capsys, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    from lightning_autopar import cli

    out = tmp_path / "cpu.yaml"
    assert cli.main(["probe", "-o", str(out), "--sizes", "4K", "--iters", "1"]) == 0
    assert not dist.is_initialized()
    text = capsys.readouterr().out
    assert "one process: no links measured" in text and f"wrote {out}" in text
    spec = load_cluster_spec(str(out))
    assert spec.device.peak_tflops.fp32 > 0 and spec.device.memory_bandwidth_gbs > 0 and spec.world_size == 1
