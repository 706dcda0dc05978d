"""The runtime's fixed costs per optimizer step (host work no device term prices), by term name (RUNTIME_TERMS):
the loop, micro-batches, FSDP units, TP / EP dispatch, pipeline actions and collective synchronisation, from
measured microseconds per occurrence (ClusterSpec.runtime). Pure numpy."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_autopar.planner.hardware import Hardware
from lightning_autopar.planner.cost_pipeline import SCHED_DUALPIPEV, SCHED_IZB, SCHED_ZBV


DDP_BUCKET_BYTES = 25e6  # torch DDP bucket_cap_mb default


# Host work of autopar's runtime paths that no device term prices: measured on the live process group
# (profile/runtime.py) or refit from measured steps (planner/calibrate.py), ClusterSpec.runtime, microseconds per
# occurrence. Each term counts occurrences per optimizer step on the busiest rank; 0 us (presets) adds nothing.

RUNTIME_TERMS = ("step", "microbatch", "fsdp_units", "tp_dispatch", "pipeline_actions", "ep_dispatch",
                 "collective_sync")


def step_overhead_time(hw: Hardware) -> float:
    """t_step: once per optimizer step, the training loop around it (hooks, closure, zero_grad) (measured)."""
    return hw.runtime.step_us * 1e-6


def microbatch_overhead_time(hw: Hardware, slots: Any) -> Any:
    """slots * t_mb: per micro-batch slot, batch slicing and the autocast / no_sync contexts (measured)."""
    return np.asarray(slots, dtype=float) * hw.runtime.microbatch_us * 1e-6


def fsdp_collectives_per_microbatch(zero: Any, fsdp: Any, pp: Any = 1) -> Any:
    """FSDP2 collectives per unit and micro-batch as parallel/fsdp.py applies them: zero 3 gathers in forward and
    again in backward (reshard_after_forward) -- in a pipeline stage only in backward, as torch.distributed.
    pipelining keeps the parameters gathered after each backward until the step's last; zero 1/2 keep them
    gathered until the step's last backward (set_gradient_sync); zero 0 gathers nothing
    (fsdp_collectives_per_step counts the once-per-step ones)."""
    zero = np.asarray(zero)
    return np.where(fsdp & (zero == 3), np.where(np.asarray(pp) > 1, 1.0, 2.0), 0.0)


def fsdp_collectives_per_step(zero: Any, fsdp: Any, pp: Any = 1) -> Any:
    """FSDP2 collectives per unit once per step: the gradient reduction after the last micro-batch (gradient sync
    is off for the others) and the one gather of the step's first forward at zero 1/2 (and at zero 3 in a
    pipeline stage)."""
    zero = np.asarray(zero)
    first = ((zero == 1) | (zero == 2)) | ((zero == 3) & (np.asarray(pp) > 1))
    return np.where(fsdp, 1.0 + np.where(first, 1.0, 0.0), 0.0)


# FSDP2's eager ops per unit and collective, counted on its code path (torch/distributed/fsdp/_fully_shard/
# _fsdp_collectives.py) for a transformer block of T = 12 parameter tensors (2 norms, 4 projections or a fused qkv
# + out, 2 MLP matrices, with biases): an all-gather runs all_gather_copy_in (the buffer and _foreach_copy_),
# the collective, split_with_sizes_copy and one unsharded-parameter view per tensor (4 + T = 16); a reduce-scatter
# runs the buffer, chunk_cat, the pre- and post-divide, the collective and, per tensor, an as_strided view and the
# sharded-gradient DTensor or accumulate (6 + 2T = 30). The mean of the two per collective: 23.
FSDP2_OPS_PER_UNIT_CALL = 23.0


def fsdp_unit_seconds(hw: Hardware) -> float:
    """t_unit, seconds per FSDP unit and collective: measured (RuntimeCosts.fsdp_unit_us, runtime/paths.py), else
    FSDP2_OPS_PER_UNIT_CALL eager ops at the device's per-op cost when the device is the host (a CPU process: its
    ops run in line with the compute, so each costs kernel_overhead_us, the figure the block terms charge per op);
    on an accelerator they are launched ahead of the device's work and hidden (0 until measured)."""
    if hw.runtime.fsdp_unit_us > 0:
        return hw.runtime.fsdp_unit_us * 1e-6
    return FSDP2_OPS_PER_UNIT_CALL * hw.overhead_s if hw.host_device else 0.0


def fsdp_unit_overhead_time(hw: Hardware, units: Any, slots: Any, zero: Any, fsdp: Any, pp: Any = 1) -> Any:
    """units * (slots * c_mb + c_step) * t_unit: each FSDP unit's hooks and copy-in/out per collective, c_mb per
    micro-batch and c_step per step (fsdp_collectives_per_microbatch / _per_step; t_unit: fsdp_unit_seconds). The
    preset used to price it at 0, so ZeRO 1/2 (one reduce-scatter and one gather per unit and step, and the
    sharded optimizer step) beat DDP's one bucketed all-reduce on CPU processes, where it measured 2.6x slower."""
    calls = np.asarray(slots, dtype=float) * fsdp_collectives_per_microbatch(zero, fsdp, pp) \
        + fsdp_collectives_per_step(zero, fsdp, pp)
    return np.asarray(units, dtype=float) * calls * fsdp_unit_seconds(hw)


def tp_dispatch_time(hw: Hardware, blocks: Any, slots: Any, tp: Any) -> Any:
    """blocks * slots * t_tp when tp > 1: DTensor dispatch and sharding propagation of each TP block (measured)."""
    return np.where(np.asarray(tp) > 1, np.asarray(blocks, dtype=float) * slots * hw.runtime.tp_block_us * 1e-6, 0.0)


