"""Context parallelism (``parallel.context``): the load-balanced sequence layout, the refusals found from the
model's structure, and (one torchrun at world 4, tests/dist/cp_scenarios.py) training under strategy="autopar"
equal to the single-process loop -- our GPT at cp2 x dp2 (zero 3; zero 0 with accumulation and full recompute),
cp4, tp2 x cp2 (sp off and on), pp2 x cp2, the tiny Hugging Face Llama (GQA) at cp2 x dp2; the heads flavour
(cp_kind=heads) at cp2 x dp2, cp4 and tp2+sp x cp2 for our GPT, the Llama at cp4 and with right padding at cp2 x
dp2 --, one-line refusals of a padding mask
and of a RoPE computed from the sequence length, and less activation memory at cp2 than at cp1."""

from __future__ import annotations

import pytest
import torch
from conftest import run_scenarios
from common import reference_run
from test_strategy import assert_equivalent, load

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.context import check_cp, gathered_positions, local_positions
from lightning_autopar.profile.analyze import analyze, find_transformer

WORLD4 = ["memory", "gpt_cp2_dp2", "gpt_cp2_dp2_zero0_accum", "gpt_cp4", "gpt_tp2_cp2", "gpt_tp2_cp2_sp",
          "gpt_pp2_cp2",
          "llama_cp2_dp2", "refuse_padding", "refuse_rope",
          "gpt_cp2_dp2_heads", "gpt_cp4_heads", "gpt_tp2_cp2_sp_heads", "llama_cp4_heads",
          "llama_cp2_heads_right_padding"]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, WORLD4, script="cp_scenarios.py")


