"""Pipeline parallelism for models that are not a block stack, part two: the chunks of a traced split
(``trace``) and the pipeline that runs them.

* Skip connections are carried: every value a later chunk needs (a U-Net's encoder output, the residual of a
  block) travels through each chunk in between, so a chunk only talks to its neighbours (the stage protocol of
  ``PipelineStage``, any schedule). The model's inputs are not carried: every chunk reads them from the
  micro-batch the strategy captured, as in ``chunks`` (the first stage's schedule input is the micro-batch
  index).
* Names stay the user's. The splitter keeps the module hierarchy inside each stage graph and the very parameter
  and buffer tensors of the user's model, so the user's module stays the parameter container: after the split,
  what other ranks' chunks own is removed from it (set to None), and ``parameters()``, the optimizer and state
  dicts see this rank's part under the original names; their union is the single-device state dict.
* BatchNorm: the training graph updates running statistics in place (``aten.batch_norm`` with training=True on
  the module's own buffers), once per micro-batch forward, in micro-batch order, as on one device with gradient
  accumulation. The schedule's shape-inference pass runs one extra forward; the buffers are restored after it
  (``stage.traced_stage_class``). Validation runs the eval-mode trace (running statistics, no dropout); when
  both traces are the same program (no mode-dependent module), the training chunks serve both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.pipeline.partition import chunk_sizes
from lightning_autopar.parallel.pipeline.runtime import StagedPipeline
from lightning_autopar.parallel.pipeline.stage import graph_to_device, traced_stage_class
from lightning_autopar.parallel.pipeline.trace import (Example, TracedSplit, check_unit_count, flatten_inputs,
                                                       same_program, tensors_by_name, trace_split)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class TracedChunk(nn.Module):
    """One chunk (stage module) of a traced split: runs its stage graph on the micro-batch's inputs and the
    values carried from the chunk before; returns the values the next chunk needs (passed-through ones copied),
    or (last chunk) the model output's tensors. Its parameters are the user model's own tensors."""

    def __init__(self, split: TracedSplit, index: int, inputs: Callable[[int], Example]) -> None:
        super().__init__()
        self.index, self.num_chunks = index, split.num_chunks
        self.stage = split.stage_module(index)
        self.__dict__["_split"] = split
        self.__dict__["_inputs"] = inputs
        self.mb_index = 0
        self.unit_fqns = list(split.units[index])
        self._fixed: dict[int, Any] = {i: v for i, (kind, v) in enumerate(split.output) if kind == "const"}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_chunks - 1

    @property
    def blocks(self) -> list[nn.Module]:
        """The units this chunk runs, as modules of its stage graph (FSDP units under data parallelism)."""
        found = []
        for fqn in self.unit_fqns:
            try:
                found.append(self.stage.get_submodule(fqn))
            except AttributeError:
                continue
        return found

    def _flat_inputs(self) -> dict[str, Any]:
        split: TracedSplit = self.__dict__["_split"]
        args, kwargs = self.__dict__["_inputs"](self.mb_index)
        return dict(zip(split.placeholders, flatten_inputs(split, args, kwargs)))

    def forward(self, *received: torch.Tensor) -> Any:
        split: TracedSplit = self.__dict__["_split"]
        env = self._flat_inputs()
        if not self.is_first:
            carried = split.carried[self.index]
            if len(received) != len(carried):
                raise RuntimeError(f"pipeline (traced): chunk {self.index} received {len(received)} values, "
                                   f"expected {len(carried)}")
            received = tuple(_contiguous_grad(t) for t in received)
            env.update(zip(carried, received))
        wiring = split.stages[self.index]
        result = self.stage(*(env[a] for a in wiring.args))
        for value, i in wiring.outputs.items():
            env[value] = result if i is None else result[i]
        if self.is_last:
            leaves = [env[v] if kind == "value" else v for kind, v in split.output]
            self._fixed = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}
            tensors = tuple(v for v in leaves if isinstance(v, torch.Tensor))
            return tensors[0] if len(tensors) == 1 else tensors
        received_ids = {id(t) for t in received}
        out = []
        for value in split.carried[self.index + 1]:
            tensor = env[value]
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError("plan.pp", f"{split.module_name}: a {type(tensor).__name__} value crosses the "
                                  f"split before unit '{split.units[self.index + 1][0]}'", "use pp=1")
            # a stage output must not be its received tensor (the schedule frees and reuses those), and p2p
            # (gloo) sends and receives contiguous tensors only (gradient buffers copy the output's strides)
            out.append(tensor.clone(memory_format=torch.contiguous_format) if id(tensor) in received_ids
                       else tensor.contiguous())
        return out[0] if len(out) == 1 else tuple(out)

    def rebuild(self, output: Any) -> Any:
        """The model output (as the user's forward returns it: a tensor, tuple, ModelOutput) from the last
        chunk's tensors."""
        from torch.utils._pytree import tree_unflatten

        split: TracedSplit = self.__dict__["_split"]
        tensors = iter(list(output) if isinstance(output, (tuple, list)) else [output])
        leaves = [self._fixed[i] if i in self._fixed else next(tensors) for i in range(len(split.output))]
        return tree_unflatten(leaves, split.out_spec)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: a received value's gradient goes back by p2p, which (gloo)
    needs contiguous tensors, and e.g. the gradient of one input of a ``cat`` is a strided slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x) if x.requires_grad else x


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _prune(module: nn.Module, keep: set[int]) -> None:
    """Remove from ``module`` every parameter and buffer not in ``keep`` (set to None: names, state dicts and the
    optimizer then see only this rank's part)."""
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for key, value in list(store.items()):
                if value is not None and id(value) not in keep:
                    store[key] = None


