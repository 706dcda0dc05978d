"""Hugging Face Mixtral (transformers 5: fused 3-D expert weights) under expert, tensor and data parallelism
trains exactly like the single-process loop.

One torchrun launch of world 4 runs tests/dist/hf_moe_scenarios.py; per-step losses and final parameters are
compared with the plain single-process loop within LOSS_RTOL / PARAM_RTOL + PARAM_ATOL of tests/test_strategy.py
(reached: ~1e-7 relative on losses, ~1e-7 absolute on parameters). The balance-loss weight is raised to 0.5 so
that a per-rank (inexact) balance loss would fail the comparison (it misses by ~1e-3 on losses). In-process:
the analysis finds the fused layout, the planner's spec counts the experts, the strategy allows ep and tp, the
TP split of the fused experts is checked on their forward (and refused for a gate/up cut otherwise than
[gate | up]), HF's experts forward under the EP dispatch, and when the router logits are gathered.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from common import SEQ, STEPS, VOCAB
from conftest import run_scenarios
from test_strategy import assert_equivalent, load

transformers = pytest.importorskip("transformers")

from hf_moe_scenarios import CLIP, RESUME, SCENARIOS, TP_RESUME  # noqa: E402
from tests_hf import hf_reference_run, make_hf_moe_module  # noqa: E402

from lightning_autopar.errors import ConfigError  # noqa: E402

WORLD4 = [*SCENARIOS, RESUME, TP_RESUME]
# name -> (dp, zero, ep, tp)
LAYOUT = {"mixtral_dp4": (4, 0, 1, 1), "mixtral_ep2_zero3": (4, 3, 2, 1), "mixtral_ep4": (4, 0, 4, 1),
          "mixtral_ep2_clip": (4, 2, 2, 1), "mixtral_pp2_ep2": (2, 3, 2, 1), RESUME: (4, 3, 2, 1),
          "mixtral_tp2": (2, 3, 1, 2), "mixtral_tp2_ep2": (2, 2, 2, 2), TP_RESUME: (2, 3, 2, 2)}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, WORLD4, script="hf_moe_scenarios.py")


_REFERENCES: dict = {}


def reference(clip: float | None = None):
    if clip not in _REFERENCES:
        _REFERENCES[clip] = hf_reference_run(STEPS, make=make_hf_moe_module, clip=clip)
    return _REFERENCES[clip]


@pytest.mark.parametrize("name", WORLD4)
def test_mixtral_matches_single_process(world4, name):
    """dp=4 ep=1 (exact balance loss), ep=2 zero=3, ep=4 zero=0, ep=2 with clipping, pp=2 x dp=2 x ep=2, TP
    inside the fused experts (tp=2 x dp=2, and tp=2 x ep=2 with clipping), and resumes at step 4 (ep=2; tp=2 x
    ep=2, whose experts are 2-D strided DTensors in the checkpoint)."""
    result = load(world4, name)
    plan = result["plan"]
    assert (plan["dp"], plan["zero"], plan["ep"], plan["tp"]) == LAYOUT[name]
    clip = CLIP if "gradient_clip_val" in SCENARIOS.get(name, ("", {}))[1] else None
    assert_equivalent(result, *reference(clip), first_step=STEPS // 2 if name in (RESUME, TP_RESUME) else 0)


# ------------------------------------------------------------------------------------------- in-process


def _tiny_mixtral():
    torch.manual_seed(0)
    return make_hf_moe_module()


def test_analysis_finds_the_fused_layout_and_the_spec_counts_experts():
    from lightning_autopar.models.hf import LitCausalLM, causal_lm
    from lightning_autopar.parallel.tensor import check_tp
    from lightning_autopar.profile.analyze import analyze, find_transformer, model_spec_from_module
    from lightning_autopar.specs import load_model_spec

    module = _tiny_mixtral()
    analysis = analyze(find_transformer(module)[1], trace=False)
    moe = analysis.blocks[0].moe
    assert moe is not None and moe.fused
    assert (moe.fqn, moe.router, moe.experts) == ("mlp", "gate", "experts")
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden, moe.gated) == (4, 2, 64, True)
    assert moe.fused_params == ["gate_up_proj", "down_proj"]
    check_tp(analysis, 2)  # split inside each expert
    with pytest.raises(ConfigError, match=r"^plan.tp: tp=3 does not divide"):
        check_tp(analysis, 3)

    preset = load_model_spec("mixtral_tiny")
    model = causal_lm(preset)
    spec = model_spec_from_module(LitCausalLM(model))
    assert (spec.experts, spec.top_k, spec.ffn_hidden, spec.ffn_kind) == (4, 2, preset.ffn_hidden, "swiglu")
    actual = sum(p.numel() for p in model.parameters())
    assert spec.total_params() == pytest.approx(actual, rel=0.01)


def test_meta_trace_counts_routed_expert_flops():
    """The meta forward + backward runs on the fused experts (as batched_mm, restored after) and counts each
    token's top-k experts: 3 x (attention projections + scores + router + k SwiGLU experts) per token."""
    from lightning_autopar.profile.analyze import analyze, find_transformer

    transformer = find_transformer(_tiny_mixtral())[1]
    before = transformer.config._experts_implementation
    analysis = analyze(transformer, seq_len=SEQ, trace=True)
    assert transformer.config._experts_implementation == before
    assert not any("meta forward failed" in u for u in analysis.unclassified)
    h, kv, f, E, k = 32, 16, 64, 4, 2
    per_token = 2 * (2 * h * h + 2 * h * kv) + 2 * 2 * SEQ * h + 2 * h * E + k * 2 * 3 * h * f
    assert analysis.blocks[0].flops == 3 * SEQ * per_token


