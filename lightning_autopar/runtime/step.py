"""The data-parallel training and evaluation steps (no pipeline): the user's step runs once per micro-batch of
this rank's slice, its ``self.log`` values recorded and logged once per step (``logs``), the earlier
micro-batches' gradients held for the strategy's backward (``grads``), the gradient reduction only on the last
micro-batch of the batch the optimizer steps on. Framework-neutral: the driver passes its contexts and backward.

Any batch size (``batches.micro_batches``): a rank short of rows runs zero-weight stand-ins; their loss is
multiplied by 0, their logs weighted 0, and BatchNorm counts nothing from them (``parallel.stand_in``),
so the step equals one device on the real rows."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from lightning_autopar.parallel.stand_in import standing_in
from lightning_autopar.runtime.batches import batch_rows, micro_batches, uneven_label_tokens
from lightning_autopar.runtime.grads import GradientHold, gradients_set_aside
from lightning_autopar.runtime.group import DataParallelGroup
from lightning_autopar.runtime.logs import LogRecorder, recording_logs


@dataclass
class StepEnv:
    """What a step runs with. ``module`` is the user's (its ``*_step`` hooks and ``log``); the contexts are the
    precision's (autocast); ``fsdp_roots`` the modules whose gradient sync the micro-batch loop switches."""

    module: nn.Module
    group: DataParallelGroup
    train_context: Callable[[], AbstractContextManager[Any]]
    eval_context: Callable[[], AbstractContextManager[Any]]
    fsdp_roots: list[nn.Module] = field(default_factory=list)
    hold: GradientHold = field(default_factory=GradientHold)
    # manual optimization: the current micro-batch's loss weight, which the driver's backward applies (the
    # user's loop calls it); 1 outside a step
    manual_weight: float = 1.0


@dataclass(frozen=True)
class Accumulation:
    """The micro-batch loop's view of one step: the plan's micro-batches, whether the strategy runs their
    backward (automatic optimization), and the framework's own accumulation around them (``k`` batches per
    optimizer step; ``stepping``: the optimizer steps after this one)."""

    grad_accum: int
    automatic: bool = True
    k: int = 1
    stepping: bool = True


def loss_of(output: Any) -> Any:
    return output["loss"] if isinstance(output, Mapping) else output


_WARNED_TOKENS = [False]


def warn_token_weighting(batch: Any, parts: int, dp_rank: int) -> None:
    """One warning (per process, from data-parallel rank 0) when a batch split into ``parts`` > 1 micro-batch
    slices carries HF-style ``labels`` whose rows count different numbers of tokens: the slices are weighted by
    rows (batches.micro_batches), so a loss that averages over each slice's counted tokens is not the average over
    the whole batch's tokens one device would take. Silent otherwise: never silently inexact."""
    import warnings

    if _WARNED_TOKENS[0] or parts < 2 or dp_rank != 0 or not uneven_label_tokens(batch):
        return
    _WARNED_TOKENS[0] = True
    warnings.warn("autopar: the batch's 'labels' rows count different numbers of tokens (padding -100) and the "
                  "batch is split over ranks / micro-batches weighted by rows: a loss that is a mean over each "
                  "slice's tokens differs from one device's mean over the whole batch; to match it, return a "
                  "per-row mean (or a token sum over the batch's token count)", stacklevel=2)


def training_step(env: StepEnv, batch: Any, rest: tuple, kwargs: dict, acc: Accumulation,
                  backward: Callable[[torch.Tensor], Any]) -> Any:
    """Run the user's ``training_step`` on every micro-batch; ``backward`` (the driver's) runs for all but the
    last, whose weighted loss is returned for the driver's own backward. The returned value is this rank's mean
    loss; its gradient the last micro-batch's weighted loss."""
    from lightning_autopar.parallel.fsdp import set_gradient_sync

    module = env.module
    dp_rank, dp = env.group.rank_and_size()
    micro = micro_batches(batch, acc.grad_accum if acc.automatic else 1, dp_rank, dp)
    warn_token_weighting(batch, dp * len(micro), dp_rank)
    total = batch_rows(batch)
    recorder = LogRecorder()
    local_loss = torch.zeros((), device=env.group.device)
    rows_local = sum(mb.rows for mb in micro)
    output = loss = None
    weight = 1.0
    env.hold.held = {}  # none left from a step whose backward the framework skipped
    params = module.parameters() if acc.automatic else ()
    with gradients_set_aside(params) as produced:
        for i, (mb, weight, rows) in enumerate(micro):
            last = i == len(micro) - 1
            if acc.automatic:
                set_gradient_sync(env.fsdp_roots, last and acc.stepping)
            recorder.weight = rows / total
            env.manual_weight = weight
            try:
                with recording_logs(module, recorder), env.train_context(), standing_in(rows == 0):
                    output = module.training_step(mb, *rest, **kwargs)
            finally:
                env.manual_weight = 1.0
            loss = loss_of(output)
            if not acc.automatic or loss is None:
                break
            if rows:  # a stand-in's loss counts nowhere (rows_local is 0 on a rank with none)
                local_loss = local_loss + loss.detach() * (rows / rows_local)
            if not last:
                backward(loss * weight / acc.k)
    env.hold.held = produced  # DDP keeps them in .grad until the last backward reduces them all
    recorder.flush(module, env.group.reduce, total)
    if not acc.automatic or output is None:
        return output
    weighted = loss * weight
    combined = weighted + (local_loss - weighted).detach()
    return {**output, "loss": combined} if isinstance(output, Mapping) else combined


def eval_step(env: StepEnv, hook: str, batch: Any, rest: tuple, kwargs: dict) -> Any:
    """The user's ``hook`` (validation_step, test_step) on this rank's slice; logs averaged over the dp group.
    A rank with no rows runs the stand-in (collectives entered), logs with weight 0 and returns its output."""
    dp_rank, dp = env.group.rank_and_size()
    mb = micro_batches(batch, 1, dp_rank, dp)[0]
    total = batch_rows(batch)
    recorder = LogRecorder(mb.rows / total)
    with recording_logs(env.module, recorder), env.eval_context(), standing_in(mb.rows == 0):
        out = getattr(env.module, hook)(mb.batch, *rest, **kwargs)
    recorder.flush(env.module, env.group.reduce, total)
    return out