class TracedPipeline(StagedPipeline):
    """This rank's chunks of a traced split, their stages and the schedule: the interface of
    ``parallel.pipeline.Pipeline`` that the strategy drives (train_step, forward_only, has_last, last_chunk,
    broadcast_from_last, inferring, chunks), for any model torch.export can trace.

    Construction traces the whole ``module`` (training and eval mode) on ``example`` (one micro-batch's
    (args, kwargs) of the model call), then removes from it what other ranks' chunks own. Data parallelism
    over the chunks (FSDP) swaps parameters: call ``rebind_parameters()`` afterwards. Validation of a model whose
    eval trace differs (BatchNorm, dropout) cannot run on sharded parameters and is refused in one line.
    """

    def __init__(self, module: nn.Module, example: Example, unit_fqns: Sequence[str], pp_mesh: DeviceMesh,
                 schedule: str, n_microbatches: int, device: torch.device,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], vpp: int = 1,
                 layers_per_stage: Sequence[int] | None = None) -> None:
        self.module = module
        self._join(pp_mesh, device, n_microbatches)
        chunks = self.pp * vpp
        check_unit_count(module, unit_fqns, chunks)
        self.sizes = chunk_sizes(len(unit_fqns), self.pp, vpp, layers_per_stage)
        self.split = trace_split(module, example, unit_fqns, self.sizes, train=True)
        eval_split = trace_split(module, example, unit_fqns, self.sizes, train=False)
        self.eval_split = None if same_program(self.split, eval_split) else eval_split
        mine = [j for j in range(chunks) if j % self.pp == self.pp_rank]
        self.chunks = [TracedChunk(self.split, j, self.input_of) for j in mine]
        self.eval_chunks = ([TracedChunk(self.eval_split, j, self.input_of) for j in mine]
                            if self.eval_split is not None else self.chunks)
        for chunk in {id(c): c for c in self.chunks + self.eval_chunks}.values():
            graph_to_device(chunk.stage, device)
        keep = {id(t) for c in self.chunks + self.eval_chunks for t in tensors_by_name(c).values()}
        if self.pp_rank == 0:  # tensors no stage uses (unused parameters) stay with the first stage
            used = {id(t) for k in range(chunks) for t in tensors_by_name(self.split.stage_module(k)).values()}
            keep |= {id(t) for t in tensors_by_name(module).values() if id(t) not in used}
        _prune(module, keep)
        self.split.pipe = None  # the other ranks' stage modules (and their tensors) can go
        if self.eval_split is not None:
            self.eval_split.pipe = None
        self._build_schedule(traced_stage_class(), schedule, loss_fn)

    @property
    def recompute_modules(self) -> list[nn.Module]:
        """What activation recomputation checkpoints: each chunk's stage graph, called with explicit inputs (the
        chunk itself reads its micro-batch's inputs by index, which a recompute run during another micro-batch's
        backward -- 1F1B interleaves them -- would read wrong)."""
        return [c.stage for c in self.chunks]

    def rebind_parameters(self) -> None:
        """After something replaced parameters on the chunks (FSDP's ``fully_shard``): put the chunks' current
        parameter objects back into the user's module (and the eval chunks) under the same names."""
        current: dict[str, nn.Parameter] = {}
        for chunk in self.chunks:
            current.update(dict(chunk.stage.named_parameters(remove_duplicate=False)))
        targets = [self.module] + ([c.stage for c in self.eval_chunks] if self.eval_split is not None else [])
        for target in targets:
            for sub_name, sub in target.named_modules():
                for key, value in list(sub._parameters.items()):
                    fqn = f"{sub_name}.{key}" if sub_name else key
                    if value is not None and fqn in current:
                        sub._parameters[key] = current[fqn]

    def check_inputs(self, inputs: list[Example]) -> None:
        """One ConfigError when a model call's structure or a dimension the trace fixed (every one but the
        batch's, where the model allows) differs from the traced call's."""
        for args, kwargs in inputs:
            flatten_inputs(self.split, args, kwargs)

    def forward_only(self, inputs: Example) -> Any:
        """One micro-batch forward through all chunks in stage order without gradients (validation), with the
        eval-mode trace when the user's module is in eval mode; returns the model output on the rank holding
        the last chunk, else None."""
        chunks = self.chunks if self.module.training else self.eval_chunks
        if chunks is not self.chunks and any(_is_dtensor(p) for c in chunks for p in c.parameters()):
            raise ConfigError("plan.pp", f"{self.split.module_name}: validation runs the eval-mode trace (the model "
                              "has BatchNorm or dropout), whose chunks cannot run on the parameters data "
                              "parallelism sharded", "use dp=1 with pp>1, or pp=1")
        return self._forward_chunks(chunks, inputs)
