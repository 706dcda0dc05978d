"""Ecosystem (issue 7), multi-process: the Fabric strategy and a Hugging Face Llama under the Trainer strategy
train exactly like the single-process loop (2 processes), and the Hydra app runs with Lightning's launcher."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import STEPS, reference_run
from conftest import DIST, ROOT, background_launch, check_launch, launch_environ, run_scenarios
from test_strategy import assert_equivalent

try:
    import transformers  # noqa: F401

    HAVE_HF = True
except ImportError:
    HAVE_HF = False

FABRIC = ["fabric_dp", "fabric_tp", "fabric_ddp", "fabric_ddp_accum", "fabric_model_first",
          "fabric_model_first_refused", "fabric_checkpoint_zero0", "fabric_checkpoint_zero3"]
WORLD4 = ["fabric_step_pp2"]  # issue 31's cell: Fabric's pipeline through the step call at 4 processes
SCENARIOS = FABRIC + (["hf_llama", "hf_llama_tp"] if HAVE_HF else [])


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, SCENARIOS, script="ecosystem_scenarios.py")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, WORLD4, script="ecosystem_scenarios.py")


def without_thread_env() -> dict[str, str]:
    """The environment a user's shell gives: no thread variable (the strategies pick each process's share)."""
    return {k: v for k, v in launch_environ().items() if k != "OMP_NUM_THREADS"}


def load(out: Path, name: str) -> dict:
    result = torch.load(out / f"{name}.pt", weights_only=False)
    assert "crash" not in result, result.get("crash")
    return result


@pytest.mark.parametrize("name, layout", [("fabric_dp", (2, 1, 3)), ("fabric_tp", (1, 2, 0)),
                                          ("fabric_ddp", (2, 1, 0))])
def test_fabric_matches_single_process(world2, reference, name, layout):
    result = load(world2, name)
    plan = result["plan"]
    assert (plan["dp"], plan["tp"], plan["zero"]) == layout and plan["grad_accum"] == 1
    assert_equivalent(result, *reference)


def test_fabric_pipeline_through_the_step_call(world4, reference):
    """``AutoParallelFabricStrategy(step_call=True)`` at 4 processes: the loop calls ``model.train_step(batch,
    loss_fn)`` on the global batch, which runs the pipeline schedule (pp=2 x dp=2, 2 micro-batches per data-parallel
    rank), then ``optimizer.step()``."""
    result = load(world4, "fabric_step_pp2")
    plan = result["plan"]
    assert (plan["pp"], plan["dp"], plan["grad_accum"]) == (2, 2, 2)
    assert_equivalent(result, *reference)


def test_fabric_in_documented_order(world2, reference):
    """``fabric.setup(model, optimizer)`` before ``fabric.setup_dataloaders`` (Fabric's docs): the layout is planned
    at setup, the loader settles mbs for its global batch, and training equals the single-process loop."""
    result = load(world2, "fabric_model_first")
    plan = result["plan"]
    assert plan["dp"] * plan["mbs"] == 8 and plan["grad_accum"] == 1 and plan["dp"] * plan["tp"] == 2
    assert_equivalent(result, *reference)


def test_fabric_documented_order_refuses_an_indivisible_batch(world2):
    result = load(world2, "fabric_model_first_refused")
    assert result["field"] == "DataLoader.batch_size"
    assert "7 rows does not split evenly over the dp=2" in result["error"] and "\n" not in result["error"]


@pytest.mark.parametrize("name", ["fabric_checkpoint_zero0", "fabric_checkpoint_zero3"])
def test_fabric_save_and_load_resume_exactly(world2, name):
    """fabric.save / fabric.load through the autopar strategy, also on the DDP layout (zero=0, no DTensor
    parameters): the steps after the load repeat the steps after the save."""
    result = torch.load(world2 / f"{name}.pt", weights_only=False)
    assert result["plan"]["zero"] == int(name[-1])
    torch.testing.assert_close(torch.tensor(result["resumed"]), torch.tensor(result["reference"]), rtol=1e-6, atol=0)


def test_fabric_no_backward_sync_on_ddp(world2, reference):
    """Plain data parallelism runs on DDP (replicate): fabric.no_backward_sync keeps the first half-batch's
    gradients local (they differ across ranks), and the accumulated step equals the single-process one."""
    result = load(world2, "fabric_ddp_accum")
    assert (result["plan"]["dp"], result["plan"]["zero"]) == (2, 0)
    assert result["local_grads_differ"] is True
    assert_equivalent(result, *reference)


@pytest.mark.skipif(not HAVE_HF, reason="transformers not installed (extra 'hf'): pip install 'lightning-autopar[hf]'")
@pytest.mark.parametrize("name, layout", [("hf_llama", (2, 3, 1)), ("hf_llama_tp", (1, 0, 2))])
def test_hf_llama_matches_single_process(world2, name, layout):
    from tests_hf import hf_reference_run

    result = load(world2, name)
    assert (result["plan"]["dp"], result["plan"]["zero"], result["plan"]["tp"]) == layout
    assert_equivalent(result, *hf_reference_run(STEPS))


@pytest.fixture(scope="module")
@background_launch
def own_launches(tmp_path_factory) -> dict:
    """The launches by Lightning's own launcher (``python script.py``): the Hydra app, and a Trainer and a Fabric
    run with no thread variable; they run beside the other tests (see conftest's background lane)."""
    out = tmp_path_factory.mktemp("own_launches")
    env = without_thread_env()
    env.pop("HYDRA_FULL_ERROR", None)
    launched = {"hydra": subprocess.run(
        [sys.executable, "examples/train_gpt.py", "model=gpt-tiny", "cluster=cpu", "trainer=debug",
         "trainer.max_steps=3", "planner.fix=tp=2", "trainer.enable_progress_bar=false", f"hydra.run.dir={out / 'run'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)}
    for mode in ("trainer", "fabric"):
        launched[mode] = subprocess.run([sys.executable, str(DIST / "launcher_threads.py"), str(out), mode], cwd=ROOT,
                                        env=without_thread_env(), capture_output=True, text=True, timeout=600)
    return {"out": out, **launched}


def test_hydra_app_with_lightning_launcher(own_launches):
    """`python examples/train_gpt.py ...` on 2 CPU processes: Lightning re-runs the script for rank 1 with
    Hydra's run dir, so both ranks compose the same config; rank 0 prints the plan and the final loss."""
    run_dir, proc = own_launches["out"] / "run", own_launches["hydra"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "autopar plan: GPT on cpu (1 x 2 cpu)" in proc.stdout
    planned = next(line for line in proc.stdout.splitlines() if line.startswith("autopar: planned in"))
    assert re.search(r" tp=2(\+sp)? ", planned), planned  # sequence parallel when the planner prices it better
    assert "final train_loss" in proc.stdout
    assert (run_dir / "train_ddp_process_1.log").exists()  # rank 1 ran through Lightning's Hydra command
    assert (run_dir / ".hydra" / "overrides.yaml").exists()


@pytest.mark.parametrize("mode", ["trainer", "fabric"])
def test_own_launcher_shares_the_cores(own_launches, mode):
    """`python script.py` with devices=2 and no OMP_NUM_THREADS: Lightning's launcher starts rank 1 and sets the
    threads of DDPStrategy processes only; with the autopar strategies every rank still trains with at most its
    share of the cores (processes x threads <= cores), as under torchrun or DDPStrategy."""
    from lightning_autopar.topology.worker import cpu_count

    check_launch(own_launches[mode], f"launcher_threads.py {mode}")
    share = max(1, cpu_count() // 2)
    threads = [int((own_launches["out"] / f"{mode}_rank{rank}.txt").read_text()) for rank in (0, 1)]
    assert all(1 <= t <= share for t in threads), (threads, share)
