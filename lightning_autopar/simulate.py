"""Simulate a plan at its real world size in one process (issue 27, ``autopar simulate``).

For each requested rank: join a fake process group (``torch.testing._internal.distributed.fake_pg``) of the plan's
world size at that rank, build the plan's DeviceMesh with ``topology.mesh.build_mesh``, build the model on the meta
device and give it fake tensors (``FakeTensorMode``: shapes, dtypes and devices, no data), apply the plan with the
apply layer the strategies use (``runtime.trial``'s build: ``parallel.apply.apply_plan``), create the optimizer's
states, and run one training step (every micro-batch, the gradient reduction, the optimizer step) under
``profile.memory``'s MemTracker and a dispatch mode recording every collective with its process group. Nothing is
allocated: a fake tensor's storage is counted, never backed.

The report puts each rank's model states (the bytes of its local shards of the parameters, of the gradients at
the optimizer step and of the optimizer's states), its activations and peak (MemTracker) beside the planner's
prediction for the same plan (``PricedPlan.memory_breakdown``, and the per-stage states of
``planner.traffic.rank_state_bytes``), and per group kind (dp, fsdp, tp, cp, ep, pp) each collective's count and
bytes in the step beside ``planner.traffic.step_collectives``.

Pipelines (pp > 1) run torch's schedule itself; what its stages tell each other that a fake group cannot carry
(warm-up votes, stage metadata, the runtime's object gathers) passes inside this process (``StageMailbox``), so
the stages are simulated in order; before the measured step, the schedule infers the stages' shapes (each stage's
forward and backward of one micro-batch) and stops (``shapes_only``). DTensor's sharding propagation infers an
op's output on tensors of the global shapes inside the active FakeTensorMode on a cache miss; that runs in a fake
mode of its own while measuring (``propagation_in_own_fake_mode``), so the step's memory does not depend on what
earlier steps cached.
The runtime's checks on tensor values (CP's position and mask tests, its numeric self-check) are taken as passed
(``value_checks_pass``): a live run still makes them. Not simulated (``check_simulable`` refuses them in one line): MoE models (the routing sizes the expert batches
from the tokens' values) and plain DDP (its C++ reducer builds buckets from the parameters' data).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import ClusterSpec, ModelSpec, PricedPlan

if TYPE_CHECKING:
    from lightning_autopar.runtime.trial import SharedAnalysis

GIB = 2**30
MEMORY_KEYS = ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "peak_gib")
KINDS = ("dp", "fsdp", "tp", "cp", "ep", "pp")


# ------------------------------------------------------------------------------------------------ the report


@dataclass
class RankResult:
    """One simulated rank: its pipeline stage, memory terms (GiB) and the planner's for the same rank."""

    rank: int
    stage: int
    measured: dict[str, float]
    predicted: dict[str, float]
    collectives: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (kind, op) -> [count, bytes]
    predicted_collectives: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "stage": self.stage}
        for key in MEMORY_KEYS:
            out[key] = self.measured[key]
            out["predicted_" + key] = self.predicted[key]
        return out


