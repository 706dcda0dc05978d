"""Pipeline parallelism for models that are not a block stack: split the traced graph at unit boundaries.

``parallel.pipeline`` splits a transformer by swapping its blocks; a CNN, a U-Net or a Hugging Face ResNet has no
such stack. Here ``torch.export`` traces the model once per mode (training and eval) with a split point before
the first unit of every chunk, and ``torch.distributed.pipelining``'s splitter (``Pipe._from_traced``) cuts the
graph there. What this module adds around the splitter:

* Skip connections are carried: every value a later chunk needs (a U-Net's encoder output, the residual of a
  block) travels through each chunk in between, so a chunk only talks to its neighbours (the stage protocol of
  ``PipelineStage``, any schedule). The model's inputs are not carried: every chunk reads them from the
  micro-batch the strategy captured, as in ``parallel.pipeline`` (the first stage's schedule input is the
  micro-batch index).
* Names stay the user's. The splitter keeps the module hierarchy inside each stage graph and the very parameter
  and buffer tensors of the user's model, so the user's module stays the parameter container: after the split,
  what other ranks' chunks own is removed from it (set to None), and ``parameters()``, the optimizer and state
  dicts see this rank's part under the original names; their union is the single-device state dict.
* BatchNorm: the training graph updates running statistics in place (``aten.batch_norm`` with training=True on
  the module's own buffers), once per micro-batch forward, in micro-batch order, as on one device with gradient
  accumulation. The schedule's shape-inference pass runs one extra forward; the buffers are restored after it.
  Validation runs the eval-mode trace (running statistics, no dropout); when both traces are the same program
  (no mode-dependent module), the training chunks serve both.

Refused (``check_traced_pipeline``, one ConfigError each): export fails (data-dependent control flow, graph
breaks; the first line of the reason is shown); a unit that is not called exactly once where the trace expects
it; a parameter used on both sides of a split (a tie: the splitter would copy it and train two tensors); a
non-tensor value crossing a split.

The trace is dynamic in the batch dimension where the model allows it (``Dim.AUTO``); every other input
dimension is fixed at the example's size and checked on every call.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.pipeline import StagedPipeline, _stage_class, chunk_sizes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._pytree import TreeSpec

Example = tuple[tuple, dict]


# ------------------------------------------------------------------------------------------- tracing and wiring


@dataclass(frozen=True)
class StageWiring:
    """One stage of the split graph: its graph module's name, the root-graph values it takes (in order), and
    how its result becomes root-graph values (``outputs[name] = index`` into a tuple result, or None: the whole
    result is the value)."""

    submod: str
    args: list[str]
    outputs: dict[str, int | None]


@dataclass
class TracedSplit:
    """A model traced and cut into chunks, with what each chunk receives and returns."""

    pipe: Any  # torch.distributed.pipelining Pipe
    module_name: str
    in_spec: TreeSpec
    out_spec: TreeSpec
    placeholders: list[str]
    input_shapes: list[tuple[int | None, ...] | None]  # per placeholder: fixed dims (None where dynamic)
    stages: list[StageWiring]
    carried: list[list[str]]  # carried[k]: root values chunk k receives from chunk k-1 (carried[0] = [])
    output: list[tuple[str, Any]]  # the model output leaves: ("value", root name) or ("const", value)
    units: list[list[str]]  # unit fqns per chunk

    @property
    def num_chunks(self) -> int:
        return len(self.stages)

    def stage_module(self, k: int) -> nn.Module:
        return self.pipe.split_gm.get_submodule(self.stages[k].submod)


def _first_line(err: BaseException) -> str:
    for text in (str(err), str(err.__cause__ or "")):
        for line in text.splitlines():
            if line.strip():
                return f"{type(err).__name__}: {line.strip()}"
    return type(err).__name__


def _dynamic_batch(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Export's dynamic_shapes: the leading (batch) dimension of every tensor input left to the tracer."""
    import torch.utils._pytree as pytree
    from torch.export import Dim

    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError:
        return None
    spec = {}
    for name, value in bound.arguments.items():
        spec[name] = pytree.tree_map(lambda t: {0: Dim.AUTO} if isinstance(t, torch.Tensor) and t.dim() else None,
                                     value)
    return spec


@contextmanager
def _split_points(module: nn.Module, starts: Sequence[str]) -> Iterator[None]:
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


