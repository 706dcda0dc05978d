"""Structure and cost of an ``nn.Module`` without running it on a real device.

Parameters are swapped for meta tensors (``torch.func.functional_call``), so a model too big for one device
(or already built on the meta device) is analysed without allocating it. We find:

* the repeated blocks: the largest ``ModuleList``/``Sequential`` of same-class children;
* inside a block, by structure and shapes rather than attribute names: the attention (the module that calls
  ``scaled_dot_product_attention`` or a 4-D softmax; its linears split into q/k/v/o or fused qkv), the MLP
  (linears hidden -> ffn [gate, up] and ffn -> hidden [down]) and MoE layers (a router hidden -> E next to a
  list of E identical MLPs, or -- the fused layout of Hugging Face Mixtral -- a router module with a weight
  [E, hidden] next to an experts module holding 3-D parameters [E, ...]);
* embeddings (token, position), the final norm and the LM head (tied or not);
* per block: parameters, forward+backward FLOPs (``FlopCounterMode``) and saved-activation bytes.

What could not be classified is listed in ``ModelAnalysis.unclassified`` rather than guessed.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from lightning_autopar.specs import ModelSpec

HEAD_ATTR_HINTS = ("head", "heads")


@dataclass
class AttentionInfo:
    fqn: str  # relative to the block
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

    @property
    def fused(self) -> bool:
        return self.qkv is not None


@dataclass
class MLPInfo:
    fqn: str  # relative to the block (or to an MoE expert list entry)
    up: str
    down: str
    gate: str | None = None
    ffn_hidden: int = 0


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
    seq_len: int = 0
    flops_total: float = 0.0  # whole model forward + backward for (batch, seq_len)
    unclassified: list[str] = field(default_factory=list)

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


def find_block_list(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The ModuleList/Sequential of >= 2 same-class children holding the most parameters."""
    best: tuple[int, str, nn.Module] | None = None
    for name, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < 2:
            continue
        kinds = {type(c) for c in child}
        if len(kinds) != 1 or isinstance(child[0], nn.Linear):
            continue
        count = _param_count(child)
        if best is None or count > best[0]:
            best = (count, name, child)
    return (best[1], best[2]) if best else None


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}


def _classify_mlp(fqn: str, module: nn.Module, hidden: int) -> MLPInfo | None:
    """hidden -> ffn linears (up, and gate for swiglu) and one ffn -> hidden linear (down)."""
    lin = _linears(module)
    names = list(lin)
    ins = [n for n in names if lin[n].in_features == hidden and lin[n].out_features != hidden]
    outs = [n for n in names if lin[n].out_features == hidden and lin[n].in_features != hidden]
    if not ins and len(names) in (2, 3) and all(lin[n].in_features == lin[n].out_features == hidden for n in names):
        ins, outs = names[:-1], names[-1:]  # ffn == hidden: fall back to definition order
    if len(outs) != 1 or len(ins) not in (1, 2):
        return None
    down = outs[0]
    ffn = lin[down].in_features
    if any(lin[n].out_features != ffn for n in ins):
        return None
    if len(ins) == 1:
        return MLPInfo(fqn=fqn, up=ins[0], down=down, ffn_hidden=ffn)
    # swiglu: the gate goes through the activation; prefer its usual names, else the first defined
    gate = next((n for n in ins if "gate" in n or n in ("w1", "fc_1")), ins[0])
    up = next(n for n in ins if n != gate)
    return MLPInfo(fqn=fqn, up=up, down=down, gate=gate, ffn_hidden=ffn)


def _classify_attention(fqn: str, module: nn.Module, hidden: int, heads: int, head_dim: int,
                        kv_heads: int) -> AttentionInfo:
    info = AttentionInfo(fqn=fqn, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    lin = _linears(module)
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
    for attr, value in vars(module).items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if not any(h in attr.lower() for h in HEAD_ATTR_HINTS) or "dim" in attr.lower() or "size" in attr.lower():
            continue
        if "kv" in attr.lower() or "key_value" in attr.lower() or "group" in attr.lower():
            if value == kv_heads:
                info.kv_heads_attrs.append(attr)
        elif value == heads:
            info.heads_attrs.append(attr)
    return info


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


def _classify_moe(fqn: str, module: nn.Module, hidden: int) -> MoEInfo | None:
    lists = [(n, m) for n, m in module.named_children() if isinstance(m, nn.ModuleList) and len(m) >= 2]
    for name, experts in lists:
        if len({type(e) for e in experts}) != 1:
            continue
        routers = [n for n, m in _linears(module).items() if m.in_features == hidden and m.out_features == len(experts)]
        if not routers:
            # routers are sometimes wrapped (a "gate" module holding the linear)
            routers = [f"{n}.{ln}" for n, m in module.named_children() if not isinstance(m, nn.ModuleList)
                       for ln, l in _linears(m).items() if l.in_features == hidden and l.out_features == len(experts)]
        if not routers:
            continue
        expert_mlp = _classify_mlp("", experts[0], hidden)
        return MoEInfo(fqn=fqn, router=routers[0], experts=name, num_experts=len(experts), top_k=_top_k(module),
                       expert_mlp=expert_mlp, ffn_hidden=expert_mlp.ffn_hidden if expert_mlp else 0,
                       gated=bool(expert_mlp and expert_mlp.gate))
    return _classify_fused_moe(fqn, module, hidden)


# ------------------------------------------------------------------------------------------- tracing


class _SDPARecorder(torch.overrides.TorchFunctionMode):
    """Records the innermost module calling attention and the (heads, kv_heads, head_dim) it uses."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.calls: list[tuple[str, int, int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3:
            q, k = args[0], args[1]
            if q.dim() == 4:
                self.calls.append((self.stack[-1] if self.stack else "", q.shape[1], k.shape[1], q.shape[-1]))
        elif func in (torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax) and args:
            x = args[0]
            if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[-1] == x.shape[-2]:
                self.calls.append((self.stack[-1] if self.stack else "", x.shape[1], x.shape[1], 0))
        return func(*args, **kwargs)


@contextmanager
def _meta_friendly_experts(model: nn.Module) -> Iterator[None]:
    """Hugging Face fused experts run as ``batched_mm`` while traced: the same math and FLOPs (each routed token
    through its experts), and, unlike ``grouped_mm`` (meta kernel: bf16 only) or ``eager`` (``nonzero``), it
    runs on meta tensors of any dtype."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_experts_implementation", None) not in (None, "batched_mm")}
    saved = {key: c._experts_implementation for key, c in configs.items()}
    try:
        for c in configs.values():
            c._experts_implementation = "batched_mm"
        yield
    finally:
        for key, c in configs.items():
            c._experts_implementation = saved[key]


