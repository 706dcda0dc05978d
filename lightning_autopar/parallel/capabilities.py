"""What the runtime can apply to one model, decided once (issue 25 item 2): ``Capabilities``.

One record per model set-up, built by ``apply.model_capabilities`` before planning and read afterwards by the planner's
restrictions (``allowed``, each narrowed field with its ``excluded`` reason), ``apply.check_plan`` at the plan's
real degrees, ``apply.apply_plan`` and the per-batch length check (``apply.check_batch_length``). It carries the
facts those need -- attention causal by itself, why a length tp does not divide cannot be padded under SP, the
tie groups, the unused trainable parameters, the MoE layout -- and the outcome of every check it ran, keyed by
the check and its degree, so no check (and no meta forward) runs twice for the same model and degree: tp=2 checked
for the restrictions is not checked again when the plan has tp=2. Nothing lives in module-global registries.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable

from lightning_autopar.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from lightning_autopar.profile.analyze import ModelAnalysis

NOT_CHECKED = "the model was not checked"
# memos holding modules of the model they were made from, which an identical copy of it must make again
MODULE_MEMOS = ("pipeline split",)


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
    # trainable parameters (root-relative) the call trace on token ids never reached: a batch may skip them (a
    # VLM's projector without images), and whether one does is the data's (parallel/unreached.py)
    unreached: list[str] = field(default_factory=list)
    moe: str = ""  # "": no MoE layers; "ep": a layout expert parallelism supports; "unsupported"
    # why the embedding and LM head of this model cannot be sharded by vocabulary ('' where they can;
    # ``parallel.vocab.module_refusal``); a plan's own reasons (pp, tp not dividing V) come from ``vocab.refusal``
    vocab: str = NOT_CHECKED
    _checks: dict[tuple[str, Hashable], ConfigError | None] = field(default_factory=dict, repr=False)
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, analysis: ModelAnalysis) -> Capabilities:
        """A new record for the model of ``analysis`` (its name and the unused parameters its trace found)."""
        return cls(analysis.spec.name, unused=list(analysis.unused_params))

    def for_copy(self) -> Capabilities:
        """This record for an identical copy of its model (a simulation builds one per rank): every fact, check
        outcome and memo, bar the memos holding this model's own modules (``MODULE_MEMOS``)."""
        # the containers are the copy's own (its checks add to them); their values -- check outcomes (ConfigErrors,
        # which do not deep-copy), traced facts -- are read, never changed, so both records hold the same ones
        return dataclasses.replace(
            self, allowed=copy.deepcopy(self.allowed), excluded=dict(self.excluded), unpaddable=dict(self.unpaddable),
            unused=list(self.unused), unreached=list(self.unreached), _checks=dict(self._checks),
            _memo={key: value for key, value in self._memo.items() if key not in MODULE_MEMOS})

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

    def record(self, kind: str, degree: Hashable, outcome: ConfigError | None) -> None:
        """The outcome of the check (``kind``, ``degree``) found otherwise (``checked`` then gives it)."""
        self._checks[(kind, degree)] = outcome

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` once per ``key`` (a trace of the model, the pipeline split's analysis)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def unpaddable_at(self, tp: int) -> str:
        """Why a length ``tp`` does not divide cannot be padded under SP ('' where it can; not checked: why not)."""
        return self.unpaddable.get(tp, NOT_CHECKED)
