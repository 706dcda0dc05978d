"""`autopar simulate` (issue 27): a plan applied at its world size in this one process (fake process group, fake
tensors), one training step per rank, memory and collectives beside the planner's. Small worlds of the reference
GPT; each simulation takes a few seconds."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from lightning_autopar.simulate import simulate
from lightning_autopar.specs import ModelSpec

GIB = 2**30
SEQ = 8
# 2 blocks of hidden 64 (the simulated reference GPT has no learned position table: the spec prices none)
SPEC = ModelSpec(name="sim-tiny", layers=2, hidden=64, heads=4, vocab=128, seq_len=SEQ)
BASE = "pp=1,cp=1,ep=1,sp=false,compile=false,recompute=none,offload=none,precision=fp32,mbs=1"
BLOCK = 4 * 64 * 64 + 2 * 64 * 256 + 4 * 64  # attention, MLP, two LayerNorms (weight + bias)
EDGE = 2 * 128 * 64 + 2 * 64  # embedding, LM head, final norm
PARAMS = 2 * BLOCK + EDGE  # what the reference GPT holds
TENSORS = 2 * 10 + 4  # parameter tensors: 10 per block; embedding, final norm, head


def run(fix: str, world: int, global_batch: int, **kwargs):
    report = simulate(SPEC, "a100-80g-dgx", global_batch=global_batch, fix=f"{BASE},{fix}", nodes=1,
                      devices_per_node=world, **kwargs)
    assert not dist.is_initialized()  # the fake group is gone
    return report


def collective(report, group: str, op: str) -> dict:
    return next(c for c in report.collectives() if c["group"] == group and c["op"] == op)


@pytest.fixture(scope="module")
def zero3():
    return run("dp=8,dp_shard=8,tp=1,zero=3,grad_accum=2", 8, 16)


def test_zero3_states_are_the_planners(zero3):
    (rank,) = zero3.ranks
    m, p = rank.measured, rank.predicted
    # fp32: 4 B of parameters, 4 of gradients, 8 of Adam's m and v per parameter, sharded over the 8 ranks
    # (FSDP2 pads each tensor's dim 0 to a multiple of 8: none of these needs it)
    assert m["params_gib"] * GIB == PARAMS * 4 / 8
    assert m["grads_gib"] * GIB == PARAMS * 4 / 8
    assert m["optimizer_gib"] * GIB == PARAMS * 8 / 8 + 4 * TENSORS  # + Adam's step count per tensor
    for key in ("params_gib", "grads_gib", "optimizer_gib"):
        assert m[key] == pytest.approx(p[key], rel=0.01), key
    assert 0 < m["activations_gib"] < m["peak_gib"]


def test_zero3_collectives(zero3):
    blocks, units, ga = 2, 3, 2
    rs = collective(zero3, "fsdp", "reduce_scatter")
    assert rs["count"] == rs["predicted_count"] == units  # once per step, one per FSDP unit
    assert rs["bytes"] == PARAMS * 4  # fp32 gradients, whole buffers
    assert rs["bytes"] == pytest.approx(rs["predicted_bytes"], rel=0.01)
    ag = collective(zero3, "fsdp", "all_gather")
    # the runtime keeps the last block and the root unit gathered (parallel/fsdp.py): the first micro-batch
    # gathers every unit, then each micro-batch's backward re-gathers the other blocks, and the second
    # micro-batch's forward those blocks again (the planner priced every unit twice per micro-batch before
    # issue 27; now the kept ones once per step)
    assert ag["count"] == units + (blocks - 1) * (2 * ga - 1) == ag["predicted_count"]
    kept = BLOCK + EDGE
    assert ag["bytes"] == 4 * (kept + 2 * ga * (PARAMS - kept))
    assert ag["bytes"] == pytest.approx(ag["predicted_bytes"], rel=0.01)
    loss = collective(zero3, "dp", "all_reduce")  # the logged loss, averaged over the data-parallel ranks
    assert loss["count"] == 1 and loss["bytes"] == 4


def test_mixed_precision_states_are_the_planners_in_the_runtimes_split():
    """bf16-mixed: the planner's ZeRO bytes (2 + 2 + 12 per parameter) stated as the runtime holds them (its fp32
    parameter is the master copy, its gradient fp32: 4 + 4 + 8; planner.traffic.runtime_split)."""
    report = run("dp=8,dp_shard=8,tp=1,zero=3,grad_accum=1,precision=bf16-mixed", 8, 8)
    m, p = report.ranks[0].measured, report.ranks[0].predicted
    assert m["params_gib"] * GIB == m["grads_gib"] * GIB == PARAMS * 4 / 8
    for key in ("params_gib", "grads_gib", "optimizer_gib"):
        assert m[key] == pytest.approx(p[key], rel=0.01), key


def test_sequence_parallel_pipeline_collectives():
    """tp=2 with SP in two pipeline stages, full recompute on every block: the stages send this rank's sequence
    chunk (Megatron's, 1/tp of the activation), and TP's collectives are counted as the runtime issues them
    (planner.traffic.tp_block_collectives): 6 all-gathers per block and micro-batch, 4 reduce-scatters plus the
    recompute's 1, the norms' 4 gradient all-reduces, one gather at each end of the block stack."""
    report = run("dp=1,tp=2,sp=true,pp=2,zero=1,grad_accum=2,schedule=1f1b,recompute=full", 4, 2,
                 ranks="first,last")
    act = 1 * SEQ * 64 * 4 // 2  # one micro-batch's hidden states, fp32, this TP rank's half of the sequence
    for op in ("send", "recv"):
        row = collective(report, "pp", op)
        assert row["count"] == row["predicted_count"] == 2 and row["bytes"] == row["predicted_bytes"] == 2 * act
    for op in ("all_gather", "reduce_scatter", "all_reduce"):  # (all-reduces: the vocabulary's and the norms')
        row = collective(report, "tp", op)
        assert row["count"] == row["predicted_count"], row
        assert row["bytes"] == pytest.approx(row["predicted_bytes"], rel=0.05), row


def test_uneven_shards_count_as_allocated():
    """dp=3 does not divide the tensors' first dims: FSDP2 pads each shard to ceil(size / 3) rows, and the last
    rank's shorter view is the same allocation: both ranks hold the first's bytes, the padding over the planner's
    P/3 (22 rows for 64: 3% here, nothing at real sizes)."""
    report = run("dp=3,dp_shard=3,tp=1,zero=3,grad_accum=1", 3, 3, ranks="first,last")
    first, last = (r.measured for r in report.ranks)
    for key in ("params_gib", "grads_gib", "optimizer_gib"):
        assert first[key] == last[key], key
        assert 1 < first[key] / report.ranks[0].predicted[key] < 1.04, key


def test_json_keys(zero3):
    out = json.loads(json.dumps(zero3.to_json_dict()))
    assert set(out) == {"world", "plan", "ranks", "collectives", "seconds"}
    assert out["world"] == 8 and out["plan"].startswith("dp=8 zero=3")
    keys = {"params_gib", "grads_gib", "optimizer_gib", "activations_gib", "peak_gib"}
    assert set(out["ranks"][0]) == {"rank", "stage"} | keys | {f"predicted_{k}" for k in keys}
    assert all(set(c) == {"group", "op", "count", "bytes", "predicted_count", "predicted_bytes"}
               for c in out["collectives"])


def test_tensor_parallel_layout():
    report = run("dp=2,tp=2,zero=0,grad_accum=1", 4, 2, ranks="first,last")
    assert [r.rank for r in report.ranks] == [0, 3]
    # projections split, and the token embedding and LM head by vocabulary (parallel/vocab.py); norms whole
    tp_params = 2 * (BLOCK - 4 * 64) // 2 + 2 * 4 * 64 + EDGE - 128 * 64
    for rank in report.ranks:
        m, p = rank.measured, rank.predicted
        assert m["params_gib"] * GIB == tp_params * 4  # zero 0: FSDP2 on a replicate mesh keeps them whole
        # the planner holds the same; its unsharded compute copy beside the (here whole) shard, which FSDP2 frees
        # after backward, is left to the peak (planner.traffic.compute_copy_bytes)
        assert p["params_gib"] * GIB == pytest.approx(tp_params * 4)
    ar = collective(report, "tp", "all_reduce")
    tokens = 1 * SEQ * 64 * 4  # one micro-batch's hidden states, fp32
    # per block: o_proj and down_proj forward (g); backward q, k, v and up_proj's inputs (f, one per projection:
    # the planner prices Megatron's fused QKV, two per block each way); the vocabulary-parallel embedding's g
    # forward and the head's f backward; the loss's three all-reduces of one fp32 value per token (max, sum-exp,
    # target logit), inside DTensor's dispatch (loss_parallel)
    loss = 3 * SEQ * 4
    assert ar["count"] == 2 * 6 + 2 + 3 and ar["bytes"] == (2 * 6 + 2) * tokens + loss
    assert ar["predicted_count"] == 2 * 4 + 2 + 3 and ar["predicted_bytes"] == (2 * 4 + 2) * tokens + loss


def test_pipeline_stages():
    report = run("dp=2,pp=2,tp=1,zero=1,grad_accum=4,schedule=1f1b", 4, 8)
    assert [(r.rank, r.stage) for r in report.ranks] == [(0, 0), (2, 1)]  # the first rank of each stage
    for rank in report.ranks:
        m, p = rank.measured, rank.predicted
        # zero 1 runs as zero 2 (FSDP2 reduce-scatters): gradients and optimizer states sharded over dp
        for key in ("params_gib", "grads_gib", "optimizer_gib"):
            assert m[key] == pytest.approx(p[key], rel=0.01), (rank.stage, key)
    act = 1 * SEQ * 64 * 4  # one micro-batch's hidden states, fp32
    for op in ("send", "recv"):  # activations forward, gradients backward: one per micro-batch each way
        row = collective(report, "pp", op)
        assert row["count"] == row["predicted_count"] == 4 and row["bytes"] == row["predicted_bytes"] == 4 * act
    for op in ("all_gather", "reduce_scatter"):  # once per step per unit (zero 1/2), the shape inference apart
        row = collective(report, "fsdp", op)
        assert row["count"] == row["predicted_count"] == 2  # a block and the embedding (head) unit
        assert row["bytes"] == pytest.approx(row["predicted_bytes"], rel=0.01)


@pytest.mark.parametrize("cp_kind", ["gather", "heads"])
def test_context_parallel(cp_kind):
    report = run(f"dp=2,cp=2,tp=1,zero=3,grad_accum=1,cp_kind={cp_kind}", 4, 2)
    assert report.priced.plan.cp_kind == cp_kind
    for op, units in (("all_gather", 4), ("reduce_scatter", 3)):  # FSDP over dp x cp ranks, labelled fsdp
        row = collective(report, "fsdp", op)
        assert row["count"] == row["predicted_count"] == units
        assert row["bytes"] == pytest.approx(row["predicted_bytes"], rel=0.01)
    if cp_kind == "gather":
        rs = collective(report, "cp", "reduce_scatter")  # K's and V's gradients, each on its own
        assert rs["count"] == rs["predicted_count"] == 2 * 2 and rs["bytes"] == rs["predicted_bytes"]
        ag = collective(report, "cp", "all_gather")  # K and V, each on its own
        assert ag["count"] == ag["predicted_count"], ag
        assert ag["bytes"] == pytest.approx(ag["predicted_bytes"], rel=0.05), ag
    else:  # q, k, v scattered by heads and the output back, forward and backward: 4 all-to-alls x 2 x 2 blocks
        a2a = collective(report, "cp", "all_to_all")
        assert a2a["count"] == a2a["predicted_count"] == 16 and a2a["bytes"] == a2a["predicted_bytes"]
        assert not any(c["group"] == "cp" and c["op"] == "reduce_scatter" for c in report.collectives())
    m, p = report.ranks[0].measured, report.ranks[0].predicted
    for key in ("params_gib", "grads_gib", "optimizer_gib"):
        assert m[key] == pytest.approx(p[key], rel=0.01), key


def llama_tiny():
    """A Hugging Face LlamaForCausalLM (the factory form of ``--model pkg.module:factory``)."""
    from lightning_autopar.models.hf import causal_lm
    from lightning_autopar.specs import load_model_spec

    return causal_lm(load_model_spec("llama_tiny"))


def test_hugging_face_factory():
    pytest.importorskip("transformers")
    report = simulate(llama_tiny, "a100-80g-dgx", global_batch=4, fix=f"{BASE},dp=4,tp=1,zero=3,grad_accum=1",
                      nodes=1, devices_per_node=4)
    m, p = report.ranks[0].measured, report.ranks[0].predicted
    for key in ("params_gib", "grads_gib", "optimizer_gib"):  # RMSNorm has no bias: 0.1% under the spec's count
        assert m[key] == pytest.approx(p[key], rel=0.01), key
    rs = collective(report, "fsdp", "reduce_scatter")
    assert rs["count"] == rs["predicted_count"] == 4 + 1  # four decoder layers and the rest
    assert not dist.is_initialized()


def test_plain_ddp_and_moe_are_refused_in_one_line():
    from lightning_autopar.errors import ConfigError

    with pytest.raises(ConfigError, match="plan.zero.*plain DDP"):
        run("dp=4,tp=1,zero=0,grad_accum=1", 4, 4)
    with pytest.raises(ConfigError, match="model.experts"):
        simulate("mixtral_tiny", "a100-80g-dgx", global_batch=4, fix="dp=4,zero=3", nodes=1, devices_per_node=4)
    assert not dist.is_initialized()


def test_cli_bad_input_exits_2(capsys):
    from lightning_autopar.cli import main

    assert main(["simulate", "--model", "gpt-tiny", "--cluster", "cpu", "--global-batch", "0"]) == 2
    assert "--global-batch" in capsys.readouterr().err
    assert main(["simulate", "--model", "gpt-tiny", "--cluster", "a100-80g-dgx", "--nodes", "1",
                 "--global-batch", "8", "--ranks", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ranks" in err and "Traceback" not in err
    assert main(["simulate", "--model", "no_such_pkg.mod:factory", "--cluster", "cpu", "--global-batch", "8"]) == 2
    assert "factory" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_strategy_simulate_flag_plans_simulates_and_trains_nothing(monkeypatch):
    """Trainer(strategy=AutoParallelStrategy(simulate=True, cluster=...)): the user's module at its first batch,
    planned for 2 nodes x 4 devices of the cluster, its pipeline stages' first ranks simulated in this process;
    no step, no process group, the module unchanged, the model analysed once (the simulated builds start from
    that analysis); without a cluster, one line."""
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_autopar.profile.analyze as analyze_module

    analyses = []
    real_analyze = analyze_module.analyze
    monkeypatch.setattr(analyze_module, "analyze", lambda *a, **k: analyses.append(1) or real_analyze(*a, **k))

    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.errors import ConfigError
    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT

    module = LitGPT(GPTConfig(vocab=128, seq_len=SEQ, layers=2, hidden=64, heads=4), lr=0.01)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    tokens = torch.randint(0, 128, (8, SEQ + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    strategy = AutoParallelStrategy(simulate=True, cluster="a100-80g-dgx", fix=f"{BASE},dp=4,tp=1,pp=2,zero=3",
                                    print_plan=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, num_nodes=2, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    report = strategy.simulation
    assert report.world == 8 and report.priced.plan.pp == 2 and [r.rank for r in report.ranks] == [0, 4]
    assert {r.stage for r in report.ranks} == {0, 1}
    m, p = report.ranks[0].measured, report.ranks[0].predicted
    assert m["params_gib"] == pytest.approx(p["params_gib"], rel=0.01)
    assert trainer.global_step == 0 and not dist.is_initialized()
    assert len(analyses) == 1
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    with pytest.raises(ConfigError, match="simulate.*cluster="):
        AutoParallelStrategy(simulate=True)


def test_a_compiled_plan_is_simulated_eager_with_a_note():
    """compile=true: compiled kernels read their inputs' data, which a fake tensor does not have (a pipeline's
    shape inference crashed the process); the blocks run eager, the states are the same as the eager plan's, and
    the report says so."""
    compiled = run("dp=4,dp_shard=4,tp=1,zero=3,grad_accum=1,compile=true", 4, 4, ranks="first")
    eager = run("dp=4,dp_shard=4,tp=1,zero=3,grad_accum=1", 4, 4, ranks="first")
    assert compiled.priced.plan.compile and not eager.priced.plan.compile
    assert len(compiled.notes) == 1 and "ran eager" in compiled.notes[0] and not eager.notes
    for key in ("params_gib", "grads_gib", "optimizer_gib"):
        assert compiled.ranks[0].measured[key] == eager.ranks[0].measured[key]
    assert compiled.collectives() == eager.collectives()
    # a pipeline stage's first step infers its shapes through the blocks (before: a segmentation fault)
    staged = run("dp=2,dp_shard=2,tp=1,pp=2,zero=3,grad_accum=2,compile=true,schedule=gpipe", 4, 4)
    assert staged.priced.plan.pp == 2 and "ran eager" in staged.notes[0] and len(staged.ranks) == 2
