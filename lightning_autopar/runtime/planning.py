"""The strategies' framework side of set-up, shared by the Trainer and Fabric strategies: ``PlanningMixin`` reads
the framework's state (the module, the plan's DataLoader and its first batch, the precision's contexts, the rank
and device), calls the set-up stages in order (runtime/setup.py: analyse -> capabilities -> plan -> measure ->
apply) and keeps what they return. Each framework's strategy supplies, through the small methods at the top of
``PlanningMixin``, where the DataLoader, the user's model call and the precision's contexts come from.

The constructor arguments are the strategies' (``AutoParallelStrategy(fix=..., cluster=...)``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Mapping

from torch import nn

from lightning_autopar.runtime.measure import measure
from lightning_autopar.runtime.pipeline_step import PipelineSteps
from lightning_autopar.runtime.setup import (RUNTIME_SUPPORT, Analysed, Capable, Live, SetupOptions, Workload,
                                             analyse_model, announce, apply_setup, batch_geometry, check_batch,
                                             find_capabilities, norm_parts, plan_model)
from lightning_autopar.runtime.step import StepEnv
from lightning_autopar.runtime.trial import RngState, SetupOutcome, SetupSettings
from lightning_autopar.specs import ClusterSpec, Plan, parse_fix
from lightning_autopar.topology.mesh import pg_timeout
from lightning_autopar.topology.worker import install_excepthook

__all__ = ["RUNTIME_SUPPORT", "PlanningMixin"]


class PlanningMixin(ABC):
    """The strategies' shared state and planning, independent of which framework provides the base class."""

    strategy_name = "autopar"

    def __init__(
        self,
        fix: str | Mapping[str, Any] | None = None,
        cluster: str | Mapping[str, Any] | ClusterSpec | None = None,
        global_batch: int | None = None,
        restrict: Mapping[str, list[Any]] | None = None,
        top: int = 5,
        print_plan: bool = True,
        memory_fraction: float = 0.9,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        save_distributed_checkpoint: bool = True,
        moe_capacity_factor: float | None = None,
        trials: int | None = None,
        profile: bool | None = None,
        profile_budget_s: float = 10.0,
        profile_fraction: float = 0.02,
        profile_cache: str | bool | None = None,
    ) -> None:
        install_excepthook()
        super().__init__(
            data_parallel_size=1,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=pg_timeout(timeout),  # timeout=, else $AUTOPAR_PG_TIMEOUT, else 30 min
        )
        self._fix = parse_fix(fix)  # bad keys and values fail here, before any process starts
        # set-up profiling and trials (runtime.trial.SetupSettings); bad values fail here too
        self._setup = SetupSettings(trials, profile, profile_budget_s, profile_fraction, profile_cache)
        self.setup_outcome: SetupOutcome | None = None
        self._cluster_arg = cluster
        self._global_batch_arg = global_batch
        self._restrict = dict(restrict or {})
        self._top = top
        self._print_plan = print_plan
        self._memory_fraction = memory_fraction
        self.plan: Plan | None = None
        self.report: Any = None
        self.mesh_layout: Any = None
        self.analysis: Any = None
        self.excluded: dict[str, str] = {}  # plan field -> why the runtime cannot apply its other values here
        self.capabilities: Any = None  # what the runtime can apply to the model (parallel.capabilities)
        self._fsdp_roots: list[nn.Module] = []
        self._global_batch = 0
        self._capacity_factor = moe_capacity_factor  # None: no token dropped (parallel.experts)
        self._applied: Any = None
        self._applied_to: Any = None  # the LightningModule the plan was applied to
        self._step_env: StepEnv | None = None  # what the step runtime runs with, once the plan is applied
        self._pipeline_steps: PipelineSteps | None = None  # its pipeline steps (pipe None when pp == 1)
        self._first_of: tuple[Any, Any] | None = None  # (plan DataLoader, its first batch)
        self._transformer: nn.Module | None = None  # the block stack the plan was applied to

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Both frameworks' registries take the strategy under the same name (``Strategy.register_strategies``)."""
        strategy_registry.register(cls.strategy_name, cls, description="Automatic parallelism planned by autopar")

    # ------------------------------------------------------------------ what each framework supplies

    @abstractmethod
    def _plan_loader(self) -> Any:
        """The DataLoader whose batches the plan is for (None without one)."""

    @abstractmethod
    def _model_call(self) -> Any:
        """The user's call of its model (``profile.units.ModelCall``), for a model analysed in unit form."""

    @abstractmethod
    def _train_context(self) -> AbstractContextManager[Any]:
        """The precision's context around a training step (autocast)."""

    @abstractmethod
    def _eval_context(self) -> AbstractContextManager[Any]:
        """The precision's context around an evaluation step."""

    @abstractmethod
    def _loss_scaler(self) -> Any:
        """The fp16 loss scaler of the framework's precision, or None."""

    def _planned_steps(self) -> int | None:
        """Optimizer steps of the planned run, for the set-up budget (None: unknown, e.g. Fabric, whose loop is
        the user's; 0: not training, so no trials)."""
        return None

    def _automatic_optimization(self) -> bool:
        """Whether the strategy runs the micro-batches' backward itself (Fabric: no, the user's loop does)."""
        return bool(getattr(self.lightning_module, "automatic_optimization", True))

    # ------------------------------------------------------------------ environment

    def _worker_setup(self) -> None:
        from lightning_autopar.topology import worker

        assert self.accelerator is not None
        worker.share_cpu_threads(self.num_processes)
        worker.destroy_at_exit()  # whichever path creates the group below (worker.destroy_at_exit says why)
        worker.start_heartbeat()  # names a peer that stops answering; a failed rank 0's line reaches its peers
        if worker.uses_shared_agent_store():
            self.accelerator.setup_device(self.root_device)
            device_id = self.root_device if self.root_device.type != "cpu" else None
            worker.init_process_group(self._get_process_group_backend(), self._timeout, device_id=device_id)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank reads the whole global batch and takes its slice in training_step.
        return {"num_replicas": 1, "rank": 0}

    @staticmethod
    def _keep_optimizer_layouts(optimizers: list[Any], model: nn.Module) -> None:
        """Optimizer states of TP weights stored in another row order show the single-device order in state dicts
        (``parallel.row_order.keep_optimizer_row_order``), so optimizer checkpoints reshard across plans."""
        from lightning_autopar.parallel.row_order import keep_optimizer_row_order

        for optimizer in optimizers:
            keep_optimizer_row_order(getattr(optimizer, "_optimizer", optimizer), model)

    def _offload_optimizers(self, optimizers: list[Any]) -> None:
        """plan.offload=optimizer: each optimizer's states and step on the host (``parallel.offload.HostStep``)."""
        from lightning_autopar.parallel.offload import offload_optimizers
        from lightning_autopar.runtime.lightning_private import unwrap_optimizer

        if self.plan is not None:
            offload_optimizers([unwrap_optimizer(o) for o in optimizers], self.root_device, self.plan.offload)

    def _cluster_spec(self) -> ClusterSpec:
        from lightning_autopar.specs import load_cluster_spec

        if self._cluster_arg is not None:
            return load_cluster_spec(self._cluster_arg, nodes=self.num_nodes, devices_per_node=self.num_processes)
        from lightning_autopar.topology import discover

        return discover.discover_cluster()

    def _first_batch(self) -> Any:
        """The first batch of the plan's DataLoader (None without one); read once per loader."""
        loader = self._plan_loader()
        if loader is None:
            return None
        cached = self._first_of
        if cached is not None and cached[0] is loader:
            return cached[1]
        rng = RngState.capture()  # iterating a loader draws its seeds from the global RNG: the run's must not move
        try:
            first = next(iter(loader))
        except (TypeError, StopIteration):
            first = None
        finally:
            rng.restore()
        self._first_of = (loader, first)
        return first

    def _batch_geometry(self, transformer_seq: int | None, traced: bool = False) -> tuple[int, int]:
        """(global batch, sequence length) from the plan's DataLoader, as on one device (``setup.batch_geometry``;
        Fabric settles its batch with it when the loader comes after the model)."""
        unit_form = self.analysis is not None and self.analysis.spec.unit_form
        return batch_geometry(self._workload(), self._global_batch_arg, self.world_size, unit_form, transformer_seq,
                              traced)

    # ------------------------------------------------------------------ the set-up stages (runtime/setup.py)

    def _workload(self) -> Workload:
        """What this framework supplies to the stages: the module, the plan DataLoader's first batch and batch
        size, and the step contexts."""
        loader = self._plan_loader()
        return Workload(self.lightning_module, self._first_batch(),
                        getattr(loader, "batch_size", None) if loader is not None else None,
                        self._automatic_optimization(), self._planned_steps(), self._train_context,
                        self._eval_context, self._loss_scaler)

    def _live(self) -> Live:
        return Live(self.global_rank, self.world_size, self.root_device, self.broadcast)

    def _options(self) -> SetupOptions:
        return SetupOptions(self._fix, self._restrict, self._global_batch_arg, self._top, self._memory_fraction,
                            self._setup, self._capacity_factor, self._save_distributed_checkpoint, self._print_plan)

    def _restrictions(self, model: nn.Module | None, analysis: Any, precision: str = "",
                      example: tuple[tuple, dict] | None = None, live: Live | None = None) -> dict[str, list[Any]]:
        """The capabilities stage for this strategy's module (``setup.find_capabilities``; with ``live``, by rank 0:
        the record given to every rank without the memos that hold rank 0's modules, ``Capabilities.for_copy``;
        ``precision`` unused): ``self.capabilities`` (for check_plan, the apply and the per-batch checks) and
        ``self.excluded`` kept, the planner's ``restrict`` returned."""
        capable = (live or Live()).shared(
            lambda: find_capabilities(self.lightning_module, model, analysis, example, self._options(),
                                      self._automatic_optimization(), self.world_size, self.global_rank,
                                      self._model_call),
            lambda found: Capable(found.capabilities.for_copy(), found.restrict))
        self.capabilities, self.excluded = capable.capabilities, capable.excluded
        return capable.restrict

    def _plan_and_apply(self, precision_name: str) -> None:
        """The stages in order (runtime/setup.py): analyse, capabilities, plan, measure, apply, each result kept on
        the strategy; ``precision_name`` is the framework's precision setting ("bf16-mixed", ...)."""
        work, live, options = self._workload(), self._live(), self._options()
        analysed = analyse_model(work, self._model_call, self._global_batch_arg, live.world_size, live)
        self.analysis, self._global_batch = analysed.analysis, analysed.global_batch
        started = time.perf_counter()
        restrict = self._restrictions(analysed.model, analysed.analysis, example=analysed.example, live=live)
        capable = Capable(self.capabilities, restrict)
        planned = plan_model(analysed, capable, self._cluster_spec(), precision_name, options, started, live)
        self.report = planned.report
        measured = measure(planned, analysed, work, live, options.settings, options.memory_fraction)
        report, self.setup_outcome = measured.report, measured.outcome
        report.excluded = {**report.excluded, **self.excluded}  # the planner's own (unit form), the runtime's
        self.report, self.plan = report, report.best.plan
        announce(report, measured.outcome.line(report.best, report.source), analysed, live, started, self._print_plan)
        self._apply(self.plan, analysed, capable, work)

    def _apply(self, plan: Plan, analysed: Analysed, capable: Capable, work: Workload) -> None:
        """The apply stage (``setup.apply_setup``), its mesh and step runtime kept on the strategy."""
        set_up = apply_setup(plan, analysed, capable, self.report.best.layers_per_stage, work, self._live(),
                             self._options())
        self.mesh_layout, self._device_mesh = set_up.layout, set_up.layout.mesh
        self._step_env, self._pipeline_steps, self._applied = set_up.env, set_up.steps, set_up.applied
        self._fsdp_roots, self._transformer = set_up.applied.fsdp_roots, set_up.model
        self._first_of = None  # the batch is not held for the whole run

    def _check_batch(self, batch: Any) -> None:
        """The per-batch checks that need the applied plan (``setup.check_batch``)."""
        check_batch(self.plan, self.capabilities, self._transformer, batch)

    def _norm_parts(self) -> list[Any] | None:
        """Parameter parts for gradient clipping when ranks hold different parameters (``setup.norm_parts``)."""
        return norm_parts(self._applied, self.plan, self.mesh_layout)