# ------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ranks_hold_every_position_once_with_equal_causal_work(cp):
    seq = 8 * cp
    parts = [local_positions(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
    assert torch.equal(gathered_positions(seq, cp), torch.cat(parts))
    work = {int((p + 1).sum()) for p in parts}  # keys each rank's queries see under the causal mask
    assert len(work) == 1


# ------------------------------------------------------------------------------------------- refusals


def refusal(model: torch.nn.Module, cp: int = 2, **kwargs) -> str:
    _, transformer = find_transformer(model)
    with pytest.raises(ConfigError) as err:
        check_cp(analyze(transformer), transformer, cp, **kwargs)
    message = str(err.value)
    assert "\n" not in message and message.startswith("plan.cp:") and "cp=1" in message
    return message


def gpt(**overrides):
    from common import model_config

    from lightning_autopar.models.gpt import GPT

    return GPT(model_config(**overrides))


def test_our_gpt_is_accepted_and_its_attention_found():
    model = gpt()
    check_cp(analyze(model), model, 2)
    check_cp(analyze(model), model, 4)


def test_structural_refusals():
    assert "MoE layers" in refusal(gpt(experts=4, top_k=2))
    m = gpt(seq_len=12)  # 12 is padded to 16 for causal attention (the non-causal refusal: test_sequence_data)
    check_cp(analyze(m), m, 4)
    assert "compile=false" in refusal(gpt(), compile=True)


def test_an_attention_without_sdpa_is_refused():
    pytest.importorskip("transformers")
    import tp_layout_scenarios as S

    assert "does not call scaled_dot_product_attention" in refusal(S.encoder_model())


def test_litgpt_whose_blocks_run_from_a_module_dict_is_refused():
    pytest.importorskip("litgpt")
    import tp_layout_scenarios as S

    assert "not one module whose forward runs" in refusal(S.litgpt_model())


# ------------------------------------------------------------------------------------------- distributed


@pytest.mark.parametrize("name, cp, sp", [("gpt_cp2_dp2", 2, False), ("gpt_cp4", 4, False),
                                         ("gpt_tp2_cp2", 2, False), ("gpt_tp2_cp2_sp", 2, True),
                                         ("gpt_cp2_dp2_heads", 2, False), ("gpt_cp4_heads", 4, False),
                                         ("gpt_tp2_cp2_sp_heads", 2, True)])
def test_gpt_matches_single_process(world4, name, cp, sp):
    result = load(world4, name)
    kind = "heads" if name.endswith("_heads") else "gather"
    assert (result["plan"]["cp"], result["plan"]["sp"], result["plan"]["cp_kind"]) == (cp, sp, kind)
    assert_equivalent(result, *reference_run())


def test_gpt_zero0_accumulation_recompute_matches(world4):
    assert_equivalent(load(world4, "gpt_cp2_dp2_zero0_accum"), *reference_run(micro_batches=2, dp=2))


def test_gpt_pipeline_matches(world4):
    result = load(world4, "gpt_pp2_cp2")
    assert (result["plan"]["pp"], result["plan"]["cp"]) == (2, 2)
    assert_equivalent(result, *reference_run(micro_batches=4))


@pytest.mark.parametrize("name", ["llama_cp2_dp2", "llama_cp4_heads", "llama_cp2_heads_right_padding"])
def test_hf_llama_gqa_matches(world4, name):
    from cp_scenarios import make_for
    from tests_hf import hf_reference_run

    result = load(world4, name)
    assert result["plan"]["cp_kind"] == ("gather" if name == "llama_cp2_dp2" else "heads")
    assert_equivalent(result, *hf_reference_run(8, make=make_for(name) if "padding" in name else None))


@pytest.mark.parametrize("name, words", [("refuse_padding", "given a mask"),
                                         ("refuse_rope", "differs from the plain forward")])
def test_refusals_are_one_line(world4, name, words):
    error = load(world4, name)["error"]
    assert error is not None and "\n" not in error and words in error and error.endswith("use cp=1")


def test_cp2_saves_less_for_backward_than_cp1(world4):
    result = load(world4, "memory")
    assert result["cp2"] < 0.8 * result["cp1"], result


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("cp,heads,kv_heads", [(2, 4, 4), (3, 2, 2), (4, 4, 2)])
def test_mask_free_attention_equals_causal_attention_on_one_device(monkeypatch, kernel, cp, heads, kv_heads):
    """Every cp rank's mask-free attention (its queries over the gathered K/V) is the one-device causal attention
    at its positions, and the ranks' gradients add up to the one-device gradients (both chunk kernels)."""
    import torch.nn.functional as F

    from lightning_autopar.parallel import context as C

    if kernel == "math":
        monkeypatch.setattr(C, "_chunk_kernels", lambda device: (C._math_forward, C._math_backward))
    torch.manual_seed(cp)
    seq = 8 * cp
    q = torch.randn(2, heads, seq, 8, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 8, requires_grad=True) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    grad_out = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), grad_out)
    got = [torch.zeros_like(t) for t in (q, k, v)]
    order = gathered_positions(seq, cp)
    for rank in range(cp):
        mine = local_positions(seq, cp, rank)
        inputs = (q.detach()[:, :, mine].requires_grad_(), k.detach()[:, :, order].requires_grad_(),
                  v.detach()[:, :, order].requires_grad_())
        out = C.chunked_causal_attention(*inputs, C.CPGroup(None, cp, rank), None)
        torch.testing.assert_close(out, ref[:, :, mine], rtol=1e-5, atol=1e-5)
        for total, grad, where in zip(got, torch.autograd.grad(out, inputs, grad_out[:, :, mine]),
                                      (mine, order, order)):
            total[:, :, where] += grad
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_mask_free_attention_reorders_the_gather_into_global_chunks(cp):
    """The all-gather's slots put back in global order are the global positions in order (so a query chunk's
    earlier keys are one prefix and its diagonal the next chunk)."""
    from lightning_autopar.parallel.context import chunk_slots

    seq = 4 * cp
    order = gathered_positions(seq, cp).view(2 * cp, 2)
    assert torch.equal(torch.cat([order[s] for s in chunk_slots(cp)]), torch.arange(seq))


# ------------------------------------------------------------------------------------------- planner


def test_the_planner_prices_what_runs():
    """Per block: K/V all-gathered forward, reduce-scattered backward, nothing hidden; the logits gathered and
    the loss on the whole sequence (its memory independent of cp)."""
    from test_planner_comm import cluster

    from lightning_autopar.planner import cost as C
    from lightning_autopar.specs import ModelSpec

    hw = C.Hardware.from_cluster(cluster())
    m = ModelSpec(name="m", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=100, seq_len=64)
    kv = 2 * 2 * 64 * m.kv_heads * m.head_dim / 1 * 2.0
    fwd, bwd = C.cp_comm_per_block(hw, m, 2, 64, 1, 2, 2.0)
    assert fwd == pytest.approx(C.allgather_time(hw, kv, 2, 1)) and fwd > 0
    assert bwd == pytest.approx(C.reduce_scatter_time(hw, kv, 2, 1))
    assert C.cp_comm_per_block(hw, m, 2, 64, 1, 1, 2.0) == (0.0, 0.0)
    assert C.logits_bytes(m, 2, 64, 1, 2, 2.0) == C.logits_bytes(m, 2, 64, 1, 1, 2.0)


# ------------------------------------------------------------------------------------------- the heads flavour


