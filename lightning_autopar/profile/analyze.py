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
  (linears hidden -> ffn [gate, up] and ffn -> hidden [down]); and, always by structure, MoE layers (a router
  hidden -> E next to a list of E identical MLPs, or -- the fused layout of Hugging Face Mixtral -- a router
  module with a weight [E, hidden] next to an experts module holding 3-D parameters [E, ...]);
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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from lightning_autopar.specs import ModelSpec

HEAD_ATTR_HINTS = ("head", "heads")
SHORT_TRACE_SEQ = 8  # the sequence length of the fallback trace


@dataclass
class AttentionInfo:
    # relative to the block: the innermost module holding all the projections and the attention call ("" for
    # the block itself); the projections are relative to it and need not be its children (HF BERT: fqn
    # "attention", q "self.query", o "output.dense")
    fqn: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None  # fused projection
    o: str | None = None
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    heads_attrs: list[str] = field(default_factory=list)  # int attributes holding the head count
    kv_heads_attrs: list[str] = field(default_factory=list)
    transposed: list[str] = field(default_factory=list)  # projections storing their weight as [in, out] (Conv1D)
    # fused qkv: how the model splits the projection's output. "sequential": [q | k | v] (``qkv_pieces`` the
    # widths); "grouped": one [q.. k v] group per kv head, viewed as (groups, q_per_kv + 2, head_dim)
    qkv_layout: str = ""
    qkv_pieces: list[int] = field(default_factory=list)
    # what TP must divide so the module's own code sees its local heads: attribute paths ("split_size",
    # "config.n_head"), found by running the sharded module on meta tensors (``tp_refusal`` when none works)
    tp_attrs: list[str] = field(default_factory=list)
    tp_refusal: str | None = None  # "<path relative to the block>: why TP cannot split it", None when it can
    tp_validated: bool = False  # tp_attrs come from a dry run (else: the head-count attributes, unvalidated)

    @property
    def fused(self) -> bool:
        return self.qkv is not None


@dataclass
class MLPInfo:
    # relative to the block (or to an MoE expert list entry): the innermost module holding up, gate and down, which
    # are relative to it (HF BERT: fqn "" -- the block --, up "intermediate.dense", down "output.dense")
    fqn: str
    up: str
    down: str
    gate: str | None = None
    ffn_hidden: int = 0
    gate_up: str | None = None  # one projection holding [gate | up] (Phi-3's ``gate_up_proj``); then up == gate_up
    transposed: list[str] = field(default_factory=list)  # projections storing their weight as [in, out]
    tp_refusal: str | None = None  # "<path relative to the block>: why TP cannot split this MLP", None when it can


@dataclass
class MoEInfo:
    fqn: str  # relative to the block
    router: str  # relative to the MoE module: an nn.Linear(hidden, E), or a router module with a weight [E, hidden]
    experts: str  # the ModuleList of experts, or (fused layout) the module holding the experts' stacked weights
    num_experts: int = 0
    top_k: int = 0
    expert_mlp: MLPInfo | None = None  # structure of one expert, relative to the expert (ModuleList layout)
    # fused layout (Hugging Face Mixtral: ``gate_up_proj`` [E, 2*ffn, hidden], ``down_proj`` [E, hidden, ffn]): the
    # experts module's parameters, each with the experts along dim 0; empty for a ModuleList of experts
    fused_params: list[str] = field(default_factory=list)
    ffn_hidden: int = 0  # one expert's FFN width
    gated: bool = False  # SwiGLU-style experts (gate and up projections)

    @property
    def fused(self) -> bool:
        return bool(self.fused_params)


@dataclass
class BlockInfo:
    index: int
    fqn: str
    params: int
    flops: float = 0.0  # forward + backward, for the analysed batch
    activation_bytes: float = 0.0  # saved for backward, for the analysed batch
    attention: AttentionInfo | None = None
    mlp: MLPInfo | None = None
    moe: MoEInfo | None = None


@dataclass
class ModelAnalysis:
    spec: ModelSpec
    blocks_fqn: str
    blocks: list[BlockInfo]
    token_embedding: str | None
    position_embedding: str | None
    final_norm: str | None
    lm_head: str | None
    tied_embeddings: bool
    total_params: int
    batch: int = 0
    seq_len: int = 0  # the traced sequence length (FLOPs and activation bytes are for (batch, seq_len))
    flops_total: float = 0.0  # whole model forward + backward for (batch, seq_len)
    unclassified: list[str] = field(default_factory=list)
    # trainable parameters the traced forward never touched (LLaVA's vision post_layernorm, an unused head):
    # DDP must be told to expect no gradient for them; frozen parameters (requires_grad=False) are not listed
    unused_params: list[str] = field(default_factory=list)

    def describe(self) -> str:
        b0 = self.blocks[0] if self.blocks else None
        parts = [f"{len(self.blocks)} blocks at '{self.blocks_fqn}'", f"{self.total_params / 1e6:.2f}M params"]
        if b0 and b0.attention:
            a = b0.attention
            kind = "fused qkv" if a.fused else "q/k/v/o"
            parts.append(f"attention {kind} heads={a.heads} kv_heads={a.kv_heads}")
        if b0 and (b0.mlp or b0.moe):
            parts.append("MoE" if any(b.moe for b in self.blocks) else "MLP")
        if self.unclassified:
            parts.append(f"unclassified: {', '.join(self.unclassified)}")
        return "; ".join(parts)


