"""``Rebalance``: when the measured step persistently disagrees with the prediction, re-price the plans the
runtime can switch to with the cost model refit to the measurement, and switch to a faster one.

* Measurements come from the ``StepMonitor`` (a required companion callback): the median step time after
  warm-up of the plan in effect.
* Trigger: measured off the prediction by more than ``tolerance`` (default 25%) at ``patience`` consecutive
  checks, either way (a prediction too slow misranks the splits as much as one too fast).
* Re-pricing: ``planner.calibrate.refit`` fits the cluster's runtime fixed costs and compute rates so that
  ``planner.search.estimate`` of the plan in effect matches its measured step (least squares over the
  observations); the same cost model, with the measured terms, then prices every candidate. One way to
  re-price, the cost model's own terms, so the trials at set-up and the run agree.
* Candidates: the plan in effect with every other (``mbs``, ``grad_accum``) of the same global batch
  (``dp * mbs * grad_accum``); the fastest feasible one is taken when the refit prices it more than ``min_gain``
  faster than the plan in effect (the 32 -> 28 micro-batch kind of change). Layout changes (dp, tp, zero ...)
  would need resharding and are left to a restart: the strategy plans again at setup.
* Switch: at a checkpoint boundary (``AutoCheckpoint.save`` first, when one is attached). The strategy reads
  ``strategy.plan.grad_accum`` every step and weights each micro-batch by its rows, so the gradients, the
  losses and the optimizer updates are those of the same global batch: the training math is unchanged.
  ``strategy.report.best`` becomes the new priced plan and ``strategy.report.cluster`` the refit cluster, so the
  monitor compares against the refit prediction. Rank 0 decides and broadcasts: every rank switches alike.
  The choice (split and refit cluster) is part of the checkpoint and re-applied on resume when the layout is
  the same.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L

from lightning_autopar.callbacks.monitor import StepMonitor
from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import ClusterSpec, Plan, PricedPlan, load_cluster_spec


@dataclass
class Repricing:
    """The plan in effect and its same-batch alternatives priced on the refit cluster."""

    cluster: ClusterSpec  # refit to the measured step
    current: PricedPlan  # the plan in effect, re-priced
    best: PricedPlan  # the fastest feasible split (may be the plan in effect)

    def gain(self) -> float:
        """Fraction of the re-priced step the best split saves (0 when it is the plan in effect)."""
        now = self.current.step_time_s
        return 1.0 - self.best.step_time_s / now if now > 0 else 0.0


def reprice(report: Any, plan: Plan, measured_step_s: float) -> Repricing | None:
    """Refit ``report.cluster`` to ``plan`` measuring ``measured_step_s`` per step (planner.calibrate.refit), then
    price ``plan`` and its same-batch splits on the refit cluster; None when no split is feasible."""
    from lightning_autopar.planner.calibrate import refit

    cluster = refit(report.cluster, report.model, [(plan, measured_step_s)], report.global_batch, report.seq_len)
    current = price(report, cluster, plan)
    feasible = [p for p in (price(report, cluster, s) for s in same_batch_splits(plan, plan.global_batch))
                if p.feasible]
    if not feasible:
        return None
    return Repricing(cluster, current, min(feasible, key=lambda p: p.step_time_s))


def price(report: Any, cluster: ClusterSpec, plan: Plan) -> PricedPlan:
    """``planner.search.estimate`` of ``plan`` for the report's model, batch and memory budget on ``cluster``."""
    from lightning_autopar.planner.search import estimate

    return estimate(report.model, cluster, plan, global_batch=plan.global_batch, seq_len=report.seq_len,
                    memory_fraction=report.memory_fraction)


