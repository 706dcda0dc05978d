"""The block-stack pipeline's chunks: this rank's part of the user's transformer, each run by the user's own
``forward`` with the chunk's pieces swapped in.

* a non-first chunk gets zeros from the stand-ins of the parts before the blocks (the embeddings; a vision tower
  or a projector: zeros of their outputs' shapes, from a meta copy), and its first block receives the
  activation sent by the previous stage instead (whatever the model computes before the blocks is discarded);
* a non-last chunk stops at the first part after the blocks, the final norm (it raises the block output out of
  the forward), so the norm, the head and anything after them (e.g. a loss inside a Hugging Face model) never
  run there;
* the last chunk returns the model's output (a tensor, a tuple, or a ``ModelOutput``: flattened to tensors for
  the schedule and rebuilt before the user's loss code sees it).

Every chunk calls the model with the arguments the user's step passed for its micro-batch (``capture``):
positions and masks derived from the inputs are right on every stage. A model whose loop reads a per-layer list
of its config by the block's position (Hugging Face's ``config.layer_types[i]``: GPT-OSS, Gemma, Qwen with sliding
windows) sees that list led by the chunk's blocks' entries while the chunk runs (``PerLayerLists``).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_autopar.parallel.pipeline.moe import (MoESource, hand_over_targets, install_recorders, moe_sources,
                                                     router_recorder)
from lightning_autopar.parallel.pipeline.partition import StageParts, named_parts
from lightning_autopar.parallel.pipeline.standins import (ChunkRun, ExitStage, InjectReceived, StageOutput,
                                                          ZeroEmbedding, ZeroOutputs, blocks_container,
                                                          replace_submodule, stand_in_module)

if TYPE_CHECKING:
    from lightning_autopar.profile.analyze import ModelAnalysis


class PerLayerLists:
    """The per-layer lists of the transformer's configs (any list or tuple of plain values with one entry per
    block, on a ``config`` object a module holds), led by one chunk's entries while it runs: the model's own loop
    enumerates the chunk's blocks from 0, so ``layer_types[i]`` must be the chunk's i-th block's entry. The list
    keeps its length (the rest as it was), as what reads it by a block's own index expects: a Hugging Face cache
    built from ``config.layer_types`` has one layer per block, and a training forward's single pass returns the
    same keys and values from either kind of cache layer."""

    def __init__(self, transformer: nn.Module, num_blocks: int) -> None:
        configs = {id(c): c for m in transformer.modules() if (c := getattr(m, "config", None)) is not None
                   and hasattr(c, "__dict__") and not isinstance(c, nn.Module)}
        self.lists = [(c, name) for c in configs.values() for name, value in vars(c).items()
                      if isinstance(value, (list, tuple)) and len(value) == num_blocks
                      and all(v is None or isinstance(v, (str, int, float, bool)) for v in value)]

    @contextmanager
    def cut(self, start: int, stop: int) -> Iterator[None]:
        saved = [getattr(c, name) for c, name in self.lists]
        try:
            for (c, name), value in zip(self.lists, saved):
                object.__setattr__(c, name, type(value)([*value[start:stop], *value[stop - start:]]))
            yield
        finally:
            for (c, name), value in zip(self.lists, saved):
                object.__setattr__(c, name, value)


class PipelineChunk(nn.Module):
    """One pipeline chunk (stage) of the user's transformer, as torch.distributed.pipelining's stage module.

    Its registered children are what the chunk owns (its blocks; embeddings, final norm, head when first / last),
    so FSDP units and ``parameters()`` are per chunk; the forward runs the user's transformer with the chunk's
    pieces swapped in. The chunk is not a child of the LightningModule: parameter names stay the user's.
    """

    def __init__(self, index: int, num_chunks: int, transformer: nn.Module, analysis: ModelAnalysis,
                 block_items: list[tuple[str, nn.Module]], owned: dict[str, nn.Module],
                 originals: dict[str, nn.Module], inputs: Callable[[int], tuple[tuple, dict]],
                 own: Sequence[MoESource] = (), before: Sequence[MoESource] = (),
                 replay_targets: Sequence[nn.Module] = (), first_block: int = 0,
                 per_layer: PerLayerLists | None = None, parts: StageParts | None = None) -> None:
        super().__init__()
        parts = parts if parts is not None else named_parts(analysis)
        self._block_range = (first_block, first_block + len(block_items))  # in the whole stack
        self._per_layer = per_layer
        self.index, self.num_chunks = index, num_chunks
        self.blocks = nn.ModuleList(m for _, m in block_items)
        self.owned = nn.ModuleList(owned.values())
        self.__dict__["_transformer"] = transformer
        self.__dict__["_inputs"] = inputs
        self._blocks_fqn = analysis.blocks_fqn
        self._block_items = block_items
        self._run = ChunkRun()
        self.mb_index = 0
        self.out_spec: Any = None
        self._non_tensor: list[tuple[int, Any]] = []
        # MoE values: what arrives with the activation (earlier chunks' layers, in order), what this chunk adds,
        # and (last chunk) the modules that hand the received ones to the user's loss
        self._before, self._own = list(before), list(own)
        self._replay_targets = list(replay_targets)
        self.received_values: tuple[torch.Tensor, ...] = ()
        self._recorded: dict[int, torch.Tensor] = {}
        self._recording = False
        for source in self._own:
            if source.index is not None:
                source.module.register_forward_hook(self._recorder(source))
        if index == num_chunks - 1 and any(s.index is not None for s in self._before):
            self._run.replay = self._replay_recorded
        # the pieces' modules while this chunk runs: its own parts, else their stand-ins (``split_model``); a
        # non-last chunk ends its forward at the first part after the blocks
        first, last = index == 0, index == num_chunks - 1
        mine = set(parts.before + parts.idle) if first else set()
        mine |= set(parts.after) if last else set()
        self._pieces: dict[str, nn.Module] = part_stand_ins(originals, parts, analysis, self._run, skip=mine)
        self._pieces.update({fqn: owned[fqn] for fqn in mine})
        if not last:
            self._pieces[parts.after[0]] = ExitStage()

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def carries_moe_values(self) -> bool:
        """Whether this chunk's activation travels with MoE values (earlier or its own layers')."""
        return bool(self._before or self._own)

    def _recorder(self, source: MoESource) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._recording:  # this chunk's forward, not a recompute in backward
                self._recorded[id(source)] = output[source.index] if isinstance(output, tuple) else output
        return hook

    def _own_values(self) -> list[torch.Tensor]:
        values = []
        for source in self._own:
            if source.attr is not None:
                # a 1-element copy: p2p of a 0-dim tensor is avoided, and FSDP warns on outputs that are views
                values.append(getattr(source.module, source.attr).reshape(1).clone())
            elif id(source) in self._recorded:
                values.append(self._recorded[id(source)])
            else:
                raise RuntimeError(f"pipeline: the router {type(source.module).__name__} of block {source.block} "
                                   "did not run in its stage's forward")
        return values

    def _hand_over(self, received: tuple[torch.Tensor, ...]) -> None:
        """Last chunk: give the user's loss the earlier layers' values of this micro-batch."""
        self.received_values = received
        for source, target, value in zip(self._before, self._replay_targets, received):
            if source.attr is not None:
                setattr(target, source.attr, value.reshape(()))
            else:  # a copy: it becomes part of the model output, and FSDP warns on outputs that are views
                target.forward.value = value.clone()

    def _replay_recorded(self) -> None:
        for source, target in zip(self._before, self._replay_targets):
            if source.index is not None:
                target()

    @property
    def is_last(self) -> bool:
        return self.index == self.num_chunks - 1

    @contextmanager
    def _active(self, received: torch.Tensor | None) -> Iterator[None]:
        transformer = self.__dict__["_transformer"]
        blocks = transformer.get_submodule(self._blocks_fqn)
        items = list(self._block_items)
        if not self.is_first:
            items[0] = (items[0][0], InjectReceived(items[0][1], self._run))
        saved_blocks = blocks._modules
        saved = {fqn: transformer.get_submodule(fqn) for fqn in self._pieces}
        object.__setattr__(blocks, "_modules", OrderedDict(items))
        for fqn, module in self._pieces.items():
            replace_submodule(transformer, fqn, module)
        self._run.received = received
        try:
            with self._per_layer.cut(*self._block_range) if self._per_layer is not None else nullcontext():
                yield
        finally:
            self._run.received = None
            object.__setattr__(blocks, "_modules", saved_blocks)
            for fqn, module in saved.items():
                replace_submodule(transformer, fqn, module)

    def forward(self, *received: torch.Tensor) -> Any:
        """First chunk: ``received`` is ignored (the micro-batch index comes from the stage); else the
        activation of the previous chunk. Returns the activation, or (last chunk) the model output's tensors."""
        from torch.utils._pytree import tree_flatten

        args, kwargs = self.__dict__["_inputs"](self.mb_index)
        hidden = None if self.is_first else received[0]
        values = tuple(received[1:])
        if len(values) != len(self._before):
            raise RuntimeError(f"pipeline: chunk {self.index} received {len(values)} MoE values, expected "
                               f"{len(self._before)}")
        if self.is_last:
            self._hand_over(values)
        self._recorded, self._recording = {}, True
        with self._active(hidden):
            try:
                out = self.__dict__["_transformer"](*args, **kwargs)
            except StageOutput as stop:
                if self.is_last:
                    raise
                if not self.carries_moe_values:
                    # not a view: the split-backward schedules detach stage outputs in place (torch's
                    # stage_backward_input), which a view refuses (SP's gathered output at micro-batch size 1)
                    return stop.value.clone() if stop.value._is_view() else stop.value
                # earlier layers' values pass through (a copy: an output must not be the received tensor)
                return (stop.value, *(v.clone() for v in values), *self._own_values())
            finally:
                self._recording = False
        if not self.is_last:
            raise RuntimeError("pipeline: the forward finished without reaching the final norm / LM head")
        leaves, self.out_spec = tree_flatten(out)
        self._non_tensor = [(i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)]
        tensors = tuple(v for v in leaves if isinstance(v, torch.Tensor))
        return tensors[0] if len(tensors) == 1 else tensors

    def rebuild(self, output: Any) -> Any:
        """The model output (as the user's forward returned it) from what the last chunk returned."""
        from torch.utils._pytree import tree_unflatten

        tensors = list(output) if isinstance(output, (tuple, list)) else [output]
        leaves: list[Any] = []
        fixed = dict(self._non_tensor)
        it = iter(tensors)
        for i in range(self.out_spec.num_leaves):
            leaves.append(fixed[i] if i in fixed else next(it))
        return tree_unflatten(leaves, self.out_spec)


