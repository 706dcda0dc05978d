"""Structure and cost of an ``nn.Module`` without running it on a real device.

Parameters are swapped for meta tensors (``torch.func.functional_call``), so a model too big for one device
(or already built on the meta device) is analysed without allocating it. We find:

* the repeated blocks: the largest ``ModuleList``/``Sequential`` of same-class children;
* inside a block, from the traced dataflow where there is a trace: the attention's o projection reads the output
  of an attention call (``scaled_dot_product_attention``, or eager attention's 4-D softmax), its q/k/v (or one
  fused qkv) feed that call; the MLP's down projection (ffn -> hidden) reads, through an activation or gate * up,
  projections reading the hidden states -- wherever these modules sit (HF BERT's o in ``attention.output``, its
  MLP from ``intermediate.dense`` to ``output.dense``);
* otherwise by structure and shapes rather than attribute names: the attention (the module that calls
  ``scaled_dot_product_attention`` or a 4-D softmax; its linears split into q/k/v/o or fused qkv), the MLP
  (linears hidden -> ffn [gate, up] and ffn -> hidden [down]);
* MoE layers from what the traced code does (profile/routing.py): a router's scores (a product with a 2-D
  weight) selected top-k, the selection deciding which expert modules, or which slices of stacked expert weights
  [E, ...], process which tokens -- whatever the containers or config flags; without a trace, by structure (a
  router hidden -> E next to a list of E identical MLPs, or a router weight [E, hidden] next to a module holding
  3-D parameters [E, ...]);
* embeddings (token, position), the final norm and the LM head (tied or not);
* per block: parameters, forward+backward FLOPs (``FlopCounterMode``) and saved-activation bytes;
* for tensor parallelism, from what the traced code does: projections that multiply ``x @ W`` (GPT-2's Conv1D,
  weight [in, out]), how a fused qkv / gate_up output is cut (split, chunk, slices, a view into pieces or kv
  groups), norms applied to a projection's full output (OLMoE's q/k norms), and a dry run of block 0's attention
  and MLP on one TP rank's local shapes, which finds the attributes the model's code needs divided (a head count,
  GPT-2's ``split_size``, litgpt's ``config.n_head``) or the reason its code cannot run that way.

What could not be classified is listed in ``ModelAnalysis.unclassified`` rather than guessed.
"""


from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from lightning_autopar.profile.records import (AttentionInfo, BlockInfo, MLPInfo, ModelAnalysis, MoEInfo,  # noqa: F401
                                               _join, one_class_children)
from lightning_autopar.profile.routing import RoutedLayer, Routing, within
from lightning_autopar.profile.tp_layout import (MAX_DRY_RUNS, divide_attributes, fused_layout,  # noqa: F401
                                                 leaf_width_attributes, local_width_attributes, _tp_feasibility)
from lightning_autopar.profile.trace import (ATTENTION_MARK, BlockCost, Dataflow, DropoutCalls, Example,  # noqa: F401
                                             ParameterUses, Probe, Trace, blocks_stand_in_on_failure, first_line,
                                             implements_forward, meta_buffer, meta_example, meta_forward,
                                             meta_friendly, token_ids)
from lightning_autopar.specs import ModelSpec

HEAD_ATTR_HINTS = ("head", "heads")
SHORT_TRACE_SEQ = 8  # the sequence length of the fallback trace


# ------------------------------------------------------------------------------------------- structure


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_modules(container: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (key, block) children of a block container, in order: a ModuleList's or Sequential's indices,
    a ModuleDict's keys (torchtitan's ``layers``), any other holder's attribute names."""
    return list(container.named_children())


def _repeated(child: nn.Module) -> bool:
    """``child`` holds >= 2 children of one class that are not Linears (a block container: find_block_list)."""
    kids = one_class_children(child)
    return bool(kids) and not isinstance(kids[0], nn.Linear)


def in_any_blocks(module: nn.Module) -> set[str]:
    """The names of the modules inside a block of any repeated stack of ``module`` (an encoder-decoder's or a
    vision-language model's other stacks too): an embedding's head or a final norm is never one of them."""
    containers = [f"{name}." for name, child in module.named_modules() if name and _repeated(child)]
    return {n for n, _ in module.named_modules() if any(n.startswith(c) for c in containers)}


