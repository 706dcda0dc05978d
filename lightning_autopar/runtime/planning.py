"""Planning shared by the Trainer and Fabric strategies: analyse the user's model, read the global batch and
sequence length from the plan's DataLoader, restrict the search to what the runtime can apply, plan, build the
DeviceMesh, apply the plan (``parallel.apply``) and set up the step runtime over it (``runtime.step``,
``runtime.pipeline_step``). Each framework's strategy supplies, through the small methods at the top of
``PlanningMixin``, where the DataLoader, the user's model call and the precision's contexts come from.

The constructor arguments are the strategies' (``AutoParallelStrategy(fix=..., cluster=...)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.topology.mesh import pg_timeout
from lightning_autopar.topology.worker import install_excepthook
from lightning_autopar.runtime.analysis import analyse, sequence_length
from lightning_autopar.runtime.batches import batch_rows, leading_size
from lightning_autopar.runtime.group import DataParallelGroup, broadcast_module, dp_mesh
from lightning_autopar.runtime.lightning_private import set_module_device_mesh
from lightning_autopar.runtime.pipeline_step import PipelineSteps
from lightning_autopar.runtime.step import StepEnv
from lightning_autopar.runtime.trial import (MIN_SETUP_S, QUICK_MIN_STEPS, RngState, SetupOutcome, SetupSettings,
                                             fastest, run_trials)
from lightning_autopar.specs import ClusterSpec, Plan, RuntimeProfile, TrialResult, parse_fix

# What the runtime cannot apply on any model (the backend lacks it); the planner searches only inside it unless
# the user fixes a field. Empty: every plan kind the planner searches runs (tests/test_plan_parity.py). What a
# given model's structure refuses is excluded per model (tp, sp, cp, pp, ep), with the reason: its capabilities
# (parallel/capabilities.py), built once in _restrictions.
RUNTIME_SUPPORT: dict[str, list[Any]] = {}


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
        (``parallel.tensor.keep_optimizer_row_order``), so optimizer checkpoints reshard across plans."""
        from lightning_autopar.parallel.tensor import keep_optimizer_row_order

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
        """(global batch, sequence length) from the training DataLoader, as on one device. A model in unit form
        has no sequence: a sample is one batch row (seq 1); a transformer traced on the user's call (``traced``:
        a ViT on pixels) has the length its attention saw, not the batch's second dimension."""
        global_batch, seq_len = self._global_batch_arg, None
        loader = self._plan_loader()
        if loader is not None and global_batch is None:
            global_batch = getattr(loader, "batch_size", None)
        first = self._first_batch()
        if first is not None:
            # a batch without a batch dimension fails here, at set-up, not at step 1 (runtime.batches)
            rows = batch_rows(first, "DataLoader")
            global_batch = global_batch or rows
            seq_len = sequence_length(first)
        if not global_batch:
            global_batch = self.world_size
        if self.analysis is not None and self.analysis.spec.unit_form:
            seq_len = 1
        elif traced and transformer_seq:
            seq_len = transformer_seq
        return int(global_batch), int(seq_len or transformer_seq or 1)


    def _analyse(self) -> tuple[nn.Module, Any, tuple[tuple, dict] | None]:
        """(the model the plan applies to, its analysis, the user's call of it or None): ``runtime.analysis``."""
        return analyse(self.lightning_module, self._model_call)

    def _restrictions(self, transformer: nn.Module, analysis: Any, precision: str) -> dict[str, list[Any]]:
        """The runtime's limits for a transformer: its capabilities (``parallel.capabilities``: what each
        parallelism's check refuses for this model's structure, each with its reason in the report), kept as
        ``self.capabilities`` for check_plan, the apply and the per-batch checks."""
        from lightning_autopar.parallel.apply import model_capabilities

        caps = self.capabilities = model_capabilities(self.lightning_module, transformer, analysis,
                                                      self._automatic_optimization())
        return self._restricted(caps)

    def _restricted(self, caps: Any) -> dict[str, list[Any]]:
        """The planner's ``restrict``: the runtime's support, the model's capabilities, then the user's own."""
        self.excluded = caps.excluded
        restrict: dict[str, list[Any]] = {k: list(v) for k, v in RUNTIME_SUPPORT.items()}
        restrict.update({k: list(v) for k, v in caps.allowed.items()})
        restrict.update(self._restrict)
        return restrict

    def _unit_restrictions(self, analysis: Any, model: nn.Module, example: tuple[tuple, dict]) -> dict[str, list[Any]]:
        """The runtime's limits for a model in unit form (the planner itself keeps tp = cp = ep = 1 and, with
        BatchNorm, grad_accum = 1 unless fixed): pp where its stages can be traced (``check_unit_pipeline``, the
        reason in the report otherwise). A grad_accum the user fixes on a BatchNorm model gets one warning."""
        from lightning_autopar.parallel.apply import check_unit_pipeline
        from lightning_autopar.parallel.batchnorm import batchnorm_modules
        from lightning_autopar.parallel.capabilities import Capabilities

        caps = self.capabilities = Capabilities.of(analysis)
        if not self._automatic_optimization():
            caps.exclude("grad_accum", [1], "the user's loop runs backward (manual optimization)")
            caps.exclude("pp", [1], "pipeline parallelism runs backward itself; manual optimization cannot")
        else:
            # the smallest pipeline this world allows: the check traces the model (torch.export), so a world with
            # no pp > 1 (one process) pays nothing; check_plan reads its outcome for a plan at that degree
            pp = next((d for d in range(2, self.world_size + 1) if self.world_size % d == 0), None)
            try:
                if pp is not None:
                    caps.checked("unit pp", (pp, 1), lambda: check_unit_pipeline(
                        self.lightning_module, model, analysis, example, pp))
            except ConfigError as err:
                caps.exclude("pp", [1], str(err))
        fixed = self._fix.get("grad_accum")
        if batchnorm_modules(model) and fixed is not None and fixed > 1 and self.global_rank == 0:
            warnings.warn(f"autopar: grad_accum={fixed} is fixed and {analysis.spec.name} has BatchNorm: its "
                          "statistics (and running buffers) are per micro-batch, as on one device running "
                          f"{fixed} micro-batches per step, not the whole batch at once", stacklevel=2)
        return self._restricted(caps)

    def _plan_and_apply(self, precision_name: str) -> None:
        """Plan for the model and the plan DataLoader and apply the plan; ``precision_name`` is the framework's
        precision setting ("bf16-mixed", ...)."""
        from lightning_autopar.parallel.precision import plan_precision
        from lightning_autopar.parallel.tensor import check_tp
        from lightning_autopar.planner.search import plan as make_plan

        transformer, analysis, example = self._analyse()
        self.analysis = analysis
        unit_form = analysis.spec.unit_form
        global_batch, seq_len = self._batch_geometry(analysis.spec.seq_len, traced=example is not None)
        self._global_batch = global_batch
        # what the plan is for: the analysis at the batch's length (a copy: the analysis itself is not changed)
        analysis = self.analysis = dataclasses.replace(analysis, spec=dataclasses.replace(analysis.spec,
                                                                                          seq_len=seq_len))
        precision = plan_precision(precision_name)
        if "tp" in self._fix and not unit_form:  # unit form: the planner refuses tp > 1 (check_unit_fix)
            check_tp(analysis, self._fix["tp"])
        started = time.perf_counter()
        restrict = (self._unit_restrictions(analysis, transformer, example) if unit_form
                    else self._restrictions(transformer, analysis, precision))

        from lightning_autopar.parallel.context import priced_length
        from lightning_autopar.parallel.sequence import padding_note

        priced_seq = seq_len if unit_form else priced_length(self.capabilities.causal, analysis.spec.name, seq_len,
                                                             self._fix.get("cp") or 1)  # a fixed cp pads

        def plan_on(cluster: Any) -> Any:  # enough candidates for the trials to have distinct plans
            return make_plan(analysis.spec, cluster, global_batch=global_batch, seq_len=priced_seq, fix=self._fix,
                             top=max(self._top, self._setup.candidates), restrict=restrict, precision=precision,
                             memory_fraction=self._memory_fraction)

        self.report = plan_on(self._cluster_spec())
        outcome = self.setup_outcome = self._measure(plan_on, transformer, analysis, precision, started)
        # the planner's own exclusions (unit form) and the runtime's
        self.report.excluded = {**self.report.excluded, **self.excluded}
        plan = self.plan = self.report.best.plan
        if self.global_rank == 0 and self._print_plan:
            self.report.print_table()
            print(f"autopar: planned in {time.perf_counter() - started:.2f}s for world {self.world_size}, "
                  f"global batch {global_batch}, seq {seq_len}: {plan.short()}", flush=True)
            print(f"autopar: {outcome.line(self.report.best, self.report.source)}", flush=True)
            from lightning_autopar.launch import print_env_hints

            print_env_hints(plan, self.report.cluster)
        note = "" if unit_form else padding_note(plan, seq_len)
        if self.global_rank == 0 and note:
            warnings.warn(note, stacklevel=2)
        self._apply(plan, transformer, analysis, example)

    # ------------------------------------------------------------------ set-up profiling and trials

    def _measure(self, plan_on: Any, model: nn.Module, analysis: Any, precision: str, started: float) -> SetupOutcome:
        """Set-up measurement (docs/profiling.md), after the first planning: the cached profile and calibrated
        cluster, or a runtime profile within the set-up budget and its calibration; then trials of the best
        distinct plans and the refit. Each changed cluster is planned on again (``plan_on``); ``self.report`` is
        the last planning, with ``profile`` and ``trials`` set and the measured-fastest plan as ``best``."""
        from lightning_autopar.planner.calibrate import calibrate
        from lightning_autopar.profile.runtime import cluster_fingerprint, model_fingerprint, profile_runtime

        settings, report = self._setup, self.report
        steps = self._planned_steps()
        run_s = None if steps is None else steps * report.best.step_time_s
        out = SetupOutcome(budget_s=settings.budget_s(run_s, steps), quick=settings.quick(run_s, steps),
                           plan_s=time.perf_counter() - started)
        plans = [report.best.plan] if out.quick else [c.plan for c in report.candidates]  # quick: the best only
        keys = (cluster_fingerprint(report.cluster),
                model_fingerprint(analysis.spec, report.global_batch, report.seq_len, precision))
        cache = None if settings.profile is False else settings.cache_dir()  # profile=False: the cluster as given
        cached = self._load_cached(keys, cache)
        profile, cluster = cached or (None, report.cluster)
        out.cached = cached is not None
        # a calibrated cluster file (a cache's cluster.yaml, `autopar probe`) is priced with as it is, so the CLI
        # and the strategy predict the same from it; profile=True measures anyway
        given = bool(report.cluster.runtime.source) and settings.profile is not True
        if cached is None and given:
            out.skipped = f"the cluster given is calibrated ({report.cluster.runtime.source})"
        elif cached is None and settings.profile is not False and out.budget_s > 0:
            with self._state_kept():
                profile = profile_runtime(model, analysis, plans, report.seq_len,
                                          precision, out.budget_s, self.root_device, self._step_pass())
            profile.cluster_key, profile.model_key = keys
            out.profile_s = profile.seconds  # the slowest rank's: every rank decides the trials on it
            tick = time.perf_counter()
            cluster = calibrate(cluster, analysis.spec, profile, precision)
            out.calibrate_s = time.perf_counter() - tick
        elif cached is None:
            out.skipped = ("profile=False" if settings.profile is False else "not training" if steps == 0 else
                           "no planned run to take a share of: profile=True measures" if steps is None else
                           f"budget {out.budget_s:.3g}s below {MIN_SETUP_S:g}s and {steps} steps below "
                           f"{QUICK_MIN_STEPS}: profile=True measures anyway")
        if out.profile_s:  # calibrated just now: its fixed costs too (a cached cluster has them already)
            cluster = self._with_path_costs(cluster, keys[0], cache, out)
        if cluster is not report.cluster:
            tick = time.perf_counter()
            self.report = plan_on(cluster)
            out.calibrate_s += time.perf_counter() - tick
        trials = list(profile.trials) if profile is not None else []
        if not trials and self._wants_trials(out):
            trials = self._run_trials(out, analysis, plan_on)
            profile = profile or RuntimeProfile(cluster_key=keys[0], model_key=keys[1])
            profile.trials = trials
        self.report.profile, self.report.trials = profile, trials
        self._choose(fastest(trials), fresh=out.trials_run > 0)
        if cache is not None and profile is not None and (out.profile_s or out.trials_run):
            out.cluster_file = self._save(profile, cache)
        elif out.cached:
            from lightning_autopar.profile.runtime import profile_folder

            out.cluster_file = str(profile_folder(*keys, cache) / "cluster.yaml")
        self.report.source = out.figures_source(self.report.source)
        return out

    def _step_pass(self) -> Any:
        """mbs -> a forward of the user's own ``training_step`` on the first ``mbs`` rows of the plan's first batch,
        returning its loss (``self.log`` recorded and dropped, the precision's autocast on): what the set-up profile
        times, so the loss, the logging and the model's own call are those training runs. None without a batch,
        a training_step or automatic optimization (the profile then runs the model on token ids)."""
        from lightning.fabric.utilities.apply_func import move_data_to_device

        from lightning_autopar.runtime.batches import slice_batch
        from lightning_autopar.runtime.logs import LogRecorder, recording_logs
        from lightning_autopar.runtime.step import loss_of

        module, batch = self.lightning_module, self._first_batch()
        if batch is None or not self._automatic_optimization() or not callable(getattr(module, "training_step", None)):
            return None
        batch = move_data_to_device(batch, self.root_device)
        total = leading_size(batch) or 1

        def make(mbs: int) -> Any:
            rows = slice_batch(batch, 0, min(mbs, total), total)

            def forward() -> Any:
                with recording_logs(module, LogRecorder()), self._train_context():
                    loss = loss_of(module.training_step(rows, 0))
                if loss is None:
                    raise RuntimeError("training_step returned no loss")
                return loss

            return forward

        return make

    @contextlib.contextmanager
    def _state_kept(self) -> Any:
        """The module's gradients and buffers (BatchNorm statistics, counters) as before on exit: the set-up
        profile runs its training step."""
        import torch

        from lightning_autopar.profile.runtime import kept_gradients

        module = self.lightning_module
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        try:
            with kept_gradients(module):
                yield
        finally:
            with torch.no_grad():
                for name, b in module.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])

    def _with_path_costs(self, cluster: ClusterSpec, cluster_key: str, cache: Path | None,
                         out: SetupOutcome) -> ClusterSpec:
        """``cluster`` with the runtime's fixed costs (runtime/paths.py): as it is when it has them (a cached or
        given calibrated cluster), else the ones cached for this cluster, else measured on the runtime's own paths
        when the set-up budget has PATHS_MIN_S left after the profile (cached per cluster only when every path
        ran, so a short budget does not leave a partial fit behind)."""
        from lightning_autopar.planner.calibrate import merged_runtime
        from lightning_autopar.profile.runtime import load_cluster_costs, save_cluster_costs
        from lightning_autopar.runtime.paths import PATHS_MIN_S, SOURCE, measure_paths, path_plans

        if SOURCE in cluster.runtime.source:
            return cluster
        costs = None
        if cache is not None:
            costs = self.broadcast(load_cluster_costs(cluster_key, cache) if self.global_rank == 0 else None)
        if costs is None:
            left = out.budget_s - out.profile_s
            if left < PATHS_MIN_S or out.quick:  # quick: the trial of the best plan measures its fixed costs
                return cluster
            tick = time.perf_counter()
            costs, timings = measure_paths(cluster, self.root_device, left)
            out.paths_s = time.perf_counter() - tick
            if cache is not None and len(timings) == len(path_plans(self.world_size)):
                save_cluster_costs(cluster_key, costs, [vars(t) for t in timings], cache)
        source = f"{cluster.runtime.source} + {costs.source}" if cluster.runtime.source else costs.source
        return dataclasses.replace(cluster, runtime=merged_runtime(cluster.runtime, costs, source))

    def _save(self, profile: RuntimeProfile, cache: Path) -> str:
        """Rank 0 writes the profile and the report's (calibrated) cluster to the cache; a cache that cannot be
        written (OSError) costs a warning, not the run. Every rank gets the cluster.yaml path ("" if not written)."""
        from lightning_autopar.profile.runtime import save_profile

        path = ""
        if self.global_rank == 0:
            try:
                path = str(save_profile(profile, self.report.cluster, cache) / "cluster.yaml")
            except OSError as err:
                warnings.warn(f"autopar: the profile cache {cache} could not be written ({err}); the next run "
                              "measures again", stacklevel=2)
        return str(self.broadcast(path))

    def _load_cached(self, keys: tuple[str, str], cache: Any) -> tuple[RuntimeProfile, ClusterSpec] | None:
        """Rank 0's cached (profile, calibrated cluster) for ``keys``, on every rank (None without one)."""
        if cache is None:
            return None
        from lightning_autopar.profile.runtime import load_profile

        return self.broadcast(load_profile(*keys, cache) if self.global_rank == 0 else None)

    def _trial_refusal(self) -> str:
        """Why this set-up cannot run trials ("" when it can): a trial runs the module's own training_step and
        configure_optimizers on the plan DataLoader's first batch."""
        module = self.lightning_module
        if self._planned_steps() == 0:
            return "not training"
        if not all(callable(getattr(module, name, None)) for name in ("training_step", "configure_optimizers")):
            return "the module has no training_step and configure_optimizers for a trial to run"
        if not getattr(module, "automatic_optimization", True):
            return "manual optimization: the training_step steps the optimizer itself"
        if self._first_batch() is None:
            return "no batch to run on (Fabric: set up the DataLoader before the model)"
        return ""

    def _wants_trials(self, out: SetupOutcome) -> bool:
        """trials=K asks for them (a module that cannot run one: ConfigError, unless not training); None: when the
        set-up budget has room after the profile."""
        count = self._setup.trials
        if count == 0 or (count is None and out.budget_s - out.profile_s - out.paths_s <= 0):
            return False
        refusal = self._trial_refusal()
        if refusal and count is not None and refusal != "not training":
            raise ConfigError("trials", refusal, "use trials=0")
        return not refusal

    def _run_trials(self, out: SetupOutcome, analysis: Any, plan_on: Any) -> list[TrialResult]:
        """Trials of the best distinct plans on the first batch, then the refit and the planning on it."""
        from lightning.fabric.utilities.apply_func import move_data_to_device

        from lightning_autopar.planner.calibrate import refit

        tick = time.perf_counter()
        batch = move_data_to_device(self._first_batch(), self.root_device)
        trials = run_trials(self.lightning_module, self.report.candidates, batch, self.root_device,
                            self._setup.trials, out.budget_s - out.profile_s - out.paths_s)
        out.trials_s, out.trials_run = time.perf_counter() - tick, len(trials)
        ran = [(Plan(**t.plan), t.measured_s) for t in trials if not t.error]
        if ran:
            tick = time.perf_counter()
            report = self.report
            self.report = plan_on(refit(report.cluster, analysis.spec, ran, report.global_batch, report.seq_len))
            out.refit_s = time.perf_counter() - tick
        return trials

    def _choose(self, chosen: Plan | None, fresh: bool) -> None:
        """Make ``chosen`` (the measured-fastest trial's plan) ``report.best`` and the first candidate: its entry
        among the candidates or, for trials just run, its price on the report's cluster. A cached choice no
        longer among the candidates leaves the planner's best."""
        from lightning_autopar.planner.search import estimate

        report = self.report
        if chosen is None:
            return
        priced = next((c for c in report.candidates if c.plan == chosen), None)
        if priced is None and not fresh:
            return
        if priced is None:
            priced = estimate(report.model, report.cluster, chosen, report.global_batch, report.seq_len,
                              memory_fraction=self._memory_fraction)
        report.candidates = [priced, *(c for c in report.candidates if c is not priced)]
        report.best = priced

    def _apply(self, plan: Plan, transformer: nn.Module, analysis: Any, example: tuple[tuple, dict] | None) -> None:
        """The mesh for ``plan``, the plan applied to the module, and the step runtime over them."""
        from lightning_autopar.parallel.apply import apply_plan
        from lightning_autopar.topology.mesh import build_mesh

        module = self.lightning_module
        layout = self.mesh_layout = build_mesh(plan, self.root_device.type)
        self._device_mesh = layout.mesh
        set_module_device_mesh(module, layout.mesh)
        if (plan.pp > 1 or plan.ep > 1) and not self._save_distributed_checkpoint:
            raise ConfigError("save_distributed_checkpoint", "with pp>1 or ep>1 each rank holds different "
                              "parameters, so a single-file checkpoint from rank 0 would miss them",
                              "keep save_distributed_checkpoint=True")
        if plan.pp > 1 and not module.automatic_optimization:
            raise ConfigError("plan.pp", "pipeline parallelism runs forward and backward itself, which manual "
                              "optimization cannot do", "use pp=1, or automatic optimization")
        broadcast_module(module)
        env = self._step_env = StepEnv(module, DataParallelGroup(layout["dp_flat"], self.root_device),
                                       self._train_context, self._eval_context)
        steps = self._pipeline_steps = PipelineSteps(env, self._loss_scaler)
        applied = self._applied = apply_plan(
            module, transformer, analysis, plan, layout, dp_mesh(layout, plan), self.root_device, loss_fn=steps.loss,
            layers_per_stage=self.report.best.layers_per_stage, capacity_factor=self._capacity_factor,
            example=example, capabilities=self.capabilities)
        self._fsdp_roots = env.fsdp_roots = applied.fsdp_roots
        steps.pipe, steps.model = applied.pipeline, applied.pipeline_root or transformer  # what the user's steps call
        self._transformer = transformer
        self._first_of = None  # the batch is not held for the whole run

    def _check_batch(self, batch: Any) -> None:
        """Checks of a training batch that need the applied plan, before the step's first collective (every rank
        holds the same batch, so every rank stops with the same line): its sequence length under SP / CP."""
        from lightning_autopar.parallel.apply import check_batch_length

        plan = self.plan
        if plan is not None and (plan.sp or plan.cp > 1) and self._transformer is not None:
            check_batch_length(plan, self.capabilities, sequence_length(batch))

    def _norm_parts(self) -> list[Any] | None:
        """Parameter parts for gradient clipping when ranks hold different parameters (stages, experts)."""
        applied, plan = self._applied, self.plan
        if applied is None or plan is None:
            return None
        pp = [self.mesh_layout["pp"].get_group()] if plan.pp > 1 else []
        parts: list[Any] = []
        if applied.expert_meshes:
            ids = applied.expert_params()
            parts.append((lambda p: id(p) in ids, [applied.expert_meshes["ep"].get_group(), *pp]))
        if not parts and not pp:
            return None
        return parts + [(lambda p: True, pp)]

