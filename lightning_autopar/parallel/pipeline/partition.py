"""Where the block-stack pipeline cuts: what is split, whether it can be, and how many blocks each chunk gets.

The blocks are cut into ``pp * vpp`` contiguous chunks (the planner's ``layers_per_stage``, else an even split);
chunk ``j`` lives on pipeline rank ``j % pp`` (GPipe and 1F1B: one chunk per rank; interleaved 1F1B and
interleaved zero bubble: ``vpp`` chunks per rank), or in a V for ZBV and DualPipeV (``stage_owners``: rank ``r``
holds chunks ``r`` and ``2*pp-1-r``, so the first and the last chunk share rank 0). What lies outside the blocks
goes by what the model's traced call runs (``stage_parts``): the parts run before the first block (the
embeddings, a VLM's vision tower and projector, a ViT's patch embedding and class token) with the first chunk,
those run after the last block (the final norm, a pooler, the head) with the last.

What is split (``pipeline_root``): the innermost module holding every parameter of the LightningModule -- the
transformer itself, or a wrapper adding the head to it (Hugging Face ``LlamaForCausalLM`` around ``LlamaModel``,
whose own loss with ``labels=`` then runs on the last stage; ``LlavaForConditionalGeneration`` around its tower,
projector and text model).

Requirements (``check_pipeline``, one ``ConfigError`` otherwise): a stack of at least ``pp * vpp`` blocks; every
parameter outside the blocks in a part that runs before or after them (none among them, none on the module
holding the blocks); something with parameters after the blocks to stop at; untied embeddings; the user's step
calls that module once per micro-batch. Without a trace of the model's call, the parts are the ones the
structure names: the token and position embeddings, the final norm, the LM head. Our GPT (dense and MoE),
Llama / Mixtral-style models, litgpt's GPT, Hugging Face ViT and LLaVA qualify (tested: ``models.gpt.GPT``,
Hugging Face ``LlamaForCausalLM`` and ``MixtralForCausalLM``, ``litgpt.model.GPT``; the third-party matrix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from torch import nn

from lightning_autopar.errors import ConfigError

if TYPE_CHECKING:
    from lightning_autopar.parallel.units import CallTrace
    from lightning_autopar.profile.analyze import ModelAnalysis


def stage_owners(pp: int, num_chunks: int, schedule: str) -> list[int]:
    """Pipeline rank of each chunk: a V for ``V_SCHEDULES`` (rank r holds chunks r and 2*pp-1-r, torch's
    ``generate_stage_to_rank_mapping(style="v")``), else round-robin (chunk j on rank j % pp)."""
    from lightning_autopar.specs import V_SCHEDULES

    if schedule in V_SCHEDULES and num_chunks == 2 * pp:
        return [j if j < pp else num_chunks - 1 - j for j in range(num_chunks)]
    return [j % pp for j in range(num_chunks)]


def check_schedule(schedule: str, pp: int, n_microbatches: int, recompute: str = "none",
                   compile: bool = False) -> None:
    """Raise one ConfigError when torch's schedule cannot run ``n_microbatches`` over ``pp`` ranks (the planner's
    ``microbatch_rule``), or with ``recompute`` or ``compile`` (``recompute_rule``, ``compile_rule``: the
    zero-bubble split backward). A V schedule's vpp == 2 is Plan.validate's rule."""
    from lightning_autopar.planner.space import compile_rule, microbatch_rule, recompute_rule

    if pp == 1:
        return
    reason = microbatch_rule(schedule, pp, n_microbatches)
    if reason:
        raise ConfigError("plan.grad_accum", reason, "choose grad_accum accordingly, or schedule=1f1b")
    reason = recompute_rule(schedule, recompute)
    if reason:
        raise ConfigError("plan.recompute", reason, "use recompute=none, or schedule=1f1b or interleaved")
    reason = compile_rule(schedule, pp, compile)
    if reason:
        raise ConfigError("plan.compile", reason, "use compile=false, or schedule=1f1b or interleaved")


def schedule_count(schedule: str, pp: int, micro_batches: int) -> int:
    """The fewest micro-batches, at least ``micro_batches``, that torch's ``schedule`` runs over ``pp`` ranks
    (``microbatch_rule``): a run of fewer is filled up with zero-weight stand-ins (``runtime.StagedPipeline``)."""
    from lightning_autopar.planner.space import microbatch_rule

    count = max(1, micro_batches)
    while microbatch_rule(schedule, pp, count):
        count += 1
    return count


def chunk_sizes(num_blocks: int, pp: int, vpp: int = 1, layers_per_stage: Sequence[int] | None = None) -> list[int]:
    """Blocks per chunk (``pp * vpp`` chunks): the planner's partition when it fits, else an even split."""
    chunks = pp * vpp
    if layers_per_stage and len(layers_per_stage) == chunks and sum(layers_per_stage) == num_blocks \
            and min(layers_per_stage) >= 1:
        return [int(n) for n in layers_per_stage]
    base, extra = divmod(num_blocks, chunks)
    return [base + (1 if j < extra else 0) for j in range(chunks)]


