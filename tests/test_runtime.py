"""The step runtime (``lightning_autopar.runtime``): batch splitting and the log recorder (no process group),
trial runs on a live world-2 group (torchrun): times per step, nothing left behind; and a peer that stops
(SIGSTOP) under ``torchrun --max-restarts 1``: the live rank names it in one line, the job resumes."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import DIST, background_launch, check_launch, torchrun

from lightning_autopar.runtime.batches import leading_size, micro_batches, slice_batch, split_rows
from lightning_autopar.runtime.logs import LogRecorder, recording_logs


@pytest.mark.parametrize("total, parts", [(8, 2), (10, 3), (3, 4), (1, 1)])
def test_split_rows_covers_contiguously(total, parts):
    spans = [split_rows(total, parts, i) for i in range(parts)]
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sizes = [stop - start for start, stop in spans]
    assert max(sizes) - min(sizes) <= 1


def test_slice_batch_cuts_batch_leaves_only():
    batch = {"x": torch.arange(12).reshape(6, 2), "y": (torch.arange(6),), "scale": torch.tensor(2.0), "n": 3}
    part = slice_batch(batch, 2, 4, 6)
    assert part["x"].tolist() == [[4, 5], [6, 7]] and part["y"][0].tolist() == [2, 3]
    assert part["scale"] is batch["scale"] and part["n"] == 3
    assert leading_size(batch) == 6 and leading_size({"n": 3}) is None


def test_micro_batches_weights_give_the_global_mean():
    """Each rank takes its contiguous slice in micro-batches; every rank's weights sum to 1 (the dp group averages)."""
    x = torch.arange(12.0)
    dp = 2
    seen, weights = [], []
    for rank in range(dp):
        micro = micro_batches((x,), 3, rank, dp)
        assert len(micro) == 3
        seen += [v for mb in micro for v in mb.batch[0].tolist()]
        weights += [mb.weight for mb in micro]
        assert sum(mb.rows for mb in micro) == 6
    assert seen == x.tolist()
    assert sum(weights) == pytest.approx(dp)  # each rank's weights sum to 1 (the dp group averages them)


def test_micro_batches_stand_in_for_a_rank_without_rows():
    from lightning_autopar.errors import ConfigError

    # one row, two data-parallel ranks: rank 1 runs a zero-weight stand-in (row 0) so it enters every collective
    (stand_in,) = micro_batches((torch.arange(1.0),), 1, 1, 2)
    assert stand_in.rows == 0 and stand_in.weight == 0.0 and torch.equal(stand_in.batch[0], torch.zeros(1))
    with pytest.raises(ConfigError):  # no tensor with a batch dimension: refused the same on every rank
        micro_batches({"n": 3}, 1, 0, 1)


class _Logged:
    def __init__(self):
        self.calls = []

    def log(self, name, value, **kwargs):
        self.calls.append((name, value, kwargs))


def test_log_recorder_weights_reduces_and_logs_once():
    module = _Logged()
    recorder = LogRecorder()
    with recording_logs(module, recorder):
        for weight, loss in [(0.25, 4.0), (0.75, 8.0)]:
            recorder.weight = weight
            module.log("loss", torch.tensor(loss), True)  # positional prog_bar
            module.log("tag", "text")
    assert "log" not in module.__dict__  # the method is back
    recorder.flush(module, lambda t: t * 2, batch_size=16)  # "reduce": two ranks with the same values
    calls = {name: (value, kwargs) for name, value, kwargs in module.calls}
    assert float(calls["loss"][0]) == pytest.approx(2 * (0.25 * 4 + 0.75 * 8))
    assert calls["loss"][1] == {"prog_bar": True, "sync_dist": False, "batch_size": 16}
    assert calls["tag"] == ("text", {})
    assert recorder.values == {}


@pytest.fixture(scope="module")
@background_launch
def trial_world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("runtime_w2")
    proc = torchrun(DIST / "runtime_scenarios.py", 2, str(out))
    check_launch(proc, "torchrun runtime_scenarios.py")
    return [torch.load(out / f"trial_r{rank}.pt", weights_only=False) for rank in range(2)]


def test_trial_measures_and_leaves_no_state(trial_world2):
    for result in trial_world2:
        assert "crash" not in result, result.get("crash")
        for name in ("dp2_zero0", "dp2_zero3"):
            times = result["times"][name]
            assert len(times) == 2 and all(t > 0 for t in times), (name, times)
        assert result["params_unchanged"] and result["same_parameter_objects"] and result["plain_tensors"]
        assert result["rng_unchanged"]
        assert result["world_sum"] == 2.0


@pytest.fixture(scope="module")
@background_launch
def stopped_peer(tmp_path_factory):
    """The stopped-peer launch (its wait for the timeout runs beside the other tests)."""
    out = tmp_path_factory.mktemp("stopped_peer")
    proc = torchrun(DIST / "runtime_scenarios.py", 2, str(out), "stopped", torchrun_args=("--max-restarts=1",))
    return out, proc


def test_stopped_peer_is_named_and_the_restart_resumes(stopped_peer):
    """Rank 1 SIGSTOPs itself after step 3 (strategy timeout 20 s): rank 0's all_reduce times out, it prints one
    line naming rank 1 and exits 1 (no traceback); torchrun restarts the job from the step-2 checkpoint."""
    tmp_path, proc = stopped_peer
    check_launch(proc, "torchrun runtime_scenarios.py stopped")
    text = proc.stdout + proc.stderr
    lines = [line for line in text.splitlines() if "stopped answering" in line]
    # its last beat: step 3, or step 2 when the beat after step 3 began had no time to run before the stop
    assert len(lines) == 1 and lines[0].startswith("autopar (rank 0): rank 1 stopped answering (last seen in "
                                                   "training step "), text[-4000:]
    # the collective that times out: the preemption flag's reduce at step 3's end, or step 4's gradient reduce
    assert re.search(r"timed out in training step [34] ", lines[0]) and "Traceback" not in text, lines[0]
    result = torch.load(tmp_path / "stopped.pt", weights_only=False)
    assert result["restarts"] == 1 and result["resumed_from"].endswith("step=00000002")
    assert len(result["losses"]) == 4  # steps 3..6 after the resume