def find_block_list(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The container of >= 2 children of one class (the blocks), whatever its class: a ModuleList, a Sequential,
    a ModuleDict (torchtitan keeps its blocks in ``layers``, a ModuleDict), or a module of the user's own holding
    only its blocks. Linears (a projection list) are not blocks. Of several stacks (a vision-language model's tower
    and text model, an encoder-decoder's two), the one the token embedding feeds: the stack whose nearest
    ancestor holding an embedding holds the largest one (the token table, not a tower's position table), the
    nearest such ancestor first (a text model's own, before the whole VLM's); then the most parameters."""
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    token = max(tables, key=lambda m: m.num_embeddings) if tables else None
    holders = {name: m for name, m in module.named_modules() if token is not None and any(
        isinstance(c, nn.Embedding) for c in m.modules())}
    best: tuple[tuple[int, int, int], str, nn.Module] | None = None
    for name, child in module.named_modules():
        if not _repeated(child):
            continue
        parts = name.split(".")
        owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1) if ".".join(parts[:i]) in holders),
                     None)
        feeds = owner is not None and any(m is token for m in holders[owner].modules())
        key = (int(feeds), owner.count(".") + 1 if feeds and owner else 0, _param_count(child))
        if best is None or key > best[0]:
            best = (key, name, child)
    return (best[1], best[2]) if best else None


@dataclass(frozen=True)
class Projection:
    """A child computing ``x @ W^T`` (nn.Linear, weight [out, in]) or ``x @ W`` (GPT-2's Conv1D, weight [in, out];
    ``transposed``). Which one a non-Linear module is comes from the op its forward applies to the weight in the
    meta trace (``linear`` vs ``addmm``/``mm``/``matmul``), since a square weight's shape cannot tell."""

    in_features: int
    out_features: int
    transposed: bool = False


Orientation = dict[int, bool]  # id(module) -> weight stored [in, out], for traced non-Linear projections


def _projection(m: nn.Module, orient: Orientation | None = None) -> Projection | None:
    """``m`` as a projection: an nn.Linear, or a module whose traced forward multiplied its 2-D weight."""
    if isinstance(m, nn.Linear):
        return Projection(m.in_features, m.out_features)
    if orient and id(m) in orient and isinstance(getattr(m, "weight", None), torch.Tensor):
        rows, cols = m.weight.shape
        return Projection(rows, cols, True) if orient[id(m)] else Projection(cols, rows)
    return None


def _linears(module: nn.Module, orient: Orientation | None = None) -> dict[str, Projection]:
    return {n: p for n, m in module.named_children() if (p := _projection(m, orient)) is not None}


def _classify_mlp(fqn: str, module: nn.Module, hidden: int, orient: Orientation | None = None) -> MLPInfo | None:
    """hidden -> ffn linears (up, and gate for swiglu) and one ffn -> hidden linear (down); or one hidden -> 2*ffn
    linear (fused gate and up) and the down projection."""
    lin = _linears(module, orient)
    flipped = [n for n, m in lin.items() if m.transposed]
    names = list(lin)
    ins = [n for n in names if lin[n].in_features == hidden and lin[n].out_features != hidden]
    outs = [n for n in names if lin[n].out_features == hidden and lin[n].in_features != hidden]
    if not ins and len(names) in (2, 3) and all(lin[n].in_features == lin[n].out_features == hidden for n in names):
        ins, outs = names[:-1], names[-1:]  # ffn == hidden: fall back to definition order
    if len(outs) != 1 or len(ins) not in (1, 2):
        return None
    down = outs[0]
    ffn = lin[down].in_features
    if len(ins) == 1 and lin[ins[0]].out_features == 2 * ffn:
        return MLPInfo(fqn=fqn, up=ins[0], down=down, ffn_hidden=ffn, gate_up=ins[0], transposed=flipped)
    if any(lin[n].out_features != ffn for n in ins):
        return None
    if len(ins) == 1:
        return MLPInfo(fqn=fqn, up=ins[0], down=down, ffn_hidden=ffn, transposed=flipped)
    # swiglu: the gate goes through the activation; prefer its usual names, else the first defined
    gate = next((n for n in ins if "gate" in n or n in ("w1", "fc_1")), ins[0])
    up = next(n for n in ins if n != gate)
    return MLPInfo(fqn=fqn, up=up, down=down, gate=gate, ffn_hidden=ffn, transposed=flipped)


def _classify_attention(fqn: str, module: nn.Module, hidden: int, heads: int, head_dim: int,
                        kv_heads: int, orient: Orientation | None = None) -> AttentionInfo:
    info = AttentionInfo(fqn=fqn, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    lin = _linears(module, orient)
    info.transposed = [n for n, m in lin.items() if m.transposed]
    ins = [n for n, m in lin.items() if m.in_features == hidden]
    outs = [n for n, m in lin.items() if m.out_features == hidden and m.in_features == heads * head_dim]
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    fused = [n for n in ins if lin[n].out_features == q_width + 2 * kv_width and n not in outs[-1:]]
    if fused and len(ins) - len(outs[-1:] if outs[-1:] and outs[-1] in ins else []) == 1:
        info.qkv = fused[0]
    else:
        proj_in = [n for n in ins if not (outs and n == outs[-1])]
        q = [n for n in proj_in if lin[n].out_features == q_width]
        kv = [n for n in proj_in if lin[n].out_features == kv_width and n not in q[:1]]
        if q and len(kv) >= 2:
            info.q, info.k, info.v = q[0], kv[0], kv[1]
        elif len(q) >= 3:  # MHA: all three have the same width; keep definition order
            info.q, info.k, info.v = q[0], q[1], q[2]
    if outs:
        info.o = outs[-1]
    _head_attributes(info, module, "", heads, kv_heads)
    return info


def _head_attributes(info: AttentionInfo, module: nn.Module, path: str, heads: int, kv_heads: int) -> None:
    """Add ``module``'s integer attributes named like a head count (at ``path`` below the attention module) to
    ``info.heads_attrs`` / ``info.kv_heads_attrs``: what TP divides when no dry run could check it."""
    for attr, value in vars(module).items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if not any(h in attr.lower() for h in HEAD_ATTR_HINTS) or "dim" in attr.lower() or "size" in attr.lower():
            continue
        if "kv" in attr.lower() or "key_value" in attr.lower() or "group" in attr.lower():
            if value == kv_heads:
                info.kv_heads_attrs.append(_join(path, attr))
        elif value == heads:
            info.heads_attrs.append(_join(path, attr))


# ------------------------------------------------------------------------------------------- structure from dataflow
#
# Where attention and the MLP sit is read from what block 0's forward does, not from module boundaries: the o
# projection is the one reading an attention call's output, q/k/v the ones feeding that call; the MLP's down
# projection reads (through an activation, or gate * up) projections that read the hidden states. So Hugging
# Face BERT's attention (q/k/v in ``attention.self``, o in the sibling ``attention.output``) and its MLP
# (``intermediate.dense`` -> ``output.dense``) are found like any other; paths are relative to the innermost
# module holding all the parts (``AttentionInfo.fqn`` / ``MLPInfo.fqn``, possibly the block itself: "").


@dataclass(frozen=True)
class _BlockFlow:
    """Block 0's projections (relative to the block, in call order) and where each one's input comes from."""

    projections: dict[str, Projection]
    inputs: dict[str, frozenset[str]]  # projection -> projections / attention marks its input is computed from
    attention: list[tuple[str, frozenset[str], frozenset[str], frozenset[str]]]  # (site, q, k, v sources)


def _block_flow(traced: Trace | None, block_fqn: str, block: nn.Module, orient: Orientation) -> _BlockFlow | None:
    """Block 0's dataflow from the trace, names relative to the block; None without a trace."""
    probe = traced.probe if traced is not None else None
    if probe is None or not probe.inputs:
        return None
    prefix = block_fqn + "."

    def rel(name: str) -> str:
        if name.startswith(ATTENTION_MARK):
            return ATTENTION_MARK + rel(name[len(ATTENTION_MARK):])
        return "" if name == block_fqn else name[len(prefix):] if name.startswith(prefix) else name

    projections, inputs = {}, {}
    for name, sources in probe.inputs.items():
        local = rel(name)
        found = _projection(block.get_submodule(local), orient)
        if found is not None:
            projections[local] = found
            inputs[local] = frozenset(rel(n) for n in sources)
    attention = [(rel(site), *(frozenset(rel(n) for n in src) for src in qkv)) for site, *qkv in probe.attention
                 if site == block_fqn or site.startswith(prefix)]
    return _BlockFlow(projections, inputs, attention)


def _common_module(paths: list[str]) -> str:
    """The innermost module containing every module at ``paths`` (relative to the block; "" is the block)."""
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _under(fqn: str, name: str) -> str:
    """``name`` (relative to the block) relative to its ancestor module ``fqn``."""
    return name[len(fqn) + 1:] if fqn else name


def _attention_qkv(flow: _BlockFlow, site: str, sources: tuple[frozenset[str], ...], o: str,
                   q_width: int) -> list[str] | None:
    """[qkv] or [q, k, v]: the projections feeding the attention call at ``site``. SDPA: each of its q, k, v comes
    from one projection (the same one when fused). A softmax (eager attention): the projections o reads through
    softmax(q k^T) @ v, q the first called of the q width, k and v in call order."""
    if any(sources):
        if any(len(src) != 1 for src in sources):
            return None
        q, k, v = (next(iter(src)) for src in sources)
        names = [q] if q == k == v else [q, k, v] if len({q, k, v}) == 3 else []
    else:
        order = list(flow.projections)
        feeding = flow.inputs[o] - {ATTENTION_MARK + site}
        names = sorted(feeding, key=lambda n: order.index(n) if n in flow.projections else -1)
        if len(names) == 3:
            q = next((n for n in names if flow.projections.get(n, Projection(0, 0)).out_features == q_width), names[0])
            names = [q, *(n for n in names if n != q)]
    if len(names) not in (1, 3) or any(n not in flow.projections for n in names):
        return None
    return names


def _attention_from_flow(flow: _BlockFlow, block: nn.Module, hidden: int, heads: int, head_dim: int,
                         kv_heads: int) -> AttentionInfo | None:
    """Block 0's attention from the dataflow: o reads the first attention call's output; q/k/v (or one fused
    qkv) feed it. None when the dataflow does not show a whole attention with the traced head geometry."""
    if not flow.attention or not heads:
        return None
    site, *sources = flow.attention[0]
    o = next((n for n, src in flow.inputs.items() if ATTENTION_MARK + site in src), None)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    names = _attention_qkv(flow, site, tuple(sources), o, q_width) if o is not None else None
    if names is None or o in names:
        return None
    proj = flow.projections
    widths = [proj[n].out_features for n in names]
    if proj[o].out_features != hidden or proj[o].in_features != q_width or any(
            proj[n].in_features != hidden for n in names):
        return None
    if widths not in ([q_width + 2 * kv_width], [q_width, kv_width, kv_width]):
        return None
    fqn = _common_module([_parent(n) for n in (*names, o)] + [site])
    info = AttentionInfo(fqn=fqn, heads=heads, kv_heads=kv_heads, head_dim=head_dim, o=_under(fqn, o))
    if len(names) == 1:
        info.qkv = _under(fqn, names[0])
    else:
        info.q, info.k, info.v = (_under(fqn, n) for n in names)
    info.transposed = [_under(fqn, n) for n in (*names, o) if proj[n].transposed]
    # head-count attributes on the modules from the attention module down to the one calling attention
    path = _under(fqn, site) if site != fqn else ""
    parts = path.split(".") if path else []
    for depth in range(len(parts) + 1):
        sub = ".".join(parts[:depth])
        _head_attributes(info, block.get_submodule(_join(fqn, sub)), sub, heads, kv_heads)
    return info


def _mlp_from_flow(flow: _BlockFlow, hidden: int, attention: set[str]) -> MLPInfo | None:
    """Block 0's MLP from the dataflow: a down projection writing ``hidden`` whose input is computed from one
    (up, or a fused gate/up of twice its width) or two (gate and up) projections reading ``hidden`` and nothing
    else (no attention call, no other projection), none of them attention's. Inside a list (an expert of a
    ModuleList) it is not the block's MLP."""
    proj, order = flow.projections, list(flow.projections)
    for down, sources in flow.inputs.items():
        if down in attention or proj[down].out_features != hidden or not sources \
                or any(n not in proj or n in attention or n == down for n in sources):
            continue
        ins = sorted(sources, key=order.index)
        ffn = proj[down].in_features
        widths = [proj[n].out_features for n in ins]
        fqn = _common_module([_parent(n) for n in (*ins, down)])
        if any(proj[n].in_features != hidden for n in ins) or any(p.isdigit() for p in fqn.split(".")):
            continue
        flipped = [_under(fqn, n) for n in (*ins, down) if proj[n].transposed]
        rel = [_under(fqn, n) for n in ins]
        if widths == [2 * ffn]:
            return MLPInfo(fqn=fqn, up=rel[0], down=_under(fqn, down), ffn_hidden=ffn, gate_up=rel[0],
                           transposed=flipped)
        if widths == [ffn]:
            return MLPInfo(fqn=fqn, up=rel[0], down=_under(fqn, down), ffn_hidden=ffn, transposed=flipped)
        if widths == [ffn, ffn]:
            # which of the two goes through the activation does not change the split: the usual names, else
            # the first called
            gate = next((n for n in rel if "gate" in n.rpartition(".")[2] or n.rpartition(".")[2] in ("w1", "fc_1")),
                        rel[0])
            return MLPInfo(fqn=fqn, up=next(n for n in rel if n != gate), down=_under(fqn, down), gate=gate,
                           ffn_hidden=ffn, transposed=flipped)
    return None


def _fits(block: nn.Module, fqn: str, names: list[str | None], like: nn.Module) -> bool:
    """Whether ``block`` has the projections ``names`` (below ``fqn``) with the shapes they have in ``like``
    (block 0): blocks of one class can still differ (an MoE every other block)."""
    for name in filter(None, names):
        path = _join(fqn, name)
        try:
            mine, theirs = block.get_submodule(path), like.get_submodule(path)
        except AttributeError:
            return False
        weight, ref = getattr(mine, "weight", None), getattr(theirs, "weight", None)
        if not isinstance(weight, torch.Tensor) or not isinstance(ref, torch.Tensor) or weight.shape != ref.shape:
            return False
    return True


def _top_k(*modules: nn.Module) -> int:
    """The routed-experts-per-token count from the first module with an int attribute named like it."""
    for module in modules:
        for attr, value in vars(module).items():
            if isinstance(value, int) and not isinstance(value, bool) and (
                    "top" in attr.lower() or attr.lower() in ("k", "num_experts_per_tok")):
                return value
    return 0


def _expert_call(experts: nn.Module) -> str:
    """"indices" when the fused experts' forward takes (tokens, top-k expert ids, top-k weights), as Hugging Face's
    does, else "" (``MoEInfo.expert_call``)."""
    try:
        params = list(inspect.signature(experts.forward).parameters.values())
    except (TypeError, ValueError):
        return ""
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return "indices" if len(positional) == 3 else ""


def _fused_experts(experts: nn.Module, num: int, hidden: int,
                   alone: bool = True) -> tuple[list[str], int, bool] | None:
    """(parameters, one expert's FFN width, gated) of a module holding E = ``num`` experts' stacked weights: its
    own parameters all have E along dim 0, at least one 3-D (``alone``: and its children hold none). Projections
    as nn.Linear stores them ([out, in]), or transposed when the experts module says ``is_transposed``: inputs
    read ``hidden``, the output projection writes it; one input of width 2*ffn is a fused gate+up. None for
    another module."""
    params = dict(experts.named_parameters(recurse=False))
    if not params or any(p.dim() < 2 or p.shape[0] != num for p in params.values()) \
            or not any(p.dim() == 3 for p in params.values()) \
            or (alone and _param_count(experts) != sum(p.numel() for p in params.values())):
        return None
    flip = bool(getattr(experts, "is_transposed", False))
    shapes = {n: (p.shape[2], p.shape[1]) if flip else (p.shape[1], p.shape[2])
              for n, p in params.items() if p.dim() == 3}  # name -> (out, in)
    ins = [n for n, (o, i) in shapes.items() if i == hidden and o != hidden]
    outs = [n for n, (o, i) in shapes.items() if o == hidden and i != hidden]
    if len(outs) != 1:
        return None
    ffn = shapes[outs[0]][1]
    widths = sorted(shapes[n][0] for n in ins)
    if widths not in ([ffn], [2 * ffn], [ffn, ffn]):
        return None
    return list(params), ffn, widths != [ffn]


def _classify_fused_moe(fqn: str, module: nn.Module, hidden: int) -> MoEInfo | None:
    """The fused layout by structure (no trace): a router child whose ``weight`` is [E, hidden] (not an
    nn.Linear; or a router module holding one gate nn.Linear [E, hidden], as torchtitan's) and an experts child
    holding the E experts' stacked weights (``_fused_experts``)."""
    children = dict(module.named_children())
    for r_name, router in children.items():
        if isinstance(router, nn.Linear):
            continue
        weight = getattr(router, "weight", None)
        gates = [(n, m) for n, m in router.named_children() if isinstance(m, nn.Linear)]
        if not isinstance(weight, torch.Tensor) and len(gates) == 1:  # torchtitan: a router module, its gate Linear
            r_name, weight = f"{r_name}.{gates[0][0]}", gates[0][1].weight
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden \
                or weight.shape[0] < 2:
            continue
        num = weight.shape[0]
        for e_name, experts in children.items():
            found = _fused_experts(experts, num, hidden) if e_name != r_name else None
            if found is not None:
                params, ffn, gated = found
                return MoEInfo(fqn=fqn, router=r_name, experts=e_name, num_experts=num,
                               top_k=_top_k(module, router), fused_params=params, ffn_hidden=ffn, gated=gated,
                               expert_call=_expert_call(experts))
    return None


def _classify_moe(fqn: str, module: nn.Module, hidden: int, orient: Orientation | None = None) -> MoEInfo | None:
    lists = [(n, m) for n, m in module.named_children() if isinstance(m, nn.ModuleList) and len(m) >= 2]
    for name, experts in lists:
        if len({type(e) for e in experts}) != 1:
            continue
        routers = [n for n, m in _linears(module, orient).items()
                   if m.in_features == hidden and m.out_features == len(experts)]
        if not routers:
            # routers are sometimes wrapped (a "gate" module holding the linear)
            routers = [f"{n}.{ln}" for n, m in module.named_children() if not isinstance(m, nn.ModuleList)
                       for ln, l in _linears(m, orient).items()
                       if l.in_features == hidden and l.out_features == len(experts)]
        if not routers:
            continue
        return _listed_moe(fqn, routers[0], name, experts[0], len(experts), _top_k(module), hidden, orient)
    return _classify_fused_moe(fqn, module, hidden)


def _listed_moe(fqn: str, router: str, experts: str, first: nn.Module, num: int, top_k: int, hidden: int,
                orient: Orientation | None) -> MoEInfo:
    """An MoE layer whose experts are modules of their own (``experts`` holds them; ``first`` is one)."""
    expert_mlp = _classify_mlp("", first, hidden, orient)
    return MoEInfo(fqn=fqn, router=router, experts=experts, num_experts=num, top_k=top_k, expert_mlp=expert_mlp,
                   ffn_hidden=expert_mlp.ffn_hidden if expert_mlp else 0, gated=bool(expert_mlp and expert_mlp.gate))


def _routed_moe(block: nn.Module, block_fqn: str, routed: list[RoutedLayer], hidden: int,
                orient: Orientation | None) -> MoEInfo | None:
    """The block's MoE layer from the trace's routing (``profile.routing``): the innermost module holding the
    router and the experts; the experts' container (a list of E expert modules) or the module holding their
    stacked weights. None when the trace saw no routing in the block, or experts of neither kind."""
    layer = next((r for r in routed if within(r.router, block_fqn)), None)
    if layer is None:
        return None
    router, experts = _under(block_fqn, layer.router), [_under(block_fqn, e) for e in layer.experts]
    holder = _common_module(experts) if len(experts) > 1 else experts[0]
    fqn = _common_module([router, holder])
    if len(experts) > 1:
        if len(experts) != layer.num_experts or any(_parent(e) != holder for e in experts):
            return None
        return _listed_moe(fqn, _under(fqn, router), _under(fqn, holder), block.get_submodule(experts[0]),
                           layer.num_experts, layer.top_k, hidden, orient)
    children = one_class_children(block.get_submodule(holder))
    if len(children) == layer.num_experts and holder != fqn:
        # one module called with the routing that dispatches to its E experts itself (Switch Transformers'
        # experts: a ModuleDict with a forward of its own, called with a one-hot dispatch mask)
        return _listed_moe(fqn, _under(fqn, router), _under(fqn, holder), children[0], layer.num_experts,
                           layer.top_k, hidden, orient)
    # the stacked weights may sit in the MoE layer itself, beside its router
    found = _fused_experts(block.get_submodule(holder), layer.num_experts, hidden, alone=holder != fqn)
    if found is None:
        return None
    params, ffn, gated = found
    return MoEInfo(fqn=fqn, router=_under(fqn, router), experts=_under(fqn, holder), num_experts=layer.num_experts,
                   top_k=layer.top_k, fused_params=params, ffn_hidden=ffn, gated=gated,
                   expert_call=layer.expert_call)


def plain_moe_layout(module: nn.Module, info: MoEInfo) -> bool:
    """A plain MoE (no ``route``): a router (an ``nn.Linear``, or any module whose scores the trace saw select the
    experts) and an ``nn.ModuleList`` or ``nn.ModuleDict`` of experts the analysis found to be MLPs from hidden to
    hidden, so an expert call's output has its input's shape. Expert parallelism runs such a layer's forward twice
    (capture, then replay: ``parallel.experts.PlainExpertForward``), which the planner prices
    (``ModelSpec.moe_replay``)."""
    if info.fused or callable(getattr(module, "route", None)) or info.expert_mlp is None:
        return False
    return isinstance(module.get_submodule(info.experts), (nn.ModuleList, nn.ModuleDict))



# ------------------------------------------------------------------------------------------- tracing


def _meta_run(model: nn.Module, batch: int, seq_len: int, block_fqns: list[str],
              example: Example | None = None) -> Trace:
    """Forward + backward on meta tensors (``profile.trace.meta_forward``): per-block FLOPs, saved bytes, the
    attention call sites, how each projection uses its weight, and block 0's calls (``Probe``); blocks that cannot
    run on meta tensors stand in as identity. The forward gets ``example`` (a real call's arguments, e.g. a ViT's
    pixel values) when given, else token ids of shape (batch, seq_len)."""
    call = token_ids(batch, seq_len) if example is None else meta_example(example, batch)
    for follow in (False, True):  # Routing dormant first: a model with no router is traced once, without following
        routing = Routing(follow)
        recorders = [BlockCost(block_fqns), ParameterUses(),
                     Dataflow(block_fqns[0] if block_fqns else None, weights=True), routing,
                     DropoutCalls(block_fqns)]
        trace = meta_forward(model, call, recorders, backward=True,
                             stand_in=[model.get_submodule(f) for f in block_fqns])
        if not routing.restart:
            return trace
    return trace



def _int_attrs(mod: nn.Module) -> dict[str, int]:
    """Integer attributes of a module and of its ``config`` object (Hugging Face keeps head counts there)."""
    sources = [vars(mod)]
    config = getattr(mod, "config", None)
    if hasattr(config, "__dict__"):
        sources.insert(0, vars(config))
    return {a.lower(): v for src in sources for a, v in src.items() if isinstance(v, int) and not isinstance(v, bool)}


def _attention_from_attributes(block: nn.Module, hidden: int) -> tuple[str | None, int, int, int]:
    """(site, heads, kv_heads, head_dim) without tracing: a module with >= 3 linears reading ``hidden`` and an
    output linear, whose head geometry is in its (or its config's) integer attributes."""
    for name, mod in block.named_modules():
        lin = _linears(mod)
        if sum(m.in_features == hidden for m in lin.values()) < 1 or not any(
                m.out_features == hidden for m in lin.values()):
            continue
        attrs = _int_attrs(mod)
        heads = next((attrs[a] for a in ("n_heads", "num_heads", "n_head", "num_attention_heads") if a in attrs), 0)
        head_dim = attrs.get("head_dim", 0)
        q_width = max((m.out_features for m in lin.values() if m.in_features == hidden), default=0)
        if not heads and head_dim and len(lin) >= 3:
            heads = q_width // head_dim if q_width == hidden else hidden // head_dim
        if not heads:
            continue
        head_dim = head_dim or hidden // heads
        kv_heads = next((attrs[a] for a in ("n_kv_heads", "num_key_value_heads", "n_query_groups", "num_kv_heads")
                         if a in attrs), heads)
        return name, heads, kv_heads, head_dim
    return None, 0, 0, 0



# ------------------------------------------------------------------------------------------- entry points


def _traced_module(model: nn.Module, runner: nn.Module | None) -> tuple[str, nn.Module]:
    """(prefix of ``model`` in it, module to run): ``model`` itself, or -- when it has no forward (litgpt's
    ``transformer`` ModuleDict) -- its innermost ancestor in ``runner`` that has one (litgpt's GPT)."""
    if implements_forward(model) or runner is None:
        return "", model
    full = next((n for n, m in runner.named_modules() if m is model), None)
    if full is None:
        return "", model
    parts = full.split(".") if full else []
    for cut in range(len(parts) - 1, -1, -1):
        ancestor = runner.get_submodule(".".join(parts[:cut]))
        if implements_forward(ancestor):
            return ".".join(parts[cut:]), ancestor
    return "", model


def analyze(model: nn.Module, seq_len: int | None = None, batch: int = 1, trace: bool = True,
            runner: nn.Module | None = None, example: Example | None = None) -> ModelAnalysis:
    """Analyse a model with a stack of blocks. ``trace=False`` skips the meta forward (structure from shapes
    only). ``runner``: a module containing ``model``, whose innermost part with a forward is run for the trace
    when ``model`` has none of its own (a container of the blocks and embeddings, as litgpt's). ``example``:
    (args, kwargs) of a real call of the module the trace runs (``model``, or that part of ``runner``), used
    instead of token ids (a vision model's pixel values), its tensors cut to ``batch`` rows."""
    found = find_block_list(model)
    if found is None:
        raise ValueError(f"{type(model).__name__}: no repeated blocks found (need an nn.ModuleList or nn.Sequential "
                         "of identical blocks, as in GPT/Llama-style models)")
    blocks_fqn, container = found
    keys, blocks = zip(*block_modules(container))
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    embeddings.sort(key=lambda nm: -nm[1].num_embeddings)
    # the token embedding: the one an LM head outside the blocks maps back to (same table size and width, or the
    # same weight), else the largest -- a learned position table longer than the vocabulary is not it
    # (a Linear inside any repeated stack is a block's, not a head: an encoder-decoder's other stack's MLP can have
    # the vocabulary's shape)
    inside = in_any_blocks(model)
    outside = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith(blocks_fqn + ".")
               and n not in inside]
    tok = next(((n, e) for n, e in embeddings if any(
        h.weight is e.weight or (h.out_features == e.num_embeddings and h.in_features == e.embedding_dim)
        for h in outside)), embeddings[0] if embeddings else None)
    embeddings = [tok] + [nm for nm in embeddings if nm[1] is not tok[1]] if tok else embeddings
    hidden = tok[1].embedding_dim if tok else next(
        (m.in_features for m in blocks[0].modules() if isinstance(m, nn.Linear)), 0)
    vocab = tok[1].num_embeddings if tok else 0
    pos = next(((n, m) for n, m in embeddings[1:] if m.embedding_dim == hidden), None)
    head = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in inside
                 and not n.startswith(blocks_fqn + ".") and m.in_features == hidden and m.out_features == vocab), None)
    tied = bool(tok and head and head[1].weight is tok[1].weight)
    norms = [n for n, m in model.named_modules() if not n.startswith(blocks_fqn + ".") and n != blocks_fqn and
             "norm" in type(m).__name__.lower()]
    seq_len = seq_len or (pos[1].num_embeddings if pos else 128)
    unclassified: list[str] = []

    traced: Trace | None = None  # the meta trace, None without one (not asked for, or failed: ``failure``)
    failure: str | None = None
    block_fqns = [f"{blocks_fqn}.{key}" for key in keys]
    traced_seq = seq_len
    if trace:
        # a model bounded below the default length (litgpt's block_size, no position embedding to read it from)
        # is traced again on a short sequence: the structure is the same, only the FLOPs are for that length
        lengths = (seq_len,) if example is not None else (seq_len, min(seq_len, SHORT_TRACE_SEQ))
        for traced_seq in dict.fromkeys(lengths):
            try:
                prefix, module = _traced_module(model, runner)
                names = [f"{prefix}.{f}" if prefix else f for f in block_fqns]
                run = _meta_run(module, batch, traced_seq, names, example)
            except Exception as err:  # noqa: BLE001 -- the call could not be prepared: as a failed trace
                prefix, run = "", Trace(error=err, failure=first_line(err))
            if run.failure is None:
                traced = run.relative(prefix)
                break
            failure = failure or run.failure  # structure alone still serves the planner and TP
        if traced is None and failure is not None:
            unclassified.append(f"meta forward failed ({failure})")
            traced_seq = seq_len
        if example is not None and traced is not None and traced.attn_seq:
            seq_len = traced_seq = traced.attn_seq  # the user's call sets the length (a ViT: its patches)
        for why in dict.fromkeys(traced.stood_in if traced else []):  # their FLOPs and saved bytes are missing
            unclassified.append(f"a block ran only up to a data-dependent op on meta tensors ({why})")
    seen = traced or Trace()  # what the trace saw (nothing without one)

    # projections that are not nn.Linear (GPT-2's Conv1D): orientation from the op the trace saw on the weight
    orient: Orientation = {}
    for name, flipped in seen.orientation.items():
        mod = model.get_submodule(name)
        if not isinstance(mod, nn.Linear):
            orient[id(mod)] = flipped

    # attention geometry: from the traced SDPA call, else from attributes
    attn_site, heads, kv_heads, head_dim = None, 0, 0, 0
    for site, h, kvh, hd in seen.attention:
        if site.startswith(block_fqns[0] + "."):
            attn_site, heads, kv_heads, head_dim = site[len(block_fqns[0]) + 1 :], h, kvh, hd
            break
    if attn_site is None:
        attn_site, heads, kv_heads, head_dim = _attention_from_attributes(blocks[0], hidden)
    if heads and not head_dim:
        head_dim = hidden // heads
    if heads and kv_heads == heads and attn_site is not None:
        # repeat_interleave before SDPA hides GQA: read the k projection width instead
        mod = blocks[0].get_submodule(attn_site)
        widths = sorted({m.out_features for m in _linears(mod, orient).values() if m.in_features == hidden})
        if widths and widths[0] < heads * head_dim and widths[0] % head_dim == 0:
            kv_heads = widths[0] // head_dim
        elif len(fused := [w for w in widths if w > heads * head_dim]) == 1 and fused[0] % head_dim == 0 \
                and 0 < fused[0] // head_dim - heads < 2 * heads and (fused[0] // head_dim - heads) % 2 == 0:
            kv_heads = (fused[0] // head_dim - heads) // 2  # one fused qkv of (heads + 2 * kv_heads) heads

    # block 0's attention and MLP from the traced dataflow (None without a trace, or where it shows none: then
    # from the structure of the modules, as before)
    flow = _block_flow(traced, block_fqns[0], blocks[0], orient)
    flow_attn = _attention_from_flow(flow, blocks[0], hidden, heads, head_dim, kv_heads) if flow else None
    attn_parts = [] if flow_attn is None else [flow_attn.q, flow_attn.k, flow_attn.v, flow_attn.qkv, flow_attn.o]
    flow_mlp = _mlp_from_flow(flow, hidden, {_join(flow_attn.fqn, n) for n in attn_parts if n}) if flow else None
    mlp_parts = [] if flow_mlp is None else [flow_mlp.up, flow_mlp.gate, flow_mlp.down]
    skipped = [attn_site] if attn_site is not None else []
    if flow_attn is not None and flow_attn.fqn:
        skipped.append(flow_attn.fqn)

    # MoE layers: from the trace's routing (a router's top-k selection feeding experts) where the trace ran
    # through the blocks (or saw routing before a block stood in); from the structure without a trace
    routed = seen.routing if traced is not None and (seen.routing or not traced.stood_in) else None
    infos: list[BlockInfo] = []
    ffn_hidden, ffn_kind, experts, top_k, moe_every_hits, replayed = 0, "gelu", 0, 0, [], False
    for i, block in enumerate(blocks):
        info = BlockInfo(index=i, fqn=block_fqns[i], params=_param_count(block),
                         flops=seen.flops.get(block_fqns[i], 0.0),
                         activation_bytes=seen.saved.get(block_fqns[i], 0.0))
        if flow_attn is not None and _fits(block, flow_attn.fqn, attn_parts, blocks[0]):
            info.attention = copy.deepcopy(flow_attn)
        elif attn_site is not None and heads:
            info.attention = _classify_attention(attn_site, block.get_submodule(attn_site), hidden, heads,
                                                 head_dim, kv_heads, orient)
        info.moe = None if routed is None else _routed_moe(block, block_fqns[i], routed, hidden, orient)
        for name, mod in block.named_modules():
            if any(name == s or name.startswith(s + ".") for s in skipped):
                continue
            if routed is None and info.moe is None:
                info.moe = _classify_moe(name, mod, hidden, orient)
            if info.mlp is None and info.moe is None and (mlp := _classify_mlp(name, mod, hidden, orient)) is not None:
                info.mlp = mlp
        if info.moe is not None:
            replayed = replayed or plain_moe_layout(block.get_submodule(info.moe.fqn), info.moe)
            moe_every_hits.append(i)
            experts, top_k = info.moe.num_experts, info.moe.top_k or top_k
            if info.moe.ffn_hidden:
                ffn_hidden = ffn_hidden or info.moe.ffn_hidden
                ffn_kind = "swiglu" if info.moe.gated else ffn_kind
        if info.moe is None and flow_mlp is not None and _fits(block, flow_mlp.fqn, mlp_parts, blocks[0]):
            info.mlp = copy.deepcopy(flow_mlp)
        if info.mlp is not None:
            ffn_hidden, ffn_kind = info.mlp.ffn_hidden, ("swiglu" if info.mlp.gate or info.mlp.gate_up else "gelu")
        if i == 0:
            if info.attention is None or (info.attention.o is None) or not (info.attention.q or info.attention.qkv):
                unclassified.append(f"{info.fqn}: attention projections")
            if info.mlp is None and info.moe is None:
                unclassified.append(f"{info.fqn}: MLP")
        infos.append(info)
    _tp_feasibility(blocks, infos, traced)

    moe_every = 1
    if moe_every_hits:
        first = moe_every_hits[0] + 1
        moe_every = first if all((h + 1) % first == 0 for h in moe_every_hits) else 1
    spec = ModelSpec(
        name=type(model).__name__,
        layers=len(blocks),
        hidden=hidden,
        heads=heads or 1,
        kv_heads=kv_heads or heads or 1,
        ffn_hidden=ffn_hidden or 4 * hidden,
        ffn_kind=ffn_kind,
        vocab=vocab or 1,
        seq_len=seq_len,
        experts=experts,
        top_k=top_k or (2 if experts else 2),
        moe_every=moe_every,
        tied_embeddings=tied,
        moe_replay=replayed,
        frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad),
        dropout=traced.dropout if traced is not None else True,  # without a trace: Korthikanti's count, masks kept
    )
    return ModelAnalysis(
        spec=spec,
        blocks_fqn=blocks_fqn,
        blocks=infos,
        token_embedding=tok[0] if tok else None,
        position_embedding=pos[0] if pos else None,
        final_norm=norms[-1] if norms else None,
        lm_head=head[0] if head else None,
        tied_embeddings=tied,
        total_params=sum(p.numel() for p in model.parameters()),
        batch=batch,
        seq_len=traced_seq,
        flops_total=seen.total_flops,
        unclassified=unclassified,
        unused_params=list(seen.unused),
        collectives=list(seen.collectives),
        trace_failure=failure if trace and traced is None else None,
    )


def find_transformer(module: nn.Module) -> tuple[str, nn.Module]:
    """The innermost submodule of ``module`` that owns the block list and the token embedding (e.g. the GPT
    inside a LightningModule)."""
    found = find_block_list(module)
    if found is None:
        raise ValueError(f"{type(module).__name__}: no repeated blocks found")
    blocks_fqn = found[0]
    best = ("", module)
    for name, child in module.named_modules():
        if name and blocks_fqn.startswith(name + ".") and any(isinstance(m, nn.Embedding) for m in child.modules()):
            if len(name) > len(best[0]):
                best = (name, child)
    return best


def model_spec_from_module(module: nn.Module, seq_len: int | None = None) -> ModelSpec:
    """The planner's ModelSpec for a module (a LightningModule is searched for its transformer)."""
    _, transformer = find_transformer(module)
    return analyze(transformer, seq_len=seq_len, trace=False).spec
