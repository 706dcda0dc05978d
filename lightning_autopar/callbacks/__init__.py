"""Training-time callbacks for the autopar strategy (they also work with other strategies where they can).

* ``AutoCheckpoint``: periodic sharded checkpoints (complete or invisible, last k kept), automatic and
  elastic resume with RNG states and the position in the epoch.
* ``Overlap``: FSDP2 prefetch / reshard / reduce-scatter knobs chosen from the plan, overridable.
* ``StepMonitor``: measured vs predicted step time (and every named cost term), tokens/s, TFLOP/s, MFU, memory;
  a warning naming the term that is off; a CSV and a PNG report.
* ``Preemption``: SIGUSR1 / SIGTERM on any rank stop every rank at one step boundary with one checkpoint, a
  SLURM requeue and exit code 128 + signal (added by the autopar strategy).
* ``Rebalance``: refit the cost model to the monitor's measured step (``planner.calibrate.refit``), re-price,
  and switch to a micro-batch split of the same global batch predicted > 5% faster, at a checkpoint boundary.
* Gradient accumulation is the strategy's (``plan.grad_accum``); ``accumulation`` documents how it combines
  with Lightning's ``accumulate_grad_batches``.
"""

from lightning_autopar.callbacks.checkpoint import AutoCheckpoint, latest_checkpoint, make_resumable
from lightning_autopar.callbacks.monitor import StepMonitor, StepRecord
from lightning_autopar.callbacks.overlap import Overlap, OverlapKnobs, choose_overlap
from lightning_autopar.callbacks.preemption import Preemption
from lightning_autopar.callbacks.rebalance import Rebalance

__all__ = ["AutoCheckpoint", "Overlap", "OverlapKnobs", "Preemption", "Rebalance", "StepMonitor", "StepRecord",
           "choose_overlap", "latest_checkpoint", "make_resumable"]
