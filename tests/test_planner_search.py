"""plan() / estimate(): the space, fix and restrict, ranking, errors, pipeline partition, measurements."""

from __future__ import annotations

import itertools
import time
from collections import Counter

import numpy as np
import pytest

from lightning_autopar.errors import ConfigError, InfeasibleError
from lightning_autopar.planner import cost as C
from lightning_autopar.planner.search import estimate, plan
from lightning_autopar.planner.space import enumerate_space
from lightning_autopar.specs import Plan, load_cluster_spec, load_model_spec

STRATEGY_RESTRICT = {"pp": [1], "cp": [1], "ep": [1], "sp": [False], "recompute": ["none"]}


def cpu(n: int = 4):
    return load_cluster_spec("cpu", devices_per_node=n)


def test_tiny_on_cpu_is_fast_and_valid() -> None:
    plan("gpt-tiny", cpu(), global_batch=8, precision="fp32", restrict=STRATEGY_RESTRICT)  # warm caches
    start = time.process_time()  # CPU time: other work on shared cores does not count against it
    report = plan("gpt-tiny", cpu(), global_batch=8, precision="fp32", restrict=STRATEGY_RESTRICT)
    assert time.process_time() - start < 0.2
    best = report.best.plan
    best.validate(world_size=4, global_batch=8)
    assert best.precision == "fp32" and best.pp == 1 and best.cp == 1 and not best.sp
    steps = [c.step_time_s for c in report.candidates]
    assert steps == sorted(steps) and all(c.feasible for c in report.candidates)
    assert report.evaluated >= len(report.candidates) and report.feasible <= report.evaluated


def test_full_space_counts() -> None:
    # top=5000: the zero-bubble schedules (interleaved-zb, zbv, dualpipev: issue 15) took the space past 1000
    report = plan("gpt-tiny", cpu(), global_batch=8, precision="fp32", top=5000, explain_choice=False)
    plans = {tuple(sorted(c.plan.to_dict().items())) for c in report.candidates}
    assert len(plans) == len(report.candidates) == report.feasible  # no duplicates, all fit
    seen = {(c.plan.tp, c.plan.pp, c.plan.schedule, c.plan.recompute, c.plan.zero) for c in report.candidates}
    assert {s[2] for s in seen} == {"gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev"}
    # 4 layers: every multi-chunk schedule runs pp=2 x vpp=2. interleaved-zb keeps interleaved's rows (grad_accum
    # % pp) without recompute or compile (the split backward: space.recompute_rule, compile_rule), so a sixth of
    # the eager ones (6 recompute options: none, selective, full, ops, and full / ops on every 2nd block,
    # space.RECOMPUTE_EVERY, issue 17); zbv takes any grad_accum (torch pads the V), adding the grad_accum=1 rows; dualpipev needs
    # grad_accum >= 2*pp = 4
    eager = [c for c in report.candidates if not c.plan.compile]
    n = Counter(c.plan.schedule for c in eager)
    rows = lambda f: sum(1 for c in eager if f(c.plan))  # noqa: E731
    assert n["interleaved-zb"] * 6 == n["interleaved"]
    assert n["zbv"] == n["interleaved-zb"] + rows(lambda p: p.schedule == "zbv" and p.grad_accum == 1)
    assert n["dualpipev"] == rows(lambda p: p.schedule == "interleaved-zb" and p.grad_accum >= 4)
    assert all(c.plan.vpp == 2 and c.plan.pp == 2 and c.plan.recompute == "none" and not c.plan.compile
               for c in report.candidates if c.plan.schedule in ("interleaved-zb", "zbv", "dualpipev"))
    assert {s[3] for s in seen} == {"none", "selective", "full", "ops"} and {s[4] for s in seen} == {0, 1, 2, 3}
    assert {(c.plan.recompute, c.plan.recompute_every) for c in eager if c.plan.recompute_every > 1} == {
        ("full", 2), ("ops", 2)}
    for c in report.candidates:
        c.plan.validate(world_size=4, global_batch=8)
        assert 4 % c.plan.tp == 0 and c.plan.global_batch == 8


def test_space_divisibility() -> None:
    spec = load_model_spec("mixtral-8x7b")
    space = enumerate_space(spec, 64, 64, 4096, ["bf16-mixed"])
    tp, ep, dp, cp = (space.column(n) for n in ("tp", "ep", "dp", "cp"))
    assert set(np.unique(tp)) <= {1, 2, 4, 8}  # kv_heads = 8
    assert np.all(8 % ep == 0) and np.all(dp % ep == 0) and ep.max() == 8
    assert np.all(64 % dp == 0) and np.all(4096 % (2 * cp[cp > 1]) == 0)


