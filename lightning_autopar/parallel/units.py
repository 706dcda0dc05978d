"""Which modules become data-parallel units (FSDP2 ``fully_shard`` or DDP ``replicate``), chosen from what the
model calls, and the guard that the applied plan kept every tied parameter tied.

Why from calls and not from classes: FSDP2 gathers a unit's parameters in the unit's forward pre-hook (and frees
them after its forward at zero=3), so a unit must be a module whose forward runs, and every use of a parameter must
happen inside the forward of the unit owning it. A container (litgpt's ``transformer`` ModuleDict, any ModuleList)
is never called: it cannot be a unit. We record the calls with forward hooks during one forward on meta tensors
(no memory, no compute) and, for every parameter, the stack of module forwards running at each of its uses.

Why tied parameters need care: one Parameter reachable under several names (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``). ``fully_shard`` swaps the Parameter for a sharded one on the modules *it manages* only.
With the tie split across units (or a user of the tie outside every unit) the other name keeps the old, full,
never-synchronised tensor: the model silently trains apart from one device. So a tied group is owned by one unit,
an ancestor of every module holding it whose forward encloses all its uses; ``check_applied`` verifies after the
apply that every tie is still one tensor, owned by one unit, and that no parameter was left outside every unit.

The meta forward runs on token ids (a transformer), or on ``example``: the user's own model call (args, kwargs) as
captured from the training step (``profile.units.find_model_call``), its tensors swapped for meta tensors -- so
CNNs, U-Nets and other models in unit form are traced too (their units are the analysis' units). When it fails,
modules whose class implements ``forward`` stand in for the called ones, and what the blocks leave goes to the
outermost of them (their forward encloses every use); the guard still applies.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.profile.stage_flow import StageFlow
from lightning_autopar.profile.trace import (ParameterUses, first_line, implements_forward, meta_example, meta_forward,
                                             token_ids)


@dataclass(frozen=True)
class TieGroup:
    """One Parameter object reachable under several names (root-relative, in registration order)."""

    names: tuple[str, ...]

    def describe(self) -> str:
        return " = ".join(f"'{n}'" for n in self.names)


@dataclass(frozen=True)
class ParamGroup:
    """One Parameter object: its names and the modules registering it (root-relative)."""

    names: tuple[str, ...]
    holders: tuple[str, ...]


@dataclass
class CallTrace:
    """What one forward of ``entry`` on meta tensors ran: the modules called, and per parameter name the stacks
    of module forwards (outermost first) running at each use. ``traced`` False: the forward failed and
    ``called`` holds the modules whose class implements ``forward``. ``partial``: some block could not run on
    meta tensors (data-dependent routing, e.g. ``nonzero``) and stood in as identity, so uses inside it may be
    missing."""

    entry: str
    traced: bool
    called: frozenset[str]
    uses: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    failure: str = ""
    partial: bool = False
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # module -> its (first, last) call (``Trace``)
    carried: tuple[str, ...] = ()  # what reaches the blocks besides their hidden state (``Trace.carried``)


@dataclass(frozen=True)
class UnitChoice:
    """The units, root-relative names, innermost first: blocks, then the modules owning everything else."""

    blocks: tuple[str, ...]
    rest: tuple[str, ...]

    def modules(self, root: nn.Module) -> list[nn.Module]:
        return [root.get_submodule(n) for n in self.blocks + self.rest]


# ------------------------------------------------------------------------------------------- structure


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _ancestors(name: str) -> list[str]:
    """The proper ancestors of a module name, the root ("") excluded."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _inside(name: str, ancestor: str) -> bool:
    """``name`` is ``ancestor`` or below it ("" is the root)."""
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


