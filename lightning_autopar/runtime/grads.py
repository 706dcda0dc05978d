"""Gradients held between micro-batches. Lightning's zero_grad runs after ``training_step`` and before the last
backward, so gradients made inside the step (earlier micro-batches; the pipeline schedule) wait outside
``.grad`` until the strategy's backward puts them back (``GradientHold``)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator


@contextmanager
def gradients_set_aside(params: Iterable[Any]) -> Iterator[dict[Any, Any]]:
    """Run the block on fresh gradients and put the earlier ones back after it; yields a dict that then holds
    what the block produced."""
    produced: dict[Any, Any] = {}
    params = list(params)
    previous = {p: p.grad for p in params}
    for p in params:
        p.grad = None
    try:
        yield produced
    finally:
        produced.update({p: p.grad for p in params if p.grad is not None})
        for p in params:
            p.grad = previous[p]


def restore_gradients(grads: dict[Any, Any]) -> None:
    """Add ``grads`` into ``.grad`` (set where there is none)."""
    for p, grad in grads.items():
        p.grad = grad if p.grad is None else p.grad + grad


@dataclass
class GradientHold:
    """What a training step left for the strategy's backward: the earlier micro-batches' gradients (put back
    before the last micro-batch's backward, which DDP then reduces with them) and the pipeline schedule's
    (the whole step's; with them, backward runs only the hooks)."""

    held: dict[Any, Any] = field(default_factory=dict)
    pipeline: dict[Any, Any] | None = None

    def put_back_held(self) -> None:
        held, self.held = self.held, {}
        restore_gradients(held)

    def take_pipeline(self) -> dict[Any, Any] | None:
        grads, self.pipeline = self.pipeline, None
        return grads
