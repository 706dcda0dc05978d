"""The set-up stages (runtime/setup.py, runtime/measure.py) on their own: a tiny GPT in a plain nn.Module (no
Lightning, no strategy), one process, each stage's typed output checked; the measure stage's trial and the apply
stage on a world-1 gloo group. At world 4 (tests/dist/scenarios.py set_up_once): rank 0 alone analyses, checks and
plans, every rank holding the same findings."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import run_scenarios  # tests/conftest.py
from lightning_autopar.errors import ConfigError
from lightning_autopar.models import GPT, GPTConfig
from lightning_autopar.models.gpt import lm_loss
from lightning_autopar.parallel.capabilities import Capabilities
from lightning_autopar.runtime.measure import Measured, choose, measure, trial_refusal
from lightning_autopar.runtime.setup import (Analysed, Capable, Live, Planned, PlanOn, SetUp, SetupOptions,
                                             Workload, analyse_model, apply_setup, batch_geometry, find_capabilities,
                                             plain_data, plan_model)
from lightning_autopar.runtime.trial import SetupOutcome, SetupSettings
from lightning_autopar.specs import Plan, load_cluster_spec

ROWS, SEQ = 4, 16


class TinyLM(nn.Module):
    """What a trial and the step runtime call: training_step and configure_optimizers, no Lightning."""

    automatic_optimization = True

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab=64, seq_len=SEQ, layers=2, hidden=32, heads=4))

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        return lm_loss(self.model(idx), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batch():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (ROWS, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _work(module: nn.Module, **kw) -> Workload:
    return Workload(module, first_batch=_batch(), loader_batch_size=ROWS, **kw)


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _planned(module: nn.Module, options: SetupOptions) -> tuple[Analysed, Capable, Planned]:
    work = _work(module)
    analysed = analyse_model(work, lambda: pytest.fail("a transformer needs no model call"), None, 1)
    capable = find_capabilities(module, analysed.model, analysed.analysis, analysed.example, options)
    planned = plan_model(analysed, capable, load_cluster_spec("cpu", nodes=1, devices_per_node=1), "32-true", options)
    return analysed, capable, planned


def test_analyse_capabilities_and_plan_stages():
    module = TinyLM()
    options = SetupOptions(restrict={"zero": [0]}, settings=SetupSettings(trials=0, profile=False))
    analysed, capable, planned = _planned(module, options)

    assert isinstance(analysed, Analysed) and not analysed.unit_form and analysed.example is None
    assert analysed.model is module.model  # the transformer the plan applies to
    assert (analysed.global_batch, analysed.seq_len, analysed.analysis.spec.seq_len) == (ROWS, SEQ, SEQ)

    assert isinstance(capable, Capable) and isinstance(capable.capabilities, Capabilities)
    assert capable.restrict["zero"] == [0]  # the user's restrict comes last
    assert capable.excluded is capable.capabilities.excluded

    assert isinstance(planned, Planned) and isinstance(planned.plan_on, PlanOn)
    report = planned.report
    assert (report.global_batch, report.seq_len, planned.plan_on.precision) == (ROWS, SEQ, "fp32")
    assert report.best.plan.dp == 1 and report.best.plan.zero == 0
    again = planned.plan_on(report.cluster)  # what the measure stage calls on each changed cluster
    assert again.best.plan == report.best.plan


def test_geometry_of_a_unit_form_model_and_of_no_batch():
    work = _work(TinyLM())
    assert batch_geometry(work, None, 2, unit_form=True, transformer_seq=None) == (ROWS, 1)
    assert batch_geometry(work, 8, 2, unit_form=False, transformer_seq=32) == (8, SEQ)
    assert batch_geometry(Workload(TinyLM()), None, 2, unit_form=False, transformer_seq=32) == (2, 32)


def test_measure_stage_without_profile_or_trials_keeps_the_first_planning():
    module = TinyLM()
    options = SetupOptions(settings=SetupSettings(trials=0, profile=False, profile_cache=False))
    analysed, _, planned = _planned(module, options)
    measured = measure(planned, analysed, _work(module), Live(), options.settings)
    assert isinstance(measured, Measured) and isinstance(measured.outcome, SetupOutcome)
    assert measured.report is planned.report and measured.report.trials == [] and measured.report.profile is None
    assert measured.outcome.skipped == "profile=False" and measured.outcome.trials_run == 0
    assert measured.outcome.plan_s >= 0


def test_trial_refusal_and_choice():
    module = TinyLM()
    assert trial_refusal(_work(module)) == ""
    assert trial_refusal(_work(module, planned_steps=0)) == "not training"
    assert trial_refusal(Workload(module)).startswith("no batch to run on")
    assert "no training_step" in trial_refusal(_work(nn.Linear(2, 2)))
    _, _, planned = _planned(module, SetupOptions(top=3))
    report = planned.report
    last = report.candidates[-1]
    choose(report, last.plan, fresh=False)
    assert report.best is last and report.candidates[0] is last
    choose(report, Plan(dp=1, mbs=1, grad_accum=4), fresh=False)  # a cached choice no longer a candidate: kept
    assert report.best is last


def test_measure_trial_then_apply_on_one_process(single_process_group, monkeypatch):
    """Two trials, each on a copy of the model, read the set-up's analysis: no trial traces the model again."""
    from lightning_autopar.profile import analyze

    module = TinyLM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    options = SetupOptions(settings=SetupSettings(trials=2, profile=False, profile_cache=False))
    analysed, capable, planned = _planned(module, options)
    work, live = _work(module), Live()
    traced = []
    monkeypatch.setattr(analyze, "analyze", lambda *a, **k: traced.append(a) or pytest.fail("analysed again"))
    measured = measure(planned, analysed, work, live, options.settings)
    outcome, report = measured.outcome, measured.report
    assert outcome.trials_run == 2 and len(report.trials) == 2 and not any(t.error for t in report.trials)
    assert traced == []
    assert report.trials[0].measured_s > 0 and Plan(**report.trials[0].plan) == report.best.plan
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # a trial leaves no state

    set_up = apply_setup(report.best.plan, analysed, capable, report.best.layers_per_stage, work, live, options)
    assert isinstance(set_up, SetUp) and set_up.model is analysed.model
    assert module._device_mesh is set_up.layout.mesh and set_up.steps.pipe is None
    assert set_up.env.group.rank_and_size() == (0, 1) and set_up.env.fsdp_roots == set_up.applied.fsdp_roots


