"""The measure stage of set-up (runtime/setup.py; docs/profiling.md "The flow"), after the first planning: the
cached profile and calibrated cluster, or a runtime profile within the set-up budget and its calibration, the
runtime's fixed costs on its own paths; then trials of the best distinct plans and the refit, and the choice of
the measured-fastest plan. Each changed cluster is planned on again (``Planned.plan_on``).

``measure(planned, analysed, work, live, settings, memory_fraction) -> Measured``: explicit inputs only (the
user's module and first batch in ``Workload``, the rank, world, device and broadcast in ``Live``), so it runs
in one process without a strategy (tests/test_setup_stages.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from lightning_autopar.errors import ConfigError
from lightning_autopar.runtime.batches import leading_size
from lightning_autopar.runtime.setup import Analysed, Live, Planned, Workload
from lightning_autopar.runtime.trial import (MIN_SETUP_S, QUICK_MIN_STEPS, SetupOutcome, SetupSettings,
                                             SharedAnalysis, fastest, run_trials)
from lightning_autopar.specs import ClusterSpec, Plan, RuntimeProfile, TrialResult


@dataclass
class Measured:
    """The last planning (``profile`` and ``trials`` set, the measured-fastest plan as ``best``) and what the
    measurement did (``SetupOutcome``: seconds per phase, cached, skipped and why)."""

    report: Any  # planner.report.PlanReport
    outcome: SetupOutcome


def measure(planned: Planned, analysed: Analysed, work: Workload, live: Live, settings: SetupSettings,
            memory_fraction: float = 0.9) -> Measured:
    """The measure stage (module doc). Every rank takes the same decisions: cached values come from rank 0
    (``live.broadcast``) and measured figures are the slowest rank's."""
    return _Measurement(planned, analysed, work, live, settings, memory_fraction).run()


