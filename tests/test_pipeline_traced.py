"""Pipeline parallelism through torch's tracer for models that are not a block stack (parallel.pipeline.trace, parallel.pipeline.traced).

One torchrun launch of world 2 (pp=2) runs every scenario of tests/dist/pipeline_traced_scenarios.py: a plain CNN
(BatchNorm, residuals across the split), a 3D U-Net (GroupNorm, encoder outputs concatenated across one split,
and across three with the interleaved schedule) and Hugging Face ResNet (bottleneck, BatchNorm), under GPipe,
1F1B and interleaved 1F1B. Each must equal the single-process loop over the same micro-batches: losses per step,
parameters and buffers (BatchNorm running statistics) after the steps, and the eval-mode output of a batch of
another size (running statistics; the trace is dynamic in the batch dimension). Single-process tests cover the
split (carried skip connections, user names) and the refusal lines.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import run_scenarios
from pipeline_traced_scenarios import MODELS, SCENARIOS, STEPS, UNET_UNITS, UNet3D, build, reference

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.pipeline import TracedChunk, check_traced_pipeline, flatten_inputs, trace_split

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def traced_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    return run_scenarios(tmp_path_factory, 2, list(SCENARIOS), script="pipeline_traced_scenarios.py")


@pytest.fixture(scope="module")
def references():
    return {model: reference(model) for model in MODELS}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_traced_pipeline_equals_single_process(name, traced_runs, references):
    result = torch.load(traced_runs / f"{name}.pt", weights_only=False)
    assert "crash" not in result, result.get("crash")
    losses, state, eval_out = references[SCENARIOS[name][0]]
    assert len(result["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=RTOL, atol=ATOL)
    assert set(result["state"]) == set(state)  # the union of the stages' state dicts: every user name, once
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=RTOL, atol=ATOL, msg=key)
    torch.testing.assert_close(result["eval"], eval_out, rtol=RTOL, atol=ATOL)
    assert all(n > 0 for n in result["params_per_rank"])  # each rank holds its own part only


def _run_chunks(split, example):
    chunks = [TracedChunk(split, k, lambda i: example) for k in range(split.num_chunks)]
    out = chunks[0](torch.tensor(0))
    for chunk in chunks[1:]:
        out = chunk(*(out if isinstance(out, tuple) else (out,)))
    return chunks[-1].rebuild(out)


def test_unet_skips_are_carried_through_the_chunks_between():
    model = build("unet")
    x = torch.randn(2, 2, 8, 8, 8)
    split = trace_split(model, ((x,), {}), UNET_UNITS, [1, 1, 1, 5])
    # chunk 1 gets enc1's output and its pooling; chunk 2 enc1's and enc2's outputs and the pooling; chunk 3
    # both encoder outputs (for the concatenations) and mid's. enc1's output passes through chunks 1 and 2.
    assert [len(c) for c in split.carried] == [0, 2, 3, 3]
    assert len(set(split.carried[1]) & set(split.carried[2]) & set(split.carried[3])) == 1
    expected = model(x)
    torch.testing.assert_close(_run_chunks(split, ((x,), {})), expected)
    # names are the user's: every stage tensor is the model's own tensor under the same name
    own = dict(model.named_parameters())
    for k in range(split.num_chunks):
        for name, param in split.stage_module(k).named_parameters():
            assert own[name] is param


def test_hf_resnet_output_is_rebuilt_as_the_model_output():
    pytest.importorskip("transformers")
    model = build("resnet")
    x = torch.randn(2, 3, 16, 16)
    split = trace_split(model, ((), {"pixel_values": x}), MODELS["resnet"]["units"], [2, 3])
    out = _run_chunks(split, ((), {"pixel_values": x}))
    assert type(out).__name__ == "ImageClassifierOutputWithNoAttention"
    torch.testing.assert_close(out.logits, model(pixel_values=x).logits)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # control flow on tensor values: export cannot trace it
            return self.b(h)
        return self.b(-h)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_refusal_when_export_cannot_trace(capfd):
    with pytest.raises(ConfigError) as err:
        check_traced_pipeline(DataDependent(), ((torch.randn(2, 4),), {}), ["a", "b"], 2)
    text = str(err.value)
    assert text.startswith("plan.pp: DataDependent: torch.export cannot trace the model")
    assert "data-dependent" in text and "\n" not in text and text.endswith("fix: use pp=1")
    assert "def forward" not in capfd.readouterr().err  # export's partial graph is not printed


def test_refusal_for_a_tie_across_the_split():
    with pytest.raises(ConfigError, match=r"plan.pp: Tied: parameter 'a.weight' is used on both sides of a split"):
        check_traced_pipeline(Tied(), ((torch.randn(2, 4),), {}), ["a", "b"], 2)


def test_refusal_for_more_chunks_than_units_and_unknown_unit():
    with pytest.raises(ConfigError, match="pp\\*vpp=4 exceeds its 2 units"):
        check_traced_pipeline(Tied(), ((torch.randn(2, 4),), {}), ["a", "b"], 2, vpp=2)
    with pytest.raises(ConfigError, match="no submodule 'c' to split at"):
        check_traced_pipeline(UNet3D(), ((torch.randn(2, 2, 8, 8, 8),), {}), ["enc1", "c"], 2)


def test_check_leaves_the_model_unchanged_and_accepts_it():
    model = build("cnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check_traced_pipeline(model, ((torch.randn(2, 3, 8, 8),), {}), MODELS["cnn"]["units"], 2)
    assert all("forward" not in vars(m) for m in model.modules())  # the split annotations are removed
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_fixed_dimensions_are_checked():
    model = build("cnn")
    split = trace_split(model, ((torch.randn(2, 3, 8, 8),), {}), MODELS["cnn"]["units"], [2, 2])
    flatten_inputs(split, (torch.randn(5, 3, 8, 8),), {})  # the batch dimension is dynamic
    with pytest.raises(ConfigError, match="input 'x' has shape \\(2, 3, 9, 9\\)"):
        flatten_inputs(split, (torch.randn(2, 3, 9, 9),), {})


class RowsAfterB(nn.Module):
    """The row count read from the input and used after unit 'b': an int crosses a split before 'b' (only).
    Unit 'a' is the heaviest, so a partition by unit time would cut right after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 512), nn.Linear(512, 4))
        self.b, self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        rows = x.shape[0]
        h = self.b(self.a(x)).reshape(rows, 2, 2).reshape(rows, 4)
        return self.d(self.c(h))

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _unit_plan(module, world, fix):
    from functools import partial

    from lightning_autopar.profile.units import find_model_call
    from lightning_autopar.runtime.setup import SetupOptions, Workload, analyse_model, find_capabilities, plan_model
    from lightning_autopar.runtime.trial import SetupSettings
    from lightning_autopar.specs import load_cluster_spec

    batch = (torch.randn(8, 4),)
    work = Workload(module, first_batch=batch, loader_batch_size=8)
    options = SetupOptions(fix=fix, settings=SetupSettings(trials=0, profile=False))
    analysed = analyse_model(work, lambda: find_model_call(module, partial(module.training_step, (batch[0][:2],), 0)),
                             None, world)
    assert analysed.unit_form
    capable = find_capabilities(module, analysed.model, analysed.analysis, analysed.example, options,
                                world_size=world)
    cluster = load_cluster_spec("cpu", nodes=1, devices_per_node=world)
    return analysed, capable, plan_model(analysed, capable, cluster, "32-true", options)


def test_planner_refuses_a_pipeline_the_runtime_would_refuse():
    """Issue 26, planner = runtime: a pinned pp=4 cuts before 'b', where an int crosses: the planner refuses it
    with the runtime's line; pp=2 is offered only at a partition the runtime traces (here the even one, not the
    cut after the heavy 'a' a partition by unit time would choose)."""
    from lightning_autopar.parallel.apply import check_unit_pipeline

    torch.manual_seed(0)
    with pytest.raises(ConfigError) as err:
        _unit_plan(RowsAfterB(), 4, {"pp": 4})
    assert str(err.value).count("a SymInt value crosses the split before unit 'b'") == 1, str(err.value)
    analysed, capable, planned = _unit_plan(RowsAfterB(), 2, {"pp": 2})
    best = planned.report.best
    assert best.plan.pp == 2 and best.layers_per_stage == [2, 2]
    assert "pp" not in capable.capabilities.excluded  # pp=2 itself is offered
    for priced in planned.report.candidates:
        check_unit_pipeline(analysed.model, analysed.model, analysed.analysis, analysed.example, priced.plan.pp,
                            priced.plan.vpp, priced.layers_per_stage)