@dataclass(frozen=True)
class StageParts:
    """The split module's parts outside its blocks (names relative to the split), by the stage that owns them:
    ``before`` run before the first block (the first chunk's; another chunk's stand-in gives zeros of their
    outputs), ``after`` after the last block, in call order (the last chunk's; another chunk ends its forward at
    ``after[0]``), ``idle`` never called, their parameters unused (the first chunk's, never run elsewhere)."""

    before: tuple[str, ...]
    after: tuple[str, ...]
    idle: tuple[str, ...] = ()

    @property
    def all(self) -> tuple[str, ...]:
        return self.before + self.after + self.idle


def named_parts(analysis: ModelAnalysis) -> StageParts:
    """The parts the structure names, without a trace: the embeddings before the blocks, the final norm and the LM
    head after them."""
    return StageParts(tuple(p for p in (analysis.token_embedding, analysis.position_embedding) if p),
                      tuple(p for p in (analysis.final_norm, analysis.lm_head) if p))


def stage_parts(split: nn.Module, analysis: ModelAnalysis, trace: CallTrace | None, path: str = "") -> StageParts:
    """Which stage owns each module outside the blocks of ``split`` (at ``path`` under the trace's root), from
    what the model's call ran (``trace``: each module's first and last call, each parameter's uses): the outermost
    modules holding no block, called, enclosing every use of their parameters, are parts; a part running before
    the first block is the first stage's (a vision tower, a projector, the embeddings), one running after the last
    block the last stage's (the final norm, a pooler, the head). One ConfigError for a parameter no stage can own:
    used among the blocks, held by a module holding the blocks, or used outside its module's forward. Without a
    trace of the call (or a block it never ran), the parts the structure names (``named_parts``) and nothing
    else."""
    from lightning_autopar.parallel.units import _inside
    from lightning_autopar.profile.records import _join

    blocks = analysis.blocks_fqn

    def full(name: str) -> str:
        return _join(path, name)

    block_calls = [span for name, span in (trace.spans.items() if trace is not None else ())
                   if _inside(name, full(blocks)) and name != full(blocks)]
    if trace is None or not trace.traced or trace.partial or not block_calls:
        why = ("not traced" if trace is None else f"not traced ({trace.failure})" if not trace.traced or
               trace.partial else "traced without running the blocks")
        return _checked_named_parts(split, analysis, why)
    if trace.carried:  # what the other stages' zeros would change (profile/stage_flow.py)
        raise ConfigError("plan.pp", f"{trace.carried[0]}: a pipeline stage other than the first has zeros in its "
                          "place, so it cannot run there", "use pp=1")
    first_block, last_block = min(s[0] for s in block_calls), max(s[1] for s in block_calls)
    uses = trace.uses
    parts: dict[str, list[str]] = {"before": [], "after": [], "idle": []}

    def used(fqn: str) -> list[tuple[str, ...]]:
        module = split.get_submodule(fqn)
        return [stack for n, _ in module.named_parameters(remove_duplicate=False)
                for stack in uses.get(full(f"{fqn}.{n}" if fqn else n), [])]

    def refuse(name: str, why: str) -> ConfigError:
        return ConfigError("plan.pp", f"parameter '{name}' {why}, so no pipeline stage can own it",
                           "use pp=1, or move it into a block")

    def visit(fqn: str) -> None:
        module = split.get_submodule(fqn)
        direct = [_join(fqn, n) for n, _ in module.named_parameters(recurse=False)]
        if _inside(blocks, fqn):  # an ancestor of the blocks: its own parameters cannot leave it
            if direct:
                raise refuse(direct[0], f"is held by '{fqn or type(split).__name__}', which also holds the blocks")
            for child, _ in module.named_children():
                if _join(fqn, child) != blocks:
                    visit(_join(fqn, child))
            return
        if not any(True for _ in module.parameters()):
            return
        stacks = used(fqn)
        if full(fqn) not in trace.spans:
            if not stacks:  # never called, its parameters unused
                parts["idle"].append(fqn)
                return
        elif all(full(fqn) in stack for stack in stacks):
            first, last = trace.spans[full(fqn)]
            inside_blocks = any(_inside(m, full(blocks)) for stack in stacks for m in stack)
            if last < first_block and not inside_blocks:
                parts["before"].append(fqn)
                return
            if first > last_block and not inside_blocks:
                parts["after"].append(fqn)
                return
            name = next(_join(fqn, n) for n, _ in module.named_parameters())
            raise refuse(name, f"belongs to '{fqn}', which runs among the blocks (the model calls it between "
                               "the first block and the last, or from inside one)")
        if direct:
            raise refuse(direct[0], f"is used outside the forward of '{fqn}', its module")
        for child, _ in module.named_children():
            visit(_join(fqn, child))

    visit("")
    after = sorted(parts["after"], key=lambda f: trace.spans[full(f)][0])
    return StageParts(tuple(parts["before"]), tuple(after), tuple(parts["idle"]))


