"""Real data (issue 18): any batch size at the data-parallel plans, dict / dataclass / iterable data, one line on
every rank.

Pure: ``micro_batches`` gives every rank the same number of micro-batches, a zero-weight stand-in (``rows == 0``,
row 0 of the global batch) where a rank is short of rows, weights summing to the global mean; dataclass and
HF-style dict batches slice by their batch dimension; the log recorder drops a stand-in's values.
Runtime (tests/dist/real_data_scenarios.py, one torchrun at world 4): ragged last batches (3 rows < dp=4; 6 rows
in 2 micro-batches at dp=4; 1 row) at dp zero 0/3, tp2 x dp2, a BatchNorm CNN, a tiny HF Llama on padded dict
batches with attention_mask, an IterableDataset and a @dataclass batch equal the single-process loop (losses at
every step, final weights; rtol 1e-5). A ConfigError on rank 1 mid-step stops both ranks with one line each."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch
from conftest import DIST, background_launch, run_scenarios, torchrun
from test_strategy import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL, load
import real_data_scenarios as R

from lightning_autopar.errors import ConfigError
from lightning_autopar.runtime.batches import leading_size, micro_batches, slice_batch
from lightning_autopar.runtime.logs import LogRecorder

# ------------------------------------------------------------------------------------------- pure


def test_a_rank_without_rows_gets_one_stand_in():
    x = torch.arange(3.0)
    micro = [micro_batches((x,), 2, rank, 4) for rank in range(4)]
    assert [len(m) for m in micro] == [1, 1, 1, 1]
    assert [m[0].rows for m in micro] == [1, 1, 1, 0]
    stand_in = micro[3][0]
    assert stand_in.weight == 0.0 and stand_in.batch[0].tolist() == [0.0]  # row 0 of the global batch
    assert sum(mb.weight for m in micro for mb in m) == pytest.approx(4)  # the dp average is the global mean


def test_short_slices_run_one_row_per_micro_batch_and_stand_ins():
    """6 rows, dp 4, grad_accum 2: slices 2,2,1,1; every rank runs 2 micro-batches (collectives pair up)."""
    x = torch.arange(6.0)
    micro = [micro_batches((x,), 2, rank, 4) for rank in range(4)]
    assert [[mb.rows for mb in m] for m in micro] == [[1, 1], [1, 1], [1, 0], [1, 0]]
    seen = [v for m in micro for mb in m if mb.rows for v in mb.batch[0].tolist()]
    assert seen == x.tolist()
    assert sum(mb.weight for m in micro for mb in m) == pytest.approx(4)
    assert micro_batches((x,), 3, 0, 1) and [mb.rows for mb in micro_batches((x,), 8, 0, 1)] == [1] * 6


def test_a_batch_without_a_batch_dimension_is_one_line():
    with pytest.raises(ConfigError, match="training batch: no tensor with a batch dimension"):
        micro_batches({"n": 3}, 1, 0, 2)


@dataclass
class _Batch:
    tokens: torch.Tensor
    texts: list
    scale: float = 2.0


def test_dataclass_and_dict_batches_slice_by_rows():
    batch = _Batch(torch.arange(10).reshape(5, 2), ["a", "b", "c", "d", "e"])
    assert leading_size(batch) == 5
    part = slice_batch(batch, 1, 3, 5)
    assert isinstance(part, _Batch) and part.tokens.tolist() == [[2, 3], [4, 5]] and part.texts == ["b", "c"]
    assert part.scale == 2.0
    hf = {"input_ids": torch.ones(4, 3), "attention_mask": torch.zeros(4, 3), "labels": torch.ones(4, 3)}
    mb = micro_batches(hf, 1, 1, 2)[0]
    assert {k: v.shape[0] for k, v in mb.batch.items()} == {"input_ids": 2, "attention_mask": 2, "labels": 2}


def test_a_stand_in_logs_nothing_even_nan():
    recorder = LogRecorder(0.0)
    recorder("loss", float("nan"))
    assert recorder.values["loss"][0].item() == 0.0


# ------------------------------------------------------------------------------------------- runtime, world 4




@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, list(R.CASES), script="real_data_scenarios.py")


@pytest.mark.parametrize("name", list(R.CASES))
def test_real_data_matches_single_process(world4, name):
    result = load(world4, name)
    ref_losses, ref_state = R.reference(name)
    batches = math.ceil(R.ROWS / R.CASES[name].batch_size)
    assert len(result["losses"]) == batches == len(ref_losses)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    assert set(result["state"]) == set(ref_state)
    for key, ref in ref_state.items():
        torch.testing.assert_close(result["state"][key], ref, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=key)


def test_validation_weights_a_rank_without_rows_zero(world4):
    """trainer.validate on 11 rows at batch 8 (last batch 3 < dp): the rows' mean loss, as on one device."""
    import lightning.pytorch as L

    L.seed_everything(0, verbose=False)
    module = R.gpt()
    module.load_state_dict(R.reference("dp4_zero0")[1])
    with torch.no_grad():
        val = sum(module.loss(batch).item() * len(batch[0]) for batch in R.loader(R.CASES["dp4_zero0"], R.tokens(11)))
    assert load(world4, "dp4_zero0")["val"] == pytest.approx(val / 11, rel=LOSS_RTOL)


