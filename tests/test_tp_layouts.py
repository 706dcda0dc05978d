"""Tensor parallelism from what the code does: the analysis traces the model on meta tensors (heads found in a
``view``, fused q/k/v and gate/up layouts, GPT-2's transposed Conv1D, attention and MLP parts in sibling modules
as in BERT), dry-runs each block's attention and MLP
on one TP rank's local shapes, and refuses tp > 1 with one line when the model's code cannot run that way.
Distributed: tp=2 equals the single-process loop for each layout (fused GQA [q | k | v] too, also under
tp=2 x dp=4 zero=3), and a DCP checkpoint written at tp=2 loads into the single-device model unchanged (names and
values); a row-permuted weight's optimizer states read in the single-device order."""

from __future__ import annotations

import pytest
import torch
from conftest import run_scenarios
from common import reference_run
from test_strategy import PARAM_ATOL, PARAM_RTOL, assert_equivalent, load
import tp_layout_scenarios as S

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.row_order import RowOrder
from lightning_autopar.parallel.tensor import LocalShardSpec, block_layout, check_tp
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


@pytest.mark.parametrize("name, tp_attrs", [
    ("phi3_gqa", ["config.num_attention_heads", "num_key_value_heads"]),
    ("litgpt_gqa", ["config.n_head", "config.n_query_groups"]),
])
def test_fused_gqa_in_unequal_sequential_pieces_is_offered(name, tp_attrs):
    """[q | k | v] of widths 32, 16, 16 (4 heads, 2 kv heads of 8): the dry run runs the model's own split on a
    rank's local widths (16, 8, 8) with the head counts divided; the layer stores the weight row-permuted."""
    model = S.MODELS[name]()
    _, transformer = find_transformer(model)
    a = analyze(transformer, runner=model)
    attn = a.blocks[0].attention
    assert (attn.qkv_layout, attn.qkv_pieces, attn.tp_refusal) == ("sequential", [32, 16, 16], None)
    assert sorted(attn.tp_attrs) == tp_attrs and attn.tp_validated
    check_tp(a, 2)
    style = block_layout(a.blocks[0])[f"{attn.fqn}.{attn.qkv}"]
    assert style.spec == LocalShardSpec("col", widths=(32, 16, 16))


def test_row_order_gives_each_rank_its_own_heads_q_k_and_v():
    """P(W) = [q_0; k_0; v_0; q_1; k_1; v_1]: a plain Shard(0) of it is rank r's [q_r; k_r; v_r]."""
    order = RowOrder((4, 2, 2), tp=2, dim=0)
    assert order.local_index(0).tolist() == [0, 1, 4, 6]
    assert order.local_index(1).tolist() == [2, 3, 5, 7]
    w = torch.arange(8.0).unsqueeze(1).expand(8, 3)
    permuted = w.index_select(0, order.permutation())
    assert permuted.chunk(2)[1][:, 0].tolist() == [2, 3, 5, 7]
    assert torch.equal(permuted.index_select(0, order.inverse()), w)


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


def test_encoder_heads_are_divided_on_the_submodule_that_reads_them():
    """BERT as written before transformers 4.48: the attention module is the common ancestor of q/k/v (in
    ``attention.self``) and o (``attention.output.dense``); the dry run finds the attributes its code needs
    divided on the submodule (a view by ``num_attention_heads``, one by ``all_head_size``)."""
    from lightning_autopar.profile.analyze import divide_attributes

    model = S.encoder_model()
    a = analyze(model)
    attn, mlp = a.blocks[0].attention, a.blocks[0].mlp
    assert (attn.fqn, attn.q, attn.o, attn.heads) == ("attention", "self.query", "output.dense", 4)
    assert attn.tp_attrs == ["self.num_attention_heads", "self.all_head_size"] and attn.tp_validated
    assert (mlp.fqn, mlp.up, mlp.down) == ("", "intermediate.dense", "output.dense")
    check_tp(a, 2)
    inner = model.layer[0].attention.self
    assert (inner.num_attention_heads, inner.all_head_size) == (4, 32)  # the dry run left the model as it was
    restore = divide_attributes(model.layer[0].attention, attn.tp_attrs, 2)
    assert (inner.num_attention_heads, inner.all_head_size) == (2, 16)
    restore()
    assert (inner.num_attention_heads, inner.all_head_size) == (4, 32)