def test_strategy_allows_ep_and_tp_for_fused_experts():
    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.profile.analyze import analyze, find_transformer

    module = _tiny_mixtral()
    strategy = AutoParallelStrategy(cluster="cpu", print_plan=False)
    strategy.connect(module)
    restrict = strategy._restrictions(None, analyze(find_transformer(module)[1], trace=False), "fp32")
    assert restrict.get("tp", [2]) != [1]
    assert restrict.get("ep", [2]) != [1]


def test_fused_dispatch_runs_hf_experts_forward():
    """The EP dispatch (one rank) through HF's own experts forward equals the MoE block, for each experts
    implementation; a rank receiving no rows still gives every expert weight a (zero) gradient."""
    from lightning_autopar.parallel.experts import ExpertLayer, FusedExpertsForward

    block = _tiny_mixtral().model.model.layers[0].mlp
    experts = block.experts
    x = torch.randn(2, SEQ, 32)
    layer = ExpertLayer(fqn="mlp", module=block, experts=[experts], fused_params=["gate_up_proj", "down_proj"])
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        experts.config._experts_implementation = implementation
        ref = block(x)
        experts.forward = FusedExpertsForward(layer, 4, None, None)
        try:
            torch.testing.assert_close(block(x), ref, rtol=1e-6, atol=1e-7)
        finally:
            del experts.forward
    out = FusedExpertsForward(layer, 4, None, None).run_experts(x.new_zeros(0, 32), [0, 0, 0, 0])
    out.sum().backward()
    assert out.shape == (0, 32)
    assert all(p.grad is not None and not p.grad.any() for p in experts.parameters())


