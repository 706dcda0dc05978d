"""Set-up as stages, shared by the Trainer and Fabric strategies (``runtime.planning.PlanningMixin`` calls them in
order and stores what they return)::

    Workload, Live ─► analyse ─► Analysed ─► capabilities ─► Capable ─► plan ─► Planned
                                                                                   │
          SetUp ◄─ apply ◄─ (plan, report.best) ◄─ Measured ◄─ measure (runtime/measure.py) ◄┘

Each stage is a plain function of typed records: what the framework supplies (``Workload``: the user's module,
the plan DataLoader's first batch, the step contexts), where it runs (``Live``: rank, world, device, the
broadcast from rank 0) and the strategy's options (``SetupOptions``). No stage reads the strategy object, so
each can be called and tested on its own (tests/test_setup_stages.py runs them in one process).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import time
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.capabilities import NOT_CHECKED
from lightning_autopar.runtime.analysis import analyse, sequence_length
from lightning_autopar.runtime.batches import batch_rows
from lightning_autopar.runtime.group import DataParallelGroup, broadcast_module, dp_mesh
from lightning_autopar.runtime.lightning_private import set_module_device_mesh
from lightning_autopar.runtime.pipeline_step import PipelineSteps
from lightning_autopar.runtime.step import StepEnv
from lightning_autopar.runtime.trial import SetupSettings
from lightning_autopar.specs import ClusterSpec, Plan

# What the runtime cannot apply on any model (the backend lacks it); the planner searches only inside it unless
# the user fixes a field. Empty: every plan kind the planner searches runs (tests/test_plan_parity.py). What a
# given model's structure refuses is excluded per model (tp, sp, cp, pp, ep), with the reason: its capabilities
# (parallel/capabilities.py), built once by the capabilities stage.
RUNTIME_SUPPORT: dict[str, list[Any]] = {}


def _same(value: Any) -> Any:
    return value


def _no_scaler() -> Any:
    return None


T = TypeVar("T")


class _PlainDataPickler(pickle.Pickler):
    """Pickles plain data only: a module or a tensor inside refuses (a copy of one on another rank would not be
    that rank's own)."""

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, (nn.Module, torch.Tensor)):
            raise pickle.PicklingError(f"{type(obj).__name__} inside")


def plain_data(value: Any) -> bytes | None:
    """``value`` pickled, or None where it holds a module, a tensor or anything else pickle refuses."""
    buffer = io.BytesIO()
    try:
        _PlainDataPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception:  # noqa: BLE001 -- pickle refuses many kinds (locks, lambdas, process groups): not shared
        return None
    return buffer.getvalue()


# ------------------------------------------------------------------ what the stages are given


@dataclass(frozen=True)
class Live:
    """Where set-up runs: this process's global rank, the world's size, its device, and the broadcast of rank 0's
    value to every rank (the strategy's ``broadcast``; the identity on one process)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    broadcast: Callable[[Any], Any] = _same

    def shared(self, make: Callable[[], T], portable: Callable[[T], Any] = _same) -> T:
        """``make()`` run by rank 0 alone and its result given to every rank: what set-up finds about the model
        (analysis, capabilities, plan) is the same on every rank, and tracing it once per job instead of once per
        rank spares the host's cores (ranks on one host traced the same model side by side; the checks and the
        planner ran ``world_size`` times). ``portable(result)`` is what crosses (pickled; plain data only). Where
        rank 0's ``make()`` raises, or its result holds a module or a tensor, every rank runs ``make()`` itself,
        as without sharing (each raises its own error). Every rank must call it at the same point."""
        if self.world_size == 1:
            return make()
        if self.rank != 0:
            data = self.broadcast(None)
            try:
                return make() if data is None else pickle.loads(data)
            except (pickle.UnpicklingError, TypeError, AttributeError, ImportError):  # not rebuilt here
                return make()
        try:
            value = make()
        except BaseException:
            self.broadcast(None)
            raise
        self.broadcast(plain_data(portable(value)))
        return value


@dataclass(frozen=True)
class Workload:
    """What the framework supplies, read by the strategy: the user's module, the plan DataLoader's first batch and
    batch size, and the contexts the steps run in."""

    module: nn.Module  # the LightningModule, or the module given to fabric.setup
    first_batch: Any = None  # the plan DataLoader's first batch (None without one)
    loader_batch_size: int | None = None  # that DataLoader's batch_size (None without one)
    automatic: bool = True  # the strategy runs the micro-batches' backward (Fabric: the user's loop does)
    planned_steps: int | None = None  # optimizer steps of the planned run (None: unknown; 0: not training)
    train_context: Callable[[], AbstractContextManager[Any]] = torch.enable_grad  # the precision's, per step
    eval_context: Callable[[], AbstractContextManager[Any]] = torch.no_grad
    loss_scaler: Callable[[], Any] = _no_scaler  # the fp16 loss scaler of the precision, or None


@dataclass(frozen=True)
class SetupOptions:
    """The strategy's constructor options the stages read."""

    fix: Mapping[str, Any] = field(default_factory=dict)
    restrict: Mapping[str, list[Any]] = field(default_factory=dict)
    global_batch: int | None = None  # the global_batch= argument
    top: int = 5
    memory_fraction: float = 0.9
    settings: SetupSettings = field(default_factory=SetupSettings)
    capacity_factor: float | None = None
    save_distributed_checkpoint: bool = True
    print_plan: bool = True


