"""Pipeline parallelism: split the user's model at block boundaries and run it with torch.distributed.pipelining.

Split: the blocks are cut into ``pp * vpp`` contiguous chunks (the planner's ``layers_per_stage``, else an even
split); chunk ``j`` lives on pipeline rank ``j % pp`` (GPipe and 1F1B: one chunk per rank; interleaved 1F1B:
``vpp`` chunks per rank). The token and position embeddings go with the first chunk, the final norm and the LM
head with the last. Each rank keeps only its blocks, under their original indices (a ``ModuleList`` whose keys
are the original ones), and parameter-free stand-ins for the embeddings, norm and head it does not own, so the
parameter names of what remains are exactly the user's (``model.blocks.5.attn.q_proj.weight``): DCP
checkpoints and ``get_model_state_dict`` work per rank, and their union is the single-device state dict.

Running a chunk runs the user's own ``forward`` of the transformer with the chunk's pieces swapped in:

* a non-first chunk gets zeros from its embedding stand-ins, and its first block receives the activation sent
  by the previous stage instead (whatever the model computes before the blocks is discarded);
* a non-last chunk stops at the final norm (it raises the block output out of the forward), so the norm, the
  head and anything after them (e.g. a loss inside a Hugging Face model) never run there;
* the last chunk returns the model's output (a tensor, a tuple, or a ``ModelOutput``: flattened to tensors for
  the schedule and rebuilt before the user's loss code sees it).

The strategy captures, per micro-batch, the arguments the user's ``training_step`` passes to the model (the
token ids, masks, ...), and every chunk calls the model with them: positions and masks derived from the inputs
are right on every stage.

What is split (``pipeline_root``): the innermost module holding every parameter of the LightningModule -- the
transformer itself, or a wrapper adding the head to it (Hugging Face ``LlamaForCausalLM`` around ``LlamaModel``,
whose own loss with ``labels=`` then runs on the last stage).

MoE models: the load-balancing losses of every stage's MoE layers must reach the user's loss on the last stage,
exactly as on one device (their gradients then flow back through the schedule). Each non-last chunk sends,
next to its activation, one tensor per MoE layer so far (``MoESource``): the layer's ``aux_loss`` attribute
(``models.gpt.MoE``; any MoE module keeping its balance loss in a tensor attribute of that name), or the router
output Hugging Face records for its balance loss (``_can_record_outputs["router_logits"]``, e.g. Mixtral's router
logits). On the last chunk the received values are handed to the user's code where it looks for them:
attributes are set on parameter-free stand-ins of the layers' modules (same class, registered beside the blocks
as ``pipeline_moe_stand_ins``, so ``isinstance`` walks over ``modules()`` find them; on the layer's own module
when this rank holds it), and recorded router outputs are replayed by stand-in routers before the chunk's first
block, so Hugging Face's recorder lists every layer in order. A balance loss kept anywhere else (e.g. returned
through the block outputs) is not carried.

Requirements (one ``ConfigError`` otherwise): a stack of at least ``pp * vpp`` blocks; every parameter outside
the blocks belongs to the token embedding, the position embedding, the final norm or the LM head; a final norm
or an LM head to stop at; untied embeddings; the user's step calls that module once per micro-batch. Our GPT
(dense and MoE), Llama / Mixtral-style models and litgpt's GPT qualify (tested: ``models.gpt.GPT``, Hugging Face
``LlamaForCausalLM`` and ``MixtralForCausalLM``, ``litgpt.model.GPT``).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_autopar.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_autopar.profile.analyze import ModelAnalysis


# ------------------------------------------------------------------------------------------- partition


def chunk_sizes(num_blocks: int, pp: int, vpp: int = 1, layers_per_stage: Sequence[int] | None = None) -> list[int]:
    """Blocks per chunk (``pp * vpp`` chunks): the planner's partition when it fits, else an even split."""
    chunks = pp * vpp
    if layers_per_stage and len(layers_per_stage) == chunks and sum(layers_per_stage) == num_blocks \
            and min(layers_per_stage) >= 1:
        return [int(n) for n in layers_per_stage]
    base, extra = divmod(num_blocks, chunks)
    return [base + (1 if j < extra else 0) for j in range(chunks)]


