"""Any nn.Module as units (profile/units.py): units partition the parameters, their FLOPs equal FlopCounterMode on
real tensors, ties stay in one unit, kinds are found, the step's model call is found, and the front door picks the
transformer analysis for BERT / ViT and the unit form for ResNet, a plain CNN and a 3D U-Net."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_autopar.errors import ConfigError
from lightning_autopar.models.unet import ConvBlock3d
from lightning_autopar.profile.analyze import ModelAnalysis
from lightning_autopar.profile.units import (REST, UnitModelAnalysis, analyze_model, analyze_units, describe_units,
                                             find_model_call, flop_formulas)

tf = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------- models


class PlainCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.fc(x.flatten(1))


class UNet3D(nn.Module):
    """Two levels: skip connections joined by torch.cat in the root forward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc1, self.enc2 = ConvBlock3d(1, 4, groups=2), ConvBlock3d(4, 8, groups=2)
        self.pool = nn.MaxPool3d(2)
        self.bottom = ConvBlock3d(8, 16, groups=2)
        self.up2, self.dec2 = nn.ConvTranspose3d(16, 8, 2, stride=2), ConvBlock3d(16, 8, groups=2)
        self.up1, self.dec1 = nn.ConvTranspose3d(8, 4, 2, stride=2), ConvBlock3d(8, 4, groups=2)
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        b = self.bottom(self.pool(e2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


def resnet() -> nn.Module:
    config = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck",
                             num_labels=3)
    return tf.ResNetForImageClassification(config)


def vit() -> nn.Module:
    config = tf.ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64, num_labels=3)
    return tf.ViTForImageClassification(config)


def bert() -> nn.Module:
    config = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32)
    return tf.BertForMaskedLM(config)


BATCH = 2
MODELS = {
    "resnet": (resnet, lambda: torch.randn(BATCH, 3, 32, 32)),
    "vit": (vit, lambda: torch.randn(BATCH, 3, 16, 16)),
    "bert": (bert, lambda: torch.randint(0, 64, (BATCH, 16))),
    "cnn": (PlainCNN, lambda: torch.randn(BATCH, 3, 16, 16)),
    "unet": (UNet3D, lambda: torch.randn(BATCH, 1, 8, 8, 8)),
}


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    make, example = MODELS[name]
    return make(), example()


def real_flops(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """FlopCounterMode on real tensors, per module fqn ("" = the model), with SDPA's CPU kernel counted."""
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        model(x)
    counts = counter.get_flop_counts()
    root = type(model).__name__
    return {name: float(sum(counts.get(f"{root}.{name}" if name else root, {}).values()))
            for name, _ in model.named_modules()}


# ------------------------------------------------------------------------------------------- analysis


@pytest.mark.parametrize("name", list(MODELS))
def test_units_partition_params_and_match_flop_counter(name):
    model, x = build(name)
    a = analyze_units(model, ((x,), {}))
    assert a.failure == ""
    assert sum(u.params for u in a.units) == sum(p.numel() for p in model.parameters())  # ties counted once
    names = [u.name for u in a.units]
    assert names[: len(a.modules)] == a.modules and set(names[len(a.modules):]) <= {REST}
    real = real_flops(model, x)
    for unit in a.units[: len(a.modules)]:
        assert unit.flops * BATCH == pytest.approx(real[unit.name], rel=1e-9), unit.name
        assert 0 <= unit.conv_flops <= unit.flops
    assert sum(u.flops for u in a.units) * BATCH == pytest.approx(real[""], rel=1e-9)
    assert sum(u.activation_bytes for u in a.units) > 0 and sum(u.ops for u in a.units) > 0
    assert all(u.output_bytes > 0 for u in a.units[: len(a.modules)])
    a.spec(name).validate()
    assert all(p.device.type == "cpu" for p in model.parameters())  # nothing moved


def test_sizes_are_per_sample():
    model = PlainCNN()
    one = analyze_units(model, ((torch.randn(1, 3, 16, 16),), {}))
    four = analyze_units(model, ((torch.randn(4, 3, 16, 16),), {}))
    assert one.units == four.units


@pytest.mark.parametrize("name, kinds", [
    ("resnet", {"conv", "batchnorm", "pool", "linear"}),
    ("vit", {"conv", "linear", "layernorm", "attention", "mlp"}),
    ("bert", {"embedding", "linear", "layernorm", "attention", "mlp", "tied"}),
    ("cnn", {"conv", "batchnorm", "pool", "linear"}),
    ("unet", {"conv", "groupnorm", "pool"}),
])
def test_kinds_found(name, kinds):
    model, x = build(name)
    a = analyze_units(model, ((x,), {}))
    found = set().union(*(u.kinds for u in a.units))
    assert kinds <= found
    assert a.has_batchnorm == (name in ("resnet", "cnn"))


def test_repeated_blocks_are_units():
    """ViT's encoder layers and ResNet's bottleneck layers (a stage's first one included) are one unit each."""
    a = analyze_units(vit(), ((torch.randn(1, 3, 16, 16),), {}))
    assert [m for m in a.modules if m.startswith("vit.layers")] == ["vit.layers.0", "vit.layers.1"]
    config = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[3, 3], layer_type="bottleneck")
    a = analyze_units(tf.ResNetForImageClassification(config), ((torch.randn(1, 3, 32, 32),), {}))
    layers = [f"resnet.encoder.stages.{s}.layers.{i}" for s in (0, 1) for i in range(3)]
    assert [m for m in a.modules if m.startswith("resnet.encoder")] == layers
    assert a.modules[-1] == "classifier"  # the stem, big in so small a model, may be split


