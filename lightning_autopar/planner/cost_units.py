"""Cost terms of the unit form (any model described by units: parameters, FLOPs and saved bytes per sample):
forward/backward time per unit, selective recompute, saved activations, SyncBatchNorm collectives and the MFU
numerator. Pure numpy; each docstring gives the formula and its source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_autopar.planner.hardware import Hardware
from lightning_autopar.planner.cost_kernels import dispatch_floor
from lightning_autopar.planner.cost_comm import allgather_time, allreduce_time
from lightning_autopar.specs import ModelSpec


UNIT_BWD = 2.0  # backward / forward of a unit: dX and dW each cost a forward's FLOPs; norm/activation grads ~2x traffic


@dataclass(frozen=True)
class UnitArrays:
    """The units of a unit-form ModelSpec as numpy columns (specs.UnitSpec: per sample, forward, 4-byte elements).
    ``inputs`` is each unit's input, the previous unit's output (0 for the first: the batch is the loader's)."""

    flops: np.ndarray
    conv: np.ndarray
    memory: np.ndarray
    ops: np.ndarray
    act: np.ndarray
    out: np.ndarray
    inputs: np.ndarray
    params: np.ndarray
    frozen: np.ndarray  # of params, those with requires_grad=False
    attention: np.ndarray  # bool: the unit holds attention (selective recompute applies)
    batchnorm: np.ndarray  # BatchNorm layers per unit (each synchronises its statistics over dp)

    @staticmethod
    def of(m: ModelSpec) -> "UnitArrays":
        col = lambda name: np.array([float(getattr(u, name)) for u in m.units])  # noqa: E731
        out = col("output_bytes")
        return UnitArrays(col("flops"), col("conv_flops"), col("memory_bytes"), col("ops"), col("activation_bytes"),
                          out, np.concatenate([[0.0], out[:-1]]), col("params"), col("frozen_params"),
                          np.array(["attention" in u.kinds for u in m.units]),
                          np.array([max(u.batchnorm_layers, int("batchnorm" in u.kinds)) for u in m.units]))


def unit_time(hw: Hardware, u: UnitArrays, mbs: Any, peak: Any, elem: Any) -> tuple[np.ndarray, np.ndarray]:
    """(fwd, bwd) per (candidate, unit): b*[conv/(P*eta_conv) + (F-conv)/(P*eta_gemm) + M*e/4/BW] + ops*launch, bwd 2x (roofline per kernel class).

    The three parts add rather than overlap: memory_bytes counts only the memory-bound kernels (norms, pooling,
    activations, adds), which run between the conv/matmul kernels, never at the same time; each class is already
    at its own roofline bound. Tile and wave losses of small batches are not modelled (the shapes are not in a
    unit); the per-op launch cost is what penalises small micro-batches. Host dispatch floors it (dispatch_floor).
    """
    b, peak, e = (np.asarray(x, dtype=float)[..., None] for x in (mbs, peak, elem))
    compute = u.conv / (peak * hw.conv_eff) + (u.flops - u.conv) / (peak * hw.gemm_eff)
    memory = u.memory * e / 4.0 / hw.mem_bw
    fwd = dispatch_floor(hw, b * (compute + memory) + u.ops * hw.overhead_s, u.ops)
    bwd = dispatch_floor(hw, UNIT_BWD * (b * (compute + memory) + u.ops * hw.overhead_s), UNIT_BWD * u.ops)
    return fwd, bwd


def unit_selective_time(hw: Hardware, u: UnitArrays, mbs: Any, elem: Any, every_unit: bool = False) -> np.ndarray:
    """Selective recompute per (candidate, unit): attention units re-run their memory-bound ops, b*M*e/4/BW + ops*launch; others 0.

    ``every_unit`` (recompute=ops): every unit re-runs them (the op-level policy keeps each unit's conv/matmul
    outputs, whatever the unit holds; the memory estimate keeps the unit's activations, an upper bound as below).

    Units without attention price selective as none (no time, all activations kept). Units with attention are
    charged the re-run of their element-wise work but keep their full activations in the memory estimate: both
    are upper bounds, since a unit does not say which of its saved bytes belong to the matmuls (parallel.recompute
    keeps matmul and fused-attention outputs).
    """
    b, e = (np.asarray(x, dtype=float)[..., None] for x in (mbs, elem))
    return np.where(u.attention | every_unit, b * u.memory * e / 4.0 / hw.mem_bw + u.ops * hw.overhead_s, 0.0)


def unit_activation_bytes(u: UnitArrays, mbs: Any, elem: Any, recompute: int) -> np.ndarray:
    """Saved bytes per (candidate, unit): none/selective/ops b*act*e/4 (ops: an upper bound, unit_selective_time);
    full b*input*e/4 (the checkpointed unit keeps its input only)."""
    b, e = (np.asarray(x, dtype=float)[..., None] for x in (mbs, elem))
    return b * (u.inputs if recompute == 2 else u.act) * e / 4.0


def sync_batchnorm_time(hw: Hardware, dp: Any) -> tuple[Any, Any]:
    """(fwd, bwd) per BatchNorm layer and micro-batch: collectives of the statistics forward and backward, latency-bound
    (torch SyncBatchNorm; parallel/batchnorm.py).

    The statistics are 2C+1 floats per layer (kilobytes): the collectives cost their hops, priced with zero payload;
    they block the next op, so nothing hides them. One pair per BatchNorm layer (``UnitSpec.batchnorm_layers``; a
    unit that only says "batchnorm" in its kinds counts one).
    """
    dp = np.asarray(dp, dtype=float)
    return (np.where(dp > 1, allgather_time(hw, 0.0, dp, 1), 0.0),
            np.where(dp > 1, allreduce_time(hw, 0.0, dp, 1), 0.0))


def unit_model_flops_per_sample(m: ModelSpec) -> float:
    """3 x the units' forward FLOPs per sample, no recompute: the MFU numerator in unit form (Chowdhery et al. 2022)."""
    return 3.0 * float(sum(u.flops for u in m.units))