# ------------------------------------------------------------------ analyse


@dataclass
class Analysed:
    """What the plan is for: the model it applies to, its analysis at the batch's sequence length, the user's call
    of it (unit form, or a transformer traced on that call) and the batch geometry as on one device."""

    model: nn.Module
    analysis: Any  # profile.records.ModelAnalysis
    example: tuple[tuple, dict] | None
    global_batch: int
    seq_len: int

    @property
    def unit_form(self) -> bool:
        return bool(self.analysis.spec.unit_form)


def batch_geometry(work: Workload, global_batch: int | None, world_size: int, unit_form: bool,
                   transformer_seq: int | None, traced: bool = False) -> tuple[int, int]:
    """(global batch, sequence length) from the plan's DataLoader, as on one device. A model in unit form has no
    sequence: a sample is one batch row (seq 1); a transformer traced on the user's call (``traced``: a ViT on
    pixels) has the length its attention saw, not the batch's second dimension."""
    seq_len = None
    if global_batch is None:
        global_batch = work.loader_batch_size
    first = work.first_batch
    if first is not None:
        # a batch without a batch dimension fails here, at set-up, not at step 1 (runtime.batches)
        rows = batch_rows(first, "DataLoader")
        global_batch = global_batch or rows
        seq_len = sequence_length(first)
    if not global_batch:
        global_batch = world_size
    if unit_form:
        seq_len = 1
    elif traced and transformer_seq:
        seq_len = transformer_seq
    return int(global_batch), int(seq_len or transformer_seq or 1)


def analyse_model(work: Workload, model_call: Callable[[], Any], global_batch: int | None,
                  world_size: int, live: Live | None = None) -> Analysed:
    """The analyse stage: the model found and analysed (``runtime.analysis.analyse``; ``model_call`` runs only for
    a model that is no plain transformer), the batch geometry read, the analysis copied at the batch's length.
    ``live``: the ranks share rank 0's analysis (``Live.shared``)."""
    model, analysis, example = analyse(work.module, model_call, (live or Live()).shared)
    global_batch, seq_len = batch_geometry(work, global_batch, world_size, analysis.spec.unit_form,
                                           analysis.spec.seq_len, traced=example is not None)
    # what the plan is for: the analysis at the batch's length (a copy: the analysis itself is not changed)
    analysis = dataclasses.replace(analysis, spec=dataclasses.replace(analysis.spec, seq_len=seq_len))
    return Analysed(model, analysis, example, global_batch, seq_len)


# ------------------------------------------------------------------ capabilities


@dataclass
class Capable:
    """What the runtime can apply to the model (``parallel.capabilities.Capabilities``) and the planner's
    ``restrict`` from it: the runtime's support, the model's capabilities, then the user's own."""

    capabilities: Any
    restrict: dict[str, list[Any]]

    @property
    def excluded(self) -> dict[str, str]:
        """plan field -> why the runtime cannot apply its other values here (the plan report)."""
        return self.capabilities.excluded


