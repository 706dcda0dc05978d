"""The bounded search (bounded.GridSearch on an enumerated space, search.Tables.steps where the runtime's fixed
costs are priced per candidate: memory first, a lower bound per mid against the k-th best step found) returns
exactly what exhaustive pricing returns: the same ranked plans and prices, runner-up, smallest plan, explanation
(what-if re-plans), feasible and rejected counts, on random (model, cluster, batch, fix) cases."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from lightning_autopar.errors import ConfigError, InfeasibleError
from lightning_autopar.planner import cost as C
from lightning_autopar.planner.bounded import GridSearch, below
from lightning_autopar.planner.search import Tables, _same_compute, plan
from lightning_autopar.planner.space import enumerate_space
from lightning_autopar.specs import load_cluster_spec, load_model_spec

# (model, seq_len or None): dense, GQA, MoE, unit form (ResNet-152, 53 units; a 3-D U-Net)
MODELS = [("gpt-tiny", None), ("llama_tiny", None), ("mixtral_tiny", None), ("gpt_moe_small", 256),
          ("gpt_small", 256), ("gpt3-125m", 512), ("resnet152", None), ("unet3d", None)]
CLUSTERS = [("cpu", dict(devices_per_node=4)), ("cpu", dict(devices_per_node=8)), ("a100-80g-dgx", dict(nodes=1)),
            ("a100-80g-dgx", dict(nodes=2)), ("h100-sxm-dgx", dict(nodes=1)), ("h100-96g-500w", {})]
FIXES = [None, None, "zero=3", "tp=2", "pp=2", "recompute=full", "mbs=1", "compile=true", "pp=2,schedule=1f1b"]


def outcome(report) -> tuple:
    """Everything plan() returns that pricing decides, as comparable values."""
    row = lambda c: (c.plan, c.step_time_s, c.memory_gib_per_device, c.host_gib_per_device)  # noqa: E731
    return ([row(c) for c in report.candidates], report.runner_up and row(report.runner_up), row(report.smallest),
            report.explanation, report.feasible, report.evaluated, dict(report.rejected))


def both(model: str, cluster, **kw) -> tuple:
    """(bounded, exhaustive) outcomes, or the error both raise (type and message)."""
    got = []
    for exhaustive in (False, True):
        try:
            got.append(outcome(plan(model, cluster, exhaustive=exhaustive, **kw)))
        except (ConfigError, InfeasibleError) as err:
            got.append((type(err), str(err)))
    return tuple(got)


@functools.lru_cache(maxsize=None)
def random_cases(n: int, seed: int = 30) -> list[tuple[str, object, dict]]:
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n):
        name, seq = MODELS[rng.integers(len(MODELS))]
        cname, ckw = CLUSTERS[rng.integers(len(CLUSTERS))]
        cluster = load_cluster_spec(cname, **ckw)
        kw = dict(global_batch=int(rng.choice([8, 16, 24, 32, 64])), seq_len=seq,
                  fix=FIXES[rng.integers(len(FIXES))], top=int(rng.choice([1, 3, 10])),
                  memory_fraction=float(rng.choice([0.9, 0.9, 0.5, 0.2])))
        if name == "unet3d" or cname == "cpu":
            kw["global_batch"] = int(rng.choice([8, 16]))
        cases.append((name, cluster, kw))
    return cases


@pytest.mark.parametrize("case", range(56))
def test_bounded_search_equals_exhaustive_on_random_cases(case: int) -> None:
    model, cluster, kw = random_cases(56)[case]
    bounded, exhaustive = both(model, cluster, **kw)
    assert bounded == exhaustive


def test_offload_only_fits_and_moe_equal_exhaustive() -> None:
    # Llama-3-8B at 20% of an H100's memory with zero 3: only offload plans fit (test_planner_offload)
    bounded, exhaustive = both("llama3-8b", "h100-96g-500w", global_batch=16, seq_len=8192, fix="zero=3",
                               memory_fraction=0.2)
    assert bounded == exhaustive and bounded[0][0][0].offload != "none"
    bounded, exhaustive = both("mixtral_tiny", load_cluster_spec("h100-sxm-dgx", nodes=2), global_batch=64)
    assert bounded == exhaustive and bounded[0][0][0].ep >= 1


def test_bounds_hold_and_prune() -> None:
    """Every candidate's step is at least its mid's bound, and the search prices a fraction of the space."""
    spec = load_model_spec("gpt_small")
    cluster = load_cluster_spec("a100-80g-dgx", nodes=1)
    hw = C.Hardware.from_cluster(cluster)
    space = enumerate_space(spec, cluster.world_size, 64, 512, ["bf16-mixed"], host_offload=True)
    t = Tables.of(spec, hw, space, 512)
    every = t.steps(np.ones(space.size, dtype=bool), 1, exhaustive=True)
    assert np.all(every >= t.lower_bounds()[t.cm]) and np.all(every >= t.compute_bounds()[t.cm])
    fresh = Tables.of(spec, hw, space, 512)
    fast = fresh.steps(np.ones(space.size, dtype=bool), 10)
    assert np.array_equal(np.sort(fast)[:10], np.sort(every)[:10])
    assert fresh.priced < space.size / 2
    # a what-if cluster with other links keeps the compute bound (the search uses it); other compute does not
    assert _same_compute(hw, dataclasses.replace(hw, inter_bw=2 * hw.inter_bw, intra_bw=2 * hw.intra_bw))
    assert not _same_compute(hw, dataclasses.replace(hw, gemm_eff=hw.gemm_eff * 2))


def test_grid_bounds_hold_and_prune() -> None:
    """On a GPU preset's space (the grid search's path): every candidate's step is at least its mid's bound, its
    memory within its mid's memory bounds; the feasible counts and the ranking equal the per-candidate columns';
    the search prices a fraction of the space."""
    spec = load_model_spec("mixtral_tiny")
    cluster = load_cluster_spec("h100-sxm-dgx", nodes=2)
    hw = C.Hardware.from_cluster(cluster)
    space = enumerate_space(spec, cluster.world_size, 64, spec.seq_len, ["bf16-mixed"], host_offload=True)
    t = Tables.of(spec, hw, space, spec.seq_len)
    assert t.fixed is None and space.grid is not None
    every = t.steps(np.ones(space.size, dtype=bool), 1, exhaustive=True)
    memory, host = t.memory_host()
    search = GridSearch(t, space.grid)
    mids = np.arange(len(space.mids["key"]))
    assert np.all(every >= search.bounds(mids)[t.cm])
    low, high = search._memory_bounds()
    assert np.all((memory >= low[t.cm]) & (memory <= high[t.cm]))
    limit = float(np.quantile(memory, 0.4))
    scan = search.scan(limit, np.inf)
    ok = memory <= limit
    assert scan.feasible == ok.sum() and scan.over_memory == (~ok).sum()
    assert np.array_equal(scan.ok_per_mid, np.bincount(t.cm[ok], minlength=len(mids)))
    assert scan.smallest == int(np.argmin(memory))
    ranked = search.rank(scan, 5, by_layout=True)
    idx = np.flatnonzero(ok)
    assert np.array_equal(ranked.top(5), idx[np.lexsort((memory[idx], every[idx]))[:5]])
    assert search.priced < space.size / 2
    assert float(below(0.1)) <= 0.1 < float(np.nextafter(below(0.1), np.float32(1)))
