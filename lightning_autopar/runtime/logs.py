"""The log recorder: ``self.log`` inside the strategy's step runs once per micro-batch (and per rank), but the
user logged once per step on one device. The recorder stands in for ``LightningModule.log``, weights every value
by its micro-batch's share of the global batch, sums over the data-parallel group and logs once."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

_LOG_POSITIONAL = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph", "sync_dist")


class LogRecorder:
    """Stands in for ``LightningModule.log`` during the micro-batch loop: values are weighted by each
    micro-batch's share of the global batch, then summed over the data-parallel group and logged once."""

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight
        self.values: dict[str, list[Any]] = {}  # name -> [weighted sum or last value, kwargs, aggregatable]

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:  # positional prog_bar, logger, ... as in LightningModule.log
            kwargs.update(zip(_LOG_POSITIONAL, args))
        numeric = isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                                        and value.is_floating_point())
        if numeric:
            contribution = torch.as_tensor(value, dtype=torch.float64).detach().cpu() * self.weight
            if self.weight == 0:  # a stand-in's value counts nowhere, even a NaN one (0 * NaN is NaN)
                contribution = torch.zeros((), dtype=torch.float64)
            entry = self.values.setdefault(name, [torch.zeros((), dtype=torch.float64), kwargs, True])
            entry[0] = entry[0] + contribution
            entry[1] = kwargs
        else:
            self.values[name] = [value, kwargs, False]

    def flush(self, module: Any, reduce: Callable[[torch.Tensor], torch.Tensor], batch_size: int) -> None:
        """Sum the numeric values over the group (``reduce``) and log everything once through ``module.log``."""
        names = [n for n, (_, _, agg) in self.values.items() if agg]
        if names:
            summed = reduce(torch.stack([self.values[n][0] for n in names]).float())
            for name, value in zip(names, summed):
                self.values[name][0] = value
        for name, (value, kwargs, agg) in self.values.items():
            kwargs = dict(kwargs)
            if agg:
                kwargs["sync_dist"] = False  # already the global mean
                kwargs.setdefault("batch_size", batch_size)
            module.log(name, value, **kwargs)
        self.values.clear()


@contextmanager
def recording_logs(module: Any, recorder: LogRecorder) -> Iterator[None]:
    """Route ``module.log`` (and ``log_dict``, which goes through it) to ``recorder`` inside the block."""
    module.log = recorder  # instance attribute shadows the method
    try:
        yield
    finally:
        del module.log