def _checked_named_parts(split: nn.Module, analysis: ModelAnalysis, why: str = "not traced") -> StageParts:
    """``named_parts``, with one ConfigError for a parameter outside them and the blocks (``why``: how the
    model's call went, which would have told the stage that runs it)."""
    need = "a stack of blocks (nn.ModuleList/Sequential), with embeddings, final norm and LM head outside it"
    parts = named_parts(analysis)
    prefixes = [analysis.blocks_fqn + "."] + [p + "." for p in parts.all]
    for name, _ in split.named_parameters():
        if not any(name.startswith(p) for p in prefixes):
            raise ConfigError("plan.pp", f"parameter '{name}' is outside the blocks, embeddings, final norm and LM "
                              f"head, and the model's call was {why}, which would tell the stage that runs it; "
                              f"pipeline parallelism needs {need}", "use pp=1, or move it into a block")
    return parts


def check_pipeline(analysis: ModelAnalysis, transformer: nn.Module, root: nn.Module, pp: int, vpp: int = 1,
                   trace: CallTrace | None = None, path: str = "") -> StageParts:
    """Raise one ConfigError when ``transformer`` (at ``path`` under ``root``) cannot be split into ``pp * vpp``
    pipeline chunks; else return who owns what outside its blocks (``stage_parts`` from ``trace``, the model's
    call)."""
    from lightning_autopar.parallel.units import tie_groups

    chunks = pp * vpp
    if len(analysis.blocks) < chunks:
        raise ConfigError("plan.pp", f"pp*vpp={chunks} exceeds the {len(analysis.blocks)} blocks of the model",
                          "use pp*vpp <= number of blocks")
    groups = tie_groups(root)
    ties = "; ".join(t.describe() for t in groups)
    if analysis.tied_embeddings or ties:
        # more than a pair (T5, BART: one embedding for the encoder, the decoder and the head): no config untie
        fix = "use pp=1" + (", or untie them (e.g. tie_word_embeddings=False)"
                            if all(len(t.names) <= 2 for t in groups) else "")
        raise ConfigError("plan.pp", f"tied parameters {ties or 'LM head = token embedding'} are one tensor, which "
                          "pipeline stages cannot share", fix)
    parts = stage_parts(transformer, analysis, trace, path)
    if not parts.after:
        raise ConfigError("plan.pp", f"{type(transformer).__name__}: nothing with parameters runs after the blocks "
                          "(a final norm, a head), so a stage cannot end there", "use pp=1")
    transformer_ids = {id(p) for p in transformer.parameters()}
    for name, p in root.named_parameters():
        if id(p) not in transformer_ids:
            raise ConfigError("plan.pp", f"parameter '{name}' of the LightningModule lives outside the transformer "
                              "(the module holding the blocks), so no pipeline stage can own it", "use pp=1")
    return parts


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
