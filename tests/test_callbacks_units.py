"""In-process tests of the callbacks' parts: checkpoint verification and selection, the resumable loader, RNG
states, the compute/communication split, the pipeline timeline, the monitor's check and report, the re-plan
arithmetic and the overlap choice."""

from __future__ import annotations

import json
import random
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_autopar.callbacks import StepMonitor, StepRecord, choose_overlap, latest_checkpoint, make_resumable
from lightning_autopar.callbacks.checkpoint import MARKER, checkpoint_name, rng_state, set_rng_state, verify
from lightning_autopar.callbacks import Rebalance
from lightning_autopar.callbacks.monitor import STEP_TERMS, communication_split, pipeline_schedule
from lightning_autopar.callbacks.rebalance import reprice, same_batch_splits
from lightning_autopar.errors import ConfigError
from lightning_autopar.planner.cost import RUNTIME_TERMS
from lightning_autopar.planner.search import estimate
from lightning_autopar.specs import Breakdown, ClusterSpec, ModelSpec, Plan, PricedPlan, load_cluster_spec


def fake_checkpoint(root, step, files=None, marker=True):
    path = root / checkpoint_name(step)
    path.mkdir(parents=True)
    files = files or {"__0_0.distcp": b"x" * 100, ".metadata": b"m" * 10, "meta.pt": b"p" * 20}
    for name, data in files.items():
        (path / name).write_bytes(data)
    if marker:
        (path / MARKER).write_text(json.dumps({"files": {n: len(d) for n, d in files.items()}}))
    return path


def test_newest_complete_checkpoint_wins_and_broken_ones_are_skipped(tmp_path):
    fake_checkpoint(tmp_path, 2)
    good = fake_checkpoint(tmp_path, 10)
    truncated = fake_checkpoint(tmp_path, 12)
    (truncated / "__0_0.distcp").write_bytes(b"x" * 40)
    fake_checkpoint(tmp_path, 14, marker=False)
    (tmp_path / ".tmp-step=00000016").mkdir()
    assert verify(good) is None
    assert "truncated" in verify(truncated)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_checkpoint(tmp_path) == good
    messages = [str(w.message) for w in caught]
    assert any("step=00000012" in m and "truncated" in m for m in messages)
    assert any("step=00000014" in m and "no completion marker" in m for m in messages)
    assert latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("kwargs", [{}, {"num_workers": 1, "persistent_workers": True}])
def test_resumable_loader_skips_done_batches_once(kwargs):
    loader = DataLoader(list(range(10)), batch_size=2, **kwargs)
    assert make_resumable(loader, None) is loader and isinstance(loader, DataLoader)
    loader.load_state_dict({"batches": 3})
    assert len(loader) == 5  # Lightning counts the epoch's batches itself
    assert [b.tolist() for b in loader] == [[6, 7], [8, 9]]
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    loader.load_state_dict({"batches": 5})  # the epoch had ended: start the next one from its beginning
    assert len(list(loader)) == 5


def test_rng_states_survive_a_weights_only_load(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state = rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.save({"rng": [state]}, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)["rng"][0]
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_state(loaded)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1]) and random.random() == expected[2]


def event(name, start_us, end_us, thread=1):
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start_us, end=end_us),
                           device_type="DeviceType.CPU")