# ------------------------------------------------------------------------------------------- one line on every rank


@pytest.fixture(scope="module")
@background_launch
def rank1_fails(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank1_fails")
    return out / "logs", torchrun(DIST / "real_data_scenarios.py", 2, str(out), "rank1_fails", timeout=300,
                                  torchrun_args=("--log-dir", str(out / "logs"), "--redirects", "3"))


def test_a_failure_on_one_rank_stops_every_rank_with_its_line(rank1_fails):
    logs, proc = rank1_fails
    assert proc.returncode != 0
    line = "training batch: rank 1's rows are bad; fix: fix rank 1's data"
    errs = {int(p.parent.name): p.read_text() for p in logs.rglob("stderr.log")}
    assert set(errs) == {0, 1}, proc.stderr[-3000:]
    expected = {1: f"autopar (rank 1): {line}", 0: f"autopar (rank 0): stopped because rank 1 failed: {line}"}
    for rank, text in errs.items():  # Lightning's own info lines (rank 0) may precede it
        assert [ln for ln in text.splitlines() if "autopar" in ln] == [expected[rank]], text
        assert "Traceback" not in text and "Connection closed" not in text, text
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert codes and set(codes) == {"2"}, proc.stderr[-3000:]


def test_last_batch_rows_known_before_iterating():
    """What Fabric checks at set-up (a last batch its dp ranks cannot split evenly fails there, not mid-epoch)."""
    from torch.utils.data import DataLoader

    from lightning_autopar.fabric import check_even_rows
    from lightning_autopar.runtime.batches import last_batch_rows

    data = R.tokens(43)
    assert last_batch_rows(DataLoader(data, batch_size=8)) == 3
    assert last_batch_rows(DataLoader(data, batch_size=8, drop_last=True)) is None
    assert last_batch_rows(DataLoader(R.tokens(40), batch_size=8)) == 8
    assert last_batch_rows(DataLoader(R.Stream(), batch_size=8)) is None
    with pytest.raises(ConfigError, match="DataLoader.drop_last: a batch of 3 rows does not split evenly over the 2"):
        check_even_rows(last_batch_rows(DataLoader(data, batch_size=8)), 2)


def test_uneven_label_tokens_are_found_and_warned_once():
    """HF-style labels whose rows count different numbers of tokens: slices weighted by rows are not one device's
    token mean, so the step warns once (runtime.step.warn_token_weighting); even rows or no split: silent."""
    import warnings

    from lightning_autopar.runtime import step
    from lightning_autopar.runtime.batches import uneven_label_tokens

    even = {"labels": torch.tensor([[1, 2, -100], [3, 4, -100]])}
    uneven = {"labels": torch.tensor([[1, 2, 3], [3, -100, -100]])}
    assert not uneven_label_tokens(even) and uneven_label_tokens(uneven)
    assert not uneven_label_tokens((torch.zeros(2, 3),))
    step._WARNED_TOKENS[0] = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.warn_token_weighting(uneven, 1, 0)  # not split: one device's mean
        step.warn_token_weighting(even, 4, 0)
        step.warn_token_weighting(uneven, 4, 0)
        step.warn_token_weighting(uneven, 4, 0)  # once
    assert len(caught) == 1 and "labels" in str(caught[0].message)
    step._WARNED_TOKENS[0] = False
