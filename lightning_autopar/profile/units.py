"""Any ``nn.Module`` described as units: the unit form of ModelSpec (ARCHITECTURE.md, contract additions).

The transformer analysis (``analyze.py``) needs a stack of attention blocks; a ResNet, a U-Net or a plain CNN has
none. Here one forward of the model on meta tensors (no memory, no compute; the user's example cut to one row, so
every size is per sample) records, per stack of running module forwards, what its aten ops cost:

* FLOPs with ``torch.utils.flop_counter``'s formulas, decomposing as ``FlopCounterMode`` does, so a unit's number
  equals ``FlopCounterMode``'s for that module on real tensors (on CPU real tensors SDPA runs a kernel the
  registry lacks; ``flop_formulas()`` supplies it, and a meta trace runs SDPA's math path anyway);
* bytes read and written by the memory-bound ops (everything but matmul, conv and attention kernels; views move
  nothing), and the number of ops, each paying the device's per-kernel overhead;
* bytes autograd saves for backward (saved-tensor pack hooks fire during the forward, so no backward is run),
  each storage counted once, parameters excluded;
* what the ops are (norms, pooling, 4-D softmax / SDPA = attention).

Units are then chosen top-down from the modules whose forward ran: a module is split while it holds more than
1/16 of the model's FLOPs or parameters (or contains repeated blocks) and has at least two children doing work
(holding parameters or FLOPs), or one and no work of its own. A repeated block -- an element of a ModuleList /
Sequential in which >= 2 elements of one class have the same parameter shapes (ResNet's bottleneck layers, a
transformer's layers) -- is never split. A tied parameter stays inside one unit: the smallest called module
enclosing every module holding it. What no unit covers (the root's own parameters, a tie whose enclosing module is
the model, a U-Net's ``cat`` in the root forward, parameter-free modules such as pooling between units) becomes one
extra spec unit named ``(rest)``, listed last. Sizes come from the meta trace: SDPA runs its math path there, so
attention's saved bytes are those of unfused attention.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_autopar.errors import ConfigError
from lightning_autopar.profile.analyze import (BlockInfo, ModelAnalysis, ParameterUses, analyze, find_block_list, first_line,
                                               implements_forward, meta_buffer, meta_example,
                                               meta_friendly)
from lightning_autopar.specs import UNIT_KINDS, ModelSpec, UnitSpec

REST = "(rest)"  # the spec unit holding what no module unit covers
DOMINANT_SHARE = 0.9  # a child doing this share of its parent's FLOPs makes the parent one unit
UNIT_SHARE = 1 / 16  # a module holding more than this share of FLOPs or parameters is split further
ELEMENT_BYTES = 4  # unit sizes are counted at 4-byte elements (the planner scales to the plan's precision)
META_FIX = ("make its forward run on meta tensors (no data-dependent ops such as nonzero() or .item()), "
            "or describe the model by units in a model spec YAML (units: ...)")

aten = torch.ops.aten

# ------------------------------------------------------------------------------------------- the model call


@dataclass
class ModelCall:
    """The module a training step runs and the call it makes (real tensors, as the step passed them)."""

    fqn: str  # relative to the root given to find_model_call ("" for the root itself)
    module: nn.Module
    args: tuple
    kwargs: dict


class _ModelCalled(BaseException):
    """Stops the step at the model's first forward. A BaseException, so a step's ``except Exception`` lets it
    through."""

    def __init__(self, fqn: str, args: tuple, kwargs: dict) -> None:
        super().__init__(fqn)
        self.fqn, self.args, self.kwargs = fqn, args, kwargs


def find_model_call(root: nn.Module, step: Callable[[], Any]) -> ModelCall:
    """Run ``step`` (e.g. ``partial(lit.training_step, batch, 0)``) without gradients until the first forward of
    a parameter-holding module under ``root`` starts (``root`` itself when the step calls ``self(x)``, else the
    child it calls, e.g. ``self.model(pixel_values=...)``), and return that module and its arguments. Modules
    holding no parameters (a normaliser, a loss) are passed over: they are not the model to parallelise. The
    step never gets further than that call, so it costs one call's preparation, not a step."""
    names = {id(m): n for n, m in root.named_modules()}

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if next(mod.parameters(), None) is not None:
            raise _ModelCalled(names[id(mod)], args, kwargs)

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in root.modules()]
    try:
        with torch.no_grad():
            step()
    except _ModelCalled as found:
        return ModelCall(found.fqn, root.get_submodule(found.fqn), tuple(found.args), dict(found.kwargs))
    except Exception as err:  # noqa: BLE001 -- the user's step failed before calling its model
        raise ConfigError("training_step", f"raised before calling a module ({first_line(err)})",
                          "make the step run on the example batch") from None
    finally:
        for h in handles:
            h.remove()
    raise ConfigError("training_step", f"never called a module of {type(root).__name__} holding parameters",
                      "call the model in training_step (e.g. self(x) or self.model(x))")


