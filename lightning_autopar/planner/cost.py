"""Cost terms of the planner: compute, communication, pipeline and memory, each a small named function.

Every function is pure numpy and broadcasts over arrays of candidates, so the search prices whole
columns of plans at once. Units: seconds, bytes, FLOPs. Each docstring gives the formula and its
source on one line. Constants that are not datasheet figures are first-principles estimates and say so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_autopar.specs import PRECISIONS, ClusterSpec, ModelSpec, RuntimeCosts

GIB = float(2**30)
# Arrays below are indexed by precision (specs.PRECISIONS): fp32, bf16-mixed, fp16-mixed, fp8-mixed. fp8-mixed is
# Transformer Engine's recipe: fp8 GEMM inputs, everything else (activations kept, weights, grads, attention) bf16.
ACT_BYTES = np.array([4.0, 2.0, 2.0, 2.0])  # activation / matmul element bytes by precision index
WEIGHT_BYTES = ACT_BYTES  # ZeRO accounting: 2-byte weights and grads in mixed precision, 4 in fp32
OPTIM_BYTES = np.array([8.0, 12.0, 12.0, 12.0])  # Adam: m, v (fp32) [+ fp32 master copy when mixed]
DDP_BUCKET_BYTES = 25e6  # torch DDP bucket_cap_mb default
FRAGMENTATION = 0.10  # caching-allocator margin on the dynamic part (activations, buffers)
FLASH_BLOCK = 128  # query/key block of fused attention kernels: causal work is (nb+1)/(2nb) of full
FLASH_CTAS_PER_SM = 2  # FA2 head_dim 128: 4 warps, ~64 KB shared memory per CTA, so two CTAs fit on one SM
SOFTMAX_EQUIV_FLOPS = 32.0  # exp on the special-function unit costs ~32 matmul FLOPs per score element
                            # (tensor-core FLOP/clk over 4x SFU op/clk, A100: 2048/(4*16)); FlashAttention-3 s.3
KERNELS_PER_MOE_FWD = 12  # router, softmax, top-k, permute, unpermute, index ops (per MoE block, plus experts)
KERNELS_PER_LOOP_EXPERT = 4  # a plain MoE loop, per expert: where(ids == e), gather rows, weight multiply, index_add
TILE_FILL_S = 1.0e-6  # per wave of GEMM tiles: K-pipeline fill (~one HBM round trip, 0.6-0.8 us) + epilogue store
ATTN_REF_HEAD_DIM = 128  # head_dim at which the presets' attention efficiencies are quoted (FA2/FA3 benchmarks)
GRAD_REDUCE_BYTES = np.array([4.0, 4.0, 4.0, 4.0])  # gradients are reduced in fp32 (FSDP2 reduce_dtype; Megatron default)
GRAD_ACC_BYTES = np.array([12.0, 10.0, 10.0, 10.0])  # per param per micro-batch: read grad (4|2), read+write fp32 accumulator
CONV_OF_GEMM = 0.8  # implicit-GEMM convolution rate / GEMM rate when a device gives no conv_efficiency (derived_conv_efficiency)
FP8 = 3  # precision index of fp8-mixed: its GEMMs run at the device's fp8 rate (PeakTflops.fp8)
BASE_PREC = np.array([0, 1, 2, 1])  # the precision everything but the GEMMs runs in (fp8-mixed: bf16)
FP8_CAST_BYTES = 4.0  # per element quantised for an fp8 GEMM: read bf16 2 B, write fp8 1 B twice (x and x^T)
UNIT_BWD = 2.0  # backward / forward of a unit: dX and dW each cost a forward's FLOPs; norm/activation grads ~2x traffic
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


# ============================================================================================ FLOPs (analytic)


def qkv_flops(m: ModelSpec, tokens: Any) -> Any:
    """2*T*h*(h + 2*kv*d): Q, K, V projections (Narayanan et al. 2021, GQA per Ainslie et al. 2023)."""
    return 2 * tokens * m.hidden * (m.hidden + 2 * m.kv_heads * m.head_dim)


def out_proj_flops(m: ModelSpec, tokens: Any) -> Any:
    """2*T*h*h: attention output projection (Narayanan et al. 2021)."""
    return 2 * tokens * m.hidden * m.hidden


def attention_core_flops(m: ModelSpec, batch: Any, seq: Any, causal_fraction: Any = 1.0) -> Any:
    """4*b*s^2*h * causal_fraction: Q@K^T and P@V (Narayanan et al. 2021; fused kernels skip masked blocks)."""
    return 4 * batch * seq * seq * m.hidden * causal_fraction


def mlp_flops(m: ModelSpec, tokens: Any) -> Any:
    """2*T*h*f * n_matrices (2 for gelu, 3 for swiglu; Shazeer 2020)."""
    return 2 * tokens * m.hidden * m.ffn_hidden * m.ffn_matrices


def moe_flops(m: ModelSpec, tokens: Any) -> Any:
    """2*T*h*E (router) + top_k * MLP(T) (Fedus et al. 2021, no dropped tokens)."""
    return 2 * tokens * m.hidden * m.experts + m.top_k * mlp_flops(m, tokens)


def lm_head_flops(m: ModelSpec, tokens: Any) -> Any:
    """2*T*h*V: the output projection onto the vocabulary (Narayanan et al. 2021)."""
    return 2 * tokens * m.hidden * m.vocab


def forward_flops(m: ModelSpec, batch: Any, seq: Any, causal_fraction: Any = 1.0) -> Any:
    """Sum over blocks of attention + MLP/MoE, plus the LM head (embedding lookup has no FLOPs)."""
    tokens = batch * seq
    attn = qkv_flops(m, tokens) + out_proj_flops(m, tokens) + attention_core_flops(m, batch, seq, causal_fraction)
    dense = m.layers - m.moe_layers
    return (m.layers * attn + dense * mlp_flops(m, tokens) + m.moe_layers * moe_flops(m, tokens)
            + lm_head_flops(m, tokens))


def model_flops_per_token(m: ModelSpec, seq: int) -> float:
    """3 x forward FLOPs per token, full s^2 attention, no recompute: the MFU numerator (Chowdhery et al. 2022)."""
    return 3.0 * forward_flops(m, 1, seq) / seq


def causal_fraction(seq_kv: Any) -> Any:
    """(nb+1)/(2*nb), nb = s/block: share of score blocks a causal fused kernel computes (Dao 2023)."""
    nb = np.maximum(np.asarray(seq_kv, dtype=float) / FLASH_BLOCK, 1.0)
    return (nb + 1) / (2 * nb)


# ============================================================================================ compute time


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


def attention_efficiency(hw: Hardware, head_dim: int, backward: bool = False) -> float:
    """eta(128) * [d/(d+32)] / [128/160]: device kernel rate at head_dim 128 (FA2: Dao 2023; FA3: Shah et al. 2024), exp share by d."""
    share = head_dim / (head_dim + SOFTMAX_EQUIV_FLOPS)
    ref = ATTN_REF_HEAD_DIM / (ATTN_REF_HEAD_DIM + SOFTMAX_EQUIV_FLOPS)
    fwd = hw.attn_fwd * share / ref if hw.attn_fwd else hw.gemm_eff * share  # no kernel figure: matmul rate less exp
    if backward and hw.attn_bwd:
        return hw.attn_bwd * share / ref
    return fwd


def attention_work_quantisation(hw: Hardware, mbs: Any, heads: Any, sq: Any, seq: Any) -> Any:
    """n/(n+1) * wave: each (batch, head, 128-row block) CTA streams n causal K/V blocks + ~1 block of Q load / O store (Dao 2023)."""
    if not hw.units:
        return 1.0
    nq = np.maximum(np.ceil(np.asarray(sq, dtype=float) / FLASH_BLOCK), 1.0)
    n_kv = np.maximum(np.asarray(seq, dtype=float) / FLASH_BLOCK, 1.0) * causal_fraction(seq)  # mean blocks visited
    items = np.maximum(mbs * heads * nq, 1.0)
    slots = hw.units * FLASH_CTAS_PER_SM
    wave = items / (np.ceil(items / slots) * slots)
    return n_kv / (n_kv + 1.0) * wave


def cp_attention_calls(cp: Any) -> Any:
    """4 attention kernel calls per layer with cp > 1 (1 without): each of a rank's two query chunks attends to
    the keys before it in one call and to its own chunk causally in another (parallel/context.py
    ``_ChunkedCausalAttention``; rank 0's first chunk has none before it, and the step waits for the slowest
    rank)."""
    return np.where(np.asarray(cp, dtype=float) > 1, 4.0, 1.0)


def attention_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, peak: Any, elem: Any,
                   fused: bool = True) -> tuple[Any, Any]:
    """Fused: 4b(s/cp)s(h/tp)*causal at the kernel's fwd/bwd rate (bwd 2.5x FLOPs) x work quantisation (Dao 2023); unfused: 3 s^2 passes.
    With cp > 1 a rank's two load-balanced query chunks meet the gathered keys chunk by chunk without a mask
    (parallel/context.py ``_ChunkedCausalAttention``): the same causal share of the score blocks, in ``cp_attention_calls``
    kernel calls (each with its launch overhead) whose partial outputs are merged by log-sum-exp."""
    d = m.head_dim
    sq = seq / cp
    heads = m.heads / tp
    calls = cp_attention_calls(cp)
    if fused:
        flops = 4.0 * mbs * heads * sq * seq * d * causal_fraction(seq)
        quant = attention_work_quantisation(hw, mbs, heads, sq, seq)
        q_elems = mbs * sq * heads * d
        io = elem * (2 * q_elems + 2 * mbs * sq * m.kv_heads / tp * d)  # q, k, v in, o out
        # the log-sum-exp merge: each extra call's fp32 partial output read and rescaled into the running one
        merge = (calls - 1) * q_elems * 4 * 3 / hw.mem_bw
        fwd = np.maximum(flops / (peak * attention_efficiency(hw, d) * quant), io / hw.mem_bw) + merge + calls * hw.overhead_s
        # backward: dq, dk, dv from q, k, v, o, do (2x io), plus the softmax-dot preprocess (read o, do) and the
        # fp32 dq accumulator's conversion (read 4, write e): two more kernels (FlashAttention-2 backward)
        side = q_elems * (2 * elem + 4 + elem) / hw.mem_bw  # the two side kernels run before / after the main one
        bwd = (np.maximum(2.5 * flops / (peak * attention_efficiency(hw, d, backward=True) * quant), 2 * io / hw.mem_bw)
               + calls * side + 3 * calls * hw.overhead_s)
        return fwd, bwd
    batch = mbs * heads
    f1, b1 = gemm_fwd_bwd(hw, sq, seq, d, peak, elem, batch)
    f2, b2 = gemm_fwd_bwd(hw, sq, d, seq, peak, elem, batch)
    scores = mbs * heads * sq * seq
    soft = stream_time(hw, 3 * 4.0 * scores, 3)
    return f1 + f2 + soft, b1 + b2 + 2 * soft


def block_memory_ops(m: ModelSpec, tp: Any, sp: Any, fused: bool = False, elem: Any = 2.0) -> tuple[Any, Any, Any, Any]:
    """(fwd, bwd) elements of ``elem`` bytes per token per block + kernels: 2 norms, residual adds, attn-out copy,
    activation, RoPE if swiglu (eager PyTorch; ``fused``: the Transformer Engine / Megatron fused kernels).

    The norms as norm_traffic prices them (an eager RMSNorm's fp32 passes do not scale with ``elem``).
    Eager (autopar's runtime, HF Llama, torchtitan): fwd 2 residual adds (read 2, write 1: 3h), the attention
    output's transpose-copy (2h/tp), the activation (gelu r+w 2f; silu 2f + mul 3f), RoPE cat/mul/mul/add on q and k
    (7 passes); bwd the residual grad sums (3h), the copy, the activation (gelu x, dy -> dx 3f; swiglu three
    products 9f), RoPE the same 7 passes. Fused (TE ``fused_attn`` writes its output in the [s, b, h] layout the
    out projection reads: no copy; Megatron ``bias_swiglu``: read 2f, write f, bwd read 3f, write 2f, one kernel;
    TE ``fused_rope``: read + write q and k once, one kernel each; ``bias_dropout_add``: one kernel per add)."""
    h, f, kvd = m.hidden, m.ffn_hidden / tp, m.kv_heads * m.head_dim / tp
    rep = h / np.where(sp, tp, 1)  # replicated along TP unless sequence-parallel
    llama = m.ffn_kind == "swiglu"
    nf, nb, nk_f, nk_b = norm_traffic(m, elem, fused)
    norm_f, norm_b = 2 * rep * nf / elem, 2 * rep * nb / elem
    if fused:
        fwd = norm_f + 2 * 3 * rep + (3 * f if llama else 2 * f) + (2 * (h / tp + kvd) if llama else 0)
        bwd = norm_b + 2 * 3 * rep + (5 * f if llama else 3 * f) + (2 * (h / tp + kvd) if llama else 0)
        kernels = 2 + 1 + (2 if llama else 0)
        return fwd, bwd, 2 * nk_f + kernels, 2 * nk_b + kernels
    fwd = norm_f + 2 * 3 * rep + 2 * h / tp + (5 * f if llama else 2 * f) + (7 * (h / tp + kvd) if llama else 0)
    bwd = norm_b + 2 * 3 * rep + 2 * h / tp + (9 * f if llama else 3 * f) + (7 * (h / tp + kvd) if llama else 0)
    k_fwd = 2 + 1 + (2 if llama else 1) + (8 if llama else 0)
    k_bwd = 2 + 1 + (3 if llama else 1) + (8 if llama else 0)
    return fwd, bwd, 2 * nk_f + k_fwd, 2 * nk_b + k_bwd


def norm_traffic(m: ModelSpec, elem: Any, fused: bool = False) -> tuple[Any, Any, Any, Any]:
    """(fwd, bwd) bytes per normalised element + (fwd, bwd) kernels of one norm: LayerNorm / fused, or eager RMSNorm.

    nn.LayerNorm (models.GPT, gelu presets) and a fused norm (``fused``: TE / Apex) are one kernel: fwd read x,
    write y (2e); bwd read x, dy, write dx (3e) + the weight-grad pass reading x, dy (2e), two kernels.
    A swiglu model's RMSNorm runs eagerly (HF ``LlamaRMSNorm``, torchtitan ``RMSNorm``): x.float(), pow(2),
    mean(-1), +eps, rsqrt, mul, .to(bf16), weight mul -- fwd 2(e+4) [the casts] + 20 + 2e bytes in 8 kernels (36 B
    at e=2); autograd's backward: grad*w, grad*y and its sum (6e), the casts back (2(e+4)), grad*x32 + sum, grad*r,
    mean's expand/N, pow's 2*x^1 (copy, mul, mul), the two-path add (68) in 16 kernels (92 B at e=2). The casts
    are no-ops in fp32 (e=4): 28 / 92 B in 6 / 14 kernels. Counted op by op with a TorchDispatchMode over
    LlamaRMSNorm (transformers 5.24, torch 2.13); the [T, 1] statistics' ops carry no bytes at these sizes."""
    e = np.asarray(elem, dtype=float)
    if fused or m.ffn_kind != "swiglu":
        return 2 * e, 5 * e, 1, 2
    casts = np.where(e < 4, 2 * (e + 4), 0.0)
    cast_k = np.where(e < 4, 2, 0)
    return casts + 20 + 2 * e, casts + 6 * e + 68, 6 + cast_k, 14 + cast_k


def dispatch_floor(hw: Hardware, device_s: Any, ops: Any) -> Any:
    """max(device time, ops * host dispatch): eager PyTorch issues one op at a time; no CUDA graphs (PyTorch dispatcher)."""
    return np.maximum(device_s, ops * hw.dispatch_s) if hw.dispatch_s else device_s


@dataclass
class BlockTimes:
    """Per micro-batch times of one block on one device (arrays over candidates)."""

    fwd: Any
    bwd: Any
    attn_fwd: Any  # the attention core alone (what selective recompute redoes)


def gemm_peak(hw: Hardware, peak: Any, fp8: Any) -> Any:
    """The rate the GEMMs run at: the device's fp8 rate where ``fp8`` (fp8-mixed), else ``peak`` (Transformer Engine)."""
    return np.where(fp8, hw.peak[FP8], peak) if np.any(fp8) else peak


def fp8_cast_time(hw: Hardware, m: ModelSpec, tokens: Any, tp: Any, sp: Any, fused: bool = False) -> tuple[Any, Any]:
    """FP8_CAST_BYTES per quantised element: fwd the inputs of qkv, out, up, down; bwd their output grads (TE cast_transpose).

    An fp8 GEMM takes fp8 operands, and Hopper's fp8 tensor cores take only the TN layout, so Transformer Engine
    writes each quantised tensor twice, as is and transposed (the wgrad GEMM reads the transpose): read 2 B, write
    1+1 B per element (TE ``cast_transpose``; Micikevicius et al. 2022, "FP8 formats for deep learning", s. 4).
    Forward: the qkv and up inputs (h per token, h/tp with SP), the out input (h/tp) and the down input (f/tp);
    backward: the grads of the qkv output ((h+2kvd)/tp), out output (h, h/tp with SP), up/gate output (f/tp each)
    and down output (h, h/tp with SP). Weights are quantised once per step (cached across micro-batches) and not
    priced here; the amax reductions ride on these kernels.
    ``fused`` (TE LayerNormLinear / LayerNormMLP): the norm writes the qkv and up inputs in fp8 and the activation
    the down input, and the activation's backward writes the up/gate grads in fp8 (``dswiglu_cast_transpose``): only
    the out input's cast (fwd) and the qkv, out and down output grads' (bwd) remain separate kernels.
    """
    h, f, kvd = m.hidden, m.ffn_hidden / tp, m.kv_heads * m.head_dim / tp
    rep = h / np.where(sp, tp, 1)
    if fused:
        fwd, k_f = tokens * (h / tp) * FP8_CAST_BYTES, 1
        bwd, k_b = tokens * ((h / tp + 2 * kvd) + 2 * rep) * FP8_CAST_BYTES, 3
        return stream_time(hw, fwd, k_f), stream_time(hw, bwd, k_b)
    fwd = tokens * (2 * rep + h / tp + f) * FP8_CAST_BYTES
    bwd = tokens * ((h / tp + 2 * kvd) + 2 * rep + (m.ffn_matrices - 1) * f) * FP8_CAST_BYTES
    return stream_time(hw, fwd, 4), stream_time(hw, bwd, 4)


def dense_block_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, sp: Any, peak: Any,
                     elem: Any, fused: bool = True, fp8: Any = False) -> BlockTimes:
    """Sum of the block's matmuls (q, k, v, out, MLP; split by TP), attention core and memory-bound ops, fwd and bwd (Megatron layout).

    ``fp8`` (fp8-mixed): the matmuls run at the fp8 rate and pay their operand casts (fp8_cast_time); ``peak`` is
    then the bf16 rate the attention core and everything else run at (Transformer Engine)."""
    T = mbs * seq / cp
    h, kvd = m.hidden, m.kv_heads * m.head_dim
    gp = gemm_peak(hw, peak, fp8)
    fq, bq = gemm_fwd_bwd(hw, T, h / tp, h, gp, elem)  # q, k, v: three projections (models.GPT, HF Llama)
    fk, bk = gemm_fwd_bwd(hw, T, kvd / tp, h, gp, elem)
    f1, b1 = fq + 2 * fk, bq + 2 * bk
    f2, b2 = gemm_fwd_bwd(hw, T, h, h / tp, gp, elem)
    fa, ba = attention_time(hw, m, mbs, seq, tp, cp, peak, elem, fused)
    mf, mb = mlp_time(hw, m, T, m.ffn_hidden / tp, gp, elem)
    ew_f, ew_b, k_f, k_b = block_memory_ops(m, tp, sp, hw.fused_ew, elem)
    ef = stream_time(hw, T * ew_f * elem, k_f)
    eb = stream_time(hw, T * ew_b * elem, k_b)
    if np.any(fp8):
        cf, cb = fp8_cast_time(hw, m, T, tp, sp, hw.fused_ew)
        ef, eb = ef + np.where(fp8, cf, 0.0), eb + np.where(fp8, cb, 0.0)
        k_f, k_b = k_f + np.where(fp8, 1 if hw.fused_ew else 4, 0), k_b + np.where(fp8, 3 if hw.fused_ew else 4, 0)
    gemms = 4 + m.ffn_matrices  # q, k, v, out, up(/gate), down
    fwd = dispatch_floor(hw, f1 + f2 + fa + mf + ef, gemms + 1 + k_f)
    bwd = dispatch_floor(hw, b1 + b2 + ba + mb + eb, 2 * gemms + 3 + k_b)
    return BlockTimes(fwd, bwd, fa)


def compiled_block_time(hw: Hardware, eager: BlockTimes, fused: BlockTimes | None, compile: Any) -> BlockTimes:
    """A block's time with ``compile`` (plan.compile, per candidate): what inductor removes is the element-wise
    and norm memory traffic between the GEMMs and their per-op launches (Ansel et al. 2024, "PyTorch 2", ASPLOS:
    pointwise/reduction fusion; torchtitan per-block compile).

    Measured (``RuntimeCosts.compile_speedup`` s > 0, eager/compiled fwd+bwd of one block at set-up): eager / s.
    Else on a device where compile fuses (``Hardware.compile_fuses``, the GPU presets): ``fused``, the block priced
    with fused element-wise traffic and kernel counts (block_memory_ops / norm_traffic ``fused``), never above
    eager. Else (a CPU cluster, no measurement): eager -- compile=true is not predicted faster blindly. The
    compile warm-up is set-up time, not step time."""
    speedup = hw.runtime.compile_speedup
    if speedup > 0:
        now = BlockTimes(eager.fwd / speedup, eager.bwd / speedup, eager.attn_fwd / speedup)
    elif fused is not None and hw.compile_fuses:
        now = BlockTimes(np.minimum(fused.fwd, eager.fwd), np.minimum(fused.bwd, eager.bwd), fused.attn_fwd)
    else:
        return eager
    pick = lambda a, b: np.where(compile, a, b)  # noqa: E731
    return BlockTimes(pick(now.fwd, eager.fwd), pick(now.bwd, eager.bwd), pick(now.attn_fwd, eager.attn_fwd))


def compile_hardware(hw: Hardware) -> Hardware:
    """``hw`` as a compiled block sees it: element-wise ops fused (``fused_ew``), for compiled_block_time."""
    return dataclasses.replace(hw, fused_ew=True)


def async_tp_exposed(hw: Hardware, tp_f: Any, tp_b: Any, block: BlockTimes, tp: Any, on: Any) -> tuple[Any, Any]:
    """Exposed TP collectives of a block with async TP where ``on`` (compile, tp > 1, sp, a device where compile
    fuses; torch's micro-pipelined TP, CUDA symmetric memory): each all-gather -> matmul and matmul ->
    reduce-scatter is split into tp steps so one step's transfer overlaps the previous step's partial matmul
    (Wang et al. 2023, "Overlap communication with dependent computation via decomposition", ASPLOS; torchtitan
    async TP): exposed = overlapped_exposed(c, W, c/tp, comm_sm), W the block's time outside the attention core
    (its TP matmuls; backward 2.5x the core), c/tp the first step's transfer that nothing hides."""
    def one(comm: Any, window: Any) -> Any:
        hidden = overlapped_exposed(comm, hw.overlap * np.maximum(window, 0.0), comm / np.maximum(tp, 1), hw.comm_sm)
        return np.where(on, hidden, comm)
    return one(tp_f, block.fwd - block.attn_fwd), one(tp_b, block.bwd - 2.5 * block.attn_fwd)


def mlp_time(hw: Hardware, m: ModelSpec, tokens: Any, ffn_local: Any, peak: Any, elem: Any,
             batch: Any = 1) -> tuple[Any, Any]:
    """(n_matrices-1) up/gate GEMMs (T, f/tp, h) + down GEMM (T, h, f/tp), fwd and bwd (Shazeer 2020)."""
    uf, ub = gemm_fwd_bwd(hw, tokens, ffn_local, m.hidden, peak, elem, batch)
    df, db = gemm_fwd_bwd(hw, tokens, m.hidden, ffn_local, peak, elem, batch)
    up = m.ffn_matrices - 1
    return up * uf + df, up * ub + db


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


def moe_block_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, ep: Any, sp: Any, peak: Any,
                   elem: Any, fused: bool = True, fp8: Any = False) -> BlockTimes:
    """Dense attention + router GEMM (T,E,h) + E/ep expert GEMMs in turn on T*k*ep/E*imbalance tokens (f/tp wide) + permutes (GShard)."""
    dense = dense_block_time(hw, m, mbs, seq, tp, cp, sp, peak, elem, fused, fp8)
    T = mbs * seq / cp
    peak = gemm_peak(hw, peak, fp8)  # the router and expert GEMMs (their casts stay priced as the dense MLP's)
    mlp_f, mlp_b = mlp_time(hw, m, T, m.ffn_hidden / tp, peak, elem)
    T_rank = T / np.where(sp, tp, 1)
    rf, rb = gemm_fwd_bwd(hw, T_rank, m.experts, m.hidden, peak, elem)
    local = m.experts / ep
    # experts are TP-split (f/tp) and see all T*k routed tokens of the TP group (gathered back when SP); the
    # busiest EP rank (expected max of ep multinomial loads) sets the pace of the synchronous all-to-all
    imb = moe_load_imbalance(T * m.top_k, ep)
    per_expert = np.maximum(T * m.top_k * ep / m.experts * imb, 1.0)
    ef, eb = mlp_time(hw, m, per_expert, m.ffn_hidden / tp, peak, elem)  # one GEMM per local expert, no grouped GEMM
    act = stream_time(hw, local * per_expert * (5 if m.ffn_kind == "swiglu" else 2) * m.ffn_hidden / tp * elem,
                      local * (2 if m.ffn_kind == "swiglu" else 1))  # the experts' activations (as in a dense MLP)
    act_b = stream_time(hw, local * per_expert * (9 if m.ffn_kind == "swiglu" else 3) * m.ffn_hidden / tp * elem,
                        local * (3 if m.ffn_kind == "swiglu" else 1))
    # gather to experts, weighted scatter-add back (read+write T*k*h each), fp32 router softmax/top-k over T*E
    perm = stream_time(hw, 4 * T_rank * m.top_k * m.hidden * elem * imb + 12 * T_rank * m.experts,
                       KERNELS_PER_MOE_FWD + 3 * local)
    ew_mlp_f, ew_mlp_b = block_mlp_act(hw, m, T, tp, elem)
    fwd = dense.fwd - mlp_f - ew_mlp_f + rf + local * ef + act + perm
    if m.moe_replay:
        fwd = fwd + np.where(np.asarray(ep) > 1, moe_replay_time(hw, m, T_rank, peak, elem), 0.0)
    bwd = dense.bwd - mlp_b - ew_mlp_b + rb + local * eb + act_b + 2 * perm
    return BlockTimes(fwd, bwd, dense.attn_fwd)


