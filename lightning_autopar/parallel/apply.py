"""Apply a plan to a model in the one canonical order:

    PP split -> TP/SP -> CP -> EP -> BatchNorm sync -> compile -> recompute -> FSDP/DP -> precision

1. PP split (``pipeline``): this rank keeps its chunks' blocks (original names) and the pieces it owns. A model in
   unit form is split by ``pipeline.traced`` (torch.export of the user's call, cut at unit boundaries).
2. TP (``tensor``): DTensor layouts on the remaining blocks (all experts still present, each split inside); with
   plan.sp, SP (``sequence``): the hidden states between the TP regions split along the sequence over the tp ranks.
2a. Vocabulary parallel (``vocab``): the token embedding sharded by vocabulary rows and the LM head by output
   columns over the tp group (under pp, each stage the part it holds), the token cross-entropy computed on the
   vocabulary shards; off (one line saying why) when tp does not divide the vocabulary, or when the model uses
   either weight outside its module.
2b. CP (``context``): the transformer's sequence inputs split over the cp ranks and its outputs gathered back,
   attention over the whole sequence (K/V all-gathered); after TP (heads local), checked live on a short sequence;
   with PP before the split (the hooks must reach the embeddings the stages swap in and out, and the whole model
   runs only then); FSDP then reduces over dp x cp (``MeshLayout.dp_mesh``).
3. EP (``experts``): remote experts removed, MoE forwards routed through all-to-all; with data parallelism alone
   (ep=1) the MoE forward is replaced too, so the balance loss covers the global micro-batch.
3b. BatchNorm (``batchnorm``): with data parallelism every BatchNorm layer computes its statistics over the dp
   group (count-weighted, running buffers as one device). After the split and the layouts (it needs the modules
   this rank keeps), before recompute (whose re-run forward must find the synchronised layer, which then skips
   the running-stat update) and before FSDP/DDP (which wrap the module whose class it swaps).
4. Recompute (``recompute``): composable checkpoint hooks per block (outside FSDP, as torchtitan does); for a
   model in unit form (any ``nn.Module``: CNNs, U-Nets; ``analysis.spec.unit_form``) per unit of the analysis,
   or per pipeline chunk when its stages are traced graphs (``pipeline.traced``: the unit modules no longer run).
4b. Compile (``compile``, plan.compile): each block's (unit's) forward compiled, hooks left eager; a block class
   that fails to compile runs eager with one warning (torchtitan: TP -> AC -> compile -> FSDP). Its first-call
   check hook is registered before recompute's hooks (the compiled forward does not depend on the order).
5. FSDP/DP (``fsdp``): experts on the expert-data-parallel mesh first, then blocks, then the modules owning
   the rest (or, with PP, each chunk) on the data-parallel mesh; zero=0 with data parallelism alone: DDP
   (``replicate``). The units are chosen (``units.choose_units``) before step 1, from one meta forward of the
   untouched model (on token ids, or on the user's own call of it, ``example``): modules whose forward runs,
   tied parameters owned by one unit; for a model in unit form the blocks are the analysis' units. With
   plan.offload=params every unit offloads its shard to the host (``offload``: FSDP2's CPUOffloadPolicy);
   offload=optimizer is applied to the optimizers the strategy builds (``offload.HostStep``).
6. Precision: FSDP's mixed-precision policy (set in step 5) plus Lightning's precision plugin (the strategy).

Then the guard (``units.check_applied``): every tie found before step 1 is still one tensor owned by one unit,
and no parameter is outside every data-parallel unit -- a plan that would train apart from one device stops
here with one line instead of diverging silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Sequence

import torch
from torch import nn

from lightning_autopar.dims import ParallelDims
from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.capabilities import Capabilities

if TYPE_CHECKING:
    from lightning_autopar.parallel.compile import CompiledBlocks
    from lightning_autopar.parallel.context import ContextParallel
    from lightning_autopar.parallel.experts import ExpertLayer
    from lightning_autopar.parallel.pipeline import Pipeline
    from lightning_autopar.parallel.vocab import VocabModules, VocabState
    from lightning_autopar.profile.analyze import ModelAnalysis
    from lightning_autopar.specs import Plan
    from lightning_autopar.topology.mesh import MeshLayout


@dataclass
class Applied:
    fsdp_roots: list[nn.Module]
    pipeline: Pipeline | None = None
    pipeline_root: nn.Module | None = None  # the module the pipeline splits and runs (parallel.pipeline)
    experts: list[ExpertLayer] = field(default_factory=list)
    expert_meshes: dict[str, Any] = field(default_factory=dict)
    context: ContextParallel | None = None  # the cp hooks (cp > 1; parallel.context)
    vocab: VocabState | None = None  # the vocabulary shards (tp > 1 where vocab parallel runs; parallel.vocab)
    compiled: CompiledBlocks | None = None  # plan.compile: the blocks compiled and their checks (parallel.compile)

    def expert_params(self) -> set[int]:
        """Expert parameters that differ between the ranks of an EP group (norms combined over it). Not those
        of the fused layout: DTensors sharded over "ep", whose norm already covers the group."""
        return {id(p) for layer in self.experts if not layer.fused for e in layer.experts for p in e.parameters()}


def check_unit_pipeline(root: nn.Module, model: nn.Module, analysis: ModelAnalysis, example: tuple[tuple, dict] | None,
                        pp: int, vpp: int = 1, layers_per_stage: Sequence[int] | None = None) -> None:
    """Raise one ConfigError ("plan.pp") when a model in unit form cannot run as ``pp`` pipeline stages: stages
    come from torch.export of the user's call split at unit boundaries (``parallel.pipeline.trace``), which needs
    that call (``example``), every parameter of ``root`` inside ``model``, and no BatchNorm -- a pipeline runs
    micro-batches, and a BatchNorm in a stage would normalise each apart (and not over the data-parallel ranks:
    the traced stages run the graph's batch-norm ops, not the synchronised modules)."""
    from lightning_autopar.parallel.pipeline import check_traced_pipeline

    _check_unit_pipeline_inputs(root, model, analysis, example)
    check_traced_pipeline(model, example, [b.fqn for b in analysis.blocks], pp, vpp, layers_per_stage)


def _check_unit_pipeline_inputs(root: nn.Module, model: nn.Module, analysis: ModelAnalysis,
                                example: tuple[tuple, dict] | None) -> None:
    """What refuses every pipeline of a model in unit form before its trace (``check_unit_pipeline``)."""
    from lightning_autopar.parallel.batchnorm import batchnorm_modules

    name = analysis.spec.name
    if example is None:
        raise ConfigError("plan.pp", f"{name}: no call of the model was captured to trace its stages", "use pp=1")
    norms = batchnorm_modules(model)
    if norms:
        raise ConfigError("plan.pp", f"{name}: BatchNorm ('{norms[0][0]}') in a pipeline stage would normalise each "
                          "micro-batch apart, not the batch one device sees", "use pp=1 (or GroupNorm/LayerNorm)")
    inside = {id(p) for p in model.parameters()}
    outside = next((n for n, p in root.named_parameters() if id(p) not in inside), None)
    if outside is not None:
        raise ConfigError("plan.pp", f"{type(root).__name__}.{outside} is outside the model its step calls "
                          f"({name}), so no pipeline stage would own it", "use pp=1, or move it into the model")


def unit_pipeline_limits(root: nn.Module, model: nn.Module, analysis: ModelAnalysis,
                         example: tuple[tuple, dict] | None, world_size: int, caps: Capabilities,
                         only: Collection[int] | None = None) -> None:
    """The pp degrees the runtime can apply to a model in unit form, recorded in ``caps`` (``check_plan`` reads
    each degree's outcome): one trace cut before every unit tells which cuts refuse (``SplitRefusals``: a tie or
    a non-tensor value across it), so every degree of this world is checked at the partition the runtime would
    cut, with the runtime's line; where some cut refuses, the planner keeps to even partitions (the ones
    checked) instead of partitioning by unit time. ``only``: the degrees a plan can still take (the user's fix);
    a world, or a fix, that leaves no pp > 1 pays nothing (the trace is a torch.export of the model: ~0.5 s for
    a small CNN)."""
    from lightning_autopar.parallel.pipeline import UnitOrderError, chunk_sizes, split_refusals

    degrees = [d for d in range(2, world_size + 1) if world_size % d == 0 and d <= len(analysis.blocks)
               and (only is None or d in only)]
    if not degrees:
        return
    units = [b.fqn for b in analysis.blocks]
    try:
        _check_unit_pipeline_inputs(root, model, analysis, example)
        refusals = split_refusals(model, example, units)
    except UnitOrderError as err:  # a unit called twice: no cut before every unit; the smallest degree, as traced
        try:
            caps.checked("unit pp", (degrees[0], 1), lambda: check_unit_pipeline(root, model, analysis, example,
                                                                                 degrees[0]))
            caps.exclude("pp", [1, degrees[0]], str(err))
            caps.exclude("uneven", [False], str(err))
        except ConfigError as refused:
            caps.exclude("pp", [1], str(refused))
        return
    except ConfigError as err:
        caps.exclude("pp", [1], str(err))
        return
    allowed, reasons = [1], []
    for pp in degrees:
        refused = refusals.of_sizes(chunk_sizes(len(units), pp))
        caps.record("unit pp", (pp, 1), refused)
        if refused is None:
            allowed.append(pp)
        else:
            reasons.append(f"pp={pp}: {refused}")
    if reasons:
        caps.exclude("pp", allowed, "; ".join(reasons))
    if refusals.ties or refusals.crossings:
        caps.exclude("uneven", [False], f"{analysis.spec.name}: a pipeline cuts only where the trace allows "
                     "(even partitions, each checked)")


def present_blocks(analysis: ModelAnalysis, transformer: nn.Module) -> ModelAnalysis:
    """The analysis restricted to the blocks still present in ``transformer`` (after the PP split)."""
    if analysis.spec.unit_form:
        return analysis  # no pipeline split: every unit is here
    blocks = transformer.get_submodule(analysis.blocks_fqn)
    keys = set(blocks._modules)
    prefix = analysis.blocks_fqn + "."
    kept = [b for b in analysis.blocks if b.fqn[len(prefix):].split(".")[0] in keys]
    return dataclasses.replace(analysis, blocks=kept)


def has_moe(analysis: ModelAnalysis) -> bool:
    return any(b.moe is not None for b in analysis.blocks)


def plain_ddp(plan: Plan, analysis: ModelAnalysis) -> bool:
    """zero=0 data parallelism alone on a dense model: DDP (``parallel.fsdp.apply_replicate``) instead of FSDP2
    (``dims.runs_plain_ddp``, the rule the planner prices)."""
    return ParallelDims.from_plan(plan).plain_ddp(has_moe(analysis))


def pipeline_split(root: nn.Module, transformer: nn.Module, analysis: ModelAnalysis) -> tuple[nn.Module, ModelAnalysis]:
    """(module to split, its analysis): the transformer, or the wrapper holding it and the LM head."""
    from lightning_autopar.parallel.pipeline import pipeline_root
    from lightning_autopar.profile.analyze import analyze

    split = pipeline_root(root, transformer)
    # the split needs structure only (stages, embeddings, head); TP uses the transformer's traced analysis
    return split, (analysis if split is transformer else analyze(split, trace=False))


def applied_schedule(plan: Plan) -> str:
    """The schedule torch runs for ``plan``: 1F1B with fewer micro-batches than stages is GPipe's order (torch
    rejects it as 1F1B)."""
    if plan.schedule == "1f1b" and plan.grad_accum < plan.pp:
        return "gpipe"
    return plan.schedule


def check_batch_length(plan: Plan, capabilities: Capabilities, seq: int | None) -> None:
    """A batch's sequence length that SP (tp) or CP (2*cp) cannot split and cannot pad exactly: one ConfigError,
    raised before the step's first collective and the same on every rank (all hold the same global batch), so a
    later batch of another length stops every rank with one line (sequence.check_length, context.check_length).
    ``capabilities``: the record ``check_plan`` checked the plan against."""
    from lightning_autopar.parallel import context, sequence

    if not seq:
        return
    if plan.sp:
        sequence.check_length(capabilities.name, seq, plan.tp, capabilities.unpaddable_at(plan.tp))
    if plan.cp > 1:
        context.check_length(capabilities.name, seq, plan.cp, bool(capabilities.causal))


# why a loop that calls backward itself (manual optimization; Fabric and Accelerate loops) gets neither
LOOP_BACKWARD_ACCUM = ("the user's loop runs backward once per batch (manual optimization; Fabric / Accelerate: "
                       "step_call=True and model.train_step(batch, loss_fn) run micro-batches)")
LOOP_BACKWARD_PP = ("pipeline parallelism runs backward itself and the user's loop calls backward (manual "
                    "optimization; Fabric / Accelerate: step_call=True and model.train_step(batch, loss_fn))")


def model_capabilities(root: nn.Module, transformer: nn.Module | None, analysis: ModelAnalysis,
                       automatic_optimization: bool = True, model_call: Callable[[], Any] | None = None
                       ) -> Capabilities:
    """The capabilities of a transformer (``root`` the LightningModule holding it): what each parallelism's check
    refuses for this model's structure, each with its reason. tp=2 and cp=2 are the smallest splits: what refuses
    them refuses every degree > 1; pp is checked at 2 on the pipeline split. ``automatic_optimization`` False: the
    user's loop runs backward (one micro-batch per step, no pipeline). ``model_call``: the user's call of its
    model (``profile.units.ModelCall``), traced where the trace on token ids leaves parts of the model idle (a
    VLM's vision tower), so the pipeline knows which stage runs them."""
    from lightning_autopar.parallel.context import check_cp
    from lightning_autopar.parallel.sequence import check_sp
    from lightning_autopar.parallel.tensor import check_tp
    from lightning_autopar.parallel.tp_experts import check_fused_experts_tp

    caps = Capabilities.of(analysis)
    if transformer is not None:
        caps.unreached = _unreached(root, call_trace(root, transformer, analysis, caps))
        caps.unused = list(dict.fromkeys([*caps.unused, *caps.unreached]))
    try:
        check_tp(analysis, 2, structure_only=True)
        if transformer is not None:  # the fused experts' layout, checked on the modules as the apply does
            check_fused_experts_tp(transformer, analysis.blocks, 2)
    except ConfigError as err:
        caps.exclude("tp", [1], str(err))
    if caps.allowed.get("tp") != [1]:
        try:
            check_sp(analysis, transformer, 2, runner=root, capabilities=caps)
        except ConfigError as err:
            caps.exclude("sp", [False], str(err))
        if transformer is not None:  # without the model (a structure-only check) the vocabulary stays unchecked
            vocab_modules(root, transformer, analysis, caps)
    try:
        check_cp(analysis, transformer, 2, capabilities=caps)
    except ConfigError as err:
        caps.exclude("cp", [1], str(err))
    if not automatic_optimization:
        caps.exclude("grad_accum", [1], LOOP_BACKWARD_ACCUM)
    for name, (values, reason) in _pipeline_expert_limits(root, analysis, automatic_optimization, caps,
                                                          model_call).items():
        caps.exclude(name, values, reason)
    return caps


def _unreached(root: nn.Module, trace: Any) -> list[str]:
    """The trainable parameters of ``root`` that the call trace on token ids never reached (a VLM's projector and
    trainable tower: a batch without images skips them, and whether a rank's batch has any is the data's, so DDP
    looks for unused parameters and FSDP checks, ``unreached.ReachCheck``)."""
    if not trace.traced or trace.partial:
        return []
    return [n for n, p in root.named_parameters() if p.requires_grad and n not in trace.uses]


def _pipeline_expert_limits(root: nn.Module, analysis: ModelAnalysis, automatic_optimization: bool,
                            caps: Capabilities, model_call: Callable[[], Any] | None = None
                            ) -> dict[str, tuple[list[Any], str]]:
    """pp and ep values the runtime can apply to this model: pp needs a splittable stack of blocks and automatic
    optimization; ep needs MoE layers with a route() method, the fused layout of HF Mixtral or the plain layout
    (parallel.experts). Field -> (allowed values, why the others are not). Sets ``caps.moe``."""
    from lightning_autopar.parallel.experts import check_ep, moe_modules, supports_ep
    from lightning_autopar.profile.analyze import find_transformer

    _, transformer = find_transformer(root)
    out: dict[str, tuple[list[Any], str]] = {}
    pipeline_refusal = ""
    try:
        check_pipeline_once(root, transformer, analysis, 2, 1, caps, model_call)
        splittable = True
    except ConfigError as err:
        splittable, pipeline_refusal = False, str(err)
    if not splittable:
        out["pp"] = ([1], pipeline_refusal)
    elif not automatic_optimization:
        out["pp"] = ([1], LOOP_BACKWARD_PP)
    if not has_moe(analysis):
        out["ep"] = ([1], "no MoE layers found")
    elif not all(supports_ep(m, info) for _, m, info in moe_modules(transformer, analysis)):
        caps.moe = "unsupported"
        try:  # the layer's own reason (one line), as a pinned ep gets it
            check_ep(analysis, transformer, 2 if has_moe(analysis) else 1)
            why = "MoE layout not supported by expert parallelism (parallel/experts.py)"
        except ConfigError as err:
            why = str(err)
        out["ep"] = ([1], why)
    else:
        caps.moe = "ep"
    return out


def check_pipeline_once(root: nn.Module, transformer: nn.Module, analysis: ModelAnalysis, pp: int, vpp: int,
                        caps: Capabilities, model_call: Callable[[], Any] | None = None) -> None:
    """``pipeline.check_pipeline`` of the pipeline split at (``pp``, ``vpp``), once per degree; the split, its
    analysis and the trace telling which stage owns the parts outside the blocks once per model (the parts kept
    as the memo "pipeline parts", for the split)."""
    from lightning_autopar.parallel.pipeline import check_pipeline

    def run() -> None:
        split, split_analysis = caps.memo("pipeline split", lambda: pipeline_split(root, transformer, analysis))
        path = next(n for n, m in root.named_modules() if m is split)
        trace = pipeline_trace(root, transformer, analysis, caps, split, path, model_call)
        parts = check_pipeline(split_analysis, split, root, pp, vpp, trace, path)
        caps.memo("pipeline parts", lambda: parts)

    caps.checked("pp", (pp, vpp), run)


def pipeline_trace(root: nn.Module, transformer: nn.Module, analysis: ModelAnalysis, caps: Capabilities,
                   split: nn.Module, path: str, model_call: Callable[[], Any] | None) -> Any:
    """The trace that tells the pipeline which stage runs each part outside the blocks: the call trace on token
    ids, or, where it fails (a ViT: pixels) or leaves a parameter-holding module outside the blocks uncalled that
    the user's call may run (a VLM's vision tower and projector: token ids alone never reach them), the trace of
    the user's call (``model_call``, run up to the model's forward once). ``path``: the split's name under
    ``root``. Once per model."""
    from lightning_autopar.parallel.units import trace_model_call

    def choose() -> Any:
        trace = call_trace(root, transformer, analysis, caps)
        modules = [n for n, m in split.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
        outside = [f"{path}.{n}" if path else n for n in modules if not n.startswith(analysis.blocks_fqn + ".")]
        if model_call is None or (trace.traced and all(n in trace.called for n in outside)):
            return trace
        try:
            call = model_call()
        except Exception:  # noqa: BLE001 -- no batch to run the step on: the trace on token ids
            return trace
        transformer_path = next(n for n, m in root.named_modules() if m is transformer)
        block_fqns = [f"{transformer_path}.{b.fqn}" if transformer_path else b.fqn for b in analysis.blocks]
        return trace_model_call(root, call, block_fqns, analysis.spec.seq_len)

    return caps.memo("pipeline trace", choose)


def call_trace(root: nn.Module, transformer: nn.Module, analysis: ModelAnalysis, caps: Capabilities,
               example: tuple[tuple, dict] | None = None) -> Any:
    """The meta trace of the model's call (``units.trace_calls``), once per model and call: the vocabulary check
    and the choice of units both read it. It holds module and parameter names only, so a copy of the model
    (``Capabilities.for_copy``) reads the same one."""
    from lightning_autopar.parallel.units import trace_calls

    return caps.memo("call trace" if example is None else "call trace of the example", lambda: trace_calls(
        root, transformer, analysis.spec.seq_len, [b.fqn for b in analysis.blocks], example))


def vocab_modules(root: nn.Module, transformer: nn.Module, analysis: ModelAnalysis,
                  caps: Capabilities) -> VocabModules | None:
    """The embedding and LM head vocabulary parallelism would shard (None where it cannot: ``caps.vocab`` says
    why), found once per model from the untouched model: the head may sit in the pipeline split's wrapper (an HF
    ``*ForCausalLM``), and the trace of the model's call tells whether their weights are used outside their
    modules."""
    from lightning_autopar.parallel.vocab import find_modules, module_refusal

    def find() -> tuple[VocabModules | None, str]:
        split, split_analysis = (None, None) if analysis.lm_head else caps.memo(
            "pipeline split", lambda: pipeline_split(root, transformer, analysis))
        where = find_modules(root, transformer, analysis, split_analysis, split)
        if isinstance(where, str):
            return None, where
        trace = call_trace(root, transformer, analysis, caps)
        return where, module_refusal(root, where, trace.uses if trace.traced else None)

    where, caps.vocab = caps.memo("vocab", find)
    return where


def _apply_vocab(root: nn.Module, where: VocabModules | None, rows: int, plan: Plan, layout: MeshLayout,
                 caps: Capabilities) -> VocabState | None:
    """Step 2a: the vocabulary shards (``rows``: the embedding's, read before a pipeline split), or one line
    (rank 0) saying why the embedding and head stay whole."""
    from lightning_autopar.parallel.vocab import apply_vocab_parallel, refusal

    why = refusal(plan, rows, caps.vocab if where is not None else caps.vocab or "not found")
    if why:
        if torch.distributed.get_rank() == 0:
            print(f"autopar: vocabulary parallel off ({why}): the embedding and the LM head stay whole on every "
                  "tp rank", flush=True)
        return None
    me = torch.distributed.get_rank()
    first = all(min(layout.ranks(name)) == me for name in ("dp_flat", "cp"))  # (the head's stage prints the line)
    return apply_vocab_parallel(root, where, layout["tp"], rows, gather_logits=plan.cp > 1, first_replica=first)


def check_plan(plan: Plan, analysis: ModelAnalysis, root: nn.Module, transformer: nn.Module,
               example: tuple[tuple, dict] | None = None, capabilities: Capabilities | None = None) -> Capabilities:
    """Raise one ConfigError for what the runtime cannot apply to this model. ``capabilities``: the model's record
    (``capabilities.model_capabilities``; a new one when None), whose checks already run at the plan's degrees
    are not run again; the facts the apply reads are recorded in it. Returns it."""
    from lightning_autopar.parallel.context import check_cp
    from lightning_autopar.parallel.experts import check_ep
    from lightning_autopar.parallel.tensor import check_tp
    from lightning_autopar.planner.space import check_unit_fix

    caps = capabilities if capabilities is not None else Capabilities.of(analysis)
    if analysis.spec.unit_form:
        check_unit_fix(analysis.spec, {"tp": plan.tp, "cp": plan.cp, "ep": plan.ep})
        if plan.pp > 1:
            caps.checked("unit pp", (plan.pp, plan.vpp), lambda: check_unit_pipeline(
                root, transformer, analysis, example, plan.pp, plan.vpp))
        return caps
    check_tp(analysis, plan.tp)
    if plan.sp:
        from lightning_autopar.parallel.sequence import check_sp

        check_sp(analysis, transformer, plan.tp, runner=root, capabilities=caps)
    if plan.pp > 1:
        from lightning_autopar.parallel.pipeline import check_schedule

        check_schedule(applied_schedule(plan), plan.pp, plan.grad_accum, plan.recompute, plan.compile)
        check_pipeline_once(root, transformer, analysis, plan.pp, plan.vpp, caps)
    check_ep(analysis, transformer, plan.ep)
    check_cp(analysis, transformer, plan.cp, plan.compile, capabilities=caps)
    if plan.cp > 1 and plan.cp_kind == "heads":
        from lightning_autopar.parallel.context_heads import check_heads

        check_heads(analysis.spec.name, analysis.spec.heads, analysis.spec.kv_heads, plan.tp, plan.cp)
    return caps


def _check_reach(root: nn.Module, caps: Capabilities, model: nn.Module, layout: MeshLayout,
                 device: torch.device) -> None:
    """FSDP over a model with modules the trace on token ids never reached: after each call of ``model`` the
    data-parallel ranks agree on which of them ran, or all raise one line (``unreached.ReachCheck``)."""
    from lightning_autopar.parallel.unreached import ReachCheck, unreached_modules

    ReachCheck(root, unreached_modules(root, caps.unreached), model, layout["dp_flat"].get_group(), device)


def cp_flavour(plan: Plan) -> Callable[..., Any] | None:
    """The cp attention ``plan.cp_kind`` asks for (``context.apply_context_parallel``'s ``attention``): None for
    the K/V all-gather, ``context_heads.heads_attention`` for the all-to-all over heads."""
    if plan.cp_kind != "heads":
        return None
    from lightning_autopar.parallel.context_heads import heads_attention

    return heads_attention


def apply_plan(root: nn.Module, transformer: nn.Module, analysis: ModelAnalysis, plan: Plan, layout: MeshLayout,
               dp_mesh: Any, device: torch.device, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
               layers_per_stage: Sequence[int] | None = None, capacity_factor: float | None = None,
               example: tuple[tuple, dict] | None = None, capabilities: Capabilities | None = None) -> Applied:
    """Apply ``plan`` to ``transformer`` (inside ``root``, the LightningModule; for a model in unit form, the
    model the training step calls, ``example`` being that call) in place; see the module doc. ``capabilities``:
    the model's record from the set-up (``check_plan`` then runs no check twice), else one made here."""
    from lightning_autopar.parallel.batchnorm import batchnorm_modules, sync_batchnorm
    from lightning_autopar.parallel.context import apply_context_parallel, self_check
    from lightning_autopar.parallel.compile import check_compile, compile_blocks, enable_async_tp
    from lightning_autopar.parallel.experts import apply_expert_parallel, experts_always_used
    from lightning_autopar.parallel.fsdp import (apply_data_parallel, apply_data_parallel_chunks, apply_replicate,
                                                 shard_experts)
    from lightning_autopar.parallel.offload import check_offload, fsdp_offload_policy, parameters_to_host
    from lightning_autopar.parallel.pipeline import Pipeline, TracedPipeline
    from lightning_autopar.parallel.recompute import apply_recompute
    from lightning_autopar.parallel.tensor import apply_tensor_parallel
    from lightning_autopar.parallel.units import check_applied, choose_units

    caps = check_plan(plan, analysis, root, transformer, example, capabilities)
    check_compile(plan.compile, plan.pp, device.type, schedule=applied_schedule(plan))
    check_offload(plan.offload, plan.precision, device.type)
    ties = caps.ties(root)
    where = vocab_modules(root, transformer, analysis, caps) if plan.tp > 1 else None
    rows = root.get_submodule(where.embedding).weight.shape[0] if where is not None else 0  # before the split
    units = None
    if plan.pp == 1:  # chosen on the untouched model: TP and EP below change its parameters
        units = choose_units(root, transformer, [b.fqn for b in analysis.blocks], analysis.spec.seq_len,
                             wrap_blocks=not plain_ddp(plan, analysis), example=example,
                             trace=call_trace(root, transformer, analysis, caps, example))
    pipeline = split = None
    context = None
    if plan.cp > 1 and plan.pp > 1:  # 2b. CP, before the split: hooks on every piece, the whole model checked
        context = apply_context_parallel(transformer, [transformer.get_submodule(b.fqn) for b in analysis.blocks],
                                         layout["cp"].get_group(), analysis.spec.name, root,
                                         causal=bool(caps.causal), attention=cp_flavour(plan))
        self_check(transformer, context, analysis.spec.vocab, analysis.spec.seq_len)
    if plan.pp > 1:  # 1. PP split
        if loss_fn is None:
            raise ValueError("pipeline parallelism needs the loss function run on the last stage")
        schedule = applied_schedule(plan)
        if analysis.spec.unit_form:  # stages traced from the user's call, split at unit boundaries
            split = transformer
            pipeline = TracedPipeline(split, example, [b.fqn for b in analysis.blocks], layout["pp"], schedule,
                                      plan.grad_accum, device, loss_fn, vpp=plan.vpp,
                                      layers_per_stage=layers_per_stage)
        else:
            split, split_analysis = pipeline_split(root, transformer, analysis)
            pipeline = Pipeline(split, split_analysis, layout["pp"], schedule, plan.vpp, plan.grad_accum, device,
                                loss_fn, layers_per_stage,
                                parts=caps.memo("pipeline parts", lambda: None))  # check_plan's pipeline check's
    local = present_blocks(analysis, transformer)
    apply_tensor_parallel(transformer, local, layout["tp"], sp=plan.sp)  # 2. TP
    if plan.sp:  # 2. SP (parallel.sequence): hooks on the blocks this rank keeps, cut between pipeline chunks
        from lightning_autopar.parallel.sequence import apply_sequence_parallel

        chunks = ([(list(c.blocks), c.is_first, c.is_last) for c in pipeline.chunks]
                  if isinstance(pipeline, Pipeline) else None)
        apply_sequence_parallel(transformer, local, layout["tp"], chunks, unpaddable=caps.unpaddable_at(plan.tp))
    vocab = _apply_vocab(root, where, rows, plan, layout, caps) if plan.tp > 1 else None  # 2a. vocabulary parallel
    if plan.cp > 1 and plan.pp == 1:  # 2b. CP
        context = apply_context_parallel(transformer, [transformer.get_submodule(b.fqn) for b in local.blocks],
                                         layout["cp"].get_group(), analysis.spec.name, root,
                                         causal=bool(caps.causal), attention=cp_flavour(plan))
        self_check(transformer, context, analysis.spec.vocab, analysis.spec.seq_len)
    if plan.cp > 1:
        dp_mesh = layout.dp_mesh(plan)
    divide = plan.dp if plan.cp > 1 else None
    experts, meshes = [], {}
    if has_moe(local) and (plan.ep > 1 or plan.dp > 1):  # 3. EP
        meshes = layout.expert_meshes(plan) if plan.ep > 1 else {}
        experts = apply_expert_parallel(transformer, local, meshes["ep"].get_group() if meshes else None,
                                        layout["dp_flat"].get_group() if plan.dp > 1 else None, capacity_factor,
                                        ep_mesh=meshes.get("ep"))
    if plan.dp > 1 and batchnorm_modules(root):  # BatchNorm statistics over the dp group (module doc, step 3)
        sync_batchnorm(root, layout["dp_flat"].get_group())
    traced = isinstance(pipeline, TracedPipeline)  # its stages run traced graphs, not the user's unit modules
    blocks = {b.fqn: transformer.get_submodule(b.fqn) for b in local.blocks}  # 4. recompute
    attention_of = {blocks[b.fqn]: blocks[b.fqn].get_submodule(b.attention.fqn) if b.attention else blocks[b.fqn]
                    for b in local.blocks if b.moe is not None}
    # 4b. compile before recompute's hooks: its first-call check sees the block's inputs after the earlier hooks
    # (SP's scatter) and before the checkpoint's saved-tensor context; the compiled forward is unaffected by order
    compiled = compile_blocks(blocks) if plan.compile else None
    apply_recompute(pipeline.recompute_modules if traced else blocks.values(), plan.recompute, attention_of,
                    every=plan.recompute_every)
    if plan.compile and plan.tp > 1 and plan.sp and device.type == "cuda":  # async TP (GPU only; priced so)
        enable_async_tp(layout["tp"])
    offload = fsdp_offload_policy(plan.offload, device)
    if plan.offload == "params" and device.type != "cpu":
        parameters_to_host(root)  # FSDP2 offloads shards it finds on the CPU
    if plan.ep == 1 and pipeline is None:  # (expert parallelism calls every local expert each step itself)
        experts_always_used(transformer, local)  # 5. FSDP / DP reduce what every rank has a gradient for
    if meshes:  # 5. FSDP / DP
        shard_experts([e for layer in experts for e in layer.experts], meshes["edp"], plan.zero, plan.dp,
                      plan.precision, offload)
    if pipeline is not None:
        roots = apply_data_parallel_chunks(pipeline.chunks, dp_mesh, plan.zero, plan.precision, divide, offload)
        if traced:
            pipeline.rebind_parameters()  # the sharded parameters back under the user's names
    elif plain_ddp(plan, local):
        roots = apply_replicate(root, units, layout["dp_flat"].get_group(), find_unused=bool(caps.unused))
    else:
        if caps.unreached and plan.dp > 1:  # FSDP reduces what has a gradient: the ranks must agree on what ran
            _check_reach(root, caps, root.get_submodule(call_trace(root, transformer, analysis, caps).entry), layout,
                         device)
        roots = apply_data_parallel(root, units, dp_mesh, plan.zero, plan.precision, divide, offload)
    check_applied(root, ties, every_param=pipeline is None)
    return Applied(fsdp_roots=roots, pipeline=pipeline, pipeline_root=split, experts=experts, expert_meshes=meshes,
                   compiled=compiled, context=context, vocab=vocab)