def _meta_run(model: nn.Module, batch: int, seq_len: int, vocab: int, block_fqns: list[str]) -> dict[str, Any]:
    """Forward + backward on meta tensors: per-block FLOPs, saved bytes, and the attention call sites."""
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    params = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
              for n, p in model.named_parameters()}
    buffers = {n: torch.empty_like(b, device="meta") for n, b in model.named_buffers()}
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
        handles.append(mod.register_forward_hook(post(name)))
    recorder = _SDPARecorder(stack)
    idx = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    try:
        with ExitStack() as es:
            counter = es.enter_context(FlopCounterMode(display=False))
            es.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            es.enter_context(recorder)
            es.enter_context(_meta_friendly_experts(model))
            out = functional_call(model, {**params, **buffers}, (idx,), strict=False, tie_weights=True)
            logits = out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out[0])
            logits.float().sum().backward()
    finally:
        for h in handles:
            h.remove()
    counts = counter.get_flop_counts()
    root = type(model).__name__
    block_flops = {f: float(sum(counts.get(f"{root}.{f}", {}).values())) for f in block_fqns}
    return {"flops": block_flops, "total": float(counter.get_total_flops()), "saved": saved, "attn": recorder.calls}


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


def analyze(model: nn.Module, seq_len: int | None = None, batch: int = 1, trace: bool = True) -> ModelAnalysis:
    """Analyse a decoder-style model. ``trace=False`` skips the meta forward (structure from shapes only)."""
    found = find_block_list(model)
    if found is None:
        raise ValueError(f"{type(model).__name__}: no repeated blocks found (need an nn.ModuleList or nn.Sequential "
                         "of identical blocks, as in GPT/Llama-style models)")
    blocks_fqn, blocks = found
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    embeddings.sort(key=lambda nm: -nm[1].num_embeddings)
    tok = embeddings[0] if embeddings else None
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
    block_fqns = [f"{blocks_fqn}.{i}" for i in range(len(blocks))]
    if trace:
        try:
            traced = _meta_run(model, batch, seq_len, vocab, block_fqns)
        except Exception as err:  # structure alone still serves the planner and TP
            unclassified.append(f"meta forward failed ({type(err).__name__}: {str(err).splitlines()[0][:80]})")

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
        widths = sorted({m.out_features for m in _linears(mod).values() if m.in_features == hidden})
        if widths and widths[0] < heads * head_dim and widths[0] % head_dim == 0:
            kv_heads = widths[0] // head_dim

    infos: list[BlockInfo] = []
    ffn_hidden, ffn_kind, experts, top_k, moe_every_hits = 0, "gelu", 0, 0, []
    for i, block in enumerate(blocks):
        info = BlockInfo(index=i, fqn=block_fqns[i], params=_param_count(block),
                         flops=traced.get("flops", {}).get(block_fqns[i], 0.0),
                         activation_bytes=traced.get("saved", {}).get(block_fqns[i], 0.0))
        if attn_site is not None and heads:
            info.attention = _classify_attention(attn_site, block.get_submodule(attn_site), hidden, heads,
                                                 head_dim, kv_heads)
        for name, mod in block.named_modules():
            if attn_site is not None and (name == attn_site or name.startswith(attn_site + ".")):
                continue
            if info.moe is None and (moe := _classify_moe(name, mod, hidden)) is not None:
                info.moe = moe
                moe_every_hits.append(i)
                experts, top_k = moe.num_experts, moe.top_k or top_k
                if moe.ffn_hidden:
                    ffn_hidden = ffn_hidden or moe.ffn_hidden
                    ffn_kind = "swiglu" if moe.gated else ffn_kind
            if info.mlp is None and info.moe is None and (mlp := _classify_mlp(name, mod, hidden)) is not None:
                info.mlp = mlp
                ffn_hidden, ffn_kind = mlp.ffn_hidden, ("swiglu" if mlp.gate else "gelu")
        if i == 0:
            if info.attention is None or (info.attention.o is None) or not (info.attention.q or info.attention.qkv):
                unclassified.append(f"{info.fqn}: attention projections")
            if info.mlp is None and info.moe is None:
                unclassified.append(f"{info.fqn}: MLP")
        infos.append(info)

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
        seq_len=seq_len,
        flops_total=traced.get("total", 0.0),
        unclassified=unclassified,
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