def _restricted(caps: Any, user: Mapping[str, list[Any]]) -> Capable:
    restrict: dict[str, list[Any]] = {k: list(v) for k, v in RUNTIME_SUPPORT.items()}
    restrict.update({k: list(v) for k, v in caps.allowed.items()})
    restrict.update(user)
    return Capable(caps, restrict)


def find_capabilities(module: nn.Module, model: nn.Module | None, analysis: Any, example: tuple[tuple, dict] | None,
                      options: SetupOptions, automatic: bool = True, world_size: int = 1,
                      rank: int = 0, model_call: Callable[[], Any] | None = None) -> Capable:
    """The capabilities stage: a fixed tp checked, then the runtime's limits for a transformer (what each
    parallelism's check refuses for this model's structure, ``parallel.apply.model_capabilities``; ``model_call``
    the user's call of its model, traced where token ids leave parts of it idle) or for a model in unit form
    (``_unit_capabilities``), each with its reason in the report."""
    from lightning_autopar.parallel.apply import check_pipeline_once, check_unit_pipeline, model_capabilities
    from lightning_autopar.parallel.tensor import check_tp

    fix = options.fix
    pp, vpp = fix.get("pp", 1), fix.get("vpp", 1)
    if analysis.spec.unit_form:
        caps = _unit_capabilities(module, model, analysis, example, fix, automatic, world_size, rank)
        if pp > 1 and automatic:  # a pinned pipeline the runtime refuses: its line now, not a plan priced
            caps.checked("unit pp", (pp, vpp), lambda: check_unit_pipeline(module, model, analysis, example, pp, vpp))
    else:
        if "tp" in fix:  # unit form: the planner refuses tp > 1 (check_unit_fix)
            check_tp(analysis, fix["tp"])
        caps = model_capabilities(module, model, analysis, automatic, model_call)
        if pp > 1:
            check_pipeline_once(module, model, analysis, pp, vpp, caps, model_call)
    if analysis.collectives:
        _own_collectives(caps, analysis.collectives, rank)
    return _restricted(caps, options.restrict)


def _own_collectives(caps: Any, collectives: list[str], rank: int) -> None:
    """The model calls torch.distributed itself (``Analysis.collectives``): on the default group, which is the
    data-parallel replicas only when nothing else splits the model, so tp, pp, cp and ep stay 1 (each with this
    reason); one warning on rank 0, naming the call."""
    line = f"the model calls {collectives[0]} itself" + (f" (and {len(collectives) - 1} more torch.distributed "
                                                         "calls)" if len(collectives) > 1 else "")
    for name in ("tp", "pp", "cp", "ep"):
        if caps.allowed.get(name) != [1]:
            caps.exclude(name, [1], f"{line}, on the default group, which holds the data-parallel replicas only "
                         "when nothing else splits the model")
    if rank == 0:
        warnings.warn(f"autopar: {line}: under data parallelism it runs over the data-parallel ranks, where one "
                      "device runs it alone; tp, pp, cp and ep are not planned", stacklevel=3)


def _unit_capabilities(module: nn.Module, model: nn.Module | None, analysis: Any, example: tuple[tuple, dict] | None,
                       fix: Mapping[str, Any], automatic: bool, world_size: int, rank: int) -> Any:
    """The runtime's limits for a model in unit form (the planner itself keeps tp = cp = ep = 1 and, with
    BatchNorm, grad_accum = 1 unless fixed): pp where its stages can be traced (``check_unit_pipeline``, the
    reason in the report otherwise). A grad_accum the user fixes on a BatchNorm model gets one warning."""
    from lightning_autopar.parallel.apply import LOOP_BACKWARD_ACCUM, LOOP_BACKWARD_PP, unit_pipeline_limits
    from lightning_autopar.parallel.batchnorm import batchnorm_modules
    from lightning_autopar.parallel.capabilities import Capabilities

    caps = Capabilities.of(analysis)
    if not automatic:
        caps.exclude("grad_accum", [1], LOOP_BACKWARD_ACCUM)
        caps.exclude("pp", [1], LOOP_BACKWARD_PP)
    else:
        unit_pipeline_limits(module, model, analysis, example, world_size, caps, _pp_left(fix, world_size))
    fixed = fix.get("grad_accum")
    if batchnorm_modules(model) and fixed is not None and fixed > 1 and rank == 0:
        warnings.warn(f"autopar: grad_accum={fixed} is fixed and {analysis.spec.name} has BatchNorm: its "
                      "statistics (and running buffers) are per micro-batch, as on one device running "
                      f"{fixed} micro-batches per step, not the whole batch at once", stacklevel=3)
    return caps