def same_batch_splits(plan: Any, global_batch: int) -> list[Any]:
    """``plan`` with every (mbs, grad_accum) such that dp * mbs * grad_accum == global_batch."""
    if global_batch % plan.dp:
        return []
    rows = global_batch // plan.dp
    return [dataclasses.replace(plan, mbs=m, grad_accum=rows // m) for m in range(1, rows + 1) if rows % m == 0]


class Rebalance(L.Callback):
    """Re-plan the micro-batch split at run time (see the module docstring).

    Args:
        check_every_n_steps: how often to compare measured and predicted.
        patience: consecutive disagreeing checks before re-pricing.
        tolerance: relative step-time disagreement that counts (0.25: more than 25% off).
        min_gain: the re-priced best split must be this much faster than the plan in effect to switch.
        respect_fix: leave ``mbs``/``grad_accum`` alone when the strategy's ``fix`` pins one of them.
    """

    def __init__(self, check_every_n_steps: int = 20, patience: int = 2, tolerance: float = 0.25,
                 min_gain: float = 0.05, respect_fix: bool = True, verbose: bool = True) -> None:
        if check_every_n_steps < 1 or patience < 1:
            raise ConfigError("Rebalance", "check_every_n_steps and patience must be >= 1")
        if tolerance < 0:
            raise ConfigError("Rebalance.tolerance", f"got {tolerance}", "a relative disagreement >= 0, e.g. 0.25")
        if not 0 <= min_gain < 1:
            raise ConfigError("Rebalance.min_gain", f"got {min_gain}", "a fraction in [0, 1), e.g. 0.05")
        self.check_every_n_steps = check_every_n_steps
        self.patience = patience
        self.tolerance = tolerance
        self.min_gain = min_gain
        self.respect_fix = respect_fix
        self.verbose = verbose
        self.switches: list[dict[str, Any]] = []
        self.monitor: StepMonitor | None = None
        self._strikes = 0
        self._last_step = -1
        self._restored: dict[str, Any] | None = None
        self._cluster: ClusterSpec | None = None  # the refit cluster of the last switch (checkpointed)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.monitor = next((c for c in trainer.callbacks if isinstance(c, StepMonitor)), None)
        if self.monitor is None:
            raise ConfigError("Rebalance", "needs measurements", "add a StepMonitor to the Trainer's callbacks")
        restored, self._restored = self._restored, None
        if restored and restored.get("plan") and self._tunable(trainer):
            report, plan = trainer.strategy.report, trainer.strategy.plan
            wanted = dataclasses.replace(plan, **restored["plan"])
            if wanted != plan and wanted in same_batch_splits(plan, plan.global_batch):
                cluster = restored_cluster(restored.get("cluster"), report.cluster)
                self._apply(trainer, price(report, cluster, wanted), cluster, "restored from the checkpoint")

    # ------------------------------------------------------------------ checking

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.check_every_n_steps or not self._tunable(trainer):
            return
        self._last_step = step
        decision = self.decide(trainer) if trainer.is_global_zero else None
        decision = trainer.strategy.broadcast(decision)  # rank 0's measurements decide for everyone
        if decision is not None:
            priced, cluster, reason = decision
            checkpoint = _attached_checkpoint(trainer)
            if checkpoint is not None:
                checkpoint.save(trainer)  # the boundary: the state before the switch is on disk
            self._apply(trainer, priced, cluster, reason)

    def _tunable(self, trainer: Any) -> bool:
        strategy = trainer.strategy
        plan = getattr(strategy, "plan", None)
        if plan is None or getattr(strategy, "report", None) is None or plan.pp > 1:
            return False
        if not trainer.lightning_module.automatic_optimization:
            return False
        fixed = getattr(strategy, "_fix", {})
        return not (self.respect_fix and ("mbs" in fixed or "grad_accum" in fixed))

    def decide(self, trainer: Any) -> tuple[PricedPlan, ClusterSpec, str] | None:
        """(new priced plan, refit cluster, reason) when a switch is due, else None (rank-local: rank 0)."""
        summary = self.monitor.summary() if self.monitor is not None else None
        if summary is None:
            return None
        report, plan = trainer.strategy.report, trainer.strategy.plan
        return self.judge(report, plan, summary["step_time_s"], summary["pred_step_time_s"])

    def judge(self, report: Any, plan: Plan, measured_s: float, predicted_s: float) \
            -> tuple[PricedPlan, ClusterSpec, str] | None:
        """The decision on one check: ``measured_s`` / ``predicted_s`` are the monitor's medians per optimizer
        step (``predicted_s`` is ``report.best``'s step time, times the loader batches Lightning accumulates)."""
        off = predicted_s > 0 and abs(measured_s / predicted_s - 1) > self.tolerance
        self._strikes = self._strikes + 1 if off else 0
        if self._strikes < self.patience:
            return None
        self._strikes = 0
        # per plan step: the monitor's figures cover Lightning's accumulated loader batches, the plan's one
        plan_step_s = measured_s * report.best.step_time_s / predicted_s
        found = reprice(report, plan, plan_step_s)
        if found is None or found.best.plan == plan or found.gain() <= self.min_gain:
            return None
        now, then = found.current.step_time_s, found.best.step_time_s
        reason = (f"measured {measured_s:.4g} s/step vs predicted {predicted_s:.4g} s; refit to the measurement "
                  f"({found.cluster.runtime.source or found.cluster.name}): {plan.short()} {now:.4g} s -> "
                  f"{found.best.plan.short()} {then:.4g} s/step ({100 * found.gain():.0f}% faster)")
        return found.best, found.cluster, reason

    def _apply(self, trainer: Any, priced: PricedPlan, cluster: ClusterSpec, reason: str) -> None:
        strategy = trainer.strategy
        old = strategy.plan
        strategy.plan = priced.plan
        strategy.report.best = priced
        strategy.report.cluster = self._cluster = cluster
        self.switches.append({"step": trainer.global_step, "from": old.short(), "to": priced.plan.short(),
                              "mbs": priced.plan.mbs, "grad_accum": priced.plan.grad_accum,
                              "predicted_s": priced.step_time_s, "reason": reason})
        if self.verbose and trainer.is_global_zero:
            print(f"autopar: re-plan at step {trainer.global_step}: {old.short()} -> {priced.plan.short()} "
                  f"({reason})", flush=True)

    # ------------------------------------------------------------------ checkpointed state

    def state_dict(self) -> dict[str, Any]:
        last = self.switches[-1] if self.switches else None
        return {"plan": {"mbs": last["mbs"], "grad_accum": last["grad_accum"]} if last else None,
                "cluster": plain(dataclasses.asdict(self._cluster)) if self._cluster is not None else None,
                "switches": list(self.switches)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict
        self.switches = list(state_dict.get("switches", []))


def plain(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with numpy scalars as Python numbers: a checkpoint is loaded with ``weights_only=True``."""
    return json.loads(json.dumps(data, default=float))


def restored_cluster(saved: dict[str, Any] | None, live: ClusterSpec) -> ClusterSpec:
    """The checkpointed refit cluster when it describes the live world, else the live cluster (re-planned)."""
    if not saved:
        return live
    cluster = load_cluster_spec(saved)
    return cluster if cluster.world_size == live.world_size else live


def _attached_checkpoint(trainer: Any) -> Any:
    from lightning_autopar.callbacks.checkpoint import AutoCheckpoint

    return next((c for c in trainer.callbacks if isinstance(c, AutoCheckpoint)), None)
