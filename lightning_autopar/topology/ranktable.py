"""Build, read, validate and write rank tables (HCCL v1.0 hccl.json and a generic form).

Sources: ``--hosts 10.0.0.1:8,10.0.0.2:8`` (or ``--hosts a,b --devices-per-node 8``), ``--from-slurm``
(SLURM_JOB_NODELIST, or a nodelist given after the flag, e.g. ``node[01-03,07]``), ``--from-env`` (the live run
under torchrun: every rank reports its host and device), ``--read FILE`` (convert between formats).
``--validate FILE`` checks a table of either format: every defect exits 2 with one line naming it.

Ranks are numbered node by node; device_id is the local index. Host names are resolved to IPv4 with the
system resolver (``--no-resolve`` keeps names; names that do not resolve stay names). Device IPs (the NPU RoCE
addresses HCCL needs) come from ``--device-ip-base A.B.C.D`` (rank r gets base + r), else from /etc/hccn.conf
on the live ranks (``--from-env`` on Ascend), else the host address stands in for them.

HCCL v1.0 (strings everywhere, as in real hccl.json)::

    {"server_count": "2", "server_list": [{"server_id": "10.0.0.1",
      "device": [{"device_id": "0", "device_ip": "192.168.1.10", "rank_id": "0"}, ...]}, ...],
     "status": "completed", "version": "1.0"}

Generic (``"format": "autopar-ranktable"``): world_size, devices_per_node, nodes [{node, host, address,
devices [{device_id, rank, device_ip}]}], ranks [{rank, node, local_rank, device_id}] and link levels
[{level: node, groups}, {level: cluster, groups}] (the groups of ranks that share each link level).

The command (``autopar ranktable``) is ``topology/cli_ranktable.py``; tables of discovered ranks come from
``topology.discover.table_from_records``. This module imports neither.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import socket
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from lightning_autopar.errors import ConfigError

GENERIC_FORMAT = "autopar-ranktable"
MAX_NODES = 100_000
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")  # one dot-separated part of a host name
_DIGITS = re.compile(r"0|[1-9][0-9]{0,8}")


@dataclass
class Device:
    device_id: int
    rank_id: int
    device_ip: str | None = None


@dataclass
class Server:
    server_id: str  # the host address (or name)
    devices: list[Device] = field(default_factory=list)
    host: str | None = None


@dataclass
class RankTable:
    servers: list[Server]
    kind: str = "hccl"  # the format it was read from

    @property
    def world_size(self) -> int:
        return sum(len(s.devices) for s in self.servers)

    @property
    def devices_per_node(self) -> int:
        return len(self.servers[0].devices) if self.servers else 0

    def node_groups(self) -> list[list[int]]:
        return [sorted(d.rank_id for d in s.devices) for s in self.servers]

    def levels(self) -> list[dict[str, Any]]:
        """Groups of ranks sharing each link level, inside out (cluster only when there are several nodes)."""
        out = [{"level": "node", "groups": self.node_groups()}]
        if len(self.servers) > 1:
            out.append({"level": "cluster", "groups": [list(range(self.world_size))]})
        return out

    def summary(self) -> str:
        return f"{self.kind}, {len(self.servers)} servers x {self.devices_per_node} devices, {self.world_size} ranks"

    def validate(self) -> RankTable:
        """Semantic checks shared by both formats; raise ConfigError naming the first defect."""
        if not self.servers:
            raise ConfigError("server_list", "is empty", "list at least one server")
        seen: dict[int, str] = {}
        for i, server in enumerate(self.servers):
            check_host(server.server_id, f"server_list[{i}].server_id")
            if not server.devices:
                raise ConfigError(f"server_list[{i}].device", "is empty", "list the server's devices")
            ids: set[int] = set()
            for j, dev in enumerate(server.devices):
                where = f"server_list[{i}].device[{j}]"
                if dev.device_id in ids:
                    raise ConfigError(f"{where}.device_id", f"device_id {dev.device_id} appears twice on server "
                                      f"{server.server_id}", "give each device of a server its own device_id")
                ids.add(dev.device_id)
                if dev.rank_id in seen:
                    raise ConfigError(f"{where}.rank_id", f"duplicate rank_id {dev.rank_id} (also at {seen[dev.rank_id]})",
                                      "give every device its own rank_id")
                seen[dev.rank_id] = where
                if dev.device_ip is not None:
                    check_ipv4(dev.device_ip, f"{where}.device_ip")
        n = len(seen)
        if set(seen) != set(range(n)):
            missing = sorted(set(range(n)) - set(seen))[:5]
            extra = sorted(set(seen) - set(range(n)))[:5]
            raise ConfigError("rank_id", f"rank ids must be exactly 0..{n - 1}; missing {missing}, unexpected {extra}",
                              "number the ranks 0..N-1 without gaps")
        counts = [len(s.devices) for s in self.servers]
        if len(set(counts)) > 1:
            detail = ", ".join(f"{s.server_id}: {len(s.devices)}" for s in self.servers[:8])
            raise ConfigError("server_list", f"uneven device counts ({detail})",
                              "give every server the same number of devices")
        return self

    # ------------------------------------------------------------------------------------------ writers

    def to_hccl(self) -> dict[str, Any]:
        servers = []
        for server in self.servers:
            devices = []
            for dev in server.devices:
                if dev.device_ip is None:
                    raise ConfigError("device_ip", f"unknown for rank {dev.rank_id} (host {server.server_id} has no "
                                      "IPv4 address)", "pass --device-ip-base A.B.C.D or resolvable host names")
                devices.append({"device_id": str(dev.device_id), "device_ip": dev.device_ip,
                                "rank_id": str(dev.rank_id)})
            servers.append({"server_id": server.server_id, "device": devices})
        return {"server_count": str(len(self.servers)), "server_list": servers, "status": "completed",
                "version": "1.0"}

    def to_generic(self) -> dict[str, Any]:
        nodes, ranks = [], []
        for i, server in enumerate(self.servers):
            address = server.server_id if is_ipv4(server.server_id) else None
            nodes.append({"node": i, "host": server.host or server.server_id, "address": address,
                          "devices": [{"device_id": d.device_id, "rank": d.rank_id, "device_ip": d.device_ip}
                                      for d in server.devices]})
            ranks += [{"rank": d.rank_id, "node": i, "local_rank": j, "device_id": d.device_id}
                      for j, d in enumerate(server.devices)]
        return {"format": GENERIC_FORMAT, "version": 1, "world_size": self.world_size,
                "devices_per_node": self.devices_per_node, "nodes": nodes,
                "ranks": sorted(ranks, key=lambda r: r["rank"]), "levels": self.levels()}

    def to_json(self, fmt: str) -> str:
        data = self.to_hccl() if fmt == "hccl" else self.to_generic()
        return json.dumps(data, indent=2) + "\n"


# --------------------------------------------------------------------------------------------- checks


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def is_ipv4(text: Any) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except (ipaddress.AddressValueError, ValueError, TypeError):
        return False


def check_ipv4(text: Any, where: str) -> str:
    if not isinstance(text, str) or not is_ipv4(text):
        raise ConfigError(where, f"malformed IPv4 address {_show(text)}", "write four dot-separated numbers 0..255")
    return text


def check_host(text: str, where: str) -> str:
    """An IPv4 address, or a host name (anything made only of digits and dots must be a valid IPv4)."""
    if re.fullmatch(r"[0-9.]+", text):
        return check_ipv4(text, where)
    if len(text) > 253 or not all(_LABEL.fullmatch(label) for label in text.split(".")):
        raise ConfigError(where, f"{_show(text)} is neither an IPv4 address nor a host name",
                          "use the host's IPv4 address")
    return text


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(where, f"must be a JSON object, got {_show(value)}")
    return value


def _get(obj: dict[str, Any], key: str, where: str, types: tuple[type, ...], what: str) -> Any:
    path = f"{where}.{key}" if where else key
    if key not in obj:
        raise ConfigError(path, "is missing", f"add {key} ({what})")
    value = obj[key]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ConfigError(path, f"must be {what}, got {_show(value)}")
    return value


def _digits(obj: dict[str, Any], key: str, where: str) -> int:
    """An HCCL id: a string of decimal digits ("0", "15")."""
    value = _get(obj, key, where, (str,), 'a string of digits like "0"')
    if not _DIGITS.fullmatch(value):
        raise ConfigError(f"{where}.{key}" if where else key, f"must be a string of digits like \"0\", got {_show(value)}")
    return int(value)


def _int(obj: dict[str, Any], key: str, where: str) -> int:
    value = _get(obj, key, where, (int,), "an integer")
    if value < 0:
        raise ConfigError(f"{where}.{key}", f"must be >= 0, got {value}")
    return value


def _list(obj: dict[str, Any], key: str, where: str, what: str) -> list[Any]:
    value = _get(obj, key, where, (list,), f"a list of {what}")
    if not value:
        raise ConfigError(f"{where}.{key}" if where else key, "is empty", f"list the {what}")
    return value


# --------------------------------------------------------------------------------------------- readers


def parse_hccl(data: dict[str, Any]) -> RankTable:
    version = _get(data, "version", "", (str,), 'the string "1.0"')
    if version != "1.0":
        raise ConfigError("version", f"unsupported HCCL rank table version {_show(version)}", 'use version "1.0"')
    status = _get(data, "status", "", (str,), 'the string "completed"')
    if status != "completed":
        raise ConfigError("status", f"is {_show(status)}, not \"completed\"", "write the finished table")
    count = _digits(data, "server_count", "")
    servers = []
    for i, raw in enumerate(_list(data, "server_list", "", "servers")):
        where = f"server_list[{i}]"
        item = _obj(raw, where)
        server_id = check_host(_get(item, "server_id", where, (str,), "the host IPv4 address"), f"{where}.server_id")
        devices = []
        for j, raw_dev in enumerate(_list(item, "device", where, "devices")):
            dwhere = f"{where}.device[{j}]"
            dev = _obj(raw_dev, dwhere)
            devices.append(Device(device_id=_digits(dev, "device_id", dwhere), rank_id=_digits(dev, "rank_id", dwhere),
                                  device_ip=check_ipv4(_get(dev, "device_ip", dwhere, (str,), "an IPv4 address"),
                                                       f"{dwhere}.device_ip")))
        servers.append(Server(server_id=server_id, devices=devices))
    if count != len(servers):
        raise ConfigError("server_count", f"says {count} but server_list has {len(servers)} servers",
                          f'set server_count to "{len(servers)}"')
    return RankTable(servers=servers, kind="hccl").validate()


def parse_generic(data: dict[str, Any]) -> RankTable:
    fmt = _get(data, "format", "", (str,), f'"{GENERIC_FORMAT}"')
    if fmt != GENERIC_FORMAT:
        raise ConfigError("format", f"unknown format {_show(fmt)}", f'use "{GENERIC_FORMAT}"')
    if _get(data, "version", "", (int,), "the integer 1") != 1:
        raise ConfigError("version", f"unsupported version {_show(data['version'])}", "use 1")
    servers = []
    for i, raw in enumerate(_list(data, "nodes", "", "nodes")):
        where = f"nodes[{i}]"
        node = _obj(raw, where)
        if _int(node, "node", where) != i:
            raise ConfigError(f"{where}.node", f"is {node['node']}, expected {i}", "number the nodes 0..N-1 in order")
        host = check_host(_get(node, "host", where, (str,), "the host name"), f"{where}.host")
        address = _get(node, "address", where, (str, type(None)), "an IPv4 address or null")
        if address is not None:
            check_ipv4(address, f"{where}.address")
        devices = []
        for j, raw_dev in enumerate(_list(node, "devices", where, "devices")):
            dwhere = f"{where}.devices[{j}]"
            dev = _obj(raw_dev, dwhere)
            ip = _get(dev, "device_ip", dwhere, (str, type(None)), "an IPv4 address or null")
            devices.append(Device(device_id=_int(dev, "device_id", dwhere), rank_id=_int(dev, "rank", dwhere),
                                  device_ip=None if ip is None else check_ipv4(ip, f"{dwhere}.device_ip")))
        servers.append(Server(server_id=address or host, devices=devices, host=host))
    table = RankTable(servers=servers, kind="generic").validate()
    for key, actual in (("world_size", table.world_size), ("devices_per_node", table.devices_per_node)):
        if _int(data, key, "") != actual:
            raise ConfigError(key, f"says {data[key]} but the nodes hold {actual}", f"set {key} to {actual}")
    expected = table.to_generic()
    ranks = _get(data, "ranks", "", (list,), "a list of {rank, node, local_rank, device_id}")
    if len(ranks) != len(expected["ranks"]):
        raise ConfigError("ranks", f"has {len(ranks)} entries for {table.world_size} ranks", "list every rank once")
    for k, (got, want) in enumerate(zip(sorted(ranks, key=_rank_key), expected["ranks"])):
        entry = _obj(got, f"ranks[{k}]")
        for key in ("rank", "node", "local_rank", "device_id"):
            if _int(entry, key, f"ranks[{k}]") != want[key]:
                raise ConfigError(f"ranks[{k}].{key}", f"is {entry[key]} but the nodes say {want[key]} for rank "
                                  f"{want['rank']}", "make ranks agree with nodes")
    levels = _get(data, "levels", "", (list,), "a list of {level, groups}")
    if json.dumps(levels, sort_keys=True) != json.dumps(expected["levels"], sort_keys=True):  # types too
        raise ConfigError("levels", "do not match the nodes", f"use {json.dumps(expected['levels'])[:120]}")
    return table


def _rank_key(entry: Any) -> int:
    value = entry.get("rank") if isinstance(entry, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def parse_table(data: Any) -> RankTable:
    """A RankTable from decoded JSON of either format."""
    if not isinstance(data, dict):
        raise ConfigError("top level", f"must be a JSON object, got {_show(data)}")
    if "server_list" in data or "server_count" in data:
        return parse_hccl(data)
    if "nodes" in data or "format" in data:
        return parse_generic(data)
    raise ConfigError("top level", "neither an HCCL table (server_list) nor a generic one (nodes)",
                      "write HCCL v1.0 JSON or `autopar ranktable --format generic` output")


def read_table(path: str | os.PathLike[str]) -> RankTable:
    """Read and validate a rank table file of either format (ConfigError on any defect)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(str(path), f"cannot read it: {getattr(err, 'strerror', None) or err}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(str(path), f"not JSON ({err.msg} at line {err.lineno} column {err.colno})",
                          "write valid JSON") from None
    except RecursionError:
        raise ConfigError(str(path), "nested too deeply to be a rank table") from None
    return parse_table(data)