# ------------------------------------------------------------------------------------------- structure


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_modules(container: nn.Module) -> list[tuple[str, nn.Module]]:
    """The (key, block) children of a block container, in order: a ModuleList's or Sequential's indices,
    a ModuleDict's keys (torchtitan's ``layers``), any other holder's attribute names."""
    return list(container.named_children())


def find_block_list(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The container of >= 2 children of one class (the blocks) holding the most parameters, whatever its
    class: a ModuleList, a Sequential, a ModuleDict (torchtitan keeps its blocks in ``layers``, a ModuleDict),
    or a module of the user's own holding only its blocks. Linears (a projection list) are not blocks."""
    best: tuple[int, str, nn.Module] | None = None
    for name, child in module.named_modules():
        kids = [m for _, m in block_modules(child)]
        if len(kids) < 2 or len({type(c) for c in kids}) != 1 or isinstance(kids[0], nn.Linear):
            continue
        count = _param_count(child)
        if best is None or count > best[0]:
            best = (count, name, child)
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


def _block_flow(traced: dict[str, Any], block_fqn: str, block: nn.Module, orient: Orientation) -> _BlockFlow | None:
    """Block 0's dataflow from the trace, names relative to the block; None without a trace."""
    probe: _Probe | None = traced.get("probe")
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


def _classify_fused_moe(fqn: str, module: nn.Module, hidden: int) -> MoEInfo | None:
    """The fused layout: a router child whose ``weight`` is [E, hidden] (not an nn.Linear) and an experts child
    whose parameters all have E along dim 0, at least one 3-D. Projections as nn.Linear stores them ([out, in]),
    or transposed when the experts module says ``is_transposed``: inputs read ``hidden``, the output projection
    writes it; one input of width 2*ffn is a fused gate+up."""
    children = dict(module.named_children())
    for r_name, router in children.items():
        weight = getattr(router, "weight", None)
        if isinstance(router, nn.Linear) or not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
                or weight.shape[1] != hidden or weight.shape[0] < 2:
            continue
        num = weight.shape[0]
        for e_name, experts in children.items():
            params = dict(experts.named_parameters(recurse=False))
            if e_name == r_name or not params or any(p.dim() < 2 or p.shape[0] != num for p in params.values()) \
                    or not any(p.dim() == 3 for p in params.values()) or _param_count(experts) != sum(
                        p.numel() for p in params.values()):
                continue
            flip = bool(getattr(experts, "is_transposed", False))
            shapes = {n: (p.shape[2], p.shape[1]) if flip else (p.shape[1], p.shape[2])
                      for n, p in params.items() if p.dim() == 3}  # name -> (out, in)
            ins = [n for n, (o, i) in shapes.items() if i == hidden and o != hidden]
            outs = [n for n, (o, i) in shapes.items() if o == hidden and i != hidden]
            if len(outs) != 1:
                continue
            ffn = shapes[outs[0]][1]
            widths = sorted(shapes[n][0] for n in ins)
            if widths not in ([ffn], [2 * ffn], [ffn, ffn]):
                continue
            return MoEInfo(fqn=fqn, router=r_name, experts=e_name, num_experts=num, top_k=_top_k(module, router),
                           fused_params=list(params), ffn_hidden=ffn, gated=widths != [ffn])
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
        expert_mlp = _classify_mlp("", experts[0], hidden, orient)
        return MoEInfo(fqn=fqn, router=routers[0], experts=name, num_experts=len(experts), top_k=_top_k(module),
                       expert_mlp=expert_mlp, ffn_hidden=expert_mlp.ffn_hidden if expert_mlp else 0,
                       gated=bool(expert_mlp and expert_mlp.gate))
    return _classify_fused_moe(fqn, module, hidden)


def plain_moe_layout(module: nn.Module, info: MoEInfo) -> bool:
    """A plain MoE (no ``route``): a router ``nn.Linear`` and an ``nn.ModuleList`` of experts the analysis found to
    be MLPs from hidden to hidden, so an expert call's output has its input's shape. Expert parallelism runs such a
    layer's forward twice (capture, then replay: ``parallel.experts.PlainExpertForward``), which the planner
    prices (``ModelSpec.moe_replay``)."""
    if info.fused or callable(getattr(module, "route", None)) or info.expert_mlp is None:
        return False
    return isinstance(module.get_submodule(info.experts), nn.ModuleList) and isinstance(
        module.get_submodule(info.router), nn.Linear)


# ------------------------------------------------------------------------------------------- tracing


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


class ParameterUses(torch.overrides.TorchFunctionMode):
    """The parameters (``params``: name -> the tensor the traced forward gets) that any torch function of the
    forward takes; ``unused()``: the trainable ones it never took."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = {id(t): n for n, t in params.items()}
        self.trainable = [n for n, t in params.items() if t.requires_grad]
        self.used: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if (name := self.names.get(id(leaf))) is not None:
                self.used.add(name)
        return func(*args, **kwargs)

    def unused(self) -> list[str]:
        return [n for n in self.trainable if n not in self.used]


class _MetaAutocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast`` that takes ``device_type="meta"`` (code calling ``autocast(x.device.type)``, as
    torchtitan's MoE router does) as the CPU's: its casts apply to CPU tensors only, so on meta tensors it is a
    no-op, and the user's arguments (enabled, dtype) are kept."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


def _batch_norm_two_rows(batch_norm: Any) -> Any:
    """``F.batch_norm`` that normalises a meta input with one value per channel as two copies of it (the rows of
    the result: the input's)."""

    def call(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.device.type == "meta" and input.dim() >= 2 and input.numel() == input.shape[1]:
            return batch_norm(torch.cat((input, input)), *args, **kwargs)[:1]
        return batch_norm(input, *args, **kwargs)

    return call


@contextmanager
def meta_friendly(model: nn.Module) -> Iterator[None]:
    """What every meta forward runs under, so the trace survives what real code does on meta tensors:

    - Hugging Face fused experts run as ``batched_mm``: the same math and FLOPs (each routed token through its
      experts), and, unlike ``grouped_mm`` (meta kernel: bf16 only) or ``eager`` (``nonzero``), it runs on meta
      tensors of any dtype;
    - ``torch.autocast(device_type="meta")`` is accepted (``_MetaAutocast``);
    - BatchNorm in train mode does not refuse one value per channel (a trace of one row through a 1x1 feature
      map, a CIFAR-size ResNet; the meta kernel divides by n - 1): such an input is normalised as two copies
      of itself, the same shapes and, but for that one op, the same FLOPs (``_batch_norm_two_rows``)."""
    import torch.nn.functional as F

    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_experts_implementation", None) not in (None, "batched_mm")}
    saved = {key: c._experts_implementation for key, c in configs.items()}
    autocasts = (torch.autocast, torch.amp.autocast)
    batch_norm = F.batch_norm
    try:
        for c in configs.values():
            c._experts_implementation = "batched_mm"
        torch.autocast = torch.amp.autocast = _MetaAutocast
        F.batch_norm = _batch_norm_two_rows(batch_norm)
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation = saved[key]
        torch.autocast, torch.amp.autocast = autocasts
        F.batch_norm = batch_norm


@dataclass
class _Probe:
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


def _probe_hooks(model: nn.Module, block0: str, recorder: _TraceRecorder, probe: _Probe) -> list[Any]:
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


def _meta_run(model: nn.Module, batch: int, seq_len: int, vocab: int, block_fqns: list[str],
              example: Example | None = None) -> dict[str, Any]:
    """Forward + backward on meta tensors: per-block FLOPs, saved bytes, the attention call sites, how each
    projection uses its weight, and block 0's calls (``_Probe``). The forward gets ``example`` (a real call's
    arguments, e.g. a ViT's pixel values) when given, else token ids of shape (batch, seq_len)."""
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    params = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
              for n, p in model.named_parameters()}
    buffers = {n: meta_buffer(b) for n, b in model.named_buffers()}
    weights = {id(t): n[: -len(".weight")] for n, t in params.items() if n.endswith(".weight") and t.dim() == 2}
    stack: list[str] = []
    saved: dict[str, float] = {f: 0.0 for f in block_fqns}
    current_block: list[str] = []

    def pre(name):
        def hook(mod, args):
            stack.append(name)
            if name in saved:
                current_block.append(name)
        return hook

    def post(name):
        def hook(mod, args, out):
            stack.pop()
            if name in saved:
                current_block.pop()
        return hook

    def pack(t):
        if current_block and isinstance(t, torch.Tensor):
            saved[current_block[-1]] += t.numel() * t.element_size()
        return t

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(pre(name)))
        handles.append(mod.register_forward_hook(post(name), always_call=True))  # pops after a failure too
    recorder = _TraceRecorder(stack, weights)
    probe = _Probe()
    if block_fqns:
        handles += _probe_hooks(model, block_fqns[0], recorder, probe)
    args, kwargs = ((torch.zeros(batch, seq_len, dtype=torch.long, device="meta"),), {}) if example is None \
        else meta_example(example, batch)
    stood_in: list[str] = []
    uses = ParameterUses(params)
    try:
        with ExitStack() as es:
            counter = es.enter_context(FlopCounterMode(display=False))
            es.enter_context(uses)
            es.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            es.enter_context(recorder)
            es.enter_context(meta_friendly(model))
            es.enter_context(blocks_stand_in_on_failure([model.get_submodule(f) for f in block_fqns], stood_in))
            out = functional_call(model, {**params, **buffers}, args, kwargs, strict=False, tie_weights=True)
            logits = out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out[0])
            logits.float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    probe.attention = list(recorder.attention_flow)
    counts = counter.get_flop_counts()
    root = type(model).__name__
    block_flops = {f: float(sum(counts.get(f"{root}.{f}", {}).values())) for f in block_fqns}
    return {"flops": block_flops, "total": float(counter.get_total_flops()), "saved": saved, "attn": recorder.calls,
            "attn_seq": recorder.attn_seq,
            "orientation": recorder.orientation, "consumers": recorder.consumers, "probe": probe,
            "stood_in": list(dict.fromkeys(stood_in)),
            # a block that stood in did not run to its end: what it did not reach is not known to be unused
            "unused": [] if stood_in else uses.unused()}


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


