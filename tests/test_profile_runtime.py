"""Set-up runtime profiling (profile/runtime.py): fingerprints, the on-disk cache, the budget, the plans' groups,
and a world-4 launch profiling a tiny GPT for three plans (plus the probe's calibrated YAML)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from conftest import run_scenarios
from lightning_autopar.profile import runtime as rt
from lightning_autopar.specs import (BlockSample, ClusterSpec, CollectiveSample, ModelSpec, Plan, RuntimeCosts,
                                     RuntimeProfile, load_cluster_spec)

SPEC = ModelSpec(name="tiny", layers=2, hidden=32, heads=4, vocab=64, seq_len=16)


def test_fingerprints_are_stable_and_keyed():
    cluster = ClusterSpec(name="c", nodes=1, devices_per_node=4)
    assert rt.cluster_fingerprint(cluster) == rt.cluster_fingerprint(dataclasses.replace(cluster))
    assert rt.cluster_fingerprint(cluster) != rt.cluster_fingerprint(dataclasses.replace(cluster, devices_per_node=2))
    assert rt.cluster_fingerprint(cluster) != rt.cluster_fingerprint(dataclasses.replace(cluster, nodes=2))
    threads, before = torch.get_num_threads(), rt.cluster_fingerprint(cluster)
    try:
        torch.set_num_threads(threads + 1)  # another thread share per process: other block times
        assert rt.cluster_fingerprint(cluster) != before
    finally:
        torch.set_num_threads(threads)
    key = rt.model_fingerprint(SPEC, 16, 128, "fp32")
    assert key == rt.model_fingerprint(ModelSpec(**dataclasses.asdict(SPEC)), 16, 128, "fp32")
    others = {rt.model_fingerprint(dataclasses.replace(SPEC, hidden=64), 16, 128, "fp32"),
              rt.model_fingerprint(SPEC, 32, 128, "fp32"), rt.model_fingerprint(SPEC, 16, 64, "fp32"),
              rt.model_fingerprint(SPEC, 16, 128, "bf16-mixed")}
    assert key not in others and len(others) == 4


def _profile() -> RuntimeProfile:
    return RuntimeProfile(cluster_key="abc", model_key="def",
                          blocks=[BlockSample("dense", 2, 128, "fp32", 1e-3, 2e-3)],
                          collectives=[CollectiveSample("all_reduce", 4, 1, 4096, 1e-4)],
                          runtime=RuntimeCosts(fsdp_unit_us=120.0, source="profile test"), seconds=1.5, budget_s=10,
                          skipped=["pipeline_action_us: not timed"])


def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "env"))
    assert rt.cache_dir() == tmp_path / "env"
    monkeypatch.delenv("AUTOPAR_CACHE")
    assert rt.cache_dir().parts[-2:] == ("lightning_autopar", "profiles")
    calibrated = ClusterSpec(name="cpu-calibrated", devices_per_node=4, runtime=RuntimeCosts(fsdp_unit_us=120.0))
    folder = rt.save_profile(_profile(), calibrated, tmp_path)
    assert folder == tmp_path / "abc" / "def" and (folder / "cluster.yaml").exists()
    assert load_cluster_spec(str(folder / "cluster.yaml")) == calibrated  # a plain --cluster FILE
    profile, cluster = rt.load_profile("abc", "def", tmp_path)
    assert profile == _profile() and cluster == calibrated
    assert rt.load_profile("abc", "other", tmp_path) is None


@pytest.mark.parametrize("damage", ["garbage", "old_format", "bad_fields", "no_cluster", "bad_cluster"])
def test_a_damaged_cache_is_ignored(tmp_path, damage):
    folder = rt.save_profile(_profile(), ClusterSpec(name="x"), tmp_path)
    data = json.loads((folder / "profile.json").read_text())
    if damage == "garbage":
        (folder / "profile.json").write_text("{not json")
    elif damage == "old_format":
        (folder / "profile.json").write_text(json.dumps({**data, "format": 0}))
    elif damage == "bad_fields":
        data["profile"]["blocks"] = [{"kind": "dense", "speed": 3}]
        (folder / "profile.json").write_text(json.dumps(data))
    elif damage == "no_cluster":
        (folder / "cluster.yaml").unlink()
    else:
        (folder / "cluster.yaml").write_text("links: [{bandwidth_gbs: -1}]\n")
    assert rt.load_profile("abc", "def", tmp_path) is None


def test_plan_groups_follow_the_mesh_order():
    kinds = {g.kind: (g.size, g.stride) for g in rt.plan_groups(Plan(dp=2, tp=2, pp=2, zero=3, dp_shard=2))}
    assert kinds == {"dp": (2, 2), "tp": (2, 1), "pp": (2, 4)}
    hybrid = {g.kind: g.groups for g in rt.plan_groups(Plan(dp=4, zero=3, dp_shard=2))}
    assert hybrid["dp_shard"] == ((0, 1), (2, 3)) and hybrid["dp"] == ((0, 1, 2, 3),)
    assert [g.kind for g in rt.plan_groups(Plan(dp=4, ep=2))] == ["dp", "ep"]
    same = rt.distinct_groups([Plan(dp=2, tp=2), Plan(dp=2, pp=2), Plan(dp=4)])
    assert [(g.kind, g.groups) for g in same] == [("dp", ((0, 2), (1, 3))), ("tp", ((0, 1), (2, 3))),
                                                  ("pp", ((0, 2), (1, 3))), ("dp", ((0, 1, 2, 3),))]
    assert rt.neighbour_pairs(((0, 2, 4, 6), (1, 3, 5, 7))) == [(0, 2), (4, 6), (1, 3), (5, 7)]


class _MaskedBlock(torch.nn.Module):
    """A block that needs more than hidden states (as HF blocks need position embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x, mask):
        return self.proj(x) * mask


