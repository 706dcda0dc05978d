"""Which pipeline stage owns each part outside the blocks (parallel.pipeline.partition.stage_parts), from what the
model's traced call runs: a vision tower and a projector before the blocks go with the first stage, the final
norm and a head after them with the last; a part running among the blocks, or a parameter on the module holding
the blocks, is refused in one line. In process: the split ranks run one after the other (world 4 in the matrix:
tests/test_third_party.py, the LLaVA and ViT rows at pp2)."""

from __future__ import annotations

import copy

import pytest
import torch
from common import model_config
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.models.gpt import GPT


class VisionTower(nn.Module):
    """The tower as a module whose forward runs: a patch projection, a class embedding, an unused norm; it returns
    a tuple with a dict of hidden states (the structure a stand-in must give back)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(16, 32)
        self.cls = nn.Parameter(torch.randn(32))
        self.post_norm = nn.LayerNorm(32)  # never called, as LLaVA's post_layernorm

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, dict]:
        out = self.patch(pixels) + self.cls
        return out, {"hidden": (out, out * 2)}


class VLM(GPT):
    """Our GPT with a frozen vision tower and a projector before the blocks (their output added to the
    embeddings); ``among``: a module called between blocks 1 and 2; ``own_param``: a parameter of the module
    holding the blocks, used in its forward."""

    def __init__(self, among: bool = False, own_param: bool = False) -> None:
        super().__init__(model_config(layers=4))
        self.tower = VisionTower()
        self.tower.requires_grad_(False)
        self.projector = nn.Linear(32, 32)
        self.among = nn.Linear(32, 32) if among else None
        self.bias = nn.Parameter(torch.zeros(32)) if own_param else None

    def forward(self, idx: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        pos = torch.arange(idx.shape[1], device=idx.device)
        features, hidden = self.tower(pixels)
        image = self.projector(features + hidden["hidden"][1])
        x = self.tok_emb(idx) + self.pos_emb(pos) + image[:, None, :]
        if self.bias is not None:
            x = x + self.bias
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.among is not None and i == 1:
                x = self.among(x)
        return self.lm_head(self.ln_f(x))


def _parts(model: nn.Module, call: tuple[tuple, dict]):
    from lightning_autopar.parallel.pipeline import check_pipeline
    from lightning_autopar.parallel.units import trace_calls
    from lightning_autopar.profile.analyze import analyze

    analysis = analyze(model, trace=False)
    holder = nn.Module()
    holder.model = model
    trace = trace_calls(holder, model, 16, [b.fqn for b in analysis.blocks], call)
    return analysis, check_pipeline(analysis, model, model, 2, 1, trace, "model")


def _call() -> tuple[tuple, dict]:
    torch.manual_seed(1)
    return (torch.randint(0, 64, (2, 16)), torch.randn(2, 16)), {}


def test_parts_before_and_after_the_blocks_go_to_the_first_and_last_stage_and_train_as_one_device():
    from lightning_autopar.parallel.pipeline import chunk_sizes, split_model

    torch.manual_seed(0)
    model = VLM()
    call = _call()
    analysis, parts = _parts(model, call)
    assert set(parts.before) == {"tower", "projector", "tok_emb", "pos_emb"}
    assert parts.after == ("ln_f", "lm_head") and parts.idle == ()

    ref = model(*call[0])
    sizes = chunk_sizes(len(analysis.blocks), 2)
    chunks, copies = [], []
    for rank in range(2):
        part = copy.deepcopy(model)
        chunks += split_model(part, analysis, rank, 2, 1, sizes, lambda i: call, parts=parts)
        copies.append(part)
    first, last = chunks
    out = last.rebuild(last(first().detach()))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    names = [n for c in copies for n, _ in c.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()), "each parameter on exactly one rank"
    assert {n for n, _ in copies[0].named_parameters()} >= {"tower.cls", "tower.patch.weight", "projector.weight"}
    assert not any(n.startswith(("tower.", "projector.")) for n, _ in copies[1].named_parameters())


def test_a_split_vlm_passes_gradients_back_through_the_projector():
    from lightning_autopar.parallel.pipeline import chunk_sizes, split_model

    torch.manual_seed(0)
    model = VLM()
    call = _call()
    analysis, parts = _parts(model, call)
    reference = copy.deepcopy(model)
    reference(*call[0]).square().mean().backward()
    sizes = chunk_sizes(len(analysis.blocks), 2)
    copies = [copy.deepcopy(model) for _ in range(2)]
    first, last = (split_model(c, analysis, rank, 2, 1, sizes, lambda i: call, parts=parts)[0]
                   for rank, c in enumerate(copies))
    hidden = first()
    received = hidden.detach().requires_grad_()
    last.rebuild(last(received)).square().mean().backward()
    hidden.backward(received.grad)
    grads = {n: p.grad for c in copies for n, p in c.named_parameters() if p.grad is not None}
    for name, p in reference.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert "tower.patch.weight" not in grads  # frozen


def test_a_part_run_among_the_blocks_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^plan.pp: parameter 'among.weight' belongs to 'among', which runs "
                                          r"among the blocks"):
        _parts(VLM(among=True), _call())


def test_a_parameter_of_the_module_holding_the_blocks_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^plan.pp: parameter 'bias' is held by 'VLM', which also holds the "
                                          r"blocks"):
        _parts(VLM(own_param=True), _call())


def test_zero_outputs_give_zeros_in_the_outputs_structure_on_the_activations_device_and_dtype():
    from lightning_autopar.parallel.pipeline.standins import ChunkRun, ZeroOutputs

    tower = VisionTower()
    run = ChunkRun()
    run.received = torch.ones(2, 3, dtype=torch.float64)
    stand_in = ZeroOutputs(tower, run)
    assert not list(stand_in.parameters()) and stand_in.patch.in_features == 16  # attributes read through
    out, hidden = stand_in(torch.randn(5, 16))
    assert out.shape == (5, 32) and out.dtype == torch.float64 and not out.any()
    assert [t.shape for t in hidden["hidden"]] == [(5, 32), (5, 32)]


def test_reading_a_parameters_dtype_is_no_use_of_it():
    from lightning_autopar.profile.trace import ParameterUses, meta_forward

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.read = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x.to(self.read.weight.dtype))  # the ViT pattern: a weight's dtype read, not used

    trace = meta_forward(Reads(), ((torch.empty(2, 4, device="meta"),), {}), [ParameterUses(stacks=True)], grad=False)
    assert trace.error is None
    assert sorted(trace.unused) == ["read.bias", "read.weight"]


class Skips(GPT):
    """Our GPT whose embeddings reach more than the first block's input: ``x0`` given to every block (the
    modded-nanoGPT value residual), added back before the head, or an "encoder" output every block
    cross-attends to (an encoder-decoder whose decoder stack is split)."""

    def __init__(self, how: str) -> None:
        super().__init__(model_config(layers=4))
        self.how = how
        self.encoder = nn.Linear(32, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = x0 = self.tok_emb(idx) + self.pos_emb(pos)
        memory = self.encoder(x0)
        for block in self.blocks:
            if self.how == "x0 to every block":
                x = block(x) + 0.5 * x0
            elif self.how == "cross-attention":
                x = block(x + torch.sigmoid(memory))
            else:
                x = block(x)
        if self.how == "x0 before the head":
            x = x + x0
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("how, line", [
    ("x0 to every block", r"block 'model.blocks.1' takes as its hidden state a value computed from 'model.tok_emb'"),
    ("cross-attention", r"block 'model.blocks.1' takes as its hidden state a value computed from 'model.encoder'"),
    ("x0 before the head", r"the model reads a value computed from 'model.tok_emb' after its last block"),
])
def test_a_value_from_before_the_blocks_that_reaches_past_the_first_block_is_refused(how, line):
    """What runs before the blocks is zeros on the later stages: a model whose blocks or head read it other than
    through the first block's input cannot be split (silently wrong otherwise), in one line naming the part."""
    with pytest.raises(ConfigError, match=rf"^plan.pp: {line}.*: a pipeline stage other than the first has zeros"):
        _parts(Skips(how), ((torch.randint(0, 64, (2, 16)),), {}))
    _parts(Skips("plain"), ((torch.randint(0, 64, (2, 16)),), {}))  # the same model without it splits
