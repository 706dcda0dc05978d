"""The model forms the planner prices, two implementations of one interface (``ModelForm``) chosen once from the
ModelSpec by ``form_of``:

- ``TransformerForm``: a decoder-only transformer by its fields (blocks, embedding, head; a sample is a sequence of
  ``seq_len`` tokens);
- ``UnitForm``: any model as a sequence of units (``ModelSpec.units``: CNNs, U-Nets; a sample is one batch row).

The form answers every question whose answer differs between the two: the sequence length it prices, the fixed
values it refuses and the space it allows (space.py), the pipeline partition's layer weights (partition.py), the
per-rank term tables with the measured block times applied (terms.py), the FSDP units of a stage (the runtime's
fixed costs), the model FLOPs, the measured kinds calibration fits (calibrate.py), and the report's wording
(report.py, search.py, cli_plan.py). The rest of the planner calls the form instead of branching on the model.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lightning_autopar.errors import ConfigError
from lightning_autopar.planner.cost import (
    dense_block_time, embedding_time, head_time, model_flops_per_token, moe_block_time)
from lightning_autopar.planner.cost_units import UnitArrays, unit_model_flops_per_sample, unit_time
from lightning_autopar.planner.hardware import ACT_BYTES, Hardware
from lightning_autopar.planner.partition import block_weights, unit_weights
from lightning_autopar.planner.space_table import Space
from lightning_autopar.planner.terms import transformer_terms, unit_terms
from lightning_autopar.specs import (
    INTERLEAVED_SCHEDULES, PRECISIONS, RECOMPUTE_MODES, SCHEDULES, V_SCHEDULES, BlockSample, Measured, ModelSpec, Plan)

UNIT_FORM_EXCLUDED = INTERLEAVED_SCHEDULES + V_SCHEDULES  # several stages per rank: not for the traced pipeline
SHARED_KINDS = ("model", "optimizer")  # measured kinds every form knows (calibrate.py)


class ModelForm(ABC):
    """What the planner needs to know of a model's form. Stateless: one instance per form (``form_of``)."""

    name: str  # "transformer" | "unit"
    rate: str  # the throughput's unit in reports: "tokens/s" | "samples/s"
    batch_hint: str  # what shrinks the work per step, for the relax hints of an infeasible search

    @abstractmethod
    def seq(self, model: ModelSpec, seq_len: int | None) -> int:
        """The sequence length priced: the given one or the spec's (a transformer), 1 (a unit-form sample is a row)."""

    def check_seq_len(self, name: str, seq_len: int | None) -> None:
        """Refuse a sequence length the form has no use for (``autopar plan --seq-len``; ``name``: the model as
        given)."""

    @abstractmethod
    def check_fix(self, model: ModelSpec, fix: Mapping[str, Any]) -> None:
        """Refuse, in one line (ConfigError), fixed values this form can never run (before space.check_fix's
        common rules)."""

    @abstractmethod
    def restrict(self, model: ModelSpec, fix: Mapping[str, Any],
                 restrict: Mapping[str, Sequence]) -> tuple[dict[str, Sequence], dict[str, str]]:
        """The form's space inside ``restrict``, and per narrowed field the reason (PlanReport.excluded)."""

    @abstractmethod
    def layer_weights(self, model: ModelSpec, hw: Hardware, seq: int, prec: int,
                      fused: bool) -> tuple[np.ndarray, float, float]:
        """The pipeline partition's weights: per layer (block or unit) fwd+bwd time, the embedding's, the head's."""

    @abstractmethod
    def terms(self, model: ModelSpec, hw: Hardware, space: Space, seq: int, measured: Measured | None, fused: bool,
              opts: np.ndarray) -> tuple[dict[str, list], dict[str, list]]:
        """Per representative pipeline rank, the mid-level and dpc-level term tables (terms.py), measured block
        times applied (scaled by the analytic ratio)."""

    @abstractmethod
    def stage_units(self, model: ModelSpec, pp: np.ndarray) -> tuple[Any, Any, Any, bool]:
        """The first pipeline stage's (blocks, MoE blocks, FSDP units) per pp, and whether the model has MoE layers:
        what the runtime's fixed costs count (terms.runtime_terms)."""

    @abstractmethod
    def model_flops(self, model: ModelSpec, global_batch: int, seq: int) -> float:
        """The model FLOPs of one step of ``global_batch`` samples (MFU's numerator)."""

    @abstractmethod
    def sample_times(self, hw: Hardware, model: ModelSpec, sample: BlockSample) -> tuple[float, float]:
        """The cost model's (fwd, bwd) seconds of one measured kind (not "optimizer") at the sample's shape, tp = cp
        = 1 (calibrate.py)."""

    @abstractmethod
    def knows_kind(self, model: ModelSpec, kind: str) -> bool:
        """Whether a measured kind (besides SHARED_KINDS) is one of this model's."""

    @abstractmethod
    def shape(self, model: ModelSpec, seq_len: int) -> str:
        """The work per sample in a report's title: "seq 4096" or "152 units"."""

    def relax_hints(self, model: ModelSpec, smallest: Plan) -> list[str]:
        """Form-specific things to relax when no plan fits (search.relax_hints), before the common ones."""
        return []

    @abstractmethod
    def describe(self, model: ModelSpec, units_table: Callable[[ModelSpec], str]) -> str:
        """``autopar plan --explain-model``: the model in a few lines (``units_table``: profile.units.describe_units,
        passed in by the CLI, which may import torch)."""