def test_blocks_that_need_more_than_hidden_states_are_skipped(tmp_path):
    from types import SimpleNamespace

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_MaskedBlock(), _MaskedBlock()])
    analysis = SimpleNamespace(spec=SPEC, blocks_fqn="blocks", token_embedding=None, lm_head=None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        profile = rt.profile_runtime(model, analysis, [Plan(mbs=2)], 16, "fp32", 5.0, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    # no forward of its own to run on token ids, blocks that need more than hidden states: only the optimizer step
    assert [b.kind for b in profile.blocks] == ["optimizer"] and all(p.grad is None for p in model.parameters())
    assert profile.skipped == ["blocks: _MaskedBlock does not run on hidden states alone (trials measure it)"]


def test_budget_zero_measures_nothing(tmp_path):
    from lightning_autopar.models import GPT, GPTConfig
    from lightning_autopar.profile.analyze import analyze

    model = GPT(GPTConfig(vocab=64, seq_len=16, layers=2, hidden=32, heads=4))
    analysis = analyze(model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        profile = rt.profile_runtime(model, analysis, [Plan(dp=1, zero=3, mbs=2)], 16, "fp32", 0.0,
                                     torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert profile.blocks == [] and profile.collectives == [] and profile.budget_s == 0.0
    assert profile.seconds < 1.0
    assert "model passes: no budget left" in profile.skipped
    assert "optimizer step: over the budget" in profile.skipped


@pytest.fixture(scope="module")
def profiled_world4(tmp_path_factory):
    out = run_scenarios(tmp_path_factory, 4, ["profile"], script="profile_runtime_scenarios.py")
    return [torch.load(out / f"profile_r{rank}.pt", weights_only=False) for rank in range(4)]


def test_world4_profile_measures_every_group_kind(profiled_world4):
    for result in profiled_world4:
        assert "crash" not in result, result.get("crash")
    profile = RuntimeProfile(**profiled_world4[0]["profile"])
    groups = {(c.ranks, c.stride, c.op) for c in profile.collectives}
    for ranks, stride in ((4, 1), (2, 1), (2, 2)):  # dp=4; tp (and the pp plan's dp); pp (and the tp plan's dp)
        assert {(ranks, stride, op) for op in ("all_reduce", "all_gather", "reduce_scatter")} <= groups
    assert (2, 2, "p2p") in groups
    assert all(c.seconds > 0 for c in profile.collectives)
    # whole-model passes at each plan's micro-batch size, then one optimizer step
    assert {(b.kind, b.mbs) for b in profile.blocks} == {("model", 1), ("model", 2), ("model", 4), ("optimizer", 0)}
    assert all(b.fwd_s > 0 and b.bwd_s > 0 and b.seq_len == 16 for b in profile.blocks if b.kind == "model")
    assert 0 < profile.seconds <= profile.budget_s == 60.0 and profiled_world4[0]["wall"] < 10.0  # well under 10 s
    assert profile.skipped == []
    for other in profiled_world4[1:]:  # every rank holds the same figures
        assert other["profile"] == profiled_world4[0]["profile"]


def test_world4_profile_leaves_no_state(profiled_world4):
    for result in profiled_world4:
        assert result["params_unchanged"] and result["grads_unchanged"] and result["rng_unchanged"]
        assert result["world_sum"] == 4.0


def test_world4_budget_zero_skips_everything(profiled_world4):
    empty = RuntimeProfile(**profiled_world4[0]["empty"])
    assert empty.blocks == [] and empty.collectives == []
    phrases = " | ".join(empty.skipped)
    for part in ("collectives on dp groups of 4", "collectives on pp groups of 2", "model passes: no budget left",
                 "optimizer step: over the budget"):
        assert part in phrases


def test_world4_probe_writes_a_calibrated_cluster_file(profiled_world4):
    spec = load_cluster_spec(profiled_world4[0]["probe_yaml"])
    # the runtime's fixed costs, fitted on its own paths (runtime/paths.py): how the time splits between the
    # terms depends on the probe's link figures (a 2-run probe here); that the paths cost host time does not
    rt_costs = spec.runtime
    assert rt_costs.source.startswith("runtime paths")
    assert max(rt_costs.microbatch_us, rt_costs.fsdp_unit_us, rt_costs.tp_block_us, rt_costs.pipeline_action_us) > 0
    assert spec.world_size == 4


def test_runtime_paths_fit_recovers_costs() -> None:
    """runtime/paths.py: the fixed costs that generated the paths' residuals come back from the fit, with the
    occurrences the cost model counts for each path."""
    from lightning_autopar.runtime.paths import FIELDS, PathTiming, fit_costs, occurrences, path_plans, tiny_spec

    cluster = load_cluster_spec("cpu", devices_per_node=4)
    truth = {"step_us": 5000.0, "microbatch_us": 2000.0, "fsdp_unit_us": 3000.0, "tp_block_us": 15000.0,
             "pipeline_action_us": 500.0}  # step_us is shared by every path: the fit's free term is it
    names = [name for name, _ in path_plans(4)]
    assert names == ["ddp", "accumulation", "fsdp", "tp", "pipeline"] and len(path_plans(3)) == 3
    timings = []
    for name, plan in path_plans(4):
        occ = occurrences(cluster, tiny_spec(), plan, 16)
        extra = sum(occ[f] * truth[f] for f in FIELDS)
        timings.append(PathTiming(name, plan.to_dict(), 0.01 + extra - 0.004, 0.01, occ))  # tiny model overpriced
    assert occurrences(cluster, tiny_spec(), path_plans(4)[1][1], 16)["microbatch_us"] == pytest.approx(4e-6)
    fitted = fit_costs(timings)
    for name, value in truth.items():
        # the tiny model overpriced by 4 ms a step: indistinguishable from less step work (5 - 4 ms)
        assert getattr(fitted, name) == pytest.approx(1000.0 if name == "step_us" else value, rel=1e-3)
    assert fitted.source.startswith("runtime paths")


def test_cluster_costs_cache_round_trip(tmp_path) -> None:
    costs = RuntimeCosts(fsdp_unit_us=12.0, source="runtime paths test")
    assert rt.load_cluster_costs("abc", tmp_path) is None
    rt.save_cluster_costs("abc", costs, [{"name": "ddp"}], tmp_path)
    assert rt.load_cluster_costs("abc", tmp_path) == costs
    (rt.profile_folder("abc", None, tmp_path) / rt.COSTS_FILE).write_text("{broken")
    assert rt.load_cluster_costs("abc", tmp_path) is None