def test_the_heads_flavour_is_priced_as_four_all_to_alls_each_way():
    """DeepSpeed-Ulysses per block: q, k, v and the output exchanged (b*s/cp*heads*d/tp*e bytes each rank holds;
    k and v at the kv heads, repeated to the heads where cp does not divide them), the same backward."""
    from test_planner_comm import cluster

    from lightning_autopar.planner import cost as C
    from lightning_autopar.specs import ModelSpec

    hw = C.Hardware.from_cluster(cluster())
    m = ModelSpec(name="m", layers=2, hidden=64, heads=8, kv_heads=2, ffn_hidden=128, vocab=100, seq_len=64)
    local = 2 * 64 / 2 * m.head_dim * 2.0
    fwd, bwd = C.cp_heads_comm_per_block(hw, m, 2, 64, 1, 2, 2.0)
    want = 2 * C.alltoall_time(hw, local * 8, 2, 1) + 2 * C.alltoall_time(hw, local * 2, 2, 1)
    assert fwd == pytest.approx(want) and bwd == pytest.approx(want) and fwd > 0
    repeated, _ = C.cp_heads_comm_per_block(hw, m, 2, 64, 1, 4, 2.0)  # 2 kv heads over cp=4: sent as 8
    local4 = 2 * 64 / 4 * m.head_dim * 2.0
    assert repeated == pytest.approx(4 * C.alltoall_time(hw, local4 * 8, 4, 1))
    assert C.cp_heads_comm_per_block(hw, m, 2, 64, 1, 1, 2.0) == (0.0, 0.0)
    gf, _ = C.cp_comm_by_kind(hw, m, 2, 64, 1, 2, 2.0, 0)
    assert gf == pytest.approx(C.cp_comm_per_block(hw, m, 2, 64, 1, 2, 2.0)[0])
    # memory: no gathered K/V, the output before the exchange back (and repeated K/V) instead
    gather = C.activation_bytes_per_block(m, 1, 64, 1, False, 4, 0, 2.0)
    heads = C.activation_bytes_per_block(m, 1, 64, 1, False, 4, 0, 2.0, cp_kind=1)
    assert heads - gather == pytest.approx(16 * (2.0 * 64 + 4 * (8 - 2) * m.head_dim) - 48 * 4.0 * 2 * m.head_dim)


def test_heads_are_offered_where_they_divide_and_can_pay():
    from lightning_autopar.planner.space import heads_rule, heads_searched

    assert heads_rule(4, 2, 2, 2) is None and "cp=4" in heads_rule(4, 2, 2, 4)
    assert heads_searched(32, 32, 1, 2) and heads_searched(32, 8, 1, 8)
    assert not heads_searched(32, 8, 1, 2)  # GQA at a small cp: more bytes and more memory than the gather
    assert not heads_searched(32, 32, 1, 64)  # does not divide


def test_a_fixed_heads_flavour_that_cannot_run_is_refused_in_one_line():
    from lightning_autopar.planner.space import check_fix
    from lightning_autopar.specs import ModelSpec, Plan, parse_fix

    m = ModelSpec(name="m", layers=2, hidden=64, heads=4, kv_heads=4, ffn_hidden=128, vocab=100, seq_len=64)
    with pytest.raises(ConfigError) as err:
        check_fix(m, 8, 8, 64, parse_fix("tp=2,cp=4,cp_kind=heads"))
    assert str(err.value).startswith("fix.cp_kind:") and "cp_kind=gather" in str(err.value)
    assert parse_fix("cp_kind=ulysses") == {"cp_kind": "heads"}
    assert "cp=2/heads" in Plan(dp=1, cp=2, cp_kind="heads").short()


@pytest.mark.parametrize("kv_heads, seq, kind", [(32, 8192, "heads"), (4, 8192, "gather"), (8, 256, "gather"),
                                                 (8, 8192, "heads")])
def test_the_planner_picks_the_flavour_per_model_and_length(kv_heads, seq, kind):
    """cp=8 on 16 devices: with as many kv heads as heads the all-to-alls move a quarter of the gather's bytes;
    with 4 kv heads of 32 more; with 8, fewer bytes but 4x the collectives' latency: the gather at 256 tokens,
    the heads from 8k."""
    from test_planner_comm import cluster

    from lightning_autopar.planner.search import plan
    from lightning_autopar.specs import ModelSpec

    m = ModelSpec(name="m", layers=4, hidden=4096, heads=32, kv_heads=kv_heads, ffn_hidden=11008, vocab=32000,
                  seq_len=seq)
    best = plan(m, cluster(nodes=2, dpn=8), global_batch=16, seq_len=seq, fix="cp=8,tp=1", explain_choice=False).best
    assert best.plan.cp_kind == kind