@contextmanager
def _quiet() -> Iterator[None]:
    """Keep export's diagnostics (the failing graph, printed as warnings) and torch's deprecation notices off
    the user's console: a failure is reported as one ConfigError line (export prints the partial graph of a
    failed trace to stderr itself)."""
    import io
    import logging
    import warnings
    from contextlib import redirect_stderr

    loggers = [logging.getLogger(n) for n in ("torch.fx.experimental.symbolic_shapes", "torch.export",
                                               "torch._export", "torch._dynamo", "torch.distributed.pipelining")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _groups(unit_fqns: Sequence[str], sizes: Sequence[int]) -> list[list[str]]:
    out, start = [], 0
    for n in sizes:
        out.append(list(unit_fqns[start:start + n]))
        start += n
    return out


def trace_split(module: nn.Module, example: Example, unit_fqns: Sequence[str], sizes: Sequence[int],
                train: bool = True) -> TracedSplit:
    """Trace ``module`` (in training or eval mode) on one micro-batch and cut it before the first unit of every
    group of ``sizes`` units. One ConfigError when the model cannot be split so."""
    from torch.distributed.pipelining._IR import Pipe

    name = type(module).__name__
    args, kwargs = tuple(example[0]), dict(example[1])
    for fqn in unit_fqns:
        try:
            module.get_submodule(fqn)
        except AttributeError:
            raise ConfigError("plan.pp", f"{name}: no submodule '{fqn}' to split at", "use pp=1") from None
    groups = _groups(unit_fqns, sizes)
    starts = [g[0] for g in groups[1:]]
    was_training = module.training
    module.train(train)
    try:
        with _split_points(module, starts), torch.no_grad(), _quiet():
            try:
                ep = torch.export.export(module, args, kwargs, dynamic_shapes=_dynamic_batch(module, args, kwargs))
            except Exception as err:  # export's reasons are many (graph breaks, data-dependent control flow, ...)
                raise ConfigError("plan.pp", f"{name}: torch.export cannot trace the model for a pipeline split "
                                  f"({_first_line(err)})", "use pp=1") from None
        try:
            with _quiet():
                pipe = Pipe._from_traced(module, ep)
        except Exception as err:
            raise ConfigError("plan.pp", f"{name}: the traced graph cannot be split at the units "
                              f"{', '.join(starts)} ({_first_line(err)})", "use pp=1") from None
    finally:
        module.train(was_training)
    split = _wire(pipe, name, ep, groups)
    _check_split(module, split)
    return split


def _wire(pipe: Any, name: str, ep: Any, groups: list[list[str]]) -> TracedSplit:
    """Read the split's root graph: who produces and who consumes each value; what each chunk carries."""
    import operator

    graph = pipe.split_gm.graph
    placeholders: list[str] = []
    shapes: list[tuple[int | None, ...] | None] = []
    producer: dict[str, int] = {}
    last_use: dict[str, int] = {}
    stages: list[StageWiring] = []
    output: list[tuple[str, Any]] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            placeholders.append(node.name)
            val = node.meta.get("val")
            shapes.append(tuple(d if isinstance(d, int) else None for d in val.shape)
                          if isinstance(val, torch.Tensor) else None)
        elif node.op == "call_module":
            k = len(stages)
            if node.kwargs:
                raise ConfigError("plan.pp", f"{name}: stage {k} of the split takes keyword values", "use pp=1")
            stages.append(StageWiring(node.target, [a.name for a in node.args], {}))
            producer[node.name] = k
            stages[k].outputs[node.name] = None
            for a in node.args:
                last_use[a.name] = max(last_use.get(a.name, -1), k)
        elif node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            k = producer[src.name]
            stages[k].outputs.pop(src.name, None)
            stages[k].outputs[node.name] = int(node.args[1])
            producer[node.name] = k
        elif node.op == "output":
            from torch.fx.node import Node
            from torch.utils._pytree import tree_flatten

            leaves, _ = tree_flatten(node.args[0])
            for leaf in leaves:
                if isinstance(leaf, Node):
                    output.append(("value", leaf.name))
                    last_use[leaf.name] = len(groups)  # needed by the last chunk (at least)
                else:
                    output.append(("const", leaf))
        else:
            raise ConfigError("plan.pp", f"{name}: unexpected node {node.op} {node.target} in the split graph",
                              "use pp=1")
    if len(stages) != len(groups):
        raise ConfigError("plan.pp", f"{name}: splitting before units {', '.join(g[0] for g in groups[1:])} gave "
                          f"{len(stages)} stages, not {len(groups)} (a unit is called more than once, or not "
                          "where the units' order says)", "use pp=1")
    values = [n.name for n in graph.nodes if n.name in producer and n.name in stages[producer[n.name]].outputs]
    carried = [[v for v in values if producer[v] < k <= last_use.get(v, -1)] for k in range(len(stages))]
    return TracedSplit(pipe, name, ep.call_spec.in_spec, ep.call_spec.out_spec, placeholders, shapes, stages,
                       carried, output, groups)


def _check_split(module: nn.Module, split: TracedSplit) -> None:
    """Refuse what the chunks could not train as one device does: a tensor on both sides of a split (a tie, or
    a module called from two chunks: the splitter copies it) and non-tensor values crossing a split."""
    name = split.module_name
    replicated = getattr(split.pipe, "replicated_params", [])
    if replicated:
        where = replicated[0]
        fqn = next(iter(where.values()))
        raise ConfigError("plan.pp", f"{name}: parameter '{fqn}' is used on both sides of a split (stages "
                          f"{', '.join(where)}: a tie, or a module called from two chunks), and the split would "
                          "copy it", "use pp=1, or keep the modules sharing it in one chunk")
    user = {id(t) for t in _tensors(module).values()}
    for k in range(split.num_chunks):
        for fqn, tensor in _tensors(split.stage_module(k)).items():
            if isinstance(tensor, nn.Parameter) and id(tensor) not in user:
                raise ConfigError("plan.pp", f"{name}: stage {k} holds '{fqn}', which is not the model's own "
                                  "tensor, so training it would not update the model", "use pp=1")
    for k in range(1, split.num_chunks):
        vals = _output_values(split, k - 1)
        for value in split.carried[k]:
            meta = vals.get(value)
            if meta is not None and not isinstance(meta, torch.Tensor):
                raise ConfigError("plan.pp", f"{name}: a {type(meta).__name__} value crosses the split before "
                                  f"unit '{split.units[k][0]}'; stages exchange tensors only", "use pp=1, or "
                                  "split at other units")


def _output_values(split: TracedSplit, k: int) -> dict[str, Any]:
    """The traced example values (fake tensors, ints) of stage ``k``'s outputs by root name, where recorded."""
    gm = split.stage_module(k)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    results = out_node.args[0]
    wiring = split.stages[k]
    found = {}
    for value, index in wiring.outputs.items():
        node = results if index is None else results[index]
        if hasattr(node, "meta"):
            found[value] = node.meta.get("val")
    return found


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (every name of a shared tensor)."""
    out: dict[str, torch.Tensor] = {}
    out.update(dict(module.named_parameters(remove_duplicate=False)))
    out.update({k: v for k, v in module.named_buffers(remove_duplicate=False) if v is not None})
    return out


def _same_program(a: TracedSplit, b: TracedSplit) -> bool:
    """Whether two traces compute the same thing (no mode-dependent module): same code in every (sub)graph."""

    def code(gm: nn.Module) -> list[str]:
        return [getattr(m, "code", "") or str(getattr(m, "graph", "")) for m in gm.modules()]

    return a.num_chunks == b.num_chunks and all(code(a.stage_module(k)) == code(b.stage_module(k))
                                                for k in range(a.num_chunks))


def check_traced_pipeline(module: nn.Module, example: Example, unit_fqns: Sequence[str], pp: int,
                          vpp: int = 1, layers_per_stage: Sequence[int] | None = None) -> None:
    """Raise one ConfigError("plan.pp", ...) when ``module`` cannot be pipelined in ``pp * vpp`` chunks at its
    units through torch's tracer (the first line of export's reason is in the message), so the planner
    restricts pp to 1 and shows why. Traces the model in training mode without changing it (the eval-mode
    trace, made when the pipeline is built, refuses in the same way)."""
    if pp * vpp <= 1:
        return
    chunks = pp * vpp
    if len(unit_fqns) < chunks:
        raise ConfigError("plan.pp", f"{type(module).__name__}: pp*vpp={chunks} exceeds its {len(unit_fqns)} "
                          "units", "use pp*vpp <= number of units")
    sizes = chunk_sizes(len(unit_fqns), pp, vpp, layers_per_stage)
    trace_split(module, example, unit_fqns, sizes, train=True)


# ------------------------------------------------------------------------------------------- chunks


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


def flatten_inputs(split: TracedSplit, args: tuple, kwargs: dict) -> list[Any]:
    """The model call's (args, kwargs) as the trace's flat inputs; one ConfigError when their structure or a
    fixed dimension differs from the traced micro-batch."""
    from torch.utils._pytree import tree_flatten

    traced_kwargs = split.in_spec.child(1).context or []
    if set(kwargs) != set(traced_kwargs):
        raise ConfigError("training_step", f"{split.module_name} was traced for the pipeline with keyword "
                          f"arguments {sorted(traced_kwargs)}, the step passed {sorted(kwargs)}",
                          "call the model the same way in every step")
    leaves, spec = tree_flatten((tuple(args), {k: kwargs[k] for k in traced_kwargs}))
    if spec != split.in_spec or len(leaves) != len(split.placeholders):
        raise ConfigError("training_step", f"{split.module_name} was traced for the pipeline with inputs "
                          f"{split.in_spec}, the step passed {spec}", "call the model the same way in every step")
    for name, leaf, fixed in zip(split.placeholders, leaves, split.input_shapes):
        if fixed is None or not isinstance(leaf, torch.Tensor):
            continue
        if leaf.dim() != len(fixed) or any(f is not None and f != s for f, s in zip(fixed, leaf.shape)):
            raise ConfigError("DataLoader.batch_size", f"{split.module_name}: input '{name}' has shape "
                              f"{tuple(leaf.shape)}, the pipeline trace fixed {tuple('*' if f is None else f for f in fixed)}",
                              "keep every input's shape (except the batch size where the model allows it) fixed")
    return leaves


def _traced_stage_class() -> type:
    """The pipeline's stage class, restoring the chunk's buffers after the schedule's shape inference: a real
    forward and backward on zeros that must not count as a step (BatchNorm running statistics). Restored after
    the inference backward, not before it: autograd saved those buffers and checks they were not modified."""
    base = _stage_class()

    class TracedStage(base):  # type: ignore[misc, valid-type]
        _saved: list[tuple[torch.Tensor, torch.Tensor]] | None = None

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self._saved = [(b, b.detach().clone()) for _, b in self.submod.named_buffers()]
            return super()._prepare_forward_infra(*args, **kwargs)

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super()._prepare_backward_infra(*args, **kwargs)
            finally:
                self.restore_buffers()

        def restore_buffers(self) -> None:
            saved, self._saved = self._saved, None
            with torch.no_grad():
                for buf, value in saved or []:
                    buf.copy_(value)

    return TracedStage


# ------------------------------------------------------------------------------------------- the pipeline


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
    over the chunks (FSDP) swaps parameters: call ``rebind_parameters()`` afterwards. Validation of a model whose eval trace differs (BatchNorm, dropout)
    cannot run on sharded parameters and is refused in one line.
    """

    def __init__(self, module: nn.Module, example: Example, unit_fqns: Sequence[str], pp_mesh: DeviceMesh,
                 schedule: str, n_microbatches: int, device: torch.device,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], vpp: int = 1,
                 layers_per_stage: Sequence[int] | None = None) -> None:
        from torch.distributed.pipelining._IR import _modify_graph_op_device

        self.module = module
        self._join(pp_mesh, device, n_microbatches)
        chunks = self.pp * vpp
        if len(unit_fqns) < chunks:
            raise ConfigError("plan.pp", f"{type(module).__name__}: pp*vpp={chunks} exceeds its {len(unit_fqns)} "
                              "units", "use pp*vpp <= number of units")
        self.sizes = chunk_sizes(len(unit_fqns), self.pp, vpp, layers_per_stage)
        self.split = trace_split(module, example, unit_fqns, self.sizes, train=True)
        eval_split = trace_split(module, example, unit_fqns, self.sizes, train=False)
        self.eval_split = None if _same_program(self.split, eval_split) else eval_split
        mine = [j for j in range(chunks) if j % self.pp == self.pp_rank]
        self.chunks = [TracedChunk(self.split, j, self.input_of) for j in mine]
        self.eval_chunks = ([TracedChunk(self.eval_split, j, self.input_of) for j in mine]
                            if self.eval_split is not None else self.chunks)
        for chunk in {id(c): c for c in self.chunks + self.eval_chunks}.values():
            _modify_graph_op_device(chunk.stage, device)
        keep = {id(t) for c in self.chunks + self.eval_chunks for t in _tensors(c).values()}
        if self.pp_rank == 0:  # tensors no stage uses (unused parameters) stay with the first stage
            used = {id(t) for k in range(chunks) for t in _tensors(self.split.stage_module(k)).values()}
            keep |= {id(t) for t in _tensors(module).values() if id(t) not in used}
        _prune(module, keep)
        self.split.pipe = None  # the other ranks' stage modules (and their tensors) can go
        if self.eval_split is not None:
            self.eval_split.pipe = None
        self._build_schedule(_traced_stage_class(), schedule, loss_fn)

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

    def _after_step(self) -> None:
        for stage in self.stages:  # a forward-only inference (no backward to restore after) ends here
            stage.restore_buffers()

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