def test_nested_config_paths_divide_the_submodules_own_copy():
    """"self.config.n_head" divides the head count on a shallow copy of ``self``'s config: the config other
    modules share keeps its value, and restoring puts the shared object back."""
    from types import SimpleNamespace

    from lightning_autopar.profile.analyze import divide_attributes

    shared = SimpleNamespace(n_head=4)
    outer = torch.nn.Module()
    outer.self = torch.nn.Module()
    outer.self.config = shared
    restore = divide_attributes(outer, ["self.config.n_head"], 2)
    assert outer.self.config.n_head == 2 and shared.n_head == 4 and outer.self.config is not shared
    restore()
    assert outer.self.config is shared


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


def test_qwen3_per_head_qk_norms_are_found_so_tp_sums_their_gradient():
    """Qwen3's q_norm / k_norm run over head_dim on each head (one weight for all heads): TP is not refused, and the
    analysis names them (``AttentionInfo.head_norms``), so TP sums their gradient over the TP group (each rank's
    use sees its local heads only; without the sum a tp=2 run drifted 6e-4 from one device in four steps)."""
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    model = transformers.Qwen3ForCausalLM(cfg)
    _, transformer = find_transformer(model)
    a = analyze(transformer, trace=True, runner=model)
    assert all(b.attention.head_norms == ["q_norm", "k_norm"] and b.attention.tp_refusal is None for b in a.blocks)
    check_tp(a, 2)


def test_a_module_per_head_is_refused():
    """StableLM's q/k LayerNorms are one LayerNorm per head (a ModuleList zipped with the heads): on a TP rank's
    local heads they would pair with the wrong heads (a tp=2 run drifted 3e-4 from one device, silently), so tp is
    refused in one line naming the module."""
    import transformers

    cfg = transformers.StableLmConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, qk_layernorm=True,
                                      max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    reason = refusal(transformers.StableLmForCausalLM(cfg))
    assert "layers.0.self_attn.q_layernorm.norms holds one LayerNorm per head (4)" in reason
    assert reason.endswith("fix: use tp=1")


def test_attention_sinks_are_per_head_parameters_split_with_the_heads():
    """GPT-OSS's attention sinks (one logit per head, a plain parameter of the attention module): found as a
    per-head parameter, sharded with the heads in the dry run, so tp=2 is not refused for them (the matrix's
    titan_sinks row trains equal at tp=2). A norm whose width happens to equal the head count is no such parameter."""
    from third_party_models import TitanTransformer

    model = TitanTransformer(sinks=True)
    a = analyze(model, trace=True)
    assert all(b.attention.head_params == ["sinks"] and b.attention.tp_refusal is None for b in a.blocks)
    check_tp(a, 2)


def test_t5_relative_bias_is_sharded_with_the_heads_and_cross_attention_refuses_sp():
    """Issue 26: T5's relative position bias (an Embedding [buckets, heads] in each stack's first self-attention)
    is a per-head table: TP shards it with the heads, so tp=2 runs on the local heads; the decoder's cross-attention
    is left whole by TP, so SP (which would hand it a split sequence) is refused in one line."""
    from lightning_autopar.parallel.apply import model_capabilities
    from lightning_autopar.parallel.sequence import check_sp

    model = S.T5LM()
    _, decoder = find_transformer(model)
    a = analyze(decoder, trace=True, runner=model)
    attn = a.blocks[0].attention
    assert attn.head_tables == ["relative_attention_bias"] and a.blocks[1].attention.head_tables == []
    assert attn.tp_refusal is None and a.blocks[0].other_attention == ["layer.1.EncDecAttention"]
    check_tp(a, 2)
    assert "layer.0.SelfAttention.relative_attention_bias" in block_layout(a.blocks[0])
    with pytest.raises(ConfigError, match=r"^plan.sp: block.0.layer.1.EncDecAttention: a second attention"):
        check_sp(a, decoder, 2, runner=model)
    # the embedding shared by the encoder, the decoder and the head: no pipeline stage can hold it for all three
    caps = model_capabilities(model, decoder, a, True)
    assert caps.excluded["pp"].startswith("plan.pp: tied parameters 't5.shared.weight' = 't5.encoder.embed_tokens")
    assert caps.excluded["pp"].endswith("fix: use pp=1")  # shared by both stacks: no config flag unties it
    assert "tp" not in caps.excluded and caps.excluded["sp"].startswith("plan.sp: block.0.layer.1.EncDecAttention")