def moe_replay_time(hw: Hardware, m: ModelSpec, tokens: Any, peak: Any, elem: Any) -> Any:
    """Forward time a plain-loop MoE layer adds under ep > 1: its forward runs twice (capture, then replay around
    one exchange: parallel.experts.PlainExpertForward), so once more the router GEMM (T,E,h), the gathers of the
    routed rows and the scatter-add back (read+write T*k*h each, as ``perm`` in moe_block_time), the fp32
    softmax/top-k over T*E, and the loop's KERNELS_PER_LOOP_EXPERT launches for each of the E experts. No backward
    term: the capture pass's output is discarded; only its row gathers are differentiated, as one pass would."""
    router = gemm_time(hw, tokens, m.experts, m.hidden, peak, elem)
    loop = stream_time(hw, 4 * tokens * m.top_k * m.hidden * elem + 12 * tokens * m.experts,
                       KERNELS_PER_MOE_FWD + KERNELS_PER_LOOP_EXPERT * m.experts)
    return router + loop


def block_mlp_act(hw: Hardware, m: ModelSpec, tokens: Any, tp: Any, elem: Any) -> tuple[Any, Any]:
    """The dense MLP's activation traffic inside block_memory_ops (gelu 2f/3f, swiglu 5f/9f per token; fused swiglu
    3f/5f), to swap for experts'."""
    f = m.ffn_hidden / tp
    swi = m.ffn_kind == "swiglu"
    fwd, bwd = ((3, 5) if hw.fused_ew else (5, 9)) if swi else (2, 3)
    return tokens * f * fwd * elem / hw.mem_bw, tokens * f * bwd * elem / hw.mem_bw