def _pp_left(fix: Mapping[str, Any], world_size: int) -> set[int] | None:
    """The pipeline degrees a fix leaves a model in unit form (None: any). Its plans keep tp = cp = 1, so a fixed
    dp leaves pp = world / dp alone."""
    if "pp" in fix:
        return {int(fix["pp"])}
    if "dp" in fix and world_size % int(fix["dp"]) == 0:
        return {world_size // int(fix["dp"])}
    return None


# ------------------------------------------------------------------ plan


@dataclass
class PlanOn:
    """Planning the analysed model on a cluster (``planner.search.plan``); every changed cluster (calibrated,
    refit) is planned on again with it. Asks for enough candidates for the trials to have distinct plans."""

    spec: Any  # the analysis's ModelSpec at the batch's length
    global_batch: int
    seq_len: int  # the length priced: a fixed cp pads (parallel.context.priced_length)
    precision: str
    restrict: dict[str, list[Any]]
    options: SetupOptions

    def __call__(self, cluster: ClusterSpec) -> Any:
        from lightning_autopar.planner.search import plan

        options = self.options
        return plan(self.spec, cluster, global_batch=self.global_batch, seq_len=self.seq_len, fix=options.fix,
                    top=max(options.top, options.settings.candidates), restrict=self.restrict,
                    precision=self.precision, memory_fraction=options.memory_fraction)


@dataclass
class Planned:
    """The first planning, on the cluster as given or discovered, and how to plan again."""

    report: Any  # planner.report.PlanReport
    plan_on: PlanOn
    started: float  # time.perf_counter() when planning began (the capabilities included)


def priced_spec(analysed: Analysed, capable: Capable) -> Any:
    """The model spec the planner prices: the analysis's, with vocabulary parallelism off where the capabilities
    refuse it for this model (``Capabilities.vocab``), so the embedding and head are priced as the runtime holds
    them."""
    spec = analysed.analysis.spec
    if analysed.unit_form or not capable.capabilities.vocab or capable.capabilities.vocab == NOT_CHECKED:
        return spec
    return dataclasses.replace(spec, vocab_parallel=False)


def plan_model(analysed: Analysed, capable: Capable, cluster: ClusterSpec, precision_name: str,
               options: SetupOptions, started: float | None = None, live: Live | None = None) -> Planned:
    """The plan stage: the framework's precision setting ("bf16-mixed", ...) as the plan's, the length priced (a
    causal model's cp pads), and the planner run on ``cluster`` (``live``: by rank 0, its report given to every
    rank, ``Live.shared``)."""
    from lightning_autopar.parallel.context import priced_length
    from lightning_autopar.parallel.precision import plan_precision

    started = time.perf_counter() if started is None else started
    seq_len = analysed.seq_len
    priced_seq = seq_len if analysed.unit_form else priced_length(
        capable.capabilities.causal, analysed.analysis.spec.name, seq_len, options.fix.get("cp") or 1)
    plan_on = PlanOn(priced_spec(analysed, capable), analysed.global_batch, priced_seq,
                     plan_precision(precision_name), capable.restrict, options)
    return Planned((live or Live()).shared(lambda: plan_on(cluster)), plan_on, started)


def announce(report: Any, line: str, analysed: Analysed, live: Live, started: float, print_plan: bool) -> None:
    """Rank 0: the plan table, the chosen plan and the measurement ``line`` (with ``print_plan``), the launcher's
    environment hints, and the warning when SP / CP pad the sequence."""
    from lightning_autopar.parallel.sequence import padding_note

    plan = report.best.plan
    if live.rank != 0:
        return
    if print_plan:
        report.print_table()
        print(f"autopar: planned in {time.perf_counter() - started:.2f}s for world {live.world_size}, "
              f"global batch {analysed.global_batch}, seq {analysed.seq_len}: {plan.short()}", flush=True)
        print(f"autopar: {line}", flush=True)
        from lightning_autopar.launch import print_env_hints

        print_env_hints(plan, report.cluster)
    note = "" if analysed.unit_form else padding_note(plan, analysed.seq_len)
    if note:
        warnings.warn(note, stacklevel=3)


# ------------------------------------------------------------------ apply


@dataclass
class SetUp:
    """The plan applied: its mesh, the module's parallel form (``parallel.apply.Applied``) and the step runtime."""

    layout: Any  # topology.mesh.MeshLayout
    env: StepEnv
    steps: PipelineSteps  # pipe None when pp == 1
    applied: Any
    model: nn.Module  # the block stack (or unit-form model) the plan was applied to


def apply_setup(plan: Plan, analysed: Analysed, capable: Capable, layers_per_stage: Any, work: Workload, live: Live,
                options: SetupOptions) -> SetUp:
    """The apply stage: the mesh for ``plan``, the plan applied to the module (``parallel.apply.apply_plan``) and
    the step runtime over them (``runtime.step``, ``runtime.pipeline_step``)."""
    from lightning_autopar.parallel.apply import apply_plan
    from lightning_autopar.topology.mesh import build_mesh

    module, device = work.module, live.device
    layout = build_mesh(plan, device.type)
    set_module_device_mesh(module, layout.mesh)
    if (plan.pp > 1 or plan.ep > 1) and not options.save_distributed_checkpoint:
        raise ConfigError("save_distributed_checkpoint", "with pp>1 or ep>1 each rank holds different "
                          "parameters, so a single-file checkpoint from rank 0 would miss them",
                          "keep save_distributed_checkpoint=True")
    if plan.pp > 1 and not work.automatic:
        raise ConfigError("plan.pp", "pipeline parallelism runs forward and backward itself, which manual "
                          "optimization cannot do", "use pp=1, or automatic optimization (Fabric / Accelerate: "
                          "step_call=True and model.train_step)")
    broadcast_module(module)
    env = StepEnv(module, DataParallelGroup(layout["dp_flat"], device), work.train_context, work.eval_context)
    steps = PipelineSteps(env, work.loss_scaler)
    applied = apply_plan(module, analysed.model, analysed.analysis, plan, layout, dp_mesh(layout, plan), device,
                         loss_fn=steps.loss, layers_per_stage=layers_per_stage, capacity_factor=options.capacity_factor,
                         example=analysed.example, capabilities=capable.capabilities)
    env.fsdp_roots = applied.fsdp_roots
    steps.pipe, steps.model = applied.pipeline, applied.pipeline_root or analysed.model  # what the user's steps call
    return SetUp(layout, env, steps, applied, analysed.model)


def check_batch(plan: Plan | None, capabilities: Any, model: nn.Module | None, batch: Any) -> None:
    """Checks of a training batch that need the applied plan, before the step's first collective (every rank
    holds the same batch, so every rank stops with the same line): its sequence length under SP / CP."""
    from lightning_autopar.parallel.apply import check_batch_length

    if plan is not None and (plan.sp or plan.cp > 1) and model is not None:
        check_batch_length(plan, capabilities, sequence_length(batch))


def norm_parts(applied: Any, plan: Plan | None, layout: Any) -> list[Any] | None:
    """Parameter parts for gradient clipping when ranks hold different parameters (stages, experts)."""
    if applied is None or plan is None:
        return None
    pp = [layout["pp"].get_group()] if plan.pp > 1 else []
    parts: list[Any] = []
    if applied.expert_meshes:
        ids = applied.expert_params()
        parts.append((lambda p: id(p) in ids, [applied.expert_meshes["ep"].get_group(), *pp]))
    if not parts and not pp:
        return None
    return parts + [(lambda p: True, pp)]
