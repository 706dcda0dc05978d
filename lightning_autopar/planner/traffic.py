"""The planner's view of one rank of a plan, term by term, for comparison with a simulation (``autopar simulate``,
issue 27): the rank's model states by pipeline stage (``terms._dp_rank_terms``, the search's own term on the
stage's parameters) and the collectives of one step per group kind, as the cost terms count them
(``terms._dp_rank_terms``, ``cost_comm.tp_comm_per_block``, ``cp_comm_per_block``, ``ep_comm_per_block``, the
pipeline's p2p). Bytes are whole buffers: an all-gather's output, a reduce-scatter's input, an all-reduce's
tensor, an all-to-all's input, a send's tensor.

Counts follow the cost model's units: one FSDP unit per block plus one for the stage's embedding / norm / head,
TP's two collectives per block forward and two backward (Megatron's f and g; with SP an all-gather and a
reduce-scatter each, and what the time terms hide or leave out: ``tp_block_collectives``), CP's K and V all-gathers
per block forward and reduce-scatters backward (the heads flavour: four all-to-alls each way) and the gather of
the model's output, EP's dispatch and combine per MoE block each way, one p2p transfer per micro-batch each
way between neighbouring chunks, and the vocabulary-parallel embedding, head and loss (``vocab_collectives``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_autopar.dims import runs_fsdp, runs_plain_ddp
from lightning_autopar.planner.cost_comm import cp_heads_kv_heads
from lightning_autopar.planner.cost_memory import fsdp_shard_copy_bytes, vocab_split
from lightning_autopar.planner.hardware import (ACT_BYTES, FRAGMENTATION, GRAD_REDUCE_BYTES, OPTIM_BYTES,
                                                WEIGHT_BYTES, Hardware)
from lightning_autopar.planner.terms import DPC_TERMS, _dp_rank_terms, rank_param_counts
from lightning_autopar.specs import OFFLOAD_MODES, PRECISIONS, ModelSpec, Plan, PricedPlan

GIB = 2**30


def stage_blocks(model: ModelSpec, plan: Plan, layers_per_stage: list[int], stage: int) -> tuple[int, int, bool, bool]:
    """(dense blocks, MoE blocks, holds the embedding, holds the head) of pipeline rank ``stage``: chunk c of the
    pp * vpp chunks (``layers_per_stage``) runs on rank c % pp (the interleaved order)."""
    counts = list(layers_per_stage) or [model.layers]
    chunks = len(counts)
    starts = np.cumsum([0] + counts)
    moe = [model.experts > 0 and (i + 1) % max(model.moe_every, 1) == 0 for i in range(model.layers)]
    nd = nm = 0
    for c in range(chunks):
        if c % plan.pp != stage:
            continue
        layers = range(int(starts[c]), int(starts[c + 1]))
        nm += sum(moe[i] for i in layers)
        nd += sum(not moe[i] for i in layers)
    return nd, nm, stage == 0, stage == (chunks - 1) % plan.pp


def stage_params(model: ModelSpec, plan: Plan, layers_per_stage: list[int], stage: int,
                 kept: bool = False, held: bool = False) -> Any:
    """(dense parameters, expert parameters, the largest FSDP unit) on rank ``stage`` before data-parallel
    sharding, as the search counts them (``terms.rank_param_counts``); ``kept``: the parameters of the root unit
    and the last block instead (what zero 3 keeps gathered, ``terms._dp_rank_terms``); ``held``: as the rank holds
    them in memory (``rank_param_counts``)."""
    nd, nm, he, hh = stage_blocks(model, plan, layers_per_stage, stage)
    has_moe = model.experts > 0
    dense, shared, expert, emb, head = (float(np.asarray(x)) for x in
                                        rank_param_counts(model, plan.tp, plan.ep, plan.pp, has_moe, held))
    if kept:
        return he * emb + hh * head + (dense if nd > 0 else shared)
    p_d = nd * dense + nm * shared + he * emb + hh * head
    unit = max(dense, shared + expert if has_moe else 0.0)
    return p_d, nm * expert, unit


def predicted_states(model: ModelSpec, cluster: Any, plan: Plan, layers_per_stage: list[int],
                     stage: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) GiB on rank ``stage``: the search's ``_dp_rank_terms`` on the
    stage's parameters."""
    hw = Hardware.from_cluster(cluster)
    p_d, p_e, unit = stage_params(model, plan, layers_per_stage, stage)
    held_d = stage_params(model, plan, layers_per_stage, stage, held=True)[0]
    a = lambda x: np.array([float(x)])  # noqa: E731
    dpc: dict[str, list] = {name: [] for name in DPC_TERMS}
    ds = plan.dp_shard or plan.dp
    _dp_rank_terms(hw, dpc, np.array([plan.zero]), np.array([PRECISIONS.index(plan.precision)]), a(plan.dp),
                   a(plan.cp), a(plan.tp), a(plan.ep), a(ds), a(p_d), a(p_e), a(unit), a(0.0), a(plan.pp),
                   np.array([OFFLOAD_MODES.index(plan.offload)]), trains=model.trainable_share(), held_d=a(held_d))
    params, grads, optim = (float(dpc[name][0][0]) / GIB for name in ("m_params", "m_grads", "m_optim"))
    return runtime_split(params - compute_copy_bytes(plan, held_d + p_e, p_e > 0) / GIB, grads, optim,
                         plan.precision)


