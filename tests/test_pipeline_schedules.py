"""Zero-bubble and DualPipe schedules (issue 15): the runtime trains exactly like the single-process loop, a
forced plan torch cannot run is refused in one line, and the planner prices their bubble and in-flight
activations (hand-computed values) and picks a zero-bubble schedule when the bubble matters.

Scenarios (tests/dist/schedule_scenarios.py) run under torchrun, one launch per world size; per-step losses and
final parameters are compared with the plain single-process loop on the same model (fp32) within LOSS_RTOL /
PARAM_RTOL + PARAM_ATOL of tests/test_strategy.py (1e-5 relative).
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_scenarios
from common import make_data, make_module, reference_run
from schedule_scenarios import REFUSED, SCENARIOS
from test_strategy import assert_equivalent, load

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.pipeline.partition import stage_owners
from lightning_autopar.planner import cost as C
from lightning_autopar.planner.search import estimate, plan
from lightning_autopar.planner.space import enumerate_space
from lightning_autopar.specs import SCHEDULES, load_cluster_spec, load_model_spec

WORLD2 = ["pp2_zbv", "pp2_zbv_ga2", "pp2_izb", "pp2_dualpipev", "pp2_moe_zbv", "pp2_moe_dualpipev",
          "dualpipev_refused", "izb_refused", "zbv_recompute_refused", "zbv_validation"]
WORLD4 = ["pp2_dp2_izb_zero1", "pp2_dp2_izb_zero3", "pp2_dp2_zbv_zero3", "pp2_tp2_zbv", "pp2_tp2_sp_dualpipev_mbs1"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, WORLD2, script="schedule_scenarios.py")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, WORLD4, script="schedule_scenarios.py")


_REFERENCE: dict = {}


def reference(name: str = "pp2_zbv", steps: int = 8):
    """The single-process run of scenario ``name``'s model; an MoE balance loss is per micro-batch, so an MoE
    reference runs the same micro-batches (tests/dist/common.reference_run)."""
    model = SCENARIOS[name][1]
    micro = int(dict(kv.split("=") for kv in SCENARIOS[name][0].split(","))["grad_accum"]) if "experts" in model else 1
    key = (tuple(sorted(model.items())), steps, micro)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_run(steps=steps, micro_batches=micro, **model)
    return _REFERENCE[key]


def _check_plan(result, fix: str) -> None:
    want = dict(kv.split("=") for kv in fix.split(","))
    got = result["plan"]
    assert (got["schedule"], got["pp"], got["vpp"]) == (want["schedule"], 2, 2)


@pytest.mark.parametrize("name", [n for n in WORLD2 if n in SCENARIOS])
def test_world2_matches_single_process(world2, name):
    result = load(world2, name)
    _check_plan(result, SCENARIOS[name][0])
    assert_equivalent(result, *reference(name))


@pytest.mark.parametrize("name", WORLD4)
def test_world4_matches_single_process(world4, name):
    result = load(world4, name)
    _check_plan(result, SCENARIOS[name][0])
    assert_equivalent(result, *reference())


@pytest.mark.parametrize("name, field", [("dualpipev_refused", "fix.grad_accum"), ("izb_refused", "fix.grad_accum"),
                                         ("zbv_recompute_refused", "fix.recompute")])
def test_forced_plan_torch_cannot_run_is_one_line(world2, name, field):
    error = load(world2, name)["error"]
    assert error is not None and error.startswith(field) and "\n" not in error
    assert REFUSED[name][0].split("schedule=")[1].split(",")[0] in error


def test_zbv_validation_reaches_every_rank(world2):
    """The V puts the last chunk on rank 0: the forward-only pass walks the chunks in stage order and the
    val_loss is broadcast from rank 0; it equals the single-device model's mean loss on the validation batches."""
    result = load(world2, "zbv_validation")
    _, state = reference(steps=2)
    module = make_module(**SCENARIOS["pp2_zbv"][1])
    module.load_state_dict(state)
    data = make_data()
    n = len(data) // 8
    with torch.no_grad():
        expected = sum(module.loss(data[i * 8:(i + 1) * 8]).item() for i in range(n)) / n
    assert len(set(result["val_losses"])) == 1
    assert result["val_losses"][0] == pytest.approx(expected, rel=1e-5)


# ============================================================================================ placement, space


def test_v_placement_is_torchs():
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    assert stage_owners(2, 4, "zbv") == [0, 1, 1, 0]
    assert stage_owners(4, 8, "dualpipev") == list(generate_stage_to_rank_mapping(4, 8, style="v").values())
    assert stage_owners(2, 4, "interleaved-zb") == [0, 1, 0, 1]


def test_space_enumerates_the_new_schedules_with_their_rules():
    spec = load_model_spec("gpt-tiny")  # 4 layers
    space = enumerate_space(spec, 4, 8, 64, ["fp32"])
    sched, vpp, pp, ga = (space.column(n) for n in ("schedule", "vpp", "pp", "ga"))
    code = {s: SCHEDULES.index(s) for s in SCHEDULES}
    for s in ("zbv", "dualpipev"):
        rows = sched == code[s]
        assert rows.any() and set(vpp[rows]) == {2} and set(pp[rows]) == {2}  # layers % (2*pp): pp=4 cannot
    assert (ga[sched == code["dualpipev"]] >= 4).all()  # micro-batches >= 2*pp stages
    izb = sched == code["interleaved-zb"]
    assert izb.any() and (vpp[izb] >= 2).all() and (ga[izb] % pp[izb] == 0).all()


