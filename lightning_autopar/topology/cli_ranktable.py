"""`autopar ranktable`: build, validate and convert rank tables (HCCL ``hccl.json``, generic) from hosts, SLURM,
the live run or a file. The CLI sits beside the table code (``topology/ranktable.py``, parsing and building only),
so the table code imports nothing of discovery or process groups.
"""

from __future__ import annotations

import argparse
import os
import sys

from lightning_autopar.errors import ConfigError
from lightning_autopar.files import atomic_write
from lightning_autopar.topology.ranktable import (RankTable, check_ipv4, expand_nodelist, parse_hosts, read_table,
                                                   slurm_devices_per_node, table_from_hosts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--hosts", help="hosts and device counts: 10.0.0.1:8,10.0.0.2:8 (or a,b with --devices-per-node)")
    src.add_argument("--from-env", action="store_true", help="the live run (under torchrun, srun, mpirun)")
    src.add_argument("--from-slurm", nargs="?", const="", default=None, metavar="NODELIST",
                     help="expand NODELIST (default $SLURM_JOB_NODELIST), e.g. node[01-03,07]")
    src.add_argument("--read", metavar="FILE", help="read a table of either format (to convert it)")
    src.add_argument("--validate", metavar="FILE", help="check a table of either format; exit 2 on any defect")
    parser.add_argument("--devices-per-node", type=int, default=None, help="devices per host (--hosts, --from-slurm)")
    parser.add_argument("--device-ip-base", default=None, metavar="A.B.C.D",
                        help="device IPs: rank r gets A.B.C.D + r (default: /etc/hccn.conf, else the host address)")
    parser.add_argument("--no-resolve", action="store_true", help="keep host names; do not resolve them to IPv4")
    parser.add_argument("--format", choices=("hccl", "generic"), default="hccl", help="output format (default hccl)")
    parser.add_argument("-o", "--output", default=None, help="write here (atomically) instead of stdout")


def _from_env(device_ip_base: str | None) -> RankTable | None:
    """Gather the live ranks; the table on rank 0, None elsewhere."""
    import torch.distributed as dist

    from lightning_autopar.topology.discover import gather_records, table_from_records
    from lightning_autopar.topology.mesh import init_process_group_with_timeout

    created = False
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        init_process_group_with_timeout("gloo")
        created = True
    try:
        records = gather_records()
        rank = dist.get_rank() if dist.is_initialized() else 0
        return table_from_records(records, device_ip_base) if rank == 0 else None
    finally:
        if created:
            dist.destroy_process_group()


def build_table(args: argparse.Namespace) -> RankTable | None:
    if args.devices_per_node is not None and args.devices_per_node < 1:
        raise ConfigError("--devices-per-node", f"must be >= 1, got {args.devices_per_node}")
    if args.device_ip_base is not None:
        check_ipv4(args.device_ip_base, "--device-ip-base")
    if args.read:
        return read_table(args.read)
    if args.from_env:
        return _from_env(args.device_ip_base)
    if args.hosts is not None:
        hosts = parse_hosts(args.hosts, args.devices_per_node)
    else:
        nodelist = args.from_slurm or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
        if not nodelist:
            raise ConfigError("SLURM_JOB_NODELIST", "is not set", "run inside a SLURM job or pass --from-slurm NODELIST")
        per_node = args.devices_per_node or slurm_devices_per_node()
        if per_node is None:
            raise ConfigError("--devices-per-node", "unknown (no SLURM_NTASKS_PER_NODE)", "pass --devices-per-node K")
        hosts = [(h, per_node) for h in expand_nodelist(nodelist)]
    return table_from_hosts(hosts, args.device_ip_base, resolve=not args.no_resolve)


def run(args: argparse.Namespace) -> int:
    if args.validate:
        table = read_table(args.validate)
        print(f"{args.validate}: ok ({table.summary()})")
        return 0
    table = build_table(args)
    if table is None:  # a non-zero rank of --from-env
        return 0
    text = table.to_json(args.format)
    if args.output:
        atomic_write(args.output, text)
        print(f"wrote {args.output} ({args.format}: {len(table.servers)} servers x {table.devices_per_node} devices, "
              f"{table.world_size} ranks)")
    else:
        sys.stdout.write(text)
    return 0
