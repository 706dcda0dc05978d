"""Data-parallel units chosen from what the model calls, and the guard that ties survive the apply (issue 12
items 0 and 2), in one process: which modules become units for Hugging Face GPT-2 (tied lm_head / wte), litgpt's
GPT (blocks in a ModuleDict) and our GPT; FSDP2 / replicate on a world-1 gloo group; the guard refusing a split
tie. The multi-process equivalence of these models is tests/test_third_party.py's matrix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import make_module, model_config
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.units import check_applied, choose_units, tie_groups, trace_calls
from lightning_autopar.profile.analyze import analyze, find_transformer

SEQ = 16


def make_gpt2() -> nn.Module:
    """A LightningModule around a tiny GPT2LMHeadModel, whose ``lm_head.weight`` is ``transformer.wte.weight``."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_autopar.models.hf import LitCausalLM

    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0)
    return LitCausalLM(GPT2LMHeadModel(config))


def make_litgpt() -> nn.Module:
    pytest.importorskip("litgpt")
    from tests_litgpt import make_litgpt_module

    return make_litgpt_module()


def units_of(root: nn.Module, with_blocks: bool = True):
    _, transformer = find_transformer(root)
    blocks = [b.fqn for b in analyze(transformer, trace=False).blocks]
    return choose_units(root, transformer, blocks, SEQ, wrap_blocks=with_blocks)


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- unit choice


def test_gpt2_tie_is_owned_by_the_lm_model_not_the_transformer():
    root = make_gpt2()
    units = units_of(root)
    assert units.blocks == ("model.transformer.h.0", "model.transformer.h.1")
    # GPT2Model ("model.transformer") holds wte but not lm_head: only GPT2LMHeadModel encloses both uses
    assert units.rest == ("model",)
    assert [t.names for t in tie_groups(root)] == [("model.transformer.wte.weight", "model.lm_head.weight")]
    assert units_of(root, with_blocks=False).rest == ("model",)  # DDP: the module the step calls


def test_litgpt_container_is_never_a_unit():
    root = make_litgpt()
    _, transformer = find_transformer(root)
    assert isinstance(transformer, nn.ModuleDict)  # what the structure search finds: it has no forward
    units = units_of(root)
    assert units.blocks == tuple(f"model.transformer.h.{i}" for i in range(4))
    assert units.rest == ("model",)  # litgpt's GPT, whose forward calls wte, the blocks, ln_f and lm_head
    trace = trace_calls(root, transformer, SEQ)
    assert trace.traced and "model.transformer" not in trace.called
    assert set(units.blocks + units.rest) <= trace.called


@pytest.mark.parametrize("tied", [False, True])
def test_our_gpt_units(tied):
    root = make_module(tied_embeddings=tied)
    units = units_of(root)
    assert units.blocks == ("model.blocks.0", "model.blocks.1") and units.rest == ("model",)
    assert [t.names for t in tie_groups(root)] == ([("model.tok_emb.weight", "model.lm_head.weight")] if tied else [])


