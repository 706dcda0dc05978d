"""Precision per plan: fp32, bf16-mixed (FSDP2 MixedPrecisionPolicy: bf16 compute and gathers, fp32 gradient
reduction and master weights) and fp16-mixed (the same in fp16, plus a gradient scaler whose inf/NaN check is
agreed by all ranks, since each rank only sees its own gradient shards)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_autopar.errors import ConfigError

LIGHTNING_TO_PLAN = {
    "32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed",
}


def plan_precision(lightning_precision: str) -> str:
    """Map Lightning's precision flag to the plan's precision field."""
    try:
        return LIGHTNING_TO_PLAN[str(lightning_precision)]
    except KeyError:
        raise ConfigError("Trainer.precision", f"{lightning_precision!r} is not supported by autopar",
                          "use '32-true', 'bf16-mixed' or '16-mixed'") from None


def mixed_precision_policy(precision: str) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp8-mixed":  # the planner prices it (fp8 GEMM rate); there is no fp8 GEMM path to run it with
        raise ConfigError("plan.precision", "fp8-mixed is priced by the planner only: autopar has no fp8 GEMM runtime",
                          "use bf16-mixed to train")

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


class ShardedGradScaler(torch.amp.GradScaler):
    """GradScaler for sharded (DTensor) gradients: unscales each rank's local shards, then all-reduces the
    found-inf flag over the world so every rank skips (or takes) the same step."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # torch's hook, same signature
        from torch.distributed.tensor import DTensor

        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale.to(grads[0].device))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        return {found_inf.device: found_inf}