def check_pipeline(analysis: ModelAnalysis, transformer: nn.Module, root: nn.Module, pp: int, vpp: int = 1) -> None:
    """Raise one ConfigError when ``transformer`` cannot be split into ``pp * vpp`` pipeline chunks."""
    from lightning_autopar.parallel.units import tie_groups

    if pp == 1:
        return
    need = "a stack of blocks (nn.ModuleList/Sequential), with embeddings, final norm and LM head outside it"
    chunks = pp * vpp
    if len(analysis.blocks) < chunks:
        raise ConfigError("plan.pp", f"pp*vpp={chunks} exceeds the {len(analysis.blocks)} blocks of the model",
                          "use pp*vpp <= number of blocks")
    ties = "; ".join(t.describe() for t in tie_groups(root))
    if analysis.tied_embeddings or ties:
        raise ConfigError("plan.pp", f"tied parameters {ties or 'LM head = token embedding'} are one tensor, which "
                          "pipeline stages cannot share", "use pp=1, or untie them (e.g. tie_word_embeddings=False)")
    if analysis.final_norm is None and analysis.lm_head is None:
        raise ConfigError("plan.pp", f"{type(transformer).__name__}: no final norm or LM head after the blocks, "
                          f"so a stage cannot end there; pipeline parallelism needs {need}", "use pp=1")
    pieces = [p for p in (analysis.token_embedding, analysis.position_embedding, analysis.final_norm,
                          analysis.lm_head) if p]
    prefixes = [analysis.blocks_fqn + "."] + [p + "." for p in pieces]
    for name, _ in transformer.named_parameters():
        if not any(name.startswith(p) for p in prefixes):
            raise ConfigError("plan.pp", f"parameter '{name}' is outside the blocks, embeddings, final norm and LM "
                              f"head, so no pipeline stage can own it; pipeline parallelism needs {need}",
                              "use pp=1, or move it into a block")
    transformer_ids = {id(p) for p in transformer.parameters()}
    for name, p in root.named_parameters():
        if id(p) not in transformer_ids:
            raise ConfigError("plan.pp", f"parameter '{name}' of the LightningModule lives outside the transformer "
                              "(the module holding the blocks), so no pipeline stage can own it", "use pp=1")


def pipeline_root(root: nn.Module, transformer: nn.Module) -> nn.Module:
    """The module the pipeline splits and runs: the innermost module under ``root`` holding every parameter of
    ``root`` -- the transformer itself (our GPT), or a wrapper adding the LM head to it (a Hugging Face
    ``*ForCausalLM`` around its ``*Model``); ``transformer`` when none does."""
    everything = {id(p) for p in root.parameters()}
    best: tuple[int, nn.Module] | None = None
    for name, module in root.named_modules():
        if name and everything <= {id(p) for p in module.parameters()}:
            depth = name.count(".")
            if best is None or depth > best[0]:
                best = (depth, module)
    return best[1] if best is not None else transformer


# ------------------------------------------------------------------------------------------- stand-ins


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


def _blocks_container(items: Sequence[tuple[str, nn.Module]], like: nn.Module) -> nn.Module:
    if isinstance(like, nn.Sequential):  # Sequential indexes positionally already
        seq = nn.Sequential()
        for key, module in items:
            seq.add_module(key, module)
        return seq
    return StageBlocks(items)


class _Run:
    """What the running chunk needs while the user's forward executes: the received activation."""

    def __init__(self) -> None:
        self.received: torch.Tensor | None = None
        self.replay: Callable[[], None] | None = None  # last chunk: earlier stages' router outputs, replayed

    def dtype(self) -> torch.dtype:
        return self.received.dtype if self.received is not None else torch.get_default_dtype()


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding owned by another stage: zeros of the embedding's output shape."""

    def __init__(self, dim: int, run: _Run) -> None:
        super().__init__()
        self.dim = dim
        self._run = [run]  # a list: not a submodule

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self._run[0].dtype(), device=ids.device)


class _StageOutput(Exception):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.value = value


class _Exit(nn.Module):
    """In place of the final norm (or head) on a non-last chunk: ends the forward with the block output."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise _StageOutput(x)


class _Inject(nn.Module):
    """In place of a non-first chunk's first block while it runs: feeds it the received activation."""

    def __init__(self, block: nn.Module, run: _Run) -> None:
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


def _set(root: nn.Module, fqn: str, module: nn.Module) -> None:
    parent, _, leaf = fqn.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


# ------------------------------------------------------------------------------------------- MoE values across stages


