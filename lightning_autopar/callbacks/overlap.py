"""Compute/communication overlap as plan knobs: chosen from the planner's priced plan, overridable, applied
at runtime to the modules the strategy already wrapped with FSDP2 (``parallel/fsdp.py``: one unit per block
plus the transformer and leftover children).

Knobs (FSDP2 runtime APIs):

* ``forward_prefetch`` / ``backward_prefetch``: how many following (preceding, in backward) blocks' parameter
  all-gathers a block issues ahead (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``).
  0 keeps FSDP2's defaults (no explicit forward prefetch, implicit one-block backward prefetch); each extra
  block in flight holds one more gathered block in memory.
* ``reshard_after_forward``: free gathered parameters after forward and gather again in backward (ZeRO-3),
  or keep them (ZeRO-2 traffic, more memory); None keeps what the plan's ``zero`` applied.
* ``reduce_scatter_buffers``: gradient reduce-scatter input buffers in flight
  (``set_reduce_scatter_max_input_buffers``), the gradient "bucket" dial: 1 is FSDP2's default, more lets the
  backward proceed while earlier reduce-scatters are still on the wire, at the cost of those buffers.
* ``separate_reduce_scatter_group``: reduce-scatter on its own communicator so it can progress concurrently
  with all-gathers (``set_separate_reduce_scatter_group``): the analogue of splitting collectives into groups
  (HCCL_GROUP_SIZE-style grouping). FSDP2 buckets gradients per unit (one block), fixed when the apply layer
  wraps the model, so grouping at runtime is about which communicator and how many buffers, not bucket bytes.

Knobs a torch version does not offer are skipped with a warning. None of them change the training math.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L

from lightning_autopar.errors import ConfigError

# exposed communication relative to compute above which prefetching more pays (first-principles thresholds:
# a few percent is within measurement noise; a quarter means one block ahead cannot hide it)
_WORTH_OVERLAPPING = 0.02
_COMM_BOUND = 0.25


@dataclass
class OverlapKnobs:
    forward_prefetch: int = 0
    backward_prefetch: int = 0
    reshard_after_forward: bool | None = None
    reduce_scatter_buffers: int = 1
    separate_reduce_scatter_group: bool = False

    def validate(self) -> None:
        for name in ("forward_prefetch", "backward_prefetch"):
            if getattr(self, name) < 0:
                raise ConfigError(f"Overlap.{name}", f"must be >= 0, got {getattr(self, name)}")
        if self.reduce_scatter_buffers < 1:
            raise ConfigError("Overlap.reduce_scatter_buffers", f"must be >= 1, got {self.reduce_scatter_buffers}")


def choose_overlap(report: Any) -> OverlapKnobs:
    """The knobs for the planner's best plan (``report.best``), from its cost terms and memory headroom.

    Only sharded plans (zero >= 1 over more than one rank) gather parameters; prefetching depth grows with
    exposed communication relative to compute, as long as the extra gathered blocks fit beside the predicted
    memory. Extra reduce-scatter buffers remove a compute-stream stall, so only on accelerators (on CPU/gloo
    there is no such stall and benchmarks/overlap.py measured them slower); a separate reduce-scatter
    communicator is chosen for communication-bound plans (it measured faster on CPU/gloo too).
    """
    from lightning_autopar.planner.hardware import GIB, WEIGHT_BYTES, prec_index

    best = report.best
    plan = best.plan
    knobs = OverlapKnobs()
    if plan.zero == 0 or plan.shard_size <= 1:
        return knobs
    b = best.breakdown
    ratio = b.comm_exposed_s / max(b.compute_s + b.recompute_s, 1e-12)
    if ratio <= _WORTH_OVERLAPPING:
        return knobs
    model, cluster = report.model, report.cluster
    unit_gib = model.block_params() / plan.tp * float(WEIGHT_BYTES[prec_index(plan.precision)]) / GIB
    headroom = cluster.device.memory_gib * report.memory_fraction - best.memory_gib_per_device
    depth = 2 if ratio > _COMM_BOUND and headroom > 2 * unit_gib else 1 if headroom > unit_gib else 0
    if plan.zero == 3:
        knobs.forward_prefetch = knobs.backward_prefetch = depth
    accelerator = cluster.device.name.lower() != "cpu"
    knobs.reduce_scatter_buffers = 2 if accelerator and headroom > unit_gib else 1
    knobs.separate_reduce_scatter_group = ratio > _COMM_BOUND
    return knobs


def fsdp_units(module: Any, roots: list[Any]) -> tuple[list[Any], list[Any]]:
    """(blocks in forward order, roots): the FSDP2 units under ``module``; blocks are the non-root units."""
    from torch.distributed.fsdp import FSDPModule

    root_ids = {id(r) for r in roots}
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    return [m for m in units if id(m) not in root_ids], [m for m in units if id(m) in root_ids]


def apply_overlap(blocks: list[Any], roots: list[Any], knobs: OverlapKnobs) -> list[str]:
    """Set the knobs on already-wrapped FSDP2 units; returns what was applied, one line per knob."""
    knobs.validate()
    done = []
    if knobs.forward_prefetch:
        d = knobs.forward_prefetch
        parent = next((r for r in roots if blocks and any(b is blocks[0] for b in r.modules())), None)
        if parent is not None:
            parent.set_modules_to_forward_prefetch(blocks[:d])
        for i, block in enumerate(blocks[:-1]):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + d])
        done.append(f"forward prefetch {d}")
    if knobs.backward_prefetch:
        d = knobs.backward_prefetch
        for i, block in enumerate(blocks[1:], start=1):
            block.set_modules_to_backward_prefetch(blocks[max(0, i - d):i][::-1])
        done.append(f"backward prefetch {d}")
    if knobs.reshard_after_forward is not None:
        for block in blocks:
            block.set_reshard_after_forward(knobs.reshard_after_forward, recurse=False)
        done.append(f"reshard after forward {knobs.reshard_after_forward}")
    for knob, method, value, default in (
            ("reduce_scatter_buffers", "set_reduce_scatter_max_input_buffers", knobs.reduce_scatter_buffers, 1),
            ("separate_reduce_scatter_group", "set_separate_reduce_scatter_group",
             knobs.separate_reduce_scatter_group, False)):
        if value == default:
            continue
        units = blocks + roots
        if not units or not hasattr(units[0], method):
            warnings.warn(f"autopar: this torch has no FSDPModule.{method}; {knob} ignored", stacklevel=2)
            continue
        for unit in units:
            getattr(unit, method)(value, recurse=False)
        done.append(f"{knob} {value}")
    return done


class Overlap(L.Callback):
    """Apply overlap knobs after the strategy wrapped the model; unset arguments take the planner's choice
    (``choose_overlap(strategy.report)``), given ones override it. ``knobs`` holds what is in effect."""

    def __init__(self, forward_prefetch: int | None = None, backward_prefetch: int | None = None,
                 reshard_after_forward: bool | None = None, reduce_scatter_buffers: int | None = None,
                 separate_reduce_scatter_group: bool | None = None, verbose: bool = True) -> None:
        self.overrides = {k: v for k, v in dict(
            forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
            reshard_after_forward=reshard_after_forward, reduce_scatter_buffers=reduce_scatter_buffers,
            separate_reduce_scatter_group=separate_reduce_scatter_group).items() if v is not None}
        OverlapKnobs(**self.overrides).validate()
        self.verbose = verbose
        self.knobs: OverlapKnobs | None = None
        self.applied: list[str] = []

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        report = getattr(strategy, "report", None)
        chosen = choose_overlap(report) if report is not None else OverlapKnobs()
        self.knobs = dataclasses.replace(chosen, **self.overrides)
        blocks, roots = fsdp_units(pl_module, list(getattr(strategy, "_fsdp_roots", [])))
        if not blocks and not roots:
            return  # nothing wrapped with FSDP2
        self.applied = apply_overlap(blocks, roots, self.knobs)
        if self.verbose and trainer.is_global_zero:
            print(f"autopar: overlap {', '.join(self.applied) or 'FSDP2 defaults'}", flush=True)
