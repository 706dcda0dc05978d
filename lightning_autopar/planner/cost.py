"""Cost terms of the planner: compute, communication, pipeline and memory, each a small named function.

Every function is pure numpy and broadcasts over arrays of candidates, so the search prices whole
columns of plans at once. Units: seconds, bytes, FLOPs. Each docstring gives the formula and its
source on one line. Constants that are not datasheet figures are first-principles estimates and say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from lightning_autopar.specs import PRECISIONS, ClusterSpec, ModelSpec

GIB = float(2**30)
ACT_BYTES = np.array([4.0, 2.0, 2.0])  # activation / matmul element bytes by precision index (fp32, bf16, fp16)
WEIGHT_BYTES = ACT_BYTES  # ZeRO accounting: 2-byte weights and grads in mixed precision, 4 in fp32
OPTIM_BYTES = np.array([8.0, 12.0, 12.0])  # Adam: m, v (fp32) [+ fp32 master copy when mixed]
DDP_BUCKET_BYTES = 25e6  # torch DDP bucket_cap_mb default
FRAGMENTATION = 0.10  # caching-allocator margin on the dynamic part (activations, buffers)
FLASH_BLOCK = 128  # query/key block of fused attention kernels: causal work is (nb+1)/(2nb) of full
SOFTMAX_EQUIV_FLOPS = 32.0  # exp on the special-function unit costs ~32 matmul FLOPs per score element
                            # (tensor-core FLOP/clk over 4x SFU op/clk, A100: 2048/(4*16)); FlashAttention-3 s.3
KERNELS_PER_BLOCK_FWD = 16  # norms, 4-6 matmuls, attention, activation, residuals, views (eager PyTorch)
KERNELS_PER_MOE_FWD = 12  # router, softmax, top-k, permute, unpermute, index ops (per MoE block, plus experts)


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

    @staticmethod
    def from_cluster(cluster: ClusterSpec) -> "Hardware":
        dev = cluster.device
        pk = dev.peak_tflops
        fp32 = pk.fp32 or pk.bf16 or pk.fp16
        peaks = np.array([fp32, pk.bf16 or pk.fp16 or fp32, pk.fp16 or pk.bf16 or fp32]) * 1e12
        inner, outer = cluster.links[0], cluster.links[-1]
        return Hardware(
            peak=peaks,
            mem_bw=dev.memory_bandwidth_gbs * 1e9 * dev.memory_efficiency,
            gemm_eff=dev.gemm_efficiency,
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
        )


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
    """max(2mnk/(peak*eta*q), e(mk+kn+mn)/BW) + launch: roofline with tile and wave quantisation (Williams et al. 2009; NVIDIA GEMM guide)."""
    m, n, k = (np.maximum(np.asarray(x, dtype=float), 1.0) for x in (m, n, k))
    t = float(hw.tile)
    mt, nt = np.ceil(m / t), np.ceil(n / t)
    q = (m * n) / (mt * nt * t * t)
    if hw.units:
        tiles = mt * nt * batch
        split_k = np.clip(np.floor(hw.units / tiles), 1.0, np.maximum(1.0, np.floor(k / (2 * t))))
        work = tiles * split_k
        q = q * work / (np.ceil(work / hw.units) * hw.units)
    flops = 2.0 * m * n * k * batch
    compute = flops / (peak * hw.gemm_eff * q)
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


def attention_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, peak: Any, elem: Any,
                   fused: bool = True) -> tuple[Any, Any]:
    """Fused: 4*b*(s/cp)*s*(h/tp)*causal at peak*eta*d/(d+32), bwd 2.5x (Dao 2023); unfused adds 3 passes over s^2 scores."""
    d = m.head_dim
    sq = seq / cp
    heads = m.heads / tp
    if fused:
        frac = causal_fraction(seq)
        flops = 4.0 * mbs * heads * sq * seq * d * frac
        eff = hw.gemm_eff * d / (d + SOFTMAX_EQUIV_FLOPS)
        io = elem * mbs * sq * (heads + 2 * m.kv_heads / tp) * d * 2  # q, k, v in, o out
        fwd = np.maximum(flops / (peak * eff), io / hw.mem_bw) + hw.overhead_s
        return fwd, 2.5 * (fwd - hw.overhead_s) + hw.overhead_s
    batch = mbs * heads
    f1, b1 = gemm_fwd_bwd(hw, sq, seq, d, peak, elem, batch)
    f2, b2 = gemm_fwd_bwd(hw, sq, d, seq, peak, elem, batch)
    scores = mbs * heads * sq * seq
    soft = stream_time(hw, 3 * 4.0 * scores, 3)
    return f1 + f2 + soft, b1 + b2 + 2 * soft


def elementwise_bytes_per_token(m: ModelSpec, tp: Any, sp: Any, elem: Any) -> Any:
    """Per token per block forward: 2 norms (2h) + 2 residuals (3h) replicated unless SP, + activation (gelu 2f, swiglu 5f)/tp."""
    norm_res = (2 * 2 + 2 * 3) * m.hidden / np.where(sp, tp, 1)
    act = (2 if m.ffn_kind == "gelu" else 5) * m.ffn_hidden / tp
    return elem * (norm_res + act)


@dataclass
class BlockTimes:
    """Per micro-batch times of one block on one device (arrays over candidates)."""

    fwd: Any
    bwd: Any
    attn_fwd: Any  # the attention core alone (what selective recompute redoes)


def dense_block_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, sp: Any, peak: Any,
                     elem: Any, fused: bool = True) -> BlockTimes:
    """Sum of the block's matmuls (split by TP), attention core and memory-bound ops, fwd and bwd (Megatron layout)."""
    T = mbs * seq / cp
    h, kvd = m.hidden, m.kv_heads * m.head_dim
    f1, b1 = gemm_fwd_bwd(hw, T, (h + 2 * kvd) / tp, h, peak, elem)
    f2, b2 = gemm_fwd_bwd(hw, T, h, h / tp, peak, elem)
    fa, ba = attention_time(hw, m, mbs, seq, tp, cp, peak, elem, fused)
    mf, mb = mlp_time(hw, m, T, m.ffn_hidden / tp, peak, elem)
    ew = stream_time(hw, T * elementwise_bytes_per_token(m, tp, sp, elem), KERNELS_PER_BLOCK_FWD - 6)
    return BlockTimes(f1 + f2 + fa + mf + ew, b1 + b2 + ba + mb + 2 * ew, fa)


