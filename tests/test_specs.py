"""Specs and `fix` parsing: contract field names, validation, one clear error per bad input."""

from __future__ import annotations

import pytest

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import ClusterSpec, ModelSpec, Plan, PricedPlan, parse_fix


def test_parse_fix_string_and_dict():
    assert parse_fix("tp=2, pp=2,schedule=interleaved,vpp=2,sp=true") == {
        "tp": 2, "pp": 2, "schedule": "interleaved", "vpp": 2, "sp": True}
    assert parse_fix({"dp": "4", "zero": 3, "precision": "bf16"}) == {"dp": 4, "zero": 3, "precision": "bf16-mixed"}
    assert parse_fix(None) == {} and parse_fix("") == {}
    assert parse_fix("dp_shard=none") == {"dp_shard": None}


@pytest.mark.parametrize("fix, field", [
    ("tq=2", "fix.tq"), ("tp=x", "fix.tp"), ("tp=0", "fix.tp"), ("zero=4", "fix.zero"),
    ("schedule=zigzag", "fix.schedule"), ("sp=maybe", "fix.sp"), ("tp", "fix"), ({"tp": True}, "fix.tp"),
    (42, "fix"),
])
def test_parse_fix_errors_name_the_field(fix, field):
    with pytest.raises(ConfigError) as err:
        parse_fix(fix)
    assert str(err.value).startswith(field + ":")
    assert "\n" not in str(err.value)


def test_plan_identities():
    plan = Plan(dp=2, tp=2, pp=2, mbs=2, grad_accum=4)
    assert plan.world_size == 8 and plan.global_batch == 16
    plan.validate(world_size=8, global_batch=16)
    with pytest.raises(ConfigError, match="plan: dp\\*tp\\*pp\\*cp"):
        plan.validate(world_size=4)
    with pytest.raises(ConfigError, match="plan.grad_accum"):
        plan.validate(global_batch=8)
    with pytest.raises(ConfigError, match="plan.sp"):
        Plan(sp=True).validate()
    with pytest.raises(ConfigError, match="plan.dp_shard"):
        Plan(dp=4, zero=3, dp_shard=3).validate()
    assert Plan(dp=4, zero=3, dp_shard=2).shard_size == 2 and Plan(dp=4).shard_size == 1


def test_priced_plan_json_has_contract_fields():
    out = PricedPlan(plan=Plan(dp=2)).to_dict()
    for key in ("dp", "zero", "dp_shard", "tp", "sp", "pp", "schedule", "vpp", "ep", "cp", "mbs", "grad_accum",
                "recompute", "precision", "step_time_s", "tokens_per_s", "model_tflops_per_device", "mfu",
                "memory_gib_per_device", "breakdown"):
        assert key in out
    assert set(out["breakdown"]) == {"compute_s", "recompute_s", "comm_exposed_s", "bubble_s"}


def test_model_spec_defaults_and_errors():
    spec = ModelSpec(layers=2, hidden=64, heads=4)
    assert spec.kv_heads == 4 and spec.ffn_hidden == 256
    with pytest.raises(ConfigError, match="model.hidden"):
        ModelSpec(hidden=65, heads=4)
    with pytest.raises(ConfigError, match="model.kv_heads"):
        ModelSpec(heads=4, kv_heads=3, hidden=64)
    with pytest.raises(ConfigError, match="cluster.nodes"):
        ClusterSpec(nodes=0)


def test_every_preset_reads_the_same_with_the_c_loader_as_with_omegaconf(tmp_path):
    """specs._read_yaml parses with PyYAML's C loader: every preset (and a file with YAML 1.2 floats, a duplicate
    key) reads as OmegaConf.load reads it."""
    from omegaconf import OmegaConf

    from lightning_autopar.specs import _UNTYPED, _read_yaml, _typed, configs_dir

    presets = sorted(configs_dir().glob("*/*.yaml"))
    assert len(presets) > 20
    for path in presets:
        ref = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        ref.pop("defaults", None)
        data = _read_yaml(path, "x")
        assert data == ref, path
        # built directly (specs._typed) as OmegaConf's structured merge builds it
        cls = {"model": ModelSpec, "cluster": ClusterSpec}.get(path.parent.name)
        if cls is not None:
            direct = _typed(cls, data)
            assert direct is not _UNTYPED, path
            assert direct == OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.create(data)))
    # what a preset never holds goes through OmegaConf: conversions, unknown keys, interpolations
    assert _typed(ModelSpec, {"layers": "12"}) is _UNTYPED and _typed(ModelSpec, {"nope": 1}) is _UNTYPED
    assert _typed(ModelSpec, {"name": "${x}"}) is _UNTYPED and _typed(ModelSpec, {"layers": True}) is _UNTYPED
    assert _typed(ModelSpec, {"kv_heads": None, "layers": 2}) == ModelSpec(layers=2)
    floats = tmp_path / "f.yaml"
    floats.write_text("a: 1e-3\nb: 2.5E+4\nc: 7\nd: 2026-12-01\ne: .inf\n")
    assert _read_yaml(floats, "x") == OmegaConf.to_container(OmegaConf.load(floats))
    dup = tmp_path / "dup.yaml"
    dup.write_text("a: 1\na: 2\n")
    with pytest.raises(ConfigError, match="cannot read .*dup.yaml"):
        _read_yaml(dup, "model")