def param_groups(root: nn.Module) -> list[ParamGroup]:
    """Every Parameter object under ``root`` with all its names (``remove_duplicate=False``)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, p in root.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
    return [ParamGroup(tuple(ns), tuple(dict.fromkeys(_parent(n) for n in ns))) for ns in names.values()]


def tie_groups(root: nn.Module) -> list[TieGroup]:
    """The parameters reachable under more than one name."""
    return [TieGroup(g.names) for g in param_groups(root) if len(g.names) > 1]


# ------------------------------------------------------------------------------------------- tracing


Example = tuple[tuple, dict]  # a model call: (args, kwargs)


def _meta_call(example: Example | None, seq_len: int) -> Example:
    """The call to trace: ``example`` with every tensor as a meta tensor of the same shape and dtype, else one
    row of ``seq_len`` token ids."""
    return token_ids(1, seq_len) if example is None else meta_example(example)


def _trace(root: nn.Module, entry: str, seq_len: int, blocks: Iterable[str] = (),
           example: Example | None = None) -> CallTrace:
    """One forward of ``root.get_submodule(entry)`` on token ids (or on ``example``, the user's call of it), every
    parameter and buffer swapped for a meta tensor (ties kept: one meta tensor per Parameter object, named by all
    its names); ``blocks`` (root-relative) stand in as identity where they cannot run on meta tensors. Raises the
    model's error when the forward does not run."""
    model = root.get_submodule(entry)
    blocks = list(blocks)
    stand_ins = [root.get_submodule(b) for b in blocks if _inside(b, entry) and b != entry]
    trace = meta_forward(model, _meta_call(example, seq_len), [ParameterUses(stacks=True), StageFlow(blocks)],
                         grad=False, every_name=True, prefix=entry, stand_in=stand_ins)
    if trace.error is not None:
        raise trace.error
    return CallTrace(entry, True, frozenset(trace.called), trace.uses, "; ".join(dict.fromkeys(trace.stood_in)),
                     partial=bool(trace.stood_in), spans=trace.spans, carried=tuple(trace.carried))


def trace_calls(root: nn.Module, transformer: nn.Module, seq_len: int, block_fqns: Iterable[str] = (),
                example: Example | None = None) -> CallTrace:
    """Trace the outermost module between ``root`` (the LightningModule, whose forward the training step does
    not run) and ``transformer`` that runs on token ids: a ``*ForCausalLM`` or litgpt's GPT around the blocks
    (``block_fqns``, relative to ``transformer``). With ``example`` (the user's call of ``transformer``, the
    model the step calls) that call is traced instead."""
    names = {id(m): n for n, m in root.named_modules()}
    path = names[id(transformer)]
    blocks = [f"{path}.{b}" if path and b else path or b for b in block_fqns]
    chain = [] if not path else [".".join(path.split(".")[: i + 1]) for i in range(path.count(".") + 1)]
    if example is not None:
        chain = [path]  # the example is the call of this module, no other
    failure = ""
    for entry in chain or [""]:
        try:
            return _trace(root, entry, seq_len, blocks, example)
        except Exception as err:  # noqa: BLE001 -- a model not runnable on token ids: try the next one inward
            failure = failure or first_line(err)
    called = frozenset(n for n, m in root.named_modules() if n and implements_forward(m))
    return CallTrace(path, False, called, {}, failure)


def trace_model_call(root: nn.Module, call: Any, blocks: Iterable[str], seq_len: int) -> CallTrace:
    """The trace of the user's own call of its model (``call``: a ``profile.units.ModelCall`` found under
    ``root``); ``blocks`` root-relative. A forward that does not run on meta tensors: ``traced`` False."""
    try:
        return _trace(root, call.fqn, seq_len, blocks, (tuple(call.args), dict(call.kwargs)))
    except Exception as err:  # noqa: BLE001 -- the model's own error, as a failed trace
        return CallTrace(call.fqn, False, frozenset(), {}, first_line(err))


# ------------------------------------------------------------------------------------------- choice


class _Owners:
    """Decides which module may own which parameters: a module whose forward runs, holding every name of the
    parameter below it, enclosing every use of it, and not a block unit (nor inside one)."""

    def __init__(self, root: nn.Module, trace: CallTrace, blocks: Iterable[str]) -> None:
        self.root = root
        self.trace = trace
        self.blocks = tuple(blocks)
        self.callable = {n for n, m in root.named_modules() if n and not _inside(n, trace.entry)
                         and implements_forward(m)} | set(trace.called)
        # the entry's ancestors enclose whatever the entry runs
        entry = trace.entry
        self.outer = tuple(a for a in self.callable if a and entry != a and _inside(entry, a))
        # untraced (or partly), uses may be unknown: what the blocks leave goes to the outermost modules with a
        # forward (those the user's step calls), whose forward encloses every use the model makes
        self.leftover_owners = self.callable if trace.traced and not trace.partial else {
            n for n in self.callable if not any(a in self.callable for a in _ancestors(n))}

    def may_own(self, module: str, group: ParamGroup, in_blocks: bool = False) -> bool:
        if module not in (self.callable if in_blocks else self.leftover_owners):
            return False
        if not in_blocks and any(_inside(module, b) for b in self.blocks):
            return False
        if not all(_inside(h, module) for h in group.holders):
            return False
        uses = next((self.trace.uses[n] for n in group.names if n in self.trace.uses), ())
        for stack in uses:
            if module not in stack and module not in self.outer:
                return False
        return True

    def deepest(self, within: str, groups: list[ParamGroup]) -> str | None:
        """The deepest module at or below ``within`` (never the root) that may own all of ``groups``."""
        best = None
        for name, _ in self.root.get_submodule(within).named_modules(prefix=within):
            if name and all(self.may_own(name, g) for g in groups):
                if best is None or name.count(".") > best.count("."):
                    best = name
        return best


def _block_units(owners: _Owners, groups: list[ParamGroup], blocks: list[str]) -> list[str]:
    """The blocks that can be units: every parameter under the block is owned by it (no tie leaving the block,
    no use outside the block's forward)."""
    kept = []
    for b in blocks:
        mine = [g for g in groups if any(_inside(h, b) for h in g.holders)]
        if all(owners.may_own(b, g, in_blocks=True) for g in mine):
            kept.append(b)
    return kept


def _cover(owners: _Owners, within: str, groups: list[ParamGroup]) -> list[str]:
    """As few units as correct at or below ``within`` owning ``groups``: one when a module may own them all,
    else one set per child holding them."""
    if not groups:
        return []
    best = owners.deepest(within, groups) if within else None
    if best is not None:
        return [best]
    by_child: dict[str, list[ParamGroup]] = defaultdict(list)
    prefix = within + "." if within else ""
    for g in groups:
        children = {prefix + h[len(prefix):].split(".")[0] if h != within else None for h in g.holders}
        if len(children) != 1 or None in children:
            raise ConfigError(
                f"parameter {' = '.join(repr(n) for n in g.names)}",
                f"no module whose forward runs holds {'all its names' if len(g.names) > 1 else 'it'} and encloses "
                f"all its uses (under {within or 'the LightningModule'!r}), so no data-parallel unit can own it and "
                "keep it one tensor", "hold it (and every module using it) inside one module the model calls")
        by_child[children.pop()].append(g)
    return [unit for child, gs in by_child.items() for unit in _cover(owners, child, gs)]


def choose_units(root: nn.Module, transformer: nn.Module, block_fqns: Iterable[str], seq_len: int,
                 wrap_blocks: bool = True, trace: CallTrace | None = None,
                 example: Example | None = None) -> UnitChoice:
    """The data-parallel units of ``root`` (the LightningModule): each block of ``transformer`` (``block_fqns``
    relative to it; for a model in unit form, the analysis' units) that owns all its parameters (``wrap_blocks``;
    DDP takes none), then as few modules as correct owning everything else. ``example``: the user's call of
    ``transformer``, traced instead of token ids."""
    direct = [n for n, _ in root.named_parameters(recurse=False)]
    if direct:
        raise ConfigError(f"{type(root).__name__}.{direct[0]}", "a parameter registered directly on the "
                          "LightningModule cannot be sharded", "hold it in a submodule (e.g. an nn.Linear)")
    block_fqns = list(block_fqns)
    trace = trace or trace_calls(root, transformer, seq_len, block_fqns, example)
    if not trace.traced:
        warnings.warn(f"autopar: the meta forward of {trace.entry or type(root).__name__!r} failed "
                      f"({trace.failure}); data-parallel units chosen from the modules implementing forward",
                      stacklevel=2)
    names = {id(m): n for n, m in root.named_modules()}
    prefix = names[id(transformer)]
    blocks = [f"{prefix}.{b}" if prefix and b else prefix or b for b in block_fqns]  # "": the model is one unit
    groups = param_groups(root)
    owners = _Owners(root, trace, [])
    kept = _block_units(owners, groups, blocks) if wrap_blocks else []
    owners = _Owners(root, trace, kept)
    rest = [g for g in groups if not any(_inside(g.holders[0], b) for b in kept)]
    return UnitChoice(tuple(kept), tuple(_cover(owners, "", rest)))


# ------------------------------------------------------------------------------------------- guard


def _is_unit(module: nn.Module) -> bool:
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, (FSDPModule, DDP))


