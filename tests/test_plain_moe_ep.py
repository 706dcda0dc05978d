"""Expert parallelism on a MoE written the plain way (a router nn.Linear, an nn.ModuleList of expert MLPs, the
top-k loop over the experts in forward, no route() method): the user's forward runs unchanged, captured and
replayed around one all-to-all exchange per layer (parallel.experts.PlainExpertForward).

One torchrun launch of world 4 runs tests/dist/plain_moe_scenarios.py (the plain test model of plain_moe.py at
ep=2 zero=0, ep=2 zero=3, ep=4 with clipping, tp=2 x ep=2, ep=2 with full recompute, pp=2 x ep=2, and litgpt's
LLaMAMoE at ep=2); per-step losses and final parameters must equal the plain single-process loop within
LOSS_RTOL / PARAM_RTOL + PARAM_ATOL of tests/test_strategy.py (reached: ~1e-7 relative on losses, ~2e-7 absolute
on parameters). The plain model's router z-loss (a token mean, on self.aux_loss) is part of the loss, so
its value and gradients under data parallelism are checked too. In-process: detection, capture/replay on one
rank equals the plain forward and its gradients (random routing noise included), the refusals, and the price.
"""

from __future__ import annotations

import copy

import pytest
import torch
from common import SEQ, STEPS, VOCAB, reference_run
from conftest import run_scenarios
from plain_moe import PlainMoE, make_dict_moe_module, make_litgpt_moe_module, make_plain_moe_module
from plain_moe_scenarios import CLIP, SCENARIOS
from test_strategy import assert_equivalent, load
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.experts import (ExpertSlots, ExpertSlotsDict, apply_plain_expert_parallel, check_ep,
                                                moe_modules, plain_layout, replays_forward, supports_ep)
from lightning_autopar.profile.analyze import analyze, find_transformer

# name -> (dp, zero, ep, tp)
LAYOUT = {"plain_ep2_zero0": (4, 0, 2, 1), "plain_ep2_zero3": (4, 3, 2, 1), "plain_ep4_clip": (4, 0, 4, 1),
          "plain_tp2_ep2": (2, 3, 2, 2), "dict_tp2_ep2": (2, 3, 2, 2), "litgpt_moe_ep2": (4, 0, 2, 1), "plain_ep2_recompute": (4, 3, 2, 1),
          "plain_pp2_ep2": (2, 3, 2, 1)}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, list(SCENARIOS), script="plain_moe_scenarios.py")


_REFERENCES: dict = {}


def reference(make, clip):
    if (make, clip) not in _REFERENCES:
        _REFERENCES[make, clip] = reference_run(STEPS, make=make, clip=clip)
    return _REFERENCES[make, clip]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_plain_moe_matches_single_process(world4, name):
    make, _, trainer_kwargs = SCENARIOS[name]
    result = load(world4, name)
    plan = result["plan"]
    assert (plan["dp"], plan["zero"], plan["ep"], plan["tp"]) == LAYOUT[name]
    clip = CLIP if "gradient_clip_val" in trainer_kwargs else None
    assert_equivalent(result, *reference(make, clip))


# ------------------------------------------------------------------------------------------- in-process


def _layers(module, trace=False):
    transformer = find_transformer(module)[1]
    analysis = analyze(transformer, trace=trace)
    return transformer, analysis, moe_modules(transformer, analysis)


@pytest.mark.parametrize("make", [make_plain_moe_module, make_litgpt_moe_module])
def test_plain_layout_is_detected_structurally(make):
    transformer, analysis, layers = _layers(make())
    assert len(layers) == 2
    assert all(plain_layout(m, info) and supports_ep(m, info) for _, m, info in layers)
    assert replays_forward(transformer, analysis)
    check_ep(analysis, transformer, 2)


def test_route_and_dense_models_are_not_plain():
    from common import make_module

    transformer, analysis, layers = _layers(make_module(experts=4, top_k=2))
    assert layers and not any(plain_layout(m, info) for _, m, info in layers)  # route(): its own dispatch
    assert not replays_forward(transformer, analysis)