# ------------------------------------------------------------------------------------------- the meta trace


def _cpu_sdpa_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """SDPA's CPU kernel, missing from torch's registry: the same count as the other SDPA kernels."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def flop_formulas() -> dict[Any, Any]:
    """FLOP formulas beyond torch's registry, as ``FlopCounterMode(custom_mapping=...)`` takes them."""
    return {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop}


def _registry() -> dict[Any, Any]:
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    return {**flop_registry, **{k: shape_wrapper(v) for k, v in flop_formulas().items()}}


CONV_OPS = {aten.convolution, aten._convolution, aten.cudnn_convolution, aten.convolution_overrideable,
            aten._slow_conv2d_forward}
# what FlopCounterMode leaves to the tensor subclass (nested tensors); never counted
SKIPPED_OPS = {aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
               aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default, aten.size.default,
               aten.sym_size.default, aten.stride.default, aten.sym_stride.default, aten.storage_offset.default,
               aten.sym_storage_offset.default, aten.numel.default, aten.sym_numel.default, aten.dim.default,
               torch.ops.prim.layout.default}
FREE_OPS = {aten._unsafe_view.default, aten.lift_fresh.default}  # metadata only, though not marked as views
OP_KINDS = {"native_batch_norm": "batchnorm", "_native_batch_norm_legit": "batchnorm",
            "_native_batch_norm_legit_no_training": "batchnorm", "cudnn_batch_norm": "batchnorm",
            "native_group_norm": "groupnorm", "native_layer_norm": "layernorm", "_fused_rms_norm": "norm",
            "embedding": "embedding", "convolution": "conv"}


def _op_kind(name: str) -> str | None:
    if "pool" in name:
        return "pool"
    if name.startswith("_scaled_dot_product") or name in ("_flash_attention_forward", "_efficient_attention_forward"):
        return "attention"
    return OP_KINDS.get(name)


def _nbytes(t: torch.Tensor, numel: int | None = None) -> int:
    """Bytes at 4-byte elements for floating tensors (the planner scales to the plan's precision), as they are
    for masks and indices."""
    n = t.numel() if numel is None else numel
    return n * (ELEMENT_BYTES if t.is_floating_point() else t.element_size())


@dataclass
class _Cost:
    """What the ops run under one stack of module forwards cost (forward, per sample)."""

    flops: float = 0.0
    conv_flops: float = 0.0
    memory_bytes: float = 0.0
    ops: int = 0
    saved_bytes: float = 0.0
    kinds: set[str] = field(default_factory=set)

    def add(self, other: _Cost) -> None:
        self.flops += other.flops
        self.conv_flops += other.conv_flops
        self.memory_bytes += other.memory_bytes
        self.ops += other.ops
        self.saved_bytes += other.saved_bytes
        self.kinds |= other.kinds


@dataclass
class _Trace:
    """One meta forward: the modules called (first-call order), costs per stack of running module forwards
    (outermost first, "" = the model), each module's output bytes (summed over its calls)."""

    order: dict[str, int] = field(default_factory=dict)
    costs: dict[tuple[str, ...], _Cost] = field(default_factory=lambda: defaultdict(_Cost))
    outputs: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    stack: list[str] = field(default_factory=list)
    key: tuple[str, ...] = ()
    failure: str = ""
    unused: list[str] = field(default_factory=list)  # trainable parameters the forward never took

    def push(self, name: str) -> None:
        self.order.setdefault(name, len(self.order))
        self.stack.append(name)
        self.key = tuple(self.stack)

    def pop(self) -> None:
        self.stack.pop()
        self.key = tuple(self.stack)

    def here(self) -> _Cost:
        return self.costs[self.key]


