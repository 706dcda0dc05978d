"""Cost terms of the planner: FLOPs and compute time (GEMMs, attention, blocks, MoE, embedding, head, the
optimizer and parameter work), each a small named function; the other concerns have their own modules:
hardware.py (the Hardware view, shared constants), cost_kernels.py (GEMM / stream roofline), cost_comm.py
(collectives), cost_pipeline.py (schedules, bubbles), cost_memory.py (bytes per device), cost_units.py (the unit
form), cost_runtime.py (the runtime's fixed costs).

Every function is pure numpy and broadcasts over arrays of candidates, so the search prices whole
columns of plans at once. Units: seconds, bytes, FLOPs. Each docstring gives the formula and its
source on one line. Constants that are not datasheet figures are first-principles estimates and say so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_autopar.planner.hardware import (
    GRAD_REDUCE_BYTES, OFFLOAD_OPTIMIZER, OFFLOAD_PARAMS, WEIGHT_BYTES, Hardware, moe_load_imbalance)
from lightning_autopar.planner.cost_kernels import dispatch_floor, gemm_fwd_bwd, gemm_peak, gemm_time, stream_time
from lightning_autopar.planner.cost_comm import allgather_time, overlapped_exposed
from lightning_autopar.planner.cost_memory import ops_matmuls
from lightning_autopar.specs import ModelSpec

# Re-exported for tests and benchmarks, which reach them as ``cost.<name>``; the package imports them from
# their own module.
from lightning_autopar.planner.hardware import (  # noqa: F401
    ACT_BYTES, BASE_PREC, CONV_OF_GEMM, FP8, FRAGMENTATION, GIB, OPTIM_BYTES, normal_max_quantile, prec_index,
    slowest_device_factor)
from lightning_autopar.planner.cost_kernels import TILE_FILL_S  # noqa: F401
from lightning_autopar.planner.cost_comm import (  # noqa: F401
    allreduce_time, alltoall_time, cp_comm_by_kind, cp_comm_per_block, cp_heads_comm_per_block, group_nodes, p2p_time, reduce_scatter_time, ring_allgather,
    ring_allreduce, tp_comm_per_block, tree_allreduce)
from lightning_autopar.planner.cost_pipeline import (  # noqa: F401
    WGRAD_SHARE, bubble_fraction, inflight_microbatches, partition_layers)
from lightning_autopar.planner.cost_memory import (  # noqa: F401
    activation_bytes_per_block, cp_heads_saved_elements, ddp_bucket_bytes, fsdp_buffer_bytes, fsdp_shard_copy_bytes,
    host_step_copy_bytes, logits_bytes, model_state_bytes, model_state_parts, offloaded_state_bytes)
from lightning_autopar.planner.cost_units import UnitArrays, unit_time  # noqa: F401
from lightning_autopar.planner.cost_runtime import (  # noqa: F401
    FSDP2_OPS_PER_UNIT_CALL, RUNTIME_TERMS, collective_calls, collective_sync_time, ep_dispatch_time,
    fsdp_unit_overhead_time, microbatch_overhead_time, pipeline_action_time, step_overhead_time, tp_dispatch_time)

FLASH_BLOCK = 128  # query/key block of fused attention kernels: causal work is (nb+1)/(2nb) of full
FLASH_CTAS_PER_SM = 2  # FA2 head_dim 128: 4 warps, ~64 KB shared memory per CTA, so two CTAs fit on one SM
SOFTMAX_EQUIV_FLOPS = 32.0  # exp on the special-function unit costs ~32 matmul FLOPs per score element
                            # (tensor-core FLOP/clk over 4x SFU op/clk, A100: 2048/(4*16)); FlashAttention-3 s.3
KERNELS_PER_MOE_FWD = 12  # router, softmax, top-k, permute, unpermute, index ops (per MoE block, plus experts)
KERNELS_PER_LOOP_EXPERT = 4  # a plain MoE loop, per expert: where(ids == e), gather rows, weight multiply, index_add
ATTN_REF_HEAD_DIM = 128  # head_dim at which the presets' attention efficiencies are quoted (FA2/FA3 benchmarks)
GRAD_ACC_BYTES = np.array([12.0, 10.0, 10.0, 10.0])  # per param per micro-batch: read grad (4|2), read+write fp32 accumulator
FP8_CAST_BYTES = 4.0  # per element quantised for an fp8 GEMM: read bf16 2 B, write fp8 1 B twice (x and x^T)


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


def cp_attention_calls(cp: Any, cp_kind: Any = 0) -> Any:
    """4 attention kernel calls per layer with cp > 1 in the gather flavour (1 without, and 1 in the heads
    flavour, ``cp_kind`` 1: one causal call over the whole sequence for heads/cp heads, parallel/context_heads.py):
    each of a rank's two query chunks attends to the keys before it in one call and to its own chunk causally in
    another (parallel/context.py ``_ChunkedCausalAttention``; rank 0's first chunk has none before it, and the
    step waits for the slowest rank)."""
    return np.where((np.asarray(cp, dtype=float) > 1) & (np.asarray(cp_kind) == 0), 4.0, 1.0)


def attention_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, peak: Any, elem: Any,
                   fused: bool = True, cp_kind: Any = 0) -> tuple[Any, Any]:
    """Fused: 4b(s/cp)s(h/tp)*causal at the kernel's fwd/bwd rate (bwd 2.5x FLOPs) x work quantisation (Dao 2023); unfused: 3 s^2 passes.
    With cp > 1 a rank's two load-balanced query chunks meet the gathered keys chunk by chunk without a mask
    (parallel/context.py ``_ChunkedCausalAttention``): the same causal share of the score blocks, in ``cp_attention_calls``
    kernel calls (each with its launch overhead) whose partial outputs are merged by log-sum-exp. The heads
    flavour (``cp_kind`` 1) runs one call over all s queries for h/(tp*cp) heads: the same FLOPs, its own work
    quantisation (Jacobs et al. 2023)."""
    d = m.head_dim
    sq = seq / cp
    heads = m.heads / tp
    calls = cp_attention_calls(cp, cp_kind)
    if fused:
        flops = 4.0 * mbs * heads * sq * seq * d * causal_fraction(seq)
        by_heads = np.asarray(cp_kind) == 1
        quant = attention_work_quantisation(hw, mbs, np.where(by_heads, heads / cp, heads), np.where(by_heads, seq, sq),
                                            seq)
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


@dataclass
class BlockTimes:
    """Per micro-batch times of one block on one device (arrays over candidates)."""

    fwd: Any
    bwd: Any
    attn_fwd: Any  # the attention core alone (what selective recompute redoes)


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
                     elem: Any, fused: bool = True, fp8: Any = False, cp_kind: Any = 0) -> BlockTimes:
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
    fa, ba = attention_time(hw, m, mbs, seq, tp, cp, peak, elem, fused, cp_kind)
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


# ============================================================================================ measurements


def scaled_measure(measured_s: float, analytic_now: Any, analytic_ref: float) -> Any:
    """measured * analytic(plan)/analytic(measured config): the measurement carries the level, the model the scaling."""
    return measured_s * analytic_now / max(analytic_ref, 1e-30)
