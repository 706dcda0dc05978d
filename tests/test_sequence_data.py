"""SP and CP on real data (issue 18): batches whose sequence length changes (64/32) at tp2+sp x dp2 and cp2 x dp2,
lengths the split does not divide (30 at tp4+sp and at cp2, 31 at tp2+sp x pp2 whose stages send the padded
sequence split: padded at the split, the padding dropped where the sequence is gathered back, causal attention
only), and Hugging Face Llama on right-padded batches with an
``attention_mask`` at cp2 x dp2 and tp2+sp x dp2 -- each equal to the single-process loop over the same batches
(losses every step, final weights). A bidirectional encoder with an indivisible length is refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import run_scenarios
from test_strategy import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL, load

import sequence_data_scenarios as S

pytest.importorskip("transformers")

NAMES = list(S.PLANS)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, NAMES, script="sequence_data_scenarios.py")


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain single-process loop over the scenario's batches: (losses, state dict)."""
    from common import single_device_run

    model, _, lengths = S.PLANS[name]
    return single_device_run(S.make(model), S.batches(model, lengths))


def assert_matches(result: dict, name: str) -> None:
    ref_losses, ref_state = reference(name)
    assert len(result["losses"]) == S.STEPS
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    assert set(result["state"]) == set(ref_state)
    for key, ref in ref_state.items():
        torch.testing.assert_close(result["state"][key], ref, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=key)


@pytest.mark.parametrize("name", [n for n in NAMES if not n.endswith("_refused")])
def test_matches_single_process(world4, name):
    result = load(world4, name)
    plan = result["plan"]
    wanted = dict(field.split("=") for field in S.PLANS[name][1].split(","))
    assert {k: str(plan[k]).lower() for k in wanted} == wanted
    assert_matches(result, name)


@pytest.mark.parametrize("name, field, fix", [("encoder_30_sp_refused", "plan.sp", "multiple of 4"),
                                              ("encoder_30_cp_refused", "plan.cp", "multiple of 4")])
def test_non_causal_indivisible_length_is_refused(world4, name, field, fix):
    error = load(world4, name)["error"]
    assert error is not None and "\n" not in error, error
    assert error.startswith(f"{field}: ") and "sequence length 30" in error and fix in error, error
