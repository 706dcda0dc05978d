"""Kernel-level cost terms the block, unit and optimizer terms are built from: GEMMs on the roofline with tile and
wave quantisation, memory-bound streams, the host-dispatch floor of eager PyTorch. Pure numpy, broadcasting over
candidates; each docstring gives the formula and its source on one line."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_autopar.planner.hardware import FP8, Hardware


TILE_FILL_S = 1.0e-6  # per wave of GEMM tiles: K-pipeline fill (~one HBM round trip, 0.6-0.8 us) + epilogue store


def gemm_time(hw: Hardware, m: Any, n: Any, k: Any, peak: Any, elem: Any, batch: Any = 1) -> Any:
    """max(2mnk/(peak*eta*q) + waves*t_fill, e(mk+kn+mn)/BW) + launch: roofline, tile/wave quantisation (Williams 2009; NVIDIA GEMM guide)."""
    m, n, k = (np.maximum(np.asarray(x, dtype=float), 1.0) for x in (m, n, k))
    t = float(hw.tile)
    mt, nt = np.ceil(m / t), np.ceil(n / t)
    q = (m * n) / (mt * nt * t * t)
    fill = 0.0
    if hw.units:
        tiles = mt * nt * batch
        split_k = np.clip(np.floor(hw.units / tiles), 1.0, np.maximum(1.0, np.floor(k / (2 * t))))
        work = tiles * split_k
        waves = np.ceil(work / hw.units)
        q = q * work / (waves * hw.units)
        fill = waves * TILE_FILL_S  # each wave of output tiles fills its K pipeline and stores its tile once
    flops = 2.0 * m * n * k * batch
    compute = flops / (peak * hw.gemm_eff * q) + fill
    memory = elem * (m * k + k * n + m * n) * batch / hw.mem_bw
    return np.maximum(compute, memory) + hw.overhead_s


def gemm_fwd_bwd(hw: Hardware, m: Any, n: Any, k: Any, peak: Any, elem: Any, batch: Any = 1) -> tuple[Any, Any]:
    """Forward Y=XW (m,n,k); backward dX (m,k,n) + dW (k,n,m): 2x the forward FLOPs (standard backprop)."""
    fwd = gemm_time(hw, m, n, k, peak, elem, batch)
    bwd = gemm_time(hw, m, k, n, peak, elem, batch) + gemm_time(hw, k, n, m, peak, elem, batch)
    return fwd, bwd


def stream_time(hw: Hardware, nbytes: Any, kernels: Any = 1) -> Any:
    """bytes / (BW * efficiency) + kernels * launch: memory-bound ops (norms, activations, softmax) (roofline)."""
    return nbytes / hw.mem_bw + kernels * hw.overhead_s


def dispatch_floor(hw: Hardware, device_s: Any, ops: Any) -> Any:
    """max(device time, ops * host dispatch): eager PyTorch issues one op at a time; no CUDA graphs (PyTorch dispatcher)."""
    return np.maximum(device_s, ops * hw.dispatch_s) if hw.dispatch_s else device_s


def gemm_peak(hw: Hardware, peak: Any, fp8: Any) -> Any:
    """The rate the GEMMs run at: the device's fp8 rate where ``fp8`` (fp8-mixed), else ``peak`` (Transformer Engine)."""
    return np.where(fp8, hw.peak[FP8], peak) if np.any(fp8) else peak
