"""Activation recomputation per plan: none, selective, full or ops, per block (one block in ``recompute_every``),
keeping parameter names.

Every mode uses the composable ``torch.distributed._composable.checkpoint`` on each block (hooks, no wrapper
module: FQNs stay the user's; composes with TP DTensors, SP hooks and FSDP2 applied afterwards, and with the
pipeline chunks, whose blocks are the rank's own modules):

* full: nothing inside a block is kept for backward except its input; the whole block reruns in backward.
* selective: an op-level policy (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs
  of the matmuls and of fused attention kernels are kept (the expensive ops), everything else -- norms,
  activations, softmax, dropout, residual adds, reshapes -- is recomputed. In MoE blocks the experts are FSDP
  units of their own, whose hooks the op-level replay cannot reproduce, so there selective recompute is the
  attention core instead: the attention module is recomputed whole, the MoE part keeps its activations.
* ops (issue 17): torchtitan's op-level selective activation checkpointing: the outputs of the ops in
  ``SAVED_OPS`` are kept (MUST_SAVE), except that of the ops in ``ALTERNATED_OPS`` (aten.mm) only every other
  one in forward order is (the 1st, 3rd, ...: q, v, gate, down in a Llama block), the rest is recomputed
  (PREFER_RECOMPUTE). That keeps about half of the matmul memory of ``selective`` for a few re-run GEMMs, the
  trade torchtitan ships for Llama 3 8B (planner.cost_memory.ops_saved_elements / ops_recompute_time price it). MoE
  blocks cannot run it (planner.space.ops_rule: refused in one line).

  ``SAVED_OPS`` is a module-level set of aten overloads a user can extend before setup, e.g.
  ``lightning_autopar.parallel.recompute.SAVED_OPS.add(torch.ops.aten.gelu.default)`` keeps the activation's
  output too (more memory, less recompute); ``ALTERNATED_OPS`` can be emptied to keep every matmul output.

``recompute_every = k`` checkpoints the blocks ``i % k == 0`` of the modules given, i.e. the rank's local blocks
in model order (under pipeline parallelism: over all of the rank's chunks together), the others keep their
activations (torchtitan's per-layer selective form); the planner prices ceil(n/k) of a rank's n blocks so.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import RECOMPUTE_MODES

MODES = RECOMPUTE_MODES


def _overloads(names: Iterable[str], namespace: Any = None) -> set:
    """The default overloads of the aten ops ``names`` this torch build has."""
    namespace = namespace or torch.ops.aten
    ops = set()
    for name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


# compute-bound ops whose outputs are kept (matmuls, fused attention, fp8 GEMMs); the SDPA ops return the
# attention output and its logsumexp, which their backward reads
SAVED_OPS: set = _overloads(["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm"])
# ops=recompute: of these, only every other output (in forward order within a block) is kept (torchtitan)
ALTERNATED_OPS: set = _overloads(["mm"])


def _policy(alternate: bool) -> Callable[..., Any]:
    """A selective-checkpoint policy for one checkpointed forward: MUST_SAVE for SAVED_OPS (with ``alternate``, only
    the odd-numbered calls of ALTERNATED_OPS), PREFER_RECOMPUTE otherwise. The count restarts with each forward and
    is kept apart for the recompute, so both see the same op sequence and make the same choices."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op not in SAVED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if alternate and op in ALTERNATED_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def selective_context(alternate: bool = False) -> Any:
    """The (forward, recompute) context pair of the op-level policy (``alternate``: ops' every-other matmul)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy(alternate))


_RECOMPUTED = "_autopar_recomputed"


def recomputed(module: nn.Module) -> bool:
    """``module`` is checkpointed by ``apply_recompute`` (its activations are rebuilt in backward)."""
    return getattr(module, _RECOMPUTED, False)


def apply_recompute(modules: Iterable[nn.Module], mode: str,
                    attention_of: Mapping[nn.Module, nn.Module] | None = None, every: int = 1) -> None:
    """Checkpoint each module (a transformer block) per ``mode``, the ones at index ``i % every == 0`` only; a
    no-op for "none". ``attention_of`` maps the MoE blocks (selective recompute: their attention module)."""
    if mode not in MODES:
        raise ConfigError("plan.recompute", f"unknown {mode!r}", f"use one of {', '.join(MODES)}")
    if every < 1:
        raise ConfigError("plan.recompute_every", f"recompute_every={every} must be >= 1", "use 1, 2, 4, ...")
    if mode == "none":
        return
    from torch.distributed._composable import checkpoint

    for i, module in enumerate(modules):
        if i % every:
            continue
        if mode == "full":
            checkpoint(module)
            setattr(module, _RECOMPUTED, True)
        elif attention_of and module in attention_of:
            if mode == "ops":
                raise ConfigError("plan.recompute", f"recompute=ops replays each block op by op, which the MoE "
                                  f"block {type(module).__name__}'s experts (own FSDP units) cannot",
                                  "use recompute=full or selective")
            checkpoint(attention_of[module])
            setattr(attention_of[module], _RECOMPUTED, True)
        else:
            checkpoint(module, context_fn=partial(selective_context, mode == "ops"))
            setattr(module, _RECOMPUTED, True)
