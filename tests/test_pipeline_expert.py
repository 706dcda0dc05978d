"""Pipeline parallel (GPipe, 1F1B, interleaved), expert parallel and activation recompute train exactly like the
single-process loop.

Scenarios (tests/dist/pp_scenarios.py) run under torchrun, one process group per world size; per-step losses
and final parameters are compared with the plain single-process loop on the same model (fp32) within
LOSS_RTOL / PARAM_RTOL + PARAM_ATOL of tests/test_strategy.py (1e-5 relative; reached: ~2e-7 on losses,
~1e-6 relative on parameters). pp2_dp2_zero3, ep2 and pp2_ep2 also clip gradients (norms across stages / expert
ranks). MoE under pipelines (pp2_moe_*, pp2_ep2, pp2_tp2_moe_recompute, resume_pp_ep, pp_moe_validation): every
stage's balance losses reach the last stage's loss; their reference accumulates the same micro-batches (the
balance loss is per micro-batch, see tests/dist/common.reference_run).
Recompute's memory saving is measured in-process (CPU allocator via the profiler).
"""

from __future__ import annotations

import copy

import lightning.pytorch as L
import pytest
import torch
from conftest import run_scenarios
from common import STEPS, make_data, make_module, model_config, reference_run
from pp_scenarios import MOE, PP4, RESUME, SCENARIOS
from test_strategy import assert_equivalent, load

from lightning_autopar.errors import ConfigError

WORLD2 = ["pp2_gpipe", "pp2_1f1b", "pp2_interleaved", "recompute_full", "recompute_selective", "pp2_moe_1f1b",
          "pp2_moe_interleaved", "pp_validation", "pp_moe_validation"]
try:
    import litgpt.model  # noqa: F401

    HAVE_LITGPT = True
except ImportError:  # scripts/setup.sh installs it (without its pins)
    HAVE_LITGPT = False
if HAVE_LITGPT:
    WORLD2.append("litgpt_pp2")
WORLD4 = ["pp4_gpipe", "pp4_1f1b", "pp4_interleaved", "pp2_dp2_zero0", "pp2_dp2_zero3", "pp2_tp2", "ep2",
          "ep2_zero0", "ep4", "ep4_full", "ep2_tp2", "moe_dp4", "pp2_ep2", "pp2_tp2_moe_recompute", "resume_pp",
          "resume_ep", "resume_pp_ep"]
WORLD8 = ["pp2_tp2_dp2"]
MODEL = {name: spec[1] for name, spec in {**SCENARIOS, **RESUME}.items()}
CLIPPED = {name for name, spec in SCENARIOS.items() if len(spec) > 2 and "gradient_clip_val" in spec[2]}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, WORLD2, script="pp_scenarios.py")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, WORLD4, script="pp_scenarios.py")


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 8, WORLD8, script="pp_scenarios.py")


_REFERENCES: dict = {}


def reference(name: str, steps: int = STEPS):
    """The single-process run of scenario ``name``'s model (and gradient clipping, if it clips)."""
    clip = SCENARIOS[name][2]["gradient_clip_val"] if name in CLIPPED else None
    model = MODEL.get(name, PP4)
    fix = dict(kv.split("=") for kv in {**SCENARIOS, **RESUME}[name][0].split(","))
    # an MoE balance loss is per micro-batch: the reference runs the same micro-batches
    micro = int(fix.get("grad_accum", 1)) if model.get("experts") else 1
    dp = int(fix.get("dp", 1)) if micro > 1 else 1
    key = (tuple(sorted(model.items())), steps, clip, micro, dp)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(steps=steps, clip=clip, micro_batches=micro, dp=dp, **model)
    return _REFERENCES[key]


@pytest.mark.parametrize("name", [n for n in WORLD2 if n in SCENARIOS])
def test_world2_matches_single_process(world2, name):
    assert_equivalent(load(world2, name), *reference(name))


@pytest.mark.parametrize("name", [n for n in WORLD4 if not n.startswith("resume")])
def test_world4_matches_single_process(world4, name):
    assert_equivalent(load(world4, name), *reference(name))


