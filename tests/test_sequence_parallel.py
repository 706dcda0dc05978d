"""Sequence parallelism on top of tp=2 (``parallel.sequence``): every plan equals the single-process loop (losses
per step, final weights) -- our GPT (also x dp=2 zero=3, in two pipeline stages, with full recompute, with MoE
blocks, also over ep=2 x dp=2), a tiny Hugging Face Llama and Mixtral, GPT-2 (fused ``c_attn``, Conv1D) --, it saves fewer activation bytes than tp=2 alone, and a
post-norm (BERT-style) block is refused with one line, decided by a meta dry run of the block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import run_scenarios
from common import reference_run
from test_strategy import assert_equivalent, load
from torch import nn
import sp_scenarios as S
import tp_layout_scenarios as T

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.sequence import check_sp
from lightning_autopar.parallel.tensor import block_layout
from lightning_autopar.profile.analyze import analyze, find_transformer

pytest.importorskip("transformers")

WORLD2 = ["gpt_sp", "gpt_sp_recompute", "gpt_moe_sp", "llama_sp", "mixtral_sp", "gpt2_sp", "gpt_tp_saved",
          "gpt_sp_saved"]
WORLD4 = ["gpt_sp_dp2_zero3", "gpt_sp_pp2", "gpt_moe_sp_dp2_ep2"]


def analysed(model: nn.Module):
    """(analysis, transformer) as the runtime makes them."""
    _, transformer = find_transformer(model)
    return analyze(transformer, trace=True, runner=model), transformer


# ------------------------------------------------------------------------------------------- structure (no processes)


class PostNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(T.HIDDEN, 2 * T.HIDDEN), nn.Linear(2 * T.HIDDEN, T.HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class PostNormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # BERT's attention: ``output`` adds the attention's own input inside (LayerNorm(dense(context) + input))
        self.attention, self.mlp, self.norm = T.EncoderAttention(), PostNormMLP(), nn.LayerNorm(T.HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.norm(x + self.mlp(x))


class PostNormEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, T.HIDDEN)
        self.layers = nn.ModuleList(PostNormBlock() for _ in range(2))
        self.head = nn.Linear(T.HIDDEN, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def refusal(model: nn.Module) -> str:
    analysis, transformer = analysed(model)
    with pytest.raises(ConfigError) as err:
        check_sp(analysis, transformer, 2)
    message = str(err.value)
    assert "\n" not in message and message.startswith("plan.sp: ") and "use sp=false" in message
    return message


def test_attention_adding_the_residual_inside_is_refused_by_the_dry_run():
    """Attention and MLP are distinct submodules, so only running the block tells: the attention's output module
    adds its [B, S, H] input to the reduce-scattered [B, S/tp, H] output."""
    message = refusal(PostNormEncoder())
    assert "layers.0: the block does not run on a sequence split over TP" in message


def test_hf_style_encoder_whose_mlp_spans_the_block_is_refused():
    assert "layer.0: the MLP spans the block itself" in refusal(T.encoder_model())


@pytest.mark.parametrize("make", [lambda: S.make("gpt")(), lambda: S.make("gpt")(experts=4, moe_every=2),
                                  lambda: S.make("llama")(), lambda: S.make("gpt2")()],
                         ids=["gpt", "gpt_moe", "llama", "gpt2"])
def test_pre_norm_models_are_accepted(make):
    analysis, transformer = analysed(make())
    check_sp(analysis, transformer, 2)
    check_sp(analysis, transformer, 1)  # no split: nothing to check


def test_sp_layout_puts_every_dense_projection_between_sequence_collectives():
    analysis, _ = analysed(S.make("gpt")(experts=4, moe_every=2))
    dense, moe = analysis.blocks[0], analysis.blocks[1]
    specs = {name: style.spec for name, style in block_layout(dense, sp=True).items()}
    assert set(specs) == {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj"}
    assert all(spec.sp for spec in specs.values()) and specs["attn.o_proj"].kind == "row"
    # experts keep TP's f/g (torch's styles): the MoE module sees the whole sequence
    assert not any(getattr(style, "spec", None) for name, style in block_layout(moe, sp=True).items()
                   if name.startswith("mlp.experts"))


# ------------------------------------------------------------------------------------------- distributed


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, WORLD2, script="sp_scenarios.py")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, WORLD4, script="sp_scenarios.py")


@pytest.mark.parametrize("name", [n for n in WORLD2 if not n.endswith("_saved")])
def test_tp2_sp_matches_single_process(world2, name):
    model, _, kwargs = S.PLANS[name]
    result = load(world2, name)
    assert (result["plan"]["tp"], result["plan"]["sp"]) == (2, True)
    assert_equivalent(result, *reference_run(make=S.make(model), **kwargs))


def test_tp2_sp_under_dp2_zero3_matches_single_process(world4):
    result = load(world4, "gpt_sp_dp2_zero3")
    assert (result["plan"]["tp"], result["plan"]["dp"], result["plan"]["zero"], result["plan"]["sp"]) == \
        (2, 2, 3, True)
    assert_equivalent(result, *reference_run())


def test_tp2_sp_with_experts_over_ep2_dp2_matches_single_process(world4):
    """The MoE module sees the whole sequence, so routing, the all-to-all and the balance loss over the data-parallel
    group are those without SP."""
    result = load(world4, "gpt_moe_sp_dp2_ep2")
    assert (result["plan"]["tp"], result["plan"]["dp"], result["plan"]["ep"], result["plan"]["sp"]) == (2, 2, 2, True)
    assert_equivalent(result, *reference_run(**S.PLANS["gpt_moe_sp_dp2_ep2"][2]))


def test_tp2_sp_in_two_pipeline_stages_matches_single_process(world4):
    """Each stage's run of blocks scatters and gathers the sequence itself; stages exchange whole sequences."""
    result = load(world4, "gpt_sp_pp2")
    assert (result["plan"]["pp"], result["plan"]["tp"], result["plan"]["sp"]) == (2, 2, True)
    assert_equivalent(result, *reference_run(**S.PLANS["gpt_sp_pp2"][2]))