class _CostMode(TorchDispatchMode):
    """Charges each aten op to the stack of module forwards running it: FLOPs as FlopCounterMode counts them
    (same formulas, same decomposition), memory-bound bytes, op count and kinds."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace
        self.registry = _registry()
        self.kinds: dict[Any, str | None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SKIPPED_OPS:
            return NotImplemented
        if func is not torch.ops.prim.device.default:
            with self:
                r = func.decompose(*args, **kwargs)
                if r is not NotImplemented:
                    return r
        out = func(*args, **kwargs)
        if func.is_view or func in FREE_OPS:
            return out
        cost = self.trace.here()
        cost.ops += 1
        packet = func._overloadpacket
        formula = self.registry.get(packet)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            cost.flops += flops
            if packet in CONV_OPS:
                cost.conv_flops += flops
        else:
            leaves = tree_flatten((args, kwargs, out))[0]
            cost.memory_bytes += sum(_nbytes(t) for t in leaves if isinstance(t, torch.Tensor))
        if func not in self.kinds:
            self.kinds[func] = _op_kind(packet.__name__)
        kind = self.kinds[func]
        if kind is None and packet in (aten._softmax, aten._safe_softmax) and args[0].dim() == 4:
            kind = "attention"
        if kind:
            cost.kinds.add(kind)
        return out


def _run_meta(model: nn.Module, example: tuple[tuple, dict], trace: _Trace) -> None:
    """One forward on meta tensors with module hooks, the cost mode and saved-tensor hooks."""
    from torch.func import functional_call

    params = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
              for n, p in model.named_parameters()}
    buffers = {n: meta_buffer(b) for n, b in model.named_buffers()}
    state_storages = {t.untyped_storage()._cdata for t in (*params.values(), *buffers.values())}
    seen: set[int] = set()

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in seen and key not in state_storages:
                seen.add(key)
                trace.here().saved_bytes += _nbytes(t, storage.nbytes() // max(t.element_size(), 1))
        return t

    def pre(name: str):
        def hook(mod, args):
            trace.push(name)
        return hook

    def post(name: str):
        def hook(mod, args, out):
            trace.pop()
            leaves = tree_flatten(out)[0]
            trace.outputs[name] += sum(_nbytes(t) for t in leaves if isinstance(t, torch.Tensor))
        return hook

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(pre(name)))
        handles.append(mod.register_forward_hook(post(name), always_call=True))  # pops after a failure too
    args, kwargs = meta_example(example, rows=1)  # sizes per sample
    uses = ParameterUses(params)
    try:
        with ExitStack() as es:
            es.enter_context(uses)
            es.enter_context(torch.enable_grad())
            es.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            es.enter_context(_CostMode(trace))
            es.enter_context(meta_friendly(model))
            out = functional_call(model, {**params, **buffers}, args, kwargs, strict=False, tie_weights=True)
        del out  # held until here: saved storages stay alive, so no storage id is reused while counting
        trace.unused = uses.unused()
    except Exception as err:  # noqa: BLE001 -- data-dependent ops have no meta kernel
        trace.failure = first_line(err)
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------------- structure


@dataclass
class _Structure:
    """The module tree with what the unit choice needs: unique parameters per subtree, repeated-list elements,
    tie groups and the modules holding them."""

    model: nn.Module
    modules: dict[str, nn.Module]
    children: dict[str, list[str]]
    numel: dict[int, int]  # parameter id -> elements
    params: dict[str, frozenset[int]]  # module -> ids of the parameters in its subtree
    blocks: set[str]  # repeated blocks (``_repeated``): never split
    ties: list[tuple[str, ...]]
    tie_holders: list[tuple[str, ...]]  # per tie: the modules registering it

    @classmethod
    def of(cls, model: nn.Module) -> _Structure:
        modules = dict(model.named_modules())
        children: dict[str, list[str]] = {}
        for name, mod in modules.items():  # a module registered twice is a child of its first parent only
            children[name] = [full for c, _ in mod.named_children() if (full := _join(name, c)) in modules]
        numel: dict[int, int] = {}
        names: dict[int, list[str]] = defaultdict(list)
        for pname, p in model.named_parameters(remove_duplicate=False):
            numel[id(p)] = p.numel()
            names[id(p)].append(pname)
        params: dict[str, frozenset[int]] = {}
        for name in reversed(list(modules)):  # named_modules is pre-order: children come after their parent
            own = {id(p) for p in modules[name]._parameters.values() if p is not None}
            params[name] = frozenset(own.union(*(params[c] for c in children[name])))
        blocks = set()
        for name, mod in modules.items():
            if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
                blocks.update(_repeated(name, mod))
        ties = [tuple(ns) for ns in names.values() if len(ns) > 1]
        holders = [tuple(dict.fromkeys(_parent(n) for n in ns)) for ns in ties]
        return cls(model, modules, children, numel, params, blocks, ties, holders)

    def count(self, ids: Iterable[int]) -> int:
        return sum(self.numel[i] for i in ids)

    def called_children(self, name: str, called: dict[str, int]) -> list[str]:
        """The nearest called descendants of ``name``, looking through modules that did not run (ModuleList)."""
        found = []
        for child in self.children[name]:
            found += [child] if child in called else self.called_children(child, called)
        return found


def _repeated(name: str, container: nn.Module) -> list[str]:
    """The elements of a list that repeat a block: of a class of which >= 2 non-leaf elements have the same
    parameter shapes (ResNet's bottleneck layers, including each stage's first one with its shortcut; not the
    stages, whose widths differ, nor the three different convolutions inside a bottleneck)."""
    seen: dict[tuple, int] = defaultdict(int)
    for child in container.children():
        if next(child.children(), None) is not None:
            seen[(type(child), tuple((n, tuple(p.shape)) for n, p in child.named_parameters()))] += 1
    classes = {cls for (cls, _), count in seen.items() if count >= 2}
    return [_join(name, c) for c, child in container.named_children() if type(child) in classes]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


# ------------------------------------------------------------------------------------------- unit choice


@dataclass
class _Totals:
    """Per module, summed over the stacks it appears in: FLOPs (inclusive), and its own ops (stacks where it is
    the innermost module)."""

    flops: dict[str, float]
    own_ops: dict[str, int]


def _totals(trace: _Trace) -> _Totals:
    flops: dict[str, float] = defaultdict(float)
    own_ops: dict[str, int] = defaultdict(int)
    for key, cost in trace.costs.items():
        for name in set(key):
            flops[name] += cost.flops
        if key:
            own_ops[key[-1]] += cost.ops
    return _Totals(flops, own_ops)


def _choose(s: _Structure, called: dict[str, int], totals: _Totals) -> list[str]:
    """Units top-down: the model is always split; a module is split when it is big (more than UNIT_SHARE of the
    FLOPs or parameters) or contains repeated blocks, is not itself a repeated block, and has >= 2 children doing
    work -- or exactly one and no work of its own (a pass-through such as ResNet's stage around its layers). Outside
    block stacks a module stays whole when its working children are all bare layers (a conv-norm-activation
    Sequential: units of single layers would leave the activations between them to no unit) or when one child
    does DOMINANT_SHARE of its FLOPs (a U-Net's up block: the transposed conv beside the conv block)."""
    total_flops = max(totals.flops.get("", 0.0), 1e-30)
    total_params = max(s.count(s.params[""]), 1)
    contains_blocks: dict[str, bool] = {}
    for name in reversed(list(s.modules)):
        contains_blocks[name] = any(c in s.blocks or contains_blocks[c] for c in s.children[name])

    def working(name: str) -> bool:
        return bool(s.params[name]) or totals.flops.get(name, 0.0) > 0

    def split(name: str, kids: list[str]) -> bool:
        if name == "":
            return True
        if name in s.blocks or not kids:
            return False
        if not contains_blocks[name]:
            big = (totals.flops.get(name, 0.0) > UNIT_SHARE * total_flops
                   or s.count(s.params[name]) > UNIT_SHARE * total_params)
            if not big or all(not s.children[k] for k in kids):
                return False
            flops = totals.flops.get(name, 0.0)
            if flops > 0 and max(totals.flops.get(k, 0.0) for k in kids) >= DOMINANT_SHARE * flops:
                return False  # one child does (nearly) all the work: splitting would not make smaller units
        if len(kids) >= 2:
            return True
        own_params = s.params[name] - s.params[kids[0]]
        return not own_params and totals.own_ops.get(name, 0) == 0

    units: list[str] = []

    def visit(name: str) -> None:
        kids = [c for c in s.called_children(name, called) if working(c)]
        if split(name, kids):
            for kid in kids:
                visit(kid)
        else:
            units.append(name)

    visit("")
    return _lift_ties(s, called, units) or [""]  # nothing to split: the model is its one unit


def _lift_ties(s: _Structure, called: dict[str, int], units: list[str]) -> list[str]:
    """Keep each tie inside one unit: the smallest called module enclosing every module holding it replaces the
    units inside it; when that is the model itself, the units holding a part of the tie are dropped and the tie
    goes to ``(rest)`` (the root's own part, which FSDP's root unit owns)."""
    chosen = set(units)

    def owner(holder: str) -> str | None:
        return next((u for u in chosen if _inside(holder, u)), None)

    moved = True
    while moved:  # each move merges or drops units, never splits one: this ends
        moved = False
        for holders in s.tie_holders:
            owners = {owner(h) for h in holders}
            if len(owners) == 1:  # one unit holds the whole tie, or (rest) does
                continue
            lca = holders[0]
            while not all(_inside(h, lca) for h in holders):
                lca = _parent(lca)
            while lca and lca not in called:
                lca = _parent(lca)
            if lca:
                chosen = {u for u in chosen if not _inside(u, lca)} | {lca}
            else:
                chosen -= owners
            moved = True
    return sorted(chosen, key=lambda u: called.get(u, len(called)))


# ------------------------------------------------------------------------------------------- result


@dataclass
class UnitAnalysis:
    """Any model as units: module units (``modules``, fqns relative to the model, first-call order) and, in
    ``units``, their specs plus ``(rest)`` when something is left over. ``failure``: why the meta forward did not
    run (then the units come from structure and carry parameters only)."""

    units: list[UnitSpec]
    modules: list[str]
    has_batchnorm: bool = False
    ties: list[tuple[str, ...]] = field(default_factory=list)
    failure: str = ""
    unused_params: list[str] = field(default_factory=list)  # trainable parameters the forward never took

    def spec(self, name: str) -> ModelSpec:
        """The unit-form ModelSpec. When the trace failed, the units come from structure with an estimate of
        2 FLOPs per parameter and sample (each weight used once, as a dense layer's) and ``trace_failure`` set:
        the planner then offers data parallelism only (DP / FSDP: the same compute on every plan, so the
        estimate cannot rank them wrong) and reports why the rest is excluded."""
        if not self.failure:
            return ModelSpec(name=name, units=[UnitSpec(**vars(u)) for u in self.units])
        units = [UnitSpec(**{**vars(u), "flops": 2.0 * u.params}) for u in self.units if u.params]
        if not units:
            raise ConfigError("model", f"its forward does not run on meta tensors ({self.failure}) and it has no "
                              "parameters to plan by", META_FIX)
        return ModelSpec(name=name, units=units, trace_failure=self.failure)


def _module_kinds(module: nn.Module) -> set[str]:
    """What a module's own type says it is."""
    kinds = set()
    if isinstance(module, nn.modules.conv._ConvNd):
        kinds.add("conv")
    elif isinstance(module, nn.modules.batchnorm._BatchNorm):
        kinds.add("batchnorm")
    elif isinstance(module, nn.GroupNorm):
        kinds.add("groupnorm")
    elif isinstance(module, nn.LayerNorm):
        kinds.add("layernorm")
    elif "norm" in type(module).__name__.lower() and next(module.children(), None) is None \
            and next(module.parameters(), None) is not None:
        kinds.add("norm")  # RMSNorm and the norms models write themselves (with a weight: not an input scaler)
    elif isinstance(module, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                             nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)):
        kinds.add("pool")
    elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        kinds.add("embedding")
    elif isinstance(module, nn.Linear):
        kinds.add("linear")
    return kinds


def _has_mlp(linears: list[nn.Linear]) -> bool:
    """An up / down pair: one linear widening h -> f and another narrowing f -> h."""
    shapes = {(m.in_features, m.out_features) for m in linears}
    return any(f > h and (f, h) in shapes for h, f in shapes)


def _specs(s: _Structure, trace: _Trace, modules: list[str]) -> list[UnitSpec]:
    """The UnitSpecs of the module units (innermost unit of each stack takes its cost) and of ``(rest)``."""
    unit_set = set(modules)
    costs: dict[str, _Cost] = defaultdict(_Cost)
    for key, cost in trace.costs.items():
        owner = next((n for n in reversed(key) if n in unit_set), REST)
        costs[owner].add(cost)
    kinds: dict[str, set[str]] = defaultdict(set)
    linears: dict[str, list[nn.Linear]] = defaultdict(list)
    batchnorms: dict[str, int] = defaultdict(int)
    for name in trace.order:
        owner = next((u for u in modules if _inside(name, u)), REST)
        mod = s.modules[name]
        kinds[owner] |= _module_kinds(mod)
        batchnorms[owner] += isinstance(mod, nn.modules.batchnorm._BatchNorm)
        if isinstance(mod, nn.Linear):
            linears[owner].append(mod)
    for holders in s.tie_holders:
        owner = next((u for u in modules if all(_inside(h, u) for h in holders)), REST)
        kinds[owner].add("tied")
    covered: set[int] = set()
    specs = []
    for name in modules:
        covered |= s.params[name]
        specs.append(_unit_spec(name or type(s.model).__name__, s.count(s.params[name]), costs[name],
                                trace.outputs.get(name, 0.0), kinds[name], _has_mlp(linears[name]),
                                batchnorms[name]))
    rest_params = s.count(s.params[""] - covered)
    rest = costs[REST]
    if rest_params or rest.ops or rest.flops or rest.saved_bytes:
        specs.append(_unit_spec(REST, rest_params, rest, 0.0, kinds[REST], _has_mlp(linears[REST]), batchnorms[REST]))
    return specs


def _unit_spec(name: str, params: int, cost: _Cost, output: float, kinds: set[str], mlp: bool,
               batchnorm_layers: int) -> UnitSpec:
    found = kinds | cost.kinds | ({"mlp"} if mlp else set())
    return UnitSpec(name=name, params=params, flops=float(cost.flops), conv_flops=float(cost.conv_flops),
                    activation_bytes=float(cost.saved_bytes), output_bytes=float(output),
                    memory_bytes=float(cost.memory_bytes), ops=cost.ops, batchnorm_layers=batchnorm_layers,
                    kinds=[k for k in UNIT_KINDS if k in found])


def analyze_units(model: nn.Module, example: tuple[tuple, dict]) -> UnitAnalysis:
    """Trace one forward of ``model`` on ``example`` (``(args, kwargs)``, e.g. ``ModelCall.args/.kwargs``) on
    meta tensors and describe it as units, per sample. ``model`` and ``example`` are never moved or run for
    real. When the forward cannot run on meta tensors, the units come from structure (modules whose class
    implements ``forward``), with parameters only, and ``failure`` says why."""
    s = _Structure.of(model)
    trace = _Trace()
    _run_meta(model, example, trace)
    if trace.failure:
        called = {n: i for i, n in enumerate(n for n, m in s.modules.items() if implements_forward(m))}
        trace = _Trace(order=called, failure=trace.failure)
    modules = _choose(s, trace.order, _totals(trace))
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) \
        or any("batchnorm" in c.kinds for c in trace.costs.values())
    return UnitAnalysis(units=_specs(s, trace, modules), modules=modules, has_batchnorm=has_bn,
                        ties=list(s.ties), failure=trace.failure, unused_params=trace.unused)