# --------------------------------------------------------------------------------------------- builders


def expand_nodelist(text: str) -> list[str]:
    """Expand a SLURM hostlist: ``node[01-03,07]``, ``rack[1-2]-n[01-02]``, ``a,b[1-2]`` (zero padding kept)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ConfigError("SLURM_JOB_NODELIST", f"unbalanced brackets in {text!r}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError("SLURM_JOB_NODELIST", f"unclosed '[' in {text!r}")
    items.append(text[start:])
    hosts: list[str] = []
    for item in items:
        item = item.strip()
        if not item:
            raise ConfigError("SLURM_JOB_NODELIST", f"empty host name in {text!r}")
        segments = [[s] if not s.startswith("[") else _expand_ranges(s[1:-1], text)
                    for s in re.split(r"(\[[^\]]*\])", item) if s]
        count = 1
        for seg in segments:
            count *= len(seg)
        if count + len(hosts) > MAX_NODES:
            raise ConfigError("SLURM_JOB_NODELIST", f"{text!r} expands to more than {MAX_NODES} hosts")
        hosts += ["".join(parts) for parts in itertools.product(*segments)]
    for host in hosts:
        check_host(host, "SLURM_JOB_NODELIST")
    dupes = sorted(h for h, n in Counter(hosts).items() if n > 1)
    if dupes:
        raise ConfigError("SLURM_JOB_NODELIST", f"lists a host twice {dupes[:3]} in {text!r}")
    return hosts


def _expand_ranges(inner: str, text: str) -> list[str]:
    out: list[str] = []
    for piece in inner.split(","):
        piece = piece.strip()
        lo, dash, hi = piece.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ConfigError("SLURM_JOB_NODELIST", f"bad range [{inner}] in {text!r}", "write e.g. node[01-04,07]")
        if not dash:
            out.append(lo)
            continue
        if int(lo) > int(hi) or int(hi) - int(lo) >= MAX_NODES:
            raise ConfigError("SLURM_JOB_NODELIST", f"bad range {piece} in {text!r}", "write low-high with low <= high")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def slurm_devices_per_node(env: dict[str, str] | None = None) -> int | None:
    """Processes per node from SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE ("8(x2)") or SLURM_GPUS_ON_NODE."""
    env = dict(os.environ) if env is None else env
    for var in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        raw = env.get(var, "").strip()
        if not raw:
            continue
        counts = {m.group(1) for m in re.finditer(r"(\d+)(\(x\d+\))?", raw)}
        if len(counts) != 1:
            raise ConfigError(var, f"{raw!r} gives nodes different task counts", "run the same tasks on every node")
        return int(counts.pop())
    return None


def parse_hosts(text: str, devices_per_node: int | None = None) -> list[tuple[str, int]]:
    """``"10.0.0.1:8,10.0.0.2:8"`` or ``"a,b"`` with ``devices_per_node`` -> [(host, devices)]."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise ConfigError("--hosts", f"empty entry in {text!r}", "write host:devices,host:devices")
        host, colon, count = part.rpartition(":") if ":" in part else (part, "", "")
        if colon and not (count.isdigit() and int(count) > 0):
            raise ConfigError("--hosts", f"bad device count in {part!r}", "write host:devices, e.g. 10.0.0.1:8")
        n = int(count) if colon else devices_per_node
        if n is None:
            raise ConfigError("--hosts", f"no device count for {part!r}", "write host:8 or pass --devices-per-node")
        out.append((check_host(host, "--hosts"), n))
    return out


