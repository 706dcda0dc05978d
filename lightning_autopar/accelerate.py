"""A plan for Hugging Face Accelerate: ``ParallelismConfig`` (dp_replicate / dp_shard / tp / cp) + an FSDP2 plugin.

``accelerate_mapping(plan)`` is the pure, documented mapping (no Accelerate import):

==================  ====================================================================================
plan                Accelerate
==================  ====================================================================================
dp, zero=0          plain DDP: no ParallelismConfig (Accelerate rejects dp_replicate > 1 with dp_shard = 1)
dp, zero>=1         dp_shard_size = dp_shard (all of dp by default), dp_replicate_size = dp / dp_shard (HSDP)
zero=3 / 1, 2       FSDP2 plugin, reshard_after_forward True / False (as ``parallel/fsdp.py`` does)
tp, cp              tp_size, cp_size (TP needs a model loaded with ``tp_plan="auto"``; not with DDP)
mbs, grad_accum     the per-process DataLoader batch size, ``gradient_accumulation_steps``
precision           mixed_precision "no" / "bf16" / "fp16"
recompute=full      the FSDP plugin's ``activation_checkpointing=True``
==================  ====================================================================================

What Accelerate cannot express raises a one-line ``ConfigError`` naming the field (pp > 1, ep > 1, sp,
selective recompute, tp with zero=0). ``accelerator(plan)`` builds the ``Accelerator``; Accelerate refuses a
ParallelismConfig on several CPU processes (it needs FSDP2 or a multi-device GPU/NPU type), which is reported in
one line too: on CPUs use the Lightning or Fabric strategy. ``examples/accelerate_gpt.py`` is the GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import Plan, parse_fix

MIXED_PRECISION = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
CPU_REFUSAL = ("Accelerate refuses a ParallelismConfig on CPU processes (it needs FSDP2 or a multi-device GPU/NPU "
               "type; under torchrun on CPU it sees one process)")


@dataclass
class AccelerateMapping:
    """The Accelerate settings of one plan (see the module table)."""

    parallelism: dict[str, int] | None  # ParallelismConfig kwargs; None: plain DDP / one process
    fsdp: dict[str, Any] | None  # FullyShardedDataParallelPlugin kwargs; None: no FSDP
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    per_process_batch_size: int = 1  # the DataLoader batch each process gets (plan.mbs)
    notes: list[str] = field(default_factory=list)


def _as_plan(plan: Plan | dict | str) -> Plan:
    if isinstance(plan, Plan):
        return plan
    return Plan(**parse_fix(plan))


def accelerate_mapping(plan: Plan | dict | str) -> AccelerateMapping:
    """Map ``plan`` (a Plan, a dict or ``"dp=4,zero=3"``) to Accelerate's settings, or raise ConfigError."""
    plan = _as_plan(plan)
    plan.validate()
    for name, value, fix in (("pp", plan.pp, "pp=1"), ("ep", plan.ep, "ep=1"), ("sp", plan.sp, "sp=false")):
        if value is True or value > 1:
            raise ConfigError(f"plan.{name}", f"Accelerate has no {name}={value} (its ParallelismConfig is "
                              "dp_replicate x dp_shard x tp x cp)", f"plan with {fix}, or use strategy='autopar'")
    if plan.compile:
        raise ConfigError("plan.compile", "Accelerate compiles the whole model (its dynamo plugin), not each block",
                          "plan with compile=false (and set Accelerate's dynamo backend yourself), or use "
                          "strategy='autopar'")
    if plan.recompute == "selective":
        raise ConfigError("plan.recompute", "Accelerate only checkpoints whole blocks (activation_checkpointing)",
                          "plan with recompute=full or none")
    sharded = plan.zero > 0 and plan.dp > 1
    if plan.tp > 1 and plan.dp > 1 and not sharded:
        raise ConfigError("plan.zero", "Accelerate cannot combine tensor parallelism with DDP (zero=0)",
                          "plan with zero>=1 (FSDP2 + TP) or dp=1")
    notes = []
    parallelism = None
    if sharded or plan.tp > 1 or plan.cp > 1:
        shard = plan.shard_size if sharded else 1
        parallelism = dict(dp_replicate_size=plan.dp // shard, dp_shard_size=shard, tp_size=plan.tp,
                           cp_size=plan.cp)
    elif plan.dp > 1:
        notes.append(f"zero=0: plain DDP over {plan.dp} processes (no ParallelismConfig)")
    fsdp = None
    if sharded or plan.cp > 1:
        fsdp = dict(fsdp_version=2, reshard_after_forward=plan.zero == 3,
                    activation_checkpointing=plan.recompute == "full")
        if plan.zero in (1, 2):
            notes.append(f"zero={plan.zero}: FSDP2 keeping parameters gathered between forward and backward")
    elif plan.recompute == "full":
        raise ConfigError("plan.recompute", "Accelerate applies activation checkpointing through its FSDP plugin, "
                          "which this plan does not use", "plan with zero>=1 and dp>1, or recompute=none")
    return AccelerateMapping(parallelism=parallelism, fsdp=fsdp, mixed_precision=MIXED_PRECISION[plan.precision],
                             gradient_accumulation_steps=plan.grad_accum, per_process_batch_size=plan.mbs,
                             notes=notes)


def accelerator_kwargs(plan: Plan | dict | str) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` (ParallelismConfig and FSDP plugin objects built)."""
    from accelerate import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    mapping = accelerate_mapping(plan)
    kwargs: dict[str, Any] = dict(mixed_precision=mapping.mixed_precision,
                                  gradient_accumulation_steps=mapping.gradient_accumulation_steps)
    if mapping.parallelism is not None:
        kwargs["parallelism_config"] = ParallelismConfig(**mapping.parallelism)
    if mapping.fsdp is not None:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(**mapping.fsdp)
    return kwargs


def _accelerator_device() -> bool:
    """Whether a GPU (CUDA) or an NPU is present: what Accelerate's ParallelismConfig needs."""
    import torch

    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def accelerator(plan: Plan | dict | str, **kwargs: Any) -> Any:
    """An ``accelerate.Accelerator`` running ``plan``; ConfigError (one line) where Accelerate refuses it."""
    from accelerate import Accelerator

    merged = {**accelerator_kwargs(plan), **kwargs}
    config = merged.get("parallelism_config")
    if config is not None and config.total_size > 1 and not _accelerator_device():
        raise ConfigError("accelerate", CPU_REFUSAL, "run on GPUs, or use strategy='autopar' (Trainer or Fabric)")
    try:
        return Accelerator(**merged)
    except ValueError as err:
        text = " ".join(str(err).split())
        if "ParallelismConfig" in text or "parallelism" in text.lower():
            raise ConfigError("accelerate", text[:300], "adjust the plan, or use strategy='autopar'") from None
        raise