def test_router_logits_gathered_only_in_exact_training_forwards():
    """Training forwards gather the router logits; eval forwards and calls with an attention_mask do not (the
    latter with one warning)."""
    from lightning_autopar.parallel.experts import RouterLogitsGather

    model = _tiny_mixtral().model
    gather = RouterLogitsGather(model.model, group=None)
    seen: list[bool] = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda *_: seen.append(gather.active))
    ids = torch.randint(0, VOCAB, (2, SEQ))
    model.train()
    model(input_ids=ids)
    with pytest.warns(UserWarning, match="attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids)
    assert seen == [True, False, False] and not gather.active


def test_fused_experts_tp_split_checked_on_their_forward():
    """The TP split of the fused experts (gate_up_proj strided on dim 1 in [gate | up] pieces, down_proj on dim 2)
    is checked on the module's own forward, for each experts implementation; a forward cutting gate/up
    interleaved fails that probe and gets the contiguous split, which its probe passes; one cutting it otherwise
    is refused with one line; the module keeps its weights either way."""
    from lightning_autopar.parallel.tp_experts import choose_fused_split, fused_split_dims, probe_fused_split
    from lightning_autopar.profile.analyze import analyze, find_transformer

    transformer = find_transformer(_tiny_mixtral())[1]
    moe = analyze(transformer, trace=False).blocks[0].moe
    experts = transformer.layers[0].mlp.experts
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    split = fused_split_dims(experts, moe, "layers.0.mlp.experts")
    assert split.dims == {"gate_up_proj": (1, 2), "down_proj": (2, 1)} and split.once == ()
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        experts.config._experts_implementation = implementation
        probe_fused_split(experts, moe, split, 2, "layers.0.mlp.experts")

    class InterleavedExperts(type(experts)):
        """gate and up interleaved along dim 1 ([g0, u0, g1, u1, ...]): not a [gate | up] chunk."""

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for k in range(top_k_index.shape[1]):
                for e in range(self.gate_up_proj.shape[0]):
                    rows = top_k_index[:, k] == e
                    h = torch.nn.functional.linear(hidden_states[rows], self.gate_up_proj[e])
                    h = torch.nn.functional.linear(self.act_fn(h[:, self.gate]) * h[:, self.up], self.down_proj[e])
                    out[rows] += h * top_k_weights[rows, k, None]
            return out

    experts.__class__ = InterleavedExperts
    experts.gate, experts.up = slice(0, None, 2), slice(1, None, 2)
    with pytest.raises(ConfigError, match=r"^plan.tp: layers.0.mlp.experts: .*cut neither \[gate \| up\]"):
        probe_fused_split(experts, moe, split, 2, "layers.0.mlp.experts")
    assert choose_fused_split(experts, moe, 2, "layers.0.mlp.experts").dims == {"gate_up_proj": (1, 1),
                                                                                 "down_proj": (2, 1)}
    experts.gate, experts.up = slice(0, None, 3), slice(1, None, 3)  # neither: every third column
    with pytest.raises(ConfigError, match=r"^plan.tp: layers.0.mlp.experts: "):
        choose_fused_split(experts, moe, 2, "layers.0.mlp.experts")
    assert all(torch.equal(p, before[n]) for n, p in experts.named_parameters())


def test_gpt_oss_experts_split_interleaved_with_their_biases():
    """GPT-OSS's fused experts ([E, hidden, 2*ffn] with gate and up interleaved, [E, ffn, hidden], a bias of each):
    the weights split on their FFN side, contiguously; the input bias with them; the output bias added once (TP
    rank 0), as the probe on their own forward confirms."""
    transformers = pytest.importorskip("transformers")
    from lightning_autopar.parallel.tp_experts import choose_fused_split
    from lightning_autopar.profile.analyze import analyze

    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    model = transformers.GptOssModel(config)
    moe = analyze(model, trace=True).blocks[0].moe
    split = choose_fused_split(model.layers[0].mlp.experts, moe, 2, "layers.0.mlp.experts")
    assert split.dims == {"gate_up_proj": (2, 1), "gate_up_proj_bias": (1, 1), "down_proj": (1, 1)}
    assert split.once == ("down_proj_bias",)


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe", "mixtral"])
def test_default_configs_are_moe_and_offer_ep(family):
    """Issue 26: with the library's default ``output_router_logits=False`` (no router logits returned, no balance
    loss) the MoE layers are found from the traced routing (the router's top-k selection feeding the experts
    module with the expert ids: profile/routing.py), ep=2 is offered and a pinned ep=2 is planned."""
    from lightning_autopar.models.hf import LitCausalLM
    from lightning_autopar.runtime.setup import SetupOptions, Workload, analyse_model, find_capabilities, plan_model
    from lightning_autopar.runtime.trial import SetupSettings
    from lightning_autopar.specs import load_cluster_spec

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=64, max_position_embeddings=SEQ, num_experts_per_tok=2, bos_token_id=0,
                  eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    if family == "olmoe":
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=4, **common))
    elif family == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=64, **common))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **common))
    assert model.config.output_router_logits is False
    module = LitCausalLM(model)
    ids = torch.randint(0, VOCAB, (4, SEQ + 1))
    work = Workload(module, first_batch=(ids[:, :-1], ids[:, 1:]), loader_batch_size=4)
    options = SetupOptions(fix={"ep": 2}, settings=SetupSettings(trials=0, profile=False))
    analysed = analyse_model(work, lambda: pytest.fail("a transformer needs no model call"), None, 4)
    assert (analysed.analysis.spec.experts, analysed.analysis.spec.top_k) == (4, 2)
    routed = analysed.analysis.blocks[0].moe
    assert (routed.router, routed.experts, routed.expert_call) == ("gate", "experts", "indices")
    capable = find_capabilities(module, analysed.model, analysed.analysis, analysed.example, options, world_size=4)
    assert capable.capabilities.moe == "ep" and "ep" not in capable.capabilities.excluded
    planned = plan_model(analysed, capable, load_cluster_spec("cpu", nodes=1, devices_per_node=4), "32-true", options)
    assert planned.report.best.plan.ep == 2


