"""``Rebalance``: when measurements persistently disagree with the plan, refit the cost model and switch to
another split of the same global batch if it is predicted to be faster.

* Measurements come from the ``StepMonitor`` (a required companion callback): median step time and, from its
  profiled steps, compute and exposed communication.
* Refit: one scale factor on the compute terms (``compute_s + recompute_s``) and one on the communication
  terms (``comm_exposed_s + bubble_s``), measured over predicted; without a profiled step both are the
  step-time ratio.
* Candidates: the plan in effect with every other (``mbs``, ``grad_accum``) of the same global batch
  (``dp * mbs * grad_accum``), priced by ``planner.search.estimate`` and rescaled by the refit; the fastest
  feasible one is taken when it beats the current plan by more than ``min_gain`` (the 32 -> 28 micro-batch
  kind of change). Layout changes (dp, tp, zero ...) would need resharding and are left to a restart:
  the strategy plans again at setup.
* Switch: at a checkpoint boundary (``AutoCheckpoint.save`` first, when one is attached). The strategy reads
  ``strategy.plan.grad_accum`` every step and weights each micro-batch by its rows, so the gradients, the
  losses and the optimizer updates are those of the same global batch: the training math is unchanged.
  ``strategy.report.best`` becomes the new priced plan, so the monitor compares against its prediction.
  The choice is part of the checkpoint and re-applied on resume when the layout is the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as L

from lightning_autopar.callbacks.monitor import StepMonitor
from lightning_autopar.errors import ConfigError


def refit_scales(summary: dict[str, float]) -> tuple[float, float]:
    """(compute scale, communication scale): measured over predicted, from a ``StepMonitor.summary``."""
    step_scale = summary["step_time_s"] / max(summary["pred_step_time_s"], 1e-12)
    if "compute_s" not in summary:
        return step_scale, step_scale
    compute = summary["compute_s"] / summary["pred_compute_s"] if summary["pred_compute_s"] > 0 else step_scale
    comm = summary["comm_s"] / summary["pred_comm_s"] if summary["pred_comm_s"] > 1e-9 else compute
    return compute, comm


def refit_step(priced: Any, scales: tuple[float, float]) -> float:
    b = priced.breakdown
    return scales[0] * (b.compute_s + b.recompute_s) + scales[1] * (b.comm_exposed_s + b.bubble_s)


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
        patience: consecutive disagreeing checks before refitting.
        tolerance: relative step-time disagreement that counts.
        min_gain: the refitted prediction must be this much faster to switch.
        respect_fix: leave ``mbs``/``grad_accum`` alone when the strategy's ``fix`` pins one of them.
    """

    def __init__(self, check_every_n_steps: int = 20, patience: int = 2, tolerance: float = 0.2,
                 min_gain: float = 0.05, respect_fix: bool = True, verbose: bool = True) -> None:
        if check_every_n_steps < 1 or patience < 1:
            raise ConfigError("Rebalance", "check_every_n_steps and patience must be >= 1")
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

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.monitor = next((c for c in trainer.callbacks if isinstance(c, StepMonitor)), None)
        if self.monitor is None:
            raise ConfigError("Rebalance", "needs measurements", "add a StepMonitor to the Trainer's callbacks")
        restored, self._restored = self._restored, None
        if restored and restored.get("plan") and self._tunable(trainer):
            plan = trainer.strategy.plan
            wanted = dataclasses.replace(plan, **restored["plan"])
            if wanted != plan and wanted in same_batch_splits(plan, plan.global_batch):
                self._apply(trainer, self._price(trainer, wanted), "restored from the checkpoint")

    # ------------------------------------------------------------------ checking

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.check_every_n_steps or not self._tunable(trainer):
            return
        self._last_step = step
        decision = self.decide(trainer) if trainer.is_global_zero else None
        decision = trainer.strategy.broadcast(decision)  # rank 0's measurements decide for everyone
        if decision is not None:
            priced, reason = decision
            checkpoint = _attached_checkpoint(trainer)
            if checkpoint is not None:
                checkpoint.save(trainer)  # the boundary: the state before the switch is on disk
            self._apply(trainer, priced, reason)

    def _tunable(self, trainer: Any) -> bool:
        strategy = trainer.strategy
        plan = getattr(strategy, "plan", None)
        if plan is None or getattr(strategy, "report", None) is None or plan.pp > 1:
            return False
        if not trainer.lightning_module.automatic_optimization:
            return False
        fixed = getattr(strategy, "_fix", {})
        return not (self.respect_fix and ("mbs" in fixed or "grad_accum" in fixed))

    def decide(self, trainer: Any) -> tuple[Any, str] | None:
        """(new priced plan, reason) when a switch is due, else None (rank-local: called on rank 0)."""
        summary = self.monitor.summary() if self.monitor is not None else None
        if summary is None:
            return None
        off = abs(summary["step_time_s"] / summary["pred_step_time_s"] - 1) > self.tolerance
        self._strikes = self._strikes + 1 if off else 0
        if self._strikes < self.patience:
            return None
        self._strikes = 0
        scales = refit_scales(summary)
        strategy = trainer.strategy
        current = self._price(trainer, strategy.plan)
        priced = [self._price(trainer, p) for p in same_batch_splits(strategy.plan, strategy.plan.global_batch)]
        feasible = [p for p in priced if p.feasible]
        if not feasible:
            return None
        best = min(feasible, key=lambda p: refit_step(p, scales))
        now, then = refit_step(current, scales), refit_step(best, scales)
        if best.plan == current.plan or then >= now * (1 - self.min_gain):
            return None
        reason = (f"measured {summary['step_time_s']:.4g} s/step vs predicted {summary['pred_step_time_s']:.4g} s; "
                  f"refit compute x{scales[0]:.3g}, communication x{scales[1]:.3g}; "
                  f"predicted {now:.4g} -> {then:.4g} s/step ({100 * (1 - then / now):.0f}% faster)")
        return best, reason

    @staticmethod
    def _price(trainer: Any, plan: Any) -> Any:
        from lightning_autopar.planner.search import estimate

        report = trainer.strategy.report
        return estimate(report.model, report.cluster, plan, global_batch=plan.global_batch,
                        seq_len=report.seq_len, memory_fraction=report.memory_fraction)

    def _apply(self, trainer: Any, priced: Any, reason: str) -> None:
        strategy = trainer.strategy
        old = strategy.plan
        strategy.plan = priced.plan
        strategy.report.best = priced
        self.switches.append({"step": trainer.global_step, "from": old.short(), "to": priced.plan.short(),
                              "mbs": priced.plan.mbs, "grad_accum": priced.plan.grad_accum, "reason": reason})
        if self.verbose and trainer.is_global_zero:
            print(f"autopar: re-plan at step {trainer.global_step}: {old.short()} -> {priced.plan.short()} "
                  f"({reason})", flush=True)

    # ------------------------------------------------------------------ checkpointed state

    def state_dict(self) -> dict[str, Any]:
        last = self.switches[-1] if self.switches else None
        return {"plan": {"mbs": last["mbs"], "grad_accum": last["grad_accum"]} if last else None,
                "switches": list(self.switches)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict
        self.switches = list(state_dict.get("switches", []))


def _attached_checkpoint(trainer: Any) -> Any:
    from lightning_autopar.callbacks.checkpoint import AutoCheckpoint

    return next((c for c in trainer.callbacks if isinstance(c, AutoCheckpoint)), None)