class TransformerForm(ModelForm):
    """A decoder-only transformer by its fields: blocks (dense or MoE), an embedding and an LM head."""

    name, rate, batch_hint = "transformer", "tokens/s", "a smaller --global-batch or --seq-len"

    def seq(self, model: ModelSpec, seq_len: int | None) -> int:
        return int(seq_len or model.seq_len)

    def check_fix(self, model: ModelSpec, fix: Mapping[str, Any]) -> None:
        return None

    def restrict(self, model: ModelSpec, fix: Mapping[str, Any],
                 restrict: Mapping[str, Sequence]) -> tuple[dict[str, Sequence], dict[str, str]]:
        return dict(restrict), {}

    def layer_weights(self, model: ModelSpec, hw: Hardware, seq: int, prec: int,
                      fused: bool) -> tuple[np.ndarray, float, float]:
        return block_weights(model, hw, seq, prec, fused)

    def terms(self, model: ModelSpec, hw: Hardware, space: Space, seq: int, measured: Measured | None, fused: bool,
              opts: np.ndarray) -> tuple[dict[str, list], dict[str, list]]:
        return transformer_terms(model, hw, space, seq, measured, fused, opts)

    def stage_units(self, model: ModelSpec, pp: np.ndarray) -> tuple[Any, Any, Any, bool]:
        blocks = np.ceil(model.layers / pp)
        moe_blocks = np.ceil(model.moe_layers / pp)
        units = blocks + 1.0  # the stage's blocks and its root (embedding / norm / head)
        return blocks, moe_blocks, units, model.moe_layers > 0

    def model_flops(self, model: ModelSpec, global_batch: int, seq: int) -> float:
        return global_batch * seq * model_flops_per_token(model, seq)

    def sample_times(self, hw: Hardware, model: ModelSpec, sample: BlockSample) -> tuple[float, float]:
        prec = PRECISIONS.index(sample.precision)
        peak, elem = hw.peak[prec], ACT_BYTES[prec]
        b, s = float(sample.mbs), float(sample.seq_len)
        if sample.kind == "model":  # embedding + blocks + head
            parts = [self.sample_times(hw, model, dataclasses.replace(sample, kind=kind))
                     for kind in ("embedding", "head")]
            dense = self.sample_times(hw, model, dataclasses.replace(sample, kind="dense"))
            moe = self.sample_times(hw, model, dataclasses.replace(sample, kind="moe")) if model.moe_layers else dense
            n_dense = model.layers - model.moe_layers
            return (sum(p[0] for p in parts) + n_dense * dense[0] + model.moe_layers * moe[0],
                    sum(p[1] for p in parts) + n_dense * dense[1] + model.moe_layers * moe[1])
        if sample.kind == "embedding":
            f, bk = embedding_time(hw, model, b, s, 1, elem)
            return float(f), float(bk)
        if sample.kind == "head":
            f, bk = head_time(hw, model, b, s, 1, 1, peak, elem)
            return float(f), float(bk)
        block = (moe_block_time(hw, model, b, s, 1, 1, 1, False, peak, elem) if sample.kind == "moe"
                 else dense_block_time(hw, model, b, s, 1, 1, False, peak, elem))
        return float(block.fwd), float(block.bwd)

    def knows_kind(self, model: ModelSpec, kind: str) -> bool:
        return kind in ("dense", "embedding", "head") or (kind == "moe" and model.moe_layers > 0)

    def shape(self, model: ModelSpec, seq_len: int) -> str:
        return f"seq {seq_len}"

    def describe(self, model: ModelSpec, units_table: Callable[[ModelSpec], str]) -> str:
        return (f"model {model.name}: transformer, layers={model.layers} hidden={model.hidden} heads={model.heads} "
                f"kv_heads={model.kv_heads} ffn_hidden={model.ffn_hidden} ({model.ffn_kind}) vocab={model.vocab} "
                f"seq_len={model.seq_len} experts={model.experts} tied_embeddings={model.tied_embeddings}, "
                f"{model.total_params() / 1e6:,.1f}M params\n")


