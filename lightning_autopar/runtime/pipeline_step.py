"""The pipeline-parallel steps (pp > 1). The training step is the schedule (forward and backward of every
micro-batch, ``parallel.pipeline``); the user's ``training_step`` is not rewritten: it runs up to its model call
on every rank (to get the model's inputs for each micro-batch) and, on the last stage, in full with the model call
returning the pipeline's output, so its own loss (and ``self.log``) code computes the loss. Logged values are
broadcast from the last stage; the schedule's gradients wait in ``StepEnv.hold`` for the framework's backward.
Evaluation runs forward-only through the stages.

Any batch: a step runs the micro-batches ``batches.micro_batches`` cuts, of whatever rows and shapes (the same
count on every rank, stand-ins where a rank is short of rows). torch's stages keep one set of activation shapes
per schedule, so the step is cut into *runs* of consecutive micro-batches whose model-call inputs have equal
shapes on every rank (``plan_runs``, from every rank's shapes, gathered once per step): every rank runs the same
runs of the same counts, so FSDP's and the pipeline's collectives pair up. Each run is one schedule step (stages
cached per shapes, ``parallel.pipeline.runtime``), its gradients added to the earlier runs'. A run below the
schedule's minimum (``StagedPipeline.run_size``) is filled up with zero-weight copies of its last micro-batch
(``filler``) whose loss counts x 0, whose logs weigh 0, and whose buffer updates (BatchNorm) are undone after the
run. Micro-batch order is kept (running statistics depend on it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Hashable, Mapping

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.runtime.batches import MicroBatch, leading_size, micro_batches, tree_leaves
from lightning_autopar.runtime.grads import gradients_set_aside, restore_gradients
from lightning_autopar.runtime.logs import LogRecorder, recording_logs
from lightning_autopar.runtime.step import StepEnv, warn_token_weighting


@dataclass
class PipelineBatch:
    """One training step's state, which the schedule's loss function reads on the last stage."""

    micro: list[MicroBatch]
    rest: tuple
    kwargs: dict
    total: int
    recorder: LogRecorder = field(default_factory=LogRecorder)
    losses: list[torch.Tensor] = field(default_factory=list)  # rows * loss of every micro-batch, last stage


@dataclass(frozen=True)
class Run:
    """Micro-batches [start, stop) of a step, one schedule step; ``key`` names their shapes on every rank."""

    start: int
    stop: int
    key: Hashable


def shape_signature(call: tuple[tuple, dict]) -> tuple:
    """Shapes and dtypes of the tensors of one captured model call: what torch's stages infer their buffers from."""
    return tuple((tuple(t.shape), str(t.dtype)) for t in tree_leaves(call) if isinstance(t, torch.Tensor))


def plan_runs(signatures: list[list[tuple]]) -> list[Run]:
    """The runs a step's micro-batches form: a run ends where any rank's shapes change. ``signatures[r]``: rank
    r's micro-batch signatures, in order; every rank has as many (``batches.micro_batches``: stand-ins where a
    rank is short of rows)."""
    count = len(signatures[0])
    if any(len(s) != count for s in signatures):
        raise RuntimeError(f"pipeline: ranks run {sorted({len(s) for s in signatures})} micro-batches, not one count")
    runs, start = [], 0
    for i in range(1, count + 1):
        if i == count or any(s[i] != s[i - 1] for s in signatures):
            runs.append(Run(start, i, tuple(s[start] for s in signatures)))
            start = i
    return runs