@pytest.mark.skipif(not HAVE_LITGPT, reason="litgpt not installed (scripts/setup.sh installs it)")
def test_litgpt_gpt_pipelined_matches_single_process(world2):
    """litgpt's own GPT (fused qkv, RoPE caches on the root) in 4 interleaved chunks over 2 stages."""
    from tests_hf import hf_reference_run
    from tests_litgpt import make_litgpt_module

    result = load(world2, "litgpt_pp2")
    assert (result["plan"]["pp"], result["plan"]["vpp"]) == (2, 2)
    assert_equivalent(result, *hf_reference_run(STEPS, make=make_litgpt_module))


def test_pp2_tp2_dp2_on_8_processes(world8):
    result = load(world8, "pp2_tp2_dp2")
    plan = result["plan"]
    assert (plan["pp"], plan["tp"], plan["dp"]) == (2, 2, 2)
    assert_equivalent(result, *reference("pp2_tp2_dp2"))


@pytest.mark.parametrize("name", ["resume_pp", "resume_ep", "resume_pp_ep"])
def test_resume_with_pp_or_ep_continues_exactly(world4, name):
    """Saved at step 4 (DCP, each stage / expert rank its own keys), resumed from another init: steps 5-8 equal."""
    assert_equivalent(load(world4, name), *reference(name), first_step=STEPS // 2)


def test_plans_are_the_requested_ones(world2, world4):
    for name, (pp, schedule, vpp) in {"pp2_gpipe": (2, "gpipe", 1), "pp2_interleaved": (2, "interleaved", 2)}.items():
        plan = load(world2, name)["plan"]
        assert (plan["pp"], plan["schedule"], plan["vpp"]) == (pp, schedule, vpp)
    assert load(world2, "recompute_selective")["plan"]["recompute"] == "selective"
    assert load(world4, "pp4_interleaved")["plan"]["vpp"] == 2
    assert [load(world4, n)["plan"]["ep"] for n in ("ep2", "ep4", "moe_dp4")] == [2, 4, 1]
    assert [load(world4, "pp2_ep2")["plan"][k] for k in ("pp", "ep", "dp")] == [2, 2, 2]
    assert load(world2, "pp2_moe_interleaved")["plan"]["vpp"] == 2


@pytest.mark.parametrize("name, trained", [("pp_validation", "pp2_1f1b"), ("pp_moe_validation", "pp2_moe_1f1b")])
def test_validation_runs_forward_only_through_the_pipeline(world2, name, trained):
    """val_loss after 2 steps equals the single-device model's mean loss on the 2 validation batches, on all ranks
    (for the MoE model: cross-entropy plus every stage's balance losses); predict returns the model's logits."""
    result = load(world2, name)
    _, state = reference(trained, steps=2)
    module = make_module(**MODEL[trained])
    module.load_state_dict(state)
    data = make_data()
    with torch.no_grad():
        expected = sum(module.loss(data[i * 8:(i + 1) * 8]).item() for i in range(2)) / 2
    assert len(set(result["val_losses"])) == 1
    assert result["val_losses"][0] == pytest.approx(expected, rel=1e-5)
    # predict: the logits of the first batch, on the last stage's rank only (pp=2: rank 1)
    first, last = result["predictions"]
    assert first is None
    with torch.no_grad():
        torch.testing.assert_close(last, module(data[0:8][0]), rtol=1e-5, atol=1e-6)
    # trainer.validate alone (fresh Trainer, untrained module, planned from the validation loader)
    L.seed_everything(0, verbose=False)
    fresh = make_module(**MODEL[trained])
    with torch.no_grad():
        expected = sum(fresh.loss(data[i * 8:(i + 1) * 8]).item() for i in range(2)) / 2
    assert result["validate_alone"] == pytest.approx(expected, rel=1e-5)


# ------------------------------------------------------------------------------------------- in-process


def _peak_cpu_bytes(fn) -> int:
    """Peak CPU memory allocated while ``fn`` runs (the allocator's running total, via the profiler)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.total_allocated, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    return max(total for _, total, _ in events) - (events[0][1] - events[0][2])


def test_recompute_same_gradients_less_memory():
    from lightning_autopar.models.gpt import GPT, GPTConfig, lm_loss
    from lightning_autopar.parallel.recompute import apply_recompute

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab=64, seq_len=64, layers=4, hidden=64, heads=4, ffn_hidden=256))
    idx, targets = torch.randint(0, 64, (8, 64)), torch.randint(0, 64, (8, 64))
    peaks, grads, names = {}, {}, {}
    for mode in ("none", "selective", "full"):
        model = copy.deepcopy(base)
        apply_recompute(list(model.blocks), mode)
        names[mode] = [n for n, _ in model.named_parameters()]

        def step(model=model):
            model.zero_grad(set_to_none=True)
            lm_loss(model(idx), targets).backward()

        step()  # warm up
        peaks[mode] = _peak_cpu_bytes(step)
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    assert names["full"] == names["selective"] == names["none"], "recompute keeps the parameter names"
    for mode in ("selective", "full"):
        for g, ref in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-8)
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


def _split_and_run(model, analysis, pp, vpp, inputs):
    """Split copies of ``model`` as pipeline ranks 0..pp-1 would, run the chunks in stage order in-process."""
    from lightning_autopar.parallel.pipeline import chunk_sizes, split_model

    sizes = chunk_sizes(len(analysis.blocks), pp, vpp)
    chunks, copies = [], []
    for rank in range(pp):
        part = copy.deepcopy(model)
        chunks += split_model(part, analysis, rank, pp, vpp, sizes, lambda i: inputs)
        copies.append(part)
    out = None
    for chunk in sorted(chunks, key=lambda c: c.index):  # MoE values travel with the activation as a tuple
        out = chunk() if chunk.index == 0 else chunk(*(out if isinstance(out, tuple) else (out,)))
    return chunk.rebuild(out), copies


def _grads_by_name(*models) -> dict[str, torch.Tensor]:
    return {n: p.grad for m in models for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pp, vpp", [(2, 1), (4, 1), (2, 2)])
def test_split_keeps_names_and_output(pp, vpp):
    from lightning_autopar.models.gpt import GPT
    from lightning_autopar.profile.analyze import analyze

    torch.manual_seed(0)
    model = GPT(model_config(layers=8))
    idx = torch.randint(0, 64, (2, 16))
    analysis = analyze(model, trace=False)
    out, copies = _split_and_run(model, analysis, pp, vpp, ((idx,), {}))
    torch.testing.assert_close(out, model(idx), rtol=0, atol=0)
    names = [n for part in copies for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()), "each parameter on exactly one rank"


def test_split_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    from lightning_autopar.parallel.pipeline import check_pipeline
    from lightning_autopar.profile.analyze import analyze

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    analysis = analyze(model, trace=False)
    check_pipeline(analysis, model, model, 2, 2)
    ids, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    out, _ = _split_and_run(model, analysis, 2, 2, ((), {"input_ids": ids, "labels": labels}))
    ref = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)  # the model's own loss, on the last stage
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)


def test_split_reads_each_blocks_own_per_layer_config():
    """Hugging Face's loop reads ``config.layer_types[i]`` by the block's position (Gemma 3 here: sliding and full
    attention alternating): each chunk sees the list cut to its own blocks, so the split output is the model's
    exactly (before, a later chunk's first block took layer 0's sliding window)."""
    transformers = pytest.importorskip("transformers")
    from lightning_autopar.profile.analyze import analyze

    torch.manual_seed(0)
    kinds = ["sliding_attention", "full_attention"] * 2
    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                        layer_types=kinds, max_position_embeddings=32, tie_word_embeddings=False,
                                        attn_implementation="eager")
    model = transformers.Gemma3ForCausalLM(cfg)
    analysis = analyze(model, trace=False)
    ids = torch.randint(0, 64, (2, 16))
    out, _ = _split_and_run(model, analysis, 2, 2, ((), {"input_ids": ids}))
    torch.testing.assert_close(out.logits, model(input_ids=ids).logits, rtol=0, atol=0)
    assert model.config.layer_types == kinds  # restored after each chunk


@pytest.mark.parametrize("pp, vpp", [(2, 1), (4, 1), (2, 2)])
def test_split_moe_gpt_carries_balance_losses(pp, vpp):
    """Every stage's MoE balance losses reach the last stage's loss (model.aux_loss() there sees all layers)
    and their gradients reach the earlier stages: loss and gradients equal the unsplit model's."""
    from lightning_autopar.models.gpt import GPT, lm_loss
    from lightning_autopar.profile.analyze import analyze

    torch.manual_seed(0)
    model = GPT(model_config(layers=8, **MOE))
    idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    analysis = analyze(model, trace=False)
    full = copy.deepcopy(model)
    ref = lm_loss(full(idx), targets) + full.aux_loss()
    ref.backward()
    out, copies = _split_and_run(model, analysis, pp, vpp, ((idx,), {}))
    last = copies[(pp * vpp - 1) % pp]
    loss = lm_loss(out, targets) + last.aux_loss()
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    grads, ref_grads = _grads_by_name(*copies), _grads_by_name(full)
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert all(n.split(".")[0] != "pipeline_moe_stand_ins" for part in copies for n, _ in part.named_parameters())


def test_split_hugging_face_mixtral_carries_router_logits():
    """Hugging Face Mixtral's own balance loss on the last stage covers every layer's router logits."""
    transformers = pytest.importorskip("transformers")
    from lightning_autopar.profile.analyze import analyze

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     max_position_embeddings=32, output_router_logits=True)
    model = transformers.MixtralForCausalLM(cfg)
    analysis = analyze(model, trace=False)
    ids = torch.randint(0, 64, (2, 16))
    full = copy.deepcopy(model)
    ref = full(input_ids=ids, labels=ids)
    ref.loss.backward()
    out, copies = _split_and_run(model, analysis, 2, 2, ((), {"input_ids": ids, "labels": ids}))
    assert len(out.router_logits) == 4
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)  # includes router_aux_loss_coef * aux
    out.loss.backward()
    grads, ref_grads = _grads_by_name(*copies), _grads_by_name(full)
    assert sorted(grads) == sorted(ref_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_unsplittable_model_is_one_clear_error():
    from lightning_autopar.models.gpt import GPT
    from lightning_autopar.parallel.pipeline import check_pipeline
    from lightning_autopar.profile.analyze import analyze

    model = GPT(model_config(layers=4))
    model.extra = torch.nn.Linear(32, 32)  # a parameter no stage can own
    with pytest.raises(ConfigError, match=r"^plan.pp: parameter 'extra.weight' is outside the blocks"):
        check_pipeline(analyze(model, trace=False), model, model, 2)
    tied = GPT(model_config(layers=4, tied_embeddings=True))
    with pytest.raises(ConfigError, match="tied"):
        check_pipeline(analyze(tied, trace=False), tied, tied, 2)


def test_planner_chooses_ep_for_moe_when_fastest():
    """A fine-grained MoE on an H100 node: expert parallelism is priced fastest and chosen."""
    from lightning_autopar.planner.search import estimate, plan
    from lightning_autopar.specs import ModelSpec

    spec = ModelSpec(name="moe64", layers=24, hidden=2048, heads=16, ffn_hidden=1408, ffn_kind="swiglu",
                     vocab=32000, seq_len=4096, experts=64, top_k=6)
    report = plan(spec, "h100-sxm-dgx", global_batch=256, top=5)
    best = report.best
    assert best.plan.ep > 1, best.plan.short()
    assert all(c.step_time_s >= best.step_time_s for c in report.candidates)
    dense_layout = estimate(spec, "h100-sxm-dgx", {**best.plan.to_dict(), "ep": 1}, global_batch=256)
    assert dense_layout.step_time_s > best.step_time_s


def test_expert_dispatch_matches_moe_and_capacity_drops():
    """The EP forward on one rank computes the MoE layer exactly; a capacity factor drops assignments."""
    from lightning_autopar.models.gpt import MoE
    from lightning_autopar.parallel.experts import ExpertLayer, ExpertParallelForward

    torch.manual_seed(0)
    moe = MoE(model_config(**MOE))
    x = torch.randn(2, 16, 32)
    ref = moe(x)
    layer = ExpertLayer(fqn="mlp", module=moe, experts=list(moe.experts))
    torch.testing.assert_close(ExpertParallelForward(layer, 4, None, None)(x), ref, rtol=1e-6, atol=1e-7)
    dropped = ExpertParallelForward(layer, 4, None, None, capacity_factor=0.5)(x)
    kept = (dropped - ref).abs().amax(-1) < 1e-6
    assert 0 < int(kept.sum()) < kept.numel()  # some tokens lost an expert, the others are untouched
