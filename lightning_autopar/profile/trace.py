"""The one meta forward: a model run on meta tensors (no memory, no compute), seen by small recorders.

Every analysis of the set-up path traces the model here, through ``meta_forward(model, call, recorders)``: the
model's parameters and buffers are swapped for meta tensors (``torch.func.functional_call``; ties kept), the
forward (and, when asked, a backward) runs under ``meta_friendly`` (what real code does that meta tensors refuse),
and each recorder adds what it sees to one typed ``Trace``:

* ``ModuleStack`` (always installed): the module forwards running at each moment, the modules called in order;
* ``ParameterUses``: which parameters the forward takes (the trainable ones it never took), and optionally the
  stack of module forwards at each use (what the data-parallel units need);
* ``BlockCost``: forward + backward FLOPs per module (``FlopCounterMode``) and the bytes saved for backward per
  block; ``OpCosts``: per stack of module forwards what its aten ops cost (FLOPs, memory-bound bytes, op count,
  kinds; the op tables and the dispatch mode in profile/op_costs.py), the storages saved for backward, each
  module's output bytes;
* ``Dataflow``: the attention calls (SDPA, eager attention's 4-D softmax) with their head geometry, how each
  projection uses its weight, the ops applied to a projection's output and, inside block 0, the dataflow between
  its projections and each module's first call (``Probe``);
* ``AttentionCalls``: per block, whether each SDPA call is causal by itself (context parallelism, SP's padding);
* ``Output``: what the forward returned (the SP dry run checks its shape);
* ``StageFlow`` (profile/stage_flow.py): where what runs before the blocks reaches them other than through the
  first block's hidden state (what a pipeline stage's zeros would change);
* ``StopAtModule``: the forward stops when a module is called (``StopAtCall``, the one stop-at-call exception,
  a BaseException so that a model's or a step's ``except Exception`` lets it through).

The trace never raises for the model's own code: ``Trace.failure`` is the reason (one line) it did not run.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves

from lightning_autopar.profile.meta_kernels import MetaKernelCache
from lightning_autopar.profile.meta_shims import collectives_seen, meta_friendly  # noqa: F401 (meta_friendly: re-exported)
from lightning_autopar.profile.op_costs import (ELEMENT_BYTES, OpCost, _CostMode, _nbytes,  # noqa: F401
                                                flop_formulas)


def implements_forward(module: nn.Module) -> bool:
    """A container (ModuleDict, ModuleList, ParameterList) inherits ``nn.Module.forward``, which raises."""
    return type(module).forward is not nn.Module.forward


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


# ------------------------------------------------------------------------------------------- the op recorder

_VIEW_OPS = frozenset({"split", "split_with_sizes", "chunk", "tensor_split", "unbind", "__getitem__", "view", "reshape",
                       "transpose", "permute", "contiguous", "narrow", "unflatten"})
_RIGHT_OPERAND = {"addmm": 2, "mm": 1, "matmul": 1, "__matmul__": 1}  # x @ W: the weight is stored [in, out]
_SOFTMAX = (torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax)
ATTENTION_MARK = "@attention:"  # a dataflow source: the output of an attention call in the module after it


def _summary(value: Any) -> Any:
    """Call arguments with tensors replaced by their shapes (kept for the layout rules, without the tensors)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return type(value)(_summary(v) for v in value)
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    return value