def test_unet_cat_in_the_root_goes_to_rest():
    model, x = build("unet")
    a = analyze_units(model, ((x,), {}))
    rest = a.units[-1]
    assert rest.name == REST and rest.params == 0 and rest.flops == 0
    assert rest.memory_bytes > 0 and rest.ops >= 2  # the two cats (and the pools, modules without work)
    assert {"enc1", "dec1", "head"} <= {m.split(".")[0] for m in a.modules}


def test_bert_tie_stays_in_one_unit():
    model, x = build("bert")
    a = analyze_units(model, ((x,), {}))
    assert ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight") in a.ties
    for tie in a.ties:
        holders = {n.rpartition(".")[0] for n in tie}
        owners = {next((m for m in a.modules if h == m or h.startswith(m + ".")), REST) for h in holders}
        assert len(owners) == 1, tie
    assert "tied" in a.units[-1].kinds and a.units[-1].name == REST  # the tie's smallest enclosing module is the model


def test_tie_lifted_to_enclosing_called_module():
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mid, self.out = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):
            return self.out(torch.tanh(self.mid(self.emb(idx))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm, self.extra = TiedLM(), nn.Linear(50, 50)

        def forward(self, idx):
            return self.extra(self.lm(idx))

    a = analyze_units(Net(), ((torch.zeros(2, 4, dtype=torch.long),), {}))
    assert a.modules == ["lm", "extra"]
    assert "tied" in a.units[0].kinds and a.units[0].params == 50 * 16 + 16 * 16 + 16


def test_saved_storage_counted_once():
    class Square(nn.Module):
        def forward(self, x):
            return x * x  # saves x twice: one storage

    model = nn.Sequential(nn.Linear(4, 8), Square())
    a = analyze_units(model, ((torch.randn(3, 4),), {}))
    assert a.modules == ["0"]
    assert a.units[0].activation_bytes == 4 * 4  # the linear's input row; its weight is a parameter
    assert a.units[1].name == REST and a.units[1].activation_bytes == 8 * 4


def test_meta_failure_units_from_structure_and_data_parallel_only():
    """A forward that does not run on meta tensors: units from structure, and the planner still offers DP and
    FSDP (they need no structure), reporting why the rest is excluded; a pinned pp is refused in one line."""
    from lightning_autopar.planner.search import plan
    from lightning_autopar.planner.space import check_unit_fix
    from lightning_autopar.specs import load_cluster_spec

    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            return self.b(x[x.sum(-1) > 0])  # boolean indexing: nonzero, no meta kernel

    model = DataDependent()
    a = analyze_units(model, ((torch.randn(2, 4),), {}))
    assert a.failure and a.modules == ["a", "b"]
    assert sum(u.params for u in a.units) == 40
    spec = analyze_model(model, ((torch.randn(2, 4),), {})).spec
    assert spec.unit_form and "nonzero" in spec.trace_failure
    report = plan(spec, load_cluster_spec("cpu", devices_per_node=4), global_batch=8, precision="fp32",
                  explain_choice=False)
    assert {(c.plan.tp, c.plan.pp, c.plan.cp, c.plan.ep) for c in report.candidates} == {(1, 1, 1, 1)}
    assert {c.plan.dp for c in report.candidates} == {4}
    assert {"pp", "tp", "recompute"} <= set(report.excluded)
    assert all("meta trace of the forward failed" in report.excluded[k] for k in ("pp", "tp", "recompute"))
    check_unit_fix(spec, {"dp": 4, "zero": 3})
    with pytest.raises(ConfigError, match=r"^fix\.pp: DataDependent: its forward does not run on meta tensors"):
        check_unit_fix(spec, {"pp": 2})


# ------------------------------------------------------------------------------------------- front door


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_front_door_transformers_keep_the_transformer_analysis(name):
    model, x = build(name)
    a = analyze_model(model, ((x,), {}))
    assert type(a) is ModelAnalysis and not a.spec.unit_form
    assert a.blocks[0].attention is not None and a.blocks[0].attention.heads == 2


@pytest.mark.parametrize("name", ["resnet", "cnn", "unet"])
def test_front_door_unit_form(name):
    model, x = build(name)
    a = analyze_model(model, ((x,), {}))
    assert isinstance(a, UnitModelAnalysis) and a.spec.unit_form and a.detail is not None
    assert [b.fqn for b in a.blocks] == a.detail.modules and a.blocks_fqn == ""
    assert a.total_params == sum(p.numel() for p in model.parameters())
    by_name = {u.name: u for u in a.detail.units}
    assert all(b.flops == 3 * by_name[b.fqn].flops for b in a.blocks)
    assert a.flops_total == pytest.approx(3 * sum(u.flops for u in a.spec.units))
    assert (a.batch, a.seq_len, a.token_embedding, a.lm_head) == (1, 1, None, None)
    with pytest.raises(ConfigError, match="no example input"):
        analyze_model(model, None)


def test_describe_units_accepts_spec_and_analysis():
    model, x = build("cnn")
    a = analyze_model(model, ((x,), {}))
    text = describe_units(a.spec)
    assert text == describe_units(a) == describe_units(a.detail)
    lines = text.splitlines()
    assert lines[0].split() == ["unit", "kinds", "params", "GFLOPs/sample", "act", "MiB/sample"]
    assert lines[2].startswith("conv1") and "conv" in lines[2] and lines[-1].startswith("total")


# ------------------------------------------------------------------------------------------- the model call


class Normalize(nn.Module):
    def forward(self, x):
        return (x - x.mean()) / (x.std() + 1e-5)


class LitCNN(L.LightningModule):
    def __init__(self, call_self: bool = False) -> None:
        super().__init__()
        self.norm, self.model, self.call_self = Normalize(), PlainCNN(), call_self

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = self.norm(x)  # holds no parameters: not the model
        logits = self(x) if self.call_self else self.model(x)
        return F.cross_entropy(logits, y)


@pytest.mark.parametrize("call_self, fqn", [(False, "model"), (True, "")])
def test_find_model_call(call_self, fqn):
    lit = LitCNN(call_self)
    batch = (torch.randn(2, 3, 16, 16), torch.tensor([0, 1]))
    call = find_model_call(lit, partial(lit.training_step, batch, 0))
    assert call.fqn == fqn and call.module is lit.get_submodule(fqn) and call.kwargs == {}
    assert call.args[0].shape == (2, 3, 16, 16) and not call.args[0].requires_grad
    assert all(not m._forward_pre_hooks for m in lit.modules())  # hooks removed
    assert analyze_model(call.module, (call.args, call.kwargs)).spec.unit_form


def test_find_model_call_refusals():
    lit = LitCNN()
    with pytest.raises(ConfigError, match="never called a module"):
        find_model_call(lit, lambda: torch.zeros(1))
    with pytest.raises(ConfigError, match="raised before calling a module"):
        find_model_call(lit, lambda: lit.training_step((torch.randn(2, 3, 16, 16),), 0))
    assert all(not m._forward_pre_hooks for m in lit.modules())


# ------------------------------------------------------------------------------------------- timing check


def timing_check() -> None:
    """Not a test (timings depend on the machine's load): the issue's target is < 2 s each for a ResNet-152-size
    and a BERT-Large-size model on meta tensors. ``python tests/test_unit_analysis.py`` prints the seconds of
    ``analyze_model`` (the front door: the transformer analysis tried first) and of ``analyze_units``."""
    import time

    with torch.device("meta"):
        resnet152 = tf.ResNetForImageClassification(tf.ResNetConfig(depths=[3, 8, 36, 3], layer_type="bottleneck"))
        bert_large = tf.BertForMaskedLM(tf.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                                      intermediate_size=4096))
    cases = [("ResNet-152", resnet152, torch.empty(8, 3, 224, 224, device="meta")),
             ("BERT-Large", bert_large, torch.zeros(8, 512, dtype=torch.long, device="meta"))]
    for name, model, x in cases:
        for fn in (analyze_model, analyze_units):
            start = time.perf_counter()
            result = fn(model, ((x,), {}))
            seconds = time.perf_counter() - start
            units = len(result.modules) if fn is analyze_units else len(result.blocks)
            print(f"{name}: {fn.__name__} {seconds:.2f} s ({type(result).__name__}, {units} units/blocks)")


if __name__ == "__main__":
    timing_check()


def test_frozen_parameters_counted_per_unit_and_in_the_transformer_spec():
    """Issue 26: parameters with requires_grad=False are counted where they sit (a frozen vision tower: its
    units), so the planner prices no gradient or optimizer state for them; a transformer's spec counts its own."""
    from third_party_models import TwoTower

    from lightning_autopar.profile.analyze import model_spec_from_module

    torch.manual_seed(0)
    model = TwoTower()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    spec = analyze_model(model, ((torch.randint(0, 64, (2, 16)),), {})).spec
    assert spec.unit_form and spec.frozen_params == frozen > 0
    assert all(u.frozen_params in (0, u.params) for u in spec.units)  # the tower's units are frozen whole
    assert 0 < spec.trainable_share() < 1

    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=16))
    llama.model.embed_tokens.requires_grad_(False)
    assert model_spec_from_module(llama).frozen_params == 64 * 32
