"""``Preemption``: SIGUSR1 / SIGTERM on any rank stop every rank at the same step, after one complete checkpoint.

A scheduler warns a job before it stops it: SLURM sends its requeue signal (SIGUSR1 by default) ahead of a
preemption or the time limit and SIGTERM at the stop (``scancel --signal`` to every task); torchrun forwards
SIGTERM to its workers. The signal may reach one rank or all, at any point of a step. The handlers installed here
only record it. At the next step boundary (after the optimizer step) the ranks reduce the record over the world,
so all of them see the same decision at the same step; then every rank

1. writes one checkpoint of that step through the trainer's ``AutoCheckpoint`` (complete or invisible, resumed
   by the next ``fit()``); without one, a warning says the state is lost,
2. on rank 0, in a SLURM batch job (Lightning's auto-requeue on, or another launcher inside the job) and when the
   requeue signal was received, requeues the job with ``scontrol requeue`` as Lightning's SLURM handling does,
3. exits with ``128 + signal`` (138 for SIGUSR1, 143 for SIGTERM): "stopped, not finished" to a scheduler or
   torchrun (Lightning's own SIGTERM path exits 0, read as success).

Lightning's handlers are replaced for the fit (``runtime.lightning_private.take_over_signal_handlers``): its SLURM
handler saves from inside the signal handler on one rank, which deadlocks in the save's collectives. A signal that
arrives after the last step changes nothing: the run is finished. The autopar strategy adds this callback unless
the trainer has one.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import warnings
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lightning_autopar.runtime import lightning_private as private

log = logging.getLogger(__name__)


class Preemption(Callback):
    """Turn SIGUSR1 / SIGTERM into one checkpoint at a step boundary agreed by every rank, then a non-zero exit.

    Args:
        signals: the signals handled; default SIGTERM and the requeue signal (SLURM's ``requeue_signal``, else
            SIGUSR1).
    """

    def __init__(self, signals: tuple[int, ...] | None = None) -> None:
        self.signals = signals
        self.received = 0  # the signal this process got since the last boundary (0: none)
        self.stopped: dict[str, Any] | None = None  # what the last stop did (rank, signals, checkpoint, requeue)
        self._undo: Any = None
        self._last_step = -1

    # ------------------------------------------------------------------ handlers

    def _requeue_signal(self, trainer: Any) -> int | None:
        """The signal after which the job is requeued, else None: Lightning's SLURMEnvironment's requeue signal
        when its auto_requeue is on; SIGUSR1 in a batch SLURM job run by another launcher (``srun torchrun``,
        where Lightning sees torchrun's environment); none in an interactive allocation (Lightning's rule)."""
        from lightning.fabric.plugins.environments import SLURMEnvironment

        env = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(env, SLURMEnvironment):
            return int(env.requeue_signal or signal.SIGUSR1) if env.auto_requeue else None
        if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
            return int(signal.SIGUSR1)
        return None

    def _handled(self, trainer: Any) -> tuple[int, ...]:
        if self.signals is not None:
            return tuple(int(s) for s in self.signals)
        return (int(signal.SIGTERM), self._requeue_signal(trainer) or int(signal.SIGUSR1))

    def _record(self, signum: int, frame: Any) -> None:
        # only a flag: a handler runs between two bytecodes of any step, where no collective may start
        self.received = max(self.received, int(signum))

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.received, self.stopped, self._last_step = 0, None, -1
        if self._undo is not None:
            self._undo()
        handled = self._handled(trainer)

        def install() -> None:
            if threading.current_thread() is threading.main_thread():  # signal.signal's own rule
                for signum in handled:
                    signal.signal(signum, self._record)

        self._undo = private.take_over_signal_handlers(trainer, install)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning runs no teardown hook after an exception (our stop)

    # ------------------------------------------------------------------ the step boundary

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # Lightning is accumulating: not a step boundary
            return
        self._last_step = step
        per_rank = self._reduce(trainer)
        if not any(per_rank):
            return
        self._stop(trainer, per_rank)

    def _reduce(self, trainer: Any) -> list[int]:
        """Every rank's received signal (0: none), the same list on every rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return [self.received]
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=trainer.strategy.root_device)
        flags[dist.get_rank()] = self.received
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [int(f) for f in flags.tolist()]

    def _stop(self, trainer: Any, per_rank: list[int]) -> None:
        from lightning_autopar.callbacks.checkpoint import AutoCheckpoint

        signum = max(per_rank)
        name = signal.Signals(signum).name
        ranks = [r for r, s in enumerate(per_rank) if s]
        ckpt = next((c for c in trainer.checkpoint_callbacks if isinstance(c, AutoCheckpoint)), None)
        path = ckpt.save(trainer, wait=True) if ckpt is not None else None
        requeued = None
        requeue_signal = self._requeue_signal(trainer)
        if trainer.is_global_zero:
            if ckpt is None:
                warnings.warn(f"autopar: {name} at step {trainer.global_step} and no AutoCheckpoint in the trainer: "
                              "the state is not saved; add AutoCheckpoint(dirpath=...)", stacklevel=2)
            if requeue_signal is not None and requeue_signal in per_rank:
                requeued = requeue()
        code = 128 + signum
        self.stopped = {"signal": name, "ranks": ranks, "step": trainer.global_step,
                        "checkpoint": str(path) if path else None, "requeued": requeued, "exit_code": code}
        if trainer.is_global_zero:
            where = f"checkpoint {path}" if path else "no checkpoint"
            print(f"autopar: {name} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: stopped "
                  f"after step {trainer.global_step}, {where}"
                  f"{f', job {requeued} requeued' if requeued else ''}; exiting with {code}", flush=True)
        trainer.strategy.barrier("autopar-preemption")
        raise SystemExit(code)


def requeue() -> str | None:
    """``scontrol requeue`` this SLURM job (an array task as ``<array job>_<task>``), as Lightning's SLURM
    handler does; returns the job id, or None when it failed (logged)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job:
        log.warning("autopar: no SLURM_JOB_ID: the job is not requeued")
        return None
    try:
        code = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        log.warning("autopar: scontrol not found: job %s is not requeued", job)
        return None
    if code != 0:
        log.warning("autopar: scontrol requeue %s failed with exit code %d", job, code)
        return None
    return job
