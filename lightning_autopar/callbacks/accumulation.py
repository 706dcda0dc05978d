"""Gradient accumulation: the plan's micro-batches inside one DataLoader batch, and Lightning's
``accumulate_grad_batches`` around it. There is no callback to add: this module documents the interplay and
holds the one decision the strategy's ``training_step`` takes from Lightning (``runtime.step.Accumulation``
carries it into the micro-batch loop).

* ``plan.grad_accum`` (chosen by the planner): each DataLoader batch is the global batch of one step; the
  strategy gives every data-parallel rank a contiguous slice and cuts it into ``grad_accum`` micro-batches of
  ``mbs`` rows, weighting each micro-batch loss by its share of the batch, with the gradient reduction only on
  the last one (FSDP2 ``set_requires_gradient_sync``). The result equals one step on the whole batch.
* ``Trainer(accumulate_grad_batches=k)``: Lightning steps the optimizer after k DataLoader batches and divides
  the loss it back-propagates by k; the effective batch is k DataLoader batches. The planner plans for the
  DataLoader batch (the unit that must fit in memory), so choose the DataLoader batch as the global batch
  and leave ``k`` at 1 unless the global batch does not fit in one DataLoader batch.

With k > 1 the strategy's own backward calls (the non-final micro-batches) are divided by k like Lightning's,
and the reduction waits for the batch Lightning steps on (``lightning_accumulation``): the gradients are those
of the k-batch mean and are reduced once per optimizer step.
"""

from __future__ import annotations

from typing import Any


def lightning_accumulation(trainer: Any) -> tuple[int, bool]:
    """(k, stepping): Lightning's ``accumulate_grad_batches`` and whether the optimizer steps after the current
    batch (call during ``training_step``)."""
    from lightning_autopar.runtime.lightning_private import should_accumulate

    k = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if k == 1:
        return 1, True
    return k, not should_accumulate(trainer)