def embedding_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, cp: Any, elem: Any, tp: Any = 1) -> tuple[Any, Any]:
    """Lookup r+w T*h (fwd); bwd zero-fills the dense V/tp*h weight grad, then scatter-adds T*h (PyTorch embedding_dense_backward)."""
    T = mbs * seq / cp
    f = stream_time(hw, 2 * T * m.hidden * elem, 2)
    return f, stream_time(hw, 3 * T * m.hidden * elem + m.vocab / tp * m.hidden * elem, 5)


def head_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, peak: Any, elem: Any) -> tuple[Any, Any]:
    """Final norm (norm_traffic) + LM head GEMM (T, V/tp, h) + fp32 cross-entropy: fwd e+16, bwd e+20 bytes per logit (F.cross_entropy on .float()).
    With cp the model's output (the logits) is all-gathered and the user's loss runs on the whole sequence on every
    cp rank (parallel/context.py): the cross-entropy over mbs*seq tokens, plus that all-gather forward."""
    T = mbs * seq / cp
    hf, hb = gemm_fwd_bwd(hw, T, m.vocab / tp, m.hidden, peak, elem)
    logits = mbs * seq * m.vocab / tp
    hf = hf + np.where(cp > 1, allgather_time(hw, logits * elem, cp, tp), 0.0)
    # fwd: upcast (read e, write 4), log-softmax (max and sum-exp passes read 4 each, write 4), nll gather
    ce_f = stream_time(hw, logits * (elem + 4 + 4 + 4 + 4), 4)
    # bwd: nll grad (zero-fill 4), log-softmax grad (read grad 4, read output 4, write 4), downcast (read 4, write e)
    ce_b = stream_time(hw, logits * (4 + 12 + 4 + elem), 4)
    nf, nb, nk_f, nk_b = norm_traffic(m, elem, hw.fused_ew)  # the final norm
    norm_f = stream_time(hw, T * m.hidden * nf, nk_f)
    norm_b = stream_time(hw, T * m.hidden * nb, nk_b)
    return hf + ce_f + norm_f, hb + ce_b + norm_b


