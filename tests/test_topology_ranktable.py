"""Rank tables: SLURM nodelists, building, both formats, validation defects (exit 2, one line), atomic writes."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_autopar import cli
from lightning_autopar.errors import ConfigError
from lightning_autopar.files import atomic_write
from lightning_autopar.topology import ranktable as rt


def autopar(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def hccl_table(servers: int = 2, dpn: int = 2) -> dict:
    hosts = [(f"10.0.0.{i + 1}", dpn) for i in range(servers)]
    return rt.table_from_hosts(hosts, device_ip_base="192.168.1.10").to_hccl()


def generic_table(servers: int = 2, dpn: int = 2) -> dict:
    hosts = [(f"10.0.0.{i + 1}", dpn) for i in range(servers)]
    return rt.table_from_hosts(hosts).to_generic()


def write(tmp_path: Path, data, name: str = "table.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


# --------------------------------------------------------------------------------------------- SLURM


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("solo", ["solo"]),
    ("x[1,3],y[002-003]", ["x1", "x3", "y002", "y003"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert rt.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n[3-1]", "n[a-b]", "n]1[", "a,,b", "n[1,1]", "n[[1]]", "n[1-2000000]"])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        rt.expand_nodelist(bad)


def test_slurm_devices_per_node():
    assert rt.slurm_devices_per_node({"SLURM_TASKS_PER_NODE": "8(x2)"}) == 8
    assert rt.slurm_devices_per_node({"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert rt.slurm_devices_per_node({}) is None
    with pytest.raises(ConfigError, match="different task counts"):
        rt.slurm_devices_per_node({"SLURM_TASKS_PER_NODE": "8(x2),4"})


def test_from_slurm_cli(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02]")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    out = tmp_path / "t.json"
    code, _, err = autopar(capsys, "ranktable", "--from-slurm", "--no-resolve", "--format", "generic", "-o", str(out))
    assert code == 0, err
    table = rt.read_table(out)
    assert [s.host for s in table.servers] == ["node01", "node02"] and table.devices_per_node == 4
    # HCCL needs device IPs: unresolved names without --device-ip-base are refused in one line
    code, _, err = autopar(capsys, "ranktable", "--from-slurm", "node[01-02]", "--devices-per-node", "2", "--no-resolve")
    assert code == 2 and "--device-ip-base" in err and len(err.splitlines()) == 1
    code, out_text, _ = autopar(capsys, "ranktable", "--from-slurm", "node[01-02]", "--devices-per-node", "2",
                                "--no-resolve", "--device-ip-base", "192.168.0.254")
    data = json.loads(out_text)
    assert code == 0 and data["server_list"][1]["device"][1]["device_ip"] == "192.168.1.1"  # 254 + 3 crosses an octet


# --------------------------------------------------------------------------------------------- build and read


def test_hosts_build_roundtrip_both_formats(capsys, tmp_path):
    for fmt in ("hccl", "generic"):
        out = tmp_path / f"{fmt}.json"
        code, text, err = autopar(capsys, "ranktable", "--hosts", "10.0.0.1:8,10.0.0.2:8", "--format", fmt, "-o", str(out))
        assert code == 0 and f"wrote {out}" in text, err
        code, text, _ = autopar(capsys, "ranktable", "--validate", str(out))
        assert code == 0 and "2 servers x 8 devices, 16 ranks" in text
        table = rt.read_table(out)
        assert table.node_groups() == [list(range(8)), list(range(8, 16))]
    data = json.loads((tmp_path / "hccl.json").read_text())
    assert data["server_count"] == "2" and data["status"] == "completed" and data["version"] == "1.0"
    assert data["server_list"][1]["device"][0] == {"device_id": "0", "device_ip": "10.0.0.2", "rank_id": "8"}
    generic = json.loads((tmp_path / "generic.json").read_text())
    assert generic["levels"][1] == {"level": "cluster", "groups": [list(range(16))]}
    # convert generic -> hccl
    code, text, _ = autopar(capsys, "ranktable", "--read", str(tmp_path / "generic.json"), "--format", "hccl")
    assert code == 0 and json.loads(text) == data


def test_hosts_with_devices_per_node_and_errors(capsys):
    table = rt.table_from_hosts(rt.parse_hosts("10.0.0.1,10.0.0.2", 4))
    assert table.world_size == 8
    for argv, needle in ((["--hosts", "10.0.0.1:8,10.0.0.2:4"], "uneven device counts"),
                         (["--hosts", "10.0.0.1,10.0.0.2"], "--devices-per-node"),
                         (["--hosts", "10.0.0.1:x"], "bad device count"),
                         (["--hosts", "10.0.0.300:2"], "malformed IPv4"),
                         (["--hosts", "10.0.0.1:2", "--device-ip-base", "255.255.255.255"], "runs past")):
        code, _, err = autopar(capsys, "ranktable", *argv)
        assert code == 2 and needle in err and len(err.splitlines()) == 1, (argv, err)


def _mutate(data: dict, path: tuple, value) -> dict:
    data = copy.deepcopy(data)
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


_DROP = object()


@pytest.mark.parametrize("kind, path, value, needle", [
    ("hccl", ("server_count",), _DROP, "server_count: is missing"),
    ("hccl", ("server_count",), "3", "server_count: says 3 but server_list has 2"),
    ("hccl", ("server_count",), 2, "server_count: must be a string of digits"),
    ("hccl", ("server_list", 0, "device", 1, "rank_id"), 1, "rank_id: must be a string of digits"),
    ("hccl", ("server_list", 1, "device", 0, "rank_id"), "0", "duplicate rank_id 0"),
    ("hccl", ("server_list", 1, "device", 1, "rank_id"), "7", "rank ids must be exactly 0..3"),
    ("hccl", ("server_list", 0, "device", 1, "device_id"), "0", "device_id 0 appears twice"),
    ("hccl", ("server_list", 0, "device", 0, "device_ip"), "192.168.1.256", "malformed IPv4"),
    ("hccl", ("server_list", 0, "server_id"), "10.0.0", "malformed IPv4"),
    ("hccl", ("status",), "initializing", "status"),
    ("hccl", ("version",), "1.2", "unsupported HCCL rank table version"),
    ("hccl", ("server_list", 0, "device"), [], "device: is empty"),
    ("hccl", ("server_list",), {}, "server_list: must be a list"),
    ("generic", ("world_size",), 5, "world_size: says 5"),
    ("generic", ("levels", 0, "groups"), [[0, 2], [1, 3]], "levels: do not match"),
    ("generic", ("nodes", 1, "devices", 0, "rank"), 0, "duplicate rank_id 0"),
    ("generic", ("ranks", 0, "local_rank"), 1, "ranks[0].local_rank"),
    ("generic", ("nodes", 0, "address"), "1.2.3", "malformed IPv4"),
])
def test_validate_defects(capsys, tmp_path, kind, path, value, needle):
    base = hccl_table() if kind == "hccl" else generic_table()
    code, _, err = autopar(capsys, "ranktable", "--validate", write(tmp_path, _mutate(base, path, value)))
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("autopar ranktable: ")


def test_validate_non_json_and_missing(capsys, tmp_path):
    code, _, err = autopar(capsys, "ranktable", "--validate", write(tmp_path, "{not json"))
    assert code == 2 and "not JSON" in err
    code, _, err = autopar(capsys, "ranktable", "--validate", str(tmp_path / "absent.json"))
    assert code == 2 and "cannot read" in err
    code, _, err = autopar(capsys, "ranktable", "--validate", write(tmp_path, "[1, 2]"))
    assert code == 2 and "top level" in err


# --------------------------------------------------------------------------------------------- fuzz

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**12) | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
                         st.sampled_from(["server_count", "server_list", "device", "rank_id", "nodes", "format",
                                          "version", "status"]) | st.text(max_size=6), kids, max_size=4),
                     max_leaves=20)
_BAD_IPS = ["256.0.0.1", "1.2.3", "1.2.3.4.5", "01.2.3.4", "1..2.3", "", " 1.2.3.4", "1.2.3.-4", "10.0.0.1."]
_NULLABLE = {"address", "device_ip"}  # generic fields that may be null


def _paths(obj, prefix=()):
    """(path, value) of every dict entry (recursively)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield prefix + (key,), value
            yield from _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _paths(value, prefix + (i,))