@dataclass
class MoESource:
    """A per-layer value the user's loss reads on the last stage but the layer's own stage computes: an MoE
    module's load-balancing loss attribute (``attr``, as ``models.gpt.MoE.aux_loss``), or a router output that
    Hugging Face records for its balance loss (``index`` into the router's output tuple)."""

    block: str  # the block's key in the blocks container
    module: nn.Module
    attr: str | None = None
    index: int | None = None


def router_recorder(root: nn.Module) -> tuple[type, int] | None:
    """(router class, output index) when a Hugging Face model in ``root`` records router outputs for its
    load-balancing loss (``_can_record_outputs["router_logits"]``), else None."""
    for module in root.modules():
        spec = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        for one in spec if isinstance(spec, list) else [spec] if spec is not None else []:
            if isinstance(one, type):
                return one, 1  # a bare class records output[1] (transformers' convention)
            if getattr(one, "target_class", None) is not None:
                return one.target_class, int(one.index)
            raise ConfigError("plan.pp", f"{type(module).__name__} records its router outputs by module name "
                              f"({one.class_name!r}), which pipeline stages cannot carry to the last stage",
                              "use pp=1")
    return None


def moe_sources(root: nn.Module, analysis: ModelAnalysis, items: Sequence[tuple[str, nn.Module]]) -> list[MoESource]:
    """The MoE values of the blocks ``items`` (in block order) that the last stage's loss may read."""
    recorder = router_recorder(root)
    moe_of = {info.fqn.rsplit(".", 1)[-1]: info.moe for info in analysis.blocks if info.moe is not None}
    sources = []
    for key, block in items:
        info = moe_of.get(key)
        if info is not None:
            module = block.get_submodule(info.fqn) if info.fqn else block
            if isinstance(getattr(module, "aux_loss", None), torch.Tensor):
                sources.append(MoESource(key, module, attr="aux_loss"))
        if recorder is not None:
            sources += [MoESource(key, m, index=recorder[1]) for m in block.modules() if isinstance(m, recorder[0])]
    return sources


def _install_recorders(root: nn.Module) -> None:
    """Install Hugging Face's output-recorder hooks on the whole model now: transformers installs them lazily on
    the first forward that records, which after the split would only see one chunk's modules."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # another transformers layout: its hooks, if any, are its own business
        return
    recording = [m for m in root.modules() if getattr(type(m), "_can_record_outputs", None)]
    for module in recording:
        # the innermost recording model only (the one whose forward records): installing from a wrapper would
        # install its inner model's hooks a second time when they are already there
        if not any(other is not module and other in set(module.modules()) for other in recording):
            maybe_install_capturing_hooks(module)


class _ReplayForward:
    """A stand-in router's forward on the last stage: returns the received value where Hugging Face's output
    recorder reads it, so the model's own balance loss sees every layer in order."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.value: torch.Tensor | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        return tuple(self.value if i == self.index else None for i in range(self.index + 1))


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


# ------------------------------------------------------------------------------------------- chunks


