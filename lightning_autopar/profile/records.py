"""What the transformer analysis finds, as records: a block's attention, MLP and MoE layer, the blocks, and the
model's analysis, a tagged union (``Analysis``: ``ModelAnalysis`` for a transformer, ``analyze.py`` fills it and
``tp_layout.py`` adds what tensor parallelism needs; ``units.UnitModelAnalysis`` for a model in unit form)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from lightning_autopar.specs import ModelSpec


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
    # per-head tables (relative to ``fqn``): an nn.Embedding of [n, heads], T5's relative_attention_bias, whose
    # output is a value per head: TP shards it along the heads with the projections
    head_tables: list[str] = field(default_factory=list)
    # norms (relative to ``fqn``) applied per head to a projection's output (Qwen3's, Gemma 3's q_norm / k_norm over
    # head_dim): one weight for every head, so under TP each rank's use of it sees its local heads only and its
    # gradient is summed over the TP group
    head_norms: list[str] = field(default_factory=list)
    # per-head parameters (relative to ``fqn``): a 1-D parameter of one value per head on the attention module
    # itself, not on a layer (GPT-OSS's attention sinks): TP shards it along the heads with the projections
    head_params: list[str] = field(default_factory=list)

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


FUSED_EXPERT_CALLS = ("indices", "grouped")  # MoEInfo.expert_call values expert and tensor parallelism drive
FUSED_CALL_REFUSAL = ("the fused experts are called neither with (tokens, top-k expert ids, weights) as Hugging "
                      "Face's are nor with (tokens sorted by expert, count per expert) as torchtitan's are")


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
    # fused layout: how the experts module is called, which expert and tensor parallelism drive: "indices"
    # (Hugging Face: its tokens, their top-k expert ids and weights), "grouped" (torchtitan's GroupedExperts: the
    # tokens sorted by expert and the count per expert); "" another call, found and priced as MoE but not split
    expert_call: str = "indices"

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
    # attention calls in the block outside ``attention`` (relative to the block: an encoder-decoder's
    # cross-attention), which TP leaves whole
    other_attention: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Analysis:
    """What the analysis of any model finds: the common part of a tagged union whose arms are ``ModelAnalysis`` (a
    transformer: its blocks, embeddings, final norm and LM head) and ``profile.units.UnitModelAnalysis`` (any model
    as units), told apart by ``form`` ("transformer" | "unit", as planner.forms.form_of names the spec's form).
    Neither arm carries the other's fields."""

    form: ClassVar[str] = ""
    spec: ModelSpec
    blocks_fqn: str  # the module the blocks' fqns are relative to ("": the root, a unit-form model's units)
    blocks: list[BlockInfo]  # a transformer's blocks, or a unit-form model's units
    tied_embeddings: bool  # a transformer's LM head is its token embedding; in unit form: parameters are tied
    total_params: int
    batch: int = 0
    seq_len: int = 0  # the traced sequence length (FLOPs and activation bytes are for (batch, seq_len))
    flops_total: float = 0.0  # whole model forward + backward for (batch, seq_len)
    unclassified: list[str] = field(default_factory=list)
    # why the meta forward did not run (one line; the analysis then comes from structure alone), None when it ran
    # or was not asked for
    trace_failure: str | None = None
    # trainable parameters the traced forward never touched (LLaVA's vision post_layernorm, an unused head):
    # DDP must be told to expect no gradient for them; frozen parameters (requires_grad=False) are not listed
    unused_params: list[str] = field(default_factory=list)
    # the model's own torch.distributed calls the trace saw, one line each (``Trace.collectives``)
    collectives: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: what was found."""
        raise NotImplementedError

    def summary(self) -> str:
        """What ``autopar analyze`` prints for the model (named by its spec)."""
        raise NotImplementedError


@dataclass(kw_only=True)
class ModelAnalysis(Analysis):
    """The transformer arm: repeated blocks with attention, the embeddings, final norm and LM head around them."""

    form: ClassVar[str] = "transformer"
    token_embedding: str | None
    position_embedding: str | None
    final_norm: str | None
    lm_head: str | None

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

    def summary(self) -> str:
        return f"{self.spec.name}: transformer form, {self.describe()}"


def _join(*names: str) -> str:
    return ".".join(n for n in names if n)


def one_class_children(module: Any) -> list[Any]:
    """``module``'s children (an ``nn.Module``'s) when there are at least two, all of one class -- a stack of
    blocks, a layer's experts, one norm per head --; else []."""
    kids = list(module.children())
    return kids if len(kids) >= 2 and len({type(c) for c in kids}) == 1 else []
