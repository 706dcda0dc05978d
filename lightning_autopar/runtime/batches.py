"""Batch splitting: a DataLoader batch is the global batch of one optimizer step (as on one device); each
data-parallel rank takes a contiguous slice of it and cuts the slice into micro-batches whose loss weights make
the summed gradient the single-device one. Pure tensor code: no process group, no framework.

Any batch size: a batch with fewer rows than data-parallel ranks, or not divisible by them or by the micro-batch
count, trains like one device. Every rank runs the same number of micro-batches (every collective inside a
forward or backward -- FSDP all-gathers, BatchNorm sync, expert all_to_all -- is entered by every rank the same
number of times); a rank short of rows runs zero-weight stand-ins (``rows == 0``): row 0 of the global batch, a
real row, so its loss is finite, multiplied by 0, contributing nothing.

Batches are tensors, or any nesting of tuples, lists, named tuples, mappings (dict, Hugging Face's
``BatchEncoding``) and dataclasses of them; a leaf is sliced when its leading size is the batch size."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch

from lightning_autopar.errors import ConfigError

_PLAIN = (str, bytes, int, float, bool, type(None))  # per-row values a list may hold (texts, ids, lengths)


class MicroBatch(NamedTuple):
    """One micro-batch of a rank's slice: its rows of the batch, its loss weight, how many rows it holds.
    ``rows == 0`` marks a stand-in (weight 0.0, row 0 of the global batch): run like any micro-batch so every
    collective is entered, contributing nothing."""

    batch: Any
    weight: float  # rows * dp / global rows: FSDP/DDP average over dp ranks, so this gives the global mean
    rows: int


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def map_batch(fn: Callable[[Any], Any], obj: Any) -> Any:
    """``fn`` applied to every leaf of a batch, rebuilding its containers (tuples, lists, named tuples,
    mappings, dataclasses); ``fn`` also sees lists/tuples of plain values whole (per-row texts or lengths)."""
    if _is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: map_batch(fn, getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, Mapping):
        return type(obj)({k: map_batch(fn, v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        if obj and all(isinstance(v, _PLAIN) for v in obj):
            return fn(obj)
        items = [map_batch(fn, v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return fn(obj)


def tree_leaves(obj: Any) -> list[Any]:
    """The leaves of a batch in order (containers as ``map_batch`` walks them)."""
    out: list[Any] = []

    def visit(leaf: Any) -> Any:
        out.extend(leaf if isinstance(leaf, (list, tuple)) else [leaf])
        return leaf

    map_batch(visit, obj)
    return out


def leading_size(batch: Any) -> int | None:
    """The batch dimension: the leading size of the first tensor leaf with one (None when there is none)."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def slice_batch(batch: Any, start: int, stop: int, size: int) -> Any:
    """Rows [start, stop) of every leaf whose leading size is the batch size (tensors; lists of per-row plain
    values); other leaves as they are."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == size:
            return leaf[start:stop]
        if isinstance(leaf, (list, tuple)) and len(leaf) == size:
            return type(leaf)(leaf[start:stop])
        return leaf

    return map_batch(cut, batch)


def split_rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` when ``total`` rows are split into ``parts`` contiguous near-equal parts."""
    base, rem = divmod(total, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


def batch_rows(batch: Any, field: str = "training batch") -> int:
    """The global batch's row count; one ConfigError line when it has no tensor with a batch dimension. Every
    rank holds the same global batch, so every rank raises the same line before any collective."""
    total = leading_size(batch)
    if total is None:
        raise ConfigError(field, f"no tensor with a batch dimension found in a {type(batch).__name__}",
                          "return tensors (or tuples/dicts/dataclasses of tensors) from the DataLoader")
    return total


def stand_in(batch: Any, total: int) -> MicroBatch:
    """The zero-weight stand-in: row 0 of the global batch (a real row: a finite loss), weight 0, rows 0."""
    return MicroBatch(slice_batch(batch, 0, 1, total), 0.0, 0)


def micro_batches(batch: Any, grad_accum: int, dp_rank: int, dp: int) -> list[MicroBatch]:
    """This rank's slice of the global ``batch`` cut into micro-batches: ``min(grad_accum, ceil(rows / dp))``
    on every rank (the same count everywhere, so collectives pair up). A slice with fewer rows than that runs
    one micro-batch per row and zero-weight stand-ins for the rest; an empty slice (rows < dp) one stand-in.
    Never raises for a small batch; raises one ConfigError line for a batch without a batch dimension."""
    total = batch_rows(batch)
    start, stop = split_rows(total, dp, dp_rank)
    local = stop - start
    parts = max(1, min(grad_accum, -(-total // dp)))  # -(-a // b): ceil, the largest slice's rows
    out = []
    for i in range(parts):
        lo, hi = split_rows(local, parts, i) if local >= parts else (min(i, local), min(i + 1, local))
        if hi == lo:
            out.append(stand_in(batch, total))
        else:
            out.append(MicroBatch(slice_batch(batch, start + lo, start + hi, total), (hi - lo) * dp / total,
                                  hi - lo))
    return out


def last_batch_rows(loader: Any) -> int | None:
    """Rows of ``loader``'s last batch when known before iterating it (a sampler with a length, a batch_size,
    drop_last False: ``len(sampler) % batch_size``, or a full batch); None otherwise (an IterableDataset, a custom
    batch sampler, drop_last=True, which never yields a short batch)."""
    size = getattr(loader, "batch_size", None)
    if not size or getattr(loader, "drop_last", True):
        return None
    try:
        samples = len(loader.sampler)
    except (TypeError, AttributeError):
        return None
    return samples % size or (size if samples else None)


IGNORE_INDEX = -100  # the label torch's cross_entropy and Hugging Face losses skip


def uneven_label_tokens(batch: Any) -> bool:
    """Whether ``batch`` is a mapping whose ``labels`` (a 2-D+ tensor, HF style) have rows with different counts
    of counted tokens (not IGNORE_INDEX): a loss averaged over a micro-batch's counted tokens then differs from
    one device's average over the whole batch's when slices are weighted by rows."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.shape[0] < 2:
        return False
    counted = (labels != IGNORE_INDEX).flatten(1).sum(1)
    return bool((counted != counted[0]).any())
