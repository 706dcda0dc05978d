"""Per-block torch.compile (plan.compile) under strategy="autopar" on our GPT, world 2: data parallelism
(DDP at zero 0, FSDP2 at zero 3), tensor parallelism (tp=2, also with full recompute), and a block that fails to compile (a custom op
whose fake kernel refuses dynamo's tracing) -- one warning naming it, training eager. Results are compared with
the single-process eager loop in tests/test_compile.py.

Usage: torchrun --nproc-per-node 2 tests/dist/compile_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_module  # noqa: E402

FIXES = {"dp_zero0": "dp=2,zero=0,compile=true", "dp_zero3": "dp=2,zero=3,compile=true",
         "tp2": "tp=2,dp=1,compile=true", "fails": "dp=2,zero=0,compile=true",
         "tp2_full": "tp=2,dp=1,recompute=full,compile=true", "pp2": "pp=2,dp=1,grad_accum=2,compile=true"}


@torch.library.custom_op("autopar_test::passthrough", mutates_args=())
def passthrough(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@passthrough.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # meta runs (the analysis) pass, dynamo's tracing does not
        raise RuntimeError("autopar_test::passthrough has no kernel for compiled graphs")
    return torch.empty_like(x)


passthrough.register_autograd(lambda ctx, grad: grad)


def failing_module():
    """Our GPT whose blocks first pass their input through ``passthrough`` (the identity: same math)."""
    from lightning_autopar.models.gpt import Block

    class FailingBlock(Block):
        def forward(self, x, *args, **kwargs):
            return super().forward(passthrough(x), *args, **kwargs)

    module = make_module()
    for block in module.model.blocks:
        block.__class__ = FailingBlock
    return module


def run(out: Path, name: str) -> None:
    from scenarios import fit, full_state, record

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, module, losses, plan = fit(FIXES[name], make=failing_module if name == "fails" else make_module)
    compiled = [str(w.message) for w in caught if "plan.compile" in str(w.message)]
    checks = {cls.__name__: check.ok for cls, check in trainer.strategy._applied.compiled.checks.items()}
    record(out, name, losses=losses, state=full_state(module), plan=plan, warnings=compiled, checks=checks)


if __name__ == "__main__":
    from scenarios import main

    main(run)
