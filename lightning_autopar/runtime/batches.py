"""Batch splitting: a DataLoader batch is the global batch of one optimizer step (as on one device); each
data-parallel rank takes a contiguous slice of it and cuts the slice into micro-batches whose loss weights make
the summed gradient the single-device one. Pure tensor code: no process group, no framework."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lightning_autopar.errors import ConfigError


class MicroBatch(NamedTuple):
    """One micro-batch of a rank's slice: its rows of the batch, its loss weight, how many rows it holds."""

    batch: Any
    weight: float  # rows * dp / global rows: FSDP/DDP average over dp ranks, so this gives the global mean
    rows: int


def tree_leaves(obj: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(obj)


def leading_size(batch: Any) -> int | None:
    """The batch dimension: the leading size of the first tensor leaf with one (None when there is none)."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def slice_batch(batch: Any, start: int, stop: int, size: int) -> Any:
    """Rows [start, stop) of every tensor leaf whose leading dim is the batch size; other leaves as they are."""
    from torch.utils._pytree import tree_map

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == size:
            return leaf[start:stop]
        if isinstance(leaf, (list, tuple)) and len(leaf) == size and not isinstance(leaf, torch.Size):
            return type(leaf)(leaf[start:stop])
        return leaf

    return tree_map(cut, batch)


def split_rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` when ``total`` rows are split into ``parts`` contiguous near-equal parts."""
    base, rem = divmod(total, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


def micro_batches(batch: Any, grad_accum: int, dp_rank: int, dp: int) -> list[MicroBatch]:
    """This rank's slice of the global ``batch`` cut into (at most) ``grad_accum`` micro-batches."""
    total = leading_size(batch)
    if total is None:
        raise ConfigError("training batch", "no tensor with a batch dimension found",
                          "return tensors (or tuples/dicts of tensors) from the DataLoader")
    start, stop = split_rows(total, dp, dp_rank)
    if stop - start < 1:
        raise ConfigError("DataLoader.batch_size", f"a batch of {total} rows cannot feed {dp} data-parallel "
                          "ranks", f"use a global batch >= {dp} (or drop_last=True)")
    local = stop - start
    parts = min(grad_accum, local)
    out = []
    for i in range(parts):
        lo, hi = split_rows(local, parts, i)
        out.append(MicroBatch(slice_batch(batch, start + lo, start + hi, total), (hi - lo) * dp / total, hi - lo))
    return out