def test_the_planner_is_told_why_tp_is_not_offered():
    from lightning_autopar import AutoParallelStrategy

    module = S.LitLM(S.nano_model())
    strategy = AutoParallelStrategy(cluster="cpu", print_plan=False)
    strategy.connect(module)
    transformer = find_transformer(module)[1]
    restrict = strategy._restrictions(transformer, analyze(transformer, runner=module), "fp32")
    assert restrict["tp"] == [1]
    assert "does not run on a TP rank's local heads" in strategy.excluded["tp"]


@pytest.mark.parametrize("width, op, args, expected", [
    (96, "split", (32, 2), ("sequential", [32, 32, 32])),
    (64, "split", ((32, 16, 16), -1), ("sequential", [32, 16, 16])),
    (96, "chunk", (3, -1), ("sequential", [32, 32, 32])),
    (96, "view", ((1, 16, 3, 4, 8),), ("sequential", [32, 32, 32])),
    (64, "view", ((1, 16, 2, 4, 8),), ("grouped", [2, 4, 8])),  # (groups, q_per_kv + 2, head_dim)
    (96, "view", ((1, 16, 12, 8),), None),  # heads straight away: which rows are q, k, v is unknown
    (64, "view", ((1, 16, -1, 32),), ("grouped", [2, 4, 8])),  # a row per group, split after (GPT-NeoX's view)
])
def test_fused_layout_rules(width, op, args, expected):
    """How a fused output is cut, from the first op the trace saw on it (4 heads, 2 kv groups of 8)."""
    assert fused_layout([(op, (1, 16, width), args, {})], width, 3, groups=2, per_group=4) == expected


# ------------------------------------------------------------------------------------------- distributed

MODELS = ["view", "gpt2", "litgpt", "phi3", "litgpt_gqa", "phi3_gqa", "encoder"]
ROW_ORDERED = {"litgpt_gqa": "transformer.h.0.attn.qkv.weight", "phi3_gqa": "model.layers.0.self_attn.qkv_proj.weight"}
STRIDED = {"gpt2": "transformer.h.0.attn.c_attn.weight", "litgpt": "transformer.h.0.attn.qkv.weight",
           "phi3": "model.layers.0.self_attn.qkv_proj.weight"}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, [*MODELS, *S.RESUMES], script="tp_layout_scenarios.py")


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
    if name in ROW_ORDERED:  # a plain Shard(0) of the row-permuted weight (FSDP's dim-1 cut beside it)
        assert result["placements"][f"model.{ROW_ORDERED[name]}"].endswith("Shard(dim=0))")


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 8, ["view_pp2_tp2_dp2", "litgpt_gqa_tp2_dp4_zero3"],
                         script="tp_layout_scenarios.py")


def test_heads_only_in_a_view_under_pp2_tp2_dp2(world8):
    """The issue's case: the live planner used to drop TP for this attention (structure alone finds no heads)."""
    result = load(world8, "view_pp2_tp2_dp2")
    assert (result["plan"]["pp"], result["plan"]["tp"], result["plan"]["dp"]) == (2, 2, 2)
    assert_equivalent(result, *reference_run(make=S.make("view")))


def test_fused_gqa_under_tp2_dp4_zero3(world8):
    """FSDP on top of the row-permuted weight: it shards the input dim, the rows stay each TP rank's own."""
    result = load(world8, "litgpt_gqa_tp2_dp4_zero3")
    assert (result["plan"]["tp"], result["plan"]["dp"], result["plan"]["zero"]) == (2, 4, 3)
    assert "Shard(dim=1), Shard(dim=0))" in result["placements"][f"model.{ROW_ORDERED['litgpt_gqa']}"]
    assert_equivalent(result, *reference_run(make=S.make("litgpt_gqa")))


