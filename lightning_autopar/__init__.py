"""lightning-autopar: automatic parallelism for PyTorch Lightning.

``import lightning_autopar`` registers ``strategy="autopar"`` with Lightning (``lightning.pytorch``, and
``pytorch_lightning`` and Fabric when available). ``plan()`` and ``estimate()`` are the planner's pure API.
"""

from __future__ import annotations

import importlib.machinery
import sys
from typing import Any

from lightning_autopar.errors import AutoparError, ConfigError, InfeasibleError
from lightning_autopar.specs import (
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    ModelSpec,
    Plan,
    PricedPlan,
    load_cluster_spec,
    load_model_spec,
    parse_fix,
)

__version__ = "0.1.0"


def _model_spec(model: Any, seq_len: int | None) -> Any:
    """An ``nn.Module`` analysed into its ModelSpec (the planner takes specs); anything else as given."""
    if hasattr(model, "parameters") and hasattr(model, "forward"):
        from lightning_autopar.profile.analyze import model_spec_from_module

        return model_spec_from_module(model, seq_len=seq_len)
    return model


def plan(model: Any, cluster: Any, global_batch: int, seq_len: int | None = None, fix: Any = None,
         top: int = 10, **kwargs: Any) -> Any:
    """Rank the feasible plans for ``model`` (a spec, preset, YAML path or ``nn.Module``) on ``cluster``; the report
    has ``.best`` and ``.candidates``."""
    from lightning_autopar.planner.search import plan as _plan

    return _plan(_model_spec(model, seq_len), cluster, global_batch=global_batch, seq_len=seq_len, fix=fix, top=top,
                 **kwargs)


def estimate(model: Any, cluster: Any, plan: Any, **kwargs: Any) -> PricedPlan:
    """Price one plan (step time, memory, breakdown) without searching."""
    from lightning_autopar.planner.search import estimate as _estimate

    return _estimate(_model_spec(model, kwargs.get("seq_len")), cluster, plan, **kwargs)


def _register() -> None:
    """Register "autopar" with every Lightning flavour that is loaded (idempotent)."""
    try:
        from lightning_autopar.strategy import register
    except ImportError:  # lightning_autopar.strategy itself is importing lightning: __getattr__ finishes the job
        return
    register()
    try:
        from lightning_autopar.fabric import register as register_fabric
    except ImportError:
        return
    register_fabric()


class _RegisterWhenLightningLoads:
    """Runs ``_register`` right after ``lightning`` (or ``pytorch_lightning`` / ``lightning_fabric``) is imported,
    so ``import lightning_autopar`` stays cheap for the planner CLI yet ``strategy="autopar"`` always resolves.
    A meta path finder by protocol (find_spec), as the loader below is one by create_module / exec_module: the
    importlib.abc bases would import importlib.resources, tempfile and shutil, ~15 ms of every ``autopar plan``."""

    triggers = ("lightning", "pytorch_lightning", "lightning_fabric")

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name not in self.triggers:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self.inner.create_module(spec)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        self.inner.exec_module(module)
        _register()


def __getattr__(name: str) -> Any:
    if name == "AutoParallelStrategy":
        from lightning_autopar.strategy import AutoParallelStrategy

        _register()
        return AutoParallelStrategy
    raise AttributeError(f"module 'lightning_autopar' has no attribute {name!r}")


if any(trigger in sys.modules for trigger in _RegisterWhenLightningLoads.triggers):
    _register()
if not any(isinstance(f, _RegisterWhenLightningLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenLightningLoads())

__all__ = [
    "AutoParallelStrategy", "AutoparError", "ClusterSpec", "ConfigError", "DeviceSpec", "InfeasibleError",
    "LinkSpec", "ModelSpec", "Plan", "PricedPlan", "estimate", "load_cluster_spec", "load_model_spec",
    "parse_fix", "plan",
]