def mlp_time(hw: Hardware, m: ModelSpec, tokens: Any, ffn_local: Any, peak: Any, elem: Any,
             batch: Any = 1) -> tuple[Any, Any]:
    """(n_matrices-1) up/gate GEMMs (T, f/tp, h) + down GEMM (T, h, f/tp), fwd and bwd (Shazeer 2020)."""
    uf, ub = gemm_fwd_bwd(hw, tokens, ffn_local, m.hidden, peak, elem, batch)
    df, db = gemm_fwd_bwd(hw, tokens, m.hidden, ffn_local, peak, elem, batch)
    up = m.ffn_matrices - 1
    return up * uf + df, up * ub + db


def moe_block_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, ep: Any, sp: Any, peak: Any,
                   elem: Any, fused: bool = True) -> BlockTimes:
    """Dense attention + router GEMM (T,E,h) + E/ep local experts on T*k*ep/E tokens each (f/tp wide) + permutes (GShard)."""
    dense = dense_block_time(hw, m, mbs, seq, tp, cp, sp, peak, elem, fused)
    T = mbs * seq / cp
    mlp_f, mlp_b = mlp_time(hw, m, T, m.ffn_hidden / tp, peak, elem)
    T_rank = T / np.where(sp, tp, 1)
    rf, rb = gemm_fwd_bwd(hw, T_rank, m.experts, m.hidden, peak, elem)
    local = m.experts / ep
    # experts are TP-split (f/tp) and see all T*k routed tokens of the TP group (gathered back when SP)
    per_expert = np.maximum(T * m.top_k * ep / m.experts, 1.0)
    ef, eb = mlp_time(hw, m, per_expert, m.ffn_hidden / tp, peak, elem, batch=local)
    launches = (local - 1) * m.ffn_matrices * hw.overhead_s  # one GEMM per local expert (no grouped GEMM)
    perm = stream_time(hw, 4 * T_rank * m.top_k * m.hidden * elem, KERNELS_PER_MOE_FWD)
    fwd = dense.fwd - mlp_f + rf + ef + launches + perm
    bwd = dense.bwd - mlp_b + rb + eb + 2 * launches + 2 * perm
    return BlockTimes(fwd, bwd, dense.attn_fwd)


def embedding_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, cp: Any, elem: Any) -> tuple[Any, Any]:
    """Lookup: read+write T*h (fwd), scatter-add T*h (bwd): memory-bound (roofline)."""
    T = mbs * seq / cp
    f = stream_time(hw, 2 * T * m.hidden * elem, 2)
    return f, stream_time(hw, 3 * T * m.hidden * elem, 3)