def test_fix_pins_and_wins_over_restrict() -> None:
    report = plan("gpt-tiny", cpu(), global_batch=8, precision="fp32", fix="tp=2,zero=1",
                  restrict={"tp": [1], "zero": [0]}, explain_choice=False)
    assert all(c.plan.tp == 2 and c.plan.zero == 1 for c in report.candidates)
    report = plan("gpt-tiny", cpu(), global_batch=8, precision="fp32", restrict={"grad_accum": [1], "sp": [False]},
                  explain_choice=False)
    assert all(c.plan.grad_accum == 1 and not c.plan.sp for c in report.candidates)


@pytest.mark.parametrize("fix,field", [
    ("tp=3", "fix.tp"), ("ep=2", "fix.ep"), ("dp=3", "fix.dp"), ("cp=3", "fix.cp"), ("pp=8", "fix.pp"),
    ("dp=2,tp=1,pp=1,cp=1", "fix"), ("mbs=3", "fix.mbs"), ("bogus=1", "fix.bogus"),
])
def test_bad_fix_is_config_error(fix: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        plan("gpt-tiny", cpu(), global_batch=8, fix=fix)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_infeasible_names_smallest_memory() -> None:
    with pytest.raises(InfeasibleError, match=r"smallest memory any plan needs is [\d.]+ GiB.*relax"):
        plan("gpt3-175b", load_cluster_spec("a100-80g-dgx"), global_batch=8)
    report = plan("gpt3-175b", load_cluster_spec("a100-80g-dgx"), global_batch=8, fix="tp=8", allow_infeasible=True)
    assert not report.best.feasible and report.feasible == 0


def test_estimate_plan_forms() -> None:
    as_text = estimate("gpt-tiny", cpu(), "tp=2,mbs=2,precision=fp32", global_batch=8)
    assert as_text.plan.dp == 2 and as_text.plan.grad_accum == 2
    as_plan = estimate("gpt-tiny", cpu(), Plan(dp=2, tp=2, mbs=2, grad_accum=2))
    assert as_plan.step_time_s == pytest.approx(as_text.step_time_s)
    b = as_plan.breakdown
    assert as_plan.step_time_s == pytest.approx(b.compute_s + b.recompute_s + b.comm_exposed_s + b.bubble_s + b.runtime_s)
    assert as_plan.tokens_per_s == pytest.approx(8 * 64 / as_plan.step_time_s)
    with pytest.raises(ConfigError, match="world size"):
        estimate("gpt-tiny", cpu(), Plan(dp=3), global_batch=3)


def test_estimate_agrees_with_search() -> None:
    report = plan("gpt3-1.3b", load_cluster_spec("a100-80g-dgx", nodes=2), global_batch=64, explain_choice=False)
    for cand in report.candidates[:3]:
        again = estimate("gpt3-1.3b", load_cluster_spec("a100-80g-dgx", nodes=2), cand.plan)
        assert again.step_time_s == pytest.approx(cand.step_time_s, rel=1e-5)
        assert again.memory_gib_per_device == pytest.approx(cand.memory_gib_per_device, rel=1e-5)


def test_pipeline_bubble_and_schedules() -> None:
    assert C.bubble_fraction(4, 8, 1) == pytest.approx(3 / 8)
    assert C.bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)
    c = load_cluster_spec("a100-80g-dgx")
    est = lambda s: estimate("gpt3-6.7b", c, f"dp=2,pp=4,mbs=1,precision=bf16-mixed,{s}", global_batch=16)  # noqa: E731
    gpipe, one_f, inter = est("schedule=gpipe"), est("schedule=1f1b"), est("schedule=interleaved,vpp=2")
    assert gpipe.step_time_s == pytest.approx(one_f.step_time_s)  # same bubble
    assert gpipe.memory_gib_per_device > one_f.memory_gib_per_device  # all 8 micro-batches in flight vs 4
    assert inter.breakdown.bubble_s < 0.6 * one_f.breakdown.bubble_s  # (pp-1)/(m*vpp), a few more p2p sends
    assert sum(one_f.layers_per_stage) == 32 and len(inter.layers_per_stage) == 8


def test_partition_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.uniform(0.5, 3.0, size=rng.integers(3, 9))
        parts = int(rng.integers(2, min(4, len(w)) + 1))
        sizes = C.partition_layers(w, parts)
        assert sum(sizes) == len(w) and min(sizes) >= 1
        cost = lambda cuts: max(w[a:b].sum() for a, b in zip((0,) + cuts, cuts + (len(w),)))  # noqa: E731
        best = min(cost(c) for c in itertools.combinations(range(1, len(w)), parts - 1))
        got = cost(tuple(np.cumsum(sizes)[:-1].tolist()))
        assert got == pytest.approx(best)