@dataclass
class SimulationReport:
    """What ``simulate`` returns: the plan priced (``priced``), the world, one RankResult per simulated rank and the
    wall seconds of the whole simulation."""

    world: int
    priced: PricedPlan
    ranks: list[RankResult]
    seconds: float
    notes: list[str] = field(default_factory=list)

    def collectives(self) -> list[dict[str, Any]]:
        """Per (group kind, op): the count and bytes of one step on the simulated rank that moves the most
        bytes of that kind (ranks differ by stage), beside the planner's for that rank."""
        best: dict[tuple[str, str], tuple[RankResult, list[int]]] = {}
        for r in self.ranks:
            for key, (count, nbytes) in r.collectives.items():
                if key not in best or nbytes > best[key][1][1]:
                    best[key] = (r, [count, nbytes])
        for r in self.ranks:  # predicted kinds no rank ran
            for key in r.predicted_collectives:
                best.setdefault(key, (r, [0, 0]))
        rows = []
        for (kind, op), (r, (count, nbytes)) in sorted(best.items(), key=lambda kv: (KINDS.index(kv[0][0])
                                                                                   if kv[0][0] in KINDS else 99,
                                                                                   kv[0][1])):
            pc, pb = r.predicted_collectives.get((kind, op), (None, None))
            rows.append({"group": kind, "op": op, "count": count, "bytes": nbytes,
                         "predicted_count": None if pc is None else int(round(pc)),
                         "predicted_bytes": None if pb is None else int(round(pb))})
        return rows

    def to_json_dict(self) -> dict[str, Any]:
        return {"world": self.world, "plan": self.priced.plan.short(),
                "ranks": [r.to_json_dict() for r in self.ranks], "collectives": self.collectives(),
                "seconds": self.seconds}

    def print_table(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=f"autopar simulate: {self.priced.plan.short()} at world {self.world} "
                            "(simulated / predicted, GiB per rank)")
        table.add_column("rank", justify="right")
        table.add_column("stage", justify="right")
        for key in MEMORY_KEYS:
            table.add_column(key.removesuffix("_gib"), justify="right")
        for r in self.ranks:
            table.add_row(str(r.rank), str(r.stage), *(f"{r.measured[k]:.4g} / {r.predicted[k]:.4g}"
                                                       for k in MEMORY_KEYS))
        console.print(table)
        comm = Table(title="collectives in one step (simulated / predicted)")
        for name in ("group", "op", "count", "bytes"):
            comm.add_column(name, justify="left" if name in ("group", "op") else "right")
        for row in self.collectives():
            pc = "-" if row["predicted_count"] is None else str(row["predicted_count"])
            pb = "-" if row["predicted_bytes"] is None else _human(row["predicted_bytes"])
            comm.add_row(row["group"], row["op"], f"{row['count']} / {pc}", f"{_human(row['bytes'])} / {pb}")
        console.print(comm)
        for note in self.notes:
            console.print(f"note: {note}")
        console.print(f"simulated {len(self.ranks)} rank(s) in {self.seconds:.1f} s")


def _human(nbytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


# ------------------------------------------------------------------------------------------------ the model


def _factory(name: str) -> Callable[[], Any]:
    """``pkg.module:factory`` -> the factory (a callable returning the model)."""
    import importlib

    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError("model", f"cannot load the factory {name!r}: {err}",
                          "give pkg.module:factory, importable from here") from None
    if not callable(factory):
        raise ConfigError("model", f"{name!r} is not callable", "give pkg.module:factory, a function")
    return factory


def is_factory(model: Any) -> bool:
    return callable(model) and not isinstance(model, (str, ModelSpec)) or (isinstance(model, str) and ":" in model
                                                                          and not model.endswith((".yaml", ".yml")))


def lightning_module(built: Any) -> Any:
    """The LightningModule the strategy would train: ``built`` itself, or an HF causal LM wrapped in
    ``models.hf.LitCausalLM``."""
    import lightning.pytorch as L

    if isinstance(built, L.LightningModule):
        return built
    if hasattr(getattr(built, "config", None), "vocab_size"):
        from lightning_autopar.models.hf import LitCausalLM

        return LitCausalLM(built)
    raise ConfigError("model", f"the factory returned a {type(built).__name__}",
                      "return a LightningModule or a Hugging Face causal LM")


def spec_module(spec: ModelSpec) -> Any:
    """The reference GPT (``models.gpt``) of ``spec``'s shape with AdamW, as a LightningModule; no learned
    position table (a spec has none: Llama's rotary positions hold no parameters, and the planner prices none)."""
    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    if spec.unit_form:
        raise ConfigError("model", f"{spec.name} is given in unit form (no module to build)",
                          "give --model pkg.module:factory returning the model")
    cfg = GPTConfig(vocab=spec.vocab, seq_len=spec.seq_len, layers=spec.layers, hidden=spec.hidden,
                    heads=spec.heads, kv_heads=spec.kv_heads, ffn_hidden=spec.ffn_hidden, ffn_kind=spec.ffn_kind,
                    experts=spec.experts, top_k=spec.top_k, moe_every=spec.moe_every,
                    tied_embeddings=spec.tied_embeddings, learned_positions=False)
    return LitGPT(cfg, optimizer="adamw", lr=1e-4)


def meta_factory(module: Any) -> Callable[[], Any]:
    """A factory of meta-device copies of ``module`` (a LightningModule already built, as the strategy's
    ``simulate=True`` gets it): parameters and buffers become meta tensors of their shapes and dtypes (a tie stays
    one Parameter), so no copy holds data; ``module`` itself is left as it is."""
    import copy
    import itertools

    import torch

    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) not in memo:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = (torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
                                if isinstance(tensor, torch.nn.Parameter) else meta)
    trainer = getattr(module, "_trainer", None)
    module._trainer = None  # a LightningModule's Trainer (and its loaders) stays out of the copy
    try:
        template = copy.deepcopy(module, memo)
    finally:
        module._trainer = trainer
    return lambda: copy.deepcopy(template)


