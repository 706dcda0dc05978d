"""Plan -> DeviceMesh, placed on the topology as the cost model assumes: the mesh-building half of
``lightning_autopar.dims.ParallelDims`` (rank order, names, strides and groups are there, pure).

Every sub-mesh the apply layer uses comes from ``MeshLayout``: the MESH_DIMS, "dp" / "dp_flat", the mesh the
data-parallel wrapper runs over (``dp_mesh``: with cp, dp_shard x cp flattened), the expert meshes
(``expert_meshes``). The private DeviceMesh API (``_flatten``, ``_unflatten``, ``_flatten_mapping``, and
``_pg_registry`` to let the groups go at exit) is used here only, as is the one swap of its module's
``new_group`` (``mesh_groups_shared``). ``mesh_outside_fake_mode`` (the simulation,
``lightning_autopar.simulate``) wraps DeviceMesh's own methods so that its rank arithmetic runs on real tensors
under FakeTensorMode.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from lightning_autopar.dims import (  # noqa: F401 (nodes_spanned: re-exported, the topology's use)
    EXPERT_DIMS, FLAT_DIMS, GROUP_DIMS, MESH_DIMS, ParallelDims, nodes_spanned)
from lightning_autopar.errors import AutoparError, ConfigError
from lightning_autopar.specs import Plan
from lightning_autopar.topology.worker import PG_TIMEOUT_ENV, destroy_at_exit

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

def group_ranks(plan: Plan, dims: tuple[str, ...] | str) -> list[list[int]]:
    """All process groups along ``dims`` (e.g. "tp", or ("dp_replicate", "dp_shard") for the dp group)."""
    return ParallelDims.from_plan(plan).group_ranks(dims)


def ep_group_ranks(plan: Plan) -> list[list[int]]:
    """Expert-parallel groups: ``ep`` consecutive data-parallel ranks, with the same pp, cp and tp coordinates."""
    return ParallelDims.from_plan(plan).ep_group_ranks()


def all_group_ranks(plan: Plan) -> dict[str, list[list[int]]]:
    """Every group of every named dimension (GROUP_DIMS, plus "ep"), as the cost model prices them."""
    return ParallelDims.from_plan(plan).all_group_ranks()


def groups_crossing_nodes(plan: Plan, devices_per_node: int | Sequence[Sequence[int]]) -> dict[str, bool]:
    """For each named group kind: does any of its groups span more than one node?

    ``devices_per_node`` is an int when ranks are numbered node by node, or the list of each node's ranks
    (``topology.discover.NodeLayout.nodes``) for the real placement.
    """
    return {name: any(nodes_spanned(g, devices_per_node) > 1 for g in groups)
            for name, groups in all_group_ranks(plan).items()}


# The process groups this process's meshes were built with, by (ranks, backend, timeout, mesh dimension name --
# None for a single rank), each with the default group it was created under: see mesh_groups_shared. A
# non-member's entry is torch's NON_GROUP_MEMBER, so every rank skips the same calls.
_MESH_GROUPS: dict[tuple[Any, ...], tuple[Any, Any]] = {}


@contextmanager
def mesh_groups_shared() -> Iterator[None]:
    """While inside: DeviceMesh's group creation (``init_device_mesh``, ``_flatten``, ``_unflatten``) reuses this
    process's groups: one single-rank group per rank, shared by every mesh dimension of size 1 (pp, cp, tp, a
    data-parallel factor at 1), and one group per dimension name and rank set, shared by the meshes of the plans
    built in this process (trials, re-planning, a later fit). torch creates new groups for every dimension of every
    mesh, and each gloo group keeps a thread that polls its sockets every 10 ms (gloo's tcp Loop), an NCCL group a
    communicator. Measured over 55 plans applied in one world-4 process (the suite's launches): 75 gloo groups per
    rank, 46 of them single-rank, their loop threads 18% of the launch's CPU samples; shared, 17 groups and 7% less
    CPU for the launch. Within one mesh every dimension of several ranks keeps a group of its own, as torch builds
    it: collectives of two dimensions over the same ranks (``dp_replicate`` and ``dp_flat``) are issued
    independently, and one group would order them against each other; a single-rank group has no peer, so sharing
    it orders nothing; and one plan's mesh runs at a time. Every rank makes the same calls in the same order (a
    mesh dimension creates all its groups on every rank), so the ones skipped are skipped everywhere and torch's
    group numbering stays in step. Swaps ``torch.distributed.device_mesh.new_group`` (the name DeviceMesh calls;
    torch 2.13) and restores it on exit."""
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed import distributed_c10d as c10d

    create = device_mesh.new_group

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  group_desc: str | None = None, **kwargs: Any) -> Any:
        if ranks is None or pg_options is not None:
            return create(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                          group_desc=group_desc, **kwargs)
        default = c10d._get_default_group()
        key = (tuple(int(r) for r in ranks), backend, timeout, group_desc if len(ranks) > 1 else None)
        entry = _MESH_GROUPS.get(key)
        if entry is not None and entry[0] is default and (
                entry[1] is c10d.GroupMember.NON_GROUP_MEMBER or entry[1] in c10d._world.pg_map):
            return entry[1]
        group = create(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc,
                       **kwargs)
        for stale in [k for k, (owner, _) in _MESH_GROUPS.items() if owner is not default]:
            del _MESH_GROUPS[stale]  # groups of an earlier default group go with it (as _MESHES' layouts)
        _MESH_GROUPS[key] = (default, group)
        return group

    device_mesh.new_group = new_group
    try:
        yield
    finally:
        device_mesh.new_group = create


def _flattened(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """``mesh[dims]`` flattened to one dim called ``name``, created once: a root mesh flattens a name once, and
    each ``_flatten`` call creates process groups. The one read of DeviceMesh's private ``_flatten_mapping``
    (the root's flattened meshes by name; torch 2.13)."""
    if name in mesh._flatten_mapping:
        return mesh[name]
    with mesh_groups_shared():
        return mesh[dims]._flatten(name)


@dataclass
class MeshLayout:
    """The world mesh of a plan plus the named sub-meshes the apply layer uses."""

    plan: Plan
    mesh: DeviceMesh
    submeshes: dict[str, DeviceMesh] = field(default_factory=dict)
    derived: dict[Any, DeviceMesh] = field(default_factory=dict)  # meshes carved later (expert meshes), shared

    def __getitem__(self, name: str) -> DeviceMesh:
        """Sub-mesh by name: a MESH_DIMS entry, "dp" (replicate x shard, 2D when hybrid) or "dp_flat" (1D)."""
        if name not in self.submeshes:
            raise KeyError(f"no sub-mesh {name!r}; have {sorted(self.submeshes)}")
        return self.submeshes[name]

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this process's group along ``name``."""
        return sorted(self[name].mesh.flatten().tolist())

    def all_ranks(self, name: str) -> list[list[int]]:
        """Every group along ``name`` (a GROUP_DIMS key), read from the live mesh (compare with group_ranks)."""
        if name not in GROUP_DIMS:
            raise KeyError(f"no group {name!r}; have {sorted(GROUP_DIMS)}")
        grid = self.mesh.mesh
        inner = [MESH_DIMS.index(d) for d in GROUP_DIMS[name]]
        outer = [i for i in range(grid.dim()) if i not in inner]
        size = 1
        for i in inner:
            size *= grid.shape[i]
        rows = grid.permute(*outer, *inner).reshape(-1, size).tolist()
        return sorted(sorted(row) for row in rows)

    def groups(self) -> dict[str, list[list[int]]]:
        """All named groups of the live mesh (same keys as all_group_ranks, less "ep")."""
        return {name: self.all_ranks(name) for name in GROUP_DIMS}

    def dp_mesh(self, plan: Plan | None = None) -> DeviceMesh:
        """The mesh the data-parallel wrapper (FSDP2 / DDP) shards / replicates over (``ParallelDims.dp_mesh_name``):
        2-D (replicate, shard) when dp replicates (HSDP, and DDP as HSDP with shard groups of one), else the shard
        dimension; with cp, the shard dimension is data-parallel x cp ranks (torchtitan's ``dp_shard_cp``),
        parameters sharded over dp_shard x cp. ``plan``: one of this layout's shape (default: the layout's)."""
        dims = ParallelDims.from_plan(plan or self.plan)
        if not dims.cp_on:
            return self["dp"] if dims.replicates else self["dp_shard"]
        _flattened(self.mesh, FLAT_DIMS["dp_shard_cp"], "dp_shard_cp")
        names = dims.dp_mesh_name
        return self.mesh[names if len(names) > 1 else names[0]]

    def expert_meshes(self, plan: Plan | None = None) -> dict[str, DeviceMesh]:
        """Expert-parallel sub-meshes carved from the data-parallel ranks (same root mesh, so they compose with TP
        and FSDP): "ep" -- ``plan.ep`` consecutive data-parallel ranks (the groups of ``ep_group_ranks``) -- and
        "edp" -- the ``dp / ep`` ranks holding the same experts, as FSDP's mesh for the experts
        (``ParallelDims.expert_shape`` / ``edp_mesh_name``)."""
        dims = ParallelDims.from_plan(plan or self.plan)
        key = ("expert", dims.expert_shape)
        if key not in self.derived:  # carved once per layout: _unflatten creates new groups each call
            with mesh_groups_shared():
                self.derived[key] = self["dp_flat"]._unflatten(0, dims.expert_shape, EXPERT_DIMS)
        grid = self.derived[key]
        return {"ep": grid["ep"], "edp": grid[dims.edp_mesh_name]}


# Meshes built in this process, by (device type, mesh shape): one layout's process groups are created once and
# shared by every plan with that shape (trials, the chosen plan, a later fit in the same process). Each gloo/NCCL
# group holds threads and sockets, so building a fresh mesh per trial or per fit piles them up; destroying them
# instead leaves DTensor's sharding caches (keyed by mesh equality) pointing at groups that no longer resolve.
_MESHES: dict[tuple[str, tuple[int, ...]], tuple[Any, MeshLayout]] = {}


def _cached_layout(device_type: str, shape: tuple[int, ...]) -> MeshLayout | None:
    """The layout built for ``shape`` on the live default group, if its groups all still resolve."""
    from torch.distributed import distributed_c10d as c10d

    entry = _MESHES.get((device_type, shape))
    if entry is None or entry[0] is not c10d._get_default_group():
        return None
    layout = entry[1]
    try:
        for mesh in (layout.mesh, *layout.submeshes.values(), *layout.derived.values()):
            for group in mesh.get_all_groups():
                c10d._resolve_process_group(group.group_name)
    except (RuntimeError, ValueError, KeyError):  # a group someone destroyed: build the layout again
        return None
    return layout


def release_meshes() -> None:
    """Forget every mesh this process built and the process groups they hold (at exit, after the default group
    is destroyed; worker.destroy_at_exit says why). torch's DTensor caches keep DeviceMesh objects alive past
    ``destroy_process_group``, and a mesh's ``_pg_registry`` (private, torch 2.13; shared by a root mesh and its
    sub-meshes) keeps its groups and their threads alive with it."""
    for _, layout in _MESHES.values():
        for mesh in (layout.mesh, *layout.submeshes.values(), *layout.derived.values()):
            mesh._pg_registry.clear()
    _MESHES.clear()
    _MESH_GROUPS.clear()


def build_mesh(plan: Plan, device_type: str) -> MeshLayout:
    """The DeviceMesh for ``plan`` on the live process group (``device_type`` "cpu", "cuda", "npu"); the groups
    of a mesh shape are created once per process group (see _MESHES)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    dims = ParallelDims.from_plan(plan, world_size=dist.get_world_size())
    destroy_at_exit(release=release_meshes)  # the groups below must end before the interpreter does
    shape = dims.shape
    layout = _cached_layout(device_type, shape)
    if layout is None:
        with mesh_groups_shared():
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        subs: dict[str, DeviceMesh] = {name: mesh[name] for name in MESH_DIMS}
        subs["dp"] = mesh[GROUP_DIMS["dp"]]
        subs["dp_flat"] = _flattened(mesh, FLAT_DIMS["dp_flat"], "dp_flat") if dims.dp > 1 else mesh["dp_shard"]
        layout = MeshLayout(plan=plan, mesh=mesh, submeshes=subs)
        default = c10d._get_default_group()
        for key in [k for k, (group, _) in _MESHES.items() if group is not default]:
            del _MESHES[key]  # layouts of an earlier process group go with it
        _MESHES[(device_type, shape)] = (default, layout)
    return MeshLayout(plan=plan, mesh=layout.mesh, submeshes=dict(layout.submeshes), derived=layout.derived)


@contextmanager
def mesh_outside_fake_mode() -> Iterator[None]:
    """While inside: every method and property of DeviceMesh runs with FakeTensorMode unset. A DeviceMesh computes
    its coordinates and sub-meshes with tensor ops on the rank grid (``nonzero``, indexing: torch 2.13), which
    FakeTensorMode cannot answer (data-dependent shapes); the grid is rank numbers, never model data, so running
    it for real changes nothing the simulation measures. The class is restored on exit."""
    import functools
    import inspect

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    def real(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return wrapped

    saved = dict(vars(DeviceMesh))
    for name, attr in saved.items():
        if isinstance(attr, property) and attr.fget is not None:
            setattr(DeviceMesh, name, property(real(attr.fget), attr.fset, attr.fdel, attr.__doc__))
        elif isinstance(attr, staticmethod):
            setattr(DeviceMesh, name, staticmethod(real(attr.__func__)))
        elif isinstance(attr, classmethod):
            setattr(DeviceMesh, name, classmethod(real(attr.__func__)))
        elif inspect.isfunction(attr) and name not in ("__init_subclass__",):
            setattr(DeviceMesh, name, real(attr))
    try:
        yield
    finally:
        for name, attr in saved.items():
            if name in ("__dict__", "__weakref__"):
                continue
            setattr(DeviceMesh, name, attr)


# --------------------------------------------------------------------------------------------- process group

_CHECKINS = [0]  # how many check-ins this process has made (every rank makes the same sequence)


class RendezvousTimeoutError(AutoparError, TimeoutError):
    """Peers did not arrive within the process-group timeout; the message names the missing ranks."""

    exit_code = 1


def pg_timeout(seconds: float | timedelta | None = None) -> timedelta:
    """Process-group timeout: ``seconds``, else $AUTOPAR_PG_TIMEOUT (seconds), else torch's default (30 min).

    The analogue of HCCL_CONNECT_TIMEOUT: it bounds the rendezvous and every collective.
    """
    if isinstance(seconds, timedelta):
        return seconds
    if seconds is None:
        raw = os.environ.get(PG_TIMEOUT_ENV, "").strip()
        if not raw:
            from torch.distributed.constants import default_pg_timeout

            return default_pg_timeout
        try:
            seconds = float(raw)
        except ValueError:
            raise ConfigError(PG_TIMEOUT_ENV, f"{raw!r} is not a number of seconds", "e.g. AUTOPAR_PG_TIMEOUT=600") from None
    if not seconds > 0:
        raise ConfigError(PG_TIMEOUT_ENV, f"must be > 0 seconds, got {seconds}", "e.g. AUTOPAR_PG_TIMEOUT=600")
    return timedelta(seconds=seconds)


def default_backend() -> str:
    """nccl on CUDA, hccl with torch_npu, else gloo."""
    import torch

    if torch.cuda.is_available():
        return "nccl"
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return "hccl"
    except Exception:
        pass
    return "gloo"


def rendezvous_check(store: Any, rank: int, world_size: int, timeout: timedelta, tag: str = "") -> None:
    """Every rank checks in on ``store`` and waits for all; raise RendezvousTimeoutError naming absent ranks."""
    from torch.distributed import PrefixStore

    from lightning_autopar.topology.discover import ranks_text

    checkin = PrefixStore(f"autopar/checkin/{tag}", store)
    checkin.set(f"rank{rank}", "1")
    checkin.add("count", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.01
    while checkin.add("count", 0) < world_size:
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not checkin.check([f"rank{r}"])]
            raise RendezvousTimeoutError(f"{ranks_text(missing)} of {world_size} did not join within "
                                         f"{timeout.total_seconds():g} s ({PG_TIMEOUT_ENV}); check that every node "
                                         "started and can reach MASTER_ADDR:MASTER_PORT")
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _wait_for_store(addr: str, port: int, timeout: timedelta) -> None:
    """Wait until the rendezvous store accepts connections; raise naming rank 0 if it never does."""
    import socket

    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise RendezvousTimeoutError(f"rank 0 (the store at {addr}:{port}) did not come up within "
                                             f"{timeout.total_seconds():g} s ({PG_TIMEOUT_ENV}): {err}") from None
            time.sleep(0.2)


def init_process_group_with_timeout(backend: str | None = None, timeout: float | timedelta | None = None,
                                    **kwargs: Any) -> None:
    """init_process_group from the launcher's env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with a timeout.

    Before the process group is created every rank checks in on the rendezvous store; a peer that never
    arrives raises RendezvousTimeoutError naming the missing ranks (instead of a silent hang). Under torchrun
    the agent's store is reused. A no-op when a process group already exists. Without a launcher: world of 1.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = backend or default_backend()
    limit = pg_timeout(timeout)
    if backend == "hccl":
        os.environ.setdefault("HCCL_CONNECT_TIMEOUT", str(max(1, int(limit.total_seconds()))))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world > 1 and not (addr and port):
        raise ConfigError("MASTER_ADDR", "MASTER_ADDR / MASTER_PORT are not set for a multi-process run",
                          "launch with torchrun (or set MASTER_ADDR and MASTER_PORT)")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if world == 1 and not (addr and port):
        addr, port = "127.0.0.1", "0"
    if rank != 0 or agent_store:
        _wait_for_store(addr, int(port), limit)
    try:
        store = dist.TCPStore(addr, int(port), world, is_master=(rank == 0 and not agent_store), timeout=limit,
                              wait_for_workers=False, multi_tenant=not agent_store)
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError: no server to connect to
        raise RendezvousTimeoutError(f"rank 0 (the store at {addr}:{port}) did not come up within "
                                     f"{limit.total_seconds():g} s ({PG_TIMEOUT_ENV}): {str(err).splitlines()[0]}"
                                     ) from None
    _CHECKINS[0] += 1
    tag = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_CHECKINS[0]}/"
    rendezvous_check(store, rank, world, limit, tag)
    if agent_store:  # the agent's store outlives a restart: this attempt's process group gets keys of its own
        from lightning_autopar.topology import worker

        store = worker.attempt_store(store)
    if backend == "nccl" and "device_id" not in kwargs:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=limit, **kwargs)
