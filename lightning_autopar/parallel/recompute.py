"""Activation recomputation per plan: none, selective or full, per block, keeping parameter names.

Both modes use the composable ``torch.distributed._composable.checkpoint`` on each block (hooks, no wrapper
module: FQNs stay the user's; composes with TP DTensors and FSDP2 applied afterwards):

* full: nothing inside a block is kept for backward except its input; the whole block reruns in backward.
* selective: an op-level policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs
  of the matmuls and of fused attention kernels are kept (the expensive ops), everything else -- norms,
  activations, softmax, dropout, residual adds, reshapes -- is recomputed. This is the Megatron-style trade:
  most of the memory of the cheap element-wise ops goes, little compute is repeated. In MoE blocks the experts
  are FSDP units of their own, whose hooks the op-level replay cannot reproduce, so there selective recompute
  is the attention core instead: the attention module is recomputed whole, the MoE part keeps its activations
  (the whole block is recomputed when the analysis found no attention module).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from lightning_autopar.errors import ConfigError

MODES = ("none", "selective", "full")


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm"]
    ops = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED = _saved_ops()


def selective_context() -> Any:
    """The (forward, recompute) context pair of the selective policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def apply_recompute(modules: Iterable[nn.Module], mode: str,
                    attention_of: Mapping[nn.Module, nn.Module] | None = None) -> None:
    """Checkpoint each module (a transformer block) per ``mode``; a no-op for "none". ``attention_of`` maps
    the blocks whose selective recompute is their attention module (MoE blocks) to that module."""
    if mode not in MODES:
        raise ConfigError("plan.recompute", f"unknown {mode!r}", f"use one of {', '.join(MODES)}")
    if mode == "none":
        return
    from torch.distributed._composable import checkpoint

    for module in modules:
        if mode == "full":
            checkpoint(module)
        elif attention_of and module in attention_of:
            checkpoint(attention_of[module])
        else:
            checkpoint(module, context_fn=partial(selective_context))