def _meta_module(model: Any, spec: ModelSpec | None) -> Any:
    """A fresh LightningModule on the meta device (built once per simulated rank: the plan changes it)."""
    import torch

    with torch.device("meta"):
        if spec is not None:
            return spec_module(spec)
        factory = _factory(model) if isinstance(model, str) else model
        return lightning_module(factory())


# ------------------------------------------------------------------------------------------------ collectives


class CollectiveRecorder:
    """A TorchDispatchMode recording every collective (c10d and functional c10d ops) with its process group:
    (group kind, op) -> [count, bytes] (bytes: torch's ``fake_collectives.CollectiveOp.get_comm_tensor_size``,
    the whole buffer: an all-gather's output, a reduce-scatter's input). The gathers and reductions FSDP2 issues
    (inside its ``foreach_all_gather`` / ``foreach_reduce``, torch 2.13's private names) are "fsdp" whatever their
    group (with dp_shard 1 and cp, FSDP's group is the cp group); ``kind_of(ranks, op)`` names the others. The
    collectives DTensor issues inside its own dispatch are recorded too."""

    def __init__(self, kind_of: Callable[[tuple[int, ...], str], str]) -> None:
        self.kind_of = kind_of
        self.counts: dict[tuple[str, str], list[int]] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[CollectiveRecorder]:
        import torch.distributed as dist
        from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_group

        recorder, cache, inside_fsdp = self, {}, [0]

        def in_fsdp(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                inside_fsdp[0] += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    inside_fsdp[0] -= 1
            return run

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if any(isinstance(t, type) and issubclass(t, DTensor) for t in types):
                    # modes run before subclasses: let DTensor run its op, so the collectives it issues inside
                    # (a redistribute, a sharding strategy's reductions) come back here (as torch's CommDebugMode)
                    return NotImplemented
                out = func(*args, **(kwargs or {}))
                if func in collective_ops and func not in sync_ops:
                    pg = CollectiveOp.get_process_group(func, args)
                    key = id(pg)
                    if key not in cache:
                        cache[key] = tuple(dist.get_process_group_ranks(pg))
                    ranks = cache[key]
                    if len(ranks) > 1:
                        op = _op_name(func)
                        kind = "fsdp" if inside_fsdp[0] and op != "all_reduce" else recorder.kind_of(ranks, op)
                        entry = recorder.counts.setdefault((kind, op), [0, 0])
                        entry[0] += 1
                        entry[1] += int(CollectiveOp.get_comm_tensor_size(func, out, args, kwargs or {}))
                return out

        saved = fsdp_group.foreach_all_gather, fsdp_group.foreach_reduce
        fsdp_group.foreach_all_gather, fsdp_group.foreach_reduce = (in_fsdp(f) for f in saved)
        try:
            with Mode():
                yield self
        finally:
            fsdp_group.foreach_all_gather, fsdp_group.foreach_reduce = saved


_OPS = {"allreduce": "all_reduce", "all_reduce": "all_reduce", "allgather": "all_gather",
        "all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "alltoall": "all_to_all",
        "all_to_all": "all_to_all", "broadcast": "broadcast", "send": "send", "isend": "send", "recv": "recv",
        "irecv": "recv", "shard_dim_alltoall": "all_to_all", "batch_p2p": "p2p", "gather": "gather",
        "scatter": "scatter", "reduce": "reduce"}


def _op_name(func: Any) -> str:
    """One name per collective whatever its API: c10d.allgather_into_tensor_coalesced_ -> all_gather."""
    name = func._schema.name.split("::")[-1].strip("_")
    for prefix, op in sorted(_OPS.items(), key=lambda kv: -len(kv[0])):
        if name.startswith(prefix):
            return op
    return name


def group_kinds(plan: Any, rank: int) -> Callable[[tuple[int, ...], str], str]:
    """``kind_of(ranks, op)`` for ``rank`` under ``plan``: tp, cp, pp or ep when ``ranks`` is this rank's group of
    that dimension, fsdp for the gathers and reductions of the data-parallel wrapper (zero >= 1 or hybrid), dp
    for its all-reduces (DDP, HSDP's replicas) and any other data-parallel traffic (MoE balance counts)."""
    from lightning_autopar.dims import ParallelDims

    dims = ParallelDims.from_plan(plan)

    def mine(groups: list[list[int]]) -> frozenset[int]:
        return next((frozenset(g) for g in groups if rank in g), frozenset())

    named = [(name, mine(dims.group_ranks(name))) for name in ("tp", "cp", "pp")]
    ep = mine(dims.ep_group_ranks()) if plan.ep > 1 else frozenset()

    def kind_of(ranks: tuple[int, ...], op: str) -> str:
        group = frozenset(ranks)
        if ep and group == ep and op == "all_to_all":
            return "ep"
        for name, members in named:
            if group == members:
                return name
        if ep and group == ep:
            return "ep"
        return "fsdp" if op in ("all_gather", "reduce_scatter") else "dp"

    return kind_of


# ------------------------------------------------------------------------------------------------ one rank


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """A fake default process group of ``world`` ranks joined as ``rank``, destroyed on exit (with the meshes
    built on it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_autopar.parallel.dtensor_private import clear_sharding_caches
    from lightning_autopar.topology.mesh import release_meshes

    if dist.is_initialized():
        raise ConfigError("simulate", "a default process group already exists in this process",
                          "simulate outside a distributed run")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        release_meshes()
        clear_sharding_caches()


@dataclass(frozen=True)
class _Vote:
    """A stage's warm-up vote as the schedule reads it (``.item()``), outside FakeTensorMode."""

    value: int

    def item(self) -> int:
        return self.value


@dataclass(frozen=True)
class _MicroIndex:
    """A micro-batch index where ``PipelineSteps.loss`` reads one from the schedule's target tensor."""

    value: int

    def reshape(self, *shape: int) -> list[int]:
        return [self.value]


class StageMailbox:
    """What pipeline stages tell each other that a fake group cannot carry, passed inside this process instead
    (``in_process``): torch 2.13's warm-up vote (each rank's own vote stands: every rank of a simulation runs the
    same code), the stages' forward metadata (what stage i sends stage i+1, kept from the simulation of stage i; a
    block stack's stages all exchange the same hidden states, so a chunk whose sender was not simulated takes the
    last one sent), their backward metadata (the gradients of a stage's outputs: its outputs' metadata), the
    runtime's gather of micro-batch signatures (every rank holds the same batch) and the last stage's loss
    broadcast (0 on the other stages: the loss is not what a simulation measures). The last stage's loss finds
    its micro-batch by the order the schedule calls it in (the micro-batch index the schedule passes is a fake
    tensor, which has no value)."""

    def __init__(self) -> None:
        self.forward: dict[tuple[int, int], Any] = {}
        self.last_forward: Any = None

    @contextlib.contextmanager
    def in_process(self) -> Iterator[None]:
        import torch.distributed as dist
        from torch.distributed.pipelining import stage as torch_stage
        from torch.distributed.pipelining._utils import InferenceMode, _StageBackwardMeta, _StageForwardMeta

        from lightning_autopar.parallel.pipeline.runtime import StagedPipeline
        from lightning_autopar.runtime.pipeline_step import PipelineSteps

        box = self

        def vote(stage: Any, has_backward: bool, received_acc: Any = None) -> Any:
            return _Vote(0 if InferenceMode.needs_dynamic(stage._user_meta, has_backward) else 1)

        def result(stage: Any, received_result: Any = None) -> Any:
            return received_result if received_result is not None else vote(stage, True)

        def send_meta(stage: Any, meta: Any, dst_stage: int) -> None:
            if isinstance(meta, _StageForwardMeta):
                box.forward[(stage.stage_index, dst_stage)] = box.last_forward = meta

        def recv_meta(stage: Any, src_stage: int) -> Any:
            if src_stage > stage.stage_index:
                return _StageBackwardMeta(backward_metas=tuple(stage._stage_meta.outputs))
            meta = box.forward.get((src_stage, stage.stage_index), box.last_forward)
            if meta is None:
                raise ConfigError("ranks", f"pipeline stage {stage.stage_index} needs the metadata of stage "
                                  f"{src_stage}, which was not simulated", "include the first stage's rank")
            return meta

        def gather_object(out: list, obj: Any, group: Any = None) -> None:
            out[:] = [obj] * len(out)

        loss, calls = PipelineSteps.loss, [0]

        def counted_loss(steps: Any, output: Any, target: Any) -> Any:
            if steps.pipe.inferring:  # the shape inference's pass: micro-batch 0
                return loss(steps, output, _MicroIndex(0))
            index = calls[0] % len(steps.current.micro)
            calls[0] += 1
            out = loss(steps, output, _MicroIndex(index))
            steps.current.losses[-1] = 0.0  # the value the runtime averages for the log: a fake tensor has none
            return out

        saved = [(torch_stage.PipelineStage, name, getattr(torch_stage.PipelineStage, name))
                 for name in ("_warmup_forward_vote", "_warmup_backward_result", "_send_meta", "_recv_meta")]
        saved += [(dist, "all_gather_object", dist.all_gather_object),
                  (StagedPipeline, "broadcast_from_last", StagedPipeline.broadcast_from_last),
                  (PipelineSteps, "loss", loss)]
        PipelineSteps.loss = counted_loss
        torch_stage.PipelineStage._warmup_forward_vote = vote
        torch_stage.PipelineStage._warmup_backward_result = result
        torch_stage.PipelineStage._send_meta = send_meta
        torch_stage.PipelineStage._recv_meta = recv_meta
        dist.all_gather_object = gather_object
        StagedPipeline.broadcast_from_last = lambda pipe, obj: obj if obj is not None else (0.0, {})
        try:
            yield
        finally:
            for owner, name, value in saved:
                setattr(owner, name, value)


@contextlib.contextmanager
def value_checks_pass() -> Iterator[None]:
    """The runtime's checks on tensor values pass: ``torch.equal`` / ``torch.allclose`` on fake tensors are true
    (CP's test that a position embedding's input is ``arange``, its causal-mask test) and CP's numeric self-check
    (the model split over the sequence against the plain one) is skipped. Fake tensors have no values; a live run
    still makes these checks."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    from lightning_autopar.parallel import context

    saved = (torch.equal, torch.allclose, context.self_check)

    def assumed(check: Callable[..., bool]) -> Callable[..., bool]:
        def run(*args: Any, **kwargs: Any) -> bool:
            if any(isinstance(a, FakeTensor) for a in args):
                return True
            return check(*args, **kwargs)
        return run

    torch.equal, torch.allclose = assumed(torch.equal), assumed(torch.allclose)
    context.self_check = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.equal, torch.allclose, context.self_check = saved


def _local_bytes(tensors: Sequence[Any]) -> int:
    """Bytes of this rank's part of ``tensors``: a DTensor's shard as allocated (``_padded_numel``)."""
    total, seen = 0, set()
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = getattr(t, "_local_tensor", None)
        total += (_padded_numel(t) if local is not None else t.numel()) * t.element_size()
    return total


def _padded_numel(dtensor: Any) -> int:
    """Elements of a DTensor's shard as the rank allocates it: each sharded dim cut in chunks of ceil(size / n), as
    torch.chunk does and FSDP2 pads its shards to (``_sharded_param_data``); the last ranks of a group whose size
    does not divide the dim see a shorter view of the same allocation."""
    import math

    shape = list(dtensor.shape)
    for mesh_dim, placement in enumerate(dtensor.placements):
        if getattr(placement, "dim", None) is not None:  # Shard, and FSDP2-over-TP's _StridedShard (no is_shard())
            dim = placement.dim % len(shape)
            shape[dim] = -(-shape[dim] // dtensor.device_mesh.size(mesh_dim))
    return math.prod(shape)


def _states(module: Any, optimizer: Any) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes this rank holds."""
    params = [p for p in module.parameters()]
    grads = [p.grad for p in params]
    states = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return _local_bytes(params), _local_bytes(grads), _local_bytes(states)


def _before_measured_step(trial: Any, module: Any, batch: Any, pipelined: bool) -> None:
    """What a training run did before the step measured: a pipeline's schedule inferred its stages' shapes (the
    first step, stopped once they are known: ``parallel.pipeline.stage.shapes_only``; the gradients it set aside
    are dropped), and the optimizer's states exist (``_first_states``)."""
    from lightning_autopar.parallel.pipeline.stage import shapes_only

    if pipelined:
        with shapes_only():
            trial.step(batch)
        trial.env.hold.take_pipeline()
    _first_states(module, trial.optimizer)


def _first_states(module: Any, optimizer: Any) -> None:
    """The optimizer's states created (its first step on zero gradients), as a training run's first step did before
    the one measured."""
    import torch

    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def simulate_rank(model: Any, spec: ModelSpec | None, priced: PricedPlan, rank: int, world: int,
                  global_batch: int, seq_len: int, mailbox: StageMailbox | None = None,
                  batch: Any = None, shared: SharedAnalysis | None = None) -> RankResult:
    """One rank of ``priced.plan`` simulated (module doc); ``batch``: a global batch whose tensors' shapes and
    dtypes the step takes (the user's first batch), else token windows of ``global_batch`` x ``seq_len``;
    ``shared``: the model's analysis from an earlier rank (``runtime.trial.SharedAnalysis``, filled here when
    empty)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import torch.distributed._tools.fake_collectives  # noqa: F401 (c10d ops under FakeTensorMode)
    from lightning_autopar.parallel.dtensor_private import propagation_in_own_fake_mode
    from lightning_autopar.profile.memory import _from_tracker, _tracker
    from lightning_autopar.runtime.trial import _build
    from lightning_autopar.topology.mesh import build_mesh, mesh_outside_fake_mode

    plan = priced.plan
    stage = rank // (world // plan.pp)  # pp is the mesh's outermost dimension (dims.MESH_DIMS)
    device = torch.device("cpu")
    recorder = CollectiveRecorder(group_kinds(plan, rank))
    mailbox = mailbox or StageMailbox()
    with fake_world(rank, world), mesh_outside_fake_mode(), mailbox.in_process(), value_checks_pass(), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer, FSDP's meta-device notes
        layout = build_mesh(plan, device.type)
        module = _meta_module(model, spec)
        with FakeTensorMode(allow_non_fake_inputs=True):
            module.to_empty(device=device)
            batch = _fake_batch(batch, module, spec, global_batch, seq_len, device)
            # compiled kernels read their inputs' data, which fake tensors do not have: the blocks run eager
            # (``SimulationReport.notes``)
            eager = dataclasses.replace(plan, compile=False) if plan.compile else plan
            trial, applied = _build(module, eager, layout, batch, device, priced.layers_per_stage or None, shared,
                                    fake=True)
            _before_measured_step(trial, module, batch, plan.pp > 1)
            states: list[tuple[int, int, int]] = []
            handle = trial.optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: states.append(_states(module, opt)))
            # a pipeline stage's backward runs autograd.grad, which MemTracker's backward hooks break (profile.memory)
            tracker = _tracker(module, trial.optimizer, backward_hooks=plan.pp == 1, module_peaks=False)
            try:  # (DTensor's shape inference on a cache miss is no allocation: propagation_in_own_fake_mode)
                with tracker, recorder.recording(), propagation_in_own_fake_mode():
                    trial.step(batch)
            finally:
                handle.remove()
            measured = _from_tracker(tracker)
            params, grads, _ = states[-1]
            optim = _states(module, trial.optimizer)[2]
    by = measured.by_category
    result = {"params_gib": params / GIB, "grads_gib": grads / GIB, "optimizer_gib": optim / GIB,
              "activations_gib": by.get("activations", 0.0), "peak_gib": measured.peak_gib}
    return RankResult(rank, stage, result, {}, recorder.counts)


def _fake_batch(batch: Any, module: Any, spec: ModelSpec | None, global_batch: int, seq_len: int,
                device: Any) -> Any:
    """Inside FakeTensorMode: ``batch`` with each tensor replaced by a fake one of its shape and dtype (values
    play no part in a simulated step), else next-token windows of the model's vocabulary."""
    import torch
    from torch.utils._pytree import tree_map

    if batch is not None:
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, batch)
    vocab = int(spec.vocab if spec is not None else module.model.config.vocab_size)
    tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), device=device)
    return tokens[:, :-1], tokens[:, 1:]


