"""Pipeline parallelism on real data (issue 18, the pipeline part): any batch through the stages.

One torchrun launch of world 4 (pp=2 x dp=2) runs every scenario of tests/dist/pipeline_data_scenarios.py: our GPT
under 1F1B, GPipe, interleaved 1F1B and ZBV, a Hugging Face Llama trained on dict batches (input_ids,
attention_mask, labels; right-padded rows) with its own loss, and a traced (unit-form) 3D U-Net, on batches of 8,
8, 7, 3 and 1 rows whose sequence length alternates 32 / 16: shapes change between batches (stages cached per
shapes), micro-batches of one step differ in rows (runs of equal shapes), dp ranks hold different numbers of rows,
or none (stand-ins). Each must equal the single-process loop: the loss of every step and the final weights (the
GPT also its validation loss on a batch of yet another shape, forward-only through the stages). The traced
pipeline refuses an input of a size its trace fixed with one line on every rank, before any enters the schedule.
Single-process tests cover how a step is cut into runs and the set-up refusal of a trace that fixed the batch size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import run_scenarios
from pipeline_data_scenarios import REFUSED, ROWS_SEQS, SCENARIOS, reference, reference_validation

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.pipeline import check_traced_pipeline
from lightning_autopar.runtime.pipeline_step import Run, plan_runs, shape_signature

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def data_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    return run_scenarios(tmp_path_factory, 4, [*SCENARIOS, *REFUSED], script="pipeline_data_scenarios.py")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pipeline_on_real_data_equals_single_process(name, data_runs):
    result = torch.load(data_runs / f"{name}.pt", weights_only=False)
    assert "crash" not in result, result.get("crash")
    assert result["plan"]["pp"] == 2 and result["plan"]["dp"] == 2
    losses, state = reference(name)
    assert len(result["losses"]) == len(ROWS_SEQS)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=RTOL, atol=ATOL)
    assert set(result["state"]) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=RTOL, atol=ATOL, msg=key)
    if result["val_loss"] is not None:
        assert result["val_loss"] == pytest.approx(reference_validation(name), rel=RTOL)


def test_traced_pipeline_refuses_a_resized_input_on_every_rank(data_runs):
    result = torch.load(data_runs / "unet_resized_refused.pt", weights_only=False)
    assert result["steps"] == 1  # the first batch trained; the second (other volume size) stopped every rank
    first = result["errors"][0]
    assert first is not None and first.startswith("DataLoader: UNet3d: input 'x' has shape (2, 1, 4, 4, 4)")
    assert "fix: " in first and "\n" not in first
    assert result["errors"] == [first] * 4


def test_a_step_is_cut_where_any_rank_changes_shape():
    a, b = shape_signature(((torch.zeros(2, 16),), {})), shape_signature(((torch.zeros(1, 16),), {}))
    assert a != b and a == shape_signature(((torch.ones(2, 16),), {"mask": None}))
    # rank 0: rows 2, 2; rank 1: rows 2, 1 -> two runs of one micro-batch, each keyed by both ranks' shapes
    assert plan_runs([[a, a], [a, b]]) == [Run(0, 1, (a, a)), Run(1, 2, (a, b))]
    assert plan_runs([[a, a, b], [a, a, b]]) == [Run(0, 2, (a, a)), Run(2, 3, (b, b))]
    with pytest.raises(RuntimeError):  # batches.micro_batches gives every rank the same count
        plan_runs([[a, a], [a]])


class BatchBound(nn.Module):
    """Reshapes to the batch size it was written for: export fixes the batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).reshape(2, 4))


def test_a_trace_that_fixes_the_batch_size_is_refused_at_set_up():
    # the planner's check (pp restricted to 1 with this reason): a ragged batch would otherwise stop mid-epoch
    with pytest.raises(ConfigError) as err:
        check_traced_pipeline(BatchBound(), ((torch.randn(2, 4),), {}), ["a", "b"], 2)
    message = str(err.value)
    assert err.value.field == "plan.pp" and "fixed the batch dimension of input 'x'" in message
    assert "\n" not in message
    check_traced_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), ((torch.randn(2, 4),), {}), ["0", "1"], 2)