class PipelineChunk(nn.Module):
    """One pipeline chunk (stage) of the user's transformer, as torch.distributed.pipelining's stage module.

    Its registered children are what the chunk owns (its blocks; embeddings, final norm, head when first / last),
    so FSDP units and ``parameters()`` are per chunk; the forward runs the user's transformer with the chunk's
    pieces swapped in. The chunk is not a child of the LightningModule: parameter names stay the user's.
    """

    def __init__(self, index: int, num_chunks: int, transformer: nn.Module, analysis: ModelAnalysis,
                 block_items: list[tuple[str, nn.Module]], owned: dict[str, nn.Module],
                 stand_ins: dict[str, nn.Module], inputs: Callable[[int], tuple[tuple, dict]],
                 own: Sequence[MoESource] = (), before: Sequence[MoESource] = (),
                 replay_targets: Sequence[nn.Module] = ()) -> None:
        super().__init__()
        self.index, self.num_chunks = index, num_chunks
        self.blocks = nn.ModuleList(m for _, m in block_items)
        self.owned = nn.ModuleList(owned.values())
        self.__dict__["_transformer"] = transformer
        self.__dict__["_inputs"] = inputs
        self._blocks_fqn = analysis.blocks_fqn
        self._block_items = block_items
        self._run = _Run()
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
        # the pieces' modules while this chunk runs
        first, last = index == 0, index == num_chunks - 1
        self._pieces: dict[str, nn.Module] = {}
        for fqn in (analysis.token_embedding, analysis.position_embedding):
            if fqn:
                self._pieces[fqn] = owned[fqn] if first else ZeroEmbedding(stand_ins[fqn].dim, self._run)
        exit_at = analysis.final_norm or analysis.lm_head
        for fqn in (analysis.final_norm, analysis.lm_head):
            if fqn:
                self._pieces[fqn] = owned[fqn] if last else (_Exit() if fqn == exit_at else nn.Identity())

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
            items[0] = (items[0][0], _Inject(items[0][1], self._run))
        saved_blocks = blocks._modules
        saved = {fqn: transformer.get_submodule(fqn) for fqn in self._pieces}
        object.__setattr__(blocks, "_modules", OrderedDict(items))
        for fqn, module in self._pieces.items():
            _set(transformer, fqn, module)
        self._run.received = received
        try:
            yield
        finally:
            self._run.received = None
            object.__setattr__(blocks, "_modules", saved_blocks)
            for fqn, module in saved.items():
                _set(transformer, fqn, module)

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
            except _StageOutput as stop:
                if self.is_last:
                    raise
                if not self.carries_moe_values:
                    return stop.value
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
                sizes: Sequence[int], inputs: Callable[[int], tuple[tuple, dict]]) -> list[PipelineChunk]:
    """Prune ``transformer`` in place to what pipeline rank ``pp_rank`` owns; return its chunks (stage order)."""
    blocks = transformer.get_submodule(analysis.blocks_fqn)
    all_items = list(blocks._modules.items())
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    num_chunks = pp * vpp
    mine = [j for j in range(num_chunks) if j % pp == pp_rank]
    run_stub = _Run()
    stand_ins: dict[str, nn.Module] = {}
    for fqn in (analysis.token_embedding, analysis.position_embedding):
        if fqn:
            weight = transformer.get_submodule(fqn).weight
            stand_ins[fqn] = ZeroEmbedding(int(weight.shape[-1]), run_stub)
    for fqn in (analysis.final_norm, analysis.lm_head):
        if fqn:
            stand_ins[fqn] = nn.Identity()
    originals = {fqn: transformer.get_submodule(fqn) for fqn in stand_ins}
    if router_recorder(transformer) is not None:
        _install_recorders(transformer)
    sources = [moe_sources(transformer, analysis, all_items[bounds[j]:bounds[j + 1]]) for j in range(num_chunks)]
    local_keys = {key for j in mine for key, _ in all_items[bounds[j]:bounds[j + 1]]}
    chunks = []
    local_items: list[tuple[str, nn.Module]] = []
    for j in mine:
        items = all_items[bounds[j]:bounds[j + 1]]
        local_items += items
        owned = {}
        if j == 0:
            owned.update({f: originals[f] for f in (analysis.token_embedding, analysis.position_embedding) if f})
        replay: list[nn.Module] = []
        if j == num_chunks - 1:
            owned.update({f: originals[f] for f in (analysis.final_norm, analysis.lm_head) if f})
            replay = _replay_targets([s for before in sources[:j] for s in before], local_keys, transformer,
                                     analysis.blocks_fqn)
        chunks.append(PipelineChunk(j, num_chunks, transformer, analysis, items, owned, stand_ins, inputs,
                                    own=sources[j], before=[s for before in sources[:j] for s in before],
                                    replay_targets=replay))
    owned_here = {f for c in chunks for f in c._pieces if c._pieces[f] is originals.get(f)}
    for fqn, stand_in in stand_ins.items():
        if fqn not in owned_here:
            _set(transformer, fqn, stand_in)
    _set(transformer, analysis.blocks_fqn, _blocks_container(local_items, blocks))
    return chunks


def _replay_targets(before: list[MoESource], local_keys: set[str], transformer: nn.Module,
                    blocks_fqn: str) -> list[nn.Module]:
    """Last chunk: per earlier MoE value, the module the user's loss reads it from. An attribute goes on the
    layer's own module when this rank holds it (interleaved schedules), else on a stand-in; a recorded router
    output is always replayed by a stand-in router. Stand-ins are registered beside the blocks (no parameters,
    so names and state dicts are unchanged) where the user's ``modules()`` walk and Hugging Face's recorder
    find them."""
    targets: list[nn.Module] = []
    stand_ins = []
    for source in before:
        if source.attr is not None and source.block in local_keys:
            targets.append(source.module)
            continue
        ghost = stand_in_module(source.module)
        if source.attr is not None:
            setattr(ghost, source.attr, torch.zeros(()))
        else:
            ghost.forward = _ReplayForward(source.index)
        targets.append(ghost)
        stand_ins.append(ghost)
    if stand_ins:
        parent, _, _ = blocks_fqn.rpartition(".")
        owner = transformer.get_submodule(parent) if parent else transformer
        owner.add_module("pipeline_moe_stand_ins", nn.ModuleList(stand_ins))
    return targets


