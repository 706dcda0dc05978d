"""Tensor parallelism from what the code does: the analysis traces the model on meta tensors (heads found in a
``view``, fused q/k/v and gate/up layouts, GPT-2's transposed Conv1D), dry-runs each block's attention and MLP
on one TP rank's local shapes, and refuses tp > 1 with one line when the model's code cannot run that way.
Distributed: tp=2 equals the single-process loop for each layout, and a DCP checkpoint written at tp=2 loads
into the single-device model unchanged (names and values)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_scenarios
from common import reference_run
from test_strategy import PARAM_ATOL, PARAM_RTOL, assert_equivalent, load
import tp_layout_scenarios as S

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.tensor import check_tp
from lightning_autopar.profile.analyze import analyze, find_transformer, fused_layout

pytest.importorskip("transformers")


def refusal(model: torch.nn.Module, **kwargs) -> str:
    """The one-line reason the planner gets for not offering tp > 1 (what the strategy's restriction shows)."""
    with pytest.raises(ConfigError) as err:
        check_tp(analyze(model, **kwargs), 2, structure_only=True)
    assert "\n" not in str(err.value)
    return str(err.value)


# ------------------------------------------------------------------------------------------- analysis


def test_heads_only_in_a_view_are_found_by_the_trace():
    traced = analyze(S.view_model())
    attn = traced.blocks[0].attention
    assert (attn.q, attn.k, attn.v, attn.o, attn.heads, attn.head_dim) == ("wq", "wk", "wv", "wo", 4, 8)
    assert attn.tp_validated and attn.tp_attrs == [] and attn.tp_refusal is None
    check_tp(traced, 2, structure_only=True)
    # the structure alone cannot know the head count: this is why the strategy traces
    assert "attention projections not recognised" in refusal(S.view_model(), trace=False)


def test_gpt2_conv1d_fused_qkv():
    model = S.gpt2_model()
    a = analyze(model)
    attn, mlp = a.blocks[0].attention, a.blocks[0].mlp
    assert (attn.qkv, attn.o, attn.heads, attn.kv_heads) == ("c_attn", "c_proj", 4, 4)
    assert sorted(attn.transposed) == ["c_attn", "c_proj"] and sorted(mlp.transposed) == ["c_fc", "c_proj"]
    assert (attn.qkv_layout, attn.qkv_pieces) == ("sequential", [32, 32, 32])
    assert attn.tp_attrs == ["split_size"]  # GPT-2 splits c_attn's output by split_size; heads come from -1
    assert (mlp.up, mlp.down, mlp.ffn_hidden) == ("c_fc", "c_proj", 128)
    check_tp(a, 2)
    assert model.transformer.h[0].attn.split_size == 32  # the dry run left the model as it was


def test_phi3_fused_qkv_and_gate_up():
    model = S.phi3_model()
    config = model.model.layers[0].self_attn.config
    a = analyze(model)
    attn, mlp = a.blocks[0].attention, a.blocks[0].mlp
    assert (attn.qkv, attn.o, attn.qkv_layout) == ("qkv_proj", "o_proj", "sequential")
    assert (mlp.gate_up, mlp.up, mlp.gate, mlp.down, mlp.ffn_hidden) == ("gate_up_proj", "gate_up_proj", None,
                                                                         "down_proj", 64)
    assert a.spec.ffn_kind == "swiglu"
    assert sorted(attn.tp_attrs) == ["config.num_attention_heads", "num_key_value_heads"]
    check_tp(a, 2)
    attn_mod = model.model.layers[0].self_attn
    assert attn_mod.config is config and config.num_attention_heads == 4 and attn_mod.num_key_value_heads == 4


def test_fused_gqa_in_sequential_pieces_is_refused_with_the_reason():
    import transformers

    cfg = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                  pad_token_id=0, bos_token_id=0, eos_token_id=0)
    reason = refusal(transformers.Phi3ForCausalLM(cfg))
    assert reason.startswith("plan.tp: model.layers.0.self_attn.qkv_proj is a fused [q|k|v] with GQA")
    assert "is a fused [q|k|v] with GQA" in refusal(S.litgpt_model(query_groups=2))


def test_litgpt_fused_qkv_divides_its_own_config_copy():
    model = S.litgpt_model()
    name, transformer = find_transformer(model)
    assert name == "transformer"  # a ModuleDict: no forward of its own, the trace runs the GPT holding it
    a = analyze(transformer, runner=model)
    attn = a.blocks[0].attention
    assert (attn.qkv, attn.o, attn.qkv_layout) == ("qkv", "proj", "sequential")
    assert attn.tp_attrs == ["config.n_head", "config.n_query_groups"]
    check_tp(a, 2)
    assert "needs the meta trace" in refusal(transformer)  # without the runner the layout stays unknown


