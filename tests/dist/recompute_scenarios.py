"""Recompute granularity (issue 17) under strategy="autopar": op-level selective checkpointing (recompute=ops) on
our GPT at dp=2 zero=3, at tp=2 with sp, in two pipeline stages (1f1b), on a tiny Hugging Face Llama; full and
ops recompute on one block in two (recompute_every=2); results are compared with the single-process loop
(tests/test_recompute.py). ``gpt_moe_ops`` records the one-line refusal of ops on MoE blocks.

Usage: torchrun --nproc-per-node 2 tests/dist/recompute_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# scenario -> (model, plan fields, model kwargs)
PLANS = {
    "gpt_ops_dp2_zero3": ("gpt", "dp=2,zero=3,recompute=ops,recompute_every=1", {}),
    "gpt_ops_tp2_sp": ("gpt", "tp=2,dp=1,sp=true,recompute=ops,recompute_every=1", {}),
    "gpt_ops_pp2": ("gpt", "pp=2,dp=1,schedule=1f1b,mbs=2,grad_accum=4,recompute=ops,recompute_every=1", {"layers": 4}),
    "gpt_full_every2_dp2": ("gpt", "dp=2,zero=3,recompute=full,recompute_every=2", {"layers": 4}),
    "gpt_ops_every2_dp2": ("gpt", "dp=2,zero=2,recompute=ops,recompute_every=2", {"layers": 4, "ffn_kind": "swiglu"}),
    "llama_ops": ("llama", "dp=2,zero=3,recompute=ops,recompute_every=1", {}),
    "gpt_moe_ops": ("gpt", "dp=2,zero=3,recompute=ops,recompute_every=1", {"experts": 4, "moe_every": 2}),
}


def run(out: Path, name: str) -> None:
    from scenarios import fit, full_state, record, record_error
    from sp_scenarios import make

    model, fix, kwargs = PLANS[name]
    if name == "gpt_moe_ops":
        record_error(out, name, fix, model_kwargs=kwargs, make=make(model))
        return
    trainer, module, losses, plan = fit(fix, model_kwargs=kwargs, make=make(model))
    if plan["pp"] > 1:  # each stage holds its own blocks: gathered from all
        from pp_scenarios import gathered_state

        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
        return
    # which blocks carry the composable checkpoint (recompute_every: every k-th local block only)
    checkpointed = [i for i, block in enumerate(module.model.blocks) if "checkpoint" in _registry(block)] \
        if model == "gpt" else None
    record(out, name, losses=losses, state=full_state(module), plan=plan, checkpointed=checkpointed)


def _registry(block) -> dict:
    from torch.distributed._composable.contract import _get_registry

    return _get_registry(block) or {}


if __name__ == "__main__":
    from scenarios import main

    main(run)