@pytest.mark.parametrize("fix, field", [
    ("pp=2,schedule=dualpipev,grad_accum=2", "fix.grad_accum"), ("pp=2,schedule=zbv,vpp=4", "fix.vpp"),
    ("pp=2,schedule=1f1b,vpp=2", "fix.vpp"), ("pp=4,schedule=zbv", "fix.vpp"),
    ("pp=2,schedule=zbv,recompute=full", "fix.recompute"), ("pp=2,schedule=dualpipev,compile=true", "fix.compile"),
])
def test_forced_invalid_schedule_is_one_config_error(fix, field):
    with pytest.raises(ConfigError) as err:
        plan("gpt-tiny", load_cluster_spec("cpu", devices_per_node=4), global_batch=8, fix=fix)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


# ============================================================================================ pricing


def test_bubble_formulas_hand_computed():
    # F : B(input) : W = 1 : 1 : 1 of a micro-batch's F+B+W (C.WGRAD_SHARE = 1/3), p = 4, m = 8
    assert C.bubble_fraction(4, 8, 1, SCHEDULES.index("1f1b")) == pytest.approx(3 / 8)
    assert C.bubble_fraction(4, 8, 2, SCHEDULES.index("interleaved")) == pytest.approx(3 / 16)
    # ZB-H1 / ZB1P: (p-1)(F+B-2W) over m(F+B) = 3 * (1/3) / 8, then / vpp
    assert C.bubble_fraction(4, 8, 2, SCHEDULES.index("interleaved-zb")) == pytest.approx(1 / 16)
    # ZBV: zero at m >= 2p-1; below, torch pads to 2p-1 micro-batch slots: (7 - 4) / 4
    assert C.bubble_fraction(4, 8, 2, SCHEDULES.index("zbv")) == pytest.approx(0.0)
    assert C.bubble_fraction(4, 4, 2, SCHEDULES.index("zbv")) == pytest.approx(3 / 4)
    # DualPipeV: (2p/2-1)(F&B+B-3W) in chunk units over m(F+B) of a rank (2 chunks): (p-1)(1/3+4/3-1)/(2m)
    assert C.bubble_fraction(4, 8, 2, SCHEDULES.index("dualpipev")) == pytest.approx(3 * (2 / 3) / 16)


def test_inflight_activations_hand_computed():
    code = SCHEDULES.index
    # rank 0 of p=4, m=8: 1F1B 4 stage sets; ZBV as 1F1B (every rank: p); DualPipeV (2p+1) chunk sets = p + 1/2
    assert C.inflight_microbatches(code("1f1b"), 4, 1, 8, 0) == 4
    assert C.inflight_microbatches(code("zbv"), 4, 2, 8, 3) == 4
    assert C.inflight_microbatches(code("dualpipev"), 4, 2, 8, 0) == pytest.approx(4.5)
    # interleaved zero bubble keeps interleaved 1F1B's memory: (min(2(p-1)+(v-1)p, mv)+1)/v = (6+4+1)/2
    assert C.inflight_microbatches(code("interleaved-zb"), 4, 2, 8, 0) == pytest.approx(5.5)
    assert C.inflight_microbatches(code("interleaved-zb"), 4, 2, 8, 0) == \
        C.inflight_microbatches(code("interleaved"), 4, 2, 8, 0)


def test_planner_picks_zero_bubble_when_the_bubble_matters():
    """pp fixed at 4 with few micro-batches: the best plan runs a zero-bubble schedule, its predicted bubble
    below 1F1B's at the same degrees."""
    cluster = load_cluster_spec("a100-80g-dgx")
    report = plan("gpt3-6.7b", cluster, global_batch=16, precision="bf16-mixed", fix="pp=4,dp=2,mbs=1",
                  explain_choice=False)
    best = report.best
    assert best.plan.schedule in ("interleaved-zb", "zbv", "dualpipev")
    p = best.plan
    one_f = estimate("gpt3-6.7b", cluster, f"dp={p.dp},tp={p.tp},pp=4,mbs=1,precision=bf16-mixed,schedule=1f1b,"
                     f"zero={p.zero},recompute={p.recompute}", global_batch=16)
    assert best.breakdown.bubble_s < one_f.breakdown.bubble_s
    assert best.step_time_s < one_f.step_time_s


def test_v_placement_puts_the_head_with_the_embedding():
    """Priced stage contents follow the runtime's placement: in a V the last chunk (head) is on rank 0."""
    from lightning_autopar.planner.partition import stage_table

    spec = load_model_spec("gpt-tiny")
    weights = torch.ones(spec.layers).numpy()
    loop, _ = stage_table(spec, weights, 0.5, 2.0, 2, 2, uneven=False)
    vee, _ = stage_table(spec, weights, 0.5, 2.0, 2, 2, uneven=False, v_shape=True)
    # rows: first rank, last rank, middle; columns [n_dense, n_moe, has_emb, has_head, rank]
    assert (loop[0, 2], loop[0, 3], loop[1, 3]) == (1, 0, 1)
    assert (vee[0, 2], vee[0, 3], vee[1, 3]) == (1, 1, 0)
    assert vee[0, 0] == vee[1, 0] == 2  # two one-block chunks per rank either way


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_unit_form_excludes_the_multi_chunk_schedules(schedule):
    """The traced pipeline holds one contiguous run of units per rank: forced, refused in one line; searched,
    never offered (space.unit_form_restrict, with the reason)."""
    spec = load_model_spec("resnet152")
    cluster = load_cluster_spec("a100-80g-dgx")
    with pytest.raises(ConfigError) as err:
        plan(spec, cluster, global_batch=256, fix=f"pp=2,schedule={schedule}")
    assert err.value.field == "fix.schedule" and "\n" not in str(err.value)
    report = plan(spec, cluster, global_batch=256, fix="pp=2", explain_choice=False, top=500)
    assert {c.plan.schedule for c in report.candidates} <= {"gpipe", "1f1b"}
