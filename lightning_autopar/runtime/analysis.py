"""What a plan applies to: the user's model found and analysed, shared by the strategies and trial runs."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.runtime.batches import leading_size, slice_batch
from lightning_autopar.runtime.logs import LogRecorder, recording_logs

STAGE_HOOKS = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}


def step_model_call(module: nn.Module, batch: Any, hook: str) -> Any:
    """The user's call of its model (``profile.units.ModelCall``): ``module.<hook>`` on two rows of ``batch``,
    stopped at its first module call (logs discarded)."""
    from lightning_autopar.profile.units import find_model_call

    total = leading_size(batch) if batch is not None else None
    if total is None:
        raise ConfigError("DataLoader", f"{type(module).__name__}: no transformer blocks found, so the model is "
                          "analysed by running the step on a batch, and the DataLoader gave none with a batch "
                          "dimension", "pass a DataLoader whose batches hold tensors")
    with recording_logs(module, LogRecorder()):
        # two rows where there are: torch.export (the traced pipeline) would specialise a batch of one
        rows = min(2, total)
        return find_model_call(module, partial(getattr(module, hook), slice_batch(batch, 0, rows, total), 0))


def _run(make: Callable[[], Any]) -> Any:
    return make()


def analyse(module: nn.Module, model_call: Callable[[], Any], shared: Callable[[Callable[[], Any]], Any] = _run
            ) -> tuple[nn.Module, Any, tuple[tuple, dict] | None]:
    """(the model the plan applies to, its analysis, the user's call of it or None). A transformer (repeated
    blocks with attention, an MLP or MoE layers found) is analysed on token ids; any other model in unit form
    (``profile.units``), from the user's own call of it (``model_call()``, run only then). ``shared(make)`` runs
    each analysis (``runtime.setup.Live.shared``: rank 0's, given to every rank)."""
    from lightning_autopar.profile.analyze import analyze, find_transformer
    from lightning_autopar.profile.units import analyze_model, is_transformer

    try:
        _, transformer = find_transformer(module)
        # token ids enter a model through an embedding: without one (a CNN, a ViT's pixels) the token-id trace
        # can only fail, so the model is traced on the user's own call straight away
        tokens_enter = any(isinstance(m, nn.Embedding) for m in transformer.modules())
        # what the code does
        analysis = shared(lambda: analyze(transformer, trace=True, runner=module)) if tokens_enter else None
    except ValueError:  # no repeated blocks, or none a transformer spec describes (a ResNet's: no width)
        analysis = None
    if analysis is not None and is_transformer(analysis) and analysis.trace_failure is None:
        return transformer, analysis, None
    call = model_call()
    example = (tuple(call.args), dict(call.kwargs))
    # a transformer that does not run on token ids (ViT: pixels) is traced on the user's own call
    return call.module, shared(lambda: analyze_model(call.module, example, runner=module)), example


def sequence_length(batch: Any) -> int | None:
    """The second dimension of the batch's first tensor with two (token ids: the sequence length)."""
    from lightning_autopar.runtime.batches import tree_leaves

    return next((int(t.shape[1]) for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
