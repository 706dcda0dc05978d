"""Pipeline parallelism for models that are not a block stack, part one: trace the model and cut the graph at
unit boundaries (``trace_split``), or say in one line why it cannot be (``check_traced_pipeline``).

``chunks`` splits a transformer by swapping its blocks; a CNN, a U-Net or a Hugging Face ResNet has no such
stack. Here ``torch.export`` traces the model once per mode (training and eval) with a split point before the
first unit of every chunk, and torch's splitter (``stage.split_traced``) cuts the graph there. ``_wire`` reads
the split's root graph: which values each chunk takes, returns and carries to its successor (``traced`` runs
them).

Refused (one ConfigError each): export fails (data-dependent control flow, graph breaks; the first line of the
reason is shown); a unit that is not called exactly once where the trace expects it; a parameter used on both
sides of a split (a tie: the splitter would copy it and train two tensors); a non-tensor value crossing a split;
a batch dimension the trace fixed (micro-batches take any number of rows).

The trace is dynamic in the batch dimension where the model allows it (``Dim.AUTO``); every other input
dimension is fixed at the example's size and checked on every call (``flatten_inputs``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.pipeline.partition import chunk_sizes
from lightning_autopar.parallel.pipeline.stage import split_points, split_traced

if TYPE_CHECKING:
    from torch.utils._pytree import TreeSpec

Example = tuple[tuple, dict]


class UnitOrderError(ConfigError):
    """The split gave another number of chunks than asked: a unit is called more than once, or out of order."""


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
                train: bool = True, check_cuts: bool = True) -> TracedSplit:
    """Trace ``module`` (in training or eval mode) on one micro-batch and cut it before the first unit of every
    group of ``sizes`` units. One ConfigError when the model cannot be split so (``check_cuts=False``: what refuses
    some cuts only, ``SplitRefusals``, is left to the caller)."""
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
        with split_points(module, starts), torch.no_grad(), _quiet():
            try:
                ep = torch.export.export(module, args, kwargs, dynamic_shapes=_dynamic_batch(module, args, kwargs))
            except Exception as err:  # export's reasons are many (graph breaks, data-dependent control flow, ...)
                raise ConfigError("plan.pp", f"{name}: torch.export cannot trace the model for a pipeline split "
                                  f"({_first_line(err)})", "use pp=1") from None
        try:
            with _quiet():
                pipe = split_traced(module, ep)
        except Exception as err:
            raise ConfigError("plan.pp", f"{name}: the traced graph cannot be split at the units "
                              f"{', '.join(starts)} ({_first_line(err)})", "use pp=1") from None
    finally:
        module.train(was_training)
    split = _wire(pipe, name, ep, groups)
    if check_cuts:
        _check_split(module, split)
    else:
        _check_own_tensors(module, split)
    _check_batch_dynamic(split, args, kwargs)
    return split


def _check_batch_dynamic(split: TracedSplit, args: tuple, kwargs: dict) -> None:
    """Refuse a trace that fixed the batch dimension (the model's code depends on the batch size: a reshape to
    it, a loop over rows): the pipeline's micro-batches have any number of rows (a ragged last batch, unequal
    micro-batches), so it would stop mid-epoch. The batch dimension is the leading one of the inputs whose
    leading size is the example's rows, as ``runtime.batches`` slices them."""
    from torch.utils._pytree import tree_leaves

    leaves = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    rows = next((int(t.shape[0]) for t in leaves if t.dim() >= 1), None)
    for name, fixed in zip(split.placeholders, split.input_shapes):
        if fixed and rows is not None and fixed[0] == rows:
            raise ConfigError("plan.pp", f"{split.module_name}: torch.export fixed the batch dimension of input "
                              f"'{name}' at the example's {rows} rows (the model's code depends on the batch size), "
                              "so pipeline micro-batches of other sizes could not run", "use pp=1")


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
            shapes.append(tuple(_fixed_size(d) for d in val.shape) if isinstance(val, torch.Tensor) else None)
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
        raise UnitOrderError("plan.pp", f"{name}: splitting before units {', '.join(g[0] for g in groups[1:])} gave "
                          f"{len(stages)} stages, not {len(groups)} (a unit is called more than once, or not "
                          "where the units' order says)", "use pp=1")
    values = [n.name for n in graph.nodes if n.name in producer and n.name in stages[producer[n.name]].outputs]
    carried = [[v for v in values if producer[v] < k <= last_use.get(v, -1)] for k in range(len(stages))]
    return TracedSplit(pipe, name, ep.call_spec.in_spec, ep.call_spec.out_spec, placeholders, shapes, stages,
                       carried, output, groups)


