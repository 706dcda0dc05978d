"""The capabilities record (issue 25 item 2, parallel/capabilities.py): built once per model, each check run once
per model and degree (one attention meta run per model), the facts the apply reads kept in the record, no
module-global registries. Single process, meta tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))

from lightning_autopar.errors import ConfigError  # noqa: E402
from lightning_autopar.parallel import apply, context, sequence  # noqa: E402
from lightning_autopar.parallel.capabilities import Capabilities  # noqa: E402
from lightning_autopar.profile.analyze import analyze  # noqa: E402
from lightning_autopar.specs import Plan  # noqa: E402


def _lit_gpt():
    from common import model_config

    from lightning_autopar.models.gpt import GPT
    from lightning_autopar.models.lit import LitGPT

    module = LitGPT(model_config())
    assert isinstance(module.model, GPT)
    return module, module.model


def _counting(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_each_check_runs_once_per_model_and_degree(monkeypatch):
    root, gpt = _lit_gpt()
    analysis = analyze(gpt, runner=root)
    attention = _counting(monkeypatch, context, "attention_calls")
    dry_runs = _counting(monkeypatch, sequence, "_dry_run")
    caps = apply.model_capabilities(root, gpt, analysis)
    assert "tp" not in caps.allowed and "sp" not in caps.allowed and "cp" not in caps.allowed
    assert caps.causal is True and caps.unpaddable_at(2) == ""
    assert len(attention) == 1 and len(dry_runs) == 1  # sp at tp=2 and cp at cp=2 share the one meta run
    # the plan at the degrees already checked: nothing traced again
    apply.check_plan(Plan(dp=1, tp=2, sp=True, cp=2), analysis, root, gpt, capabilities=caps)
    assert len(attention) == 1 and len(dry_runs) == 1
    # another degree: its own dry run, the attention run still the one
    apply.check_plan(Plan(dp=1, tp=4, sp=True, cp=4), analysis, root, gpt, capabilities=caps)
    assert len(attention) == 1 and len(dry_runs) == 2
    assert caps.unpaddable_at(4) == "" and caps.unpaddable_at(8) == "the model was not checked"


def test_a_refusal_is_kept_and_raised_again_without_rerunning():
    caps = Capabilities("m")
    runs = []

    def check():
        runs.append(1)
        raise ConfigError("plan.sp", "m: no", "use sp=false")

    for _ in range(2):
        with pytest.raises(ConfigError, match="^plan.sp: m: no"):
            caps.checked("sp", 2, check)
    assert len(runs) == 1


def test_the_facts_live_in_the_record_not_in_module_registries():
    assert not hasattr(sequence, "UNPADDABLE") and not hasattr(context, "CAUSAL")
    caps = Capabilities("m", causal=True, unpaddable={2: ""})
    apply.check_batch_length(Plan(tp=2, sp=True, cp=2), caps, 9)  # padded: causal, nothing spans the sequence
    with pytest.raises(ConfigError, match="^plan.cp: m: sequence length 9"):
        apply.check_batch_length(Plan(tp=1, cp=2), Capabilities("m", causal=False), 9)
    assert context.priced_length(None, "m", 9, 2) == 9  # not traced: priced as it is
    assert context.priced_length(True, "m", 9, 2) == 12


def test_a_copy_of_the_record_keeps_the_facts_and_outcomes_not_the_models_modules():
    # a simulation builds one copy of the model per rank and checks the first only (runtime.trial.SharedAnalysis)
    caps = Capabilities("m", causal=True, unpaddable={2: ""})
    caps.record("sp", 2, ConfigError("plan.sp", "m: no", "use sp=false"))
    caps.memo("attention calls", lambda: {"blocks.0": [True]})
    caps.memo("pipeline split", lambda: object())  # modules of this copy
    copied = caps.for_copy()
    assert copied.causal is True and copied.unpaddable_at(2) == ""
    with pytest.raises(ConfigError, match="^plan.sp: m: no"):
        copied.checked("sp", 2, lambda: None)
    assert copied.memo("attention calls", lambda: None) == {"blocks.0": [True]}
    made = object()
    assert copied.memo("pipeline split", lambda: made) is made  # made again for the copy
    copied.unpaddable[4] = ""
    assert caps.unpaddable_at(4) != ""  # the copy is its own record