# ------------------------------------------------------------------------------------------------ the API


def default_ranks(plan: Any, world: int) -> list[int]:
    """The first rank of every pipeline stage."""
    per_stage = world // plan.pp
    return [s * per_stage for s in range(plan.pp)]


def parse_ranks(text: str | Sequence[int] | None, plan: Any, world: int) -> list[int]:
    """``--ranks``: a comma list of rank numbers and the words first, last, all-stages (the default)."""
    if text is None:
        return default_ranks(plan, world)
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[int] = []
    for item in items:
        word = str(item).strip()
        if not word:
            continue
        if word == "first":
            picked = [0]
        elif word == "last":
            picked = [world - 1]
        elif word in ("all-stages", "stages"):
            picked = default_ranks(plan, world)
        else:
            try:
                picked = [int(word)]
            except ValueError:
                raise ConfigError("ranks", f"{word!r} is not a rank", "give rank numbers, first, last or "
                                  "all-stages, comma separated") from None
            if not 0 <= picked[0] < world:
                raise ConfigError("ranks", f"rank {picked[0]} is outside the world of {world}",
                                  f"use 0..{world - 1}")
        out += [r for r in picked if r not in out]
    if not out:
        raise ConfigError("ranks", "no rank given", "e.g. --ranks first,last")
    return out


