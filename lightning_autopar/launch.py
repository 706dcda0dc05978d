"""Environment variables a plan wants from the launcher: suggested, printed with the plan, never set.

``env_hints(plan, cluster)`` is pure: it maps a plan and the cluster it runs on to ``{NAME: value}`` for the
collective library (NCCL on NVIDIA GPUs, HCCL on Ascend NPUs, gloo on CPUs) and for autopar's own process-group
timeout. ``format_env_hints`` renders them as ``export`` lines with the reason for each, marking the ones the
environment already sets. The strategies print them on rank 0 after the plan table; the launch scripts under
``examples/launch/`` show where to put them (docs/launching.md).
"""

from __future__ import annotations

import os
from typing import Mapping

from lightning_autopar.specs import ClusterSpec, Plan

# Why each hint exists (printed beside it).
REASONS = {
    "AUTOPAR_PG_TIMEOUT": "process-group timeout in seconds: several nodes take longer to rendezvous and to run the "
                          "first (compiling, allocating) step",
    "NCCL_SOCKET_IFNAME": "bootstrap NCCL over the interface that reaches the other nodes, not loopback/docker",
    "CUDA_DEVICE_MAX_CONNECTIONS": "one hardware queue keeps tensor-parallel collectives ordered ahead of the "
                                   "compute they overlap with (Megatron's setting for tp > 1)",
    "HCCL_SOCKET_IFNAME": "HCCL's host-side bootstrap interface towards the other servers",
    "HCCL_CONNECT_TIMEOUT": "seconds HCCL waits for peers to connect (default 120): too short for several servers",
    "HCCL_ALGO": "hierarchical collectives: HCCL's choice inside a server, halving-doubling between servers",
    "GLOO_SOCKET_IFNAME": "gloo picks the hostname's interface by default; use the one that reaches MASTER_ADDR",
}


def backend_for(cluster: ClusterSpec) -> str:
    """The collective library a cluster's devices use: ``nccl``, ``hccl`` or ``gloo``."""
    name = cluster.device.name.lower()
    if "ascend" in name or "910" in name or "npu" in name:
        return "hccl"
    if name.startswith("cpu") or "cpu" in name.split("-"):
        return "gloo"
    return "nccl"


def _route_interface() -> str | None:
    """Name of the local interface that routes to $MASTER_ADDR (Linux; None if unknown or loopback)."""
    import fcntl
    import socket
    import struct

    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500") or 29500)))
            address = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                if socket.inet_ntoa(packed[20:24]) == address:
                    return None if name == "lo" else name
    except OSError:
        return None
    return None


def env_hints(plan: Plan, cluster: ClusterSpec, interface: str | None = None) -> dict[str, str]:
    """Suggested environment for running ``plan`` on ``cluster``: {variable: value}. Pure apart from reading the
    route to $MASTER_ADDR when ``interface`` is not given (multi-node only). Never sets anything."""
    hints: dict[str, str] = {}
    backend = backend_for(cluster)
    multi_node = cluster.nodes > 1
    if multi_node:
        interface = interface or _route_interface()
        hints["AUTOPAR_PG_TIMEOUT"] = "1800"
    if backend == "nccl":
        if multi_node:
            hints["NCCL_SOCKET_IFNAME"] = interface or "^lo,docker"
        if plan.tp > 1:
            hints["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    elif backend == "hccl":
        if multi_node:
            hints["HCCL_SOCKET_IFNAME"] = interface or "^lo,docker"
            hints["HCCL_CONNECT_TIMEOUT"] = "1200"
            hints["HCCL_ALGO"] = "level0:NA;level1:H-D_R"
    elif multi_node and interface:
        hints["GLOO_SOCKET_IFNAME"] = interface
    return hints


def format_env_hints(hints: Mapping[str, str], environ: Mapping[str, str] | None = None) -> list[str]:
    """``export NAME=value  # why`` per hint; ones already in the environment are marked, not repeated."""
    environ = os.environ if environ is None else environ
    lines = []
    for name, value in hints.items():
        reason = REASONS.get(name, "")
        if name in environ:
            state = "as suggested" if environ[name] == value else f"suggested {value}"
            lines.append(f"# {name}={environ[name]} already set ({state})")
        else:
            lines.append(f"export {name}='{value}'" + (f"  # {reason}" if reason else ""))
    return lines


def print_env_hints(plan: Plan, cluster: ClusterSpec) -> None:
    """Print the plan's environment hints (if any) under a heading; called on rank 0 with the plan table."""
    lines = format_env_hints(env_hints(plan, cluster))
    if lines:
        print("autopar: environment this plan wants (set it in the launch script; autopar sets nothing):")
        for line in lines:
            print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_autopar.launch --cluster C --nodes N [--devices-per-node K] [--plan "tp=8,dp=4"]``:
    print the hints as ``export`` lines before launching (the strategies print them again with the plan)."""
    import argparse
    import sys

    from lightning_autopar.errors import AutoparError
    from lightning_autopar.specs import load_cluster_spec, parse_fix

    parser = argparse.ArgumentParser(prog="python -m lightning_autopar.launch", description=main.__doc__)
    parser.add_argument("--cluster", required=True, help="cluster preset or YAML")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--devices-per-node", type=int, default=None)
    parser.add_argument("--plan", default=None, help="plan fields, e.g. 'tp=8,dp=4' (default: dp over all devices)")
    args = parser.parse_args(argv)
    try:
        cluster = load_cluster_spec(args.cluster, nodes=args.nodes, devices_per_node=args.devices_per_node)
        fields = parse_fix(args.plan)
        fields.setdefault("dp", cluster.world_size // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)))
        plan = Plan(**fields)
    except AutoparError as err:
        print(f"autopar launch: {err}", file=sys.stderr)
        return err.exit_code
    for line in format_env_hints(env_hints(plan, cluster)):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