def runtime_split(params: float, grads: float, optim: float, precision: str) -> tuple[float, float, float]:
    """The search's (weights, gradients, optimizer) in the runtime's split. The search counts ZeRO's bytes per
    parameter (Rajbhandari et al. 2020: mixed precision 2 + 2 + 12, the fp32 master copy among the optimizer's
    12); under autocast and FSDP2's MixedPrecisionPolicy the runtime's parameter is itself the fp32 master copy,
    its gradient fp32, and the optimizer holds Adam's two states: 4 + 4 + 8, the same 16 bytes (each term here
    is sharded alike: the compute copy is out, ``compute_copy_bytes``). fp32 runs 4 + 4 + 8 both ways."""
    prec = PRECISIONS.index(precision)
    w, o = float(WEIGHT_BYTES[prec]), float(OPTIM_BYTES[prec])
    master = o - float(OPTIM_BYTES[0])  # the fp32 copy the search puts among the optimizer's states (0 in fp32)
    if not master:
        return params, grads, optim
    return params * master / w, grads * float(GRAD_REDUCE_BYTES[prec]) / w, optim * (o - master) / o


def compute_copy_bytes(plan: Plan, params: float, has_moe: bool) -> float:
    """FSDP2's unsharded compute copy of ``params`` at zero 0-2 (``cost_memory.fsdp_shard_copy_bytes`` with no
    sharding: w*P), which the search counts in the parameters. The runtime holds it from the step's first forward
    to its last backward, not at the optimizer step where a simulation reads the parameters (the local shards):
    the report leaves it to the peak, as the simulation does."""
    fsdp = runs_fsdp(plan.zero, plan.dp, plan.tp, plan.pp, plan.ep, plan.cp, has_moe)
    prec = PRECISIONS.index(plan.precision)
    return float(fsdp_shard_copy_bytes(params, np.asarray(plan.zero), 1.0, prec, fsdp))


