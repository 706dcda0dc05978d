"""Discover the ClusterSpec of the live run: nodes, devices per node, device kind and memory, versions, links.

Every rank builds a :class:`RankRecord` (:func:`local_record`), the records are gathered with
``all_gather_object`` (:func:`gather_records`) and :func:`cluster_from_records` turns them into a ClusterSpec.
That last step is pure, so tests feed it hand-made records without a process group.

Node split: ranks are grouped by (node rank from the launcher, host name). The launcher's node rank
(torchrun ``GROUP_RANK``, ``SLURM_NODEID``, ...) tells two "nodes" on one host apart; the host name tells nodes
apart when the launcher gives no node rank.
"""

from __future__ import annotations

import os
import platform
import socket
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import ClusterSpec, DeviceSpec, LinkSpec, PeakTflops, load_cluster_spec
from lightning_autopar.topology.ranktable import Device, RankTable, Server, device_ip_for, read_table

# Local process count per node as launchers spell it (torchrun, SLURM, Open MPI, MPICH/Intel MPI, MVAPICH, LSF).
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                   "MV2_COMM_WORLD_LOCAL_SIZE", "JSM_NAMESPACE_LOCAL_SIZE")

REGENERATE = "regenerate it with `autopar ranktable --from-env`"

# Device name fragment -> cluster preset (configs/cluster/<preset>.yaml), checked in order.
PRESET_BY_DEVICE = (("H200", "h200-sxm-dgx"), ("H100", "h100-sxm-dgx"), ("A100", "a100-80g-dgx"),
                    ("910B", "ascend-910b-atlas"), ("CPU", "cpu"))

# Used only when a preset YAML is missing: datasheet figures from shared/reference/hardware.md
# (device: memory GiB, bf16/fp16/fp32 TFLOP/s, memory GB/s; links: (GB/s per device one way, latency us)).
# Latencies are rough assumptions; the 910B fp32 figure is assumed (no datasheet value). `autopar probe`
# measures the real links.
_FALLBACK = {
    "a100-80g-dgx": ("NVIDIA A100-SXM4-80GB", 80, (312, 312, 19.5), 2039, ((300, 3), (25, 5))),
    "h100-sxm-dgx": ("NVIDIA H100 SXM5 80GB", 80, (989, 989, 67), 3350, ((450, 3), (50, 5))),
    "h200-sxm-dgx": ("NVIDIA H200 SXM 141GB", 141, (989, 989, 67), 4800, ((450, 3), (50, 5))),
    "ascend-910b-atlas": ("Ascend 910B", 64, (320, 320, 80), 1200, ((56, 5), (25, 10))),
    "cpu": ("cpu", 16, (0.05, 0.05, 0.05), 20, ((2, 30), (1, 100))),
}


@dataclass
class RankRecord:
    """What one rank knows about itself; gathered from every rank."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0
    local_world_size: int | None = None  # the launcher's figure, cross-checked against the grouping
    environment: str = "local"  # torchelastic, slurm, lsf, mpi, lightning, local
    hostname: str = "localhost"
    address: str = "127.0.0.1"  # the IPv4 address this host uses to reach the master
    device_kind: str = "cpu"  # cuda, npu, cpu
    device_name: str = "cpu"
    device_index: int | None = None
    device_ip: str | None = None  # NPU RoCE address (/etc/hccn.conf) when known
    device_memory_gib: float = 0.0  # accelerator memory; 0 on CPU
    cpu_cores: int = 1  # cores this process may run on (affinity)
    host_memory_gib: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def node_key(self) -> tuple[int, str]:
        return (self.node_rank, self.hostname)


@dataclass
class NodeLayout:
    """Ranks per node (nodes ordered by their first rank) with each node's host name and address."""

    nodes: list[list[int]]
    hosts: list[str]
    addresses: list[str]

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def devices_per_node(self) -> int:
        return len(self.nodes[0])

    @property
    def contiguous(self) -> bool:
        """True when ranks are numbered node by node (what mesh placement assumes)."""
        dpn = self.devices_per_node
        return all(ranks == list(range(i * dpn, (i + 1) * dpn)) for i, ranks in enumerate(self.nodes))

    def node_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i
        raise KeyError(rank)


# --------------------------------------------------------------------------------------------- this rank