class UnitForm(ModelForm):
    """Any model as a sequence of units (ModelSpec.units): no tensor, context or expert parallelism; pipeline stages
    are contiguous runs of units; a sample is one batch row (seq 1)."""

    name, rate, batch_hint = "unit", "samples/s", "a smaller --global-batch"

    def seq(self, model: ModelSpec, seq_len: int | None) -> int:
        return 1  # a sample is one row, seq_len unused

    def check_seq_len(self, name: str, seq_len: int | None) -> None:
        if seq_len is not None:
            raise ConfigError("--seq-len", f"{name} is described by units (a sample is one batch row), so a "
                              "sequence length has no meaning for it", "omit --seq-len; --global-batch counts samples")

    def check_fix(self, model: ModelSpec, fix: Mapping[str, Any]) -> None:
        check_unit_fix(model, fix)

    def restrict(self, model: ModelSpec, fix: Mapping[str, Any],
                 restrict: Mapping[str, Sequence]) -> tuple[dict[str, Sequence], dict[str, str]]:
        return unit_form_restrict(model, fix, restrict)

    def layer_weights(self, model: ModelSpec, hw: Hardware, seq: int, prec: int,
                      fused: bool) -> tuple[np.ndarray, float, float]:
        return unit_weights(model, hw, prec)

    def terms(self, model: ModelSpec, hw: Hardware, space: Space, seq: int, measured: Measured | None, fused: bool,
              opts: np.ndarray) -> tuple[dict[str, list], dict[str, list]]:
        return unit_terms(model, hw, space, seq, measured, fused, opts)

    def stage_units(self, model: ModelSpec, pp: np.ndarray) -> tuple[Any, Any, Any, bool]:
        n_units = float(sum(1 for u in model.units if u.params > 0))
        return np.ceil(n_units / pp), 0.0 * pp, np.ceil(n_units / pp), False

    def model_flops(self, model: ModelSpec, global_batch: int, seq: int) -> float:
        return global_batch * unit_model_flops_per_sample(model)  # a sample is one batch row (seq 1)

    def sample_times(self, hw: Hardware, model: ModelSpec, sample: BlockSample) -> tuple[float, float]:
        prec = PRECISIONS.index(sample.precision)
        fwd, bwd = unit_time(hw, UnitArrays.of(model), float(sample.mbs), hw.peak[prec], ACT_BYTES[prec])
        names = [u.name for u in model.units]
        pick = slice(None) if sample.kind in ("units", "model") else [names.index(sample.kind)]
        return float(np.sum(fwd[..., pick])), float(np.sum(bwd[..., pick]))

    def knows_kind(self, model: ModelSpec, kind: str) -> bool:
        return kind == "units" or any(u.name == kind for u in model.units)

    def shape(self, model: ModelSpec, seq_len: int) -> str:
        return f"{len(model.units)} units"

    def relax_hints(self, model: ModelSpec, smallest: Plan) -> list[str]:
        if "grad_accum" in unit_form_restrict(model, {}, {})[1] and smallest.grad_accum == 1:
            return ["--fix grad_accum=K (a BatchNorm model keeps 1 unless fixed)"]
        return []

    def describe(self, model: ModelSpec, units_table: Callable[[ModelSpec], str]) -> str:
        return f"model {model.name}: {len(model.units)} units\n{units_table(model)}\n"


