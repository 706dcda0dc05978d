"""The planner prices offload (issue 17): the space, each cost term on hand cases, the search on a Llama-3-8B-like
model on 8 x H100, the host memory limit, the CPU preset, the "no plan fits" line and the memory panel."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from lightning_autopar.cli import main
from lightning_autopar.errors import ConfigError, InfeasibleError
from lightning_autopar.planner import cost as C
from lightning_autopar.planner.search import estimate, plan
from lightning_autopar.planner.space import enumerate_space
from lightning_autopar.specs import OFFLOAD_MODES, load_cluster_spec, load_model_spec

GIB = 2.0**30
H100 = "h100-96g-500w"
LLAMA = dict(global_batch=16, seq_len=8192)
SMALL = 0.18  # memory fraction of 89.4 GiB (~16.1 GiB): no zero-3 plan without offload fits, offload=params does
ZERO3_PLAN = "dp=8,zero=3,mbs=2,grad_accum=1,recompute=full,precision=bf16-mixed"


def host(link_gbs: float = 50.0, host_bw_gbs: float = 76.8) -> C.Hardware:
    """The H100 preset's Hardware with the given host link and host DRAM bandwidth."""
    hw = C.Hardware.from_cluster(load_cluster_spec(H100))
    return dataclasses.replace(hw, host_link=link_gbs * 1e9, host_bw=host_bw_gbs * 1e9)


def with_host_memory(gib: float):
    spec = load_cluster_spec(H100)
    return dataclasses.replace(spec, device=dataclasses.replace(spec.device, host_memory_gib=gib))


# ============================================================================================ cost terms


def test_offloaded_state_bytes_by_mode() -> None:
    P, N, off = 8e9, 8, np.array([0, 1, 2])
    w, g, o = 2 * P / N, 2 * P / N, 12 * P / N  # bf16-mixed zero 3: every part is this rank's shard
    mw, mg, mo = C.offloaded_state_bytes(w, g, o, 0.0, 3, off)
    assert list(mw) == [0, 0, w] and list(mg) == [0, 0, g] and list(mo) == [0, o, o]
    # zero 1/2 keep the gathered parameters 2P; what moves is FSDP2's shard copy beside them, 2P/N
    mw, _, _ = C.offloaded_state_bytes(2 * P + 2 * P / N, g, o, 2 * P / N, 2, off)
    assert list(mw) == [0, 0, 2 * P / N]


def test_offload_copy_time_by_formula() -> None:
    local, off = 1e9, np.array([0, 1, 2])
    gather, reduce, step = C.offload_copy_time(host(50.0), local, 1, off)
    assert np.allclose(gather, [0, 0, 2e9 / 50e9])  # w = 2 B per param in, per all-gather (params)
    assert np.allclose(reduce, [0, 4e9 / 50e9, 4e9 / 50e9])  # fp32 gradient shard out, per reduction
    assert np.allclose(step, [0, 2e9 / 50e9, 0])  # updated parameters back once per step (optimizer)
    assert all(np.all(t == 0) for t in C.offload_copy_time(host(0.0), local, 1, off))  # no separate host


def test_host_optimizer_step_time_by_formula() -> None:
    local = 1e9
    # bf16-mixed: Adam 7 x 4 B + half copy 2 + 2 + grad norm and clip 12 = 44 B per param, at the host's DRAM rate
    hw = host(host_bw_gbs=76.8)
    # + the six foreach calls' fixed cost, as on the device
    assert C.host_optimizer_step_time(hw, local, np.array(1)) == pytest.approx(44e9 / 76.8e9 + 6 * hw.overhead_s)
    hw = host(host_bw_gbs=0.0)  # no host DRAM figure: the device is the host
    assert C.host_optimizer_step_time(hw, local, np.array(1)) == pytest.approx(C.optimizer_time(hw, local, np.array(1)))


def test_presets_name_the_host() -> None:
    for name, link in (("a100-80g-dgx", 25.0), ("h100-sxm-dgx", 50.0), ("h200-sxm-dgx", 50.0), (H100, 50.0)):
        dev = load_cluster_spec(name).device
        assert dev.host_link_gbs == link and dev.host_memory_gib > 200 and dev.host_memory_bandwidth_gbs > 50
    cpu = load_cluster_spec("cpu").device
    assert cpu.host_link_gbs == cpu.host_memory_gib == cpu.host_memory_bandwidth_gbs == 0


def test_estimate_moves_states_to_the_host() -> None:
    got = {o: estimate("llama3-8b", H100, f"{ZERO3_PLAN},offload={o}", **LLAMA) for o in OFFLOAD_MODES}
    none, opt, par = got["none"], got["optimizer"], got["params"]
    # host: the 12 B/param states (bf16-mixed: m, v, fp32 master) + the host step's fp32 gradient copy (4 B)
    assert opt.memory_breakdown["optimizer"] == 0 and opt.host_gib_per_device == pytest.approx(
        none.memory_breakdown["optimizer"] * (12 + 4) / 12, rel=1e-6)
    assert par.memory_breakdown["parameters"] == par.memory_breakdown["gradients"] == 0
    moved = sum(none.memory_breakdown[k] for k in ("parameters", "gradients", "optimizer"))
    assert par.host_gib_per_device == pytest.approx(moved, rel=1e-6)
    for p in got.values():  # the breakdown still sums to the device memory
        assert sum(p.memory_breakdown.values()) == pytest.approx(p.memory_gib_per_device, rel=1e-5)
    assert none.memory_gib_per_device - par.memory_gib_per_device == pytest.approx(moved, rel=1e-4)
    assert par.step_time_s > none.step_time_s and opt.step_time_s > none.step_time_s  # the host step is slower
    assert "host_gib_per_device" in par.to_dict() and "host_gib_per_device" not in none.to_dict()