def head_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, peak: Any, elem: Any) -> tuple[Any, Any]:
    """Final norm + LM head GEMM (T, V/tp, h) + fp32 cross-entropy over T*V/tp logits (memory-bound)."""
    T = mbs * seq / cp
    hf, hb = gemm_fwd_bwd(hw, T, m.vocab / tp, m.hidden, peak, elem)
    logits = T * m.vocab / tp
    ce_f = stream_time(hw, logits * (elem + 4 + 4), 4)  # read logits, fp32 upcast, log-softmax
    ce_b = stream_time(hw, logits * (4 + 4 + elem), 3)  # softmax - onehot, cast back
    norm = stream_time(hw, 2 * T * m.hidden * elem, 1)
    return hf + ce_f + norm, hb + ce_b + 2 * norm


def optimizer_time(hw: Hardware, local_params: Any, prec: Any) -> Any:
    """Adam: read p,g,m,v, write p,m,v (fp32) [+ half copy when mixed, + unscale pass for fp16] per local param / BW."""
    nbytes = local_params * (4 * 7 + np.where(prec == 0, 4.0, 2.0 + 2.0) + np.where(prec == 2, 4.0, 0.0))
    return stream_time(hw, nbytes, 4)


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


def allreduce_time(hw: Hardware, nbytes: Any, size: Any, stride: Any) -> Any:
    """min(ring, tree) inside a node; across nodes hierarchical: RS intra + AR inter on S/local + AG intra (NCCL/HCCL)."""
    local, nodes = group_nodes(hw, size, stride)
    bw_in = _intra_bw(hw, local)
    intra = np.minimum(ring_allreduce(nbytes, local, bw_in, hw.intra_lat), tree_allreduce(nbytes, local, bw_in, hw.intra_lat))
    inter_bytes = nbytes / local
    inter = np.minimum(ring_allreduce(inter_bytes, nodes, hw.inter_bw, hw.inter_lat),
                       tree_allreduce(inter_bytes, nodes, hw.inter_bw, hw.inter_lat))
    hier = ring_allreduce(nbytes, local, bw_in, hw.intra_lat) + inter
    return np.where(nodes > 1, hier, intra)


def allgather_time(hw: Hardware, nbytes: Any, size: Any, stride: Any) -> Any:
    """Hierarchical ring all-gather of S gathered bytes: inter-node on S/local, then intra-node on S (NCCL). RS is symmetric."""
    local, nodes = group_nodes(hw, size, stride)
    inter = ring_allgather(nbytes / local, nodes, hw.inter_bw, hw.inter_lat)
    return inter + ring_allgather(nbytes, local, _intra_bw(hw, local), hw.intra_lat)


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


def cp_comm_per_block(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, elem: Any,
                      attn_fwd: Any, attn_bwd: Any) -> tuple[Any, Any]:
    """Ring attention: (cp-1) K/V chunk sends per block, exposed = max(0, send - attention step) (Liu et al. 2023)."""
    kv = 2 * mbs * (seq / cp) * m.kv_heads * m.head_dim / tp * elem
    local, nodes = group_nodes(hw, cp, tp)
    send = p2p_time(hw, kv, nodes > 1)
    steps = np.maximum(cp - 1, 0)
    hide_f, hide_b = hw.overlap * attn_fwd / np.maximum(cp, 1), hw.overlap * attn_bwd / np.maximum(cp, 1)
    fwd = steps * np.maximum(send - hide_f, 0) + np.where(cp > 1, send, 0)
    bwd = steps * np.maximum(2 * send - hide_b, 0) + np.where(cp > 1, 2 * send, 0)
    return fwd, bwd


def ep_comm_per_block(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, ep: Any, sp: Any,
                      elem: Any) -> tuple[Any, Any]:
    """Dispatch + combine all-to-all of T*k*h per MoE block forward, the same backward (GShard; Lepikhin et al. 2020)."""
    S = mbs * seq / cp / np.where(sp, tp, 1) * m.top_k * m.hidden * elem
    one = alltoall_time(hw, S, ep, cp * tp)
    return 2 * one, 2 * one


# ============================================================================================ pipeline


def bubble_fraction(pp: Any, microbatches: Any, vpp: Any) -> Any:
    """(pp-1)/(m*vpp): idle share of the step for GPipe/1F1B (vpp=1) and interleaved 1F1B (Narayanan et al. 2021)."""
    return (pp - 1) / (microbatches * vpp)