def step_collectives(model: ModelSpec, plan: Plan, layers_per_stage: list[int], stage: int,
                     seq: int) -> dict[tuple[str, str], list[float]]:
    """(group kind, op) -> [count, bytes] of one optimizer step on rank ``stage`` (module doc)."""
    out: dict[tuple[str, str], list[float]] = {}

    def add(kind: str, op: str, count: float, nbytes: float) -> None:
        if count > 0:
            entry = out.setdefault((kind, op), [0.0, 0.0])
            entry[0] += count
            entry[1] += nbytes

    prec = PRECISIONS.index(plan.precision)
    elem, wbytes, gbytes = float(ACT_BYTES[prec]), float(WEIGHT_BYTES[prec]), float(GRAD_REDUCE_BYTES[prec])
    nd, nm, he, hh = stage_blocks(model, plan, layers_per_stage, stage)
    blocks, ga, has_moe = nd + nm, plan.grad_accum, model.experts > 0
    p_d, p_e, _ = stage_params(model, plan, layers_per_stage, stage)
    args = (plan.zero, plan.dp, plan.tp, plan.pp, plan.ep, plan.cp, p_e > 0)
    units = blocks + (1 if he or hh else 0)
    if bool(runs_plain_ddp(*args)):
        # DDP's buckets: their count is the reducer's bucketing (25 MB), no cost term's; one per unit at least
        add("dp", "all_reduce", units, (p_d + p_e) * gbytes)
    elif bool(runs_fsdp(*args)):
        zero = 2 if (plan.zero == 0 and plan.cp > 1) else plan.zero
        shard = (plan.dp_shard or plan.dp) * plan.cp if not (plan.zero == 0 and plan.cp > 1) else plan.cp
        add("fsdp", "reduce_scatter", units, (p_d + p_e) * gbytes)
        if zero == 3 and plan.pp == 1:  # the root unit and the last block once, the others twice per micro-batch
            kept = min(stage_params(model, plan, layers_per_stage, stage, kept=True), p_d)
            add("fsdp", "all_gather", 2 + 2 * ga * (units - 2), kept * wbytes + 2 * ga * (p_d + p_e - kept) * wbytes)
        else:
            passes = 1 + ga if zero == 3 else 1  # zero 3 in a stage: forward once, backward per micro-batch
            add("fsdp", "all_gather", units * passes, passes * (p_d + p_e) * wbytes)
        replicas = plan.dp / (plan.dp_shard or plan.dp)
        if replicas > 1:
            add("dp", "all_reduce", units, (p_d + p_e) * gbytes / shard)
    tokens = plan.mbs * seq / plan.cp
    # full recompute re-runs a block's forward, its collectives included, on one block in recompute_every
    rerun = -(-blocks // max(plan.recompute_every, 1)) if plan.recompute == "full" else 0
    if plan.tp > 1:
        for key, count, nbytes in tp_block_collectives(model, plan, blocks, rerun, tokens, elem, wbytes,
                                                       int(he) + int(hh)):
            add("tp", key, count, nbytes)
    for key, count, nbytes in vocab_collectives(model, plan, he, hh, tokens, elem):
        add("tp", key, count, nbytes)
    if plan.cp > 1 and plan.cp_kind == "heads":  # q, k, v and the output exchanged each way (context_heads.py)
        local = tokens * model.head_dim / plan.tp * elem
        kv_heads = float(cp_heads_kv_heads(model, plan.tp, plan.cp)) * plan.tp
        per = 2 * local * model.heads + 2 * local * kv_heads
        add("cp", "all_to_all", 4 * (2 * blocks + rerun) * ga, (2 * blocks + rerun) * ga * per)
    elif plan.cp > 1:  # K and V gathered (their gradients reduce-scattered) each on its own (parallel/context.py)
        kv = 2 * plan.mbs * seq * model.kv_heads * model.head_dim / plan.tp * elem
        add("cp", "all_gather", 2 * (blocks + rerun) * ga, (blocks + rerun) * ga * kv)
        add("cp", "reduce_scatter", 2 * blocks * ga, blocks * ga * kv)
    if plan.cp > 1 and hh:  # the model's output (the whole vocabulary's logits) gathered back over the sequence
        add("cp", "all_gather", ga, ga * plan.mbs * seq * model.vocab * elem)
    if plan.ep > 1 and nm:
        per = tokens / (plan.tp if plan.sp else 1) * model.top_k * model.hidden * elem
        add("ep", "all_to_all", 4 * nm * ga, 4 * nm * ga * per)
    if plan.pp > 1:  # per chunk of the rank: activations to the next chunk, gradients to the one before
        act = tokens / (plan.tp if plan.sp else 1) * model.hidden * elem  # SP: Megatron's sequence shard
        chunks = len(layers_per_stage) or plan.pp
        mine = [c for c in range(chunks) if c % plan.pp == stage]
        sends = ga * sum((c < chunks - 1) + (c > 0) for c in mine)
        add("pp", "send", sends, sends * act)
        add("pp", "recv", sends, sends * act)
    return out


def tp_block_collectives(model: ModelSpec, plan: Plan, blocks: int, rerun: int, tokens: float, elem: float,
                         wbytes: float, ends: int) -> list[tuple[str, float, float]]:
    """(op, count, bytes) over the TP group of one step for the rank's ``blocks`` (``rerun`` of them recomputed in
    full), T*h each (``cost_comm.tp_comm_per_block``): Megatron's f and g, two forward and their transposes two
    backward per block and micro-batch; a recompute re-runs the forward's but the last (torch's checkpoint stops
    once the saved tensors are rebuilt: the block's output collective is not re-run). With SP (parallel/sequence.py)
    the forward's pair is an all-gather and a reduce-scatter, and backward also gathers again the input chunk each
    column projection kept (Megatron's; a recomputed block has it from its recompute): 6 all-gathers per block,
    4 reduce-scatters plus 1 per recompute; the norms' gradients, computed on this rank's tokens, are summed over TP
    per use (4 per block: the spec's two norms' weight and bias, ``ModelSpec.block_params``; in the gradient dtype
    the blocks compute in); and at the stack's ``ends`` the rank holds (its first block: the split's backward, its
    last: the output's forward; stages in between pass the sequence split) one all-gather each. The time terms
    leave out the re-gather, hidden behind the weight-gradient GEMM (Korthikanti et al. 2022, sec. 4.2.2), the
    ends' gathers (one per micro-batch and end, against 6 per block) and the norms' all-reduces (h elements
    each)."""
    ga = plan.grad_accum
    one = tokens * model.hidden * elem
    if not plan.sp:
        n = ga * (4 * blocks + rerun)
        return [("all_reduce", n, n * one)]
    gathers, scatters, norms = ga * (6 * blocks + ends), ga * (4 * blocks + rerun), ga * 4 * blocks
    return [("all_gather", gathers, gathers * one), ("reduce_scatter", scatters, scatters * one),
            ("all_reduce", norms, norms * model.hidden * wbytes)]


def vocab_collectives(model: ModelSpec, plan: Plan, he: bool, hh: bool, tokens: float,
                      elem: float) -> list[tuple[str, float, float]]:
    """(op, count, bytes) over the TP group of one step for the vocabulary-parallel embedding and head
    (parallel/vocab.py, where ``cost_memory.vocab_split`` > 1): per micro-batch the embedding's all-reduce
    forward and the head's input-gradient all-reduce backward (T*h each, the terms' ``tp_edge``), and the loss's
    three all-reduces of T fp32 values (``cost_comm.vocab_loss_comm_time``) -- or, under cp > 1, the head's output
    gathered whole instead (T*V, inside DTensor's ``full_tensor``)."""
    if float(vocab_split(model, plan.tp, plan.pp)) <= 1:
        return []
    ga = plan.grad_accum
    edge = ga * (int(he) + int(hh))
    out = [("all_reduce", edge, edge * tokens * model.hidden * elem)]
    if plan.cp > 1:
        return out + [("all_gather", ga * int(hh), ga * int(hh) * tokens * model.vocab * elem)]
    return out + [("all_reduce", 3 * ga * int(hh), 3 * ga * int(hh) * tokens * 4.0)]


def predicted_rank(model: ModelSpec, cluster: Any, priced: PricedPlan, stage: int,
                   seq: int) -> tuple[dict[str, float], dict[tuple[str, str], list[float]]]:
    """The planner's memory terms (GiB) and collectives for rank ``stage`` of ``priced``: the stage's model
    states, and the priced plan's activations and peak (those of its heaviest rank; the peak less the reserved
    memory and the caching allocator's fragmentation margin on activations and buffers, which no simulation
    sees: fake tensors are allocated exactly, ``cost_memory.memory_total``)."""
    plan, lps = priced.plan, list(priced.layers_per_stage)
    params, grads, optim = predicted_states(model, cluster, plan, lps, stage)
    terms = priced.memory_breakdown
    dynamic = terms.get("activations", 0.0) + terms.get("buffers", 0.0)
    mem = {"params_gib": params, "grads_gib": grads, "optimizer_gib": optim,
           "activations_gib": terms.get("activations", 0.0) / (1 + FRAGMENTATION),
           "peak_gib": priced.memory_gib_per_device - terms.get("reserved", 0.0)
           - dynamic * FRAGMENTATION / (1 + FRAGMENTATION)}
    return mem, step_collectives(model, plan, lps, stage, seq)
