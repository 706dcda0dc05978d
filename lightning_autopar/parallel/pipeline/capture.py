"""The user's step around a pipeline: the strategy does not rewrite the ``training_step``. It runs the step up
to its call of the model to capture, per micro-batch, that call's arguments (token ids, masks, ...), which
every chunk then calls the model with; and it runs the step again with the model call answered by the
pipeline's output (``model_call_replaced``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.profile.trace import StopAtCall


@contextmanager
def model_call_replaced(transformer: nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """While active, calling ``transformer`` runs ``fn`` instead of its forward (hooks included)."""
    transformer.forward = fn  # instance attribute: shadows the class's forward
    try:
        yield
    finally:
        transformer.__dict__.pop("forward", None)


def capture_model_call(transformer: nn.Module, step: Callable[[], Any], hook: str = "training_step") -> tuple[tuple, dict]:
    """Run the user's ``step`` up to its call of the model and return that call's (args, kwargs)."""

    def grab(*args: Any, **kwargs: Any) -> Any:
        raise StopAtCall("", args, kwargs)  # a BaseException: the step's ``except Exception`` lets it through

    with model_call_replaced(transformer, grab), torch.no_grad():
        try:
            step()
        except StopAtCall as call:
            return call.args, call.kwargs
    raise ConfigError(hook, f"with pipeline parallelism the {hook} must call the model "
                      f"({type(transformer).__name__}) exactly once, and it never did", "use pp=1")
