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
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.profile.analyze import BlockInfo, ModelAnalysis, analyze, find_block_list
from lightning_autopar.profile.records import Analysis
from lightning_autopar.profile.trace import (ELEMENT_BYTES, OpCost, OpCosts, ParameterUses, StopAtCall,  # noqa: F401
                                             Trace, first_line, flop_formulas, implements_forward, meta_example,
                                             meta_forward)
from lightning_autopar.specs import UNIT_KINDS, ModelSpec, UnitSpec

REST = "(rest)"  # the spec unit holding what no module unit covers
DOMINANT_SHARE = 0.9  # a child doing this share of its parent's FLOPs makes the parent one unit
UNIT_SHARE = 1 / 16  # a module holding more than this share of FLOPs or parameters is split further
META_FIX = ("make its forward run on meta tensors (no data-dependent ops such as nonzero() or .item()), "
            "or describe the model by units in a model spec YAML (units: ...)")

# ------------------------------------------------------------------------------------------- the model call


@dataclass
class ModelCall:
    """The module a training step runs and the call it makes (real tensors, as the step passed them)."""

    fqn: str  # relative to the root given to find_model_call ("" for the root itself)
    module: nn.Module
    args: tuple
    kwargs: dict


def find_model_call(root: nn.Module, step: Callable[[], Any]) -> ModelCall:
    """Run ``step`` (e.g. ``partial(lit.training_step, batch, 0)``) without gradients until the first forward of
    a parameter-holding module under ``root`` starts (``root`` itself when the step calls ``self(x)``, else the
    child it calls, e.g. ``self.model(pixel_values=...)``), and return that module and its arguments. Modules
    holding no parameters (a normaliser, a loss) are passed over: they are not the model to parallelise. The
    step never gets further than that call, so it costs one call's preparation, not a step."""
    names = {id(m): n for n, m in root.named_modules()}

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if next(mod.parameters(), None) is not None:
            raise StopAtCall(names[id(mod)], args, kwargs)

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in root.modules()]
    try:
        with torch.no_grad():
            step()
    except StopAtCall as found:  # a BaseException: the step's own handlers let it through
        return ModelCall(found.fqn, root.get_submodule(found.fqn), tuple(found.args), dict(found.kwargs))
    except Exception as err:  # noqa: BLE001 -- the user's step failed before calling its model
        raise ConfigError("training_step", f"raised before calling a module ({first_line(err)})",
                          "make the step run on the example batch") from None
    finally:
        for h in handles:
            h.remove()
    raise ConfigError("training_step", f"never called a module of {type(root).__name__} holding parameters",
                      "call the model in training_step (e.g. self(x) or self.model(x))")


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
    frozen: frozenset[int] = frozenset()  # ids of the parameters with requires_grad=False

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
        frozen = frozenset(id(p) for p in model.parameters() if not p.requires_grad)
        return cls(model, modules, children, numel, params, blocks, ties, holders, frozen)

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


def _totals(trace: Trace) -> _Totals:
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
    collectives: list[str] = field(default_factory=list)  # its own torch.distributed calls (Trace.collectives)

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


def _specs(s: _Structure, trace: Trace, modules: list[str]) -> list[UnitSpec]:
    """The UnitSpecs of the module units (innermost unit of each stack takes its cost) and of ``(rest)``."""
    unit_set = set(modules)
    costs: dict[str, OpCost] = defaultdict(OpCost)
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
        specs.append(_unit_spec(name or type(s.model).__name__, s.params[name], s, costs[name],
                                trace.outputs.get(name, 0.0), kinds[name], _has_mlp(linears[name]),
                                batchnorms[name]))
    rest_ids = s.params[""] - covered
    rest = costs[REST]
    if rest_ids or rest.ops or rest.flops or rest.saved_bytes:
        specs.append(_unit_spec(REST, rest_ids, s, rest, 0.0, kinds[REST], _has_mlp(linears[REST]), batchnorms[REST]))
    return specs


def _unit_spec(name: str, ids: frozenset[int], s: _Structure, cost: OpCost, output: float, kinds: set[str],
               mlp: bool, batchnorm_layers: int) -> UnitSpec:
    found = kinds | cost.kinds | ({"mlp"} if mlp else set())
    return UnitSpec(name=name, params=s.count(ids), flops=float(cost.flops), conv_flops=float(cost.conv_flops),
                    activation_bytes=float(cost.saved_bytes), output_bytes=float(output),
                    memory_bytes=float(cost.memory_bytes), ops=cost.ops, batchnorm_layers=batchnorm_layers,
                    kinds=[k for k in UNIT_KINDS if k in found], frozen_params=s.count(ids & s.frozen))


def analyze_units(model: nn.Module, example: tuple[tuple, dict]) -> UnitAnalysis:
    """Trace one forward of ``model`` on ``example`` (``(args, kwargs)``, e.g. ``ModelCall.args/.kwargs``) on
    meta tensors and describe it as units, per sample. ``model`` and ``example`` are never moved or run for
    real. When the forward cannot run on meta tensors, the units come from structure (modules whose class
    implements ``forward``), with parameters only, and ``failure`` says why."""
    s = _Structure.of(model)
    # one forward (sizes per sample), the ops' costs charged to the module forwards running them
    trace = meta_forward(model, meta_example(example, rows=1), [ParameterUses(), OpCosts()], grad=True)
    if trace.failure is not None:
        trace = Trace(called=[n for n, m in s.modules.items() if implements_forward(m)], failure=trace.failure)
    modules = _choose(s, trace.order, _totals(trace))
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) \
        or any("batchnorm" in c.kinds for c in trace.costs.values())
    return UnitAnalysis(units=_specs(s, trace, modules), modules=modules, has_batchnorm=has_bn,
                        ties=list(s.ties), failure=trace.failure or "", unused_params=trace.unused,
                        collectives=trace.collectives)


# ------------------------------------------------------------------------------------------- front door


@dataclass(kw_only=True)
class UnitModelAnalysis(Analysis):
    """The unit-form arm of the analysis (records.Analysis): ``blocks`` are the model's module units (fqns relative
    to the root), ``detail`` the full unit analysis."""

    form: ClassVar[str] = "unit"
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

    def summary(self) -> str:
        return describe_units(self.spec)

    # The transformer arm's parts, which units do not single out (an embedding or head is one unit among the
    # others): read-only None, not constructor fields, for code that reads the parts of any analysis.
    token_embedding = position_embedding = final_norm = lm_head = property(lambda self: None)


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


def is_transformer(analysis: Analysis) -> bool:
    """Planned and split as a transformer (TP, EP, the block-stack pipeline): repeated blocks with attention
    found in the first; anything else is a model in unit form."""
    attention = analysis.blocks[0].attention if analysis.blocks and analysis.form == "transformer" else None
    return attention is not None and attention.heads > 0


def analyze_model(model: nn.Module, example: tuple[tuple, dict] | None,
                  runner: nn.Module | None = None) -> Analysis:
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
        spec=spec, blocks_fqn="", blocks=blocks, tied_embeddings=bool(detail.ties), total_params=spec.total_params(),
        batch=1, seq_len=1,
        unclassified=[f"meta forward failed ({detail.failure}): data parallelism only"] if detail.failure else [],
        flops_total=3 * sum(u.flops for u in detail.units), unused_params=detail.unused_params,
        collectives=detail.collectives, trace_failure=detail.failure or None, detail=detail)


def describe_units(what: ModelSpec | UnitAnalysis | Analysis) -> str:
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
