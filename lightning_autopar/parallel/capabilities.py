"""What the runtime can apply to one model, decided once (issue 25 item 2): ``Capabilities``.

One record per model set-up, built by ``model_capabilities`` before planning and read afterwards by the planner's
restrictions (``allowed``, each narrowed field with its ``excluded`` reason), ``apply.check_plan`` at the plan's
real degrees, ``apply.apply_plan`` and the per-batch length check (``apply.check_batch_length``). It carries the
facts those need -- attention causal by itself, why a length tp does not divide cannot be padded under SP, the
tie groups, the unused trainable parameters, the MoE layout -- and the outcome of every check it ran, keyed by
the check and its degree, so no check (and no meta forward) runs twice for the same model and degree: tp=2 checked
for the restrictions is not checked again when the plan has tp=2. Nothing lives in module-global registries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable

from lightning_autopar.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from lightning_autopar.profile.analyze import ModelAnalysis

NOT_CHECKED = "the model was not checked"


@dataclass(eq=False)
class Capabilities:
    """What the runtime can apply to one model (module doc). ``allowed``: plan field -> the values the runtime can
    apply (absent: any the planner searches); ``excluded``: field -> why the others are not (the plan report)."""

    name: str
    allowed: dict[str, list[Any]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    causal: bool | None = None  # every block's attention is causal by itself (None: not known; ``check_cp``)
    unpaddable: dict[int, str] = field(default_factory=dict)  # tp -> why SP cannot pad ('' where it can)
    unused: list[str] = field(default_factory=list)  # trainable parameters no forward uses (the trace's)
    moe: str = ""  # "": no MoE layers; "ep": a layout expert parallelism supports; "unsupported"
    _checks: dict[tuple[str, Hashable], ConfigError | None] = field(default_factory=dict, repr=False)
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, analysis: ModelAnalysis) -> Capabilities:
        """A new record for the model of ``analysis`` (its name and the unused parameters its trace found)."""
        return cls(analysis.spec.name, unused=list(analysis.unused_params))

    def ties(self, root: nn.Module) -> list[Any]:
        """The tie groups of ``root`` (``parallel.units.TieGroup``), found once per model."""
        from lightning_autopar.parallel.units import tie_groups

        return self.memo("ties", lambda: tie_groups(root))

    def exclude(self, name: str, values: list[Any], reason: str) -> None:
        """Narrow plan field ``name`` to ``values``, shown with ``reason`` in the plan report."""
        self.allowed[name] = list(values)
        self.excluded[name] = reason

    def checked(self, kind: str, degree: Hashable, run: Callable[[], None]) -> None:
        """``run()`` (a check raising one ConfigError) once per (``kind``, ``degree``); later calls give its
        outcome again: nothing, or the same ConfigError."""
        key = (kind, degree)
        if key not in self._checks:
            try:
                run()
            except ConfigError as err:
                self._checks[key] = err
            else:
                self._checks[key] = None
        err = self._checks[key]
        if err is not None:
            raise err

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per ``key`` (a trace of the model, the pipeline split's analysis)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def unpaddable_at(self, tp: int) -> str:
        """Why a length ``tp`` does not divide cannot be padded under SP ('' where it can; not checked: why not)."""
        return self.unpaddable.get(tp, NOT_CHECKED)


def model_capabilities(root: nn.Module, transformer: nn.Module | None, analysis: ModelAnalysis,
                       automatic_optimization: bool = True) -> Capabilities:
    """The capabilities of a transformer (``root`` the LightningModule holding it): what each parallelism's check
    refuses for this model's structure, each with its reason. tp=2 and cp=2 are the smallest splits: what refuses
    them refuses every degree > 1; pp is checked at 2 on the pipeline split. ``automatic_optimization`` False: the
    user's loop runs backward (one micro-batch per step, no pipeline)."""
    from lightning_autopar.parallel.context import check_cp
    from lightning_autopar.parallel.sequence import check_sp
    from lightning_autopar.parallel.tensor import check_tp

    caps = Capabilities.of(analysis)
    try:
        check_tp(analysis, 2, structure_only=True)
    except ConfigError as err:
        caps.exclude("tp", [1], str(err))
    if caps.allowed.get("tp") != [1]:
        try:
            check_sp(analysis, transformer, 2, runner=root, capabilities=caps)
        except ConfigError as err:
            caps.exclude("sp", [False], str(err))
    try:
        check_cp(analysis, transformer, 2, capabilities=caps)
    except ConfigError as err:
        caps.exclude("cp", [1], str(err))
    if not automatic_optimization:
        caps.exclude("grad_accum", [1], "the user's loop runs backward (manual optimization)")
    for name, (values, reason) in _pipeline_expert_limits(root, analysis, automatic_optimization, caps).items():
        caps.exclude(name, values, reason)
    return caps


def _pipeline_expert_limits(root: nn.Module, analysis: ModelAnalysis, automatic_optimization: bool,
                            caps: Capabilities) -> dict[str, tuple[list[Any], str]]:
    """pp and ep values the runtime can apply to this model: pp needs a splittable stack of blocks and automatic
    optimization; ep needs MoE layers with a route() method, the fused layout of HF Mixtral or the plain layout
    (parallel.experts). Field -> (allowed values, why the others are not). Sets ``caps.moe``."""
    from lightning_autopar.parallel.apply import has_moe
    from lightning_autopar.parallel.experts import moe_modules, supports_ep
    from lightning_autopar.profile.analyze import find_transformer

    _, transformer = find_transformer(root)
    out: dict[str, tuple[list[Any], str]] = {}
    pipeline_refusal = ""
    try:
        check_pipeline_once(root, transformer, analysis, 2, 1, caps)
        splittable = True
    except ConfigError as err:
        splittable, pipeline_refusal = False, str(err)
    if not splittable:
        out["pp"] = ([1], pipeline_refusal)
    elif not automatic_optimization:
        out["pp"] = ([1], "pipeline parallelism runs backward itself; manual optimization cannot")
    if not has_moe(analysis):
        out["ep"] = ([1], "no MoE layers found")
    elif not all(supports_ep(m, info) for _, m, info in moe_modules(transformer, analysis)):
        caps.moe = "unsupported"
        out["ep"] = ([1], "MoE layout not supported by expert parallelism (parallel/experts.py)")
    else:
        caps.moe = "ep"
    return out


def check_pipeline_once(root: nn.Module, transformer: nn.Module, analysis: ModelAnalysis, pp: int, vpp: int,
                        caps: Capabilities) -> None:
    """``pipeline.check_pipeline`` of the pipeline split at (``pp``, ``vpp``), once per degree; the split and its
    analysis once per model."""
    from lightning_autopar.parallel.apply import pipeline_split
    from lightning_autopar.parallel.pipeline import check_pipeline

    def run() -> None:
        split, split_analysis = caps.memo("pipeline split", lambda: pipeline_split(root, transformer, analysis))
        check_pipeline(split_analysis, split, root, pp, vpp)

    caps.checked("pp", (pp, vpp), run)