def optimizer_bytes(local_params: Any, prec: Any) -> Any:
    """Adam r p,g,m,v w p,m,v (fp32) [+ half copy, fp16 unscale] + grad-norm read, clip scale (12 B) per local param (torch foreach)."""
    return local_params * (4 * 7 + np.where(prec == 0, 4.0, 2.0 + 2.0) + np.where(prec == 2, 4.0, 0.0) + 12.0)


def optimizer_time(hw: Hardware, local_params: Any, prec: Any) -> Any:
    """optimizer_bytes / BW + 6 launches: the optimizer step on the device (memory-bound; torch foreach AdamW)."""
    return stream_time(hw, optimizer_bytes(local_params, prec), 6)


def host_optimizer_step_time(hw: Hardware, local_params: Any, prec: Any) -> Any:
    """optimizer_bytes / host DRAM bandwidth: with plan.offload the step runs on the host over the rank's shard
    (ZeRO-Offload's CPU Adam, Ren et al. 2021 s.4.2; FSDP2 CPUOffloadPolicy: the optimizer steps the CPU shards),
    the same bytes read and written per parameter as on the device (fp32 AdamW p, g, m, v), streamed at
    DeviceSpec.host_memory_bandwidth_gbs (the host's DRAM share per device; memory-bound, vectorised). The device's
    optimizer_time goes away; the same six foreach calls cost their fixed time on the host threads. No separate host
    (host_bw 0, a CPU cluster): the device is the host, optimizer_time."""
    if not hw.host_bw:
        return optimizer_time(hw, local_params, prec)
    return optimizer_bytes(local_params, prec) / hw.host_bw + 6 * hw.overhead_s