# ------------------------------------------------------------------------------------------- schedule


def _stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        """Tells its chunk which micro-batch it runs, and flags the shape-inference pass."""

        inferring = False

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.submod.mb_index = fwd_chunk_id
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            self.submod.mb_index = 0
            Stage.inferring = True
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                Stage.inferring = False

        def _to_tensor(self, arg: Any) -> torch.Tensor:
            # the shape-inference pass runs a real forward on tensors made from metadata, uninitialised by
            # default: ranks of a TP group could then route MoE tokens differently and their collectives
            # (which depend on the routing) would no longer match. Zeros are the same everywhere.
            out = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):
                with torch.no_grad():
                    out.zero_()
            return out

        def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
            Stage.inferring = True
            try:
                return super()._prepare_backward_infra(*args, **kwargs)
            finally:
                Stage.inferring = False

    return Stage


class StagedPipeline:
    """What both pipelines share once their chunks exist: this rank's place in the pp group, the schedule over
    its stages, the training step, the forward-only pass in stage order and the broadcast from the last stage.
    Subclasses set ``chunks`` (with ``index``, ``num_chunks``, ``is_first``/``is_last``, ``mb_index``,
    ``rebuild``) and call ``_build_schedule``."""

    def _join(self, pp_mesh: DeviceMesh, device: torch.device, n_microbatches: int) -> None:
        self.pp_mesh = pp_mesh
        self.group = pp_mesh.get_group()
        self.pp = pp_mesh.size()
        self.pp_rank = pp_mesh.get_local_rank()
        self.device = device
        self.inputs: list[tuple[tuple, dict]] = []
        self.n_microbatches = n_microbatches

    def _build_schedule(self, stage_cls: type, schedule: str,
                        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self._stage_cls = stage_cls
        self.stages = [stage_cls(c, c.index, c.num_chunks, self.device, group=self.group) for c in self.chunks]
        if schedule == "interleaved" or len(self.stages) > 1:
            self.schedule = ScheduleInterleaved1F1B(self.stages, self.n_microbatches, loss_fn=loss_fn,
                                                    scale_grads=False)
        else:
            kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.schedule = kind(self.stages[0], self.n_microbatches, loss_fn=loss_fn, scale_grads=False)

    @property
    def inferring(self) -> bool:
        """True while the schedule infers shapes (a real forward/backward whose loss must not be recorded)."""
        return self._stage_cls.inferring

    @property
    def has_last(self) -> bool:
        return any(c.is_last for c in self.chunks)

    @property
    def last_chunk(self) -> Any:
        return next(c for c in self.chunks if c.is_last)

    def input_of(self, mb_index: int) -> tuple[tuple, dict]:
        return self.inputs[mb_index]

    def last_rank(self) -> int:
        """Global rank of the last stage in this rank's pipeline group."""
        num_chunks = self.chunks[0].num_chunks
        return int(self.pp_mesh.mesh.flatten()[(num_chunks - 1) % self.pp].item())

    def train_step(self, inputs: list[tuple[tuple, dict]]) -> None:
        """Forward and backward of all micro-batches through the schedule. ``inputs[i]`` are the (args, kwargs)
        of the model call for micro-batch i; the loss function given at construction runs on the last stage
        with the micro-batch index as its target."""
        if len(inputs) != self.n_microbatches:
            raise RuntimeError(f"pipeline: {len(inputs)} micro-batches, planned {self.n_microbatches}")
        self.inputs = inputs
        index = torch.arange(self.n_microbatches, device=self.device)
        args = (index,) if self.chunks[0].is_first else ()
        try:
            self.schedule.step(*args, target=index if self.has_last else None, return_outputs=False)
        finally:
            self.inputs = []
            self._after_step()

    def _after_step(self) -> None:
        """Hook run after every training step, also a failed one."""

    def forward_only(self, inputs: tuple[tuple, dict]) -> Any:
        """One micro-batch forward through all chunks in stage order without gradients (validation); returns
        the model output on the rank holding the last chunk, else None."""
        return self._forward_chunks(self.chunks, inputs)

    def _forward_chunks(self, chunks: Sequence[Any], inputs: tuple[tuple, dict]) -> Any:
        import torch.distributed as dist

        self.inputs = [inputs]
        ranks = self.pp_mesh.mesh.flatten().tolist()
        by_index = {c.index: c for c in chunks}
        num_chunks = chunks[0].num_chunks
        received: tuple[torch.Tensor, ...] = ()
        out = None
        try:
            with torch.no_grad():
                for j in range(num_chunks):
                    owner, prev = j % self.pp, (j - 1) % self.pp
                    if owner != self.pp_rank:
                        continue
                    chunk = by_index[j]
                    if j > 0 and prev != self.pp_rank:  # the activation (and MoE values) of the chunk before
                        meta: list[Any] = [None]
                        dist.recv_object_list(meta, src=ranks[prev], group=self.group)
                        received = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta[0])
                        for tensor in received:
                            dist.recv(tensor, src=ranks[prev], group=self.group)
                    chunk.mb_index = 0
                    result = chunk(*received)
                    if chunk.is_last:
                        out = chunk.rebuild(result)
                        break
                    received = result if isinstance(result, tuple) else (result,)
                    nxt = (j + 1) % self.pp
                    if nxt != self.pp_rank:
                        meta = [[(tuple(t.shape), t.dtype) for t in received]]
                        dist.send_object_list(meta, dst=ranks[nxt], group=self.group)
                        for tensor in received:
                            dist.send(tensor.contiguous(), dst=ranks[nxt], group=self.group)
        finally:
            self.inputs = []
            self._reshard(chunks)
        return out

    @staticmethod
    def _reshard(chunks: Sequence[nn.Module]) -> None:
        """Free parameters FSDP kept gathered after a forward without backward (the next step gathers the
        updated ones; stale gathered copies would otherwise survive the optimizer step)."""
        from torch.distributed.fsdp import FSDPModule

        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def broadcast_from_last(self, obj: Any) -> Any:
        """``obj`` as given on the last stage's rank, on every rank of the pipeline group."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.last_rank(), group=self.group)
        return box[0]


class Pipeline(StagedPipeline):
    """This rank's chunks of a block stack, their stages and the schedule (``StagedPipeline``).

    Construction splits ``transformer`` in place; TP, EP, recompute and FSDP are then applied to the chunks by
    the caller (the strategy's order), which the stages and the schedule only use from the first step on.
    """

    def __init__(self, transformer: nn.Module, analysis: ModelAnalysis, pp_mesh: DeviceMesh, schedule: str, vpp: int,
                 n_microbatches: int, device: torch.device, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 layers_per_stage: Sequence[int] | None = None) -> None:
        self._join(pp_mesh, device, n_microbatches)
        self.sizes = chunk_sizes(len(analysis.blocks), self.pp, vpp, layers_per_stage)
        self.chunks = split_model(transformer, analysis, self.pp_rank, self.pp, vpp, self.sizes, self.input_of)
        user_loss = loss_fn

        def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            loss = user_loss(output, target)
            # every received MoE value gets a gradient (zero where the user's loss does not read it), so the
            # stages before always have one to send back
            for value in self.last_chunk.received_values:
                loss = loss + (value * 0).sum()
            return loss

        self._build_schedule(_stage_class(), schedule, loss_fn)


# ------------------------------------------------------------------------------------------- the user's step


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("model call captured")
        self.args, self.kwargs = args, kwargs


@contextmanager
def model_call_replaced(transformer: nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """While active, calling ``transformer`` runs ``fn`` instead of its forward (hooks included)."""
    transformer.forward = fn  # instance attribute: shadows the class's forward
    try:
        yield
    finally:
        transformer.__dict__.pop("forward", None)


def capture_model_call(transformer: nn.Module, step: Callable[[], Any], hook: str = "training_step") -> tuple[tuple, dict]:
    """Run the user's ``step`` up to its call of the model and return that call's (args, kwargs)."""

    def grab(*args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)

    with model_call_replaced(transformer, grab), torch.no_grad():
        try:
            step()
        except _Captured as call:
            return call.args, call.kwargs
    raise ConfigError(hook, f"with pipeline parallelism the {hook} must call the model "
                      f"({type(transformer).__name__}) exactly once, and it never did", "use pp=1")
