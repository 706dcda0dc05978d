"""What two "nodes" (two torchrun agents x 2 processes, tests/test_topology_multinode.py) find about themselves,
run in the same launch as the training on them (tests/dist/batch.py): discovery sees 2 x 2; `ranktable --from-env`
writes tables that validate; RANK_TABLE_FILE is read (a swapped one is refused on every rank); a faked version
mismatch names the odd rank; build_mesh(tp=2) keeps TP groups inside a node as priced; the probe measures both
levels and writes a spec YAML. Rank 0 records every rank's findings (and the errors of any part) in OUT/discovery.pt.

Usage: torchrun --nnodes 2 ... tests/dist/multinode_scenarios.py OUT_DIR discovery
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))


def discovery_parts(out: Path) -> dict[str, Any]:
    """This rank's findings: one entry per part (its return value), and the tracebacks of the parts that failed."""
    import torch.distributed as dist

    from lightning_autopar import cli
    from lightning_autopar.errors import ConfigError
    from lightning_autopar.files import atomic_write
    from lightning_autopar.runtime import probe
    from lightning_autopar.specs import Plan
    from lightning_autopar.topology import discover
    from lightning_autopar.topology.mesh import build_mesh, group_ranks, groups_crossing_nodes
    from lightning_autopar.topology.ranktable import Device, read_table

    rank = int(os.environ["RANK"])
    res: dict[str, Any] = {"rank": rank, "group_rank": int(os.environ["GROUP_RANK"]),
                           "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "errors": []}

    def part(fn: Callable[[], Any]) -> None:
        try:
            res[fn.__name__] = fn()
        except Exception:
            res["errors"].append(fn.__name__ + ": " + traceback.format_exc())

    def discovery():
        spec = discover.discover_cluster()
        layout = discover.node_layout(discover.gather_records())
        return {"nodes": spec.nodes, "dpn": spec.devices_per_node, "layout": layout.nodes, "name": spec.name}

    def ranktable():
        codes = {}
        for fmt in ("hccl", "generic"):
            path = str(out / f"{fmt}.json")
            codes[fmt] = cli.main(["ranktable", "--from-env", "--format", fmt, "-o", path])
            dist.barrier()
            codes[fmt + "_validate"] = cli.main(["ranktable", "--validate", path])
        return codes

    def rank_table_file():
        os.environ["RANK_TABLE_FILE"] = str(out / "hccl.json")
        ok = discover.discover_cluster().world_size
        del os.environ["RANK_TABLE_FILE"]
        bad = str(out / "swapped.json")
        if rank == 0:  # ranks 1 and 2 trade places across the nodes
            table = read_table(str(out / "hccl.json"))
            a, b = table.servers[0].devices, table.servers[1].devices
            a[1], b[0] = (Device(a[1].device_id, b[0].rank_id, a[1].device_ip),
                          Device(b[0].device_id, a[1].rank_id, b[0].device_ip))
            atomic_write(bad, table.to_json("hccl"))
        dist.barrier()
        try:
            discover.discover_cluster(rank_table_file=bad)
            refused = ""
        except ConfigError as err:
            refused = str(err)
        return {"world": ok, "refused": refused}

    def versions():
        real = discover.collect_versions
        if rank == 3:
            discover.collect_versions = lambda: {**real(), "torch": "0.0-fake"}
        try:
            discover.discover_cluster()
            return ""
        except ConfigError as err:
            return str(err)
        finally:
            discover.collect_versions = real

    def mesh():
        plan = Plan(dp=2, tp=2)
        layout = build_mesh(plan, "cpu")
        nodes = discover.node_layout(discover.gather_records()).nodes
        return {"tp": layout.all_ranks("tp"), "dp": layout.all_ranks("dp"), "my_tp": layout.ranks("tp"),
                "priced_tp": group_ranks(plan, "tp"), "priced_dp": group_ranks(plan, ("dp_replicate", "dp_shard")),
                "crossing": groups_crossing_nodes(plan, nodes)}

    def probe_run():
        result = probe.run_probe(sizes=[4096, 1 << 20], iters=3, warmup=1)
        if rank == 0:
            atomic_write(str(out / "probe.yaml"), probe.spec_yaml(result.spec, result))
        return {"levels": result.measured_levels,
                "measurements": [dict(level=m.level, op=m.op, nbytes=m.nbytes, seconds=m.seconds, busbw=m.busbw_gbs,
                                      algbw=m.algbw_gbs, note=m.note) for m in result.measurements]}

    for fn in (discovery, ranktable, rank_table_file, versions, mesh, probe_run):
        part(fn)
    dist.barrier()
    return res


def run(out: Path, name: str) -> None:
    import torch.distributed as dist

    from lightning_autopar.topology.mesh import init_process_group_with_timeout

    if name != "discovery":
        raise SystemExit(f"unknown scenario {name}")
    if not dist.is_initialized():  # the launch's first scenario; the training after it keeps this group
        init_process_group_with_timeout("gloo")
    from scenarios import record

    res = discovery_parts(out)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    record(out, name, results=gathered)


if __name__ == "__main__":
    from scenarios import main

    main(run)