class SyncedLM(TinyLM):
    """A model whose MLP sums its activations over the processes itself (the kind of all_reduce the seed's article
    found left in a forward)."""

    def __init__(self) -> None:
        super().__init__()
        mlp = self.model.blocks[0].mlp
        forward = mlp.forward

        def synced(x):
            out = forward(x)
            torch.distributed.all_reduce(out)
            return out

        mlp.forward = synced


def test_a_collective_in_the_forward_is_seen_reported_and_restricts_the_plan():
    """Issue 26: the user's own torch.distributed call in forward is seen by the meta trace (it does not run: no
    process group is needed), named in one line with the module calling it, and the plan keeps to data
    parallelism (the default group is then the data-parallel replicas); one warning."""
    module = SyncedLM()
    with pytest.warns(UserWarning, match=r"calls torch\.distributed\.all_reduce in 'blocks\.0\.mlp' itself"):
        analysed, capable, planned = _planned(module, SetupOptions(settings=SetupSettings(trials=0, profile=False)))
    assert analysed.analysis.collectives == ["torch.distributed.all_reduce in 'blocks.0.mlp'"]
    for field in ("tp", "pp", "cp"):
        assert capable.restrict[field] == [1]
        assert "torch.distributed.all_reduce in 'blocks.0.mlp'" in capable.capabilities.excluded[field]
    assert "\n" not in capable.capabilities.excluded["tp"]
    assert not _planned(TinyLM(), SetupOptions())[0].analysis.collectives


class TinyCNN(nn.Module):
    """A model in unit form (no transformer blocks): four convolution units a pipeline could cut between."""

    automatic_optimization = True

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU()) for _ in range(4)])

    def training_step(self, batch, batch_idx):
        return self.net(batch).square().mean()


@pytest.mark.parametrize("fix, world, traced, checked", [
    ({}, 4, True, [2, 4]),  # the planner's own plan: every degree of the world
    ({"pp": 2}, 4, True, [2]),
    ({"dp": 2}, 4, True, [2]),  # unit form keeps tp = cp = 1: pp = world / dp
    ({"dp": 4, "zero": 3}, 4, False, []),  # no pp > 1 left: no torch.export of the model
    ({}, 1, False, []),
])
def test_unit_form_traces_a_pipeline_only_for_the_degrees_a_fix_leaves(monkeypatch, fix, world, traced, checked):
    import lightning_autopar.parallel.pipeline as pipeline
    from lightning_autopar.profile.units import find_model_call

    calls = []
    real = pipeline.split_refusals
    monkeypatch.setattr(pipeline, "split_refusals", lambda *a, **k: calls.append(1) or real(*a, **k))
    module = TinyCNN()
    batch = torch.randn(2, 3, 8, 8)
    work = Workload(module, first_batch=batch, loader_batch_size=8)
    analysed = analyse_model(work, lambda: find_model_call(module, lambda: module.training_step(batch, 0)), None,
                             world)
    assert analysed.unit_form and len(analysed.analysis.blocks) == 4
    capable = find_capabilities(module, analysed.model, analysed.analysis, analysed.example,
                                SetupOptions(fix=fix), world_size=world)
    assert calls == ([1] if traced else [])
    outcomes = capable.capabilities._checks
    assert sorted(pp for (kind, (pp, _)) in outcomes if kind == "unit pp") == checked
    assert all(outcome is None for outcome in outcomes.values())  # a plain stack of units splits anywhere


