"""Parameter-free modules that take the place of what a chunk does not own, so names stay the user's.

Each rank keeps only its blocks, under their original indices (``StageBlocks``: a ``ModuleList`` whose keys are
the original ones), and stand-ins for the embeddings, norm and head it does not own, so the parameter names of
what remains are exactly the user's (``model.blocks.5.attn.q_proj.weight``): DCP checkpoints and
``get_model_state_dict`` work per rank, and their union is the single-device state dict. While a chunk runs, a
non-first chunk's embeddings give zeros (``ZeroEmbedding``) and its first block receives the previous stage's
activation (``InjectReceived``); a non-last chunk stops at the final norm (``ExitStage`` raises
``StageOutput``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn


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


class StageOutput(Exception):
    """Carries a non-last chunk's block output out of the user's forward (raised by ``ExitStage``)."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.value = value


class ExitStage(nn.Module):
    """In place of the final norm (or head) on a non-last chunk: ends the forward with the block output."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise StageOutput(x)


class InjectReceived(nn.Module):
    """In place of a non-first chunk's first block while it runs: feeds it the received activation."""

    def __init__(self, block: nn.Module, run: ChunkRun) -> None:
        super().__init__()
        self.__dict__["_block"] = block  # not a submodule: names stay the user's
        self.__dict__["_run_ref"] = run

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_block"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        received = self.__dict__["_run_ref"].received
        if args:
            args = (received, *args[1:])
        else:
            key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
            if key is None:
                raise RuntimeError("pipeline: cannot find the hidden-state argument of the first block")
            kwargs = {**kwargs, key: received}
        replay = self.__dict__["_run_ref"].replay
        if replay is not None:  # before the chunk's first router, so recorded outputs stay in layer order
            replay()
        return self.__dict__["_block"](*args, **kwargs)


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