def test_torchtitan_moe_layout_is_found_and_split_by_tp_and_ep():
    """Issue 26: torchtitan's MoE (a router module holding the gate Linear, GroupedExperts with 3-D w1/w2/w3
    called with the tokens sorted by expert and the count per expert) is found as MoE (experts, top-k, SwiGLU
    width: priced so) with that call, which TP and EP drive (the matrix's titan_grouped_moe row: equal at tp2
    and ep2)."""
    from third_party_models import EXPERTS, FFN, TOP_K, TitanTransformer

    from lightning_autopar.parallel.apply import model_capabilities
    from lightning_autopar.profile.analyze import analyze, find_transformer

    torch.manual_seed(0)
    model = TitanTransformer(moe="grouped")
    _, transformer = find_transformer(model)
    analysis = analyze(transformer, trace=True, runner=model)
    moe = analysis.blocks[0].moe
    assert (moe.router, moe.experts, moe.fused_params, moe.expert_call) == ("router.gate", "experts",
                                                                              ["w1", "w2", "w3"], "grouped")
    assert (analysis.spec.experts, analysis.spec.top_k, analysis.spec.ffn_hidden) == (EXPERTS, TOP_K, FFN)
    caps = model_capabilities(model, transformer, analysis, True)
    assert caps.moe == "ep" and not {"tp", "ep", "pp"} & set(caps.excluded), caps.excluded


def test_switch_transformers_experts_loop_is_traced_as_moe():
    """Issue 26: Switch Transformers' experts (a ModuleDict with a forward of its own: the experts hit, from
    ``nonzero``, each picked by a tensor's value in an f-string) cannot run on meta tensors; the trace runs each
    expert on the expected rows instead (``meta_shims``), and the sparse block's MoE is found from the routing:
    its top-1 router and the four experts the dispatch calls."""
    from third_party_models import make_switch

    from lightning_autopar.profile.analyze import analyze, find_transformer

    torch.manual_seed(0)
    module = make_switch()
    _, transformer = find_transformer(module)
    analysis = analyze(transformer, trace=True, runner=module)
    assert analysis.trace_failure is None
    assert [b.moe is not None for b in analysis.blocks] == [False, True]  # one sparse block of two per stack
    moe = analysis.blocks[1].moe
    assert (moe.router, moe.experts, moe.num_experts, moe.top_k, moe.fused) == ("router.classifier", "experts", 4,
                                                                               1, False)
    assert moe.expert_mlp is not None and (moe.expert_mlp.up, moe.expert_mlp.down) == ("wi", "wo")
    experts = transformer.get_submodule(f"{analysis.blocks[1].fqn}.{moe.fqn}.{moe.experts}")
    assert "forward" not in experts.__dict__  # the stand-in is gone after the trace

