"""The training-time callbacks under torchrun (tests/dist/callback_scenarios.py), against an uninterrupted run
and the single-process reference loop:

* a real SIGKILL of one rank under plain ``torchrun --max-restarts`` (no environment variable; the workers share
  the agent's store across the restart): the restarted job resumes and ends with exactly (bit for bit) the
  parameters of the uninterrupted run;
* elastic: checkpointed on 4 processes (tp=2 x dp=2, async save), resumed on 2 (re-planned, DCP reshards);
* a truncated newest checkpoint (and a partial one) skipped with a warning, the previous one used;
* Lightning's accumulate_grad_batches around the plan's micro-batches equals one big batch (the plan's own
  accumulation alone is the strategy's "dp_accum" scenario in test_strategy.py);
* the monitor's CSV (own and the CSVLogger's) and PNG;
* a re-plan (mbs/grad_accum) at a checkpoint boundary that keeps the losses equal;
* a straggler (one of 4 ranks slowed by a busy loop) named by the monitor, once, and drawn per rank;
* preemption: SIGUSR1 to rank 0 under SLURM's variables (a stand-in ``scontrol`` on PATH) and SIGTERM to every
  rank of a pipeline plan stop both ranks at one step with one checkpoint and exit codes 138 / 143; the restarted
  job resumes equal to the uninterrupted run; a checkpoint whose ranks' step records disagree is refused in one line.
"""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import DIST, background_launch, check_launch, torchrun
from common import STEPS, reference_run

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5
PARAM_ATOL = 1e-6

# preempt_usr1 last: its stop restarts the job (the second restart, after killed's)
WORLD2 = ["plain", "killed", "truncated", "rebalance", "lightning_accum", "elastic_resume", "preempt_term", "mixed",
          "preempt_usr1"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
@background_launch
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("callbacks")
    for nproc, names, extra in ((4, ["elastic_save", "straggler"], ()), (2, WORLD2, ("--max-restarts=3",))):
        proc = torchrun(DIST / "callback_scenarios.py", nproc, str(out), ",".join(names), timeout=600,
                        torchrun_args=extra)
        check_launch(proc, f"callback scenarios ({nproc} procs)")
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def load(out, name):
    path = out / f"{name}.pt"
    if not path.exists():
        crash = out / f"{name}.crash.pt"
        pytest.fail(torch.load(crash, weights_only=False)["crash"] if crash.exists() else f"{name} did not run")
    return torch.load(path, weights_only=False)


def assert_close_state(state, ref_state):
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


def assert_close_losses(losses, ref_losses):
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)


def test_uninterrupted_run_matches_reference(runs, reference):
    plain = load(runs, "plain")
    assert_close_losses(plain["losses"], reference[0])
    assert_close_state(plain["state"], reference[1])
    assert plain["saved"] == [f"step={s:08d}" for s in (2, 4, 6, 8)]
    # the overrides, plus whatever else the planner chose for this plan (none of it may change the math)
    assert {"forward prefetch 2", "backward prefetch 2", "reduce_scatter_buffers 2"} <= set(plain["overlap"])


def test_sigkill_restart_resumes_bit_exact(runs):
    plain, killed = load(runs, "plain"), load(runs, "killed")
    assert (runs / "killed.flag").exists(), "rank 1 was never killed"
    assert killed["restarts"] == 1  # the first restart reconnected: no attempt was lost to the dead one's keys
    # plain torchrun: the workers shared the agent's store across the restart, no variable opted out of it
    assert killed["agent_store"] == "True" and killed["opt_out"] is None
    assert killed["resumed_from"].endswith("step=00000004")
    assert killed["losses"] == plain["losses"][4:]
    for name, value in plain["state"].items():
        assert torch.equal(killed["state"][name], value), name


