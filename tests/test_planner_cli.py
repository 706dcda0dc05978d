"""`autopar plan`: JSON contract, table, PNG report, and the exit codes 2 / 3 with one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_autopar.cli import main

TINY = ["plan", "--model", "gpt-tiny", "--cluster", "cpu", "--global-batch", "8", "--precision", "fp32"]
PLAN_KEYS = {"dp", "zero", "dp_shard", "tp", "sp", "pp", "schedule", "vpp", "ep", "cp", "mbs", "grad_accum",
             "recompute", "precision", "step_time_s", "tokens_per_s", "model_tflops_per_device", "mfu",
             "memory_gib_per_device", "breakdown", "feasible"}


def test_json_contract(capsys: pytest.CaptureFixture) -> None:
    assert main(TINY + ["--json", "--top", "3"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # exactly one object
    assert set(data) == {"best", "candidates", "evaluated", "feasible", "search_seconds", "step_time_source",
                         "step_time_note"}  # the source labels: issue 30
    assert data["step_time_source"] == "preset (uncalibrated)"
    assert PLAN_KEYS <= set(data["best"]) and len(data["candidates"]) == 3
    assert set(data["best"]["breakdown"]) == {"compute_s", "recompute_s", "comm_exposed_s", "bubble_s"}
    assert data["candidates"][0] == data["best"] and data["evaluated"] >= data["feasible"] > 0


def test_table_and_png(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    png = tmp_path / "out" / "plan.png"
    assert main(TINY + ["--nodes", "1", "--devices-per-node", "4", "--report", str(png)]) == 0
    out = capsys.readouterr().out
    assert "winner" in out and "runner-up" in out and "evaluated" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(png.parent) == ["plan.png"]  # the temp file was renamed, nothing left behind


@pytest.mark.parametrize("extra,field", [
    (["--fix", "tp=3"], "fix.tp"),
    (["--fix", "schedule=zigzag"], "fix.schedule"),
    (["--memory-fraction", "1.5"], "memory_fraction"),
    (["--global-batch", "0"], "--global-batch"),
])
def test_bad_input_exits_2(capsys: pytest.CaptureFixture, extra: list[str], field: str) -> None:
    assert main(TINY + extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err


def test_bad_model_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--model", "no-such-model", "--cluster", "cpu", "--global-batch", "8"]) == 2
    assert "gpt-tiny" in capsys.readouterr().err  # names the presets to choose from


def test_infeasible_exits_3(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", "gpt3-175b", "--cluster", "a100-80g-dgx", "--global-batch", "8"]
    assert main(args) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "smallest memory any plan needs" in err and "relax" in err


def test_fixed_plan_that_does_not_fit_is_priced(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", "gpt3-175b", "--cluster", "a100-80g-dgx", "--global-batch", "8",
            "--fix", "dp=8,zero=0,mbs=1", "--json"]
    assert main(args) == 3
    captured = capsys.readouterr()
    best = json.loads(captured.out)["best"]
    assert best["feasible"] is False and best["reason"].startswith("memory") and best["step_time_s"] > 0
    assert len(captured.err.strip().splitlines()) == 1


def test_module_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "lightning_autopar.cli", *TINY, "--json", "--no-explain"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["best"]["precision"] == "fp32"