def _owned_params(unit: nn.Module) -> list[int]:
    """Ids of the parameters a unit manages: those below it, not below a nested unit (what FSDP2 and
    ``replicate`` take)."""
    found: list[int] = []
    seen: set[int] = set()

    def walk(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                found.append(id(p))
        for child in module.children():
            if not _is_unit(child):
                walk(child)

    walk(unit)
    return found


def check_applied(root: nn.Module, ties: Iterable[TieGroup], every_param: bool) -> None:
    """After the apply: every tie found before it is still one tensor under all its names, owned by exactly one
    data-parallel unit; with ``every_param``, no trainable parameter is outside every unit (its gradient would
    never be averaged). Identity checks only: no communication."""
    owner_count: dict[int, int] = defaultdict(int)
    for m in root.modules():
        if _is_unit(m):
            for pid in _owned_params(m):
                owner_count[pid] += 1
    present = dict(root.named_parameters(remove_duplicate=False))
    for tie in ties:
        tensors = [present[n] for n in tie.names if n in present]
        if len({id(t) for t in tensors}) > 1:
            raise ConfigError(f"tied parameters {tie.describe()}", "the applied plan gave them separate tensors, "
                              "so they would train apart from one device", "use a plan without this data/pipeline "
                              "split, or untie them (e.g. tie_word_embeddings=False)")
        if tensors and owner_count[id(tensors[0])] > 1:
            raise ConfigError(f"tied parameters {tie.describe()}", f"owned by {owner_count[id(tensors[0])]} "
                              "data-parallel units, which would each reduce its gradient",
                              "hold every module using the tie inside one module the model calls")
    if every_param:
        for name, p in root.named_parameters():
            if p.requires_grad and owner_count[id(p)] == 0:
                raise ConfigError(f"parameter '{name}'", "in no data-parallel unit, so its gradient would not be "
                                  "averaged over the data-parallel ranks", "hold it in a module the model calls")
