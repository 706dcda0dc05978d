"""Parameter-free modules that take the place of what a chunk does not own, so names stay the user's.

Each rank keeps only its blocks, under their original indices (``StageBlocks``: a ``ModuleList`` whose keys are
the original ones), and stand-ins for the parts outside the blocks it does not own (the embeddings, a vision
tower, the final norm, the head: ``partition.StageParts``), so the parameter names of what remains are exactly
the user's (``model.blocks.5.attn.q_proj.weight``): DCP checkpoints and
``get_model_state_dict`` work per rank, and their union is the single-device state dict. While a chunk runs, a
non-first chunk's embeddings give zeros (``ZeroEmbedding``), as do its other parts before the blocks
(``ZeroOutputs``, shaped by a meta copy of the part), and its first block receives the previous stage's
activation (``InjectReceived``); a non-last chunk stops at the first part after the blocks, the final norm
(``ExitStage`` raises ``StageOutput``).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from lightning_autopar.profile.stage_flow import hidden_slot


class StageBlocks(nn.ModuleList):
    """A ModuleList holding some of the original blocks under their original indices (names unchanged);
    integer indexing and slicing are positional, as on the full list."""

    def __init__(self, items: Sequence[tuple[str, nn.Module]] | Sequence[nn.Module] = ()) -> None:
        super().__init__()
        for i, item in enumerate(items):
            key, module = item if isinstance(item, tuple) else (str(i), item)
            self.add_module(key, module)

    def __getitem__(self, idx: int | slice) -> Any:  # type: ignore[override]
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return StageBlocks(values[idx])
        return values[idx]


def blocks_container(items: Sequence[tuple[str, nn.Module]], like: nn.Module) -> nn.Module:
    """A container of the same kind as the user's blocks ``like``, holding ``items`` under their keys."""
    if isinstance(like, nn.Sequential):  # Sequential indexes positionally already
        seq = nn.Sequential()
        for key, module in items:
            seq.add_module(key, module)
        return seq
    if isinstance(like, nn.ModuleDict):  # the user's forward iterates .values() / .items()
        return nn.ModuleDict(dict(items))
    return StageBlocks(items)


class ChunkRun:
    """What the running chunk needs while the user's forward executes: the received activation."""

    def __init__(self) -> None:
        self.received: torch.Tensor | None = None
        self.replay: Callable[[], None] | None = None  # last chunk: earlier stages' router outputs, replayed

    def dtype(self) -> torch.dtype:
        return self.received.dtype if self.received is not None else torch.get_default_dtype()


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding owned by another stage: zeros of the embedding's output shape."""

    def __init__(self, dim: int, run: ChunkRun) -> None:
        super().__init__()
        self.dim = dim
        self._run = [run]  # a list: not a submodule

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self._run[0].dtype(), device=ids.device)


class ReadsThrough(nn.Module):
    """A stand-in whose attributes it lacks are those of what it stands for (``_original``, kept out of the
    submodules: names stay the user's), as the user's forward reads them (a block's config, a tower's patch
    size)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_original"], name)


class ZeroOutputs(ReadsThrough):
    """Stands in for a part another stage runs before the blocks (a vision tower, a projector): its outputs'
    zeros, in their structure (a tensor, a tuple, a ``ModelOutput``), on the activation's device. Their shapes
    come from a meta copy of the part run on the call's arguments as meta tensors (no memory, no compute); what
    the user's forward reads of the part besides its call (its config, ...) is the copy's."""

    def __init__(self, module: nn.Module, run: ChunkRun) -> None:
        super().__init__()
        self.__dict__["_original"] = meta_copy(module)  # no parameters: they stay the owning stage's
        self._run = [run]  # a list: not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = self._run[0]
        device = run.received.device if run.received is not None else next(
            (t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), torch.device("cpu"))

        def to_meta(t: Any) -> Any:
            return t.to("meta") if isinstance(t, torch.Tensor) else t

        def zeros(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return torch.zeros(t.shape, dtype=run.dtype() if t.is_floating_point() else t.dtype, device=device)

        with torch.no_grad():
            out = self.__dict__["_original"](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        return tree_map(zeros, out)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors (no data copied)."""
    import copy

    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(module, memo)


class StageOutput(Exception):
    """Carries a non-last chunk's block output out of the user's forward (raised by ``ExitStage``)."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.value = value


class ExitStage(nn.Module):
    """In place of the final norm (or head) on a non-last chunk: ends the forward with the block output."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise StageOutput(x)


# while a non-first chunk's first block runs: the shape of the hidden state the received activation stands for
# (what the stage computed before its blocks; read by SP's hooks, parallel.sequence, where the activation arrives
# as this rank's sequence chunk and the whole length is not in its shape)
STANDS_FOR: ContextVar[tuple[int, ...] | None] = ContextVar("autopar_stands_for", default=None)


class InjectReceived(ReadsThrough):
    """In place of a non-first chunk's first block while it runs: feeds it the received activation."""

    def __init__(self, block: nn.Module, run: ChunkRun) -> None:
        super().__init__()
        self.__dict__["_original"] = block
        self.__dict__["_run_ref"] = run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        received = self.__dict__["_run_ref"].received
        slot = hidden_slot(args, kwargs)
        if slot is None:
            raise RuntimeError("pipeline: cannot find the hidden-state argument of the first block")
        stands_for = args[0] if slot == 0 else kwargs[slot]
        if slot == 0:
            args = (received, *args[1:])
        else:
            kwargs = {**kwargs, slot: received}
        replay = self.__dict__["_run_ref"].replay
        if replay is not None:  # before the chunk's first router, so recorded outputs stay in layer order
            replay()
        token = STANDS_FOR.set(tuple(stands_for.shape) if isinstance(stands_for, torch.Tensor) else None)
        try:
            return self.__dict__["_original"](*args, **kwargs)
        finally:
            STANDS_FOR.reset(token)


def replace_submodule(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Put ``module`` at ``fqn`` under ``root`` (swapping a piece in or out while a chunk runs)."""
    parent, _, leaf = fqn.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def stand_in_module(module: nn.Module) -> nn.Module:
    """A parameter-free instance of ``module``'s class (so the user's ``isinstance`` checks and Hugging Face's
    recorder hooks still find it) carrying its plain attributes and forward hooks, for a layer of another stage."""
    ghost = type(module).__new__(type(module))
    nn.Module.__init__(ghost)
    for key, value in vars(module).items():
        if not key.startswith("_") and key != "forward" and not isinstance(value, (nn.Module, torch.Tensor)):
            ghost.__dict__[key] = value
    ghost._forward_hooks.update(module._forward_hooks)  # recorders installed before the split
    ghost._forward_hooks_with_kwargs.update(module._forward_hooks_with_kwargs)
    return ghost
