"""The zero-weight stand-in flag. A data-parallel rank with no rows of a small batch runs row 0 of the batch as a
stand-in (``runtime.batches``), so that it enters every collective its peers enter; collectives that *count*
rows (BatchNorm statistics in ``parallel.batchnorm``, MoE expert counts and router logits in
``parallel.experts``) must count none of it. The step sets the flag around a stand-in's forward
(``standing_in``); a module reads it in its forward (``stand_in_active``) and keeps what it saw for a forward
recomputed inside backward (``in_backward``: activation recomputation runs after the flag is gone)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

_STAND_IN = [False]  # the forward running now is a zero-weight stand-in's


@contextmanager
def standing_in(active: bool) -> Iterator[None]:
    """Inside the block, row-counting collectives count this rank's rows as none (a stand-in's forward)."""
    previous, _STAND_IN[0] = _STAND_IN[0], active
    try:
        yield
    finally:
        _STAND_IN[0] = previous


def stand_in_active() -> bool:
    """Whether the forward running now is a zero-weight stand-in's (its rows must count as none)."""
    return _STAND_IN[0]


def in_backward() -> bool:
    """Inside an autograd backward pass (e.g. a checkpointed unit being recomputed)."""
    return torch._C._current_graph_task_id() != -1


def stand_in_for(owner: Any) -> bool:
    """Whether ``owner``'s forward runs for a stand-in now: the flag, recorded on ``owner`` outside backward;
    inside backward (a recomputed forward, after the flag is gone) what its last forward recorded."""
    if not in_backward():
        owner._stand_in_seen = stand_in_active()
    return getattr(owner, "_stand_in_seen", False)