def test_sp_saves_fewer_activation_bytes_than_tp_alone(world2):
    """Each block's two norm inputs and the attention's and MLP's inputs (saved as this rank's chunk, gathered
    again in backward) are held for S/tp tokens: at least layers * 4 * B * S * H * (1 - 1/tp) fp32 values fewer
    saved for backward (Korthikanti et al. 2022: 10sbh -> 10sbh/t, the dropout masks aside)."""
    from common import GLOBAL_BATCH, SEQ, model_config

    config = model_config(**S.PLANS["gpt_sp_saved"][2])
    tp_only, with_sp = load(world2, "gpt_tp_saved")["saved"], load(world2, "gpt_sp_saved")["saved"]
    at_least = config.layers * 4 * GLOBAL_BATCH * SEQ * config.hidden * (1 - 1 / 2) * 4
    assert tp_only - with_sp >= at_least, (tp_only, with_sp, at_least)


@pytest.mark.parametrize("transposed,bias", [(False, True), (False, False), (True, True)])
def test_column_from_chunk_keeps_the_chunk_and_matches_linear(transposed, bias):
    """``ColumnFromChunk`` (the comm simulated: the gathered sequence is tp copies of the chunk) gives the
    projection's output and gradients as autograd's linear does, saves the chunk and not the gathered sequence,
    and its column projections share one re-gather."""
    from lightning_autopar.parallel.tp_comm import GATHERED, ColumnFromChunk, SeqChunk, SeqComm

    torch.manual_seed(0)
    comm = SeqComm(None, 2)
    local = torch.randn(2, 3, 8, requires_grad=True)
    weights = [torch.randn(*((8, 5) if transposed else (5, 8)), requires_grad=True) for _ in range(2)]
    biases = [torch.randn(5, requires_grad=True) if bias else None for _ in range(2)]
    saved = []

    def run(fused):
        whole = torch.cat([local] * 2, 1)
        if fused:
            SeqChunk.tag(whole, local, comm)
        outs = []
        for w, b in zip(weights, biases):
            if fused:
                chunk = getattr(whole, GATHERED)
                outs.append(ColumnFromChunk.apply(whole, chunk.local, chunk.regather, w, b, transposed))
            else:
                outs.append(whole @ w + b if transposed and b is not None else F.linear(whole, w, b))
        return sum(o.square().sum() for o in outs)

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_loss = run(True)
    params = [local, *weights, *(b for b in biases if b is not None)]
    fused_grads = torch.autograd.grad(fused_loss, params)
    plain_loss = run(False)
    plain_grads = torch.autograd.grad(plain_loss, params)
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(fused_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (2, 6, 8) not in saved and (2, 3, 8) in saved, saved


def test_chunk_forward_under_autocast_matches_autocast_linear():
    """``keep_chunk_forward`` under CPU autocast (bf16) casts as autocast's linear does: same output and
    gradients, and the bf16 chunk is what it saves."""
    from lightning_autopar.parallel.tp_comm import SeqChunk, SeqComm, keep_chunk_forward

    torch.manual_seed(0)
    plain, chunked = nn.Linear(8, 6), nn.Linear(8, 6)
    chunked.load_state_dict(plain.state_dict())
    keep_chunk_forward(chunked, False)
    local = torch.randn(2, 3, 8, requires_grad=True)
    results = []
    for module, fused in ((plain, False), (chunked, True)):
        whole = torch.cat([local] * 2, 1)
        if fused:
            SeqChunk.tag(whole, local, SeqComm(None, 2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(whole)
        assert out.dtype == torch.bfloat16
        loss = out.float().square().sum()
        results.append((out, *torch.autograd.grad(loss, [local, module.weight, module.bias])))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
