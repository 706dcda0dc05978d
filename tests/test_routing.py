"""MoE layers found from the meta trace's dataflow (issue 26, profile/routing.py): a router's scores selected top-k,
the selection deciding which experts process which tokens -- whatever containers, names or config flags the model
uses; a dense model, or a top-k that feeds no experts, is not MoE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_autopar.profile.analyze import analyze
from lightning_autopar.profile.routing import RoutedLayer, Routing
from lightning_autopar.profile.trace import meta_forward, token_ids

HIDDEN, FFN, EXPERTS, TOP_K, VOCAB, SEQ = 16, 32, 4, 2, 32, 8


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


class DictMoE(nn.Module):
    """Experts in a ModuleDict under unusual names, the router a plain parameter used as ``x @ W.T``, the tokens of
    each expert from a one-argument ``torch.where`` (no meta kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.scorer = nn.Parameter(torch.randn(EXPERTS, HIDDEN))
        self.pool = nn.ModuleDict({f"e{i}": Expert() for i in range(EXPERTS)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        weights, chosen = (flat @ self.scorer.T).softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.pool.values()):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class StackedMoE(nn.Module):
    """Stacked expert weights [E, ...] indexed by the selected expert ids inline (no experts module)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN))
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        weights, chosen = torch.topk(self.router(flat).softmax(-1), TOP_K)
        h = F.gelu(torch.einsum("tkfh,th->tkf", self.w_in[chosen], flat))
        out = torch.einsum("tkhf,tkf->tkh", self.w_out[chosen], h)
        return (out * weights[..., None]).sum(1).view_as(x)


class TopKNotMoE(nn.Module):
    """A top-k over a projection's scores that picks features, not experts: no module or weight takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = Expert()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.score(x)
        values, _ = s.topk(TOP_K, dim=-1)
        return self.mlp(x) + values.sum(-1, keepdim=True)


class Block(nn.Module):
    def __init__(self, ffn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in self.qkv(self.norm(x)).split(HIDDEN, -1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.ffn(x)


class LM(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(make()) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_experts_in_any_container_found_from_the_routing():
    trace = meta_forward(LM(DictMoE), token_ids(2, SEQ), [Routing()], backward=True)
    assert trace.failure is None and not trace.stood_in
    assert trace.routing[0] == RoutedLayer("blocks.0.ffn",
                                           tuple(f"blocks.0.ffn.pool.e{i}" for i in range(EXPERTS)), EXPERTS, TOP_K)
    moe = analyze(LM(DictMoE), seq_len=SEQ).blocks[1].moe
    assert (moe.fqn, moe.router, moe.experts, moe.num_experts, moe.top_k) == ("ffn", "", "pool", EXPERTS, TOP_K)
    assert moe.expert_mlp is not None and moe.ffn_hidden == FFN


def test_stacked_expert_weights_indexed_by_the_selection():
    analysis = analyze(LM(StackedMoE), seq_len=SEQ)
    moe = analysis.blocks[0].moe
    assert (moe.fqn, moe.router, moe.experts, moe.fused_params) == ("ffn", "router", "", ["w_in", "w_out"])
    assert (analysis.spec.experts, analysis.spec.top_k, moe.expert_call) == (EXPERTS, TOP_K, "")


@pytest.mark.parametrize("make", [Expert, TopKNotMoE])
def test_dense_models_are_not_moe(make):
    analysis = analyze(LM(make), seq_len=SEQ)
    assert analysis.spec.experts == 0 and not any(b.moe for b in analysis.blocks)


def test_a_layout_expert_parallelism_cannot_drive_is_refused_in_one_line():
    """Stacked weights indexed inline (no experts call to dispatch): found as MoE (priced so), but ep=2 is refused
    by the runtime's own check with the part and the fix, in the capabilities too; the pipeline stays."""
    from lightning_autopar.errors import ConfigError
    from lightning_autopar.parallel.apply import model_capabilities
    from lightning_autopar.parallel.experts import check_ep

    model = LM(StackedMoE)
    with pytest.raises(ConfigError, match=r"^plan\.ep: blocks\.0\.ffn: the fused experts are called neither "
                       r"with \(tokens, top-k expert ids, weights\).*fix: use ep=1") as err:
        check_ep(analyze(model, seq_len=SEQ), model, 2)
    assert "\n" not in str(err.value)
    caps = model_capabilities(model, model, analyze(model, seq_len=SEQ), True)
    assert caps.excluded["ep"] == str(err.value) and "pp" not in caps.excluded


def test_experts_in_a_module_dict_are_driven_by_expert_parallelism():
    """Experts in a ModuleDict under names of their own, the router a plain parameter: the plain layout (the
    forward's expert calls captured and replayed, tests/test_plain_moe_ep.py), so ep=2 is not refused."""
    from lightning_autopar.parallel.experts import check_ep, moe_modules, plain_layout

    model = LM(DictMoE)
    analysis = analyze(model, seq_len=SEQ)
    check_ep(analysis, model, 2)
    assert [plain_layout(m, info) for _, m, info in moe_modules(model, analysis)] == [True] * len(model.blocks)


def test_plain_loop_moe_runs_to_its_experts_on_meta():
    """The project's own MoE GPT (``torch.where(ids == e)`` per expert: a nonzero) no longer stands in on meta: the
    routed count is the expected one, so the MoE block's FLOPs hold its k experts per token (more than the dense
    block's one MLP of the same width)."""
    from lightning_autopar.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=VOCAB, seq_len=SEQ, hidden=HIDDEN, heads=2, layers=2, ffn_hidden=FFN, experts=EXPERTS,
                    top_k=TOP_K, moe_every=2)
    analysis = analyze(GPT(cfg), seq_len=SEQ)
    assert not analysis.unclassified and [b.moe is not None for b in analysis.blocks] == [False, True]
    assert analysis.blocks[1].flops > analysis.blocks[0].flops


@pytest.mark.parametrize("make", [DictMoE, StackedMoE, Expert, TopKNotMoE])
def test_a_dormant_recorder_stops_at_the_first_possible_selection_only(make):
    """``Routing(follow=False)`` follows nothing: a model that never selects over a 2-D parameter's width traces
    once with no routing, as the following recorder finds; one that may stops there (``restart``), and the
    following trace finds what it always found."""
    dormant, following = Routing(follow=False), Routing()
    first = meta_forward(LM(make), token_ids(2, SEQ), [dormant], backward=True)
    full = meta_forward(LM(make), token_ids(2, SEQ), [following], backward=True)
    assert full.failure is None
    if dormant.restart:
        assert first.stopped is not None and first.routing == []
    else:
        assert first.failure is None and first.stopped is None and first.routing == full.routing == []
    assert dormant.restart == (make is not Expert)  # TopKNotMoE selects over a projection's width: it may route
