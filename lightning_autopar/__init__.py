"""lightning-autopar: automatic parallelism for PyTorch Lightning.

``import lightning_autopar`` registers ``strategy="autopar"`` with Lightning (``lightning.pytorch``, and
``pytorch_lightning`` and Fabric when available). ``plan()`` and ``estimate()`` are the planner's pure API.
"""

from __future__ import annotations

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


def plan(model: Any, cluster: Any, global_batch: int, seq_len: int | None = None, fix: Any = None,
         top: int = 10, **kwargs: Any) -> Any:
    """Rank the feasible plans for ``model`` on ``cluster``; the report has ``.best`` and ``.candidates``."""
    from lightning_autopar.planner.search import plan as _plan

    return _plan(model, cluster, global_batch=global_batch, seq_len=seq_len, fix=fix, top=top, **kwargs)


def estimate(model: Any, cluster: Any, plan: Any, **kwargs: Any) -> PricedPlan:
    """Price one plan (step time, memory, breakdown) without searching."""
    from lightning_autopar.planner.search import estimate as _estimate

    return _estimate(model, cluster, plan, **kwargs)


def _register() -> None:
    from lightning_autopar.strategy import AutoParallelStrategy, register

    register()
    globals()["AutoParallelStrategy"] = AutoParallelStrategy
    try:
        from lightning_autopar.fabric import register as register_fabric
    except ImportError:  # the Fabric strategy is optional until it lands
        return
    register_fabric()


_register()

__all__ = [
    "AutoParallelStrategy", "AutoparError", "ClusterSpec", "ConfigError", "DeviceSpec", "InfeasibleError",
    "LinkSpec", "ModelSpec", "Plan", "PricedPlan", "estimate", "load_cluster_spec", "load_model_spec",
    "parse_fix", "plan",
]