def gathered(obj: Any) -> list[Any]:
    """``obj`` of every rank of the default process group."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def filler(mb: MicroBatch) -> MicroBatch:
    """A zero-weight copy of ``mb`` (a stand-in of its shapes, ``rows == 0`` as ``batches`` marks stand-ins):
    fills a schedule slot and contributes nothing."""
    return MicroBatch(mb.batch, 0.0, 0)


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

    def train(self, batch: Any, rest: tuple, kwargs: dict, grad_accum: int) -> torch.Tensor:
        """Run the schedule as the training step; returns this rank's mean loss (the same on every rank of its
        pipeline). The batch may hold any number of rows (not the planned global batch only)."""
        from lightning_autopar.parallel.context import hooks_off
        from lightning_autopar.parallel.pipeline import capture_model_call

        pipe, module, env = self.pipe, self.env.module, self.env
        total = leading_size(batch) or 0
        dp_rank, dp = env.group.rank_and_size()
        micro = micro_batches(batch, grad_accum, dp_rank, dp)
        warn_token_weighting(batch, dp * len(micro), dp_rank)
        with recording_logs(module, LogRecorder()), hooks_off():  # cp: the stages split the captured inputs
            inputs = [capture_model_call(self.model, partial(module.training_step, mb.batch, *rest, **kwargs))
                      for mb in micro]
        runs = plan_runs(self._shared_signatures(inputs))
        rows = sum(mb.rows for mb in micro)
        step = self.current = PipelineBatch(micro, rest, kwargs, total)
        try:
            with gradients_set_aside(module.parameters()) as produced, env.train_context():
                for run in runs:
                    self._run(step, micro[run.start:run.stop], inputs[run.start:run.stop], run.key)
        finally:
            env.hold.pipeline = produced
            self.current = None
        payload = None
        if pipe.has_last:
            payload = (float(sum(step.losses)) / rows if rows else 0.0, step.recorder.values)
        mean, step.recorder.values = pipe.broadcast_from_last(payload)
        step.recorder.flush(module, env.group.reduce, total)
        return torch.tensor(mean, device=env.group.device)

    def loop_step(self, batch: Any, loss_fn: Callable[[Any], torch.Tensor], grad_accum: int,
                  backward: Callable[[torch.Tensor], Any]) -> torch.Tensor:
        """``model.train_step(batch, loss_fn)`` for a loop the user owns (Fabric, Accelerate): ``batch`` is the
        global batch of one step (every rank the same), ``loss_fn(micro_batch)`` computes a micro-batch's loss by
        calling the model, as a ``training_step`` would. Runs forward and backward of every micro-batch of the
        plan -- with pp > 1 the pipeline schedule, else the micro-batch loop of ``runtime.step`` with
        ``backward`` (the framework's: loss scaling) -- and leaves the step's gradients in ``.grad``, reduced over
        the data-parallel ranks, for ``optimizer.step()``. Returns this rank's mean loss, detached."""
        from lightning_autopar.runtime.step import Accumulation, training_step

        env = self.env
        module = env.module
        module.training_step = lambda micro, *_a, **_k: loss_fn(micro)  # instance attribute: shadows any method
        try:
            if self.pipe is not None:
                loss = self.train(batch, (), {}, grad_accum)
                restore_gradients(env.hold.take_pipeline() or {})
                return loss
            loss = training_step(env, batch, (), {}, Accumulation(grad_accum), backward)
            env.hold.put_back_held()  # the earlier micro-batches' gradients: reduced with the last one's
            backward(loss)
            return loss.detach()
        finally:
            del module.training_step

    def _shared_signatures(self, inputs: list[tuple[tuple, dict]]) -> list[list[tuple]]:
        """Every rank's micro-batch signatures (one gather per step). Inputs the stages cannot take (a traced
        pipeline's fixed shapes) are refused here with one line on every rank together, before any of them
        enters the schedule's collectives."""
        try:
            self.pipe.check_inputs(inputs)
            refusal = None
        except ConfigError as err:
            refusal = (err.field, err.problem, err.fix)
        shared = gathered(([shape_signature(call) for call in inputs], refusal))
        refused = next((r for _, r in shared if r is not None), None)
        if refused is not None:
            raise ConfigError(*refused)
        return [signatures for signatures, _ in shared]

    def _run(self, step: PipelineBatch, micro: list[MicroBatch], inputs: list[tuple[tuple, dict]],
             key: Hashable) -> None:
        """One schedule step over equal-shaped micro-batches (filled up to the schedule's minimum with stand-ins);
        its gradients are added to those of the step's earlier runs (torch's stages reset the gradients of their
        FSDP modules after a shape inference)."""
        size = self.pipe.run_size(len(micro))
        micro = micro + [filler(micro[-1])] * (size - len(micro))
        inputs = inputs + [inputs[-1]] * (size - len(inputs))
        real = next((i for i, mb in enumerate(micro) if mb.rows == 0), None)  # stand-ins come last
        step.micro = micro
        with gradients_set_aside(self.env.module.parameters()) as produced:
            self.pipe.train_step(inputs, key, real)
        restore_gradients(produced)

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
        """Forward-only through the pipeline, then the user's hook on the last stage; logs reach every rank. Any
        batch: the chunks take any shapes (no schedule, no stored shapes)."""
        from lightning_autopar.parallel.context import hooks_off
        from lightning_autopar.parallel.pipeline import capture_model_call, model_call_replaced

        pipe, module, env = self.pipe, self.env.module, self.env
        total = leading_size(batch)
        dp_rank, dp = env.group.rank_and_size()
        mb = micro_batches(batch, 1, dp_rank, dp)[0]  # a rank with no rows: the stand-in, logs weighted 0
        step = partial(getattr(module, hook), mb.batch, *rest, **kwargs)
        with recording_logs(module, LogRecorder()), hooks_off():
            inputs = capture_model_call(self.model, step, hook)
        recorder = LogRecorder(mb.rows / total)
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
