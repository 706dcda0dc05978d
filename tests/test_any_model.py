"""Any model trains under ``strategy="autopar"`` with single-device results (issue 13): Hugging Face ResNet
(bottleneck, BatchNorm), a plain CNN (BatchNorm) and a plain 3D U-Net (Conv3d, GroupNorm, skip connections),
written as a user would, in a plain LightningModule (tests/dist/any_model_models.py).

One torchrun launch of world 4 runs every cell (tests/dist/any_model_scenarios.py): each model at the planner's
own plan, zero=3, zero=0 with grad_accum=2 fixed by the user (BatchNorm: one warning; the reference runs the same
micro-batches), recompute=full (a checkpointed unit re-runs BatchNorm in backward without updating its running
statistics twice); the CNN also at zero=1, hybrid sharding (dp_shard=2) and in a plain Fabric loop, and refused
tp=2 in one line; ResNet at recompute=selective; the synchronised BatchNorm alone with uneven rows per rank and
momentum=None. Losses per step, parameters AND buffers (BatchNorm running_mean / running_var /
num_batches_tracked) must equal the plain single-process loop (rtol 1e-5, fp32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

DIST = Path(__file__).resolve().parent / "dist"
sys.path.insert(0, str(DIST))

pytest.importorskip("transformers")

from any_model_models import MODELS, PlainCNN, UNet3d, reference_run  # noqa: E402
from any_model_scenarios import cells, fix_of  # noqa: E402
from conftest import run_scenarios  # noqa: E402
from test_strategy import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL  # noqa: E402

from lightning_autopar.errors import ConfigError  # noqa: E402

WORLD = 4
REFUSED = {"cnn__tp2", "cnn__pp2"}
NOT_A_FIT = REFUSED | {"batchnorm__uneven"}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return run_scenarios(tmp_path_factory, WORLD, cells(), script="any_model_scenarios.py")


def _result(out: Path, cell: str) -> dict:
    path = out / f"{cell}.pt"
    assert path.exists(), f"{cell}: no result"
    result = torch.load(path, weights_only=False)
    assert "crash" not in result, f"{cell} crashed:\n{result['crash']}"
    return result


_REFERENCES: dict[tuple[str, int, int], tuple[list[float], dict]] = {}


def _reference(model: str, plan: dict) -> tuple[list[float], dict]:
    """One device; with accumulation, the same micro-batches (the m-th slice of every dp slice) as the plan."""
    key = (model, plan["dp"], plan["grad_accum"]) if plan["grad_accum"] > 1 else (model, 1, 1)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(model, dp=key[1], micro_batches=key[2])
    return _REFERENCES[key]


@pytest.mark.parametrize("cell", [c for c in cells() if c not in NOT_A_FIT])
def test_equal_to_one_device(outputs, cell):
    result = _result(outputs, cell)
    assert "error" not in result, f"{cell} refused: {result['error']}"
    plan = result["plan"]
    for item in (fix_of(cell) or "").split(","):
        if item:
            key, value = item.split("=")
            assert str(plan[key]) == value, f"{cell}: plan {plan} ignores {item}"
    assert (plan["tp"], plan["ep"], plan["cp"]) == (1, 1, 1)
    ref_losses, ref_state = _reference(cell.split("__")[0], plan)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    state = result["state"]
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():  # parameters and buffers, BatchNorm running statistics included
        torch.testing.assert_close(state[name], ref, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    assert any(name.endswith("num_batches_tracked") for name in state) == MODELS[cell.split("__")[0]].batchnorm


@pytest.mark.parametrize("model", list(MODELS))
def test_own_plan_shows_its_limits(outputs, model):
    """The planner's own plan: data parallelism only, with the reason for every field kept at 1 in the report;
    BatchNorm models keep one micro-batch per step (their statistics are per micro-batch)."""
    result = _result(outputs, f"{model}__auto")
    assert {"tp", "ep", "cp"} <= set(result["excluded"]), result["excluded"]
    # pp: stages traced from the model's call, except where BatchNorm would see micro-batches apart
    assert ("pp" in result["excluded"]) == MODELS[model].batchnorm, result["excluded"]
    if MODELS[model].batchnorm:
        assert result["plan"]["grad_accum"] == 1
        assert "BatchNorm" in result["excluded"]["grad_accum"]
    assert not result["warnings"], result["warnings"]


@pytest.mark.parametrize("model", list(MODELS))
def test_fixed_accumulation_warns_once_for_batchnorm(outputs, model):
    warned = [w for w in _result(outputs, f"{model}__accum")["warnings"] if "BatchNorm" in w]
    assert len(warned) == (1 if MODELS[model].batchnorm else 0), warned


def test_synced_batchnorm_count_weighted(outputs):
    """Ranks with 2, 2, 2 and 1 rows, momentum 0.1 and None (cumulative average): outputs, parameters and running
    buffers equal one device running all 7 rows; and a residual block's two BatchNorms summed on a 1x1 map, one row
    per rank, two micro-batches accumulated, equal to one device (each bias keeps a gradient of its own)."""
    diffs = _result(outputs, "batchnorm__uneven")["diffs"]
    assert set(diffs) == {"momentum=0.1", "momentum=None", "residual 1x1"}
    assert all(d < 1e-5 for d in diffs.values()), diffs


def test_forced_splits_refused_in_one_line(outputs):
    """Through the strategy: tp=2 (nothing to split) and pp=2 (BatchNorm) on the CNN, one line each."""
    error = _result(outputs, "cnn__tp2")["error"]
    assert "\n" not in error and error.startswith("fix.tp: PlainCNN is in unit form") and "fix: use tp=1" in error
    error = _result(outputs, "cnn__pp2")["error"]
    assert "\n" not in error and error.startswith("plan.pp: PlainCNN: BatchNorm") and "fix: use pp=1" in error


# ------------------------------------------------------------------------------------------- no launch


def _unit_analysis(model: torch.nn.Module, example: torch.Tensor):
    from lightning_autopar.profile.units import analyze_model

    return analyze_model(model, ((example,), {}), runner=None)


@pytest.mark.parametrize("field,value", [("tp", 2), ("ep", 2), ("cp", 2)])
def test_unit_form_refuses_what_it_cannot_split(field, value):
    """A forced tp / ep / cp on a model in unit form: one line naming the field, the model and the fix."""
    from lightning_autopar.planner.space import check_unit_fix

    analysis = _unit_analysis(PlainCNN(), torch.randn(1, 3, 8, 8))
    assert analysis.spec.unit_form
    with pytest.raises(ConfigError) as info:
        check_unit_fix(analysis.spec, {field: value, "dp": 2})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"fix.{field}: PlainCNN is in unit form") and f"{field}={value}" in message
    assert message.endswith(f"fix: use {field}=1")
    check_unit_fix(analysis.spec, {"dp": 4, "zero": 3})  # data parallelism is always applicable


def test_pipeline_refusals_name_the_part():
    """pp on a model in unit form: refused in one line for BatchNorm (per-micro-batch statistics) and for a
    parameter outside the called model; a GroupNorm U-Net passes the check (its stages trace)."""
    from lightning_autopar.parallel.apply import check_unit_pipeline

    cnn, image = PlainCNN(), torch.randn(2, 3, 8, 8)
    with pytest.raises(ConfigError, match=r"^plan\.pp: PlainCNN: BatchNorm \('.*'\) in a pipeline stage"):
        check_unit_pipeline(cnn, cnn, _unit_analysis(cnn, image), ((image,), {}), 2)
    unet, volume = UNet3d(), torch.randn(2, 1, 4, 4, 4)
    analysis = _unit_analysis(unet, volume)
    check_unit_pipeline(unet, unet, analysis, ((volume,), {}), 2)
    holder = torch.nn.Module()
    holder.model, holder.extra = unet, torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"^plan\.pp: Module\.extra\.weight is outside the model"):
        check_unit_pipeline(holder, unet, analysis, ((volume,), {}), 2)


def test_units_become_data_parallel_units():
    """FSDP units of a model in unit form are the analysis' units, traced from the user's own call (no token
    ids): every unit of the U-Net owns its parameters."""
    import lightning.pytorch as L

    from lightning_autopar.parallel.units import choose_units

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = UNet3d()

    root = Lit()
    example = ((torch.randn(1, 1, 8, 8, 8),), {})
    analysis = _unit_analysis(root.model, example[0][0])
    fqns = [b.fqn for b in analysis.blocks]
    units = choose_units(root, root.model, fqns, 1, example=example)
    assert list(units.blocks) == [f"model.{f}" for f in fqns]
    covered = {id(p) for m in units.modules(root) for p in m.parameters()}
    assert covered == {id(p) for p in root.parameters()}