def test_nanogpt_attention_is_refused_because_its_code_needs_the_full_width():
    reason = refusal(S.nano_model())
    assert reason.startswith("plan.tp: blocks.0.attn: its code does not run on a TP rank's local heads (")
    assert reason.endswith("; fix: use tp=1")


def test_olmoe_qk_norm_over_the_full_width_is_refused():
    import transformers

    cfg = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                                   num_experts_per_tok=2, max_position_embeddings=16, pad_token_id=0,
                                   bos_token_id=0, eos_token_id=0)
    reason = refusal(transformers.OlmoeForCausalLM(cfg))
    assert "model.layers.0.self_attn.q_norm is a q/k norm over the full projection width (32)" in reason


def test_the_planner_is_told_why_tp_is_not_offered():
    from lightning_autopar import AutoParallelStrategy

    module = S.LitLM(S.nano_model())
    strategy = AutoParallelStrategy(cluster="cpu", print_plan=False)
    strategy.connect(module)
    restrict = strategy._restrictions(None, analyze(find_transformer(module)[1], runner=module), "fp32")
    assert restrict["tp"] == [1]
    assert "does not run on a TP rank's local heads" in strategy.excluded["tp"]


@pytest.mark.parametrize("width, op, args, expected", [
    (96, "split", (32, 2), ("sequential", [32, 32, 32])),
    (64, "split", ((32, 16, 16), -1), ("sequential", [32, 16, 16])),
    (96, "chunk", (3, -1), ("sequential", [32, 32, 32])),
    (96, "view", ((1, 16, 3, 4, 8),), ("sequential", [32, 32, 32])),
    (64, "view", ((1, 16, 2, 4, 8),), ("grouped", [2, 4, 8])),  # (groups, q_per_kv + 2, head_dim)
    (96, "view", ((1, 16, 12, 8),), None),  # heads straight away: which rows are q, k, v is unknown
])
def test_fused_layout_rules(width, op, args, expected):
    """How a fused output is cut, from the first op the trace saw on it (4 heads, 2 kv groups of 8)."""
    assert fused_layout([(op, (1, 16, width), args, {})], width, 3, groups=2, per_group=4) == expected


# ------------------------------------------------------------------------------------------- distributed

MODELS = ["view", "gpt2", "litgpt", "phi3"]
STRIDED = {"gpt2": "transformer.h.0.attn.c_attn.weight", "litgpt": "transformer.h.0.attn.qkv.weight",
           "phi3": "model.layers.0.self_attn.qkv_proj.weight"}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, MODELS, script="tp_layout_scenarios.py")


@pytest.mark.parametrize("name", MODELS)
def test_tp2_matches_single_process(world2, name):
    result = load(world2, name)
    assert (result["plan"]["tp"], result["plan"]["dp"]) == (2, 1)
    assert_equivalent(result, *reference_run(make=S.make(name)))
    if name in STRIDED:  # each rank holds its own heads' q, k and v rows
        assert "_StridedShard" in result["placements"][f"model.{STRIDED[name]}"] and "sf=3" in \
            result["placements"][f"model.{STRIDED[name]}"]
    if name == "phi3":
        assert "sf=2" in result["placements"]["model.model.layers.0.mlp.gate_up_proj.weight"]


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 8, ["view_pp2_tp2_dp2"], script="tp_layout_scenarios.py")


def test_heads_only_in_a_view_under_pp2_tp2_dp2(world8):
    """The issue's case: the live planner used to drop TP for this attention (structure alone finds no heads)."""
    result = load(world8, "view_pp2_tp2_dp2")
    assert (result["plan"]["pp"], result["plan"]["tp"], result["plan"]["dp"]) == (2, 2, 2)
    assert_equivalent(result, *reference_run(make=S.make("view")))


@pytest.mark.parametrize("name", ["gpt2", "litgpt", "phi3"])
def test_dcp_checkpoint_at_tp2_loads_into_the_single_device_model(world2, name):
    import torch.distributed.checkpoint as dcp

    single = S.make(name)().model
    state = {"model": {f"model.{k}": torch.zeros_like(v) for k, v in single.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(world2 / f"{name}_dcp"))
    _, ref_state = reference_run(make=S.make(name))
    assert set(state["model"]) == set(ref_state)
    for key, value in state["model"].items():
        torch.testing.assert_close(value, ref_state[key], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=key)


@pytest.mark.parametrize("name", ["gpt2", "litgpt", "phi3"])
def test_dcp_checkpoint_loads_back_into_the_tp2_model(world2, name):
    """Zeroed, then read back through ``plain_shards`` / ``restore_layout``: the sharded model is as saved."""
    result = load(world2, name)
    assert set(result["reloaded"]) == set(result["state"])
    for key, value in result["state"].items():
        torch.testing.assert_close(result["reloaded"][key], value, rtol=0, atol=0, msg=key)