def test_uneven_partition_balances_head() -> None:
    # a big vocabulary makes the last stage heavy: the DP gives it fewer blocks
    report = estimate("llama3-8b", load_cluster_spec("h100-sxm-dgx"), "dp=2,pp=4,mbs=1,precision=bf16-mixed",
                      global_batch=16)
    assert report.layers_per_stage[-1] < report.layers_per_stage[1]
    even = plan("llama3-8b", load_cluster_spec("h100-sxm-dgx"), global_batch=16, fix="pp=4,schedule=1f1b",
                restrict={"uneven": [False]}, explain_choice=False)
    assert all(len(set(c.layers_per_stage)) == 1 for c in even.candidates)


def test_measured_blocks_replace_analytic() -> None:
    spec = load_model_spec("gpt-tiny")
    c = cpu(2)
    base = estimate(spec, c, "dp=2,mbs=4,precision=fp32", global_batch=8)
    ref = C.dense_block_time(C.Hardware.from_cluster(c), spec, 4, 64, 1, 1, False, 0.16e12, 4.0)
    measured = {"mbs": 4, "seq_len": 64, "precision": "fp32",
                "blocks": {"dense": {"fwd_s": 10 * float(ref.fwd), "bwd_s": 10 * float(ref.bwd)}}}
    slow = estimate(spec, c, "dp=2,mbs=4,precision=fp32", global_batch=8, measured=measured)
    # same configuration as measured: the 4 blocks' forward+backward count 10x, the rest is unchanged
    extra = 9 * spec.layers * float(ref.fwd + ref.bwd)
    assert slow.breakdown.compute_s - base.breakdown.compute_s == pytest.approx(extra, rel=1e-4)
    report = plan(spec, c, global_batch=8, precision="fp32", measured=measured, explain_choice=False)
    assert report.best.step_time_s >= base.step_time_s * 0.5


def test_explanation_lines() -> None:
    report = plan("gpt3-6.7b", load_cluster_spec("a100-80g-dgx", nodes=4), global_batch=128)
    text = "\n".join(report.explanation)
    assert text.startswith("winner ") and "runner-up" in text
    assert "2x inter-node bandwidth" in text and "2x device memory" in text


def test_step_times_are_labelled_by_their_source() -> None:
    """Issue 30: a preset's step times say so, and how far off presets typically are; a calibrated cluster's
    say calibrated; the JSON carries both."""
    import dataclasses
    import io
    import json

    from rich.console import Console

    from lightning_autopar.planner.report import SOURCE_CALIBRATED, SOURCE_PRESET
    from lightning_autopar.specs import RuntimeCosts

    report = plan("gpt-tiny", cpu(), global_batch=16, precision="fp32", restrict=STRATEGY_RESTRICT)
    assert report.source == SOURCE_PRESET
    out = io.StringIO()
    report.print_table(Console(file=out, width=200))
    assert f"step times: {SOURCE_PRESET}, on CPU processes presets predict steps 3-4x too fast" in out.getvalue()
    doc = json.loads(json.dumps(report.to_json_dict()))
    assert doc["step_time_source"] == SOURCE_PRESET and "3-4x" in doc["step_time_note"]
    gpu = plan("gpt3-6.7b", load_cluster_spec("a100-80g-dgx", nodes=4), global_batch=128, explain_choice=False)
    assert "median 6%" in gpu.to_json_dict()["step_time_note"]
    calibrated = dataclasses.replace(cpu(), runtime=RuntimeCosts(step_us=100.0, source="profile"))
    assert plan("gpt-tiny", calibrated, global_batch=16, precision="fp32", explain_choice=False).source == \
        SOURCE_CALIBRATED


def test_rows_priced_the_same_are_one_row_naming_the_alternatives() -> None:
    """Issue 30: four rows of one price differing only in zero 1/2 x compile on/off read as one row."""
    import io

    from rich.console import Console

    from lightning_autopar.planner.report import merged_short, same_price_groups
    from lightning_autopar.specs import PricedPlan

    four = [Plan(dp=4, zero=z, mbs=4, compile=c) for c in (False, True) for z in (1, 2)]
    assert merged_short(four) == "dp=4 mbs=4 ga=1; zero 1|2, compile off|on"
    assert merged_short(four[:1]) == four[0].short()
    two = [four[0], four[3]]  # not every combination: each plan's own difference
    assert merged_short(two) == "dp=4 mbs=4 ga=1; zero=1 | zero=2 compile"
    priced = [PricedPlan(p, 0.0327) for p in four] + [PricedPlan(Plan(dp=2, pp=2, mbs=4, grad_accum=2), 0.0332)]
    assert [len(g) for g in same_price_groups(priced)] == [4, 1]
    report = plan("gpt-tiny", cpu(), global_batch=16, precision="fp32", top=8)
    out = io.StringIO()
    report.print_table(Console(file=out, width=250))
    rows = [line for line in out.getvalue().splitlines() if "mbs=" in line and "│" in line]
    groups = same_price_groups(report.candidates)
    assert len(rows) == len(groups) and all(merged_short([p.plan for p in g]) in out.getvalue() for g in groups)
