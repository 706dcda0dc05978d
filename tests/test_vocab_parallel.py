"""Vocabulary parallelism (``parallel.vocab``): under tp the token embedding is sharded by vocabulary rows, the LM
head by output columns, the token cross-entropy computed on the shards. Every plan equals the single-process loop
(losses per step, final weights: rtol 1e-5) -- our GPT with tied weights at tp=2, tp=4 and tp=2 x dp=2 zero=3, a
tiny HF Llama (untied; its ``labels=`` loss too), GPT-2 (tied), ignored targets with ``reduction="none"``, and
under pp=2 x tp=2 our untied GPT and the
Llama (its ``labels=`` loss; with SP), each stage sharding what it holds --, each rank holds 1/tp of the embedding
and head,
a loss that is not the token cross-entropy gathers the logits (exact, one line), and the planner prices what runs
(no processes for the refusals and the planner)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from common import VOCAB, make_module, reference_run
from conftest import run_scenarios
from test_strategy import assert_equivalent, load
import vocab_scenarios as V

from lightning_autopar.models.gpt import GPT
from lightning_autopar.parallel.apply import model_capabilities
from lightning_autopar.parallel.vocab import refusal
from lightning_autopar.planner.cost_memory import logits_split, vocab_split
from lightning_autopar.planner.terms import rank_param_counts
from lightning_autopar.profile.analyze import analyze, find_transformer
from lightning_autopar.runtime.setup import Analysed, Capable, priced_spec
from lightning_autopar.specs import ModelSpec, Plan

pytest.importorskip("transformers")

HIDDEN = 32  # tests/dist/common.py's GPT and tests_hf's Llama
GATHER_LINE = "autopar: the vocabulary-parallel logits are used by"


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 2, V.WORLD2, script="vocab_scenarios.py")


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_scenarios(tmp_path_factory, 4, V.WORLD4, script="vocab_scenarios.py")


def _result(world2, world4, name: str) -> dict:
    return load(world2 if name in V.WORLD2 else world4, name)


# ------------------------------------------------------------------------------------------- processes


@pytest.mark.parametrize("name", V.WORLD2 + V.WORLD4)
def test_vocab_parallel_matches_single_process(world2, world4, name):
    result = _result(world2, world4, name)
    assert_equivalent(result, *reference_run(make=V.make(V.PLANS[name][0])))


@pytest.mark.parametrize("name", V.WORLD2 + V.WORLD4)
def test_each_rank_holds_one_tp_th_of_the_embedding_and_head(world2, world4, name):
    result = _result(world2, world4, name)
    plan = result["plan"]
    whole = VOCAB * HIDDEN * 4  # fp32 [V, h]
    shards = plan["tp"] * (plan["dp"] if plan["zero"] == 3 else 1)  # FSDP shards the TP shard over dp
    tied = V.PLANS[name][0] in ("gpt_tied", "gpt_fallback", "gpt_ignore_none", "gpt2")
    assert len(result["held"]) == (1 if tied else 2), result["held"]  # a tie stays one tensor
    assert all(b == whole // shards for b in result["held"].values()), result["held"]
    assert not any("vocabulary parallel off" in line for line in result["lines"])


def test_a_loss_that_is_not_the_cross_entropy_gathers_with_one_line(world2, world4):
    lines = load(world2, "gpt_fallback_tp2")["lines"]  # every rank's
    gathered = [line for line in lines if line.startswith(GATHER_LINE)]
    assert len(gathered) == 1 and "log_softmax" in gathered[0], lines
    for name in V.WORLD2 + V.WORLD4:  # the token cross-entropy (ours, HF's labels=) stays on the shards, also
        if name != "gpt_fallback_tp2":  # on a pipeline's last stage (its schedule reads the logits' metadata)
            lines = _result(world2, world4, name)["lines"]
            assert not any(line.startswith(GATHER_LINE) for line in lines), (name, lines)


# ------------------------------------------------------------------------------------------- refusals (no processes)


def _plan(**fields) -> Plan:
    return Plan(**{"dp": 1, "tp": 2, "pp": 1, **fields})


def test_refused_where_tp_does_not_divide_the_vocabulary():
    assert refusal(_plan(tp=2), 64, "") == ""
    assert refusal(_plan(tp=2, pp=2), 64, "") == ""  # each stage shards the part it holds
    assert refusal(_plan(tp=3), 64, "") == "tp=3 does not divide the vocabulary (64 rows)"
    assert refusal(_plan(tp=2), 64, "a model's reason") == "a model's reason"


class ScaledGPT(GPT):
    """Our GPT whose forward also reads the embedding weight outside the embedding's call (a scale from its norm)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.tok_emb.weight.norm()


def functional_use() -> torch.nn.Module:
    module = make_module(tied_embeddings=True)
    module.model.__class__ = ScaledGPT
    return module


def _capabilities(model: torch.nn.Module):
    _, transformer = find_transformer(model)
    analysis = analyze(transformer, trace=True, runner=model)
    return analysis, model_capabilities(model, transformer, analysis)


def test_a_weight_used_outside_its_module_is_refused_by_the_trace_and_priced_whole():
    analysis, caps = _capabilities(make_module(tied_embeddings=True))
    assert caps.vocab == ""
    assert priced_spec(Analysed(None, analysis, None, 8, 16), Capable(caps, {})).vocab_parallel
    analysis, caps = _capabilities(functional_use())
    assert "tok_emb.weight' is used outside its module's call" in caps.vocab, caps.vocab
    # the planner then holds the embedding and head whole on every TP rank, as the runtime does
    assert not priced_spec(Analysed(None, analysis, None, 8, 16), Capable(caps, {})).vocab_parallel


# ------------------------------------------------------------------------------------------- planner (no processes)


LLAMA_32K = ModelSpec(name="llama-32k", layers=2, hidden=4096, heads=32, ffn_hidden=11008, ffn_kind="swiglu",
                      vocab=32000, seq_len=2048)


def test_the_planner_divides_embedding_head_and_logits_where_the_runtime_does():
    tp, pp = np.array([1, 4, 4, 3]), np.array([1, 1, 2, 1])
    assert vocab_split(LLAMA_32K, tp, pp).tolist() == [1, 4, 4, 1]  # 3 not dividing 32000: whole
    assert logits_split(LLAMA_32K, tp, pp, np.array([1, 1, 1, 1])).tolist() == [1, 4, 4, 1]
    assert logits_split(LLAMA_32K, 4, 1, 2) == 1  # cp: the head's output gathered whole
    off = ModelSpec(**{**LLAMA_32K.__dict__, "vocab_parallel": False})
    assert vocab_split(off, 4, 1) == 1
    _, _, _, emb, head = rank_param_counts(LLAMA_32K, 4.0, 1.0, 1.0, False, held=True)
    assert emb == 32000 * 4096 / 4 and head == 32000 * 4096 / 4 + 2 * 4096
