"""Measure collective bandwidth and latency on the live process group and write a cluster spec YAML.

Run under torchrun: ``torchrun --nproc-per-node 4 -m lightning_autopar.cli probe -o cluster.yaml``.
All-reduce, all-gather, reduce-scatter and p2p (ping-pong) are timed at a few message sizes on every topology
level: inside a node (each node's ranks, all nodes at once) and across nodes (the whole world, when there
are several nodes). Figures follow nccl-tests: size is the full buffer, algbw = size / time,
busbw = algbw * 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for p2p (one way).

The YAML (read by ``autopar plan --cluster FILE`` and ``AutoParallelStrategy(cluster=FILE)``) has per level
bandwidth_gbs = the all-reduce bus bandwidth at the largest size (GB/s per device, one direction),
latency_us = the one-way p2p time of the smallest message (alpha; the fastest p2p size, against noise), and efficiency 1 (achieved figures).
Levels not measured (a single node, one device per node) keep the preset's figures. The device comes from
discovery; on CPU it is measured (profile.measure.measure_device, all processes at once): matmul TFLOP/s per
process (fp32, bf16, fp16), copy bandwidth, per-op overhead and memory per process, with efficiency factors 1.
The ``runtime:`` section holds the runtime's fixed costs that need no model (profile.runtime.probe_costs: FSDP2
unit hooks over the world, DTensor dispatch of a TP block over a node's ranks), so the file is a calibrated
cluster file.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import ClusterSpec, LinkSpec, PeakTflops

OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
CPU_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)
GPU_SIZES = (64 << 10, 1 << 20, 16 << 20, 128 << 20)
PATHS_BUDGET_S = 30.0  # the runtime paths' micro-trials (runtime/paths.py: about 8 s on 4 CPU processes here)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "p2p":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def bandwidths(op: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, n)


@dataclass
class Measurement:
    level: str  # node or cluster
    op: str
    ranks: int  # group size (2 for p2p)
    nbytes: int
    seconds: float  # slowest rank's median; p2p: one way
    note: str = ""

    @property
    def algbw_gbs(self) -> float:
        return bandwidths(self.op, self.nbytes, self.seconds, self.ranks)[0]

    @property
    def busbw_gbs(self) -> float:
        return bandwidths(self.op, self.nbytes, self.seconds, self.ranks)[1]


@dataclass
class ProbeResult:
    spec: ClusterSpec
    measurements: list[Measurement] = field(default_factory=list)
    measured_levels: list[str] = field(default_factory=list)
    backend: str = "gloo"
    notes: list[str] = field(default_factory=list)

    def select(self, level: str, op: str) -> list[Measurement]:
        return sorted((m for m in self.measurements if m.level == level and m.op == op), key=lambda m: m.nbytes)


def parse_sizes(text: str) -> list[int]:
    """``"4K,64K,1M"`` -> byte counts."""
    out = []
    for part in (p.strip().upper().removesuffix("B").removesuffix("I") for p in text.split(",")):
        number, unit = (part[:-1], part[-1]) if part and part[-1] in _UNITS else (part, "")
        if not number.isdigit() or int(number) == 0:
            raise ConfigError("--sizes", f"bad size {part!r}", "write e.g. 4K,64K,1M,4M")
        out.append(int(number) * _UNITS[unit])
    return sorted(set(out))


def level_pairs(nodes: Sequence[Sequence[int]], level: str) -> list[tuple[int, int]]:
    """p2p pairs: inside a node, neighbouring local ranks; across nodes, the same local rank on node pairs."""
    if level == "node":
        return [(ranks[i], ranks[i + 1]) for ranks in nodes for i in range(0, len(ranks) - 1, 2)]
    return [(a, b) for k in range(0, len(nodes) - 1, 2) for a, b in zip(nodes[k], nodes[k + 1])]


# --------------------------------------------------------------------------------------------- the probe


def run_probe(sizes: Sequence[int] | None = None, iters: int | None = None, warmup: int = 2,
              check_versions: bool = True) -> ProbeResult:
    """Measure the live process group (every rank calls; every rank gets the same result)."""
    import torch
    import torch.distributed as dist

    from lightning_autopar.topology.discover import cluster_from_records, gather_records, node_layout

    from lightning_autopar.profile.measure import group_device, median_time, p2p_call, time_collective

    backend = dist.get_backend()
    device = group_device(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    records = gather_records()
    base = cluster_from_records(records, versions=check_versions)
    layout = node_layout(records)
    on_cpu = device.type == "cpu"
    sizes = sorted(sizes or (CPU_SIZES if on_cpu else GPU_SIZES))
    iters = iters or (5 if on_cpu else 20)
    levels: list[tuple[str, Any, int]] = []
    if layout.devices_per_node > 1:
        node_group, _ = dist.new_subgroups_by_enumeration(layout.nodes)
        levels.append(("node", node_group, layout.devices_per_node))
    if len(layout.nodes) > 1:
        levels.append(("cluster", dist.group.WORLD, world))
    result = ProbeResult(spec=base, backend=backend, measured_levels=[name for name, _, _ in levels])

    plan: list[Measurement] = []
    local: list[float] = []
    for level, group, n in levels:
        pairs = level_pairs(layout.nodes, level)
        mine = next((p for p in pairs if rank in p), None)
        for op in OPS:
            for size in sizes:
                if op == "p2p":
                    seconds = median_time(p2p_call(mine, rank, size, device), device, None, iters, warmup) / 2
                    plan.append(Measurement(level, op, 2, max(4, size // 4 * 4), 0.0))
                    local.append(seconds if mine else 0.0)
                    continue
                seconds, nbytes, note = time_collective(op, size, n, group, device, iters, warmup)
                local.append(seconds)
                plan.append(Measurement(level, op, n, nbytes, 0.0, note))
    if plan:  # the slowest rank decides each figure
        times = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        for m, seconds in zip(plan, times.tolist()):
            m.seconds = seconds
        result.measurements = plan
    elif world == 1:
        result.notes.append("one process: no links measured (run under torchrun with several processes)")

    device_spec = base.device
    if on_cpu:  # every process at once, as in training; a few 512^3 matmuls, a copy and small ops
        from lightning_autopar.profile.measure import measure_device

        dist.barrier()
        cal = measure_device(device, precisions=("fp32", "bf16-mixed", "fp16-mixed"), sizes=(512,), copy_mib=32)
        tf = cal.matmul_tflops
        figures = torch.tensor([tf["fp32"], tf["bf16-mixed"], tf["fp16-mixed"], cal.memory_bandwidth_gbs,
                                -cal.kernel_overhead_us], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MIN)  # per process, the slowest rank
        fp32, bf16, fp16, copy, overhead = figures.tolist()
        # achieved rates, so the cost model's efficiency factors are 1
        device_spec = dataclasses.replace(
            base.device, peak_tflops=PeakTflops(bf16=round(bf16, 4), fp16=round(fp16, 4), fp32=round(fp32, 4)),
            memory_bandwidth_gbs=round(copy, 2), gemm_efficiency=1.0, memory_efficiency=1.0,
            kernel_overhead_us=round(-overhead, 1))
    result.spec = ClusterSpec(name=f"probed-{base.name.removeprefix('discovered-')}", nodes=base.nodes,
                              devices_per_node=base.devices_per_node, device=device_spec,
                              links=_links(result, base.links))
    if world > 1:  # the runtime's fixed costs on its own paths (runtime/paths.py): a calibrated file
        from lightning_autopar.runtime.paths import measure_paths

        result.spec.runtime = measure_paths(result.spec, device, PATHS_BUDGET_S)[0]
    return result


def _links(result: ProbeResult, preset: Sequence[LinkSpec]) -> list[LinkSpec]:
    """Measured levels from the probe, the preset's figures for the others (node first, then cluster)."""
    links = {link.level: dataclasses.replace(link) for link in preset}
    for level in result.measured_levels:
        reduce = result.select(level, "all_reduce")
        p2p = result.select(level, "p2p")
        links[level] = dataclasses.replace(links.get(level, LinkSpec(level=level)),
                                           bandwidth_gbs=round(reduce[-1].busbw_gbs, 4),
                                           latency_us=round(min(m.seconds for m in p2p) * 1e6, 2), topology="switch",
                                           efficiency=1.0)
    order = ["node", "cluster"] + [name for name in links if name not in ("node", "cluster")]
    return [links[name] for name in order if name in links]


