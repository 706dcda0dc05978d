"""The set-up profile's compile phase (profile/runtime.phase_compile), single process.

Kept apart from tests/test_compile.py, which needs the world-2 launch: a module that needs no launch runs early
(tests/conftest.py), so this test's compiled block, the suite's GPT (common.model_config) at the dp=2 scenarios'
4 rows per rank, is in the session's inductor cache before compile_scenarios.py's dp_zero0 / dp_zero3 compile the
same block (measured: their launch 35 s -> 14 s wall). Only speed depends on the order, never a result.
"""

from __future__ import annotations

import torch
from common import GLOBAL_BATCH, model_config

ROWS_PER_RANK = GLOBAL_BATCH // 2  # compile_scenarios.py's dp=2 plans


def test_setup_profile_measures_the_compile_speedup(tmp_path):
    """phase_compile: one block eager vs compiled at the compile plan's mbs, the model left untouched; a small
    budget skips it with one phrase (the compile warm-up is set-up time)."""
    import torch.distributed as dist

    from lightning_autopar.models import GPT
    from lightning_autopar.profile import runtime as rt
    from lightning_autopar.profile.analyze import analyze
    from lightning_autopar.specs import Plan, RuntimeProfile

    model = GPT(model_config())
    analysis = analyze(model)
    plans = [Plan(mbs=ROWS_PER_RANK, compile=True)]
    seq = model_config().seq_len
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        small, big = RuntimeProfile(), RuntimeProfile()
        rt.phase_compile(model, analysis, plans, seq, "fp32", rt.Clock(5.0, torch.device("cpu")), small)
        rt.phase_compile(model, analysis, plans, seq, "fp32", rt.Clock(600.0, torch.device("cpu")), big)
    finally:
        dist.destroy_process_group()
    assert small.runtime.compile_speedup == 0 and "compile warm-up over the budget" in small.skipped[0]
    assert big.runtime.compile_speedup > 0 and big.skipped == []
    assert "forward" not in vars(model.blocks[0]) and all(p.grad is None for p in model.parameters())