SPLIT_BACKWARD_SCHEDULES = (SCHED_IZB, SCHED_ZBV, SCHED_DUALPIPEV)  # backward split in B and W


def pipeline_actions_per_chunk(schedule: Any) -> Any:
    """Schedule actions per chunk and micro-batch: 2 (forward, backward); 3 for the zero-bubble schedules, whose
    backward runs as two actions, input gradients (B) then weight gradients (W) (Qi et al. 2023;
    torch.distributed.pipelining's I and W actions)."""
    return np.where(np.isin(np.asarray(schedule), SPLIT_BACKWARD_SCHEDULES), 3.0, 2.0)


def pipeline_action_time(hw: Hardware, slots: Any, vpp: Any, pp: Any, schedule: Any = 1) -> Any:
    """actions(schedule) * vpp * slots * t_action when pp > 1: every action of each chunk and micro-batch slot
    (``pipeline_actions_per_chunk``), each with its schedule bookkeeping and p2p posts
    (torch.distributed.pipelining; measured t_action)."""
    return np.where(np.asarray(pp) > 1, pipeline_actions_per_chunk(schedule) * np.asarray(vpp, dtype=float) * slots
                    * hw.runtime.pipeline_action_us * 1e-6, 0.0)


def ep_dispatch_time(hw: Hardware, moe_blocks: Any, slots: Any, ep: Any) -> Any:
    """moe_blocks * slots * t_ep when ep > 1: each MoE layer's exchange bookkeeping (split sizes, permutes) (measured)."""
    return np.where(np.asarray(ep) > 1, np.asarray(moe_blocks, dtype=float) * slots * hw.runtime.ep_layer_us * 1e-6,
                    0.0)


def collective_calls(slots: Any, zero: Any, fsdp: Any, units: Any, blocks: Any, moe_blocks: Any, tp: Any, pp: Any,
                     vpp: Any, ep: Any, dp: Any, grad_bytes: Any) -> Any:
    """Blocking collective calls per step on the busiest rank: FSDP2 gathers and reductions (as
    fsdp_unit_overhead_time counts them), DDP's bucketed all-reduces (ceil(gradient bytes / DDP_BUCKET_BYTES))
    when dp > 1 without FSDP, 4 TP all-reduces per block and micro-batch (2 forward, 2 backward; Megatron), a p2p per
    pipeline action, 4 all-to-alls per MoE layer and micro-batch with ep > 1 (dispatch, combine; forward, backward)."""
    slots, zero = np.asarray(slots, dtype=float), np.asarray(zero)
    fsdp_calls = np.asarray(units, dtype=float) * (slots * fsdp_collectives_per_microbatch(zero, fsdp, pp)
                                                     + fsdp_collectives_per_step(zero, fsdp, pp))
    ddp = np.where(~np.asarray(fsdp, dtype=bool) & (np.asarray(dp) > 1),
                   np.maximum(np.ceil(np.asarray(grad_bytes, dtype=float) / DDP_BUCKET_BYTES), 1.0), 0.0)
    tp_calls = np.where(np.asarray(tp) > 1, 4.0 * np.asarray(blocks, dtype=float) * slots, 0.0)
    pp_calls = np.where(np.asarray(pp) > 1, 2.0 * np.asarray(vpp, dtype=float) * slots, 0.0)
    ep_calls = np.where(np.asarray(ep) > 1, 4.0 * np.asarray(moe_blocks, dtype=float) * slots, 0.0)
    return fsdp_calls + ddp + tp_calls + pp_calls + ep_calls


def collective_sync_time(hw: Hardware, calls: Any) -> Any:
    """calls * t_sync: each blocking collective waits for the group's last member; ranks drift apart between calls
    (measured: profile/runtime.py phase_sync; on time-shared cores a rank waits for the others' turns)."""
    return np.asarray(calls, dtype=float) * hw.runtime.sync_us * 1e-6


def runtime_fixed_time(hw: Hardware, slots: Any, zero: Any, fsdp: Any, units: Any, blocks: Any, moe_blocks: Any,
                       tp: Any, pp: Any, vpp: Any, ep: Any, dp: Any = 1, grad_bytes: Any = 0.0,
                       schedule: Any = 1) -> dict[str, Any]:
    """The runtime's fixed costs per step by term name (RUNTIME_TERMS), on the busiest rank: ``slots`` micro-batch
    slots of the step (micro-batches plus the pipeline's fill and drain), ``units`` FSDP units and ``blocks`` /
    ``moe_blocks`` on that rank, ``fsdp`` whether FSDP2 runs (not plain DDP), ``grad_bytes`` the rank's gradient
    bytes (DDP buckets), ``schedule`` the SCHEDULES code (zero-bubble schedules run more actions per chunk)."""
    calls = collective_calls(slots, zero, fsdp, units, blocks, moe_blocks, tp, pp, vpp, ep, dp, grad_bytes)
    return {"step": step_overhead_time(hw) + 0.0 * np.asarray(slots, dtype=float),
            "microbatch": microbatch_overhead_time(hw, slots),
            "fsdp_units": fsdp_unit_overhead_time(hw, units, slots, zero, fsdp, pp),
            "tp_dispatch": tp_dispatch_time(hw, blocks, slots, tp),
            "pipeline_actions": pipeline_action_time(hw, slots, vpp, pp, schedule),
            "ep_dispatch": ep_dispatch_time(hw, moe_blocks, slots, ep),
            "collective_sync": collective_sync_time(hw, calls)}