def check_simulable(plan: Any, spec: ModelSpec) -> None:
    """One ConfigError for a plan the simulation cannot run: MoE models (data-dependent routing) and plain DDP
    (zero 0, data parallelism alone: its C++ reducer builds buckets from the parameters' data), neither of which
    fake tensors can run."""
    from lightning_autopar.dims import ParallelDims

    if spec.experts:
        raise ConfigError("model.experts", f"{spec.name} routes tokens to experts by their values (which tokens go "
                          "where sizes the expert batches), which fake tensors do not have",
                          "simulate a dense model; `autopar plan` prices MoE plans")
    if ParallelDims.from_plan(plan).plain_ddp(spec.experts > 0):
        raise ConfigError("plan.zero", f"{plan.short()} runs plain DDP, whose C++ reducer needs real parameter "
                          "data; it cannot run on fake tensors", "simulate zero>=1 (the same states per rank "
                          "at zero 1-2 bar the sharding), or a plan with tp, pp or cp")


def simulate(model: Any, cluster: str | ClusterSpec, global_batch: int, seq_len: int | None = None,
             fix: Any = None, ranks: str | Sequence[int] | None = None, nodes: int | None = None,
             devices_per_node: int | None = None, precision: Any = None,
             memory_fraction: float = 0.9, batch: Any = None, analysed: Any = None) -> SimulationReport:
    """Plan ``model`` on ``cluster`` (the best plan, or the one ``fix`` pins), then simulate ``ranks`` of it at the
    plan's world size in this process (module doc). ``model``: a preset name, YAML path or ModelSpec (built as the
    reference GPT), ``"pkg.module:factory"`` or a callable returning a LightningModule or a Hugging Face causal LM.
    ``batch``: the global batch the step takes (its tensors' shapes and dtypes; default: token windows).
    ``analysed``: (root, model, analysis) when the caller has analysed the module ``model`` (a factory) copies --
    ``model`` in ``root``, analysed on token ids (``runtime.analysis.analyse``) --: its spec is planned and the
    builds start from it, instead of analysing again (the strategy's ``simulate=True``).
    No default process group may exist when it is called; none is left after."""
    from lightning_autopar.planner.search import plan as plan_model
    from lightning_autopar.planner.traffic import predicted_rank
    from lightning_autopar.runtime.trial import SharedAnalysis
    from lightning_autopar.specs import load_cluster_spec, load_model_spec

    started = time.perf_counter()
    spec: ModelSpec | None = None
    if is_factory(model) and analysed is not None:
        _, _, analysis = analysed
        planned_spec = analysis.spec if seq_len is None else dataclasses.replace(analysis.spec, seq_len=seq_len)
    elif is_factory(model):
        from lightning_autopar.profile.analyze import model_spec_from_module

        planned_spec = model_spec_from_module(_meta_module(model, None), seq_len=seq_len)
    else:
        spec = load_model_spec(model)
        if seq_len is not None:
            spec = dataclasses.replace(spec, seq_len=seq_len)
        planned_spec = spec
    seq = int(seq_len or planned_spec.seq_len)
    clus = load_cluster_spec(cluster, nodes=nodes, devices_per_node=devices_per_node)
    report = plan_model(planned_spec, clus, global_batch=global_batch, seq_len=seq, fix=fix, top=1,
                        precision=precision, memory_fraction=memory_fraction, allow_infeasible=bool(fix),
                        explain_choice=False)
    priced = report.best
    world = clus.world_size
    check_simulable(priced.plan, planned_spec)
    chosen = parse_ranks(ranks, priced.plan, world)
    results = []
    mailbox, shared = StageMailbox(), SharedAnalysis()  # every rank builds the same model: analysed once
    if analysed is not None and is_factory(model):
        shared.seed(*analysed)
    for rank in sorted(chosen, key=lambda r: (r * priced.plan.pp // world, r)):  # stages in order (StageMailbox)
        result = simulate_rank(model, spec, priced, rank, world, global_batch, seq, mailbox, batch, shared)
        result.predicted, result.predicted_collectives = predicted_rank(planned_spec, clus, priced, result.stage,
                                                                        seq)
        results.append(result)
    notes = [f"{priced.plan.short()}: the blocks ran eager (compiled kernels read tensor data, which fake tensors "
             "do not have); states and collectives are compile's, activations eager's"] if priced.plan.compile else []
    return SimulationReport(world, priced, results, time.perf_counter() - started, notes)