# --------------------------------------------------------------------------------------------- report


def _size(nbytes: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"


def render(result: ProbeResult) -> list[Any]:
    """Rich tables: every measurement, then the link levels and the device written to the spec."""
    from rich.table import Table

    spec = result.spec
    tables = []
    detail = Table(title=f"autopar probe: {spec.nodes} node(s) x {spec.devices_per_node} ranks, {result.backend}")
    for col in ("level", "op", "ranks", "size", "time us", "algbw GB/s", "busbw GB/s", "note"):
        detail.add_column(col, justify="left" if col in ("level", "op", "note") else "right")
    for m in result.measurements:
        detail.add_row(m.level, m.op, str(m.ranks), _size(m.nbytes), f"{m.seconds * 1e6:,.1f}", f"{m.algbw_gbs:.3f}",
                       f"{m.busbw_gbs:.3f}", m.note)
    tables.append(detail)
    links = Table(title=f"cluster spec {spec.name}")
    for col in ("level", "bandwidth_gbs", "latency_us", "source"):
        links.add_column(col)
    for link in spec.links:
        source = "measured" if link.level in result.measured_levels else "preset"
        links.add_row(link.level, f"{link.bandwidth_gbs:g}", f"{link.latency_us:g}", source)
    dev = spec.device
    links.add_row("device", dev.name, f"{dev.memory_gib:g} GiB, {dev.memory_bandwidth_gbs:g} GB/s",
                  f"TFLOP/s fp32 {dev.peak_tflops.fp32:g} bf16 {dev.peak_tflops.bf16:g} fp16 {dev.peak_tflops.fp16:g}")
    rt = spec.runtime
    links.add_row("runtime", "us per occurrence", f"fsdp unit {rt.fsdp_unit_us:g}, tp block {rt.tp_block_us:g}",
                  rt.source or "not measured")
    tables.append(links)
    return tables


def spec_yaml(spec: ClusterSpec, result: ProbeResult | None = None) -> str:
    from lightning_autopar.profile.measure import cluster_yaml

    head = "written by `autopar probe`"
    if result is not None:
        head += f" ({result.backend}; measured levels: {', '.join(result.measured_levels) or 'none'})"
    return cluster_yaml(spec, head)


# --------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default=None, help="write the cluster spec YAML here (atomically)")
    parser.add_argument("--sizes", default=None, help="message sizes, e.g. 4K,64K,1M,4M (default: by device)")
    parser.add_argument("--iters", type=int, default=None, help="timed runs per size (default 5 on CPU, 20 on GPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per size")
    parser.add_argument("--backend", default=None, help="process-group backend (default: nccl, hccl or gloo)")
    parser.add_argument("--no-version-check", action="store_true", help="do not stop on version mismatches")


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from rich.console import Console

    from lightning_autopar.topology.mesh import init_process_group_with_timeout
    from lightning_autopar.files import atomic_write

    sizes = parse_sizes(args.sizes) if args.sizes else None
    if args.iters is not None and args.iters < 1:
        raise ConfigError("--iters", f"must be >= 1, got {args.iters}")
    created = not dist.is_initialized()
    init_process_group_with_timeout(args.backend)
    try:
        result = run_probe(sizes, args.iters, max(0, args.warmup), check_versions=not args.no_version_check)
        if dist.get_rank() == 0:
            console = Console(width=max(110, Console().width))
            for table in render(result):
                console.print(table)
            for note in result.notes:
                console.print(f"note: {note}")
            text = spec_yaml(result.spec, result)
            if args.output:
                atomic_write(args.output, text)
                console.print(f"wrote {args.output}")
            else:
                console.print(text, markup=False, highlight=False)
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()
    return 0