class HeadFromEmbedding(nn.Module):
    """Blocks plus an embedding whose weight the model's own forward reuses as the output projection (a tie with
    one name: only the use shows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        return F.linear(x, self.emb.weight)


class Wrapper(nn.Module):
    def __init__(self, model: nn.Module, **extra: nn.Module) -> None:
        super().__init__()
        self.model = model
        for name, module in extra.items():
            self.add_module(name, module)


def test_a_parameter_used_outside_its_module_is_owned_by_the_enclosing_forward():
    root = Wrapper(HeadFromEmbedding())
    units = choose_units(root, root.model, ["blocks.0", "blocks.1"], SEQ)
    # "model.emb" is called, but its weight is also used by model's forward: emb cannot be the unit
    assert units.blocks == ("model.blocks.0", "model.blocks.1") and units.rest == ("model",)


def test_members_of_a_container_child_are_units():
    root = Wrapper(make_module().model, extra=nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}))
    units = choose_units(root, root.model, ["blocks.0", "blocks.1"], SEQ)
    assert units.rest == ("model", "extra.a", "extra.b")


def test_a_tie_outside_what_the_model_calls_is_refused():
    gpt = make_module().model
    head = nn.Linear(32, 64, bias=False)
    head.weight = gpt.tok_emb.weight  # used by the user's step, outside the traced GPT
    with pytest.raises(ConfigError, match=r"'model.tok_emb.weight' = 'head.weight'.*inside one module"):
        choose_units(Wrapper(gpt, head=head), gpt, ["blocks.0", "blocks.1"], SEQ)


def test_untraceable_model_falls_back_to_modules_with_a_forward():
    class NeedsMask(HeadFromEmbedding):
        def forward(self, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(idx) * mask

    root = Wrapper(NeedsMask())
    with pytest.warns(UserWarning, match="meta forward .* failed"):
        units = choose_units(root, root.model, ["blocks.0", "blocks.1"], SEQ)
    # the uses are unknown: the outermost module with a forward owns the rest (not "model.emb", whose weight
    # the model's forward also uses)
    assert units.blocks == ("model.blocks.0", "model.blocks.1") and units.rest == ("model",)


# ------------------------------------------------------------------------------------------- the guard


def test_guard_refuses_a_tie_broken_without_any_parallelism():
    root = make_module(tied_embeddings=True)
    ties = tie_groups(root)
    root.model.lm_head.weight = nn.Parameter(root.model.lm_head.weight.detach().clone())
    with pytest.raises(ConfigError, match=r"'model.tok_emb.weight' = 'model.lm_head.weight'.*separate tensors"):
        check_applied(root, ties, every_param=False)


def test_fsdp_on_the_chosen_units_keeps_gpt2_tied_and_named(single_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_autopar.parallel.fsdp import apply_data_parallel

    root = make_gpt2()
    names = list(root.state_dict())
    ties, units = tie_groups(root), units_of(root)
    roots = apply_data_parallel(root, units, init_device_mesh("cpu", (1,)), zero=3)
    check_applied(root, ties, every_param=True)
    assert roots == [root.model]
    assert root.model.lm_head.weight is root.model.transformer.wte.weight
    assert isinstance(root.model.lm_head.weight, DTensor)
    assert list(root.state_dict()) == names


def test_guard_catches_the_old_transformer_unit(single_process_group):
    """What issue 12 item 0 ran: blocks and GPT2Model sharded, GPT2LMHeadModel not. fully_shard swapped
    ``wte.weight`` for a sharded Parameter; ``lm_head`` (outside the unit) kept the old full tensor, whose
    gradient was never averaged: the guard stops it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = make_gpt2()
    ties = tie_groups(root)
    mesh = init_device_mesh("cpu", (1,))
    for block in root.model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(root.model.transformer, mesh=mesh)
    assert root.model.lm_head.weight is not root.model.transformer.wte.weight
    with pytest.raises(ConfigError, match=r"'model.transformer.wte.weight' = 'model.lm_head.weight'"):
        check_applied(root, ties, every_param=True)


def test_guard_refuses_a_parameter_in_no_unit(single_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = make_module()
    mesh = init_device_mesh("cpu", (1,))
    for block in root.model.blocks:
        fully_shard(block, mesh=mesh)
    with pytest.raises(ConfigError, match=r"'model.tok_emb.weight'.*in no data-parallel unit"):
        check_applied(root, [], every_param=True)


def test_guard_refuses_a_tie_in_two_replicate_units(single_process_group):
    from torch.distributed._composable.replicate import replicate

    from lightning_autopar.parallel.fsdp import apply_replicate

    root = make_gpt2()
    ties = tie_groups(root)
    apply_replicate(root, units_of(root, with_blocks=False), dist.group.WORLD)
    check_applied(root, ties, every_param=True)

    split = make_gpt2()
    replicate(split.model.transformer)
    replicate(split.model.lm_head)  # replicate keeps the tensor, but two reducers would average its gradient
    with pytest.raises(ConfigError, match=r"owned by 2 data-parallel units"):
        check_applied(split, ties, every_param=True)


def test_pipeline_refusal_names_the_tied_parameters():
    from lightning_autopar.models import GPT
    from lightning_autopar.parallel.pipeline import check_pipeline

    tied = GPT(model_config(layers=4, tied_embeddings=True))
    with pytest.raises(ConfigError, match=r"plan.pp: tied parameters 'tok_emb.weight' = 'lm_head.weight'"):
        check_pipeline(analyze(tied, trace=False), tied, tied, 2)


def test_blocks_that_cannot_run_on_meta_stand_in_as_identity():
    root = make_module(experts=4, top_k=2, moe_every=1)  # our MoE routes with torch.where: no meta kernel
    _, transformer = find_transformer(root)
    trace = trace_calls(root, transformer, SEQ, ["blocks.0", "blocks.1"])
    assert trace.traced and trace.partial and "nonzero" in trace.failure
    assert {"model.ln_f", "model.lm_head", "model.blocks.1"} <= trace.called  # the forward went on past block 0
    units = choose_units(root, transformer, ["blocks.0", "blocks.1"], SEQ, trace=trace)
    assert units.blocks == ("model.blocks.0", "model.blocks.1") and units.rest == ("model",)
    assert "forward" not in root.model.blocks[0].__dict__  # the stand-in is gone


def test_unreached_modules_are_the_outermost_wholly_unreached_ones():
    """What the FSDP reach check watches: the tower and the projector a VLM's token-id trace never reached, not
    their layers, and not a module holding reached parameters too."""
    from lightning_autopar.parallel.unreached import unreached_modules

    vlm = torch.nn.Module()
    vlm.tower = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    vlm.projector = torch.nn.Linear(4, 4)
    vlm.text = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    names = [n for n, _ in vlm.named_parameters() if not n.startswith("text.")] + ["text.1.bias"]
    assert unreached_modules(vlm, names) == ["tower", "projector"]  # text.1's weight was reached
