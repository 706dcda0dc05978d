"""The pipeline partition the planner prices: per-layer weights, layers per stage (embedding and head counted
on their stages), and the per-rank stage tables (first, last and heaviest middle rank) that pricing reads, for
the transformer form and the unit form. Pure numpy; tables are cached per (model, pp, vpp, layout)."""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from lightning_autopar.planner.cost import dense_block_time, embedding_time, head_time, moe_block_time
from lightning_autopar.planner.cost_pipeline import partition_layers
from lightning_autopar.planner.cost_units import UnitArrays, unit_time
from lightning_autopar.planner.hardware import ACT_BYTES, BASE_PREC, FP8, Hardware
from lightning_autopar.specs import ModelSpec


def block_weights(model: ModelSpec, hw: Hardware, seq: int, prec: int,
                  fused: bool) -> tuple[np.ndarray, float, float]:
    """Transformer form: per-block fwd+bwd time at tp=cp=mbs=1 (the DP's costs), plus embedding and head costs in
    the same units."""
    peak, elem, fp8 = hw.peak[BASE_PREC[prec]], ACT_BYTES[prec], prec == FP8
    dense = dense_block_time(hw, model, 1, seq, 1, 1, False, peak, elem, fused, fp8)
    w_dense = float(dense.fwd + dense.bwd)
    is_moe = moe_mask(model)
    w = np.full(model.layers, w_dense)
    if is_moe.any():
        moe = moe_block_time(hw, model, 1, seq, 1, 1, 1, False, peak, elem, fused, fp8)
        w[is_moe] = float(moe.fwd + moe.bwd)
    ef, eb = embedding_time(hw, model, 1, seq, 1, elem)
    hf, hb = head_time(hw, model, 1, seq, 1, 1, peak, elem)
    return w, float(ef + eb), float(hf + hb)


def unit_weights(model: ModelSpec, hw: Hardware, prec: int) -> tuple[np.ndarray, float, float]:
    """Unit form: each unit's fwd+bwd time at mbs=1, no separate embedding or head (they are units)."""
    peak, elem = hw.peak[BASE_PREC[prec]], ACT_BYTES[prec]
    fwd, bwd = unit_time(hw, UnitArrays.of(model), 1.0, peak, elem)
    return (fwd + bwd).reshape(-1), 0.0, 0.0


def moe_mask(model: ModelSpec) -> np.ndarray:
    """Which blocks are MoE: every moe_every-th, counting from 1 (as models.GPT builds them)."""
    idx = np.arange(1, model.layers + 1)
    return (idx % model.moe_every == 0) if model.experts else np.zeros(model.layers, dtype=bool)


def stage_chunks(weights: np.ndarray, emb: float, head: float, pp: int, vpp: int, uneven: bool) -> list[int]:
    """Blocks per pipeline chunk (pp*vpp chunks, chunk j on rank j % pp): DP partition with embedding and head included."""
    L = len(weights)
    if vpp > 1 or pp == 1 or not uneven:
        n = pp * vpp
        base, extra = divmod(L, n)
        return [base + (1 if j < extra else 0) for j in range(n)]
    w = weights.copy()
    w[0] += emb
    w[-1] += head
    return partition_layers(w, pp)


class Stage(IntEnum):
    """The columns of a transformer's stage table (stage_table), one row per representative rank."""

    DENSE = 0  # dense blocks on the rank
    MOE = 1  # MoE blocks on the rank
    EMBEDDING = 2  # 1 when the rank holds the embedding
    HEAD = 3  # 1 when the rank holds the final norm and LM head
    RANK = 4  # the pipeline rank


class UnitStage(IntEnum):
    """The columns of a unit-form stage table's rows (unit_stage_table), one row per representative rank."""

    RANK = 0  # the pipeline rank
    BOUNDARY = 1  # bytes per sample (4-byte) of the larger tensor the rank receives or sends
    HEAD_PARAMS = 2  # parameters of its first unit holding any: the gather and reduction no compute hides


_STAGE_CACHE: dict[tuple, tuple[np.ndarray, list[int]]] = {}


