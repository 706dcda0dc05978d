"""The planner in unit form (any model as units, issue 13): pricing, plan space, pipeline partition and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lightning_autopar.cli import main
from lightning_autopar.errors import ConfigError
from lightning_autopar.planner import cost as C
from lightning_autopar.planner.search import estimate, plan
from lightning_autopar.specs import ModelSpec, load_cluster_spec, load_model_spec


def tiny_units(batchnorm: bool = False) -> dict:
    """A small CNN-like model: a light stem, two heavy middle units, a head with most of the parameters."""
    norm = ["batchnorm"] if batchnorm else ["groupnorm"]
    units = [dict(name="stem", params=1_000, flops=1e10, conv_flops=1e10, activation_bytes=4e6, output_bytes=1e6,
                  memory_bytes=8e6, ops=4, kinds=["conv"] + norm),
             dict(name="mid1", params=50_000, flops=8e10, conv_flops=8e10, activation_bytes=2e6, output_bytes=5e5,
                  memory_bytes=4e6, ops=8, kinds=["conv"] + norm),
             dict(name="mid2", params=50_000, flops=8e10, conv_flops=8e10, activation_bytes=2e6, output_bytes=5e5,
                  memory_bytes=4e6, ops=8, kinds=["conv"] + norm),
             dict(name="head", params=2_000_000, flops=4e6, conv_flops=0.0, activation_bytes=1e4, output_bytes=4e3,
                  memory_bytes=0.0, ops=1, kinds=["linear"])]
    return {"name": "tiny-cnn", "units": units}


A100x8 = "a100-80g-dgx"


def test_unit_yaml_presets_load_and_plan() -> None:
    spec = load_model_spec("resnet152")
    assert spec.unit_form and spec.layers == len(spec.units) == 53 and spec.seq_len == 1
    assert 59e6 < spec.total_params() < 61e6  # ResNet-152: 60.2M
    assert 22e9 < sum(u.flops for u in spec.units) < 24e9  # 11.5 GMACs per 224x224 image
    report = plan("resnet152", A100x8, global_batch=256, explain_choice=False)
    best = report.best
    assert best.feasible and best.plan.tp == best.plan.cp == best.plan.ep == 1 and not best.plan.sp
    assert best.plan.grad_accum == 1  # BatchNorm: the planner keeps one micro-batch per step
    # samples/s and MFU from the units: 3 x forward FLOPs per sample
    assert best.tokens_per_s == pytest.approx(256 / best.step_time_s)
    flops = 256 * 3 * sum(u.flops for u in spec.units) / best.step_time_s / 8
    assert best.model_tflops_per_device == pytest.approx(flops / 1e12)
    assert 0.05 < best.mfu < 0.6
    assert set(report.excluded) >= {"tp", "cp", "ep", "sp", "grad_accum", "recompute"}
    unet = plan("unet3d", A100x8, global_batch=16, explain_choice=False).best
    assert unet.feasible and unet.plan.tp == 1


def test_unit_time_is_the_roofline_sum() -> None:
    """One device, one unit: forward = b*(conv/(P*eta_conv) + M*e/4/BW) + ops*launch; backward twice that."""
    spec = ModelSpec(**{"units": [tiny_units()["units"][1]]})
    cluster = load_cluster_spec(A100x8, devices_per_node=1)
    hw = C.Hardware.from_cluster(cluster)
    assert hw.conv_eff == pytest.approx(C.CONV_OF_GEMM * hw.gemm_eff)  # the preset gives no conv_efficiency
    u = spec.units[0]
    fwd, bwd = C.unit_time(hw, C.UnitArrays.of(spec), np.array([4.0]), np.array([312e12]), np.array([2.0]))
    expect = 4 * (u.conv_flops / (312e12 * hw.conv_eff) + u.memory_bytes * 2 / 4 / hw.mem_bw) + u.ops * hw.overhead_s
    assert float(fwd[0, 0]) == pytest.approx(max(expect, u.ops * hw.dispatch_s))
    assert float(bwd[0, 0]) == pytest.approx(2 * float(fwd[0, 0]))


def test_time_and_memory_scale_with_mbs() -> None:
    model = tiny_units()
    one = estimate(model, A100x8, "dp=8,mbs=1,grad_accum=1,precision=bf16-mixed")
    four = estimate(model, A100x8, "dp=8,mbs=4,grad_accum=1,precision=bf16-mixed")
    assert four.breakdown.compute_s > 2.5 * one.breakdown.compute_s  # launch overheads do not scale
    act = sum(u["activation_bytes"] for u in model["units"]) * 2 / 4 * (1 + C.FRAGMENTATION)  # bf16, per sample
    f32 = 1e-6 * four.memory_gib_per_device * C.GIB  # the search assembles in float32
    assert (four.memory_gib_per_device - one.memory_gib_per_device) * C.GIB == pytest.approx(3 * act, abs=f32)


def test_zero_shards_the_states() -> None:
    model = tiny_units()
    params = sum(u["params"] for u in model["units"])
    z0 = estimate(model, A100x8, "dp=8,zero=0,mbs=1,grad_accum=1,precision=bf16-mixed")
    z3 = estimate(model, A100x8, "dp=8,zero=3,mbs=1,grad_accum=1,precision=bf16-mixed")
    z1 = estimate(model, A100x8, "dp=8,zero=1,mbs=1,grad_accum=1,precision=bf16-mixed")
    # states 16 B/param mixed: zero 1 shards the 12 optimizer bytes and, as the runtime runs it (FSDP2 as ZeRO-2),
    # the 2 gradient bytes, and keeps the parameters' shard beside the gathered ones (2/8); zero 3 shards all 16
    # (buffers differ a little: DDP's buckets against FSDP's)
    want = params * ((12 + 2) * 7 / 8 - 2 / 8)
    assert (z0.memory_gib_per_device - z1.memory_gib_per_device) * C.GIB == pytest.approx(want, rel=0.03)
    assert z3.memory_gib_per_device < z1.memory_gib_per_device < z0.memory_gib_per_device


def test_full_recompute_keeps_unit_inputs() -> None:
    model = tiny_units()
    none = estimate(model, A100x8, "dp=8,mbs=8,grad_accum=1,precision=bf16-mixed,recompute=none")
    full = estimate(model, A100x8, "dp=8,mbs=8,grad_accum=1,precision=bf16-mixed,recompute=full")
    units = model["units"]
    kept = sum(u["output_bytes"] for u in units[:-1]) + max(u["activation_bytes"] for u in units)
    saved = sum(u["activation_bytes"] for u in units)
    delta = (none.memory_gib_per_device - full.memory_gib_per_device) * C.GIB
    f32 = 1e-6 * none.memory_gib_per_device * C.GIB  # the search assembles in float32
    assert delta == pytest.approx(8 * (saved - kept) * 2 / 4 * (1 + C.FRAGMENTATION), abs=f32)
    assert full.breakdown.recompute_s > 0 and none.breakdown.recompute_s == 0


def test_pipeline_partitions_units_by_time() -> None:
    """pp=2 splits contiguous units by their time weights: the two heavy middle units land on different ranks."""
    model = tiny_units()
    p = estimate(model, A100x8, "dp=4,pp=2,mbs=2,grad_accum=4,precision=bf16-mixed")
    assert sum(p.layers_per_stage) == 4 and p.layers_per_stage == [2, 2]
    assert p.breakdown.bubble_s > 0
    heavy = tiny_units()
    heavy["units"][0].update(flops=3e11, conv_flops=3e11)  # the stem outweighs both middle units together
    assert estimate(heavy, A100x8, "dp=4,pp=2,mbs=2,grad_accum=4,precision=bf16-mixed").layers_per_stage == [1, 3]
    report = plan(load_model_spec("resnet152"), A100x8, global_batch=256, fix="pp=4", explain_choice=False)
    stages = report.best.layers_per_stage
    assert len(stages) == 4 and sum(stages) == 53


def test_unit_form_refuses_transformer_parallelism() -> None:
    for fix, field in (("tp=2", "fix.tp"), ("cp=2", "fix.cp"), ("schedule=interleaved,vpp=2,pp=2", "fix.schedule")):
        with pytest.raises(ConfigError) as err:
            plan(tiny_units(), A100x8, global_batch=64, fix=fix)
        assert err.value.field == field


def test_batchnorm_grad_accum_only_when_fixed() -> None:
    bn = tiny_units(batchnorm=True)
    assert all(c.plan.grad_accum == 1 for c in plan(bn, A100x8, global_batch=64, explain_choice=False).candidates)
    fixed = plan(bn, A100x8, global_batch=64, fix="grad_accum=2", explain_choice=False).best
    assert fixed.plan.grad_accum == 2
    # SyncBatchNorm over dp costs its collectives per BatchNorm unit; a GroupNorm twin pays none
    gn = estimate(tiny_units(), A100x8, "dp=8,mbs=1,grad_accum=8,precision=bf16-mixed")
    sync = estimate(bn, A100x8, "dp=8,mbs=1,grad_accum=8,precision=bf16-mixed")
    assert sync.step_time_s > gn.step_time_s


def test_transformer_spec_unchanged_by_unit_path() -> None:
    """bert-large is a transformer preset: it plans through the block path (TP offered)."""
    spec = load_model_spec("bert-large")
    assert not spec.unit_form and spec.tied_embeddings and spec.layers == 24
    assert 330e6 < spec.total_params() < 340e6
    report = plan(spec, A100x8, global_batch=64, fix="tp=2",
                  explain_choice=False)
    assert report.best.plan.tp == 2


# ------------------------------------------------------------------------------------------------- CLI

UNIT_CLI = ["plan", "--model", "resnet152", "--cluster", A100x8, "--global-batch", "256"]


def test_cli_unit_form_json_table_png(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    assert main(UNIT_CLI + ["--json", "--top", "2", "--report", str(png), "--no-explain"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["tp"] == 1 and len(data["candidates"]) == 2
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(UNIT_CLI + ["--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and "53 units" in out and "winner" in out


def test_cli_explain_model_prints_units(capsys: pytest.CaptureFixture) -> None:
    assert main(UNIT_CLI + ["--explain-model", "--top", "1", "--no-explain"]) == 0
    out = capsys.readouterr().out
    assert "resnet.encoder.stages.2.layers.35" in out and "classifier" in out and "batchnorm" in out
    assert out.index("resnet.encoder.stages.2.layers.35") < out.index("autopar plan")  # the units come before the plan table
    assert main(UNIT_CLI + ["--explain-model", "--json", "--no-explain"]) == 0
    cap = capsys.readouterr()
    json.loads(cap.out)  # stdout stays one JSON object; the units table went to stderr
    assert "resnet.encoder.stages.0.layers.0" in cap.err


def test_cli_seq_len_with_units_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(UNIT_CLI + ["--seq-len", "224"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seq-len" in err[0] and "units" in err[0]


@pytest.mark.parametrize("bad,field", [({"flops": -1.0}, "model.units[1].flops"),
                                       ({"kinds": ["transformer"]}, "model.units[1].kinds"),
                                       ({"conv_flops": 1e12}, "model.units[1].conv_flops")])
def test_cli_bad_unit_field_exits_2(capsys: pytest.CaptureFixture, tmp_path: Path, bad: dict, field: str) -> None:
    import yaml

    model = tiny_units()
    model["units"][1].update(bad)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(model))
    assert main(["plan", "--model", str(path), "--cluster", A100x8, "--global-batch", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and "Traceback" not in err[0]
