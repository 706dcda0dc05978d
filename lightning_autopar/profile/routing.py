"""MoE layers as the meta trace sees them: a router's selection deciding which experts process which tokens.

``Routing`` is a recorder of the one meta forward (``profile.trace.meta_forward``). It follows three things:

* scores: the output of an op that multiplies by a 2-D parameter (``F.linear``, ``x @ W.T``: the router's
  weight, an ``nn.Linear``'s or a plain parameter) and whatever is computed from it alone (softmax, a cast, a
  bias) carries that parameter;
* a selection: ``topk`` (``argmax``: top-1, as Switch Transformers route) over scores whose last dimension is one of the parameter's (E
  experts, E > k) starts a routing. Its outputs and everything computed from them (the expert ids, the masks
  compared against them, the token rows picked with them, their weights) are routed, for as long as the module
  calling the selecting module runs (the MoE layer);
* the experts: a module called with routed arguments (the rows an expert of a list gets; Hugging Face's fused
  experts called with (tokens, top-k ids, top-k weights); torchtitan's GroupedExperts with rows sorted by
  expert and their counts), outermost first, or a parameter of 2+ dimensions taken together with routed values
  (stacked expert weights indexed by the expert ids). An expert's own ops are not followed: its output is
  combined back into the tokens.

A data-dependent count over routed values (``nonzero``, one-argument ``where``: the tokens of one expert) has no
meta kernel; on meta tensors it gives the expected count, ``numel // E`` (tokens x k spread over E experts), so
the layer runs on to its experts. The recorder never takes structure from names, container classes or config
flags: a router is what produces the scores a selection reads, experts are what the selection feeds.

Following the dataflow costs every op of the trace, so ``Routing(follow=False)`` is dormant: it follows nothing
and only watches for a selection that could start a routing (``topk`` / ``argmax`` with 0 < k < the last
dimension's width, that width one of a 2-D parameter's dimensions: what a selection over a router's scores has). A
trace that never makes one has no routing; at the first one it stops the forward (``restart``), and the caller
traces again with ``Routing(follow=True)``, which follows from the first op. A model with no routing pays one
dormant trace; a routed one the trace up to its first router, then the full one.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
from torch.utils._pytree import tree_leaves

from lightning_autopar.profile.trace import Recorder, Run, StopAtCall, Trace, _join, _leaves

_SELECT = {torch.topk: 0, torch.Tensor.topk: 0, torch.argmax: 1, torch.Tensor.argmax: 1}  # -> k (0: its argument)
_COUNTS = (torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere)


@dataclass(frozen=True)
class RoutedLayer:
    """One routing the trace saw: ``router`` the module holding the scoring weight, ``experts`` the modules the
    selection sent tokens to (E of them: a list of experts; one: the experts' stacked weights), the expert count
    E (the scores' width), k per token, and how the experts were called (``expert_call``): "indices" with the
    top-k expert ids (Hugging Face's ``experts(tokens, top_k_index, top_k_weights)``), "grouped" with a count per
    expert (torchtitan's ``experts(tokens sorted by expert, num_tokens_per_expert)``), "" otherwise."""

    router: str
    experts: tuple[str, ...]
    num_experts: int
    top_k: int
    expert_call: str = ""

    def relative(self, rel: Any) -> RoutedLayer:
        return RoutedLayer(rel(self.router), tuple(rel(e) for e in self.experts), self.num_experts, self.top_k,
                           self.expert_call)


@dataclass
class _Selection:
    router: str  # the scoring parameter's module
    num_experts: int
    top_k: int
    scope: str  # the module calling the selecting module: the routing lasts while it runs
    depth: int
    experts: dict[str, str] = field(default_factory=dict)  # expert module -> its call (RoutedLayer.expert_call)
    ended: bool = False


def _owner(param: str) -> str:
    return param.rpartition(".")[0]


def within(name: str, ancestor: str) -> bool:
    """``name`` is the module ``ancestor`` or below it ("" holds every module)."""
    return not ancestor or name == ancestor or name.startswith(ancestor + ".")


class Routing(Recorder, torch.overrides.TorchFunctionMode):
    """The MoE layers of the forward (``Trace.routing``), found from its dataflow (module docstring)."""

    def __init__(self, follow: bool = True) -> None:
        torch.overrides.TorchFunctionMode.__init__(self)
        self.follow = follow  # False: dormant until a selection that could start a routing (module docstring)
        self.restart = False  # a dormant recorder stopped the forward there: trace again with follow=True
        self.widths: set[int] = set()  # the dimensions of the 2-D parameters
        self.run: Run | None = None
        self.params: dict[int, tuple[weakref.ref, str]] = {}  # a parameter, or a view of one -> its name
        self.shapes: dict[str, torch.Size] = {}  # parameter name -> its shape
        self.flat: set[str] = set()  # the names of the 2-D parameters (a product with one gives scores)
        self.scores: dict[int, tuple[weakref.ref, str]] = {}  # computed from one parameter's product
        self.routed: dict[int, tuple[weakref.ref, int]] = {}  # -> the selection it comes from
        self.selections: list[_Selection] = []
        self.inside: list[int] = []  # the selections whose expert is running (its ops are not followed)
        self.running: list[str] = []  # those experts, innermost last

    # ------------------------------------------------------------------------------------------- tensors

    @staticmethod
    def _get(table: dict[int, tuple[weakref.ref, Any]], value: Any) -> Any:
        entry = table.get(id(value)) if isinstance(value, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is value else None

    @staticmethod
    def _mark(table: dict[int, tuple[weakref.ref, Any]], value: Any, tag: Any) -> None:
        """Tag the tensors of ``value``, held weakly: the trace frees what the model frees."""
        if isinstance(value, torch.Tensor):
            table[id(value)] = (weakref.ref(value), tag)
            return
        if value is None or isinstance(value, (int, float, bool, torch.Size)):
            return
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                table[id(leaf)] = (weakref.ref(leaf), tag)

    def _active(self, index: int) -> bool:
        sel = self.selections[index]
        stack = self.run.stack.stack
        if not sel.ended and not (sel.depth < len(stack) and stack[sel.depth] == sel.scope):
            sel.ended = True
        return not sel.ended and index not in self.inside

    def _routing(self, leaves: Any) -> int | None:
        """The live selection one of ``leaves`` comes from, None when none does."""
        for leaf in leaves:
            index = self._get(self.routed, leaf)
            if index is not None and self._active(index):
                return index
        return None

    # ------------------------------------------------------------------------------------------- ops

    def _select(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """A selection over one parameter's scores starts a routing."""
        scores = args[0] if args else None
        param = self._get(self.scores, scores)
        shape = self.shapes.get(param, ()) if param else ()
        k = _SELECT[func] or kwargs.get("k", args[1] if len(args) > 1 else 0)
        width = scores.shape[-1] if isinstance(scores, torch.Tensor) and scores.dim() else 0
        if len(shape) != 2 or width not in shape or not isinstance(k, int) or not 0 < k < width:
            return
        stack = self.run.stack.stack
        depth = max(len(stack) - 2, 0)
        self.selections.append(_Selection(_owner(param), width, k, stack[depth] if stack else "", depth))
        self._mark(self.routed, result, len(self.selections) - 1)

    def _count(self, index: int, value: torch.Tensor, as_tuple: bool) -> Any:
        """The positions of the true entries of a routed mask on meta: the expected count (numel // E)."""
        rows = max(1, value.numel() // self.selections[index].num_experts)
        if as_tuple:
            return tuple(torch.empty(rows, dtype=torch.long, device="meta") for _ in range(max(value.dim(), 1)))
        return torch.empty(rows, max(value.dim(), 1), dtype=torch.long, device="meta")

    def _param_use(self, index: int, leaves: Any) -> None:
        """A stacked expert weight taken with routed values: its module holds the experts."""
        sel = self.selections[index]
        for leaf in leaves:
            name = self._get(self.params, leaf)
            if name is not None and leaf.dim() >= 2 and _owner(name) != sel.router:
                sel.experts.setdefault(_owner(name), False)

    def _may_select(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """What ``_select`` needs of a selection besides its scores' parameter: 0 < k < the scores' width, the
        width one of a 2-D parameter's dimensions."""
        scores = args[0] if args else None
        k = _SELECT[func] or kwargs.get("k", args[1] if len(args) > 1 else 0)
        width = scores.shape[-1] if isinstance(scores, torch.Tensor) and scores.dim() else 0
        return isinstance(k, int) and 0 < k < width and width in self.widths

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.follow:
            if func in _SELECT and self._may_select(func, args, kwargs):
                self.restart = True
                raise StopAtCall("", args, kwargs)  # a BaseException: the model's own handlers let it through
            return func(*args, **kwargs)
        leaves = _leaves(args, kwargs)
        index = self._routing(leaves) if self.routed else None
        one_arg_where = func is torch.where and len(args) == 1 and not kwargs
        if index is not None and (func in _COUNTS or one_arg_where) and args[0].is_meta:
            result = self._count(index, args[0], one_arg_where or bool(kwargs.get("as_tuple")))
        else:
            result = func(*args, **kwargs)
        if index is not None:
            self._param_use(index, leaves)
            if not (args and result is args[0] and self._get(self.routed, args[0]) is None):  # in place on tokens not routed
                self._mark(self.routed, result, index)
        self._product(leaves, result)
        if func in _SELECT:
            self._select(func, args, kwargs, result)
        return result

    def _product(self, leaves: Any, result: Any) -> None:
        """Views of parameters keep their name; a product with a 2-D one and what follows from it alone carry
        it as scores. (Runs on every op of every trace: the lookups of ``_get`` inline, one pass over the
        leaves.)"""
        params, scores, flat = self.params, self.scores, self.flat
        first = two_d = score = None
        others = False
        for t in leaves:
            if not isinstance(t, torch.Tensor):
                continue
            entry = params.get(id(t))
            if entry is not None and entry[0]() is t:
                first = first or entry[1]
                if two_d is None and entry[1] in flat:
                    two_d = entry[1]
                continue
            others = True
            if score is None:
                entry = scores.get(id(t))
                if entry is not None and entry[0]() is t:
                    score = entry[1]
        if first is not None and not others:
            self._mark(params, result, first)
        elif two_d is not None or score is not None:
            self._mark(scores, result, two_d or score)

    # ------------------------------------------------------------------------------------------- modules

    def _called(self, name: str, args: tuple, kwargs: dict) -> None:
        leaves = _leaves(args, kwargs)
        index = self._routing(leaves) if self.routed and not self.inside else None
        if index is None:
            return
        sel = self.selections[index]
        if within(sel.router, name) or not within(name, sel.scope):
            return
        sel.experts[name] = sel.experts.get(name) or self._call_kind(index, sel, leaves)
        self.inside.append(index)
        self.running.append(name)

    def _call_kind(self, index: int, sel: _Selection, leaves: Any) -> str:
        """How a module is called with routed values (``RoutedLayer.expert_call``): "indices" when one argument
        is the top-k expert ids ([..., k] integers), "grouped" when one is a count per expert (one dimension of
        E: the rows come sorted by expert), else ""."""
        routed = [t for t in leaves if isinstance(t, torch.Tensor) and self._get(self.routed, t) == index]
        if any(not t.is_floating_point() and t.dim() and t.shape[-1] == sel.top_k for t in routed):
            return "indices"
        if any(t.dim() == 1 and t.shape[0] == sel.num_experts for t in routed):
            return "grouped"
        return ""

    def _returned(self, name: str) -> None:
        if self.running and self.running[-1] == name:
            self.running.pop()
            self.inside.pop()

    def hooks(self, run: Run) -> list[Any]:
        self.run = run
        names = {n: run.state.names.get(id(t), [_join(run.stack.prefix, n)])[0] for n, t in run.state.params.items()}
        self.params = {id(t): (weakref.ref(t), names[n]) for n, t in run.state.params.items()}
        self.shapes = {names[n]: t.shape for n, t in run.state.params.items()}
        self.flat = {name for name, shape in self.shapes.items() if len(shape) == 2}
        self.widths = {d for name in self.flat for d in self.shapes[name]}
        if not self.follow:
            return []
        handles = []
        for name, mod in run.model.named_modules():
            full = _join(run.stack.prefix, name)
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, kw, full=full: self._called(full, a, kw), with_kwargs=True))
            handles.append(mod.register_forward_hook(lambda m, a, o, full=full: self._returned(full),
                                                     always_call=True))
        return handles

    def contexts(self, run: Run) -> list[ContextManager[Any]]:
        return [self]

    def finish(self, run: Run, trace: Trace) -> None:
        trace.routing = [RoutedLayer(s.router, tuple(s.experts), s.num_experts, s.top_k,
                                     next((kind for kind in s.experts.values() if kind), ""))
                         for s in self.selections if s.experts]

