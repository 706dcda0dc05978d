"""Running the chunks: the schedule over this rank's stages, the training step, the forward-only pass in stage
order (validation) and the broadcast from the last stage (``StagedPipeline``, shared by both pipelines), and the
block-stack pipeline built on it (``Pipeline``).

GPipe and 1F1B run one stage per rank; interleaved 1F1B (or more than one chunk per rank) runs ``vpp``, placed
round-robin; interleaved zero bubble likewise with the backward split into input and weight gradients (the weight
part fills the bubble); ZBV and DualPipeV run two chunks per rank placed in a V (``partition.stage_owners``), also
with the split backward. DualPipeV's overlapped forward+backward pairs run one after the other (torch's default
without a registered overlap callback): the same arithmetic, no overlap of their communication.

Shapes: torch's stages infer their activation shapes once (a real forward and backward of micro-batch 0) and
keep receive buffers of those shapes for a fixed number of micro-batches. A training step is therefore one or
more *runs*, each of equal-shaped micro-batches (``runtime.pipeline_step`` groups them); the stages and the
schedule are kept per (shapes, micro-batch count) key, the last ``SCHEDULE_CACHE`` of them (a ragged last
batch or alternating sequence lengths reuse theirs; a new key infers again). Every rank of the pipeline group
passes the same key (they captured the same inputs), and the data-parallel ranks too (the key holds every
rank's shapes), so all ranks infer, and run FSDP's collectives, together.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

import torch
from torch import nn

from lightning_autopar.parallel.pipeline.chunks import split_model
from lightning_autopar.parallel.pipeline.partition import (StageParts, check_schedule, chunk_sizes, schedule_count,
                                                           stage_owners)
from lightning_autopar.parallel.pipeline.stage import stage_class

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_autopar.profile.analyze import ModelAnalysis

SCHEDULE_CACHE = 8  # (shapes, micro-batch count) keys whose stages and schedule are kept


class StagedPipeline:
    """What both pipelines share once their chunks exist: this rank's place in the pp group, the schedule over
    its stages, the training step, the forward-only pass in stage order and the broadcast from the last stage.
    Subclasses set ``chunks`` (with ``index``, ``num_chunks``, ``is_first``/``is_last``, ``mb_index``,
    ``rebuild``) and call ``_build_schedule``."""

    def _join(self, pp_mesh: DeviceMesh, device: torch.device, n_microbatches: int) -> None:
        self.pp_mesh = pp_mesh
        self.group = pp_mesh.get_group()
        self.pp = pp_mesh.size()
        self.pp_rank = pp_mesh.get_local_rank()
        self.device = device
        self.inputs: list[tuple[tuple, dict]] = []
        self.n_microbatches = n_microbatches  # the plan's; a step runs the micro-batches its batch has
        self.owners: list[int] = []  # pipeline rank of each chunk, set with the schedule

    def _build_schedule(self, stage_cls: type, schedule: str,
                        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        self._stage_cls, self._schedule_kind, self._loss_fn = stage_cls, schedule, loss_fn
        self.owners = stage_owners(self.pp, self.chunks[0].num_chunks, schedule)
        self._runs: OrderedDict[Hashable, tuple[list[Any], Any]] = OrderedDict()
        self.stages: list[Any] = []  # those of the current (or last) run, made by its first step
        self.schedule: Any = None

    def _stages_for(self, key: Hashable, n_microbatches: int) -> tuple[list[Any], Any]:
        """The stages and schedule for ``n_microbatches`` micro-batches of the shapes ``key`` names: cached (the
        last ``SCHEDULE_CACHE``), else new ones, whose first run infers the shapes."""
        from torch.distributed import pipelining as tp

        full = (key, n_microbatches)
        if full in self._runs:
            self._runs.move_to_end(full)
            return self._runs[full]
        stages = [self._stage_cls(c, c.index, c.num_chunks, self.device, group=self.group) for c in self.chunks]
        multi = {"interleaved-zb": tp.ScheduleInterleavedZeroBubble, "zbv": tp.ScheduleZBVZeroBubble,
                 "dualpipev": tp.ScheduleDualPipeV}
        name = self._schedule_kind
        if name in multi or name == "interleaved" or len(stages) > 1:
            kind = multi.get(name, tp.ScheduleInterleaved1F1B)
            schedule = kind(stages, n_microbatches, loss_fn=self._loss_fn, scale_grads=False)
        else:  # torch's 1F1B needs micro-batches >= stages; fewer run GPipe's order (what 1F1B then is)
            kind = tp.ScheduleGPipe if name == "gpipe" or n_microbatches < self.pp else tp.Schedule1F1B
            schedule = kind(stages[0], n_microbatches, loss_fn=self._loss_fn, scale_grads=False)
        self._runs[full] = (stages, schedule)
        while len(self._runs) > SCHEDULE_CACHE:
            self._runs.popitem(last=False)
        return stages, schedule

    def run_size(self, micro_batches: int) -> int:
        """Micro-batches a run of ``micro_batches`` equal-shaped ones takes: at least the schedule's minimum."""
        return schedule_count(self._schedule_kind, self.pp, micro_batches)

    @property
    def inferring(self) -> bool:
        """True while the schedule infers shapes (a real forward/backward whose loss must not be recorded)."""
        return self._stage_cls.inferring

    @property
    def has_last(self) -> bool:
        return any(c.is_last for c in self.chunks)

    @property
    def last_chunk(self) -> Any:
        return next(c for c in self.chunks if c.is_last)

    def input_of(self, mb_index: int) -> tuple[tuple, dict]:
        return self.inputs[mb_index]

    def last_rank(self) -> int:
        """Global rank of the last stage in this rank's pipeline group."""
        return int(self.pp_mesh.mesh.flatten()[self.owners[-1]].item())

    def check_inputs(self, inputs: list[tuple[tuple, dict]]) -> None:
        """One ConfigError when the chunks cannot run these model calls (the block-stack chunks take any)."""

    def train_step(self, inputs: list[tuple[tuple, dict]], key: Hashable = None, real: int | None = None) -> None:
        """Forward and backward of one run of micro-batches through the schedule. ``inputs[i]`` are the (args,
        kwargs) of the model call for micro-batch i, all of the shapes ``key`` names (the same key on every rank;
        None: the planned micro-batches); their count is one ``run_size`` gives. The first ``real`` are real
        micro-batches, the rest zero-weight stand-ins whose buffer updates are undone after the run (None: all
        real). The loss function given at construction runs on the last stage with the micro-batch index as its
        target."""
        n = len(inputs)
        if n != self.run_size(n):
            raise RuntimeError(f"pipeline: a run of {n} micro-batches, schedule {self._schedule_kind} needs "
                               f"{self.run_size(n)}")
        self.stages, self.schedule = self._stages_for(key, n)
        self.inputs = inputs
        for stage in self.stages:
            stage.real = real
        index = torch.arange(n, device=self.device)
        args = (index,) if self.chunks[0].is_first else ()
        try:
            self.schedule.step(*args, target=index if self.has_last else None, return_outputs=False)
        finally:
            self.inputs = []
            self._after_step()

    def _after_step(self) -> None:
        """After every run, also a failed one: undo what stand-ins (and a forward-only shape inference) did to
        the chunks' buffers."""
        for stage in self.stages:
            stage.real = None
            stage.restore_buffers()

    def forward_only(self, inputs: tuple[tuple, dict]) -> Any:
        """One micro-batch forward through all chunks in stage order without gradients (validation); returns
        the model output on the rank holding the last chunk, else None."""
        return self._forward_chunks(self.chunks, inputs)

    def _forward_chunks(self, chunks: Sequence[Any], inputs: tuple[tuple, dict]) -> Any:
        import torch.distributed as dist

        self.inputs = [inputs]
        ranks = self.pp_mesh.mesh.flatten().tolist()
        by_index = {c.index: c for c in chunks}
        num_chunks = chunks[0].num_chunks
        received: tuple[torch.Tensor, ...] = ()
        out = None
        try:
            with torch.no_grad():
                for j in range(num_chunks):
                    owner, prev = self.owners[j], self.owners[j - 1]
                    if owner != self.pp_rank:
                        continue
                    chunk = by_index[j]
                    if j > 0 and prev != self.pp_rank:  # the activation (and MoE values) of the chunk before
                        meta: list[Any] = [None]
                        dist.recv_object_list(meta, src=ranks[prev], group=self.group)
                        received = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[0])
                        for tensor in received:
                            dist.recv(tensor, src=ranks[prev], group=self.group)
                    chunk.mb_index = 0
                    result = chunk(*received)
                    if chunk.is_last:
                        out = chunk.rebuild(result)
                        break
                    received = result if isinstance(result, tuple) else (result,)
                    nxt = self.owners[j + 1]
                    if nxt != self.pp_rank:
                        meta = [[(tuple(t.shape), t.dtype) for t in received]]
                        dist.send_object_list(meta, dst=ranks[nxt], group=self.group)
                        for tensor in received:
                            dist.send(tensor.contiguous(), dst=ranks[nxt], group=self.group)
        finally:
            self.inputs = []
            self._reshard(chunks)
        return out

    @staticmethod
    def _reshard(chunks: Sequence[nn.Module]) -> None:
        """Free parameters FSDP kept gathered after a forward without backward (the next step gathers the
        updated ones; stale gathered copies would otherwise survive the optimizer step)."""
        from torch.distributed.fsdp import FSDPModule

        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def broadcast_from_last(self, obj: Any) -> Any:
        """``obj`` as given on the last stage's rank, on every rank of the pipeline group."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.last_rank(), group=self.group)
        return box[0]


class Pipeline(StagedPipeline):
    """This rank's chunks of a block stack, their stages and the schedule (``StagedPipeline``).

    Construction splits ``transformer`` in place; TP, EP, recompute and FSDP are then applied to the chunks by
    the caller (the strategy's order), which the stages and the schedule only use from the first step on.
    """

    def __init__(self, transformer: nn.Module, analysis: ModelAnalysis, pp_mesh: DeviceMesh, schedule: str, vpp: int,
                 n_microbatches: int, device: torch.device, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 layers_per_stage: Sequence[int] | None = None, parts: StageParts | None = None) -> None:
        self._join(pp_mesh, device, n_microbatches)
        check_schedule(schedule, self.pp, n_microbatches)
        self.sizes = chunk_sizes(len(analysis.blocks), self.pp, vpp, layers_per_stage)
        self.chunks = split_model(transformer, analysis, self.pp_rank, self.pp, vpp, self.sizes, self.input_of,
                                  stage_owners(self.pp, self.pp * vpp, schedule), parts)
        user_loss = loss_fn

        def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            loss = user_loss(output, target)
            # every received MoE value gets a gradient (zero where the user's loss does not read it), so the
            # stages before always have one to send back
            for value in self.last_chunk.received_values:
                loss = loss + (value * 0).sum()
            return loss

        self._build_schedule(stage_class(), schedule, loss_fn)