def split_model(transformer: nn.Module, analysis: ModelAnalysis, pp_rank: int, pp: int, vpp: int,
                sizes: Sequence[int], inputs: Callable[[int], tuple[tuple, dict]],
                owners: Sequence[int] | None = None, parts: StageParts | None = None) -> list[PipelineChunk]:
    """Prune ``transformer`` in place to what pipeline rank ``pp_rank`` owns; return its chunks (stage order).
    ``owners[j]`` is the rank of chunk j (``partition.stage_owners``; default round-robin, j % pp). ``parts``: who
    owns what outside the blocks (``partition.stage_parts``; default the embeddings, final norm and head)."""
    blocks = transformer.get_submodule(analysis.blocks_fqn)
    all_items = list(blocks._modules.items())
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    num_chunks = pp * vpp
    owners = list(owners) if owners is not None else [j % pp for j in range(num_chunks)]
    mine = [j for j in range(num_chunks) if owners[j] == pp_rank]
    parts = parts if parts is not None else named_parts(analysis)
    run_stub = ChunkRun()
    per_layer = PerLayerLists(transformer, len(all_items))
    originals = {fqn: transformer.get_submodule(fqn) for fqn in parts.all}
    stand_ins = part_stand_ins(originals, parts, analysis, run_stub)  # what the pruned model holds
    if router_recorder(transformer) is not None:
        install_recorders(transformer)
    sources = [moe_sources(transformer, analysis, all_items[bounds[j]:bounds[j + 1]]) for j in range(num_chunks)]
    local_keys = {key for j in mine for key, _ in all_items[bounds[j]:bounds[j + 1]]}
    chunks = []
    local_items: list[tuple[str, nn.Module]] = []
    for j in mine:
        items = all_items[bounds[j]:bounds[j + 1]]
        local_items += items
        owned = {}
        if j == 0:
            owned.update({f: originals[f] for f in parts.before + parts.idle})
        replay: list[nn.Module] = []
        if j == num_chunks - 1:
            owned.update({f: originals[f] for f in parts.after})
            replay = hand_over_targets([s for before in sources[:j] for s in before], local_keys, transformer,
                                       analysis.blocks_fqn)
        chunks.append(PipelineChunk(j, num_chunks, transformer, analysis, items, owned, originals, inputs,
                                    own=sources[j], before=[s for before in sources[:j] for s in before],
                                    replay_targets=replay, first_block=bounds[j], per_layer=per_layer, parts=parts))
    owned_here = {f for c in chunks for f in c._pieces if c._pieces[f] is originals.get(f)}
    for fqn, stand_in in stand_ins.items():
        if fqn not in owned_here:
            replace_submodule(transformer, fqn, stand_in)
    replace_submodule(transformer, analysis.blocks_fqn, blocks_container(local_items, blocks))
    return chunks


def part_stand_ins(originals: dict[str, nn.Module], parts: StageParts, analysis: ModelAnalysis,
                   run: ChunkRun, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, nn.Module]:
    """What takes each part's place (but ``skip``'s) on a chunk that does not own it: before the blocks, zeros of
    its output (``ZeroEmbedding`` for an embedding, else ``ZeroOutputs``), shaped as ``run``'s activation; after
    them nothing runs (a non-last chunk ends at the first, ``ExitStage``): an identity; never called: a
    parameter-free copy of its class."""
    embeddings = {f for f in (analysis.token_embedding, analysis.position_embedding) if f}
    stand_ins: dict[str, nn.Module] = {}
    for fqn in parts.before:
        if fqn not in skip:
            module = originals[fqn]
            stand_ins[fqn] = (ZeroEmbedding(int(module.weight.shape[-1]), run) if fqn in embeddings
                              else ZeroOutputs(module, run))
    stand_ins.update({fqn: nn.Identity() for fqn in parts.after if fqn not in skip})
    stand_ins.update({fqn: stand_in_module(originals[fqn]) for fqn in parts.idle if fqn not in skip})
    return stand_ins