def inflight_microbatches(schedule: Any, pp: Any, vpp: Any, microbatches: Any, stage: Any) -> Any:
    """Stage-sized activation sets held: GPipe m; 1F1B min(pp-i, m); interleaved (min(2(pp-i-1)+(v-1)pp, mv)+1)/v (Megatron)."""
    gpipe = microbatches
    one_f = np.minimum(pp - stage, microbatches)
    inter = (np.minimum(2 * (pp - stage - 1) + (vpp - 1) * pp, microbatches * vpp) + 1) / vpp
    return np.where(schedule == 0, gpipe, np.where(schedule == 1, one_f, inter))


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


def model_state_bytes(params: Any, zero: Any, shard: Any, prec: Any) -> Any:
    """Weights w + grads g + Adam states o per param (16 B mixed: 2+2+12); zero 1 /N on o, 2 also g, 3 all (Rajbhandari et al. 2020)."""
    w, g, o = WEIGHT_BYTES[prec], WEIGHT_BYTES[prec], OPTIM_BYTES[prec]
    shard = np.maximum(shard, 1)
    per_param = np.where(zero == 0, w + g + o,
                np.where(zero == 1, w + g + o / shard,
                np.where(zero == 2, w + (g + o) / shard, (w + g + o) / shard)))
    return params * per_param


def activation_bytes_per_block(m: ModelSpec, mbs: Any, seq: Any, tp: Any, sp: Any, cp: Any, recompute: Any,
                               elem: Any, fused: bool = True, moe: bool = False) -> Any:
    """sbh(10 + 24/t) + 5as^2b/t [SP: (34sbh + 5as^2b)/t]; selective drops the s^2 term; full keeps 2sbh (Korthikanti et al. 2022)."""
    s = seq / cp
    b, h = mbs, m.hidden
    kvd = m.kv_heads * m.head_dim
    ffn_elems = (4 if m.ffn_kind == "gelu" else 8) * m.ffn_hidden * (m.top_k if moe else 1)
    # 2-byte activations: replicated = LN inputs 4h, QKV input 2h, MLP input 2h, 2 dropout masks 2h = 10h;
    # TP-split = Q 2h, K,V 2*2kvd, proj input 2h, MLP intermediates (gelu 4f, swiglu 8f) (= 24h for MHA, f=4h gelu)
    replicated = 10.0 * h
    split = 2 * h + 4 * kvd + 2 * h + ffn_elems
    scores = 0.0 if fused else 5.0 * m.heads * seq  # softmax out 2, mask 1, dropout out 2 bytes per score (x s)
    rep_div = np.where(sp, tp, 1)
    full_layer = s * b * (replicated / rep_div + split / tp + scores / tp)
    selective = s * b * (replicated / rep_div + split / tp)
    checkpoint = s * b * 2.0 * h / rep_div
    out = np.where(recompute == 0, full_layer, np.where(recompute == 1, selective, checkpoint))
    return out * elem / 2.0


def logits_bytes(m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, elem: Any) -> Any:
    """T*V/tp*(e + 4 + 4): logits, their fp32 copy and the fp32 gradient of the loss (one micro-batch at a time)."""
    return mbs * seq / cp * m.vocab / tp * (elem + 8.0)


def memory_total(states: Any, activations: Any, buffers: Any, hw: Hardware) -> Any:
    """states + (activations + buffers)*(1 + fragmentation) + reserved runtime memory (PyTorch caching allocator)."""
    return states + (activations + buffers) * (1 + FRAGMENTATION) + hw.reserved


# ============================================================================================ measurements


@dataclass
class BlockMeasure:
    """Measured time and activation memory of one block kind at one (mbs, seq_len, precision), tp=1."""

    fwd_s: float
    bwd_s: float
    activation_bytes: float = 0.0


@dataclass
class Measured:
    """What profile/measure.py found on the live device; the planner scales it to each plan by the analytic ratio."""

    mbs: int
    seq_len: int
    precision: str
    blocks: dict[str, BlockMeasure] = field(default_factory=dict)  # "dense", "moe", "embedding", "head"
    device: str = ""

    @staticmethod
    def coerce(value: Any) -> "Measured | None":
        if value is None or isinstance(value, Measured):
            return value
        if isinstance(value, Mapping):
            blocks = {k: v if isinstance(v, BlockMeasure) else BlockMeasure(**v) for k, v in value.get("blocks", {}).items()}
            return Measured(int(value["mbs"]), int(value["seq_len"]), str(value["precision"]), blocks,
                            str(value.get("device", "")))
        raise TypeError(f"measured= expects a Measured or a mapping, got {type(value).__name__}")


def scaled_measure(measured_s: float, analytic_now: Any, analytic_ref: float) -> Any:
    """measured * analytic(plan)/analytic(measured config): the measurement carries the level, the model the scaling."""
    return measured_s * analytic_now / max(analytic_ref, 1e-30)