TRANSFORMER, UNIT = TransformerForm(), UnitForm()


def form_of(model: ModelSpec) -> ModelForm:
    """The form of a ModelSpec: UNIT when it is described by units, else TRANSFORMER."""
    return UNIT if model.units else TRANSFORMER


def check_unit_fix(model: ModelSpec, fix: Mapping[str, Any]) -> None:
    """Unit form (any model): no tensor, context or expert parallelism, no sequence parallel, no interleaved
    schedule (a unit-form model has no attention/MLP to split, no sequence and uneven units; pipeline stages are
    contiguous units, one per rank). A fixed value outside that is refused in one line."""
    for name in ("tp", "cp", "ep"):
        if fix.get(name, 1) != 1:
            raise ConfigError(f"fix.{name}", f"{model.name} is in unit form (no attention, MLP or sequence found): "
                              f"{name}={fix[name]} has nothing to split", f"use {name}=1")
    if model.trace_failure and fix.get("pp", 1) != 1:
        raise ConfigError("fix.pp", f"{model.name}: its forward does not run on meta tensors "
                          f"({model.trace_failure}), so no pipeline split can be traced", "use pp=1 (DP / FSDP)")
    if fix.get("sp"):
        raise ConfigError("fix.sp", "sequence parallel needs a transformer with tp > 1", "set sp=false")
    if fix.get("schedule") in UNIT_FORM_EXCLUDED or fix.get("vpp", 1) != 1:
        raise ConfigError("fix.schedule", f"{fix.get('schedule', 'vpp > 1')}: more than one stage per rank needs a "
                          "stack of identical blocks; a model in unit form has one contiguous run of units per "
                          "pipeline rank", "use schedule=1f1b or gpipe, vpp=1")


def unit_form_restrict(model: ModelSpec, fix: Mapping[str, Any],
                       restrict: Mapping[str, Sequence]) -> tuple[dict[str, Sequence], dict[str, str]]:
    """The unit form's space inside ``restrict``, and per narrowed field the reason (PlanReport.excluded):
    tp = cp = ep = 1, sp off, no interleaving (check_unit_fix); selective recompute only when a unit holds
    attention (elsewhere it is priced as none: a duplicate); grad_accum 1 when a unit holds BatchNorm, so the
    SyncBatchNorm statistics cover each rank's whole batch as on one device, unless the user fixes grad_accum."""
    out: dict[str, Sequence] = {**restrict, "tp": [1], "cp": [1], "ep": [1], "sp": [False]}
    why = dict.fromkeys(("tp", "cp", "ep", "sp"), "a model in unit form has no attention, MLP or sequence to split")
    out["schedule"] = [s for s in restrict.get("schedule", SCHEDULES) if s not in UNIT_FORM_EXCLUDED]
    why["schedule"] = (f"{', '.join(UNIT_FORM_EXCLUDED)} run several stages per rank, which needs identical blocks; "
                       "each pipeline rank holds one contiguous run of units (the traced pipeline)")
    if not any("attention" in u.kinds for u in model.units) and "recompute" not in fix:
        out["recompute"] = [r for r in restrict.get("recompute", RECOMPUTE_MODES) if r != "selective"]
        why["recompute"] = "selective recompute keeps matmul/attention outputs; no unit holds attention"
    if model.trace_failure:  # structure only: data parallelism alone, whose plans all do the same compute
        out["pp"] = [1]
        out["recompute"] = ["none"] if "recompute" not in fix else restrict.get("recompute", RECOMPUTE_MODES)
        failed = f"the meta trace of the forward failed ({model.trace_failure}): "
        why["pp"] = failed + "no pipeline split can be traced; DP and FSDP need no structure"
        why["recompute"] = failed + "no activation sizes to price recompute by"
        why.update({k: failed + v for k, v in why.items() if k in ("tp", "cp", "ep", "sp")})
    if any("batchnorm" in u.kinds for u in model.units) and "grad_accum" not in fix:
        out["grad_accum"] = [1]
        why["grad_accum"] = ("BatchNorm: statistics over the whole per-rank batch, as on one device (fix "
                             "grad_accum to allow more: the statistics are then per micro-batch)")
    return out, why
