"""Set-up profiling under torchrun (``profile.runtime``): a tiny GPT profiled for three plans on the live group.

Usage: torchrun --nproc-per-node 4 tests/dist/profile_runtime_scenarios.py OUT_DIR profile  (or in a batch)
Each rank writes OUT_DIR/profile_r<rank>.pt: the profile
(generous budget) as a dict, the one with budget 0, whether the model's parameters, gradients, RNG streams and
the world group were as before, and (rank 0) the probe's YAML path; or the traceback."""

from __future__ import annotations

import dataclasses
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_module  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

BUDGET_S = 60.0
SEQ = 16


def plans():
    from lightning_autopar.specs import Plan

    return [Plan(dp=4, zero=3, mbs=1), Plan(dp=2, pp=2, mbs=2), Plan(dp=2, tp=2, mbs=4)]


def profile_result(out_dir: Path) -> dict:
    from lightning_autopar.profile.runtime import profile_runtime
    from lightning_autopar.runtime.analysis import analyse

    torch.manual_seed(0)
    module = make_module()
    model, analysis, _ = analyse(module, lambda: None)
    for p in model.parameters():  # gradients held from an earlier step must survive
        p.grad = torch.full_like(p, 0.5)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state().clone(), random.getstate()
    device = torch.device("cpu")
    started = time.perf_counter()
    profile = profile_runtime(model, analysis, plans(), SEQ, "fp32", BUDGET_S, device)
    wall = time.perf_counter() - started
    empty = profile_runtime(model, analysis, plans(), SEQ, "fp32", 0.0, device)
    result = {"profile": dataclasses.asdict(profile), "empty": dataclasses.asdict(empty), "wall": wall}
    after = model.state_dict()
    result["params_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    result["grads_unchanged"] = all(p.grad is not None and bool((p.grad == 0.5).all()) for p in model.parameters())
    result["rng_unchanged"] = torch.equal(rng[0], torch.get_rng_state()) and rng[1] == random.getstate()
    probe_path = out_dir / "probed.yaml"
    from lightning_autopar.runtime.probe import run_probe, spec_yaml

    probed = run_probe(sizes=[4096], iters=2, warmup=1, check_versions=False)
    if dist.get_rank() == 0:
        probe_path.write_text(spec_yaml(probed.spec, probed))
    result["probe_yaml"] = str(probe_path)
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the world group still works after the sub-groups were destroyed
    result["world_sum"] = float(ones)
    return result


def run(out_dir: Path, name: str) -> None:
    """Scenario "profile": each rank writes OUT_DIR/profile_r<rank>.pt (its result or the traceback)."""
    if not dist.is_initialized():  # the first scenario of a launch; a Trainer reuses the group
        dist.init_process_group("gloo")
    try:
        result = profile_result(out_dir)
    except Exception:  # noqa: BLE001 - the test reports the traceback
        result = {"crash": traceback.format_exc()}
    torch.save(result, out_dir / f"{name}_r{dist.get_rank()}.pt")


if __name__ == "__main__":
    from scenarios import main

    main(run)