# ------------------------------------------------------------------------------------------- front door


@dataclass
class UnitModelAnalysis(ModelAnalysis):
    """A ModelAnalysis of a model in unit form: ``blocks`` are its module units, ``detail`` the full analysis."""

    detail: UnitAnalysis | None = None

    def describe(self) -> str:
        parts = [f"{len(self.blocks)} units", f"{self.total_params / 1e6:.2f}M params"]
        if self.detail and self.detail.has_batchnorm:
            parts.append("BatchNorm")
        if self.tied_embeddings:
            parts.append("tied parameters")
        if self.unclassified:
            parts.append(f"unclassified: {', '.join(self.unclassified)}")
        return "; ".join(parts)


def _transformer(model: nn.Module, runner: nn.Module | None,
                 example: tuple[tuple, dict] | None) -> ModelAnalysis | None:
    """The transformer analysis (traced on ``example`` when given) when the model has repeated blocks with
    attention in block 0, else None."""
    if find_block_list(model) is None:
        return None
    try:
        found = analyze(model, trace=True, runner=runner, example=example)
    except Exception:  # noqa: BLE001 -- not a transformer it can describe (no hidden width, ...): units serve
        return None
    return found if is_transformer(found) else None


def is_transformer(analysis: ModelAnalysis) -> bool:
    """Planned and split as a transformer (TP, EP, the block-stack pipeline): repeated blocks with attention
    found in the first; anything else is a model in unit form."""
    attention = analysis.blocks[0].attention if analysis.blocks and not analysis.spec.unit_form else None
    return attention is not None and attention.heads > 0