def resolve_ipv4(names: Sequence[str], timeout_s: float = 3.0) -> dict[str, str | None]:
    """Name -> IPv4 (None when it does not resolve within the timeout); addresses map to themselves."""
    out: dict[str, str | None] = {n: (n if is_ipv4(n) else None) for n in names}
    todo = sorted(n for n, ip in out.items() if ip is None)
    if not todo:
        return out

    def lookup(name: str) -> str | None:
        try:
            return socket.gethostbyname(name)
        except OSError:
            return None

    pool = ThreadPoolExecutor(max_workers=min(16, len(todo)))
    futures = {pool.submit(lookup, n): n for n in todo}
    done, _ = wait(futures, timeout=timeout_s)
    for fut in done:
        out[futures[fut]] = fut.result()
    pool.shutdown(wait=False, cancel_futures=True)
    return out


def device_ip_for(base: str | None, rank: int, fallback: str | None) -> str | None:
    """Rank ``rank``'s device IP: ``base`` + rank (HCCN style), else ``fallback`` (the host address)."""
    if base is None:
        return fallback
    try:
        return str(ipaddress.IPv4Address(check_ipv4(base, "--device-ip-base")) + rank)
    except ipaddress.AddressValueError:
        raise ConfigError("--device-ip-base", f"{base} + {rank} runs past 255.255.255.255",
                          "choose a lower base address") from None


def table_from_hosts(hosts: Sequence[tuple[str, int]], device_ip_base: str | None = None,
                     resolve: bool = True) -> RankTable:
    """One server per host, ranks node by node, device_id = local index."""
    addresses = resolve_ipv4([h for h, _ in hosts]) if resolve else {h: h if is_ipv4(h) else None for h, _ in hosts}
    servers, rank = [], 0
    for host, count in hosts:
        address = addresses[host]
        devices = []
        for local in range(count):
            devices.append(Device(device_id=local, rank_id=rank, device_ip=device_ip_for(device_ip_base, rank, address)))
            rank += 1
        servers.append(Server(server_id=address or host, devices=devices, host=host))
    return RankTable(servers=servers, kind="built").validate()
