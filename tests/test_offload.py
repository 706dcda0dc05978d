"""Offload (issue 17): plan.offload=params (FSDP2's CPUOffloadPolicy) and plan.offload=optimizer (the optimizer
stepping host mirrors, parallel/offload.py) train as the single-process loop (losses every step, final weights;
tests/dist/offload_scenarios.py at world 4), sharded checkpoints resume across offload on/off, and what cannot be
offloaded is refused in one line. One process: the host step's bookkeeping (states keyed by the model's
parameters, a change of the device parameter outside the step picked up, LBFGS refused)."""

from __future__ import annotations

import pytest
import torch
from common import STEPS, reference_run
from conftest import run_scenarios
from test_strategy import assert_equivalent, load
import offload_scenarios as O

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.offload import HostStep, check_offload, module_to_device, offload_optimizers

# ------------------------------------------------------------------------------------------- one process


def _sgd_pair() -> tuple[torch.nn.Linear, torch.nn.Linear, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 3)
    hosted = torch.nn.Linear(4, 3)
    hosted.load_state_dict(plain.state_dict())
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=0.1)  # noqa: E731
    a, b = make(plain), make(hosted)
    offload_optimizers([b], torch.device("cpu"), "optimizer")
    return plain, hosted, a, b


def _train(model: torch.nn.Linear, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.arange(8.0).reshape(2, 4) + i

        def closure():
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)


def test_host_step_equals_the_device_step_and_keeps_the_model_keys():
    plain, hosted, a, b = _sgd_pair()
    _train(plain, a, 3)
    _train(hosted, b, 3)
    for p, q in zip(plain.parameters(), hosted.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    # outside the step the optimizer holds the model's parameters, its states keyed by them (checkpoints)
    assert [id(p) for p in b.param_groups[0]["params"]] == [id(p) for p in hosted.parameters()]
    assert set(map(id, b.state)) == set(map(id, hosted.parameters()))
    assert isinstance(b.step.__self__, HostStep) and len(b.step.__self__.mirrors) == 2
    offload_optimizers([b], torch.device("cpu"), "optimizer")  # once only
    assert not isinstance(b.step.__self__._step.__self__, HostStep)
    for p, q in zip(a.state_dict()["state"].values(), b.state_dict()["state"].values()):
        torch.testing.assert_close(q["exp_avg"], p["exp_avg"], rtol=0, atol=0)


def test_a_parameter_changed_outside_the_step_is_copied_in_again():
    """A checkpoint load (or the user's own edit) between steps: the host mirror follows the device value."""
    plain, hosted, a, b = _sgd_pair()
    _train(plain, a, 1)
    _train(hosted, b, 1)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), hosted.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    _train(plain, a, 2)
    _train(hosted, b, 2)
    for p, q in zip(plain.parameters(), hosted.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_lbfgs_is_refused_in_one_line():
    opt = torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(ConfigError, match=r"^plan\.offload: .*LBFGS.*use offload=none") as err:
        offload_optimizers([opt], torch.device("cpu"), "optimizer")
    assert "\n" not in str(err.value)


def test_params_offload_with_fp16_on_an_accelerator_is_refused():
    with pytest.raises(ConfigError, match=r"^plan\.offload: .*fp16-mixed.*use bf16-mixed") as err:
        check_offload("params", "fp16-mixed", "cuda")
    assert "\n" not in str(err.value)
    check_offload("params", "fp16-mixed", "cpu")  # the host is the device: the scaler sees the gradients
    check_offload("optimizer", "fp16-mixed", "cuda")  # the gradients stay on the device for the scaler


def test_module_to_device_on_cpu_moves_everything():
    model = torch.nn.BatchNorm1d(3)
    module_to_device(model, torch.device("cpu"), "params")
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


# ------------------------------------------------------------------------------------------- runtime, world 4

NAMES = [*O.PLANS, *O.RESUMES, *O.REFUSALS]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, NAMES, script="offload_scenarios.py")


def _reference(fix: str, clip: float | None = None):
    fields = dict(part.split("=") for part in fix.split(","))
    accum = int(fields.get("grad_accum", 1))
    dp = int(fields["dp"])
    return reference_run(clip=clip, micro_batches=accum, dp=dp)


@pytest.mark.parametrize("name", list(O.PLANS))
def test_offload_matches_single_process(world4, name):
    fix, trainer_kwargs = O.PLANS[name]
    result = load(world4, name)
    offload = dict(part.split("=") for part in fix.split(","))["offload"]
    assert result["plan"]["offload"] == offload
    hosted = result["hosted"]
    if offload == "params":
        assert hosted["units"] > 0 and hosted["units_offloading"] == hosted["units"]
        assert hosted["host_steps"] == [None]
    else:
        assert hosted["units_offloading"] == 0 and hosted["host_steps"][0] > 0
    assert_equivalent(result, *_reference(fix, trainer_kwargs.get("gradient_clip_val")))


@pytest.mark.parametrize("name", list(O.RESUMES))
def test_checkpoint_resumes_across_offload(world4, name):
    """Saved at step 4 (DCP, sharded) with one offload mode, resumed with the other from another initialisation:
    steps 5-8 are the single-process loop's."""
    result = load(world4, name)
    assert result["plan"]["offload"] == O.RESUMES[name][1].rsplit("=", 1)[1]
    assert_equivalent(result, *reference_run(), first_step=STEPS // 2)


def test_offload_with_zero0_is_refused(world4):
    error = load(world4, "refuse_zero0")["error"]
    assert error is not None and "\n" not in error
    assert error.split(":")[0].endswith(".offload") and "zero >= 1" in error
