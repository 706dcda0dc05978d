"""The pipeline-parallel steps (pp > 1). The training step is the schedule (forward and backward of every
micro-batch, ``parallel.pipeline``); the user's ``training_step`` is not rewritten: it runs up to its model call
on every rank (to get the model's inputs for each micro-batch) and, on the last stage, in full with the model call
returning the pipeline's output, so its own loss (and ``self.log``) code computes the loss. Logged values are
broadcast from the last stage; the schedule's gradients wait in ``StepEnv.hold`` for the framework's backward.
Evaluation runs forward-only through the stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.runtime.batches import MicroBatch, leading_size, micro_batches, slice_batch, split_rows
from lightning_autopar.runtime.grads import gradients_set_aside
from lightning_autopar.runtime.logs import LogRecorder, recording_logs
from lightning_autopar.runtime.step import StepEnv


@dataclass
class PipelineBatch:
    """One training step's state, which the schedule's loss function reads on the last stage."""

    micro: list[MicroBatch]
    rest: tuple
    kwargs: dict
    total: int
    recorder: LogRecorder = field(default_factory=LogRecorder)
    losses: list[torch.Tensor] = field(default_factory=list)  # rows * loss of every micro-batch, last stage


class PipelineSteps:
    """The pipeline's training and evaluation steps over ``env``. Built before the plan is applied (its
    ``loss`` is the schedule's loss function); ``pipe`` and ``model`` (what the user's steps call) are set
    after. ``scaler`` returns the fp16 loss scaler, if any, at the time of the step."""

    def __init__(self, env: StepEnv, scaler: Callable[[], Any] = lambda: None) -> None:
        self.env = env
        self.scaler = scaler
        self.pipe: Any = None  # parallel.pipeline.Pipeline
        self.model: nn.Module | None = None
        self.current: PipelineBatch | None = None

    def train(self, batch: Any, rest: tuple, kwargs: dict, grad_accum: int, global_batch: int) -> torch.Tensor:
        """Run the schedule as the training step; returns the step's mean loss (the same on every rank)."""
        from lightning_autopar.parallel.context import hooks_off
        from lightning_autopar.parallel.pipeline import capture_model_call

        pipe, module, env = self.pipe, self.env.module, self.env
        total = leading_size(batch) or 0
        dp_rank, dp = env.group.rank_and_size()
        micro = micro_batches(batch, grad_accum, dp_rank, dp)
        if total != global_batch or len(micro) != grad_accum:
            raise ConfigError("DataLoader.batch_size", "pipeline parallelism runs fixed-size micro-batches: every "
                              f"batch must hold the planned global batch of {global_batch} rows, got {total}",
                              "use a fixed batch size and drop_last=True")
        with recording_logs(module, LogRecorder()), hooks_off():  # cp: the stages split the captured inputs
            inputs = [capture_model_call(self.model, partial(module.training_step, mb.batch, *rest, **kwargs))
                      for mb in micro]
        step = self.current = PipelineBatch(micro, rest, kwargs, total)
        try:
            with gradients_set_aside(module.parameters()) as produced, env.train_context():
                pipe.train_step(inputs)
        finally:
            env.hold.pipeline = produced
            self.current = None
        payload = None
        if pipe.has_last:
            payload = (float(sum(step.losses)) / sum(mb.rows for mb in micro), step.recorder.values)
        mean, step.recorder.values = pipe.broadcast_from_last(payload)
        step.recorder.flush(module, env.group.reduce, total)
        return torch.tensor(mean, device=env.group.device)

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the user's training_step on micro-batch ``target``, its model
        call returning the pipeline output; weighted like the non-pipelined micro-batch losses."""
        from lightning_autopar.parallel.context import hooks_off
        from lightning_autopar.parallel.pipeline import model_call_replaced

        step, pipe = self.current, self.pipe
        assert step is not None, "the pipeline's loss runs inside PipelineSteps.train"
        mb, weight, rows = step.micro[int(target.reshape(-1)[0])]
        rec = LogRecorder() if pipe.inferring else step.recorder  # shape inference: a real pass, not recorded
        rec.weight = rows / step.total
        model_output = pipe.last_chunk.rebuild(output)
        with recording_logs(self.env.module, rec), model_call_replaced(self.model, lambda *a, **k: model_output), \
                hooks_off():  # cp: the output is already gathered
            out = self.env.module.training_step(mb, *step.rest, **step.kwargs)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ConfigError("training_step", "with pipeline parallelism the training_step must return the loss",
                              "return a loss tensor (or a dict with 'loss')")
        if not pipe.inferring:
            step.losses.append(loss.detach().float().cpu() * rows)
        loss = loss * weight
        scaler = self.scaler()
        return scaler.scale(loss) if scaler is not None else loss

    def evaluate(self, hook: str, batch: Any, rest: tuple, kwargs: dict) -> Any:
        """Forward-only through the pipeline, then the user's hook on the last stage; logs reach every rank."""
        from lightning_autopar.parallel.context import hooks_off
        from lightning_autopar.parallel.pipeline import capture_model_call, model_call_replaced

        pipe, module, env = self.pipe, self.env.module, self.env
        total = leading_size(batch)
        dp_rank, dp = env.group.rank_and_size()
        start, stop = split_rows(total, dp, dp_rank)
        step = partial(getattr(module, hook), slice_batch(batch, start, stop, total), *rest, **kwargs)
        with recording_logs(module, LogRecorder()), hooks_off():
            inputs = capture_model_call(self.model, step, hook)
        recorder = LogRecorder((stop - start) / total)
        out = None
        with env.eval_context():
            output = pipe.forward_only(inputs)
            if pipe.has_last:
                with recording_logs(module, recorder), model_call_replaced(self.model, lambda *a, **k: output), \
                        hooks_off():
                    out = step()
        recorder.values = pipe.broadcast_from_last(recorder.values if pipe.has_last else None)
        recorder.flush(module, env.group.reduce, total)
        return out
