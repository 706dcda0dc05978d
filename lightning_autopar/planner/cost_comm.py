"""Communication cost terms: group placement on nodes, ring / tree collectives, point-to-point, the TP/CP/EP
traffic of a block, and the share of a collective that compute does not hide. Pure numpy, broadcasting over
candidates; each docstring gives the formula and its source on one line."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_autopar.dims import dim_strides, group_placement
from lightning_autopar.planner.hardware import Hardware, moe_load_imbalance
from lightning_autopar.specs import ModelSpec


def group_nodes(hw: Hardware, size: Any, stride: Any) -> tuple[Any, Any]:
    """(members per node, nodes spanned) of a group of `size` ranks `stride` apart, ranks filling nodes in order
    (dims.group_placement: the placement of dims.ParallelDims.group_ranks)."""
    return group_placement(size, stride, hw.dpn, hw.nodes)


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
    one = allreduce_time(hw, S, tp, dim_strides(1, 1, cp, tp)["tp"])
    return 2 * one, 2 * one


def vocab_loss_comm_time(hw: Hardware, mbs: Any, seq: Any, tp: Any, cp: Any, split: Any) -> Any:
    """The cross-entropy on vocabulary shards, per micro-batch: three all-reduces over TP of one fp32 value per
    token -- the row max, the sum of exponentials and the target logit -- T*4 bytes each, T = mbs*seq/cp
    (Megatron-LM's vocab_parallel_cross_entropy, Shoeybi et al. 2019; parallel/vocab.py); none where the
    vocabulary is not split (``split``: cost_memory.vocab_split, 1 there). The embedding's all-reduce and the
    head's input-gradient all-reduce are the TP edge terms (terms.py ``tp_edge``)."""
    nbytes = mbs * seq / cp * 4.0
    one = allreduce_time(hw, nbytes, tp, dim_strides(1, 1, cp, tp)["tp"])
    return np.where(np.asarray(split) > 1, 3.0 * one, 0.0)


def cp_logits_gather_time(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, split: Any,
                          elem: Any) -> Any:
    """Under cp > 1, per micro-batch on the head's stage: the logits gathered whole -- over TP where the head is
    vocabulary-parallel (``split`` > 1: parallel/vocab.py ``gather_logits``, T/cp x V) and then over CP by its
    output hook (parallel/context.py, T x V), forward only (their backward takes this rank's part); the loss then
    runs on the whole sequence (Megatron computes it on the local chunks instead: not done here)."""
    whole = mbs * seq * m.vocab * elem  # the gathered logits' bytes
    strides = dim_strides(1, 1, cp, tp)
    over_tp = np.where(np.asarray(split) > 1, allgather_time(hw, whole / cp, tp, strides["tp"]), 0.0)
    return np.where(np.asarray(cp) > 1, over_tp + allgather_time(hw, whole, cp, strides["cp"]), 0.0)


def cp_comm_per_block(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, elem: Any) -> tuple[Any, Any]:
    """All-gather based CP (Llama 3; Dubey et al. 2024, sec. 3.3.2): per block forward an all-gather of K and V
    (2*mbs*seq*kv_heads*head_dim/tp*e bytes gathered over the cp group), backward a reduce-scatter of their
    gradients (parallel/context.py); both run inside the attention call, so nothing hides them."""
    kv = 2 * mbs * seq * m.kv_heads * m.head_dim / tp * elem
    stride = dim_strides(1, 1, cp, tp)["cp"]
    fwd = np.where(cp > 1, allgather_time(hw, kv, cp, stride), 0.0)
    bwd = np.where(cp > 1, reduce_scatter_time(hw, kv, cp, stride), 0.0)
    return fwd, bwd


def cp_heads_kv_heads(m: ModelSpec, tp: Any, cp: Any) -> Any:
    """Key/value heads a rank sends in the heads flavour's exchange, per TP rank: kv_heads/tp where cp divides
    them, else heads/tp -- K and V repeated to the query heads before the all-to-all (parallel/context_heads.py)."""
    kv = m.kv_heads / np.asarray(tp, dtype=float)
    return np.where(np.mod(kv, np.maximum(cp, 1)) == 0, kv, m.heads / np.asarray(tp, dtype=float))


def cp_heads_comm_per_block(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any,
                            elem: Any) -> tuple[Any, Any]:
    """All-to-all over heads (DeepSpeed-Ulysses; Jacobs et al. 2023, sec. 3.1): per block forward 4 all-to-alls
    over the cp group -- q, k, v from sequence parts to head parts and the attention output back --, each of the
    b*(s/cp)*heads*head_dim/tp*e bytes a rank holds (k, v: their kv heads, ``cp_heads_kv_heads``); backward the
    4 reverse all-to-alls of their gradients (parallel/context_heads.py). Inside the attention call: not hidden.
    Per rank each moves (cp-1)/cp of its bytes, against the all-gather flavour's (cp-1)/cp of all ranks' K/V:
    a factor (2h + 2kv)/(2kv*cp) of the traffic -- less for cp > 2 with as many kv heads as heads (MHA)."""
    stride = dim_strides(1, 1, cp, tp)["cp"]
    local = mbs * seq / cp * m.head_dim * elem
    q = alltoall_time(hw, local * m.heads / tp, cp, stride)
    kv = alltoall_time(hw, local * cp_heads_kv_heads(m, tp, cp), cp, stride)
    one = np.where(cp > 1, 2 * q + 2 * kv, 0.0)  # q and the output; k and v
    return one, one


def cp_comm_by_kind(hw: Hardware, m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, elem: Any,
                    kind: Any) -> tuple[Any, Any]:
    """CP's traffic per block (fwd, bwd) by ``plan.cp_kind`` code (specs.CP_KINDS): 0 gather
    (``cp_comm_per_block``), 1 heads (``cp_heads_comm_per_block``)."""
    gf, gb = cp_comm_per_block(hw, m, mbs, seq, tp, cp, elem)
    heads = np.asarray(kind) == 1
    if not heads.any():
        return gf, gb
    hf, hb = cp_heads_comm_per_block(hw, m, mbs, seq, tp, cp, elem)
    return np.where(heads, hf, gf), np.where(heads, hb, gb)


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
    one = alltoall_time(hw, S, ep, dim_strides(1, 1, cp, tp)["ep"])
    return 2 * one, 2 * one