def _first_int(names: Sequence[str]) -> int | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def launcher_environment() -> tuple[str, int, int, int, int]:
    """(name, global rank, world size, local rank, node rank) from Lightning's cluster environments."""
    from lightning.fabric.plugins.environments import (
        LightningEnvironment,
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, cls in (("torchelastic", TorchElasticEnvironment), ("slurm", SLURMEnvironment),
                          ("lsf", LSFEnvironment), ("mpi", MPIEnvironment)):
            try:
                if cls.detect():
                    env = cls()
                    return name, env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()
            except Exception:  # a half-set environment: try the next one
                continue
        env = LightningEnvironment()
        if "WORLD_SIZE" in os.environ:
            return "lightning", env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()
    return "local", 0, 1, 0, 0


def _route_address() -> str:
    """IPv4 address of the interface that routes to MASTER_ADDR (no packet is sent), else the host's own."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500") or 29500)))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _read_key(path: str, key: str) -> str | None:
    """Value of ``key=value`` in a small text file, or None."""
    try:
        for line in Path(path).read_text().splitlines():
            k, _, v = line.partition("=")
            if k.strip().lower() == key.lower() and v.strip():
                return v.strip()
    except OSError:
        pass
    return None


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _npu():
    try:
        import torch_npu  # noqa: F401
        import torch

        return torch.npu if torch.npu.is_available() else None
    except Exception:
        return None


def collect_versions() -> dict[str, str]:
    """torch, Python, and the accelerator stack (CUDA runtime, NCCL, driver; torch_npu, CANN, driver)."""
    import torch

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        versions["cuda"] = str(torch.version.cuda)
        try:
            versions["nccl"] = ".".join(str(p) for p in torch.cuda.nccl.version())
        except Exception:
            pass
        try:
            text = Path("/proc/driver/nvidia/version").read_text()
            versions["driver"] = text.split("Kernel Module")[1].split()[0]
        except (OSError, IndexError):
            pass
    if _npu() is not None:
        import torch_npu

        versions["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
        cann = _read_key("/usr/local/Ascend/ascend-toolkit/latest/version.cfg", "runtime_running_version")
        if cann:
            versions["cann"] = cann.strip("[]").split(":")[0]  # HCCL ships with CANN
        driver = _read_key("/usr/local/Ascend/driver/version.info", "Version")
        if driver:
            versions["driver"] = driver
    return versions


def local_record() -> RankRecord:
    """This rank's record: launcher ranks, host, address, device and versions."""
    import torch

    env, rank, world, local_rank, node_rank = launcher_environment()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    rec = RankRecord(rank=rank, world_size=world, local_rank=local_rank, node_rank=node_rank,
                     local_world_size=_first_int(LOCAL_SIZE_VARS), environment=env,
                     hostname=socket.gethostname(), address=_route_address(), device_name=_cpu_name(),
                     cpu_cores=cores, host_memory_gib=_host_memory_gib(), versions=collect_versions())
    npu = _npu()
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        rec.device_kind, rec.device_name, rec.device_index = "cuda", props.name, index
        rec.device_memory_gib = props.total_memory / 2**30
    elif npu is not None:
        index = npu.current_device()
        rec.device_kind, rec.device_name, rec.device_index = "npu", npu.get_device_name(index), index
        rec.device_memory_gib = npu.get_device_properties(index).total_memory / 2**30
        rec.device_ip = _read_key("/etc/hccn.conf", f"address_{index}")
    return rec


def gather_records(group: Any = None) -> list[RankRecord]:
    """Every rank's record, in rank order (all ranks must call). Without a process group: this rank only."""
    import torch.distributed as dist

    mine = local_record()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    mine.rank, mine.world_size = dist.get_rank(), dist.get_world_size()
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return sorted(out, key=lambda r: r.rank)


# --------------------------------------------------------------------------------------------- pure part


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    ordered = sorted(set(ranks))
    start = prev = ordered[0] if ordered else 0
    for r in ordered[1:] + [None]:  # type: ignore[operator]
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def ranks_text(ranks: Sequence[int]) -> str:
    """``[3]`` -> ``"rank 3"``, ``[0, 1, 2]`` -> ``"ranks 0-2"``."""
    return f"rank{'s' if len(set(ranks)) > 1 else ''} {rank_ranges(ranks)}"


def check_versions(records: Sequence[RankRecord]) -> None:
    """Raise ConfigError naming the ranks whose torch / NCCL / HCCL / driver versions differ from the rest."""
    keys = sorted({k for r in records for k in r.versions})
    for key in keys:
        by_value: dict[str, list[int]] = defaultdict(list)
        for r in records:
            by_value[r.versions.get(key, "missing")].append(r.rank)
        if len(by_value) > 1:
            groups = sorted(by_value.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
            parts = [f"{value} on {ranks_text(ranks)}" for value, ranks in groups]
            odd = [r for _, ranks in groups[1:] for r in ranks]
            raise ConfigError(f"versions.{key}", f"{ranks_text(odd)} differ{'' if len(odd) > 1 else 's'}: "
                              + ", ".join(parts),
                              f"install the same {key} on all nodes")


def node_layout(records: Sequence[RankRecord]) -> NodeLayout:
    """Group ranks into nodes; raise ConfigError if the ranks are not 0..N-1 or the nodes are uneven."""
    ranks = sorted(r.rank for r in records)
    if ranks != list(range(len(records))):
        raise ConfigError("cluster.ranks", f"gathered ranks {ranks} are not 0..{len(records) - 1}")
    by_node: dict[tuple[int, str], list[RankRecord]] = defaultdict(list)
    for r in records:
        by_node[r.node_key].append(r)
    members = sorted(by_node.values(), key=lambda rs: min(r.rank for r in rs))
    sizes = {len(m) for m in members}
    if len(sizes) > 1:
        detail = ", ".join(f"{m[0].hostname} (node {m[0].node_rank}): {len(m)}" for m in members)
        raise ConfigError("cluster.devices_per_node", f"nodes run different numbers of ranks: {detail}",
                          "launch the same number of processes on every node")
    for m in members:
        hint = {r.local_world_size for r in m if r.local_world_size}
        if hint and hint != {len(m)}:
            raise ConfigError("cluster.devices_per_node", f"the launcher says {sorted(hint)} local processes on "
                              f"{m[0].hostname} (node {m[0].node_rank}) but ranks {rank_ranges([r.rank for r in m])} "
                              "are grouped there", "check the node rank / host name each rank reports")
    layout = NodeLayout(nodes=[sorted(r.rank for r in m) for m in members],
                        hosts=[m[0].hostname for m in members], addresses=[m[0].address for m in members])
    if not layout.contiguous:
        warnings.warn(f"ranks are not numbered node by node ({layout.nodes}); mesh groups assume blocks of "
                      f"{layout.devices_per_node} consecutive ranks per node (use a block distribution)", stacklevel=2)
    return layout


def preset_name(device_name: str) -> str | None:
    """Cluster preset for a device name, e.g. "NVIDIA H100 80GB HBM3" -> "h100-sxm-dgx"."""
    upper = device_name.upper()
    for fragment, preset in PRESET_BY_DEVICE:
        if fragment in upper:
            return preset
    return None


def _fallback_spec(preset: str) -> ClusterSpec:
    name, memory, (bf16, fp16, fp32), bandwidth, links = _FALLBACK[preset]
    levels = [LinkSpec(level=lvl, bandwidth_gbs=bw, latency_us=lat) for lvl, (bw, lat) in zip(("node", "cluster"), links)]
    device = DeviceSpec(name=name, memory_gib=memory, peak_tflops=PeakTflops(bf16, fp16, fp32),
                        memory_bandwidth_gbs=bandwidth)
    return ClusterSpec(name=preset, device=device, links=levels)


def load_preset(preset: str | None) -> ClusterSpec | None:
    """The preset YAML by name; the built-in datasheet figures when the YAML is missing; None if unknown."""
    if preset is None:
        return None
    try:
        return load_cluster_spec(preset)
    except ConfigError:
        return _fallback_spec(preset) if preset in _FALLBACK else None


def cluster_from_records(
    records: Sequence[RankRecord],
    probe: str | ClusterSpec | None = None,
    rank_table: Any = None,
    versions: bool = True,
) -> ClusterSpec:
    """ClusterSpec from gathered records (pure). ``probe``: a cluster YAML written by ``autopar probe``
    (its links, and on CPU its measured device); ``rank_table``: a RankTable checked against the ranks."""
    if not records:
        raise ConfigError("cluster", "no rank records")
    if versions:
        check_versions(records)
    layout = node_layout(records)
    if rank_table is not None:
        check_rank_table(rank_table, layout, records)
    first = records[0]
    kinds = {r.device_kind for r in records}
    names = {r.device_name for r in records}
    if len(kinds) > 1 or (first.device_kind != "cpu" and len(names) > 1):
        raise ConfigError("cluster.device", f"ranks see different devices: {sorted(names)}",
                          "run on one device type (the planner prices one device kind)")
    dpn = layout.devices_per_node
    preset = "cpu" if first.device_kind == "cpu" else preset_name(first.device_name)
    base = load_preset(preset)
    measured = load_cluster_spec(probe) if probe is not None else None
    if measured is not None and (first.device_kind == "cpu" or base is None):
        device = measured.device
    elif base is not None:
        device = base.device
    else:
        warnings.warn(f"no preset for device {first.device_name!r}: peak TFLOP/s unknown; pass cluster=FILE "
                      "or run `autopar probe`", stacklevel=2)
        device = DeviceSpec(name=first.device_name)
    device.name = first.device_name if first.device_kind != "cpu" else device.name
    if first.device_kind == "cpu":  # host memory shared by the processes on that host
        per_host = defaultdict(int)
        for r in records:
            per_host[r.hostname] += 1
        per_process = min(r.host_memory_gib / per_host[r.hostname] for r in records)
        device.memory_gib = round(per_process, 2) or device.memory_gib
        # more processes than cores: each process gets a time slice of a core (preset figures are per core)
        share = min(1.0, min(r.cpu_cores / per_host[r.hostname] for r in records))
        if share < 1.0 and measured is None:
            device.peak_tflops = PeakTflops(**{k: v * share for k, v in vars(device.peak_tflops).items()})
            device.memory_bandwidth_gbs *= share
    else:
        device.memory_gib = round(min(r.device_memory_gib for r in records), 2) or device.memory_gib
    if measured is not None:
        links = measured.links
    elif base is not None:
        links = base.links
    else:
        links = [LinkSpec(level="node"), LinkSpec(level="cluster")]
    label = preset or first.device_name.replace(" ", "-").lower()
    return ClusterSpec(name=f"discovered-{label}", nodes=len(layout.nodes), devices_per_node=dpn,
                       device=device, links=[LinkSpec(**vars(link)) for link in links])


def check_rank_table(table: Any, layout: NodeLayout, records: Sequence[RankRecord]) -> None:
    """Raise ConfigError where a RankTable (RANK_TABLE_FILE) disagrees with the live ranks."""
    field_name = "RANK_TABLE_FILE"
    if table.world_size != layout.world_size:
        raise ConfigError(field_name, f"lists {table.world_size} ranks but the run has {layout.world_size}",
                          REGENERATE)
    if len(table.servers) != len(layout.nodes) or table.devices_per_node != layout.devices_per_node:
        raise ConfigError(field_name, f"has {len(table.servers)} servers x {table.devices_per_node} devices but "
                          f"the run has {len(layout.nodes)} nodes x {layout.devices_per_node}",
                          REGENERATE)
    by_rank = {r.rank: r for r in records}
    for server in table.servers:
        node_ids = {layout.node_of(d.rank_id) for d in server.devices}
        if len(node_ids) > 1:
            raise ConfigError(field_name, f"server {server.server_id} holds ranks "
                              f"{rank_ranges([d.rank_id for d in server.devices])} that run on different nodes",
                              "list each node's ranks under its own server")
        node = node_ids.pop()
        known = {layout.hosts[node], layout.addresses[node]}
        if len(set(layout.addresses)) == len(layout.nodes) and server.server_id not in known:
            raise ConfigError(field_name, f"server {server.server_id} holds ranks of host {layout.hosts[node]} "
                              f"({layout.addresses[node]})", "use the host address as server_id")
        for d in server.devices:
            live = by_rank[d.rank_id]
            index = live.device_index if live.device_index is not None else live.local_rank
            if d.device_id != index:
                raise ConfigError(field_name, f"rank {d.rank_id} is on device {index} but the table says "
                                  f"device_id {d.device_id}", REGENERATE)


def discover_cluster(probe_file: str | None = None, check_versions: bool = True,
                     rank_table_file: str | None = None, group: Any = None) -> ClusterSpec:
    """ClusterSpec of the live run (call on every rank after init_process_group; works without one too).

    ``RANK_TABLE_FILE`` (or ``rank_table_file``) is read and checked against the live ranks; versions are
    compared across ranks unless ``check_versions`` is False. Every rank gets the same spec or the same error.
    """
    records = gather_records(group)
    table_path = rank_table_file or os.environ.get("RANK_TABLE_FILE")
    table = None
    if table_path:

        table = read_table(table_path)
    return cluster_from_records(records, probe=probe_file, rank_table=table, versions=check_versions)


def table_from_records(records: Sequence[Any], device_ip_base: str | None = None) -> RankTable:
    """The rank table of discovered ranks: one server per node, devices in rank order."""
    layout = node_layout(records)
    by_rank = {r.rank: r for r in records}
    servers = []
    for ranks, host, address in zip(layout.nodes, layout.hosts, layout.addresses):
        devices = []
        for local, rank in enumerate(ranks):
            rec = by_rank[rank]
            device_id = rec.device_index if rec.device_index is not None else rec.local_rank
            devices.append(Device(device_id=device_id, rank_id=rank,
                                  device_ip=device_ip_for(device_ip_base, rank, rec.device_ip or address)))
        servers.append(Server(server_id=address, devices=devices, host=host))
    return RankTable(servers=servers, kind="discovered").validate()
