"""Memory cost terms, in bytes per device: ZeRO model states, FSDP2 / DDP buffers, saved activations per block by
recompute mode, logits, the offloaded states and the total with the allocator's margin. Pure numpy,
broadcasting over candidates; each docstring gives the formula and its source."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_autopar.planner.hardware import (
    FRAGMENTATION, GRAD_REDUCE_BYTES, OFFLOAD_OPTIMIZER, OFFLOAD_PARAMS, OPTIM_BYTES, WEIGHT_BYTES, Hardware)
from lightning_autopar.planner.cost_comm import cp_heads_kv_heads
from lightning_autopar.specs import ModelSpec


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


def sp_replicated_elements(h: Any, tp: Any, sp: Any, moe: bool = False, dropout: bool = True) -> Any:
    """2-byte units per token of the activations TP alone leaves whole on every rank: the two LayerNorm inputs 4h,
    the QKV and MLP inputs 2h + 2h, the two dropout masks 2h (``dropout``: the blocks drop out their hidden states,
    ``ModelSpec.dropout``; none without); 10h, or 10h/t with sequence parallelism (Korthikanti
    et al. 2022, s.4.2.2 and Table 2: 34sbh/t per layer with SP and selective recompute). The QKV and MLP inputs
    are the sequence SP all-gathers; their column projections save this rank's chunk (h/t) and gather it again in
    backward (parallel/tp_comm.ColumnFromChunk; in a recomputed block the recompute gathers it again). An MoE
    block's MLP input stays whole (2h): its module gathers the sequence for the router and keeps it
    (parallel/sequence.py)."""
    div = np.where(sp, tp, 1)
    return (8.0 + 2.0 * dropout) * h / div + (2.0 * h * (1.0 - 1.0 / div) if moe else 0.0)


def cp_heads_saved_elements(m: ModelSpec, tp: Any, cp: Any) -> Any:
    """The heads flavour of CP (parallel/context_heads.py; Jacobs et al. 2023), 2-byte units per local token kept
    besides Korthikanti's: SDPA saves the exchanged q, k, v (the whole sequence for h/(tp*cp) heads: as many
    elements as this rank's own, which they replace) and its output before the exchange back, 2h/t; K and V
    repeated to the query heads where cp does not divide kv_heads/tp add 4(h - kv*d)/t
    (cost_comm.cp_heads_kv_heads). No gathered K/V: O(s/cp) per rank, against the gather flavour's O(s)."""
    repeated = (cp_heads_kv_heads(m, tp, cp) * tp - m.kv_heads) * m.head_dim
    return (2.0 * m.hidden + 4.0 * repeated) / tp


def activation_bytes_per_block(m: ModelSpec, mbs: Any, seq: Any, tp: Any, sp: Any, cp: Any, recompute: Any,
                               elem: Any, fused: bool = True, moe: bool = False, cp_kind: Any = 0) -> Any:
    """sbh(10 + 24/t) + 5as^2b/t (Korthikanti et al. 2022, Table 2), with SP sbh(34/t) + 5as^2b/t
    (``sp_replicated_elements``: the attention's and MLP's inputs saved as this rank's chunk, gathered again in
    backward); selective drops the s^2 term (with SP: 34sbh/t); full keeps 2sbh;
    ops (code 3) keeps the block input 2sbh (/t with SP) and the compute-bound ops' outputs (ops_saved_elements).
    cp > 1: s = seq/cp, plus the K and V the attention gathered from the other cp ranks, 2b(seq - s)kvd/t, which
    the attention keeps for backward (all-gather CP, parallel/context.py); in the heads flavour (``cp_kind`` 1)
    ``cp_heads_saved_elements`` per local token instead."""
    s = seq / cp
    b, h = mbs, m.hidden
    kvd = m.kv_heads * m.head_dim
    ffn_elems = (4 if m.ffn_kind == "gelu" else 8) * m.ffn_hidden * (m.top_k if moe else 1)
    # 2-byte activations: replicated = LN inputs 4h, QKV input 2h, MLP input 2h, 2 dropout masks 2h = 10h;
    # TP-split = Q 2h, K,V 2*2kvd, proj input 2h, MLP intermediates (gelu 4f, swiglu 8f) (= 24h for MHA, f=4h gelu)
    split = 2 * h + 4 * kvd + 2 * h + ffn_elems
    scores = 0.0 if fused else 5.0 * m.heads * seq  # softmax out 2, mask 1, dropout out 2 bytes per score (x s)
    rep_div = np.where(sp, tp, 1)
    replicated = sp_replicated_elements(h, tp, sp, moe, bool(m.dropout))
    gathered_kv = (seq - s) * b * 4.0 * kvd / tp  # 2-byte units as above: K and V, 2 bytes each per element
    if np.any(np.asarray(cp_kind) == 1):
        gathered_kv = np.where(np.asarray(cp_kind) == 1, s * b * cp_heads_saved_elements(m, tp, cp), gathered_kv)
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


def logits_bytes(m: ModelSpec, mbs: Any, seq: Any, tp: Any, cp: Any, elem: Any) -> Any:
    """T*V/tp*(e + 4 + 4): logits, their fp32 copy and the loss's fp32 buffer, its softmax and then in place its
    gradient (parallel/vocab.py, Megatron's vocab-parallel cross-entropy; one micro-batch at a time);
    T = mbs*seq whatever cp: the logits are gathered and the loss runs on the whole sequence (parallel/context.py).
    ``tp``: the divisor of the vocabulary the rank holds (``logits_split``)."""
    return mbs * seq * m.vocab / tp * (elem + 8.0)


def vocab_split(m: ModelSpec, tp: Any, pp: Any) -> Any:
    """The divisor of the token embedding and LM head a TP rank holds: tp where vocabulary parallelism runs
    (parallel/vocab.py: the model allows it, ``m.vocab_parallel``; tp divides V; under pp > 1 too, each stage
    sharding the part it holds), else 1 (whole on every TP rank). Embedding rows and head columns V/tp per rank
    (Megatron-LM's VocabParallelEmbedding and column-parallel output layer, Shoeybi et al. 2019). ``pp`` sets the
    result's shape only."""
    tp = np.asarray(tp, dtype=float)
    on = bool(m.vocab_parallel) & (np.mod(m.vocab, np.maximum(tp, 1)) == 0) & np.ones(np.shape(pp), dtype=bool)
    return np.where(on, tp, 1.0)


def logits_split(m: ModelSpec, tp: Any, pp: Any, cp: Any) -> Any:
    """The divisor of the logits a rank holds: ``vocab_split`` (this rank's [T, V/tp] shard, the loss computed on
    the shards: Megatron's vocab-parallel cross-entropy), except under cp > 1, where the head's output is gathered whole for
    CP's sequence gather (parallel/vocab.py ``gather_logits``)."""
    return np.where(np.asarray(cp) > 1, 1.0, vocab_split(m, tp, pp))


def memory_total(states: Any, activations: Any, buffers: Any, hw: Hardware) -> Any:
    """states + (activations + buffers)*(1 + fragmentation) + reserved runtime memory (PyTorch caching allocator)."""
    return states + (activations + buffers) * (1 + FRAGMENTATION) + hw.reserved


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