@dataclass
class _Measurement:
    planned: Planned
    analysed: Analysed
    work: Workload
    live: Live
    settings: SetupSettings
    memory_fraction: float

    def run(self) -> Measured:
        from lightning_autopar.planner.calibrate import calibrate
        from lightning_autopar.profile.runtime import cluster_fingerprint, model_fingerprint, profile_runtime

        settings, report, analysis = self.settings, self.planned.report, self.analysed.analysis
        plan_on, precision = self.planned.plan_on, self.planned.plan_on.precision
        steps = self.work.planned_steps
        run_s = None if steps is None else steps * report.best.step_time_s
        out = SetupOutcome(budget_s=settings.budget_s(run_s, steps), quick=settings.quick(run_s, steps),
                           plan_s=time.perf_counter() - self.planned.started)
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
                profile = profile_runtime(self.analysed.model, analysis, plans, report.seq_len,
                                          precision, out.budget_s, self.live.device, self._step_pass())
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
            report = plan_on(cluster)
            out.calibrate_s += time.perf_counter() - tick
        trials = list(profile.trials) if profile is not None else []
        if not trials and self._wants_trials(out):
            trials, report = self._run_trials(out, report)
            profile = profile or RuntimeProfile(cluster_key=keys[0], model_key=keys[1])
            profile.trials = trials
        report.profile, report.trials = profile, trials
        choose(report, fastest(trials), fresh=out.trials_run > 0, memory_fraction=self.memory_fraction)
        if cache is not None and profile is not None and (out.profile_s or out.trials_run):
            out.cluster_file = self._save(profile, report.cluster, cache)
        elif out.cached:
            from lightning_autopar.profile.runtime import profile_folder

            out.cluster_file = str(profile_folder(*keys, cache) / "cluster.yaml")
        report.source = out.figures_source(report.source)
        return Measured(report, out)

    def _step_pass(self) -> Any:
        """mbs -> a forward of the user's own ``training_step`` on the first ``mbs`` rows of the plan's first batch,
        returning its loss (``self.log`` recorded and dropped, the precision's autocast on): what the set-up profile
        times, so the loss, the logging and the model's own call are those training runs. None without a batch,
        a training_step or automatic optimization (the profile then runs the model on token ids)."""
        from lightning.fabric.utilities.apply_func import move_data_to_device

        from lightning_autopar.runtime.batches import slice_batch
        from lightning_autopar.runtime.logs import LogRecorder, recording_logs
        from lightning_autopar.runtime.step import loss_of

        work = self.work
        module, batch = work.module, work.first_batch
        if batch is None or not work.automatic or not callable(getattr(module, "training_step", None)):
            return None
        batch = move_data_to_device(batch, self.live.device)
        total = leading_size(batch) or 1

        def make(mbs: int) -> Any:
            rows = slice_batch(batch, 0, min(mbs, total), total)

            def forward() -> Any:
                with recording_logs(module, LogRecorder()), work.train_context():
                    loss = loss_of(module.training_step(rows, 0))
                if loss is None:
                    raise RuntimeError("training_step returned no loss")
                return loss

            return forward

        return make

    @contextlib.contextmanager
    def _state_kept(self) -> Iterator[None]:
        """The module's gradients and buffers (BatchNorm statistics, counters) as before on exit: the set-up
        profile runs its training step."""
        import torch

        from lightning_autopar.profile.runtime import kept_gradients

        module = self.work.module
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
        live = self.live
        costs = None
        if cache is not None:
            costs = live.broadcast(load_cluster_costs(cluster_key, cache) if live.rank == 0 else None)
        if costs is None:
            left = out.budget_s - out.profile_s
            if left < PATHS_MIN_S or out.quick:  # quick: the trial of the best plan measures its fixed costs
                return cluster
            tick = time.perf_counter()
            costs, timings = measure_paths(cluster, live.device, left)
            out.paths_s = time.perf_counter() - tick
            if cache is not None and len(timings) == len(path_plans(live.world_size)):
                save_cluster_costs(cluster_key, costs, [vars(t) for t in timings], cache)
        source = f"{cluster.runtime.source} + {costs.source}" if cluster.runtime.source else costs.source
        return dataclasses.replace(cluster, runtime=merged_runtime(cluster.runtime, costs, source))

    def _save(self, profile: RuntimeProfile, cluster: ClusterSpec, cache: Path) -> str:
        """Rank 0 writes the profile and the (calibrated) cluster to the cache; a cache that cannot be written
        (OSError) costs a warning, not the run. Every rank gets the cluster.yaml path ("" if not written)."""
        from lightning_autopar.profile.runtime import save_profile

        path = ""
        if self.live.rank == 0:
            try:
                path = str(save_profile(profile, cluster, cache) / "cluster.yaml")
            except OSError as err:
                warnings.warn(f"autopar: the profile cache {cache} could not be written ({err}); the next run "
                              "measures again", stacklevel=2)
        return str(self.live.broadcast(path))

    def _load_cached(self, keys: tuple[str, str], cache: Any) -> tuple[RuntimeProfile, ClusterSpec] | None:
        """Rank 0's cached (profile, calibrated cluster) for ``keys``, on every rank (None without one)."""
        if cache is None:
            return None
        from lightning_autopar.profile.runtime import load_profile

        return self.live.broadcast(load_profile(*keys, cache) if self.live.rank == 0 else None)

    def _wants_trials(self, out: SetupOutcome) -> bool:
        """trials=K asks for them (a module that cannot run one: ConfigError, unless not training); None: when the
        set-up budget has room after the profile."""
        count = self.settings.trials
        if count == 0 or (count is None and out.budget_s - out.profile_s - out.paths_s <= 0):
            return False
        refusal = trial_refusal(self.work)
        if refusal and count is not None and refusal != "not training":
            raise ConfigError("trials", refusal, "use trials=0")
        return not refusal

    def _run_trials(self, out: SetupOutcome, report: Any) -> tuple[list[TrialResult], Any]:
        """Trials of the best distinct plans on the first batch, then the refit and the planning on it: (the
        trials, the report to go on with)."""
        from lightning.fabric.utilities.apply_func import move_data_to_device

        from lightning_autopar.planner.calibrate import refit

        tick = time.perf_counter()
        batch = move_data_to_device(self.work.first_batch, self.live.device)
        shared = SharedAnalysis()  # each trial's copy reads the set-up's analysis instead of tracing again
        if self.analysed.example is None:  # unit form: each copy is analysed from its own call
            shared.seed(self.work.module, self.analysed.model, self.analysed.analysis)
        trials = run_trials(self.work.module, report.candidates, batch, self.live.device,
                            self.settings.trials, out.budget_s - out.profile_s - out.paths_s, shared)
        out.trials_s, out.trials_run = time.perf_counter() - tick, len(trials)
        ran = [(Plan(**t.plan), t.measured_s) for t in trials if not t.error]
        if ran:
            tick = time.perf_counter()
            spec = self.analysed.analysis.spec
            report = self.planned.plan_on(refit(report.cluster, spec, ran, report.global_batch, report.seq_len))
            out.refit_s = time.perf_counter() - tick
        return trials, report


def trial_refusal(work: Workload) -> str:
    """Why this set-up cannot run trials ("" when it can): a trial runs the module's own training_step and
    configure_optimizers on the plan DataLoader's first batch."""
    module = work.module
    if work.planned_steps == 0:
        return "not training"
    if not all(callable(getattr(module, name, None)) for name in ("training_step", "configure_optimizers")):
        return "the module has no training_step and configure_optimizers for a trial to run"
    if not getattr(module, "automatic_optimization", True):
        return "manual optimization: the training_step steps the optimizer itself"
    if work.first_batch is None:
        return "no batch to run on (Fabric: set up the DataLoader before the model)"
    return ""


def choose(report: Any, chosen: Plan | None, fresh: bool, memory_fraction: float = 0.9) -> None:
    """Make ``chosen`` (the measured-fastest trial's plan) ``report.best`` and the first candidate: its entry
    among the candidates or, for trials just run, its price on the report's cluster. A cached choice no
    longer among the candidates leaves the planner's best."""
    from lightning_autopar.planner.search import estimate

    if chosen is None:
        return
    priced = next((c for c in report.candidates if c.plan == chosen), None)
    if priced is None and not fresh:
        return
    if priced is None:
        priced = estimate(report.model, report.cluster, chosen, report.global_batch, report.seq_len,
                          memory_fraction=memory_fraction)
    report.candidates = [priced, *(c for c in report.candidates if c is not priced)]
    report.best = priced
