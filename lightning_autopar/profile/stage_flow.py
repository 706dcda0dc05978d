"""What a block-stack pipeline assumes of a model's dataflow, checked on its meta trace (``StageFlow``).

A pipeline stage other than the first runs the model's forward with zeros in place of what runs before the
blocks (the embeddings, a vision tower, an encoder: parallel/pipeline/standins.py) and the previous stage's
activation in place of its first block's input. That is exact only when what those parts compute reaches the
blocks through the first block's input alone. It is not when a block takes it as another argument (an
encoder's output for a decoder's cross-attention, a VLM's image features for cross-attention layers, the
embeddings ``x0`` every block of a modded-nanoGPT adds back), reads it inside its forward, or when code after the
blocks reads it (``x + x0`` before the head): those stages would see zeros, silently.

The recorder follows the values: the outputs of every module that holds parameters outside the blocks and runs
before the first block are *tainted*, and so is whatever an op computes from a tainted value outside the blocks
(not ops that read only a tensor's metadata or shape: ``new_zeros``, ``*_like``, ``x.to(y)``'s ``y``). A tainted
value reaching a block other than as its hidden state (the first positional tensor, else the first floating
keyword: ``hidden_slot``), a later block's hidden state, an op inside a block, or an op after the
last block is recorded as one line naming where it came from (``Trace.carried``).
"""

from __future__ import annotations

from typing import Any, ContextManager, Sequence

import torch
from torch.utils._pytree import tree_leaves

from lightning_autopar.profile.trace import Recorder, Run, Trace, _join, _reads_metadata

# ops whose result does not depend on a tensor argument's values (only its shape, dtype or device)
VALUE_FREE = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
                        "full_like", "rand_like", "randn_like", "randint_like", "size", "dim", "numel",
                        "is_floating_point", "is_complex", "get_device", "element_size"})
# ops that read their other tensor arguments' metadata only (``x.to(y)``: y's dtype and device)
SELF_ONLY = frozenset({"to", "type_as", "expand_as", "view_as", "reshape_as"})


def hidden_slot(args: tuple, kwargs: dict) -> int | str | None:
    """Where a block's hidden-state input is (what a pipeline stage replaces with the received activation):
    position 0 when it has positional arguments, else the first floating tensor keyword; None when neither."""
    if args:
        return 0
    return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


def hidden_argument(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A block's hidden-state input (``hidden_slot``), None where it is no tensor."""
    slot = hidden_slot(args, kwargs)
    value = args[0] if slot == 0 else kwargs[slot] if slot is not None else None
    return value if isinstance(value, torch.Tensor) else None


class StageFlow(Recorder, torch.overrides.TorchFunctionMode):
    """Records (``Trace.carried``) where a value computed by what runs before the blocks reaches the model by
    another way than the first block's hidden state (module doc). ``blocks``: the blocks' names as the trace's
    ``ModuleStack`` names them."""

    def __init__(self, blocks: Sequence[str]) -> None:
        torch.overrides.TorchFunctionMode.__init__(self)
        self.blocks = tuple(blocks)
        self.tainted: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (the part it came from, the tensor)
        self.exempt: set[int] = set()  # the first block's hidden state, read inside it: what the stage replaces
        self.in_first = False  # the first block's forward is running
        self.inside = 0  # block forwards running
        self.calls = 0  # block calls started
        self.clock = 0
        self.last_exit = -1
        self.late: list[tuple[int, str, str]] = []  # (clock, op, part): tainted ops outside the blocks after one
        self.found: list[str] = []

    def _taint(self, value: Any, source: str) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self.tainted[id(leaf)] = (source, leaf)

    def _source(self, leaf: Any) -> str | None:
        hit = self.tainted.get(id(leaf))
        return hit[0] if hit is not None and hit[1] is leaf else None

    def _note(self, line: str) -> None:
        if line not in self.found:
            self.found.append(line)

    def hooks(self, run: Run) -> list[Any]:
        handles = []
        prefix = run.stack.prefix
        for name, mod in run.model.named_modules():
            full = _join(prefix, name)
            if full in self.blocks:
                handles.append(mod.register_forward_pre_hook(
                    lambda mod, args, kwargs, full=full: self._enter(full, args, kwargs), with_kwargs=True))
                handles.append(mod.register_forward_hook(lambda mod, args, out: self._exit(), always_call=True))
            elif name and not any(b == full or b.startswith(full + ".") or full.startswith(b + ".")
                                  for b in self.blocks) and any(True for _ in mod.parameters()):
                handles.append(mod.register_forward_hook(
                    lambda mod, args, out, full=full: self._taint(out, full) if not self.calls else None))
        return handles

    def _enter(self, block: str, args: tuple, kwargs: dict) -> None:
        hidden = hidden_argument(args, kwargs)
        for leaf in tree_leaves((args, kwargs)):
            source = self._source(leaf)
            if source is None:
                continue
            if leaf is not hidden:
                self._note(f"block '{block}' takes a value computed from '{source}' besides its hidden state")
            elif self.calls:
                self._note(f"block '{block}' takes as its hidden state a value computed from '{source}', not "
                           "only the block before it's output")
        if hidden is not None and not self.calls:
            self.exempt.add(id(hidden))
        self.in_first = not self.calls
        self.calls += 1
        self.inside += 1
        self.clock += 1

    def _exit(self) -> None:
        self.in_first = False
        self.inside -= 1
        self.clock += 1
        if not self.inside:
            self.last_exit = self.clock

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        return [self]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.tainted or _reads_metadata(func):
            return out
        name = getattr(func, "__name__", "")
        if name in VALUE_FREE:
            return out
        read = args[:1] if name in SELF_ONLY else tree_leaves((args, kwargs))
        exempt = self.exempt if self.in_first else ()
        source = next((s for leaf in read if isinstance(leaf, torch.Tensor) and id(leaf) not in exempt
                       and (s := self._source(leaf)) is not None), None)
        if source is None:
            return out
        if self.inside:
            self._note(f"a block's forward reads a value computed from '{source}' ({name})")
            return out
        self._taint(out, source)
        if self.calls:
            self.clock += 1
            self.late.append((self.clock, name, source))
        return out

    def finish(self, run: Run, trace: Trace) -> None:
        for clock, op, source in self.late:
            if clock > self.last_exit:
                self._note(f"the model reads a value computed from '{source}' after its last block ({op})")
        trace.carried = list(self.found)
        self.tainted.clear()