def _dcp_into_single_device(out, name: str, model: str) -> None:
    import torch.distributed.checkpoint as dcp

    single = S.make(model)().model
    state = {"model": {f"model.{k}": torch.zeros_like(v) for k, v in single.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(out / f"{name}_dcp"))
    _, ref_state = reference_run(make=S.make(model))
    assert set(state["model"]) == set(ref_state)
    for key, value in state["model"].items():
        torch.testing.assert_close(value, ref_state[key], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=key)


def _reloaded_as_saved(result: dict) -> None:
    assert set(result["reloaded"]) == set(result["state"])
    for key, value in result["state"].items():
        torch.testing.assert_close(result["reloaded"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", ["gpt2", "litgpt", "phi3", "litgpt_gqa", "phi3_gqa"])
def test_dcp_checkpoint_at_tp2_loads_into_the_single_device_model(world2, name):
    _dcp_into_single_device(world2, name, name)


@pytest.mark.parametrize("name", ["gpt2", "litgpt", "phi3", "litgpt_gqa", "phi3_gqa"])
def test_dcp_checkpoint_loads_back_into_the_tp2_model(world2, name):
    """Zeroed, then read back through ``plain_shards`` / ``restore_layout``: the sharded model is as saved."""
    _reloaded_as_saved(load(world2, name))


def test_dcp_checkpoint_at_tp2_dp4_zero3_of_fused_gqa_round_trips(world8):
    """The row-permuted weight under FSDP reaches DCP as W: it loads into the single-device model, and back."""
    _dcp_into_single_device(world8, "litgpt_gqa_tp2_dp4_zero3", "litgpt_gqa")
    _reloaded_as_saved(load(world8, "litgpt_gqa_tp2_dp4_zero3"))


def reference_momentum(name: str) -> dict[str, torch.Tensor]:
    """The single-process loop's SGD momentum buffers by parameter name."""
    made = {}

    def make(**_):
        module = S.make(name)()
        configure = module.configure_optimizers
        module.configure_optimizers = lambda: made.setdefault("opt", configure())
        made["module"] = module
        return module

    reference_run(make=make)
    names = {id(p): n for n, p in made["module"].named_parameters()}
    return {names[id(p)]: state["momentum_buffer"] for p, state in made["opt"].state.items()}


@pytest.mark.parametrize("world, scenario, name", [("world2", "litgpt_gqa", "litgpt_gqa"),
                                                   ("world2", "phi3_gqa", "phi3_gqa"),
                                                   ("world8", "litgpt_gqa_tp2_dp4_zero3", "litgpt_gqa")])
def test_optimizer_states_of_a_row_permuted_weight_are_in_single_device_order(request, world, scenario, name):
    """The momentum of the row-permuted weight reads as the single-device one (names and row order), so a
    checkpoint's optimizer states reshard across plans; a DCP round trip (zeroed, loaded) restores them."""
    result = load(request.getfixturevalue(world), scenario)
    ref = reference_momentum(name)
    assert set(result["optim"]) == set(ref)
    for key, value in ref.items():
        torch.testing.assert_close(result["optim"][key]["momentum_buffer"], value, rtol=PARAM_RTOL,
                                   atol=PARAM_ATOL, msg=key)
        torch.testing.assert_close(result["optim_reloaded"][key]["momentum_buffer"],
                                   result["optim"][key]["momentum_buffer"], rtol=0, atol=0, msg=key)


def test_checkpoint_of_fused_gqa_at_tp2_resumes_at_another_plan(world2):
    """The strategy's sharded Lightning checkpoint saved at tp=2 (step 4) resumes at dp=2 zero=3 (tp=1) from
    another init: steps 5-8 equal the single-process loop, so model and optimizer states were stored as W (a
    momentum left in the row-permuted order would make them differ)."""
    from common import STEPS

    result = load(world2, "litgpt_gqa_resume_tp2_to_dp2")
    assert (result["plan"]["tp"], result["plan"]["dp"], result["plan"]["zero"]) == (1, 2, 3)
    assert_equivalent(result, *reference_run(make=S.make("litgpt_gqa")), first_step=STEPS // 2)