def offloaded_state_bytes(weights: Any, grads: Any, optim: Any, shard_copy: Any, zero: Any,
                          offload: Any) -> tuple[Any, Any, Any]:
    """(weights, gradients, optimizer) bytes of this rank's model states that plan.offload keeps on the host, from
    the device-side parts (model_state_parts at zero >= 1, where gradients and optimizer states are sharded):
    optimizer -> o*P/N, the Adam states and the fp32 master copy (OPTIM_BYTES; ZeRO-Offload, Ren et al. 2021 s.4);
    params -> also the gradient shard g*P/N and the parameter shard w*P/N: zero 3's sharded parameters, zero 1/2's
    shard beside the gathered parameters (fsdp_shard_copy_bytes, ``shard_copy``) (FSDP2 CPUOffloadPolicy: sharded
    parameters and gradients live on the host; torch.distributed.fsdp._fully_shard._fsdp_param). The device keeps
    what fsdp_buffer_bytes prices (the gathered parameters of the units in flight -- FSDP2 copies a unit's shard
    host->device before its all-gather -- and the unit's unsharded gradient before its reduce-scatter) and, at zero
    1/2, the gathered parameters it holds through the step."""
    off = np.asarray(offload)
    params = off == OFFLOAD_PARAMS
    w = np.where(params, np.where(np.asarray(zero) == 3, weights, shard_copy), 0.0)
    return w, np.where(params, grads, 0.0), np.where(off > 0, optim, 0.0)


def host_step_copy_bytes(local_params: Any, prec: Any, offload: Any) -> tuple[Any, Any]:
    """(weights, gradients) bytes of the copies offload=optimizer's host step works on, P/N = the rank's shard
    (``local_params``): the gradient shard copied out, 4*P/N (fp32, FSDP2's reduce dtype), and the parameter shard
    the optimizer updates, 4*P/N where the plan is fp32 (in mixed precision that copy is the fp32 master already in
    OPTIM_BYTES: 0) (ZeRO-Offload keeps the gradients and the fp32 parameters on the CPU, Ren et al. 2021 s.4.1;
    parallel/offload.HostStep's host mirrors). They are host memory where the device has a host of its own,
    else (a CPU) more of the same memory."""
    optimizer = np.asarray(offload) == OFFLOAD_OPTIMIZER
    fp32 = np.asarray(prec) == 0
    return (np.where(optimizer & fp32, 4.0 * local_params, 0.0),
            np.where(optimizer, GRAD_REDUCE_BYTES[prec] * local_params, 0.0))


def offload_copy_time(hw: Hardware, local_params: Any, prec: Any, offload: Any) -> tuple[Any, Any, Any]:
    """(per all-gather, per gradient reduction, per step) seconds of host-link copies for plan.offload, P/N = the
    rank's shard (``local_params``), at DeviceSpec.host_link_gbs (PCIe, one direction; the two directions overlap):
    params: w*P/N host->device per all-gather (FSDP2 copies each unit's CPU shard in as the all-gather's copy-in,
    on the all-gather stream, so it is prefetched with the gather and hidden behind the previous unit's compute as
    the gather is: the caller adds it to the gather term) -- forward, and backward again under zero 3;
    optimizer and params: the reduced gradient shard 4*P/N (fp32, FSDP2's reduce dtype) device->host after each
    gradient reduction (FSDP2's post-reduce copy on the reduce-scatter stream: added to the reduction term,
    overlapped with the backward as the reduction is); optimizer: the updated parameter shard w*P/N host->device
    once per step, after the host step and before the next forward, exposed (ZeRO-Offload, Ren et al. 2021 s.4.1).
    No separate host (host_link 0): nothing is copied."""
    off = np.asarray(offload)
    if not hw.host_link:
        zero = 0.0 * off
        return zero, zero, zero
    shard = local_params * WEIGHT_BYTES[prec] / hw.host_link
    gather = np.where(off == OFFLOAD_PARAMS, shard, 0.0)
    reduce = np.where(off > 0, local_params * GRAD_REDUCE_BYTES[prec] / hw.host_link, 0.0)
    return gather, reduce, np.where(off == OFFLOAD_OPTIMIZER, shard, 0.0)


def grad_accumulate_time(hw: Hardware, local_params: Any, prec: Any) -> Any:
    """Per micro-batch: add each weight grad to its fp32 accumulator, r grad 4|2 + r/w fp32 8 = 12|10 B/param (AccumulateGrad, unfused)."""
    return stream_time(hw, local_params * GRAD_ACC_BYTES[prec], 2)


def shard_copy_time(hw: Hardware, full_params: Any, shard: Any, prec: Any, gathers: Any, reduces: Any) -> Any:
    """FSDP2 per gather: copy-in cast (4+e)/N + copy-out 2e B/param; per reduce: cast e+4 + divide and accumulate 12/N (FSDP2 fp32 reduce)."""
    e = WEIGHT_BYTES[prec]
    shard = np.maximum(shard, 1)
    per_gather = (4 + e) / shard + 2 * e
    per_reduce = (e + 4) + 12 / shard
    return full_params * (gathers * per_gather + reduces * per_reduce) / hw.mem_bw