@pytest.fixture(scope="module")
def set_up_world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, ["set_up_once"])


def test_rank_0_alone_analyses_checks_and_plans_and_every_rank_holds_its_findings(set_up_world4):
    """Our GPT at tp=2 (its tp and SP checks) and at the planner's own plan, a U-Net in unit form at pp=2 (its
    pipeline trace): the analysis, the capabilities stage and the planner run once, on rank 0; ranks 1-3 hold
    equal analyses, plans, restrictions, reasons and facts (``Live.shared``)."""
    result = torch.load(set_up_world4 / "set_up_once.pt", weights_only=False)
    assert "crash" not in result, result.get("crash")
    analysed_by = {"gpt_tp2": "analyze", "gpt_auto": "analyze", "unet_pp2": "analyze_model"}
    for label, views in result["views"].items():
        assert views[0]["counts"] == {analysed_by[label]: 1, "find_capabilities": 1, "plan": 1}, label
        for rank, view in enumerate(views[1:], start=1):
            assert view["counts"] == {}, (label, rank)
            for key in ("analysis", "plan", "restrict", "excluded", "facts"):
                assert view[key] == views[0][key], (label, rank, key)
    assert result["views"]["gpt_tp2"][0]["plan"].tp == 2 and result["views"]["unet_pp2"][0]["plan"].pp == 2


def _broadcast_from(sent: list):
    """A two-rank broadcast seen from rank 1: returns what rank 0 sent."""
    return lambda value: sent[0]


def test_shared_gives_rank_0s_plain_data_and_falls_back_to_running_it_itself():
    """``Live.shared``: rank 0 runs ``make`` and sends its result pickled; another rank rebuilds it without
    running ``make``. A result holding a module or tensor, or a rank 0 that raised, is not sent (None): every rank
    runs ``make`` itself. One process runs it directly."""
    made = []

    def make():
        made.append(1)
        return {"plan": Plan(tp=2), "error": ConfigError("plan.tp", "tp=2 does not divide heads=3", "use tp=1")}

    sent: list = []
    value = Live(rank=0, world_size=2, broadcast=lambda v: sent.append(v) or v).shared(make)
    assert made == [1] and isinstance(sent[0], bytes)
    other = Live(rank=1, world_size=2, broadcast=_broadcast_from(sent)).shared(make)
    assert made == [1] and other["plan"] == value["plan"]
    assert type(other["error"]) is ConfigError and str(other["error"]) == str(value["error"])
    assert other["error"].field == "plan.tp" and other["error"].fix == "use tp=1"

    assert plain_data({"w": torch.ones(2)}) is None and plain_data([nn.Linear(2, 2)]) is None
    assert plain_data(lambda: 0) is None and pickle.loads(plain_data({"a": [1, "b"]})) == {"a": [1, "b"]}
    assert Live(rank=1, world_size=2, broadcast=_broadcast_from([None])).shared(make)["plan"] == Plan(tp=2)
    assert made == [1, 1]  # nothing sent: this rank ran it

    sent.clear()
    with pytest.raises(ConfigError):
        Live(rank=0, world_size=2, broadcast=lambda v: sent.append(v) or v).shared(
            lambda: (_ for _ in ()).throw(ConfigError("fix.tp", "bad")))
    assert sent == [None]
    assert Live().shared(lambda: 7) == 7


def test_trials_share_the_checks_and_not_the_last_copys_modules():
    """``SharedAnalysis.release_build`` after each trial: the record keeps its checks' outcomes and plain memos,
    not the memo holding the last build's modules (its copy of the model is freed with its trial)."""
    from lightning_autopar.runtime.trial import SharedAnalysis

    module = TinyLM()
    analysed, _, _ = _planned(module, SetupOptions())
    shared = SharedAnalysis()
    shared.seed(module, analysed.model, analysed.analysis)
    _, _, _, record = shared.analysed(module, _batch())
    record.memo("pipeline split", lambda: (module.model, analysed.analysis))
    record.memo("ties", lambda: [])
    record.record("pp", (2, 1), None)
    shared.release_build()
    kept = shared.capabilities
    assert kept is not record and "pipeline split" not in kept._memo and kept._memo["ties"] == []
    assert kept._checks == {("pp", (2, 1)): None}
    _, _, _, later = shared.analysed(module, _batch())
    assert later is not kept and later._checks == kept._checks
