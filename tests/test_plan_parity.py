"""One plan space (issue 15): for the same model, cluster file and batch, ``autopar plan`` and the live strategy
(``Trainer(strategy="autopar")``, nothing fixed) choose the same plan, because the runtime applies every plan kind
the planner searches (``runtime.planning.RUNTIME_SUPPORT`` keeps only what the backend lacks). One world-4 launch
(tests/dist/parity_scenarios.py); the CLI is asked with the spec the strategy analysed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import run_scenarios

SCENARIOS = ["long_context", "roomy"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = run_scenarios(tmp_path_factory, 4, SCENARIOS, script="parity_scenarios.py")
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in SCENARIOS}


def cli_best(live: dict, tmp_path) -> dict:
    spec_file = tmp_path / "model.yaml"
    spec_file.write_text(yaml.safe_dump(live["spec"]))
    cmd = [sys.executable, "-m", "lightning_autopar.cli", "plan", "--model", str(spec_file), "--cluster",
           live["cluster"], "--nodes", "1", "--devices-per-node", "4", "--global-batch", str(live["global_batch"]),
           "--seq-len", str(live["seq_len"]), "--precision", "fp32", "--json", "--no-explain"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["best"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_cli_and_live_strategy_choose_the_same_plan(launched, name, tmp_path):
    live = launched[name]
    assert "error" not in live, live.get("error")
    # nothing excluded but expert parallelism, which a dense model has no layers for (the planner's ep=1 too)
    assert set(live["excluded"]) <= {"ep"}, live["excluded"]
    best = cli_best(live, tmp_path)
    plan = {k: best[k] for k in live["plan"]}
    assert plan == live["plan"]
    assert best["step_time_s"] == pytest.approx(live["predicted"], rel=1e-6)
    assert live["loss"] == live["loss"]  # the chosen plan trained (finite loss)


def test_the_long_context_plan_needs_what_the_runtime_used_to_lack(launched):
    """The memory-bound scenario is only meaningful if its plan uses sequence or context parallelism."""
    plan = launched["long_context"]["plan"]
    assert plan["sp"] or plan["cp"] > 1, plan