def _fixed_size(dim: Any) -> int | None:
    """A traced dimension's size when the trace fixed it (an int, or a symbol export specialised), else None."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return int(dim) if is_concrete_int(dim) else None


def _check_split(module: nn.Module, split: TracedSplit) -> None:
    """Refuse what the chunks could not train as one device does: a tensor on both sides of a split (a tie, or
    a module called from two chunks: the splitter copies it) and non-tensor values crossing a split."""
    _check_own_tensors(module, split)
    refusal = SplitRefusals.of(split).at(range(1, split.num_chunks))
    if refusal is not None:
        raise refusal


def _check_own_tensors(module: nn.Module, split: TracedSplit) -> None:
    """Every parameter a stage holds is the model's own, but for the copies of a tie (``SplitRefusals.ties``)."""
    user = {id(t) for t in tensors_by_name(module).values()}
    copies = {(s, fqn) for where in getattr(split.pipe, "replicated_params", []) for s, fqn in where.items()}
    for k in range(split.num_chunks):
        for fqn, tensor in tensors_by_name(split.stage_module(k)).items():
            if isinstance(tensor, nn.Parameter) and id(tensor) not in user \
                    and (split.stages[k].submod, fqn) not in copies:
                raise ConfigError("plan.pp", f"{split.module_name}: stage {k} holds '{fqn}', which is not the "
                                  "model's own tensor, so training it would not update the model", "use pp=1")


@dataclass(frozen=True)
class SplitRefusals:
    """Which cuts of one traced split the chunks could not train as one device does, and the runtime's line for
    each: ``ties`` and ``crossings`` are spans ``(first, last, what)`` of chunk boundaries (a cut before chunk
    ``k``, ``first <= k <= last``) that a tied parameter (``what``: its name) or a non-tensor value (``what``: its
    type) crosses. From a trace cut before every unit (``split_refusals``) the planner knows every partition's
    outcome without tracing it again: ``at(cuts)`` is the refusal ``trace_split`` gives for those cuts."""

    name: str
    first_units: list[str]  # the first unit of each chunk
    ties: list[tuple[int, int, str]]
    crossings: list[tuple[int, int, str]]

    @classmethod
    def of(cls, split: TracedSplit) -> SplitRefusals:
        chunk_of = {wiring.submod: k for k, wiring in enumerate(split.stages)}
        ties = []
        for where in getattr(split.pipe, "replicated_params", []):
            chunks = [chunk_of[s] for s in where if s in chunk_of]
            if len(chunks) > 1:
                ties.append((min(chunks) + 1, max(chunks), next(iter(where.values()))))
        crossings, seen = [], set()
        for k in range(1, split.num_chunks):
            vals = _output_values(split, k - 1)
            for value in split.carried[k]:
                meta = vals.get(value)
                if value in seen or meta is None or isinstance(meta, torch.Tensor):
                    continue
                seen.add(value)
                last = max(j for j in range(k, split.num_chunks) if value in split.carried[j])
                crossings.append((k, last, type(meta).__name__))
        return cls(split.module_name, [u[0] for u in split.units], ties, crossings)

    def of_sizes(self, sizes: Sequence[int]) -> ConfigError | None:
        """The ConfigError for chunks of ``sizes`` units each (from a trace cut before every unit)."""
        from itertools import accumulate

        return self.at(list(accumulate(sizes))[:-1])

    def at(self, cuts: Sequence[int]) -> ConfigError | None:
        """The ConfigError for a split cut before each chunk in ``cuts`` (None: the chunks train as one device)."""
        cuts = sorted(cuts)
        for first, last, fqn in self.ties:
            if any(first <= k <= last for k in cuts):
                return ConfigError("plan.pp", f"{self.name}: parameter '{fqn}' is used on both sides of a split (a "
                                   "tie, or a module called from two chunks), and the split would copy it",
                                   "use pp=1, or keep the modules sharing it in one chunk")
        for k in cuts:
            kind = next((kind for first, last, kind in self.crossings if first <= k <= last), None)
            if kind is not None:
                return ConfigError("plan.pp", f"{self.name}: a {kind} value crosses the split before unit "
                                   f"'{self.first_units[k]}'; stages exchange tensors only",
                                   "use pp=1, or split at other units")
        return None


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