def test_experts_that_are_not_mlps_are_refused_in_one_line():
    """Experts the analysis cannot read as hidden -> ffn -> hidden MLPs: no output shape to stand in for."""

    class Odd(nn.Module):  # hidden -> hidden, one matrix: not an MLP
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x):
            return self.proj(x)

    module = make_plain_moe_module()
    for layer in module.model.layers:
        layer.moe.experts = nn.ModuleList(Odd() for _ in range(4))
    transformer, analysis, layers = _layers(module)
    assert layers and not any(supports_ep(m, info) for _, m, info in layers)
    with pytest.raises(ConfigError) as err:
        check_ep(analysis, transformer, 2)
    assert "\n" not in str(err.value) and str(err.value).startswith("plan.ep: layers.0.moe (PlainMoE)")


def _apply_one_rank(module, trace=False):
    """Every MoE layer through the capture / exchange / replay path on one rank (no process group)."""
    _, _, layers = _layers(module, trace)
    return [apply_plain_expert_parallel(fqn, m, info, None) for fqn, m, info in layers]


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ), generator=gen), torch.randint(0, VOCAB, (2, SEQ), generator=gen)


@pytest.mark.parametrize("make", [make_plain_moe_module, make_litgpt_moe_module, make_dict_moe_module])
def test_capture_replay_equals_the_plain_forward(make):
    """Loss and every gradient (router, experts, and through the expert rows to the layers below) equal the
    unchanged module's; parameter names and the state dict stay the user's. Experts in a ModuleDict are found
    from the trace's routing (the structure-only analysis reads lists)."""
    torch.manual_seed(0)
    module = make()
    plain = copy.deepcopy(module)
    layers = _apply_one_rank(module, trace=make is make_dict_moe_module)
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(module.state_dict()) == list(plain.state_dict())
    assert all(len(layer.experts) == 4 for layer in layers)
    batch = _batch()
    loss, ref = module.loss(batch), plain.loss(batch)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(module.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_slots_stand_for_every_expert_and_hold_the_local_ones():
    module = make_plain_moe_module()
    _apply_one_rank(module)
    experts = module.model.layers[0].moe.experts
    assert isinstance(experts, ExpertSlots) and len(experts) == 4 and len(list(experts)) == 4
    assert not isinstance(experts[1], nn.Module)  # a call slot, no parameters of its own
    assert list(experts._modules) == ["0", "1", "2", "3"]
    with pytest.raises(ConfigError, match=r"^plan.ep: layers.0.moe: expert 1 was called outside"):
        experts[1](torch.zeros(3, 32))


def test_dict_slots_stand_for_every_expert_by_key_and_hold_the_local_ones():
    module = make_dict_moe_module()
    transformer, analysis, layers = _layers(module, trace=True)
    assert len(layers) == 2 and all(plain_layout(m, info) and supports_ep(m, info) for _, m, info in layers)
    check_ep(analysis, transformer, 2)
    _apply_one_rank(module, trace=True)
    experts = module.model.layers[0].moe.experts
    keys = [f"expert_{e}" for e in range(4)]
    assert isinstance(experts, ExpertSlotsDict) and len(experts) == 4 and list(experts) == keys
    assert list(experts.keys()) == keys and [k for k, _ in experts.items()] == keys and "expert_2" in experts
    assert not isinstance(experts["expert_1"], nn.Module) and len(list(experts.values())) == 4
    assert list(experts._modules) == keys


class _NoisyMoE(PlainMoE):
    """Router jitter (random noise on the logits, as Switch's) and an in-place usage counter."""

    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return super().forward(x * (1 + 0.5 * torch.rand_like(x)))


def test_replay_draws_the_captured_random_numbers_and_buffers_update_once():
    torch.manual_seed(0)
    module = make_plain_moe_module()
    for layer in module.model.layers:
        noisy = _NoisyMoE(32, 64, 4, 2)
        noisy.load_state_dict(layer.moe.state_dict(), strict=False)
        layer.moe = noisy
    plain = copy.deepcopy(module)
    assert len(_apply_one_rank(module)) == 2
    batch = _batch(1)
    torch.manual_seed(5)
    loss = module.loss(batch)
    after = torch.rand(())
    torch.manual_seed(5)
    ref = plain.loss(batch)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(after, torch.rand(()))  # the random stream continues as on one pass
    assert float(module.model.layers[0].moe.calls) == 1.0


def test_a_forward_calling_experts_differently_on_replay_is_refused():
    class Flaky(PlainMoE):
        """Calls expert 0 once more on every other call: not a function of its inputs."""

        def __init__(self, *args):
            super().__init__(*args)
            self.count = 0

        def forward(self, x):
            self.count += 1
            out = super().forward(x)
            return out + self.experts[0](x) if self.count % 2 else out

    module = make_plain_moe_module()
    for layer in module.model.layers:
        layer.moe = Flaky(32, 64, 4, 2)
    assert len(_apply_one_rank(module)) == 2
    with pytest.raises(ConfigError, match=r"^plan.ep: layers.0.moe: the replayed forward called its experts "
                                          r"differently"):
        module.loss(_batch())


def test_strategy_allows_ep_and_prices_the_replay():
    """The strategy offers ep > 1 for the plain layout and marks the spec; the planner adds the second forward
    (router GEMM, gathers and the per-expert loop) at ep > 1 only."""
    from lightning_autopar import AutoParallelStrategy, estimate
    from lightning_autopar.specs import ModelSpec

    module = make_plain_moe_module()
    strategy = AutoParallelStrategy(cluster="cpu", print_plan=False)
    strategy.connect(module)
    analysis = analyze(find_transformer(module)[1], trace=False)
    restrict = strategy._restrictions(None, analysis, "fp32")
    assert restrict.get("ep", [2]) != [1]
    assert analysis.spec.moe_replay
    from lightning_autopar.profile.analyze import model_spec_from_module

    assert model_spec_from_module(make_plain_moe_module()).moe_replay  # lightning_autopar.plan(module) too

    spec = dict(name="moe", layers=8, hidden=1024, heads=16, ffn_hidden=2816, ffn_kind="swiglu", vocab=32000,
                seq_len=2048, experts=8, top_k=2)
    fields = dict(dp=8, zero=1, tp=1, pp=1, ep=2, mbs=1, grad_accum=4, recompute="none", precision="bf16-mixed")
    routed = estimate(ModelSpec(**spec), "h100-sxm-dgx", fields, global_batch=32)
    plain = estimate(ModelSpec(**spec, moe_replay=True), "h100-sxm-dgx", fields, global_batch=32)
    assert plain.breakdown.compute_s > routed.breakdown.compute_s
    assert plain.step_time_s > routed.step_time_s
    dense = {**fields, "ep": 1}
    assert estimate(ModelSpec(**spec, moe_replay=True), "h100-sxm-dgx", dense, global_batch=32).step_time_s == \
        estimate(ModelSpec(**spec), "h100-sxm-dgx", dense, global_batch=32).step_time_s


def test_experts_always_used_gives_skipped_experts_a_zero_gradient():
    """A plain MoE that calls only the experts its tokens were routed to: with ``experts_always_used`` every expert
    parameter takes a gradient (zero where skipped), so every data-parallel rank reduces the same tensors; the
    output and the used experts' gradients are unchanged, bit for bit."""
    from lightning_autopar.parallel.experts import experts_always_used

    class Skipping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                                         for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            scores = self.router(flat).softmax(-1)
            choice = scores.argmax(-1)
            out = torch.zeros_like(flat)
            for e, expert in enumerate(self.experts):
                rows = (choice == e).nonzero().squeeze(-1)
                if rows.numel():
                    out[rows] = expert(flat[rows]) * scores[rows, e:e + 1]
            return out.view_as(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), Skipping()) for _ in range(2))
            self.head = nn.Linear(8, 16)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx)
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    torch.manual_seed(0)
    plain, touched = Model(), Model()
    touched.load_state_dict(plain.state_dict())
    analysis = analyze(touched, trace=True)
    assert all(b.moe is not None and not b.moe.fused for b in analysis.blocks)
    experts_always_used(touched, analysis)
    idx = torch.tensor([[1, 1, 1]])  # three equal tokens: one expert hit per layer
    for model in (plain, touched):
        model(idx).square().mean().backward()
    assert torch.equal(plain(idx), touched(idx))
    skipped = [n for n, p in plain.named_parameters() if p.grad is None]
    assert skipped and all(n.startswith("blocks.") and ".experts." in n for n in skipped)
    grads = dict(touched.named_parameters())
    for name, p in plain.named_parameters():
        got = grads[name].grad
        assert got is not None, name
        assert torch.equal(got, torch.zeros_like(got) if p.grad is None else p.grad), name