# ============================================================================================ space and search


def test_space_searches_offload_only_with_a_host_and_zero() -> None:
    spec = load_model_spec("llama3-8b")
    base = enumerate_space(spec, 8, 16, 8192, ["bf16-mixed"], host_offload=False)
    space = enumerate_space(spec, 8, 16, 8192, ["bf16-mixed"], host_offload=True)
    off, zero = space.column("offload"), space.column("zero")
    assert set(np.unique(off)) == {0, 1, 2} and not np.any((off > 0) & (zero == 0))
    assert not np.any(base.column("offload")) and base.size < space.size <= 3 * base.size
    assert space.plan(int(np.flatnonzero(off == 2)[0])).offload == "params"
    with pytest.raises(ConfigError) as err:
        enumerate_space(spec, 8, 16, 8192, ["bf16-mixed"], fix={"offload": "params", "zero": 0})
    assert str(err.value).startswith("fix.offload")


def test_offload_found_when_nothing_else_fits() -> None:
    with pytest.raises(InfeasibleError):
        plan("llama3-8b", H100, **LLAMA, fix="zero=3", memory_fraction=SMALL, restrict={"offload": ["none"]},
             explain_choice=False)
    report = plan("llama3-8b", H100, **LLAMA, fix="zero=3", memory_fraction=SMALL, explain_choice=False)
    best = report.best
    assert best.feasible and best.plan.offload != "none" and best.host_gib_per_device > 0
    assert f"offload={best.plan.offload}" in best.plan.short()
    assert json.loads(json.dumps(report.to_json_dict()))["best"]["host_gib_per_device"] > 0
    ample = plan("llama3-8b", H100, **LLAMA, fix="zero=3", explain_choice=False)
    assert ample.best.plan.offload == "none"  # offload is slower: not picked when memory is ample
    assert estimate("llama3-8b", H100, dataclasses.replace(ample.best.plan, offload="params"),
                    **LLAMA).step_time_s > ample.best.step_time_s


def test_host_memory_limit_refuses_offload() -> None:
    small_host = with_host_memory(4.0)
    p = estimate("llama3-8b", small_host, f"{ZERO3_PLAN},offload=params", **LLAMA)
    assert not p.feasible and "host memory" in p.reason and "host_memory_gib" in p.reason
    with pytest.raises(InfeasibleError, match="host memory"):
        plan("llama3-8b", small_host, **LLAMA, fix="zero=3", memory_fraction=SMALL, explain_choice=False)


def test_cpu_preset_does_not_search_offload_but_prices_a_fixed_one() -> None:
    report = plan("gpt-tiny", "cpu", global_batch=8, precision="fp32", top=50, explain_choice=False)
    assert all(c.plan.offload == "none" for c in report.candidates)
    fixed = "dp=2,zero=3,mbs=4,grad_accum=1"
    none = estimate("gpt-tiny", "cpu", fixed, global_batch=8)
    par = estimate("gpt-tiny", "cpu", fixed + ",offload=params", global_batch=8)
    assert par.plan.offload == "params" and par.host_gib_per_device == 0
    assert par.memory_gib_per_device == pytest.approx(none.memory_gib_per_device)  # nothing is saved on a CPU
    assert par.step_time_s == pytest.approx(none.step_time_s)
    got = plan("gpt-tiny", "cpu", global_batch=8, fix="offload=params,zero=3", explain_choice=False)
    assert all(c.plan.offload == "params" and c.plan.zero == 3 for c in got.candidates)


# ============================================================================================ report and CLI


def test_infeasible_line_names_the_smallest_plan() -> None:
    with pytest.raises(InfeasibleError) as err:
        plan("llama3-8b", H100, **LLAMA, memory_fraction=0.02, explain_choice=False)
    line = str(err.value)
    assert "\n" not in line and "offload=params" in line and "rc=" in line and "on the host" in line
    assert "relax:" in line and "more devices" in line


def test_cli_fixed_plan_line_names_smallest(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", "llama3-8b", "--cluster", H100, "--global-batch", "16", "--seq-len", "8192",
            "--fix", "zero=3,offload=none", "--memory-fraction", "0.1", "--json", "--no-explain"]
    assert main(args) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "with dp=" in err and "rc=" in err and "unpin offload, zero (--fix)" in err


def test_png_draws_memory_of_winner_and_smallest(tmp_path: Path) -> None:
    report = plan("llama3-8b", H100, **LLAMA, fix="zero=3", memory_fraction=0.3, explain_choice=False)
    bars = report.memory_bars()
    assert list(bars) == ["#1 (winner)", "smallest"]
    win, small = bars["#1 (winner)"], bars["smallest"]
    assert sum(v for k, v in win.items() if k != "host") == pytest.approx(report.best.memory_gib_per_device, rel=1e-5)
    assert small["host"] == pytest.approx(report.smallest.host_gib_per_device) and small["host"] > 0
    assert sum(v for k, v in small.items() if k != "host") < sum(v for k, v in win.items() if k != "host")
    png = report.save_png(tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == ["plan.png"]


def test_host_step_copy_bytes_by_formula() -> None:
    """offload=optimizer's host step works on copies: the fp32 gradient shard, and the parameter shard where the
    plan is fp32 (mixed precision: that copy is the fp32 master in OPTIM_BYTES)."""
    local = np.array([1e6, 1e6, 1e6])
    offload = np.array([1, 1, 2])
    w, g = C.host_step_copy_bytes(local, np.array([0, 1, 0]), offload)
    assert list(w) == [4e6, 0.0, 0.0] and list(g) == [4e6, 4e6, 0.0]
