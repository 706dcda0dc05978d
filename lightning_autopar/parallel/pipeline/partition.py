"""Where the block-stack pipeline cuts: what is split, whether it can be, and how many blocks each chunk gets.

The blocks are cut into ``pp * vpp`` contiguous chunks (the planner's ``layers_per_stage``, else an even split);
chunk ``j`` lives on pipeline rank ``j % pp`` (GPipe and 1F1B: one chunk per rank; interleaved 1F1B and
interleaved zero bubble: ``vpp`` chunks per rank), or in a V for ZBV and DualPipeV (``stage_owners``: rank ``r``
holds chunks ``r`` and ``2*pp-1-r``, so the first and the last chunk share rank 0). The token and position
embeddings go with the first chunk, the final norm and the LM head with the last.

What is split (``pipeline_root``): the innermost module holding every parameter of the LightningModule -- the
transformer itself, or a wrapper adding the head to it (Hugging Face ``LlamaForCausalLM`` around ``LlamaModel``,
whose own loss with ``labels=`` then runs on the last stage).

Requirements (``check_pipeline``, one ``ConfigError`` otherwise): a stack of at least ``pp * vpp`` blocks; every
parameter outside the blocks belongs to the token embedding, the position embedding, the final norm or the LM
head; a final norm or an LM head to stop at; untied embeddings; the user's step calls that module once per
micro-batch. Our GPT (dense and MoE), Llama / Mixtral-style models and litgpt's GPT qualify (tested:
``models.gpt.GPT``, Hugging Face ``LlamaForCausalLM`` and ``MixtralForCausalLM``, ``litgpt.model.GPT``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

from lightning_autopar.errors import ConfigError

if TYPE_CHECKING:
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
    groups = tie_groups(root)
    ties = "; ".join(t.describe() for t in groups)
    if analysis.tied_embeddings or ties:
        # more than a pair (T5, BART: one embedding for the encoder, the decoder and the head): no config untie
        fix = "use pp=1" + (", or untie them (e.g. tie_word_embeddings=False)"
                            if all(len(t.names) <= 2 for t in groups) else "")
        raise ConfigError("plan.pp", f"tied parameters {ties or 'LM head = token embedding'} are one tensor, which "
                          "pipeline stages cannot share", fix)
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