def test_elastic_4_to_2_processes(runs, reference):
    saved, resumed = load(runs, "elastic_save"), load(runs, "elastic_resume")
    assert saved["plan"]["tp"] == 2 and saved["plan"]["dp"] == 2
    assert resumed["plan"]["dp"] * resumed["plan"]["tp"] == 2  # re-planned for the live world
    assert resumed["resumed_from"].endswith("step=00000004")
    assert_close_losses(saved["losses"], reference[0][: STEPS // 2])
    assert_close_losses(resumed["losses"], reference[0][STEPS // 2:])  # same global batch, same data position
    assert_close_state(resumed["state"], reference[1])


def test_truncated_checkpoint_is_skipped(runs):
    plain, result = load(runs, "plain"), load(runs, "truncated")
    assert result["resumed_from"].endswith("step=00000002")
    text = " ".join(result["warnings"])
    assert "step=00000004" in text and "truncated" in text
    assert "step=00000006" in text and "no completion marker" in text
    assert not any(name.startswith(".tmp-") for name in result["left"])
    assert result["losses"] == plain["losses"][2:]
    for name, value in plain["state"].items():
        assert torch.equal(result["state"][name], value), name


def test_lightning_accumulation_around_plan_accumulation(runs, reference):
    result = load(runs, "lightning_accum")
    assert result["plan"]["grad_accum"] == 2
    pairs = torch.tensor(result["losses"]).view(-1, 2).mean(dim=1)  # two loader batches of 4 = one batch of 8
    torch.testing.assert_close(pairs, torch.tensor(reference[0]), rtol=LOSS_RTOL, atol=0)
    assert_close_state(result["state"], reference[1])


def test_monitor_csv_and_png(runs):
    plain = load(runs, "plain")
    records = plain["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["step_time_s"] > 0 and r["tokens"] == 8 * 16 and r["pred_step_time_s"] > 0
        assert r["mfu"] == pytest.approx(r["pred_mfu"] * r["pred_step_time_s"] / r["step_time_s"])
    assert any(r["comm_exposed_s"] is not None for r in records), "no profiled step"
    for message in plain["warnings"]:
        assert "the term off is" in message
    with open(plain["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(plain["csv"]) as f:
        assert len(list(csv.DictReader(f))) == STEPS
    with open(f"{plain['log_dir']}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("autopar/step_time_s")]
    assert len(rows) == STEPS and all(float(r["autopar/pred_step_time_s"]) > 0 for r in rows)


def test_rebalance_keeps_the_losses(runs, reference):
    result = load(runs, "rebalance")
    assert result["switches"], "no re-plan happened"
    first = result["switches"][0]
    assert first["from"] == "dp=2 zero=0 mbs=1 ga=4" and first["step"] == 3
    assert result["plan"]["dp"] * result["plan"]["mbs"] * result["plan"]["grad_accum"] == 8
    assert (result["plan"]["mbs"], result["plan"]["grad_accum"]) != (1, 4)
    assert "step=00000003" in result["saved"]  # the switch happened at a checkpoint boundary
    assert_close_losses(result["losses"], reference[0])
    assert_close_state(result["state"], reference[1])


def test_rebalance_reprices_on_the_refit_cluster(runs):
    first = load(runs, "rebalance")["switches"][0]
    assert "refit on 1 measured plan" in first["reason"] and "faster" in first["reason"]
    assert first["predicted_s"] > 0  # the re-priced step of the plan switched to


def test_monitor_csv_has_a_column_per_term(runs):
    from lightning_autopar.callbacks.monitor import STEP_TERMS

    plain = load(runs, "plain")
    with open(plain["csv"]) as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        terms = [float(row[f"pred_{t}_s"]) for t in STEP_TERMS if t != "runtime"]  # runtime: the sum of its own
        assert sum(terms) == pytest.approx(float(row["pred_step_time_s"]), rel=1e-6)


def test_a_slow_rank_is_named_once(runs):
    result = load(runs, "straggler")
    assert result["stragglers"] == [3], result["rank_times"][-1]
    named = [w for w in result["warnings"] if "straggler" in w]
    assert len(named) == 1 and "rank 3" in named[0] and "\n" not in named[0]
    latest = {r["rank"]: r for r in result["rank_times"][-1]}
    assert latest[3]["compute_s"] > latest[0]["compute_s"] and latest[0]["waiting_s"] > latest[3]["waiting_s"]
    with open(result["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

def test_sigusr1_to_rank0_under_slurm_checkpoints_requeues_and_resumes(runs):
    plain, result = load(runs, "plain"), load(runs, "preempt_usr1")
    assert result["exit_codes"] == [138, 138]  # 128 + SIGUSR1 on both ranks: "not finished"
    assert result["requeue_calls"] == ["requeue 4242"]  # rank 0 alone, once
    assert result["restarts"] == 2  # killed's restart, then this stop's
    assert result["resumed_from"].endswith("step=00000003")  # the step the signal arrived in, saved at its end
    assert_close_losses(result["losses"], plain["losses"][3:])
    assert_close_state(result["state"], plain["state"])


def test_sigterm_to_every_rank_of_a_pipeline_plan_stops_at_one_step(runs, reference):
    result = load(runs, "preempt_term")
    assert result["plan"]["pp"] == 2
    assert result["stopped"] == 143 and result["exit_codes"] == [143, 143]
    assert result["after_stop"] == ["step=00000002", "step=00000004", "step=00000005"]
    assert result["resumed_from"].endswith("step=00000005")
    assert_close_losses(result["losses"], reference[0][5:])
    assert_close_state(result["state"], reference[1])


def test_checkpoint_with_mixed_rank_steps_is_refused(runs):
    result = load(runs, "mixed")
    assert result["error"] == (f"checkpoint {result['target']} is mixed: rank 0 at step 8; rank 1 at step 7; "
                               "delete it or resume from an earlier one")