def _other_type(value, nullable: bool):
    choices = [1, "1", 1.5, True, [], {}, None]
    return [c for c in choices if type(c) is not type(value) and not (c is None and nullable)]


@st.composite
def malformed(draw):
    kind = draw(st.sampled_from(["hccl", "generic"]))
    base = (hccl_table if kind == "hccl" else generic_table)(draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    text_base = json.dumps(base, indent=1)
    how = draw(st.sampled_from(["drop", "retype", "duplicate", "bad_ip", "random", "truncate"]))
    entries = [(p, v) for p, v in _paths(base) if isinstance(p[-1], str)]
    if how == "drop":
        path, _ = draw(st.sampled_from(entries))
        return json.dumps(_mutate(base, path, _DROP))
    if how == "retype":
        path, value = draw(st.sampled_from(entries))
        return json.dumps(_mutate(base, path, draw(st.sampled_from(_other_type(value, path[-1] in _NULLABLE)))))
    if how == "duplicate":
        ids = [(p, v) for p, v in entries if p[-1] in ("rank_id", "rank") and "ranks" not in p]
        (a, old), (_, value) = draw(st.sampled_from(ids)), draw(st.sampled_from(ids))
        return json.dumps(_mutate(base, a, value)) if value != old else "[]"
    if how == "bad_ip":
        ips = [p for p, _ in entries if p[-1] in ("device_ip", "server_id", "address", "host")]
        return json.dumps(_mutate(base, draw(st.sampled_from(ips)), draw(st.sampled_from(_BAD_IPS))))
    if how == "random":
        return json.dumps(draw(_JSON))
    return text_base[: draw(st.integers(0, len(text_base) - 2))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=malformed())
def test_fuzz_malformed_tables_exit_2_with_one_line(capsys, tmp_path, text):
    code, out, err = autopar(capsys, "ranktable", "--validate", write(tmp_path, text))
    assert code == 2, (text, out)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and err.startswith("autopar ranktable: ")


# --------------------------------------------------------------------------------------------- atomic write


def test_atomic_write_never_leaves_half_a_file(tmp_path, monkeypatch):
    target = tmp_path / "t.json"
    atomic_write(target, "old\n")
    assert target.read_text() == "old\n" and oct(target.stat().st_mode & 0o777) != "0o600"

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write(target, "new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # the temp file is gone
    with pytest.raises(ConfigError, match="cannot write"):
        atomic_write(tmp_path / "missing-dir" / "t.json", "x")