def stage_table(model: ModelSpec, weights: np.ndarray, emb: float, head: float, pp: int, vpp: int,
                uneven: bool, v_shape: bool = False) -> tuple[np.ndarray, list[int]]:
    """Representative ranks (first, last, heaviest middle) as rows named by ``Stage``;
    ``v_shape``: chunks placed in a V (zbv, dualpipev: rank r holds chunks r and 2*pp-1-r, so the head is on
    rank 0 with the embedding), else round-robin."""
    key = (weights.tobytes(), emb, head, pp, vpp, uneven, model.experts, model.moe_every, v_shape)
    if key not in _STAGE_CACHE:
        if len(_STAGE_CACHE) > 4096:
            _STAGE_CACHE.clear()
        _STAGE_CACHE[key] = _stage_table(model, weights, emb, head, pp, vpp, uneven, v_shape)
    return _STAGE_CACHE[key]


def _stage_table(model: ModelSpec, weights: np.ndarray, emb: float, head: float, pp: int, vpp: int,
                 uneven: bool, v_shape: bool) -> tuple[np.ndarray, list[int]]:
    chunks = stage_chunks(weights, emb, head, pp, vpp, uneven)
    is_moe = moe_mask(model)
    bounds = np.concatenate([[0], np.cumsum(chunks)])
    rank_rows = np.zeros((pp, len(Stage)))
    rank_w = np.zeros(pp)
    n_chunks = len(chunks)
    for j, n in enumerate(chunks):
        r = n_chunks - 1 - j if v_shape and j >= pp else j % pp
        lo, hi = bounds[j], bounds[j + 1]
        moe = int(is_moe[lo:hi].sum())
        rank_rows[r, Stage.DENSE] += n - moe
        rank_rows[r, Stage.MOE] += moe
        rank_w[r] += weights[lo:hi].sum()
    last = 0 if v_shape else pp - 1
    rank_rows[0, Stage.EMBEDDING] = 1
    rank_rows[last, Stage.HEAD] = 1
    rank_w[0] += emb
    rank_w[last] += head
    rank_rows[:, Stage.RANK] = np.arange(pp)
    middle = 1 + int(np.argmax(rank_w[1:-1])) if pp > 2 else 0
    return rank_rows[[0, pp - 1, middle]], chunks


_UNIT_STAGE_CACHE: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def unit_stage_table(units: UnitArrays, weights: np.ndarray, pp: int, vpp: int,
                     uneven: bool) -> tuple[np.ndarray, np.ndarray]:
    """Representative ranks (first, last, heaviest middle) of a unit-form model: a (N_REP, units) membership mask,
    and rows named by ``UnitStage`` (stage, boundary bytes, FSDP head params). Stages are contiguous units split by
    their time weights (stage_chunks); the boundary is the larger of the tensors the rank receives and sends (per sample, 4-byte);
    the head params are those of its first unit holding parameters (the gather and the last gradient reduction
    that no compute hides)."""
    key = (weights.tobytes(), units.out.tobytes(), units.params.tobytes(), pp, vpp, uneven)
    if key not in _UNIT_STAGE_CACHE:
        if len(_UNIT_STAGE_CACHE) > 4096:
            _UNIT_STAGE_CACHE.clear()
        _UNIT_STAGE_CACHE[key] = _unit_stage_table(units, weights, pp, vpp, uneven)
    return _UNIT_STAGE_CACHE[key]


def _unit_stage_table(units: UnitArrays, weights: np.ndarray, pp: int, vpp: int,
                      uneven: bool) -> tuple[np.ndarray, np.ndarray]:
    n_units = len(weights)
    chunks = stage_chunks(weights, 0.0, 0.0, pp, vpp, uneven)
    bounds = np.concatenate([[0], np.cumsum(chunks)]).astype(int)
    mask, rows, rank_w = np.zeros((pp, n_units)), np.zeros((pp, len(UnitStage))), np.zeros(pp)
    rows[:, UnitStage.RANK] = np.arange(pp)
    for j, _ in enumerate(chunks):
        r, lo, hi = j % pp, bounds[j], bounds[j + 1]
        if hi <= lo:
            continue
        mask[r, lo:hi] = 1.0
        rank_w[r] += weights[lo:hi].sum()
        receives = units.inputs[lo] if lo > 0 else 0.0
        sends = units.out[hi - 1] if hi < n_units else 0.0
        rows[r, UnitStage.BOUNDARY] = max(rows[r, UnitStage.BOUNDARY], receives, sends)
        held = units.params[lo:hi][units.params[lo:hi] > 0]
        if rows[r, UnitStage.HEAD_PARAMS] == 0 and len(held):
            rows[r, UnitStage.HEAD_PARAMS] = held[0]
    middle = 1 + int(np.argmax(rank_w[1:-1])) if pp > 2 else 0
    pick = [0, pp - 1, middle]
    return mask[pick], rows[pick]