class _TraceRecorder(torch.overrides.TorchFunctionMode):
    """What the forward does, seen op by op:

    * ``calls``: the innermost module calling attention and the (heads, kv_heads, head_dim) it uses;
    * ``orientation``: for each traced weight, whether the code multiplies ``x @ W`` (stored [in, out]);
    * ``consumers``: the ops applied to a projection's output (how a fused qkv is split into q, k and v);
    * ``source(t)``: the projection a tensor is (a view of) the output of;
    * while block 0 runs (``flow_on``), the dataflow between its projections: ``flow_of(t)`` is the set of
      projections (and attention calls, ``ATTENTION_MARK`` + the calling module) whose outputs reach ``t``
      through any ops but another projection; ``attention_flow`` the sources of each attention call's q, k, v.
    """

    def __init__(self, stack: list[str], weights: dict[int, str] | None = None) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[tuple[str, int, int, int]] = []
        self.attn_seq = 0  # the query length of the first attention call: the model's sequence (a ViT's patches)
        self.weights = weights or {}
        self.orientation: dict[str, bool] = {}
        self.sources: dict[int, tuple[torch.Tensor, str, bool]] = {}  # id -> (tensor, projection, direct output)
        self.consumers: dict[str, list[tuple[str, tuple[int, ...], Any, Any]]] = {}
        self.flow_on = False
        self.flow: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}  # id -> (tensor, its sources)
        self.attention_flow: list[tuple[str, frozenset[str], frozenset[str], frozenset[str]]] = []

    def tag(self, tensor: Any, name: str, direct: bool = True) -> None:
        if isinstance(tensor, torch.Tensor):
            self.sources[id(tensor)] = (tensor, name, direct)
        elif isinstance(tensor, (list, tuple)):
            for t in tensor:
                self.tag(t, name, direct)

    def source(self, tensor: Any) -> tuple[str, bool] | None:
        entry = self.sources.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return (entry[1], entry[2]) if entry is not None and entry[0] is tensor else None

    def flow_of(self, value: Any) -> frozenset[str]:
        """The projections and attention calls whose outputs reach the tensors in ``value`` (nested)."""
        if isinstance(value, torch.Tensor):
            entry = self.flow.get(id(value))
            return entry[1] if entry is not None and entry[0] is value else frozenset()
        if isinstance(value, (list, tuple)):
            return frozenset().union(*(self.flow_of(v) for v in value))
        if isinstance(value, dict):
            return self.flow_of(list(value.values()))
        return frozenset()

    def mark(self, value: Any, sources: frozenset[str]) -> None:
        if isinstance(value, torch.Tensor):
            self.flow[id(value)] = (value, sources)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self.mark(v, sources)

    def _follow(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """Dataflow of one op inside block 0: an attention call (SDPA, or a 4-D softmax of eager attention)
        records where its q, k, v come from and marks its output as attention's; any other op passes its
        inputs' sources on."""
        sources = self.flow_of((args, kwargs))
        site = ATTENTION_MARK + (self.stack[-1] if self.stack else "")
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3:
            self.attention_flow.append((site[len(ATTENTION_MARK):], *(self.flow_of(a) for a in args[:3])))
            sources = frozenset({site})
        elif func in _SOFTMAX and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
            self.attention_flow.append((site[len(ATTENTION_MARK):], frozenset(), frozenset(), frozenset()))
            sources = sources | {site}  # with q and k: eager attention's o reads probs @ v
        if sources:
            self.mark(result, sources)

    def _weight_use(self, name: str, args: tuple) -> None:
        if name == "linear" and len(args) > 1 and id(args[1]) in self.weights:
            self.orientation.setdefault(self.weights[id(args[1])], False)
        pos = _RIGHT_OPERAND.get(name)
        if pos is not None and len(args) > pos and id(args[pos]) in self.weights:
            self.orientation.setdefault(self.weights[id(args[pos])], True)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3:
            q, k = args[0], args[1]
            if q.dim() == 4:
                self.calls.append((self.stack[-1] if self.stack else "", q.shape[1], k.shape[1], q.shape[-1]))
                self.attn_seq = self.attn_seq or int(q.shape[-2])
        elif func in _SOFTMAX and args:
            x = args[0]
            if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[-1] == x.shape[-2]:
                self.calls.append((self.stack[-1] if self.stack else "", x.shape[1], x.shape[1], 0))
                self.attn_seq = self.attn_seq or int(x.shape[-2])
        name = getattr(func, "__name__", "")
        if self.weights:
            self._weight_use(name, args)
        result = func(*args, **kwargs)
        if self.flow_on and args:
            self._follow(func, args, kwargs, result)
        origin = self.source(args[0]) if args and self.sources else None
        if origin is not None:
            if origin[1]:
                self.consumers.setdefault(origin[0], []).append(
                    (name, tuple(args[0].shape), _summary(args[1:]), _summary(kwargs)))
            if name in _VIEW_OPS:
                self.tag(result, origin[0], direct=False)
        return result


# ------------------------------------------------------------------------------------------- block 0's probe, stand-ins, the call


@dataclass
class Probe:
    """What the trace saw of block 0's modules, for the TP dry run: each module's first call (meta tensors) and
    its output shape, and the norms applied to (views of) a projection's output."""

    calls: dict[str, tuple[tuple, dict]] = field(default_factory=dict)  # module -> (args, kwargs)
    out_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    norm_inputs: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # norm -> (projection, width, weight)
    # dataflow (``_TraceRecorder.flow_of``): projection -> the sources of its input, in call order; and each
    # attention call's (calling module, sources of q, of k, of v) -- all empty for a softmax
    inputs: dict[str, frozenset[str]] = field(default_factory=dict)
    attention: list[tuple[str, frozenset[str], frozenset[str], frozenset[str]]] = field(default_factory=list)


def _stateless(value: Any) -> Any:
    """A recorded call argument without stateful objects (a KV cache the full run already appended to): those
    become None, which is what a training forward passes."""
    if value is None or isinstance(value, (torch.Tensor, int, float, bool, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_stateless(v) for v in value)
    if isinstance(value, dict):
        return {k: _stateless(v) for k, v in value.items()}
    return None


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return next((t for v in value if (t := _first_tensor(v)) is not None), None)
    return None


def _probe_hooks(model: nn.Module, block0: str, recorder: _TraceRecorder, probe: Probe) -> list[Any]:
    """Hooks on block 0 and its modules: record each first call, tag projection outputs, note norms of them;
    follow the dataflow between its projections while it runs."""
    handles = []
    for name, mod in model.named_modules():
        if name == block0:
            handles += _flow_switch(mod, recorder)
        if not (name == block0 or name.startswith(block0 + ".")):
            continue
        weight = getattr(mod, "weight", None)
        is_proj = isinstance(weight, torch.Tensor) and weight.dim() == 2 and not list(mod.children())
        is_norm = isinstance(weight, torch.Tensor) and weight.dim() == 1 and not list(mod.children())

        def pre(mod, args, kwargs, name=name, is_norm=is_norm, is_proj=is_proj):
            if name not in probe.calls:
                probe.calls[name] = (_stateless(args), _stateless(kwargs))
            origin = recorder.source(args[0]) if is_norm and args else None
            if origin is not None:
                probe.norm_inputs.setdefault(name, (origin[0], args[0].shape[-1], mod.weight.numel()))
            if is_proj and args and recorder.flow_on:
                probe.inputs.setdefault(name, recorder.flow_of(args[0]))

        def post(mod, args, out, name=name, is_proj=is_proj):
            first = _first_tensor(out)
            if first is not None:
                probe.out_shapes.setdefault(name, tuple(first.shape))
            if is_proj and isinstance(out, torch.Tensor):
                recorder.tag(out, name)
                if recorder.flow_on:
                    recorder.mark(out, frozenset({name}))

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    return handles


def _flow_switch(block: nn.Module, recorder: _TraceRecorder) -> list[Any]:
    """Follow the dataflow only while ``block`` (block 0) runs: what happens after it is not needed, and
    following every op of the whole model would slow the trace down."""

    def on(mod: nn.Module, args: tuple) -> None:
        recorder.flow_on = True

    def off(mod: nn.Module, args: tuple, out: Any) -> None:
        recorder.flow_on = False
        recorder.flow.clear()

    return [block.register_forward_pre_hook(on), block.register_forward_hook(off, always_call=True)]


@contextmanager
def blocks_stand_in_on_failure(blocks: list[nn.Module], failures: list[str]) -> Iterator[None]:
    """A block whose forward cannot run on meta tensors (data-dependent routing: ``nonzero``, ``torch.where`` with
    one argument) returns its input (a block maps hidden states to hidden states of the same shape), so a meta
    trace still sees everything else, including what the block ran before it failed (its attention, for an MoE
    block); ``failures`` collects why."""

    def guarded(original: Any):
        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 -- data-dependent ops have no meta kernel
                failures.append(first_line(err))
                return args[0] if args else next(iter(kwargs.values()))
        return forward

    own = [block.__dict__.get("forward") for block in blocks]  # a forward set on the instance, if any
    try:
        for block in blocks:
            block.forward = guarded(block.forward)
        yield
    finally:
        for block, previous in zip(blocks, own):
            if previous is None:
                del block.forward
            else:
                block.forward = previous


def first_line(err: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(err).splitlines()[0][:120] if str(err) else ""
    return f"{type(err).__name__}: {text}"


Example = tuple[tuple, dict]  # (args, kwargs) of a real call of the model


def meta_example(example: Example, rows: int | None = None) -> Example:
    """A model call's (args, kwargs) for a meta trace: every tensor moved to the meta device, cut to ``rows`` rows
    along dim 0 when given (the batch dimension: sizes per sample with ``rows=1``); containers (tuples, named
    tuples, lists, dicts) are walked, anything else passes as is. The one converter every meta trace uses."""
    from torch.utils._pytree import tree_map

    def convert(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        cut = value[:rows] if rows is not None and value.dim() else value
        return torch.empty_like(cut.detach(), device="meta")

    args, kwargs = example
    return tuple(tree_map(convert, tuple(args))), dict(tree_map(convert, dict(kwargs)))


def meta_buffer(buffer: torch.Tensor) -> torch.Tensor:
    """A buffer's stand-in for a meta trace: a meta tensor, except a real scalar counter (BatchNorm with
    momentum=None reads num_batches_tracked's value, which a meta tensor cannot give)."""
    counter = buffer.dim() == 0 and not buffer.is_floating_point() and buffer.device.type != "meta"
    return buffer.clone() if counter else torch.empty_like(buffer, device="meta")


def token_ids(batch: int, seq_len: int) -> Example:
    """A call on token ids of shape (batch, seq_len), on the meta device."""
    return (torch.zeros(batch, seq_len, dtype=torch.long, device="meta"),), {}


@dataclass
class MetaState:
    """What ``functional_call`` gets for a meta forward of a model: its parameters and buffers as meta tensors
    (one meta tensor per Parameter object: ties kept), and the names of each parameter (``id`` of its meta
    tensor -> its names, below ``prefix``)."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    names: dict[int, list[str]]
    trainable: list[str] = field(default_factory=list)  # names of the parameters requiring a gradient

    @classmethod
    def of(cls, model: nn.Module, every_name: bool = False, prefix: str = "") -> MetaState:
        """``every_name``: every name a Parameter is reachable under (``remove_duplicate=False``), each tied one
        listing all of them; otherwise the first name of each, keeping ``requires_grad``."""
        names: dict[int, list[str]] = defaultdict(list)
        if not every_name:
            params = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                      for n, p in model.named_parameters()}
            for n, t in params.items():
                names[id(t)].append(_join(prefix, n))
            return cls(params, {n: meta_buffer(b) for n, b in model.named_buffers()}, dict(names),
                       [_join(prefix, n) for n, t in params.items() if t.requires_grad])
        meta: dict[int, torch.Tensor] = {}
        params = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in meta:
                meta[id(p)] = torch.empty_like(p, device="meta")
            names[id(meta[id(p)])].append(_join(prefix, n))
            params[n] = meta[id(p)]
        buffers = {n: meta_buffer(b) for n, b in model.named_buffers(remove_duplicate=False)}
        return cls(params, buffers, dict(names))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.params, **self.buffers}


# ------------------------------------------------------------------------------------------- the trace


class StopAtCall(BaseException):
    """Stops a forward (or a training step) when a module is called, carrying that call. A BaseException, so the
    user's ``except Exception`` lets it through."""

    def __init__(self, fqn: str, args: tuple, kwargs: dict) -> None:
        super().__init__(fqn)
        self.fqn, self.args, self.kwargs = fqn, args, kwargs


@dataclass
class Trace:
    """What one meta forward saw. Module names are relative to the traced model (below ``prefix`` when given).
    ``failure``: why the forward did not run (one line), None when it did; the recorders' fields are filled only
    when it ran (or stopped at ``StopAtModule``'s module: ``stopped``)."""

    failure: str | None = None
    error: BaseException | None = field(default=None, repr=False, compare=False)
    called: list[str] = field(default_factory=list)  # modules whose forward ran, in first-call order
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # module -> (first, last) call, in call order
    # ParameterUses: trainable parameters never taken; per parameter name, the stacks running at its uses
    unused: list[str] = field(default_factory=list)
    uses: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    # Dataflow: per attention call (calling module, heads, kv_heads, head_dim); the first call's query length
    attention: list[tuple[str, int, int, int]] = field(default_factory=list)
    attn_seq: int = 0
    orientation: dict[str, bool] = field(default_factory=dict)  # projection -> weight stored [in, out]
    consumers: dict[str, list[tuple[str, tuple[int, ...], Any, Any]]] = field(default_factory=dict)
    probe: Probe | None = None
    # BlockCost: forward + backward FLOPs per asked module, bytes saved for backward per block, the total
    flops: dict[str, float] = field(default_factory=dict)
    saved: dict[str, float] = field(default_factory=dict)
    total_flops: float = 0.0
    # OpCosts: per stack of module forwards (outermost first) what its ops cost; output bytes per module
    costs: dict[tuple[str, ...], OpCost] = field(default_factory=dict)
    outputs: dict[str, float] = field(default_factory=dict)
    output_shape: tuple[int, ...] | None = None  # the forward's first output tensor
    stood_in: list[str] = field(default_factory=list)  # why blocks stood in as identity (``stand_in``)
    stopped: StopAtCall | None = field(default=None, repr=False)
    # AttentionCalls: per block, whether each SDPA call it made was causal by itself; Output: what forward returned
    sdpa: dict[str, list[bool]] = field(default_factory=dict)
    dropout: bool = False  # DropoutCalls: a block dropped out values with p > 0
    output: Any = field(default=None, repr=False, compare=False)
    # the model's own torch.distributed calls ("torch.distributed.all_reduce in 'blocks.0.mlp'"), in call order,
    # once each: seen, not run (``meta_shims.collectives_seen``)
    collectives: list[str] = field(default_factory=list)
    # Routing (profile/routing.py): the MoE layers, each a router's selection and the experts it feeds
    routing: list[Any] = field(default_factory=list)
    # StageFlow (profile/stage_flow.py): where a value computed before the blocks reaches them (or what follows
    # them) other than through the first block's hidden state, one line each
    carried: list[str] = field(default_factory=list)

    @property
    def order(self) -> dict[str, int]:
        """The called modules -> their first-call index."""
        return {n: i for i, n in enumerate(self.called)}

    def relative(self, prefix: str) -> Trace:
        """The trace of an ancestor with module names made relative to its descendant at ``prefix`` (the
        analysed model): the prefix dropped, parameter uses, orientations and consumers outside it left out."""
        if not prefix:
            return self
        cut = len(prefix) + 1

        def rel(name: str) -> str:
            if name.startswith(ATTENTION_MARK):
                return ATTENTION_MARK + rel(name[len(ATTENTION_MARK):])
            return name[cut:] if name.startswith(prefix + ".") else name

        def rels(names: frozenset[str]) -> frozenset[str]:
            return frozenset(rel(n) for n in names)

        inside = prefix + "."
        probe = self.probe or Probe()
        return Trace(
            failure=self.failure, error=self.error, called=[rel(n) for n in self.called],
            spans={rel(k): v for k, v in self.spans.items()},
            unused=[rel(n) for n in self.unused if n.startswith(inside)],
            uses={rel(k): v for k, v in self.uses.items() if k.startswith(inside)},
            attention=[(rel(site), *rest) for site, *rest in self.attention], attn_seq=self.attn_seq,
            orientation={rel(k): v for k, v in self.orientation.items() if k.startswith(inside)},
            consumers={rel(k): v for k, v in self.consumers.items() if k.startswith(inside)},
            probe=Probe(calls={rel(k): v for k, v in probe.calls.items()},
                        out_shapes={rel(k): v for k, v in probe.out_shapes.items()},
                        norm_inputs={rel(k): (rel(src), w, n) for k, (src, w, n) in probe.norm_inputs.items()},
                        inputs={rel(k): rels(v) for k, v in probe.inputs.items()},
                        attention=[(rel(site), *(rels(v) for v in qkv)) for site, *qkv in probe.attention]),
            flops={rel(k): v for k, v in self.flops.items()}, saved={rel(k): v for k, v in self.saved.items()},
            total_flops=self.total_flops, costs=self.costs, outputs=self.outputs, output_shape=self.output_shape,
            stood_in=self.stood_in, stopped=self.stopped, sdpa={rel(k): v for k, v in self.sdpa.items()},
            dropout=self.dropout, output=self.output,
            routing=[r.relative(rel) for r in self.routing if r.router.startswith(inside)], carried=self.carried)


# ------------------------------------------------------------------------------------------- recorders


@dataclass
class Run:
    """One meta forward in progress, as recorders see it: the model, its meta state, the module stack."""

    model: nn.Module
    state: MetaState
    stack: ModuleStack


class Recorder:
    """Something a meta forward records: module hooks (``hooks``, registered before the forward, removed after
    it), modes or hooks to run the forward under (``contexts``), and what it saw, put into the trace once the
    forward ran (``finish``)."""

    def hooks(self, run: Run) -> list[Any]:
        return []

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        return []

    def finish(self, run: Run, trace: Trace) -> None:
        pass


class ModuleStack(Recorder):
    """The stack of module forwards running (``stack``, outermost first; ``key`` as a tuple), the modules
    called, in first-call order, and each one's first and last call among all calls (``Trace.spans``: what runs
    before, among or after a stack of blocks). ``every_name``: a module registered under several names is pushed
    under each."""

    def __init__(self, prefix: str = "", every_name: bool = False) -> None:
        self.prefix, self.every_name = prefix, every_name
        self.stack: list[str] = []
        self.key: tuple[str, ...] = ()
        self.order: dict[str, int] = {}
        self.spans: dict[str, tuple[int, int]] = {}
        self.calls = 0

    def push(self, name: str) -> None:
        self.order.setdefault(name, len(self.order))
        self.spans[name] = (self.spans.get(name, (self.calls,))[0], self.calls)
        self.calls += 1
        self.stack.append(name)
        self.key = tuple(self.stack)

    def pop(self) -> None:
        self.stack.pop()
        self.key = tuple(self.stack)

    def hooks(self, run: Run) -> list[Any]:
        handles = []
        for name, mod in run.model.named_modules(remove_duplicate=not self.every_name):
            full = _join(self.prefix, name)
            handles.append(mod.register_forward_pre_hook(lambda mod, args, full=full: self.push(full)))
            # pops after a failure too
            handles.append(mod.register_forward_hook(lambda mod, args, out: self.pop(), always_call=True))
        return handles

    def finish(self, run: Run, trace: Trace) -> None:
        trace.called = list(self.order)
        trace.spans = dict(self.spans)


_FLAT = (torch.Tensor, int, float, bool, str, type(None))


def _leaves(args: tuple, kwargs: dict) -> Any:
    """``tree_leaves((args, kwargs))``: the arguments themselves when each is a tensor or a plain value (most
    calls; a subclass of those types, a namedtuple or another pytree node goes through ``tree_leaves``)."""
    if not kwargs and all(type(a) in _FLAT or type(a) is nn.Parameter for a in args):
        return args
    return tree_leaves((args, kwargs))


# a tensor's attributes that describe it without reading its values: reading one is no use of a parameter
# (``self.proj.weight.dtype`` in a ViT's forward, outside the projection's module)
METADATA = frozenset({"dtype", "shape", "device", "ndim", "layout", "requires_grad", "is_leaf", "is_meta",
                      "is_cuda", "is_cpu", "is_sparse", "is_quantized", "names", "itemsize", "nbytes"})


def _reads_metadata(func: Any) -> bool:
    """``func`` is the getter of a tensor attribute in ``METADATA``."""
    return getattr(getattr(func, "__self__", None), "__name__", None) in METADATA


class ParameterUses(Recorder, torch.overrides.TorchFunctionMode):
    """The parameters any torch function of the forward takes (by every name of the parameter); the trainable
    ones it never took (``Trace.unused``; none known when a block stood in: it did not run to its end) and, with
    ``stacks``, per parameter name the stacks of module forwards running at its uses (``Trace.uses``). Reading a
    parameter's metadata (its dtype, shape, device: ``METADATA``) is no use."""

    def __init__(self, stacks: bool = False) -> None:
        torch.overrides.TorchFunctionMode.__init__(self)
        self.stacks = stacks
        self.run: Run | None = None
        self.names: dict[int, list[str]] = {}
        self.used: set[str] = set()
        self.uses: dict[str, list[tuple[str, ...]]] = defaultdict(list)

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        self.run, self.names = run, run.state.names
        return [self]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_metadata(func):
            return func(*args, **kwargs)
        names = self.names
        for leaf in _leaves(args, kwargs):
            found = names.get(id(leaf))  # the meta tensors are alive: no other object has their id
            if not found:
                continue
            self.used.update(found)
            if self.stacks:
                here = self.run.stack.key
                for name in found:  # under every name of the parameter: ties share the list of uses
                    if here not in self.uses[name]:
                        self.uses[name].append(here)
        return func(*args, **kwargs)

    def finish(self, run: Run, trace: Trace) -> None:
        trace.unused = [] if trace.stood_in else [n for n in run.state.trainable if n not in self.used]
        trace.uses = dict(self.uses)


_COUNTER: list[Any] = []  # the counter class, made once


def _flop_counter() -> Any:
    """``FlopCounterMode(display=False)`` whose dispatch mode skips what its ``__torch_dispatch__`` tries first
    for every op, ``func.decompose`` under the mode re-entered, for the ops that have no CompositeImplicitAutograd
    kernel (where it returns NotImplemented): the same counts, without a mode push and pop per op. Built on
    torch's private ``_FlopCounterMode`` (torch 2.13: ``FlopCounterMode.__enter__`` makes one, ``counter`` its
    FlopCounterMode); any other torch gets the plain FlopCounterMode."""
    if _COUNTER:
        return _COUNTER[0](display=False)
    from torch.utils import flop_counter

    inner = getattr(flop_counter, "_FlopCounterMode", None)
    if inner is None or not hasattr(flop_counter.FlopCounterMode, "_count_flops"):
        return flop_counter.FlopCounterMode(display=False)
    from torch._ops import HigherOrderOperator

    from lightning_autopar.profile.op_costs import SKIPPED_OPS

    class Mode(inner):
        plain: dict[Any, bool] = {}  # op -> runs and is counted at once (no decomposition to try)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            plain = self.plain.get(func)
            if plain is None:
                plain = self.plain[func] = func not in SKIPPED_OPS and not isinstance(func, HigherOrderOperator) \
                    and (func is torch.ops.prim.device.default or not func._can_decompose())
            if not plain:
                return super().__torch_dispatch__(func, types, args, kwargs)
            kwargs = kwargs or {}
            return self.counter._count_flops(func._overloadpacket, func(*args, **kwargs), args, kwargs)

    class Counter(flop_counter.FlopCounterMode):
        def __enter__(self) -> Any:
            self.flop_counts.clear()
            self.mod_tracker.__enter__()
            self.mode = Mode(self)
            self.mode.__enter__()
            return self

    _COUNTER.append(Counter)
    return Counter(display=False)


class BlockCost(Recorder):
    """Forward + backward FLOPs of each module in ``modules`` (``FlopCounterMode``), the total, and the bytes
    autograd saves while each of them runs (the innermost of them running)."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.saved = {f: 0.0 for f in modules}
        self.counter: Any = None

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        stack = run.stack.stack

        def pack(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                block = next((n for n in reversed(stack) if n in self.saved), None)
                if block is not None:
                    self.saved[block] += t.numel() * t.element_size()
            return t

        self.counter = _flop_counter()
        return [self.counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)]

    def finish(self, run: Run, trace: Trace) -> None:
        counts = self.counter.get_flop_counts()
        root = type(run.model).__name__
        trace.flops = {f: float(sum(counts.get(f"{root}.{f}", {}).values())) for f in self.saved}
        trace.total_flops = float(self.counter.get_total_flops())
        trace.saved = dict(self.saved)


class OpCosts(Recorder):
    """Per stack of module forwards, what its aten ops cost (``OpCost``: FLOPs as ``FlopCounterMode`` counts them,
    memory-bound bytes, op count, kinds, bytes saved for backward -- each storage once, parameters and buffers
    excluded), and each module's output bytes summed over its calls."""

    def __init__(self) -> None:
        self.costs: dict[tuple[str, ...], OpCost] = defaultdict(OpCost)
        self.outputs: dict[str, float] = defaultdict(float)
        self.stack: ModuleStack | None = None

    def here(self) -> OpCost:
        return self.costs[self.stack.key]

    def hooks(self, run: Run) -> list[Any]:
        def post(mod: nn.Module, args: Any, out: Any, name: str) -> None:
            leaves = tree_flatten(out)[0]
            self.outputs[name] += sum(_nbytes(t) for t in leaves if isinstance(t, torch.Tensor))

        return [mod.register_forward_hook(lambda m, a, o, name=_join(run.stack.prefix, name): post(m, a, o, name))
                for name, mod in run.model.named_modules()]

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        self.stack = run.stack
        state_storages = {t.untyped_storage()._cdata for t in run.state.tensors().values()}
        seen: set[int] = set()

        def pack(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in seen and key not in state_storages:
                    seen.add(key)
                    self.here().saved_bytes += _nbytes(t, storage.nbytes() // max(t.element_size(), 1))
            return t

        return [torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _CostMode(self)]

    def finish(self, run: Run, trace: Trace) -> None:
        trace.costs, trace.outputs = self.costs, self.outputs


class Dataflow(Recorder):
    """The op recorder (``_TraceRecorder``): attention calls, weight orientation (``weights``: of the 2-D
    ``.weight`` parameters), the ops on projection outputs; with ``block0``, its modules' first calls, output
    shapes, norms of projection outputs and the dataflow between its projections (``Probe``)."""

    def __init__(self, block0: str | None = None, weights: bool = False) -> None:
        self.block0, self.weights = block0, weights
        self.recorder: _TraceRecorder | None = None
        self.probe = Probe()

    def hooks(self, run: Run) -> list[Any]:
        weights = {id(t): n[: -len(".weight")] for n, t in run.state.params.items()
                   if n.endswith(".weight") and t.dim() == 2} if self.weights else None
        self.recorder = _TraceRecorder(run.stack.stack, weights)
        return _probe_hooks(run.model, self.block0, self.recorder, self.probe) if self.block0 else []

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        return [self.recorder]

    def finish(self, run: Run, trace: Trace) -> None:
        r = self.recorder
        self.probe.attention = list(r.attention_flow)
        trace.attention, trace.attn_seq, trace.orientation, trace.consumers = r.calls, r.attn_seq, r.orientation, \
            r.consumers
        trace.probe = self.probe


def causal_call(args: tuple, kwargs: dict) -> bool:
    """An SDPA call (``query, key, value, attn_mask, dropout_p, is_causal``) causal by itself: is_causal, no mask."""
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    return bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False)) and mask is None


class AttentionCalls(Recorder):
    """Per block of ``blocks`` (path -> module), whether each ``F.scaled_dot_product_attention`` call made while it
    is the innermost of them running is causal by itself (``causal_call``): ``Trace.sdpa``, blocks calling none
    absent. Records through ``F.scaled_dot_product_attention`` itself, swapped while the forward runs."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        self.blocks, self.current, self.calls = blocks, [], {}

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.current.pop()

    def hooks(self, run: Run) -> list[Any]:
        return [h for fqn, block in self.blocks.items() for h in (
            block.register_forward_pre_hook(lambda m, a, fqn=fqn: self.current.append(fqn)),
            block.register_forward_hook(self.leave, always_call=True))]

    @contextmanager
    def _recording(self) -> Iterator[None]:
        import torch.nn.functional as F

        original = F.scaled_dot_product_attention

        def recording(*args: Any, **kwargs: Any) -> Any:
            if self.current:
                self.calls.setdefault(self.current[-1], []).append(causal_call(args, kwargs))
            return original(*args, **kwargs)

        F.scaled_dot_product_attention = recording
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        return [self._recording()]

    def finish(self, run: Run, trace: Trace) -> None:
        trace.sdpa = self.calls


_DROPOUTS = {torch.nn.functional.dropout, torch.nn.functional.alpha_dropout,
             torch.nn.functional.feature_alpha_dropout, torch.dropout, torch.alpha_dropout, torch.feature_alpha_dropout}


class DropoutCalls(Recorder, torch.overrides.TorchFunctionMode):
    """Whether a block of ``blocks`` drops out values with p > 0 while it runs (``F.dropout`` and its kin, as
    ``nn.Dropout`` calls them or the code does itself; training or not): ``Trace.dropout``. The masks such a call
    keeps for backward are part of a block's activations (planner.cost_memory.sp_replicated_elements); Llama-style
    blocks have none."""

    def __init__(self, blocks: Sequence[str]) -> None:
        super().__init__()
        self.blocks, self.found = frozenset(blocks), False
        self.stack: list[str] = []

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        self.stack = run.stack.stack
        return [self]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS and not self.found and any(n in self.blocks for n in self.stack):
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            self.found = isinstance(p, (int, float)) and p > 0
        return func(*args, **kwargs)

    def finish(self, run: Run, trace: Trace) -> None:
        trace.dropout = self.found


class Output(Recorder):
    """What the model's forward returned, as it returned it (``Trace.output``)."""

    def hooks(self, run: Run) -> list[Any]:
        return [run.model.register_forward_hook(lambda m, a, out: setattr(self, "out", out))]

    def finish(self, run: Run, trace: Trace) -> None:
        trace.output = self.out


class StopAtModule(Recorder):
    """Stops the forward when ``module`` (named ``fqn``) is called, before its other hooks: ``Trace.stopped``
    holds the call."""

    def __init__(self, module: nn.Module, fqn: str = "") -> None:
        self.module, self.fqn = module, fqn

    def hooks(self, run: Run) -> list[Any]:
        def stop(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            raise StopAtCall(self.fqn, args, kwargs)

        return [self.module.register_forward_pre_hook(stop, with_kwargs=True, prepend=True)]


# ------------------------------------------------------------------------------------------- the meta forward


def _loss_of(out: Any) -> torch.Tensor:
    """What the backward starts from: the output, its logits, or its first element."""
    return out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out[0])


def meta_forward(model: nn.Module, call: Example, recorders: Sequence[Recorder] = (), *, backward: bool = False,
                 grad: bool | None = None, state: dict[str, torch.Tensor] | None = None, every_name: bool = False,
                 prefix: str = "", stand_in: Sequence[nn.Module] = ()) -> Trace:
    """Run ``model`` on ``call`` (its (args, kwargs), already on the meta device: ``meta_example``,
    ``token_ids``) with every parameter and buffer swapped for a meta tensor (``MetaState``; ``state``: the
    tensors to use instead, e.g. one TP rank's local shapes), under ``meta_friendly`` and the ``recorders``; with
    ``backward``, a backward from the output's sum. ``grad``: the grad mode to run in (None: the caller's).
    ``stand_in``: blocks that return their input where their forward cannot run on meta tensors
    (``blocks_stand_in_on_failure``; ``Trace.stood_in`` says why). ``prefix``/``every_name``: how modules and
    parameters are named (``ModuleStack``). Never raises for the model's code: ``Trace.failure`` says why it did
    not run."""
    from torch.func import functional_call

    meta = MetaState.of(model, every_name, prefix) if state is None else MetaState(state, {}, {})
    stack = ModuleStack(prefix, every_name)
    run = Run(model, meta, stack)
    everything = [stack, *recorders]
    trace = Trace()
    handles: list[Any] = []
    try:
        for recorder in everything:
            handles += recorder.hooks(run)
        # every recorder's contexts made before any is entered: none sees another's set-up
        contexts = [context for recorder in everything for context in recorder.contexts(run)]
        with ExitStack() as es:
            es.enter_context(nullcontext() if grad is None else torch.enable_grad() if grad else torch.no_grad())
            es.enter_context(MetaKernelCache())  # the innermost dispatch mode: the recorders' modes see every op
            for context in contexts:
                es.enter_context(context)
            es.enter_context(meta_friendly(model))
            es.enter_context(collectives_seen(stack, trace.collectives))
            es.enter_context(blocks_stand_in_on_failure(list(stand_in), trace.stood_in))
            out = functional_call(model, meta.tensors(), call[0], call[1], strict=False, tie_weights=True)
            if backward:
                _loss_of(out).float().sum().backward()
        first = _first_tensor(out)
        trace.output_shape = None if first is None else tuple(first.shape)
        for recorder in everything:
            recorder.finish(run, trace)
        del out  # held until here: saved storages stay alive, so no storage id is reused while counting
    except StopAtCall as stopped:
        trace.stopped = stopped
    except Exception as err:  # noqa: BLE001 -- the model's code not running on meta tensors is the answer
        trace.error, trace.failure = err, first_line(err)
    finally:
        for h in handles:
            h.remove()
    return trace