def analyze_model(model: nn.Module, example: tuple[tuple, dict] | None,
                  runner: nn.Module | None = None) -> ModelAnalysis:
    """The analysis the strategy plans with: the transformer analysis (unchanged) for a stack of attention
    blocks, otherwise the unit form (``UnitModelAnalysis``) from one meta forward of ``example``. A unit-form
    model whose forward cannot run on meta tensors is refused in one line: units without FLOPs would price every
    plan wrong. With an example the unit trace runs first: a model with no attention anywhere skips the
    transformer analysis (its trace and TP dry runs)."""
    detail = analyze_units(model, example) if example is not None else None
    attention = detail is None or detail.failure or any("attention" in u.kinds for u in detail.units)
    found = _transformer(model, runner, example) if attention else None
    if found is not None:
        return found
    if detail is None:
        raise ConfigError("model", f"{type(model).__name__} has no attention blocks and no example input to trace",
                          "pass an example batch (the strategy takes it from the first training_step)")
    spec = detail.spec(type(model).__name__)
    by_name = {u.name: u for u in detail.units}
    blocks = []
    for i, fqn in enumerate(detail.modules):
        unit = by_name[fqn or type(model).__name__]
        blocks.append(BlockInfo(index=i, fqn=fqn, params=unit.params, flops=3 * unit.flops,
                                activation_bytes=unit.activation_bytes))
    return UnitModelAnalysis(
        spec=spec, blocks_fqn="", blocks=blocks, token_embedding=None, position_embedding=None, final_norm=None,
        lm_head=None, tied_embeddings=bool(detail.ties), total_params=spec.total_params(), batch=1, seq_len=1,
        unclassified=[f"meta forward failed ({detail.failure}): data parallelism only"] if detail.failure else [],
        flops_total=3 * sum(u.flops for u in detail.units), unused_params=detail.unused_params, detail=detail)


def describe_units(what: ModelSpec | UnitAnalysis | ModelAnalysis) -> str:
    """The units as a plain-text table (name, kinds, params, GFLOPs / activation MiB per sample, forward)."""
    if isinstance(what, UnitModelAnalysis) and what.detail is not None:
        units = what.detail.units
    elif isinstance(what, UnitAnalysis):
        units = what.units
    elif isinstance(what, ModelSpec):
        units = what.units
    else:
        units = what.spec.units
    if not units:
        return "(not in unit form: a transformer described by its fields)"
    rows = [(u.name, ",".join(u.kinds) or "-", f"{u.params / 1e6:.3f}M", f"{u.flops / 1e9:.4f}",
             f"{u.activation_bytes / 2**20:.3f}") for u in units]
    rows.append(("total", "", f"{sum(u.params for u in units) / 1e6:.3f}M",
                 f"{sum(u.flops for u in units) / 1e9:.4f}", f"{sum(u.activation_bytes for u in units) / 2**20:.3f}"))
    header = ("unit", "kinds", "params", "GFLOPs/sample", "act MiB/sample")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])] + [c.rjust(w) for c, w in zip(row[2:], widths[2:])]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)])