# ------------------------------------------------------------------------------------------- TP feasibility
#
# Tensor parallelism runs the model's own attention / MLP code on each rank's shards: column projections
# produce out/tp features, row projections read in/tp. Whether that code still works, and which of its
# attributes must shrink (a head count, GPT-2's ``split_size``, litgpt's ``config.n_head``), is found by running
# block 0's modules once on meta tensors with those local shapes (a dry run), not by guessing from names.


def _last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _pieces_of(name: str, shape: tuple[int, ...], args: Any, kwargs: Any, width: int) -> list[int] | None:
    """The widths one op cuts the last dim of a projection output into (split / chunk / view into pieces)."""
    ndim = len(shape)
    if name in ("split", "split_with_sizes"):
        size = args[0] if args else kwargs.get("split_size_or_sections", kwargs.get("split_size"))
        if not _last_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), ndim):
            return None
        if isinstance(size, int):
            return [size] * (width // size) if size and width % size == 0 else None
        return list(size) if isinstance(size, (list, tuple)) and sum(size) == width else None
    if name == "chunk":
        n = args[0] if args else kwargs.get("chunks")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return [width // n] * n if isinstance(n, int) and _last_dim(dim, ndim) and width % n == 0 else None
    return None


def _view_tail(name: str, shape: tuple[int, ...], args: Any, width: int) -> list[int] | None:
    """For a view/reshape/unflatten of the last dim: the sizes it becomes (-1 resolved)."""
    ndim = len(shape)
    if name == "unflatten":
        if len(args) < 2 or not _last_dim(args[0], ndim):
            return None
        tail = list(args[1])
    elif name in ("view", "reshape"):
        sizes = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
        if not all(isinstance(v, int) for v in sizes) or len(sizes) <= ndim:
            return None
        tail = sizes[ndim - 1 :]
    else:
        return None
    known = 1
    for v in tail:
        known *= v if v != -1 else 1
    tail = [width // known if v == -1 else v for v in tail]
    product = 1
    for v in tail:
        product *= v
    return tail if product == width else None


def _slice_pieces(consumers: list, width: int) -> list[int] | None:
    """Slices of the last dim (Phi-3: ``qkv[..., :q]``, ``qkv[..., q:q+kv]``, ``qkv[..., q+kv:]``) tiling it."""
    bounds = []
    for name, shape, args, _ in consumers:
        if name != "__getitem__" or not args:
            continue
        index = args[0] if isinstance(args[0], tuple) else (args[0],)
        if not index or not isinstance(index[-1], slice) or not (index[0] is Ellipsis or len(index) == len(shape)):
            continue
        piece = index[-1]
        if piece.step not in (None, 1):
            return None
        start, stop = piece.start or 0, width if piece.stop is None else piece.stop
        start, stop = (start + width if start < 0 else start), (stop + width if stop < 0 else stop)
        bounds.append((start, min(stop, width)))
    bounds.sort()
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != width:
        return None
    if any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    return [b - a for a, b in bounds]


def fused_layout(consumers: list, width: int, pieces: int, groups: int = 0, per_group: int = 0
                 ) -> tuple[str, list[int]] | None:
    """How the model's code splits a fused projection's output of ``width`` features, from the ops the trace saw:
    ("sequential", piece widths) for [a | b | c] (split, chunk, slices, or a view into (pieces, ...)); ("grouped",
    [groups, per_group, ...]) for a view into one group per kv head (q heads of the group, then its k and v).
    None when not recognised (or ambiguous: ``groups == pieces``)."""
    for name, shape, args, kwargs in consumers:
        found = _pieces_of(name, shape, args, kwargs, width)
        if found:
            return "sequential", found
        tail = _view_tail(name, shape, args, width)
        if tail and len(tail) >= 2:
            if tail[0] == pieces and groups != pieces:
                return "sequential", [width // pieces] * pieces
            if len(tail) >= 3 and groups and tail[0] == groups and tail[1] == per_group and groups != pieces:
                return "grouped", tail
    sliced = _slice_pieces(consumers, width)
    return ("sequential", sliced) if sliced else None


Shards = dict[str, tuple[str, bool]]  # projection (relative to the unit) -> ("col" | "row", weight stored [in, out])


def _local_params(unit: nn.Module, shards: Shards, tp: int) -> dict[str, torch.Tensor]:
    """Meta tensors with one TP rank's shapes: a column projection holds out/tp outputs (bias too), a row
    projection in/tp inputs (its bias whole: added once, after the sum)."""
    local: dict[str, torch.Tensor] = {}
    for name, p in unit.named_parameters():
        proj, _, leaf = name.rpartition(".")
        shape = list(p.shape)
        if proj in shards:
            kind, transposed = shards[proj]
            if leaf == "weight":
                dim = (1 if transposed else 0) if kind == "col" else (0 if transposed else 1)
                shape[dim] //= tp
            elif leaf == "bias" and kind == "col":
                shape[0] //= tp
        local[name] = torch.empty(shape, dtype=p.dtype, device="meta")
    for name, b in unit.named_buffers():
        local[name] = torch.empty_like(b, device="meta")
    return local


def leaf_width_attributes(mod: nn.Module, out_features: int) -> list[str]:
    """Integer attributes of a column projection that is not an nn.Linear and equal its full output width: GPT-2's
    Conv1D keeps it in ``nf`` and reshapes its output with it, so on a TP rank they must hold the local width."""
    if isinstance(mod, nn.Linear):
        return []
    return [a for a, v in vars(mod).items() if isinstance(v, int) and not isinstance(v, bool) and v == out_features]


def local_width_attributes(unit: nn.Module, shards: Shards, tp: int) -> list[tuple[nn.Module, str, int]]:
    """(module, attribute, local value) for every column projection of ``unit`` (``leaf_width_attributes``)."""
    found = []
    for name, (kind, transposed) in shards.items():
        mod = unit.get_submodule(name)
        if kind != "col":
            continue
        out = mod.weight.shape[1] if transposed else mod.weight.shape[0]
        found += [(mod, attr, out // tp) for attr in leaf_width_attributes(mod, out)]
    return found


def divide_attributes(module: nn.Module, paths: list[str], tp: int) -> Any:
    """Divide the integer attributes at ``paths`` by ``tp``: "n_heads", "config.n_head", or below a submodule
    ("self.num_attention_heads", "self.config.num_attention_heads": HF BERT's heads sit in ``attention.self``
    while TP treats ``attention`` as the attention module). A ``config`` step goes to the owning module's own
    shallow copy of its config (never the config other modules share). Returns a callable that undoes it."""
    undo: list[tuple[Any, str, Any]] = []
    copied: set[int] = set()
    for path in paths:
        *steps, attr = path.split(".")
        owner: Any = module
        for step in steps:
            if step == "config" and isinstance(owner, nn.Module):
                if id(owner) not in copied:
                    undo.append((owner, "config", owner.config))
                    owner.config = copy.copy(owner.config)
                    copied.add(id(owner))
                owner = owner.config
            else:
                owner = getattr(owner, step)
        undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, getattr(owner, attr) // tp)

    def restore() -> None:
        for owner, attr, value in reversed(undo):
            setattr(owner, attr, value)

    return restore


def _dry_run(unit: nn.Module, call: tuple[tuple, dict], out_shape: tuple[int, ...], shards: Shards,
             attrs: list[str], tp: int, expected: list[tuple[int, int, int]] | None) -> str | None:
    """Run ``unit`` once on meta tensors with one rank's shards and ``attrs`` divided: None when its own code
    runs, produces the full run's output shape and (attention) attends over its local heads; else why not."""
    from torch.func import functional_call

    restore = divide_attributes(unit, attrs, tp)
    widths = local_width_attributes(unit, shards, tp)
    previous = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in widths]
    recorder = _TraceRecorder([])
    try:
        for mod, attr, value in widths:
            setattr(mod, attr, value)
        args, kwargs = call
        with torch.no_grad(), meta_friendly(unit), recorder:
            out = functional_call(unit, _local_params(unit, shards, tp), args, kwargs, strict=False)
    except Exception as err:  # the model's own code refusing local shapes is the answer, not a failure
        message = str(err).splitlines()[0][:160] if str(err) else ""
        return f"{type(err).__name__}: {message}"
    finally:
        for mod, attr, value in previous:
            setattr(mod, attr, value)
        restore()
    first = _first_tensor(out)
    if first is None or tuple(first.shape) != out_shape:
        return f"output shape {None if first is None else tuple(first.shape)} instead of {out_shape}"
    seen = [(h, kvh, hd) for _, h, kvh, hd in recorder.calls]
    if expected is not None and seen != expected:
        return f"attention over (heads, kv_heads, head_dim) {seen} instead of {expected}"
    return None


MAX_DRY_RUNS = 64


def _width_attributes(unit: nn.Module, values: set[int], exclude: set[int]) -> list[str]:
    """Integer attributes of ``unit``, of its submodules but the projections and other leaves with weights (an
    nn.Linear's ``out_features`` is TP's business, not the code's) and of their ``config`` objects, whose value
    is a head count or projection width; ``unit``'s own first."""

    def wanted(owner: Any) -> list[str]:
        return [a for a, v in vars(owner).items() if isinstance(v, int) and not isinstance(v, bool)
                and v in values and v not in exclude]

    paths: list[str] = []
    for name, mod in unit.named_modules():
        if name and isinstance(getattr(mod, "weight", None), torch.Tensor) and not list(mod.children()):
            continue
        paths += [_join(name, a) for a in wanted(mod)]
        config = getattr(mod, "config", None)
        if config is not None and hasattr(config, "__dict__"):
            paths += [_join(name, "config", a) for a in wanted(config)]
    return paths


def _search_attributes(unit: nn.Module, call: tuple[tuple, dict], out_shape: tuple[int, ...], shards: Shards,
                       candidates: list[str], tp: int, expected: list[tuple[int, int, int]] | None
                       ) -> tuple[list[str] | None, str]:
    """The smallest set of ``candidates`` whose division lets the dry run pass, or (None, the first error)."""
    from itertools import combinations

    first_error, runs = "", 0
    for size in range(len(candidates) + 1):
        for subset in combinations(candidates, size):
            runs += 1
            if runs > MAX_DRY_RUNS:
                return None, first_error
            error = _dry_run(unit, call, out_shape, shards, list(subset), tp, expected)
            if error is None:
                return list(subset), ""
            first_error = first_error or error
    return None, first_error


def _attention_tp(block0: str, attn_mod: nn.Module, info: AttentionInfo, traced: dict[str, Any], tp: int) -> None:
    """Fill ``info``'s TP fields: the fused layout, a structural refusal (q/k norm over the full width), and the
    attributes the dry run needs divided."""
    site = _join(block0, info.fqn)
    q_width, kv_width = info.heads * info.head_dim, info.kv_heads * info.head_dim
    probe: _Probe = traced["probe"]
    projections = [p for p in (info.q, info.k, info.v, info.qkv) if p]
    for norm, (source, width, numel) in probe.norm_inputs.items():
        if norm.startswith(site + ".") and source in {f"{site}.{p}" for p in projections} \
                and numel == width and width > info.head_dim:
            info.tp_refusal = (f"{_join(info.fqn, norm[len(site) + 1:])} is a q/k norm over the full projection width "
                               f"({width}): on a TP rank's local heads its statistics would differ")
            return
    if info.qkv:
        found = fused_layout(traced["consumers"].get(f"{site}.{info.qkv}", []), q_width + 2 * kv_width, 3,
                             info.kv_heads, info.heads // max(info.kv_heads, 1) + 2)
        if found is None:
            info.tp_refusal = f"{_join(info.fqn, info.qkv)}: how the model splits this fused qkv output was not " \
                              "recognised"
            return
        info.qkv_layout, info.qkv_pieces = found
        if info.qkv_layout == "sequential" and info.qkv_pieces != [q_width, kv_width, kv_width]:
            info.tp_refusal = f"{_join(info.fqn, info.qkv)}: fused pieces {info.qkv_pieces} are not q, k, v"
            return
        # GQA's unequal [q | k | v]: parallel.tensor stores the weight row-permuted (RowOrder), so no refusal
    if site not in probe.calls or site not in probe.out_shapes:
        return
    transposed = set(info.transposed)
    shards: Shards = {p: ("col", p in transposed) for p in projections}
    shards[info.o] = ("row", info.o in transposed)
    expected = [(h // tp, kvh // tp, hd) for s, h, kvh, hd in traced["attn"] if s == site or s.startswith(site + ".")]
    values = {info.heads, info.kv_heads, q_width, kv_width}
    candidates = _width_attributes(attn_mod, values, {info.head_dim})
    attrs, error = _search_attributes(attn_mod, probe.calls[site], probe.out_shapes[site], shards, candidates, tp,
                                      expected)
    info.tp_validated = True
    if attrs is None:
        info.tp_refusal = f"{info.fqn}: its code does not run on a TP rank's local heads ({error})"
    else:
        info.tp_attrs = attrs


def _mlp_tp(block0: str, mlp_mod: nn.Module, info: MLPInfo, traced: dict[str, Any], tp: int) -> None:
    """Fill the MLP's TP refusal: a fused gate_up must be cut in [gate | up]; its code must run on local widths."""
    site = _join(block0, info.fqn)
    probe: _Probe = traced["probe"]
    if info.gate_up:
        found = fused_layout(traced["consumers"].get(f"{site}.{info.gate_up}", []), 2 * info.ffn_hidden, 2)
        if found is None or found[0] != "sequential" or found[1] != [info.ffn_hidden] * 2:
            info.tp_refusal = (f"{_join(info.fqn, info.gate_up)}: how the model splits this fused gate/up output "
                               "was not recognised")
            return
    if site not in probe.calls or site not in probe.out_shapes:
        return
    transposed = set(info.transposed)
    shards: Shards = {p: ("col", p in transposed) for p in (info.up, info.gate) if p}
    shards[info.down] = ("row", info.down in transposed)
    error = _dry_run(mlp_mod, probe.calls[site], probe.out_shapes[site], shards, [], tp, None)
    if error is not None:
        info.tp_refusal = f"{info.fqn}: its code does not run on a TP rank's local width ({error})"


def _join(*names: str) -> str:
    return ".".join(n for n in names if n)


def _smallest_split(*sizes: int) -> int:
    """The smallest tp > 1 dividing all ``sizes`` (what the dry run checks), or 0 when none does."""
    return next((t for t in range(2, min(sizes) + 1) if all(s % t == 0 for s in sizes)), 0) if sizes else 0


def _tp_feasibility(blocks: Sequence[nn.Module], infos: list[BlockInfo], traced: dict[str, Any]) -> None:
    """Block 0's TP layout checks (fused layouts, q/k norms, the dry run) apply to every block (same class).
    Without a trace, fused projections are refused (their layout is unknown) and the head-count attributes found
    by name are used unvalidated, as before."""
    if not infos:
        return
    first, block0 = infos[0], blocks[0]
    attn, mlp = first.attention, first.mlp
    if not traced:
        if attn is not None and attn.qkv:
            attn.tp_refusal = f"{_join(attn.fqn, attn.qkv)}: the layout of a fused qkv needs the meta trace, which " \
                              "failed"
        if mlp is not None and mlp.gate_up:
            mlp.tp_refusal = f"{_join(mlp.fqn, mlp.gate_up)}: the layout of a fused gate/up needs the meta trace, " \
                             "which failed"
    else:
        if attn is not None and attn.o and (attn.q or attn.qkv):
            tp = _smallest_split(attn.heads, attn.kv_heads)
            if tp:
                _attention_tp(first.fqn, block0.get_submodule(attn.fqn), attn, traced, tp)
        if mlp is not None:
            tp = _smallest_split(mlp.ffn_hidden)
            if tp:
                _mlp_tp(first.fqn, block0.get_submodule(mlp.fqn) if mlp.fqn else block0, mlp, traced, tp)
    for info in infos:
        if attn is not None and info.attention is not None and info is not first:
            for name in ("qkv_layout", "qkv_pieces", "tp_attrs", "tp_refusal", "tp_validated"):
                setattr(info.attention, name, getattr(attn, name))
        if attn is not None and info.attention is not None and not attn.tp_validated:
            info.attention.tp_attrs = info.attention.heads_attrs + info.attention.kv_heads_attrs
        if mlp is not None and info.mlp is not None and info is not first:
            info.mlp.tp_refusal = mlp.tp_refusal


# ------------------------------------------------------------------------------------------- entry points


def implements_forward(module: nn.Module) -> bool:
    """A container (ModuleDict, ModuleList, ParameterList) inherits ``nn.Module.forward``, which raises."""
    return type(module).forward is not nn.Module.forward


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


def _relative(traced: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The trace of an ancestor with module names made relative to the analysed model (``prefix`` dropped)."""
    if not prefix:
        return traced
    cut = len(prefix) + 1

    def rel(name: str) -> str:
        if name.startswith(ATTENTION_MARK):
            return ATTENTION_MARK + rel(name[len(ATTENTION_MARK):])
        return name[cut:] if name.startswith(prefix + ".") else name

    def rels(names: frozenset[str]) -> frozenset[str]:
        return frozenset(rel(n) for n in names)

    probe: _Probe = traced["probe"]
    return {**traced,
            "unused": [rel(n) for n in traced["unused"] if n.startswith(prefix + ".")],
            "flops": {rel(k): v for k, v in traced["flops"].items()},
            "saved": {rel(k): v for k, v in traced["saved"].items()},
            "attn": [(rel(site), *rest) for site, *rest in traced["attn"]],
            "orientation": {rel(k): v for k, v in traced["orientation"].items() if k.startswith(prefix + ".")},
            "consumers": {rel(k): v for k, v in traced["consumers"].items() if k.startswith(prefix + ".")},
            "probe": _Probe(calls={rel(k): v for k, v in probe.calls.items()},
                            out_shapes={rel(k): v for k, v in probe.out_shapes.items()},
                            norm_inputs={rel(k): (rel(src), w, n) for k, (src, w, n) in probe.norm_inputs.items()},
                            inputs={rel(k): rels(v) for k, v in probe.inputs.items()},
                            attention=[(rel(site), *(rels(v) for v in qkv)) for site, *qkv in probe.attention])}


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
    outside = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith(blocks_fqn + ".")]
    tok = next(((n, e) for n, e in embeddings if any(
        h.weight is e.weight or (h.out_features == e.num_embeddings and h.in_features == e.embedding_dim)
        for h in outside)), embeddings[0] if embeddings else None)
    embeddings = [tok] + [nm for nm in embeddings if nm[1] is not tok[1]] if tok else embeddings
    hidden = tok[1].embedding_dim if tok else next(
        (m.in_features for m in blocks[0].modules() if isinstance(m, nn.Linear)), 0)
    vocab = tok[1].num_embeddings if tok else 0
    pos = next(((n, m) for n, m in embeddings[1:] if m.embedding_dim == hidden), None)
    head = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)
                 and not n.startswith(blocks_fqn + ".") and m.in_features == hidden and m.out_features == vocab), None)
    tied = bool(tok and head and head[1].weight is tok[1].weight)
    norms = [n for n, m in model.named_modules() if not n.startswith(blocks_fqn + ".") and n != blocks_fqn and
             "norm" in type(m).__name__.lower()]
    seq_len = seq_len or (pos[1].num_embeddings if pos else 128)
    unclassified: list[str] = []

    traced: dict[str, Any] = {}
    block_fqns = [f"{blocks_fqn}.{key}" for key in keys]
    traced_seq = seq_len
    if trace:
        # a model bounded below the default length (litgpt's block_size, no position embedding to read it from)
        # is traced again on a short sequence: the structure is the same, only the FLOPs are for that length
        failure: Exception | None = None
        lengths = (seq_len,) if example is not None else (seq_len, min(seq_len, SHORT_TRACE_SEQ))
        for traced_seq in dict.fromkeys(lengths):
            try:
                prefix, module = _traced_module(model, runner)
                names = [f"{prefix}.{f}" if prefix else f for f in block_fqns]
                traced = _relative(_meta_run(module, batch, traced_seq, vocab, names, example), prefix)
                break
            except Exception as err:  # structure alone still serves the planner and TP
                failure = failure or err
        if not traced and failure is not None:
            unclassified.append(f"meta forward failed ({first_line(failure)})")
            traced_seq = seq_len
        if example is not None and traced.get("attn_seq"):  # the user's call sets the length (a ViT: its patches)
            seq_len = traced_seq = traced["attn_seq"]
        for why in traced.get("stood_in", []):  # their FLOPs and saved bytes are missing from the trace
            unclassified.append(f"a block ran only up to a data-dependent op on meta tensors ({why})")

    # projections that are not nn.Linear (GPT-2's Conv1D): orientation from the op the trace saw on the weight
    orient: Orientation = {}
    for name, flipped in traced.get("orientation", {}).items():
        mod = model.get_submodule(name)
        if not isinstance(mod, nn.Linear):
            orient[id(mod)] = flipped

    # attention geometry: from the traced SDPA call, else from attributes
    attn_site, heads, kv_heads, head_dim = None, 0, 0, 0
    for site, h, kvh, hd in traced.get("attn", []):
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

    infos: list[BlockInfo] = []
    ffn_hidden, ffn_kind, experts, top_k, moe_every_hits, replayed = 0, "gelu", 0, 0, [], False
    for i, block in enumerate(blocks):
        info = BlockInfo(index=i, fqn=block_fqns[i], params=_param_count(block),
                         flops=traced.get("flops", {}).get(block_fqns[i], 0.0),
                         activation_bytes=traced.get("saved", {}).get(block_fqns[i], 0.0))
        if flow_attn is not None and _fits(block, flow_attn.fqn, attn_parts, blocks[0]):
            info.attention = copy.deepcopy(flow_attn)
        elif attn_site is not None and heads:
            info.attention = _classify_attention(attn_site, block.get_submodule(attn_site), hidden, heads,
                                                 head_dim, kv_heads, orient)
        for name, mod in block.named_modules():
            if any(name == s or name.startswith(s + ".") for s in skipped):
                continue
            if info.moe is None and (moe := _classify_moe(name, mod, hidden, orient)) is not None:
                replayed = replayed or plain_moe_layout(mod, moe)
                info.moe = moe
                moe_every_hits.append(i)
                experts, top_k = moe.num_experts, moe.top_k or top_k
                if moe.ffn_hidden:
                    ffn_hidden = ffn_hidden or moe.ffn_hidden
                    ffn_kind = "swiglu" if moe.gated else ffn_kind
            if info.mlp is None and info.moe is None and (mlp := _classify_mlp(name, mod, hidden, orient)) is not None:
                info.mlp = mlp
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
        flops_total=traced.get("total", 0.0),
        unclassified=unclassified,
        unused_params=list(traced.get("unused", [])),
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
