"""The hardware view the cost terms read (``Hardware``, derived once from a ClusterSpec) and the constants they
share: element bytes by precision, the allocator's margin, offload codes, and the order statistics of a
synchronous step (the slowest of N devices, the busiest of N expert ranks). Pure numpy, SI units."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_autopar.specs import PRECISIONS, ClusterSpec, RuntimeCosts

GIB = float(2**30)
# Arrays below are indexed by precision (specs.PRECISIONS): fp32, bf16-mixed, fp16-mixed, fp8-mixed. fp8-mixed is
# Transformer Engine's recipe: fp8 GEMM inputs, everything else (activations kept, weights, grads, attention) bf16.
ACT_BYTES = np.array([4.0, 2.0, 2.0, 2.0])  # activation / matmul element bytes by precision index
WEIGHT_BYTES = ACT_BYTES  # ZeRO accounting: 2-byte weights and grads in mixed precision, 4 in fp32
OPTIM_BYTES = np.array([8.0, 12.0, 12.0, 12.0])  # Adam: m, v (fp32) [+ fp32 master copy when mixed]
FRAGMENTATION = 0.10  # caching-allocator margin on the dynamic part (activations, buffers)
GRAD_REDUCE_BYTES = np.array([4.0, 4.0, 4.0, 4.0])  # gradients are reduced in fp32 (FSDP2 reduce_dtype; Megatron default)
CONV_OF_GEMM = 0.8  # implicit-GEMM convolution rate / GEMM rate when a device gives no conv_efficiency (derived_conv_efficiency)
FP8 = 3  # precision index of fp8-mixed: its GEMMs run at the device's fp8 rate (PeakTflops.fp8)
BASE_PREC = np.array([0, 1, 2, 1])  # the precision everything but the GEMMs runs in (fp8-mixed: bf16)
OFFLOAD_OPTIMIZER, OFFLOAD_PARAMS = 1, 2  # specs.OFFLOAD_MODES codes (0: none)


def prec_index(precision: str) -> int:
    return PRECISIONS.index(precision)


# ============================================================================================ hardware view


@dataclass(frozen=True)
class Hardware:
    """The numbers the cost terms use, derived once from a ClusterSpec (SI units)."""

    peak: np.ndarray  # FLOP/s by precision index
    mem_bw: float  # achieved streaming bandwidth, B/s
    gemm_eff: float
    units: int
    tile: int
    overhead_s: float
    capacity: float  # bytes per device
    reserved: float  # bytes not usable by tensors
    dpn: int  # devices per node
    nodes: int
    intra_bw: float  # B/s per device one direction, after protocol efficiency
    intra_lat: float
    intra_mesh: bool
    inter_bw: float
    inter_lat: float
    overlap: float = 1.0  # share of compute that can hide communication
    attn_fwd: float = 0.0  # fused attention efficiency at head_dim 128 (0: derived from gemm_eff)
    attn_bwd: float = 0.0
    comm_sm: float = 0.0  # compute share lost while a collective runs concurrently
    dispatch_s: float = 0.0  # host time per eager op
    conv_eff: float = 0.0  # fraction of peak a convolution sustains (unit form; derived_conv_efficiency)
    runtime: RuntimeCosts = field(default_factory=RuntimeCosts)  # the runtime's measured fixed costs (runtime_fixed_time)
    fused_ew: bool = False  # the stack fuses the blocks' element-wise ops (DeviceSpec.fused_elementwise)
    rs_factor: float = 1.0  # reduce-scatter time / all-gather time (LinkSpec.reduce_scatter_factor, inner level)
    compile_fuses: bool = False  # torch.compile fuses element-wise ops on this device (DeviceSpec.compile_fuses)
    host_link: float = 0.0  # device <-> host copy bandwidth, B/s one direction (0: no separate host; offload saves nothing)
    host_bw: float = 0.0  # host DRAM bandwidth per device, B/s (the host optimizer step; 0: the device's own mem_bw)
    host_device: bool = False  # the device is the host CPU (its eager ops run in line: fsdp_unit_seconds)

    @staticmethod
    def from_cluster(cluster: ClusterSpec) -> "Hardware":
        dev = cluster.device
        pk = dev.peak_tflops
        fp32 = pk.fp32 or pk.bf16 or pk.fp16
        peaks = np.array([fp32, pk.bf16 or pk.fp16 or fp32, pk.fp16 or pk.bf16 or fp32,
                          pk.fp8 or pk.bf16 or pk.fp16 or fp32]) * 1e12  # fp8: none on the device -> bf16 rate
        inner, outer = cluster.links[0], cluster.links[-1]
        slow = slowest_device_factor(cluster.world_size, dev.throughput_cv)
        return Hardware(
            peak=peaks,
            mem_bw=dev.memory_bandwidth_gbs * 1e9 * dev.memory_efficiency,
            gemm_eff=dev.gemm_efficiency * slow,
            units=int(dev.compute_units),
            tile=max(1, int(dev.tile)),
            overhead_s=dev.kernel_overhead_us * 1e-6,
            capacity=dev.memory_gib * GIB,
            reserved=dev.reserved_gib * GIB,
            dpn=cluster.devices_per_node,
            nodes=cluster.nodes,
            intra_bw=inner.bandwidth_gbs * 1e9 * inner.efficiency,
            intra_lat=inner.latency_us * 1e-6,
            intra_mesh=inner.topology == "mesh",
            inter_bw=outer.bandwidth_gbs * 1e9 * outer.efficiency,
            inter_lat=outer.latency_us * 1e-6,
            overlap=min(max(dev.comm_overlap, 0.0), 1.0),
            attn_fwd=max(dev.attention_efficiency, 0.0) * slow,
            attn_bwd=max(dev.attention_bwd_efficiency, 0.0) * slow,
            comm_sm=min(max(dev.comm_sm_fraction, 0.0), 0.9),
            dispatch_s=max(dev.dispatch_us, 0.0) * 1e-6,
            conv_eff=derived_conv_efficiency(dev.conv_efficiency, dev.gemm_efficiency) * slow,
            runtime=cluster.runtime,
            fused_ew=bool(dev.fused_elementwise),
            rs_factor=max(inner.reduce_scatter_factor, 0.0) or 1.0,
            compile_fuses=bool(dev.compile_fuses),
            host_link=max(dev.host_link_gbs, 0.0) * 1e9,
            host_bw=max(dev.host_memory_bandwidth_gbs, 0.0) * 1e9,
            host_device=dev.name.lower().startswith("cpu"),  # configs/cluster/cpu.yaml, topology.discover's "cpu"
        )


def derived_conv_efficiency(conv_efficiency: float, gemm_efficiency: float) -> float:
    """conv_efficiency, else CONV_OF_GEMM * gemm_efficiency: implicit-GEMM convolution (cuDNN, CUTLASS) is a GEMM whose
    A operand is gathered on the fly (im2col in the main loop), losing address arithmetic and tile reuse at the
    image borders; 0.8 is a first-principles estimate of that loss, not a measured figure (a preset overrides it)."""
    return conv_efficiency if conv_efficiency > 0 else CONV_OF_GEMM * gemm_efficiency


def slowest_device_factor(world: int, cv: float) -> float:
    """1 - z_N*cv: a synchronous step runs at the slowest of N devices whose rates spread by cv (order statistics; Sinha et al. SC'22)."""
    if cv <= 0 or world <= 1:
        return 1.0
    return float(max(1.0 - normal_max_quantile(world) * cv, 0.5))


# ============================================================================================ order statistics


def normal_max_quantile(n: Any) -> Any:
    """Phi^-1((n-0.375)/(n+0.25)): expected max of n standard normals (Blom 1958), Phi^-1 by Abramowitz-Stegun 26.2.23."""
    n = np.maximum(np.asarray(n, dtype=float), 1.0)
    tail = 1.0 - (n - 0.375) / (n + 0.25)
    t = np.sqrt(-2.0 * np.log(np.clip(tail, 1e-12, 0.5)))
    z = t - (2.515517 + 0.802853 * t + 0.010328 * t * t) / (1 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t ** 3)
    return np.where(n > 1, np.maximum(z, 0.0), 0.0)


def moe_load_imbalance(mean_load: Any, ranks: Any) -> Any:
    """E[max]/mean of n multinomial loads (uniform routing) = 1 + z_n/sqrt(mu): loads - mu ~ sqrt(mu)*(Z_i - mean Z) (Poisson split)."""
    mu = np.maximum(np.asarray(mean_load, dtype=float), 1.0)
    return 1.0 + normal_max_quantile(ranks) / np.sqrt(mu)