def test_communication_split_counts_only_what_compute_does_not_cover():
    events = [event("aten::mm", 0, 100), event("aten::add", 150, 200),  # main thread: compute
              event("gloo:all_gather", 50, 180, thread=2),  # 100..150 is exposed
              event("gloo:all_reduce", 300, 400, thread=3),  # fully exposed
              event("aten::copy_", 300, 400, thread=2)]  # a background thread's op is not compute
    exposed, total = communication_split(events)
    assert exposed == pytest.approx(150e-6)
    assert total == pytest.approx(230e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_schedule_respects_dependencies_and_bubble(schedule):
    pp, m, f, b = 4, 8, 1.0, 2.0
    ops = pipeline_schedule(pp, m, schedule, f, b)
    assert len(ops) == 2 * pp * m
    end = {(kind, s, i): e for s, i, kind, _, e in ops}
    start = {(kind, s, i): st for s, i, kind, st, _ in ops}
    for s in range(pp):
        for i in range(m):
            if s:
                assert start[("F", s, i)] >= end[("F", s - 1, i)]
            if s < pp - 1:
                assert start[("B", s, i)] >= end[("B", s + 1, i)]
    makespan = max(end.values())
    assert makespan == pytest.approx((m + pp - 1) * (f + b))  # the classic bubble: (pp-1)/m of the ideal


def priced(plan, step=1.0, compute=0.8, comm=0.2, bubble=0.0, memory=1.0, mfu=0.4):
    return PricedPlan(plan=plan, step_time_s=step, tokens_per_s=1000 / step, model_tflops_per_device=100 * mfu,
                      mfu=mfu, memory_gib_per_device=memory,
                      breakdown=Breakdown(compute_s=compute, comm_exposed_s=comm, bubble_s=bubble))


def record(step, measured, pred, compute=None, comm=None, plan="dp=2 zero=3 mbs=1 ga=1"):
    return StepRecord(step=step, plan=plan, step_time_s=measured, data_time_s=0.0, tokens=1000,
                      tokens_per_s=1000 / measured, peak_mem_gib=1.0, model_tflops=40 * pred / measured,
                      mfu=0.4 * pred / measured, compute_s=compute, comm_exposed_s=comm,
                      comm_total_s=comm, pred_step_time_s=pred, pred_tokens_per_s=1000 / pred,
                      pred_model_tflops=40.0, pred_mfu=0.4, pred_mem_gib=1.0, pred_compute_s=0.8 * pred,
                      pred_comm_s=0.2 * pred)


def test_monitor_names_the_term_that_is_off():
    monitor = StepMonitor(warmup_steps=1, window=4, tolerance=0.2)
    monitor.records = [record(1, 9.0, 1.0)] + [record(s, 2.0, 1.0) for s in range(2, 6)]
    summary = monitor.summary()
    assert summary["step_time_s"] == 2.0 and "compute_s" not in summary
    assert "not separately measured" in monitor.disagreement(summary)
    monitor.records[-1] = record(5, 2.0, 1.0, compute=0.9, comm=1.1)  # communication is what is off
    message = monitor.disagreement(monitor.summary())
    assert "the term off is exposed communication" in message and "+100%" in message
    monitor.records = [record(s, 1.1, 1.0) for s in range(1, 6)]
    assert monitor.disagreement(monitor.summary()) is None  # within 20%


def test_monitor_report_with_pipeline_timeline(tmp_path):
    monitor = StepMonitor(warmup_steps=1, window=2)
    monitor.records = [record(s, 2.0 + 0.1 * s, 1.0, compute=1.5 if s == 3 else None, comm=0.6 if s == 3 else None)
                       for s in range(1, 7)]
    plan = Plan(dp=1, pp=4, grad_accum=8, schedule="1f1b")
    trainer = SimpleNamespace(strategy=SimpleNamespace(report=SimpleNamespace(best=priced(plan, bubble=0.3)),
                                                       root_device=torch.device("cpu")))
    png = monitor.write_png(tmp_path / "report.png", trainer)
    csv_path = monitor.write_csv(tmp_path / "report.csv")
    assert png.read_bytes()[:4] == b"\x89PNG" and len(csv_path.read_text().splitlines()) == 7
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_rebalance_candidates_are_the_same_batch_splits():
    plan = Plan(dp=2, zero=3, mbs=1, grad_accum=4)
    splits = same_batch_splits(plan, 8)
    assert [(p.mbs, p.grad_accum) for p in splits] == [(1, 4), (2, 2), (4, 1)]
    assert same_batch_splits(plan, 7) == []  # not a multiple of dp: no split keeps the batch


GPT = ModelSpec(layers=4, hidden=256, heads=4, vocab=1000, seq_len=128)


def live_report(plan):
    """What the strategy holds after planning: the plan priced on the cpu preset for 2 processes."""
    cluster = load_cluster_spec("cpu", devices_per_node=2)
    best = estimate(GPT, cluster, plan, global_batch=plan.global_batch, seq_len=128)
    return SimpleNamespace(best=best, model=GPT, cluster=cluster, global_batch=plan.global_batch, seq_len=128,
                           memory_fraction=0.9)


def test_reprice_refits_the_cluster_to_the_measured_step():
    plan = Plan(dp=2, mbs=1, grad_accum=8)
    report = live_report(plan)
    found = reprice(report, plan, 2 * report.best.step_time_s)
    assert found.cluster.runtime.source.startswith("refit") and not report.cluster.runtime.source
    # the refit prices the plan in effect at what it measured, and its splits on the same cluster
    assert found.current.step_time_s == pytest.approx(2 * report.best.step_time_s, rel=0.1)
    assert found.best.plan in same_batch_splits(plan, 16) and found.best.feasible
    assert found.best.step_time_s <= found.current.step_time_s
    assert found.gain() == pytest.approx(1 - found.best.step_time_s / found.current.step_time_s)


def test_rebalance_switches_only_when_the_refit_split_is_faster_by_min_gain():
    plan = Plan(dp=2, mbs=1, grad_accum=8)
    report = live_report(plan)
    pred = report.best.step_time_s
    gain = reprice(report, plan, 2 * pred).gain()
    assert gain > 0.05  # one micro-batch of 8 rows beats 8 of 1 on this model, also after the refit
    decision = Rebalance(patience=1).judge(report, plan, 2 * pred, pred)  # measured 2x the prediction
    assert decision is not None
    priced, cluster, reason = decision
    assert priced.plan != plan and priced.plan.global_batch == 16 and priced.plan.dp == 2
    assert priced.step_time_s == pytest.approx(estimate(GPT, cluster, priced.plan, 16, 128).step_time_s)
    assert "faster" in reason and plan.short() in reason
    # the same measurement, a gain below min_gain: stay
    assert Rebalance(patience=1, min_gain=gain + 0.01).judge(report, plan, 2 * pred, pred) is None
    # the measurement within 25% of the prediction: nothing is re-priced
    assert Rebalance(patience=1).judge(report, plan, 1.2 * pred, pred) is None
    # the fastest split in effect already: stay
    single = Plan(dp=2, mbs=8, grad_accum=1)
    assert Rebalance(patience=1).judge(live_report(single), single, 2 * pred, pred) is None


def test_rebalance_needs_patience_and_checks_its_arguments():
    plan = Plan(dp=2, mbs=1, grad_accum=8)
    report = live_report(plan)
    pred = report.best.step_time_s
    rebalance = Rebalance(patience=2)
    assert rebalance.judge(report, plan, 2 * pred, pred) is None  # first strike
    assert rebalance.judge(report, plan, 2 * pred, pred) is not None  # second: re-priced and switched
    assert rebalance.judge(report, plan, 2 * pred, pred) is None  # strikes start over
    for bad in ({"tolerance": -0.1}, {"min_gain": 1.0}, {"patience": 0}):
        with pytest.raises(ConfigError):
            Rebalance(**bad)


def fake_trainer(report, plan, callbacks, step):
    strategy = SimpleNamespace(plan=plan, report=report, _fix={}, broadcast=lambda obj: obj,
                               root_device=torch.device("cpu"))
    return SimpleNamespace(strategy=strategy, callbacks=callbacks, global_step=step, is_global_zero=True,
                           lightning_module=SimpleNamespace(automatic_optimization=True))


def test_rebalance_switch_follows_into_the_report_and_the_checkpoint(tmp_path):
    plan = Plan(dp=2, mbs=1, grad_accum=8)
    report = live_report(plan)
    pred = report.best.step_time_s
    monitor = StepMonitor(warmup_steps=1, window=3)
    monitor.records = [record(s, 2 * pred, pred, plan=plan.short()) for s in range(1, 6)]
    rebalance = Rebalance(check_every_n_steps=5, patience=1, verbose=False)
    trainer = fake_trainer(report, plan, [monitor, rebalance], step=5)
    rebalance.on_train_start(trainer, None)
    rebalance.on_train_batch_end(trainer, None, None, None, 0)
    assert len(rebalance.switches) == 1 and rebalance.switches[0]["from"] == plan.short()
    new = trainer.strategy.plan
    assert new != plan and report.best.plan == new  # the monitor now compares with the re-priced plan
    assert report.cluster.runtime.source.startswith("refit")  # ... priced on the refit cluster
    assert report.best.step_time_s == pytest.approx(estimate(GPT, report.cluster, new, 16, 128).step_time_s)
    # resume: the split and the refit cluster come back from the checkpointed state
    torch.save(rebalance.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # as AutoCheckpoint loads it
    resumed, fresh = Rebalance(verbose=False), live_report(plan)
    resumed.load_state_dict(state)
    trainer = fake_trainer(fresh, plan, [monitor, resumed], step=5)
    resumed.on_train_start(trainer, None)
    assert trainer.strategy.plan == new and fresh.cluster == report.cluster
    assert fresh.best.step_time_s == pytest.approx(report.best.step_time_s)


def test_monitor_records_every_predicted_term(tmp_path):
    assert set(RUNTIME_TERMS) <= set(STEP_TERMS)  # a column for each runtime term the cost model names
    plan = Plan(dp=2, mbs=2, grad_accum=2)
    terms = {"step": 0.01, "microbatch": 0.02, "fsdp_units": 0.0, "tp_dispatch": 0.0, "pipeline_actions": 0.0,
             "ep_dispatch": 0.0}
    best = PricedPlan(plan=plan, step_time_s=1.0, tokens_per_s=1000.0, model_tflops_per_device=40.0, mfu=0.4,
                      memory_gib_per_device=1.0,
                      breakdown=Breakdown(compute_s=0.6, recompute_s=0.1, comm_exposed_s=0.2, bubble_s=0.07,
                                          runtime_s=0.03, terms=terms))
    trainer = fake_trainer(SimpleNamespace(best=best), plan, [], step=1)
    monitor = StepMonitor(warmup_steps=1, report_path=False)
    for step in range(1, 5):
        trainer.global_step = step
        split = (0.5, 0.6) if step == 3 else None  # one probed step: 0.5 s of 2 s exposed
        monitor.records.append(monitor._record(trainer, 2.0, 0.0, 1000, split, torch.device("cpu")))
    rec = monitor.records[-1]
    assert sum(getattr(rec, f"pred_{t}_s") for t in STEP_TERMS if t != "runtime") == pytest.approx(1.0)
    assert (rec.pred_compute_s, rec.pred_recompute_s, rec.pred_runtime_s, rec.pred_microbatch_s) == \
        pytest.approx((0.6, 0.1, 0.03, 0.02))
    assert rec.pred_comm_s == pytest.approx(0.27)
    summary = monitor.summary()
    assert summary["pred_compute_s"] == pytest.approx(0.73)  # what the measured compute_s covers
    assert summary["compute_s"] == pytest.approx(1.5) and summary["comm_s"] == pytest.approx(0.5)
    rows = {name: (p, m) for name, p, m in monitor.term_comparison()}
    assert rows["whole step"] == pytest.approx((1.0, 2.0)) and rows["step"] == (pytest.approx(0.01), None)
    assert rows["compute+recompute+runtime"] == pytest.approx((0.73, 1.5))
    assert rows["microbatch"] == (pytest.approx(0.02), None) and "tp_dispatch" not in rows  # predicted 0
    header = monitor.write_csv(tmp_path / "m.csv").read_text().splitlines()[0].split(",")
    assert {f"pred_{t}_s" for t in STEP_TERMS} <= set(header)
    assert {"step_time_s", "compute_s", "comm_exposed_s", "pred_step_time_s", "pred_comm_s"} <= set(header)
    png = monitor.write_png(tmp_path / "m.png", trainer)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_overlap_knobs_follow_the_exposed_communication():
    model = ModelSpec(layers=4, hidden=256, heads=4, vocab=1000, seq_len=128)
    cluster = ClusterSpec(name="gpu", devices_per_node=8)
    cluster.device.name, cluster.device.memory_gib = "gpu", 80.0

    def report(plan, comm):
        return SimpleNamespace(best=priced(plan, compute=1.0, comm=comm), model=model, cluster=cluster,
                               memory_fraction=0.9)

    assert choose_overlap(report(Plan(dp=8, zero=0), 0.5)).forward_prefetch == 0  # nothing gathered
    assert choose_overlap(report(Plan(dp=8, zero=3), 0.0)).forward_prefetch == 0  # nothing to hide
    knobs = choose_overlap(report(Plan(dp=8, zero=3), 0.1))
    assert (knobs.forward_prefetch, knobs.backward_prefetch, knobs.reduce_scatter_buffers) == (1, 1, 2)
    heavy = choose_overlap(report(Plan(dp=8, zero=3), 0.5))
    assert heavy.forward_prefetch == 2 and heavy.separate_reduce_scatter_group
    zero2 = choose_overlap(report(Plan(dp=8, zero=2), 0.5))
    assert zero2.forward_prefetch == 0 and zero2.reduce_scatter_buffers == 2  # parameters stay gathered
    cluster.device.name = "cpu"
    assert choose_overlap(report(Plan(dp=8, zero=3), 0.5)).reduce_scatter_buffers == 1  # no stream to stall


def test_stragglers_are_ranks_slower_than_their_stage_peers_every_time():
    from lightning_autopar.callbacks.monitor import RankTime, find_stragglers, straggler_message

    def probe(slow_rank, factor=2.0, stages=(0, 0, 0, 0)):
        return [RankTime(r, stages[r], 1.0, 0.4 * (factor if r == slow_rank else 1.0), 0.1) for r in range(4)]

    steady = [probe(3), probe(3), probe(3)]
    assert find_stragglers(steady, 0.25, 3) == [(3, 0.8, 0.4)]
    assert find_stragglers(steady[:2], 0.25, 3) == []  # not yet persistent
    assert find_stragglers([probe(3), probe(None), probe(3)], 0.25, 3) == []  # one fast probe breaks the run
    assert find_stragglers([probe(3, 1.2)] * 3, 0.25, 3) == []  # within the threshold
    assert find_stragglers(steady, 0.25, 3, min_excess_s=0.5) == []  # 0.4 s more: under the absolute floor
    assert find_stragglers(steady, 0.25, 3, min_excess_s=0.3) == [(3, 0.8, 0.4)]
    # pipeline stages do different work: the last stage's ranks compare with each other only
    staged = [[RankTime(r, r // 2, 1.0, 0.4 if r < 2 else 0.9, 0.1) for r in range(4)]] * 3
    assert find_stragglers(staged, 0.25, 3) == []
    message = straggler_message(3, 0.8, 0.4, 3)
    assert "rank 3" in message and "x2.00" in message and "\n" not in message

def test_mixed_step_records_are_named_rank_by_rank(tmp_path):
    from lightning_autopar.callbacks.checkpoint import STEPS_DIR, mixed_steps, refuse_mixed
    from lightning_autopar.errors import AutoparError

    path = fake_checkpoint(tmp_path, 4)
    assert mixed_steps(path) is None  # a checkpoint without step records (written before them) passes
    (path / STEPS_DIR).mkdir()
    for rank, step in enumerate((4, 4, 3, 3)):
        (path / STEPS_DIR / f"rank={rank:05d}.json").write_text(json.dumps({"rank": rank, "step": step}))
    line = f"checkpoint {path} is mixed: ranks 0, 1 at step 4; ranks 2, 3 at step 3; delete it or resume from an earlier one"
    assert mixed_steps(path) == line
    with pytest.raises(AutoparError) as err:
        refuse_mixed(path)
    assert str(err.value) == line
    for rank in (2, 3):
        (path / STEPS_DIR / f"rank={rank:05d}.json").write_text(json.dumps({"rank": rank, "step": 4}))
    refuse_mixed(path)  # agreeing ranks load


def test_preemption_requeues_only_in_a_slurm_batch_job(monkeypatch):
    import signal

    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    from lightning_autopar.callbacks import Preemption

    def trainer(env):
        return SimpleNamespace(strategy=SimpleNamespace(cluster_environment=env))

    for name in ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    cb = Preemption()
    assert cb._requeue_signal(trainer(LightningEnvironment())) is None  # no SLURM job
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert cb._requeue_signal(trainer(LightningEnvironment())) == signal.SIGUSR1  # srun torchrun
    assert set(cb._handled(trainer(LightningEnvironment()))) == {signal.SIGTERM, signal.SIGUSR1}
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")
    assert cb._requeue_signal(trainer(LightningEnvironment())) is None  # an salloc shell: never requeued
    assert cb._requeue_signal(trainer(SLURMEnvironment(requeue_signal=signal.SIGHUP))) == signal.SIGHUP
    assert cb._requeue_signal(trainer(SLURMEnvironment(auto_requeue=False))) is None
