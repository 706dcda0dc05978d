"""Hugging Face Trainer (issue 31): ``lightning_autopar.hf_trainer.AutoparTrainer`` runs the Trainer's own loop on
autopar's plan. At 4 CPU processes (the world-4 batch) it trains a tiny HF Llama as the single-process loop does
(rtol 1e-5) at the planner's plan (2 micro-batches per step, clipped), at zero=3 (the user's own optimizer) and at
tp=2 x dp=2 with zero=3 (clipped), and ``trainer.evaluate()`` over the plan's dp ranks gives the single-process
loss; the Trainer options that would hand a part of the plan to the Trainer are refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import run_scenarios

pytest.importorskip("transformers", reason="extra 'hf' not installed")
pytest.importorskip("accelerate", reason="extra 'accelerate' not installed")

import hf_trainer_scenarios as S  # noqa: E402

RTOL = 1e-5  # test_strategy.LOSS_RTOL / PARAM_RTOL
ATOL = 1e-6  # test_strategy.PARAM_ATOL


def llama_reference(rows: int, clip: float) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The single-process loop: the same Llama and rows in order, ``rows`` per step (the loss the model computes
    from its labels), gradients clipped to ``clip`` (0: not clipped), one SGD step at 0.1. Returns the step losses,
    the final state and the final model's loss over every row."""
    model = S.make_llama()
    tokens = S.TokenRows().tokens
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(S.HF_STEPS):
        start = step * rows % len(tokens)
        x = tokens[start:start + rows]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        evaluated = model(input_ids=tokens, labels=tokens).loss.item()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, evaluated


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, list(S.SCENARIOS), script="hf_trainer_scenarios.py")


@pytest.mark.parametrize("name", list(S.SCENARIOS))
def test_hf_trainer_matches_single_process(world4, name):
    result = torch.load(world4 / f"{name}.pt", weights_only=False)
    assert "crash" not in result, result.get("crash")
    plan = result["plan"]
    assert plan["pp"] == 1 and plan["grad_accum"] == 1 and plan["mbs"] == S.PER_DEVICE
    assert result["trainer_rows"] == result["rows"]  # the Trainer's total batch: per-device x accumulation x dp
    if name == "hft_zero3":
        assert (plan["dp"], plan["zero"]) == (4, 3)
    if name == "hft_tp2_zero3":
        assert (plan["tp"], plan["dp"], plan["zero"]) == (2, 2, 3)
    fix, accumulate, clip = S.SCENARIOS[name]
    losses, state, evaluated = llama_reference(result["rows"], clip)
    assert result["eval_loss"] == pytest.approx(evaluated, rel=RTOL)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=RTOL, atol=0)
    assert set(result["state"]) == set(state)
    for key, ref in state.items():
        torch.testing.assert_close(result["state"][key], ref, rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.parametrize("field, value, named", [("save_strategy", "steps", "save_strategy"),
                                                 ("torch_compile", True, "torch_compile"),
                                                 ("activation_checkpointing", True, "activation_checkpointing")])
def test_trainer_options_the_plan_replaces_are_refused(tmp_path, field, value, named):
    from transformers import TrainingArguments

    from lightning_autopar.errors import ConfigError
    from lightning_autopar.hf_trainer import check_arguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                             **{"save_strategy": "no", field: value})
    with pytest.raises(ConfigError) as err:
        check_arguments(args)
    assert err.value.field == f"TrainingArguments.{named}" and "\n" not in str(err.value)