def tensors_by_name(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (every name of a shared tensor)."""
    out: dict[str, torch.Tensor] = {}
    out.update(dict(module.named_parameters(remove_duplicate=False)))
    out.update({k: v for k, v in module.named_buffers(remove_duplicate=False) if v is not None})
    return out


def same_program(a: TracedSplit, b: TracedSplit) -> bool:
    """Whether two traces compute the same thing (no mode-dependent module): same code in every (sub)graph."""

    def code(gm: nn.Module) -> list[str]:
        return [getattr(m, "code", "") or str(getattr(m, "graph", "")) for m in gm.modules()]

    return a.num_chunks == b.num_chunks and all(code(a.stage_module(k)) == code(b.stage_module(k))
                                                for k in range(a.num_chunks))


def split_refusals(module: nn.Module, example: Example, unit_fqns: Sequence[str]) -> SplitRefusals:
    """What refuses each cut of ``module`` at its units, from one trace cut before every unit; raises the
    ConfigError that refuses every split (export fails, a unit not called where the units' order says, ...)."""
    return SplitRefusals.of(trace_split(module, example, unit_fqns, [1] * len(unit_fqns), check_cuts=False))


def check_unit_count(module: nn.Module, unit_fqns: Sequence[str], chunks: int) -> None:
    """One ConfigError when ``module`` has fewer units than the pipeline has chunks."""
    if len(unit_fqns) < chunks:
        raise ConfigError("plan.pp", f"{type(module).__name__}: pp*vpp={chunks} exceeds its {len(unit_fqns)} "
                          "units", "use pp*vpp <= number of units")


def check_traced_pipeline(module: nn.Module, example: Example, unit_fqns: Sequence[str], pp: int,
                          vpp: int = 1, layers_per_stage: Sequence[int] | None = None) -> None:
    """Raise one ConfigError("plan.pp", ...) when ``module`` cannot be pipelined in ``pp * vpp`` chunks at its
    units through torch's tracer (the first line of export's reason is in the message), so the planner
    restricts pp to 1 and shows why. Traces the model in training mode without changing it (the eval-mode
    trace, made when the pipeline is built, refuses in the same way)."""
    if pp * vpp <= 1:
        return
    check_unit_count(module, unit_fqns, pp * vpp)
    sizes = chunk_sizes(len(unit_fqns), pp, vpp, layers_per_stage)
    trace_split(module, example, unit_fqns, sizes, train=True)



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
            raise ConfigError("DataLoader", f"{split.module_name}: input '{name}' has shape {tuple(leaf.shape)}, "
                              f"the pipeline trace fixed {tuple('*' if f is None else f for f in fixed)}",
                              "keep every input's shape (except the batch size where the model allows it) fixed, "
                              "or use pp=1")
    return leaves
