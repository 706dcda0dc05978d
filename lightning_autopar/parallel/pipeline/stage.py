"""Every use of ``torch.distributed.pipelining``'s private API, in one module.

Checked against torch 2.13.0 (``torch.__version__`` of the project's environment). A torch upgrade that
changes any of these breaks the pipelines here, and nowhere else. ``torch.distributed.pipelining`` is
imported inside the functions: importing the planner or the profiler must not load ``torch.distributed``.

Overrides of ``PipelineStage`` methods the schedules call (``stage_class``, both pipelines):

* ``forward_one_chunk`` (public name, internal to the schedules): tells the chunk the micro-batch it runs, so
  the chunk reads that micro-batch's captured model call (the schedule only passes the activation); before the
  first stand-in micro-batch of a run (index >= ``real``: zero-weight stand-ins of a rank short of rows, or
  copies filling a schedule's minimum) it saves the chunk's buffers, which the pipeline restores after the run
  (``restore_buffers``): a stand-in must not move BatchNorm running statistics. Stand-ins come last in a run
  and every stage runs its forwards in micro-batch order, so the saved values are those after the last real
  micro-batch.
* ``_prepare_forward_infra`` / ``_prepare_backward_infra``: the stage's shape inference runs a real forward
  and backward; ``Stage.inferring`` is set meanwhile so the loss function does not record that loss, and the
  forward runs micro-batch 0's inputs.
* ``_to_tensor``: the inference makes tensors from metadata, uninitialised by default; ranks of a TP group
  could then route MoE tokens differently and their collectives would no longer match. Zeros are the same
  everywhere.

``shapes_only`` (``autopar simulate``): a schedule's step stopped right after ``_initialize_stage`` (one stage per
rank) or ``_initialize_stages`` (several), where torch 2.13 infers the stages' shapes, so a simulation infers them
without running every micro-batch of a whole step before the one it measures.

The traced pipeline (``traced_stage_class``, ``split_points``, ``split_traced``, ``graph_to_device``):

* ``_prepare_forward_infra`` / ``_prepare_backward_infra`` again: the inference forward updates BatchNorm
  running statistics in place; the buffers are saved before it and restored after the inference backward.
* ``_IR.annotate_split_points``: marks a split before a unit by replacing its ``forward`` (instance attributes
  ``forward`` and ``_orig_forward``), which ``split_points`` removes again after the trace.
* ``_IR.Pipe._from_traced``: the public ``pipeline()`` runs its own ``torch.export`` (no dynamic batch
  dimension, its diagnostics on the console); we export ourselves and hand the program to the splitter. The
  ``Pipe`` it returns is read through ``split_gm`` (the root graph and the stage graphs) and
  ``replicated_params`` (parameters the split copied).
* ``_IR._modify_graph_op_device``: the traced graphs hard-code the example's device in factory ops
  (``torch.zeros(device=...)``); it rewrites them to this rank's device.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.export import ExportedProgram


def stage_class() -> type:
    """A fresh ``PipelineStage`` subclass for one pipeline (its ``inferring`` flag is per pipeline)."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        """Tells its chunk which micro-batch it runs, and flags the shape-inference pass."""

        inferring = False
        real: int | None = None  # micro-batches of the current run before its stand-ins (None: all real)
        _saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.submod.mb_index = fwd_chunk_id
            if self.real is not None and fwd_chunk_id >= self.real:
                self.save_buffers()
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def save_buffers(self) -> None:
            """Keep the chunk's buffer values (once, until ``restore_buffers``)."""
            if self._saved is None:
                self._saved = [(b, b.detach().clone()) for _, b in self.submod.named_buffers()]

        def restore_buffers(self) -> None:
            saved, self._saved = self._saved, None
            with torch.no_grad():
                for buf, value in saved or []:
                    buf.copy_(value)

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self.submod.mb_index = 0
            Stage.inferring = True
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                Stage.inferring = False

        def _to_tensor(self, arg: Any) -> torch.Tensor:
            # zeros, not uninitialised memory: see the module doc
            out = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):
                with torch.no_grad():
                    out.zero_()
            return out

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            Stage.inferring = True
            try:
                return super()._prepare_backward_infra(*args, **kwargs)
            finally:
                Stage.inferring = False

    return Stage


class _ShapesInferred(Exception):
    """Stops a schedule's step once it has inferred its stages' shapes (``shapes_only``)."""


@contextmanager
def shapes_only() -> Iterator[None]:
    """A pipeline step inside stops once the schedule has inferred its stages' shapes (each stage's forward and
    backward of one micro-batch, its metadata sent to the next; module doc); the step's other micro-batches, its
    gradient reduction and optimizer step do not run."""
    from torch.distributed.pipelining import schedules

    def stopping(initialize: Any) -> Any:
        def run(schedule: Any, *args: Any, **kwargs: Any) -> None:
            initialize(schedule, *args, **kwargs)
            raise _ShapesInferred

        return run

    saved = [(owner, name, getattr(owner, name)) for owner, name in (
        (schedules.PipelineScheduleSingle, "_initialize_stage"),
        (schedules.PipelineScheduleMulti, "_initialize_stages"))]
    for owner, name, initialize in saved:
        setattr(owner, name, stopping(initialize))
    try:
        yield
    except _ShapesInferred:
        pass
    finally:
        for owner, name, initialize in saved:
            setattr(owner, name, initialize)


def traced_stage_class() -> type:
    """The traced pipeline's stage class, restoring the chunk's buffers after the schedule's shape inference: a
    real forward and backward on zeros that must not count as a step (BatchNorm running statistics). Restored
    after the inference backward, not before it: autograd saved those buffers and checks they were not
    modified."""
    base = stage_class()

    class TracedStage(base):  # type: ignore[misc, valid-type]
        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self.save_buffers()
            return super()._prepare_forward_infra(*args, **kwargs)

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super()._prepare_backward_infra(*args, **kwargs)
            finally:
                self.restore_buffers()

    return TracedStage


@contextmanager
def split_points(module: nn.Module, starts: Sequence[str]) -> Iterator[None]:
    """Mark a split before each module in ``starts`` (torch's annotation), removed again afterwards."""
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import annotate_split_points

    annotate_split_points(module, {fqn: SplitPoint.BEGINNING for fqn in starts})
    try:
        yield
    finally:
        for fqn in starts:
            unit = module.get_submodule(fqn)
            unit.__dict__.pop("forward", None)
            unit.__dict__.pop("_orig_forward", None)


def split_traced(module: nn.Module, program: ExportedProgram) -> Any:
    """torch's ``Pipe`` of ``program`` (an export of ``module`` with split points), cut at those points."""
    from torch.distributed.pipelining._IR import Pipe

    return Pipe._from_traced(module, program)


def graph_to_device(graph_module: nn.Module, device: torch.device) -> None:
    """Make the factory ops of a stage graph (and its subgraphs) create their tensors on ``device``."""
    from torch.distributed.pipelining._IR import _modify_graph_op_device

    _modify_graph_op_device(graph_module, device)