# ============================================================================================ unit form (any model)


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
    attention: np.ndarray  # bool: the unit holds attention (selective recompute applies)
    batchnorm: np.ndarray  # BatchNorm layers per unit (each synchronises its statistics over dp)

    @staticmethod
    def of(m: ModelSpec) -> "UnitArrays":
        col = lambda name: np.array([float(getattr(u, name)) for u in m.units])  # noqa: E731
        out = col("output_bytes")
        return UnitArrays(col("flops"), col("conv_flops"), col("memory_bytes"), col("ops"), col("activation_bytes"),
                          out, np.concatenate([[0.0], out[:-1]]), col("params"),
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


# ============================================================================================ communication


def group_nodes(hw: Hardware, size: Any, stride: Any) -> tuple[Any, Any]:
    """(members per node, nodes spanned) of a group of `size` ranks `stride` apart, ranks filling nodes in order."""
    size = np.asarray(size, dtype=float)
    per_node = np.where(stride < hw.dpn, np.minimum(size, np.maximum(np.floor(hw.dpn / np.maximum(stride, 1)), 1)), 1)
    if hw.nodes == 1:
        per_node = size
    return per_node, np.ceil(size / per_node)


def _intra_bw(hw: Hardware, local: Any) -> Any:
    """Switch: full per-device bandwidth; full mesh: a group of g uses g-1 of the dpn-1 links (HCCS)."""
    if hw.intra_mesh and hw.dpn > 1:
        return hw.intra_bw * np.maximum(local - 1, 1) / (hw.dpn - 1)
    return hw.intra_bw


def ring_allgather(nbytes: Any, n: Any, bw: Any, lat: Any) -> Any:
    """(n-1)*(alpha + S/(n*beta)), S = gathered bytes (ring; Thakur et al. 2005). Reduce-scatter costs the same."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, (n - 1) * (lat + nbytes / (np.maximum(n, 1) * bw)), 0.0)


def ring_allreduce(nbytes: Any, n: Any, bw: Any, lat: Any) -> Any:
    """2*(n-1)*(alpha + S/(n*beta)): reduce-scatter + all-gather (ring; Patarasuk & Yuan 2009)."""
    return 2 * ring_allgather(nbytes, n, bw, lat)


def tree_allreduce(nbytes: Any, n: Any, bw: Any, lat: Any) -> Any:
    """2*ceil(log2 n)*alpha + 2*S/beta: pipelined double binary tree, latency-optimal (NCCL; Sanders et al. 2009)."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, 2 * np.ceil(np.log2(np.maximum(n, 2))) * lat + 2 * nbytes / bw, 0.0)


def spanning_bw(hw: Hardware, local: Any) -> Any:
    """min(beta_intra, local*beta_inter): a ring through `local` members per node, channels striped over their NICs (NCCL rings)."""
    return np.where(local > 1, np.minimum(_intra_bw(hw, local), local * hw.inter_bw), hw.inter_bw)


def allreduce_time(hw: Hardware, nbytes: Any, size: Any, stride: Any) -> Any:
    """min(ring, tree); across nodes one ring of n at spanning_bw, 2(nodes-1) inter + 2(n-nodes) intra hops; tree: log2(nodes) (NCCL)."""
    local, nodes = group_nodes(hw, size, stride)
    bw_in = _intra_bw(hw, local)
    intra = np.minimum(ring_allreduce(nbytes, local, bw_in, hw.intra_lat), tree_allreduce(nbytes, local, bw_in, hw.intra_lat))
    n = local * nodes
    bw = spanning_bw(hw, local)
    hops = (nodes - 1) * hw.inter_lat + (n - nodes) * hw.intra_lat
    ring = ring_allreduce(nbytes, n, bw, 0.0) + 2 * hops
    tree = tree_allreduce(nbytes, nodes, bw, hw.inter_lat) + 2 * np.maximum(local - 1, 0) * hw.intra_lat
    return np.where(nodes > 1, np.minimum(ring, tree), intra)


def allgather_time(hw: Hardware, nbytes: Any, size: Any, stride: Any) -> Any:
    """Ring all-gather of S bytes over n ranks; across nodes at spanning_bw, (nodes-1) inter + (n-nodes) intra hops (NCCL). RS symmetric."""
    local, nodes = group_nodes(hw, size, stride)
    n = local * nodes
    hops = (nodes - 1) * hw.inter_lat + (n - nodes) * hw.intra_lat
    across = ring_allgather(nbytes, n, spanning_bw(hw, local), 0.0) + hops
    return np.where(nodes > 1, across, ring_allgather(nbytes, local, _intra_bw(hw, local), hw.intra_lat))


def reduce_scatter_time(hw: Hardware, nbytes: Any, size: Any, stride: Any) -> Any:
    """allgather_time x rs_factor: a ring reduce-scatter moves what an all-gather moves (Thakur et al. 2005);
    a backend whose reduce-scatter is slower says so in LinkSpec.reduce_scatter_factor (measured at set-up:
    planner/calibrate.fit_links)."""
    return allgather_time(hw, nbytes, size, stride) * hw.rs_factor


def alltoall_time(hw: Hardware, nbytes: Any, size: Any, stride: Any) -> Any:
    """(n-1)*alpha + max(S*(l-1)/n / beta_intra, S*(n-l)/n / beta_inter): pairwise exchange, S = bytes held per rank."""
    size = np.asarray(size, dtype=float)
    local, nodes = group_nodes(hw, size, stride)
    n = np.maximum(size, 1)
    intra = nbytes * (local - 1) / n / _intra_bw(hw, local)
    inter = nbytes * (n - local) / n / hw.inter_bw
    lat = np.where(nodes > 1, hw.inter_lat, hw.intra_lat)
    return np.where(size > 1, (size - 1) * lat + np.maximum(intra, inter), 0.0)


def p2p_time(hw: Hardware, nbytes: Any, inter_node: Any) -> Any:
    """alpha + S/beta on the link the two stages share (Hockney model)."""
    return np.where(inter_node, hw.inter_lat + nbytes / hw.inter_bw, hw.intra_lat + nbytes / _intra_bw(hw, 2))


def tp_comm_per_block(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, elem: Any) -> tuple[Any, Any]:
    """2 all-reduces (or AG+RS with SP, same volume) of T*h per block forward, 2 backward (Korthikanti et al. 2022)."""
    S = mbs * seq / cp * m.hidden * elem
    one = allreduce_time(hw, S, tp, 1)
    return 2 * one, 2 * one


def cp_comm_per_block(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, elem: Any) -> tuple[Any, Any]:
    """All-gather based CP (Llama 3; Dubey et al. 2024, sec. 3.3.2): per block forward an all-gather of K and V
    (2*mbs*seq*kv_heads*head_dim/tp*e bytes gathered over the cp group), backward a reduce-scatter of their
    gradients (parallel/context.py); both run inside the attention call, so nothing hides them."""
    kv = 2 * mbs * seq * m.kv_heads * m.head_dim / tp * elem
    fwd = np.where(cp > 1, allgather_time(hw, kv, cp, tp), 0.0)
    bwd = np.where(cp > 1, reduce_scatter_time(hw, kv, cp, tp), 0.0)
    return fwd, bwd


def overlapped_exposed(comm: Any, window: Any, tail: Any, sm_share: float) -> Any:
    """max(c - W, tail + f*(c - tail)): compute W runs on 1-f of the SMs while collective c (NCCL channels, one CTA each) is in flight."""
    if not sm_share:
        return np.maximum(comm - window, tail)
    return np.maximum(comm - window, tail + sm_share * (comm - tail))


def ep_comm_per_block(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, ep: Any, sp: Any,
                      elem: Any) -> tuple[Any, Any]:
    """Dispatch + combine all-to-all of T*k*h x load imbalance per MoE block forward, the same backward (GShard; Lepikhin et al. 2020)."""
    T = mbs * seq / cp
    S = T / np.where(sp, tp, 1) * m.top_k * m.hidden * elem * moe_load_imbalance(T * m.top_k, ep)  # the busiest rank
    one = alltoall_time(hw, S, ep, cp * tp)
    return 2 * one, 2 * one


# ============================================================================================ pipeline


# Schedule codes (specs.SCHEDULES.index): gpipe, 1f1b, interleaved, interleaved-zb, zbv, dualpipev.
SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED, SCHED_IZB, SCHED_ZBV, SCHED_DUALPIPEV = range(6)
# Split backward: B (input gradients) and W (weight gradients) as shares of a micro-batch's F+B+W. The weight
# gradients are the forward's GEMMs again (dW = x^T dy), the input gradients the others: F = B = W = 1/3, the
# split Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", ICLR 2024, §2) assume; the FLOPs are unchanged.
WGRAD_SHARE = 1.0 / 3.0
FWD_SHARE = 1.0 / 3.0


def bubble_fraction(pp: Any, microbatches: Any, vpp: Any, schedule: Any = SCHED_1F1B) -> Any:
    """Idle share of the step, in micro-batch slots per micro-batch, by schedule code: GPipe/1F1B (pp-1)/m,
    interleaved 1F1B (pp-1)/(m*vpp) (Narayanan et al. 2021), interleaved zero bubble ``zero_bubble_fraction``,
    ZBV ``zbv_bubble_fraction``, DualPipeV ``dualpipev_bubble_fraction``."""
    pp, m, vpp, schedule = np.asarray(pp, dtype=float), np.asarray(microbatches, dtype=float), np.asarray(vpp), \
        np.asarray(schedule)
    plain = (pp - 1) / (m * vpp)  # vpp = 1 for GPipe and 1F1B
    out = np.select([schedule == SCHED_IZB, schedule == SCHED_ZBV, schedule == SCHED_DUALPIPEV],
                    [zero_bubble_fraction(pp, m, vpp), zbv_bubble_fraction(pp, m), dualpipev_bubble_fraction(pp, m)],
                    plain)
    return out if out.ndim else float(out)


def zero_bubble_fraction(pp: Any, microbatches: Any, vpp: Any) -> Any:
    """(p-1)(F+B-2W) / (m*v*(F+B)) with B the full backward: ZB-H1 / ZB1P, 1F1B's memory with the weight
    gradients filling the drain (Qi et al. 2023, §3.1; the DualPipe README's ZB1P row); over v round-robin chunks
    per rank the fill shrinks by v as for interleaved 1F1B (torch's ScheduleInterleavedZeroBubble runs ZB1P per
    chunk). F = B_input = W: (p-1)/(3*m*v)."""
    full = 1.0 - FWD_SHARE  # B + W
    return (pp - 1) * (FWD_SHARE + full - 2 * WGRAD_SHARE) / (microbatches * vpp)


def zbv_bubble_fraction(pp: Any, microbatches: Any) -> Any:
    """max(0, 2p-1-m)/m: ZB-V (Qi et al. 2023 §6; Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
    V-ZB) is bubble-free for F = B = W once the V is full; torch's ScheduleZBVZeroBubble fills it with 2p-1
    micro-batch slots, idle where m < 2p-1."""
    return np.maximum(0.0, 2 * pp - 1 - microbatches) / microbatches


def dualpipev_bubble_fraction(pp: Any, microbatches: Any) -> Any:
    """(PP/2-1)(F&B+B-3W) over a rank's m(F+B): DualPipe (DeepSeek-V3 technical report 2024, Table 2; README
    table), PP its stage count, F, B, W per chunk; DualPipeV (Sea AI Lab 2025, DualPipe cut in half: PP = 2p
    stages on p ranks, two chunks each) keeps the formula. F&B = F+B: our stages run the overlapped pair one
    after the other (torch without an overlap callback). Per rank (2 chunks): (p-1)(F+2B-3W)/(2m) with B the full
    backward; F = B_input = W: (p-1)/(3m)."""
    full = 1.0 - FWD_SHARE
    return (pp - 1) * (FWD_SHARE + 2 * full - 3 * WGRAD_SHARE) / (2 * microbatches)


def inflight_microbatches(schedule: Any, pp: Any, vpp: Any, microbatches: Any, stage: Any) -> Any:
    """Stage-sized activation sets held (a rank's whole stage per micro-batch): GPipe m; 1F1B min(pp-i, m);
    interleaved 1F1B and interleaved zero bubble (ZB1P keeps 1F1B's memory, Qi et al. 2023 §3.2)
    min(2(pp-i-1)+(v-1)pp+1, mv)/v (Megatron's warm-up + 1, capped by the mv chunk passes: measured,
    benchmarks/memory.py); ZBV min(pp, m) on every rank (V-ZB: 1F1B's peak, balanced over
    the V; Qi et al. 2024); DualPipeV min(pp + 1/2, m): PP+1 chunk sets with PP = 2p stages (DualPipe README)."""
    gpipe = microbatches
    one_f = np.minimum(pp - stage, microbatches)
    # the warm-up forwards plus the one in flight, never more than the rank's m*v chunk passes (m = pp: all of them)
    inter = np.minimum(2 * (pp - stage - 1) + (vpp - 1) * pp + 1, microbatches * vpp) / vpp
    zbv = np.minimum(pp + 0.0 * stage, microbatches)
    dualv = np.minimum(pp + 0.5 + 0.0 * stage, microbatches)
    return np.select([schedule == SCHED_GPIPE, schedule == SCHED_1F1B, schedule == SCHED_ZBV,
                      schedule == SCHED_DUALPIPEV], [gpipe, one_f, zbv, dualv], inter)


def partition_layers(weights: np.ndarray, parts: int) -> list[int]:
    """Contiguous split of per-layer costs into `parts` stages minimising the slowest stage (linear-partition DP, O(parts*L^2))."""
    n = len(weights)
    if parts >= n:
        return [1] * n + [0] * (parts - n)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    span = prefix[None, :] - prefix[:, None]  # span[i, j] = sum of layers i..j-1
    idx = np.arange(n + 1)
    valid = idx[:, None] < idx[None, :]
    best = np.where(idx >= 1, prefix, np.inf)  # one part covering layers 0..j-1
    choice = []
    for _ in range(1, parts):
        cand = np.where(valid, np.maximum(best[:, None], span), np.inf)
        arg = np.argmin(cand, axis=0)
        best = cand[arg, idx]
        choice.append(arg)
    sizes, end = [], n
    for arg in reversed(choice):
        start = int(arg[end])
        sizes.append(end - start)
        end = start
    sizes.append(end)
    return sizes[::-1]


# ============================================================================================ memory


def model_state_parts(params: Any, zero: Any, shard: Any, prec: Any) -> tuple[Any, Any, Any]:
    """(weights, gradients, optimizer states) bytes: w, g, o per param (16 B mixed: 2+2+12); zero 1 /N on o, 2 also
    g, 3 all (Rajbhandari et al. 2020)."""
    w, g, o = WEIGHT_BYTES[prec], WEIGHT_BYTES[prec], OPTIM_BYTES[prec]
    shard = np.maximum(shard, 1)
    return (params * np.where(zero == 3, w / shard, w), params * np.where(zero >= 2, g / shard, g),
            params * np.where(zero >= 1, o / shard, o))


def model_state_bytes(params: Any, zero: Any, shard: Any, prec: Any) -> Any:
    """Weights + grads + Adam states (model_state_parts summed)."""
    w, g, o = model_state_parts(params, zero, shard, prec)
    return w + g + o


def fsdp_shard_copy_bytes(params: Any, zero: Any, shard: Any, prec: Any, fsdp: Any) -> Any:
    """w*P/N at zero 0-2 under FSDP2 (N = shard, 1 for zero 0's replicate mesh): FSDP2 without resharding after
    forward keeps the unsharded parameters (model_state_bytes' w*P) in their own buffer beside the rank's shard,
    the sharded DTensor the optimizer updates (torch.distributed.fsdp._fully_shard._fsdp_param: all-gather output
    vs sharded_param). Measured: benchmarks/memory.py, parameters = w*P*(1 + 1/N) at zero 0-2 with tp, pp, ep, cp.
    Plain DDP (fsdp false) and zero 3 (the gathered unit: fsdp_buffer_bytes) hold no such copy."""
    return np.where(np.asarray(fsdp, dtype=bool) & (zero < 3), params * WEIGHT_BYTES[prec] / np.maximum(shard, 1), 0.0)


def ddp_bucket_bytes(grad_bytes: Any) -> Any:
    """G: DDP with ``gradient_as_bucket_view=False`` (parallel.fsdp.apply_replicate) copies every gradient into
    its flat buckets, allocated once when the reducer is built and kept (torch/csrc/distributed/c10d/reducer.cpp,
    initialize_buckets); G = the rank's gradient bytes in the reduction dtype."""
    return np.asarray(grad_bytes, dtype=float)


def fsdp_buffer_bytes(unit: Any, zero: Any, prec: Any) -> Any:
    """zero 3: 2*U*w, the gathered parameters of the unit in use and of the next one, prefetched (FSDP2's implicit
    forward / backward prefetch; Zhao et al. 2023 §3.3); zero 0-2: U*g, the unsharded fp32 gradient of the unit
    being reduce-scattered (FSDP2's reduce-scatter input). U = the largest FSDP unit's parameters."""
    return np.where(zero == 3, 2.0 * unit * WEIGHT_BYTES[prec], unit * GRAD_REDUCE_BYTES[prec])


def activation_bytes_per_block(m: ModelSpec, mbs: Any, seq: Any, tp: Any, sp: Any, cp: Any, recompute: Any,
                               elem: Any, fused: bool = True, moe: bool = False) -> Any:
    """sbh(10 + 24/t) + 5as^2b/t (Korthikanti et al. 2022) [SP as autopar runs it: sbh(4 + 6/t + 24/t) + 5as^2b/t,
    the attention's and MLP's gathered inputs kept whole]; selective drops the s^2 term; full keeps 2sbh;
    ops (code 3) keeps the block input 2sbh (/t with SP) and the compute-bound ops' outputs (ops_saved_elements).
    cp > 1: s = seq/cp, plus the K and V the attention gathered from the other cp ranks, 2b(seq - s)kvd/t, which
    the attention keeps for backward (all-gather CP, parallel/context.py)."""
    s = seq / cp
    b, h = mbs, m.hidden
    kvd = m.kv_heads * m.head_dim
    ffn_elems = (4 if m.ffn_kind == "gelu" else 8) * m.ffn_hidden * (m.top_k if moe else 1)
    # 2-byte activations: replicated = LN inputs 4h, QKV input 2h, MLP input 2h, 2 dropout masks 2h = 10h;
    # TP-split = Q 2h, K,V 2*2kvd, proj input 2h, MLP intermediates (gelu 4f, swiglu 8f) (= 24h for MHA, f=4h gelu)
    # SP splits the LN inputs and dropout masks (6h); the QKV and MLP inputs (4h) are the sequence the attention /
    # MLP all-gathers, which autopar's SP keeps whole for backward (parallel/sequence.py; Megatron re-gathers it)
    on_sequence, gathered_inputs = 6.0 * h, 4.0 * h
    split = 2 * h + 4 * kvd + 2 * h + ffn_elems
    scores = 0.0 if fused else 5.0 * m.heads * seq  # softmax out 2, mask 1, dropout out 2 bytes per score (x s)
    rep_div = np.where(sp, tp, 1)
    replicated = on_sequence / rep_div + gathered_inputs
    gathered_kv = (seq - s) * b * 4.0 * kvd / tp  # 2-byte units as above: K and V, 2 bytes each per element
    full_layer = s * b * (replicated + split / tp + scores / tp) + gathered_kv
    selective = s * b * (replicated + split / tp) + gathered_kv
    checkpoint = s * b * 2.0 * h / rep_div
    ops = s * b * (2.0 * h / rep_div + ops_saved_elements(m, tp))  # CP's K/V gather re-runs in backward
    out = np.where(recompute == 0, full_layer, np.where(recompute == 1, selective,
                                                        np.where(recompute == 2, checkpoint, ops)))
    return out * elem / 2.0


def ops_matmuls(m: ModelSpec, tp: Any) -> list[tuple[Any, Any, Any]]:
    """A dense block's matmuls in forward order (q, k, v, out, [gate,] up, down: models.GPT, HF Llama), as
    (output elements per token in 2-byte units, output columns n, inner size k) on one TP rank; the out and down
    projections' outputs are whole (the partial sums before TP's all-reduce / reduce-scatter)."""
    h, kvd, f = float(m.hidden), float(m.kv_heads * m.head_dim), float(m.ffn_hidden)
    col = lambda n, k: (2.0 * n / tp, n / tp, k)  # noqa: E731  column-parallel: output split by tp
    row = lambda n, k: (2.0 * n + 0.0 * tp, n + 0.0 * tp, k / tp)  # noqa: E731  row-parallel: inner split
    return ([col(h, h), col(kvd, h), col(kvd, h), row(h, h)] + [col(f, h)] * (m.ffn_matrices - 1) + [row(h, f)])


def ops_saved_elements(m: ModelSpec, tp: Any) -> Any:
    """recompute=ops, 2-byte units per token kept besides the block input: every other matmul's output (the 1st,
    3rd, ... in forward order, ops_matmuls: q, v, gate/up, down for Llama) and the attention output 2h/t with its
    fp32 logsumexp 4a/t (parallel.recompute: torchtitan's op-level SAC policy, which saves the compute-bound ops'
    outputs but only every second mm, torch.utils.checkpoint selective checkpointing). The norms, activations,
    dropout, RoPE, residual adds and the other matmuls are recomputed from these in backward. Dense blocks only:
    MoE blocks do not run ops (space.ops_rule)."""
    kept = sum(out for i, (out, _, _) in enumerate(ops_matmuls(m, tp)) if i % 2 == 0)
    return kept + (2.0 * m.hidden + 4.0 * m.heads) / tp


def ops_recompute_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, sp: Any, peak: Any,
                       elem: Any, fp8: Any = False) -> Any:
    """recompute=ops, extra time per block and micro-batch: the forward's memory-bound ops run again in backward,
    T*E_fwd*e/BW + k_fwd*launch (block_memory_ops / norm_traffic: norms, activation, RoPE, residual adds, the
    attention-output copy; fp8-mixed adds the forward operand casts), plus the forward GEMMs of the matmuls whose
    outputs are not kept (the 2nd, 4th, ... of ops_matmuls); no attention kernel re-runs (its output is saved).
    Sources: PyTorch's selective activation checkpointing (torch.utils.checkpoint
    create_selective_checkpoint_contexts) with torchtitan's op-level policy (save every other mm)."""
    T = mbs * seq / cp
    ew_f, _, k_f, _ = block_memory_ops(m, tp, sp, hw.fused_ew, elem)
    out = stream_time(hw, T * ew_f * elem, k_f)
    gp = gemm_peak(hw, peak, fp8)
    for i, (_, n, k) in enumerate(ops_matmuls(m, tp)):
        if i % 2:
            out = out + gemm_time(hw, T, n, k, gp, elem)
    if np.any(fp8):
        cast_f, _ = fp8_cast_time(hw, m, T, tp, sp, hw.fused_ew)
        out = out + np.where(fp8, cast_f, 0.0)
    return out


def logits_bytes(m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, elem: Any) -> Any:
    """T*V/tp*(e + 4 + 4): logits, their fp32 copy and the fp32 gradient of the loss (one micro-batch at a time);
    T = mbs*seq whatever cp: the logits are gathered and the loss runs on the whole sequence (parallel/context.py)."""
    return mbs * seq * m.vocab / tp * (elem + 8.0)


def memory_total(states: Any, activations: Any, buffers: Any, hw: Hardware) -> Any:
    """states + (activations + buffers)*(1 + fragmentation) + reserved runtime memory (PyTorch caching allocator)."""
    return states + (activations + buffers) * (1 + FRAGMENTATION) + hw.reserved


# ============================================================================================ measurements


def scaled_measure(measured_s: float, analytic_now: Any, analytic_ref: float) -> Any:
    """measured * analytic(plan)/analytic(measured config): the measurement carries the level, the model the scaling."""
    return measured_s * analytic_now / max(analytic_ref, 1e-30)


# ============================================================================================ runtime fixed costs
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
