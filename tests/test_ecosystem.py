"""Ecosystem (issue 7), the fast part: Hydra configs and overrides, one-line errors, env hints, the Fabric
registration, the Accelerate mapping, the Hugging Face wrapper."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from lightning_autopar.errors import ConfigError
from lightning_autopar.specs import ClusterSpec, ModelSpec, Plan, load_cluster_spec, load_model_spec

pytest.importorskip("hydra")

from lightning_autopar.config import TrainConfig, compose, gpt_config, quote_overrides  # noqa: E402

# --------------------------------------------------------------------------------------------------- Hydra


def test_default_config_is_the_main_job():
    cfg = compose([])
    assert isinstance(cfg, TrainConfig) and isinstance(cfg.model, ModelSpec)
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.heads, cfg.model.ffn_hidden, cfg.model.vocab) == (
        4, 128, 4, 512, 256)
    assert cfg.cluster is None  # discovered at run time
    assert cfg.planner.fix is None and cfg.trainer.devices is None and cfg.trainer.max_steps == 120
    assert cfg.data.batch_size == 16


def test_main_job_progress_bar_counts_real_epochs():
    """README's main job gives max_steps only; Lightning then sets max_epochs = -1 and its rich progress bar
    printed "Epoch 14/-2". Given the loader, the Trainer spans the real epochs and stops where max_steps does."""
    from lightning.pytorch.callbacks import RichProgressBar
    from torch.utils.data import DataLoader

    from lightning_autopar.config import epochs_for_steps, trainer_from_config

    loader = DataLoader(list(range(130)), batch_size=16, drop_last=True)  # 8 batches per epoch
    assert epochs_for_steps(120, loader) == 15 and epochs_for_steps(16, loader) == 2
    assert epochs_for_steps(120, loader, accumulate=3) == 40  # 3 steps per epoch (ceil(8 / 3))
    assert epochs_for_steps(-1, loader) is None and epochs_for_steps(10, iter(range(3))) is None
    cfg = compose(["trainer.devices=1", "trainer.max_steps=120"])
    trainer = trainer_from_config(cfg, loader, callbacks=[RichProgressBar()])
    assert (trainer.max_epochs, trainer.max_steps) == (15, 120)
    bar = next(c for c in trainer.callbacks if isinstance(c, RichProgressBar))
    bar._trainer = trainer  # what Lightning's setup hook sets
    assert bar._get_train_description(14) == "Epoch 14/14"
    assert trainer_from_config(cfg).max_epochs is None  # without the loader: Lightning resolves it to -1 at fit


def test_overrides_from_the_issue_command_line():
    # `planner.fix="tp=2"` reaches argv without the quotes
    cfg = compose(["model=gpt_small", "cluster=cpu", "trainer.devices=4", "planner.fix=tp=2,zero=3"])
    assert isinstance(cfg.cluster, ClusterSpec) and cfg.cluster.name == "cpu"
    assert cfg.trainer.devices == 4 and cfg.planner.fix == "tp=2,zero=3"


def test_groups_and_structured_values():
    cfg = compose(["planner=tp2", "trainer=debug", "planner.restrict={zero:[0,3]}", "optim.lr=0.01"])
    assert cfg.planner.fix == "tp=2,zero=3" and cfg.planner.restrict == {"zero": [0, 3]}
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.max_steps) == ("cpu", 2, 5)
    assert compose(["planner.fix={tp:2}"]).planner.fix == {"tp": 2}
    assert compose([], "train_moe").model.experts == 4
    assert compose([], "train_hf").model.ffn_kind == "swiglu"


def test_presets_are_shared_with_the_spec_loaders():
    # one schema: the group YAMLs are the presets specs.load_* read
    assert compose(["model=llama_tiny"]).model == load_model_spec("llama_tiny")
    assert compose(["cluster=h100-sxm-dgx"]).cluster == load_cluster_spec("h100-sxm-dgx")
    for name in ("gpt_small", "gpt_moe_small", "mixtral_tiny"):
        assert compose([f"model={name}"]).model == load_model_spec(name)


def test_gpt_config_from_spec():
    cfg = gpt_config(load_model_spec("gpt_moe_small"), seq_len=32)
    assert (cfg.experts, cfg.top_k, cfg.seq_len, cfg.hidden) == (4, 2, 32, 128)


@pytest.mark.parametrize("overrides, field", [
    (["trainer.foo=1"], "trainer.foo"),
    (["foo=1"], "foo"),
    (["trainer.devices=abc"], "trainer.devices"),
    (["trainer.devices=0"], "trainer.devices"),
    (["model=nope"], "model"),
    (["trainer=nope"], "trainer"),
    (["model.heads=3"], "model.hidden"),
    (["planner.fix=tp=x"], "fix.tp"),
    (["planner.fix=foo=2"], "fix.foo"),
    (["planner.restrict={zero:[9]}"], "planner.restrict.zero"),
    (["trainer.precision=1.5"], "trainer.precision"),
    (["cluster=cpu", "cluster.nodes=0"], "cluster.nodes"),
    (["trainer.devices=["], "override"),
])
def test_bad_overrides_are_one_config_error(overrides, field):
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert info.value.field == field
    assert "\n" not in str(info.value)


def test_quote_overrides():
    assert quote_overrides(["planner.fix=tp=2,zero=3", "trainer.devices=2"]) == [
        "planner.fix='tp=2,zero=3'", "trainer.devices=2"]
    assert quote_overrides(["planner.fix='tp=2'", "planner.fix={tp:2}", "planner.fix=null"]) == [
        "planner.fix='tp=2'", "planner.fix={tp:2}", "planner.fix=null"]


def _app(*overrides: str, script: str = "examples/train_gpt.py") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, script, *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


def test_app_bad_override_is_one_line_exit_2():
    # the same path as every case of test_bad_overrides_are_one_config_error, through the script
    proc = _app("trainer.devices=abc", "planner.fix=tp=2")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("autopar: trainer.devices: Value 'abc'"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout


# --------------------------------------------------------------------------------------------------- env hints


def test_env_hints_single_node_cpu_wants_nothing():
    from lightning_autopar.launch import env_hints

    assert env_hints(Plan(dp=4), load_cluster_spec("cpu", nodes=1, devices_per_node=4)) == {}


def test_env_hints_nvidia_and_ascend():
    from lightning_autopar.launch import backend_for, env_hints, format_env_hints

    h100 = load_cluster_spec("h100-sxm-dgx", nodes=4)
    hints = env_hints(Plan(dp=4, tp=8), h100, interface="ib0")
    assert hints == {"AUTOPAR_PG_TIMEOUT": "1800", "NCCL_SOCKET_IFNAME": "ib0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env_hints(Plan(dp=8), load_cluster_spec("h100-sxm-dgx"))
    ascend = load_cluster_spec("ascend-910b-atlas", nodes=2)
    assert backend_for(ascend) == "hccl"
    hints = env_hints(Plan(dp=16), ascend, interface="enp1")
    assert hints["HCCL_CONNECT_TIMEOUT"] == "1200" and hints["HCCL_SOCKET_IFNAME"] == "enp1"
    assert hints["HCCL_ALGO"].startswith("level0:")
    lines = format_env_hints(hints, environ={"HCCL_CONNECT_TIMEOUT": "600"})
    assert lines[0].startswith("export AUTOPAR_PG_TIMEOUT='1800'  # ")
    assert "# HCCL_CONNECT_TIMEOUT=600 already set (suggested 1200)" in lines


# --------------------------------------------------------------------------------------------------- Fabric


def test_fabric_strategy_registered():
    from lightning.fabric import Fabric

    import lightning_autopar  # noqa: F401
    from lightning_autopar.fabric import AutoParallelFabricStrategy

    fabric = Fabric(strategy="autopar", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, AutoParallelFabricStrategy)
    strategy = AutoParallelFabricStrategy(fix="tp=2", global_batch=8)
    assert strategy._fix == {"tp": 2} and strategy._global_batch_arg == 8
    try:
        import lightning_fabric
    except ImportError:
        return
    assert "autopar" in lightning_fabric.strategies.STRATEGY_REGISTRY


def test_fabric_rebind_optimizer_by_name():
    import torch

    from lightning_autopar.fabric import rebind_optimizer

    old = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(old.parameters(), lr=0.1, momentum=0.9)
    names = {id(p): n for n, p in old.named_parameters()}
    new = {"weight": torch.nn.Parameter(old.weight.detach().clone())}  # "bias" gone (e.g. a remote expert)
    rebind_optimizer(opt, names, new)
    assert opt.param_groups[0]["params"] == [new["weight"]]


def test_fabric_settles_the_batch_within_the_planned_layout():
    """Fabric's documented order plans the layout for an assumed batch (one row per device); the loader's batch
    then sets mbs within that layout, or is refused in one line naming the largest batch the layout holds."""
    import dataclasses

    from lightning_autopar import plan
    from lightning_autopar.fabric import settle_global_batch

    cluster = load_cluster_spec("cpu", nodes=1, devices_per_node=2)
    report = plan(load_model_spec("gpt_small"), cluster, global_batch=2, seq_len=64, fix="dp=2,zero=3")
    assumed = report.best
    settled = settle_global_batch(report, assumed.plan, 16, 128)
    assert (settled.plan.dp, settled.plan.zero, settled.plan.mbs, settled.plan.grad_accum) == (2, 3, 8, 1)
    assert settled.plan.precision == assumed.plan.precision and settled.feasible
    assert settled.memory_gib_per_device > assumed.memory_gib_per_device  # priced for the real batch
    with pytest.raises(ConfigError) as info:
        settle_global_batch(report, assumed.plan, 15, 128)
    assert info.value.field == "DataLoader.batch_size" and "multiple of 2" in str(info.value)
    # a device that holds the assumed batch and half the real one, but not all of it
    between = (assumed.memory_gib_per_device + settled.memory_gib_per_device) / 2 / report.memory_fraction
    small = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_gib=between))
    with pytest.raises(ConfigError) as info:
        settle_global_batch(dataclasses.replace(report, cluster=small), assumed.plan, 16, 128)
    message = str(info.value)
    assert info.value.field == "DataLoader.batch_size" and "allow at most 8" in message and "\n" not in message


# --------------------------------------------------------------------------------------------------- launching


def test_cpu_thread_share_keeps_the_users_choice(monkeypatch):
    """Each process gets cores // local processes threads, unless OMP_NUM_THREADS says otherwise or the current
    count already fits (a torch.set_num_threads of the user's that is lower stays)."""
    import torch

    from lightning_autopar.topology import worker

    before = torch.get_num_threads()
    monkeypatch.setattr(worker, "cpu_count", lambda: 8)
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(8)
        assert worker.share_cpu_threads(4) == 2 and torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert worker.share_cpu_threads(4) == 1  # already within the share
        assert worker.share_cpu_threads(16) == 1  # more processes than cores: one thread each
        monkeypatch.setenv("OMP_NUM_THREADS", "8")
        torch.set_num_threads(8)
        assert worker.share_cpu_threads(4) == 8  # the user's explicit choice
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------------- Accelerate


def test_accelerate_mapping_pure():
    from lightning_autopar.accelerate import accelerate_mapping

    m = accelerate_mapping("dp=8,zero=3,dp_shard=4,precision=bf16-mixed,grad_accum=2,mbs=3")
    assert m.parallelism == {"dp_replicate_size": 2, "dp_shard_size": 4, "tp_size": 1, "cp_size": 1}
    assert m.fsdp == {"fsdp_version": 2, "reshard_after_forward": True, "activation_checkpointing": False}
    assert (m.mixed_precision, m.gradient_accumulation_steps, m.per_process_batch_size) == ("bf16", 2, 3)
    m = accelerate_mapping(Plan(dp=2, zero=2, tp=4))
    assert m.parallelism == {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 4, "cp_size": 1}
    assert m.fsdp["reshard_after_forward"] is False
    m = accelerate_mapping({"dp": 4, "zero": 0})
    assert m.parallelism is None and m.fsdp is None and "DDP" in m.notes[0]
    assert accelerate_mapping("tp=8").fsdp is None


@pytest.mark.parametrize("plan, field", [("pp=2", "plan.pp"), ("ep=2,dp=2", "plan.ep"),
                                         ("tp=2,sp=true", "plan.sp"), ("dp=2,tp=2,zero=0", "plan.zero"),
                                         ("dp=2,zero=3,recompute=selective", "plan.recompute"),
                                         ("dp=2,zero=0,recompute=full", "plan.recompute"),
                                         ("dp=2,zero=3,compile=true", "plan.compile")])
def test_accelerate_mapping_refusals(plan, field):
    from lightning_autopar.accelerate import accelerate_mapping

    with pytest.raises(ConfigError) as info:
        accelerate_mapping(plan)
    assert info.value.field == field


def test_accelerate_objects_and_cpu_refusal():
    pytest.importorskip("accelerate", reason="extra 'accelerate' not installed")
    import torch
    from accelerate import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from lightning_autopar.accelerate import accelerator, accelerator_kwargs

    kwargs = accelerator_kwargs("dp=4,zero=3,dp_shard=2,tp=2")
    config = kwargs["parallelism_config"]
    assert isinstance(config, ParallelismConfig) and isinstance(kwargs["fsdp_plugin"], FullyShardedDataParallelPlugin)
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.total_size) == (2, 2, 2, 8)
    assert kwargs["fsdp_plugin"].fsdp_version == 2
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="Accelerate refuses a ParallelismConfig on CPU"):
            accelerator("dp=2,zero=3")
        assert accelerator("dp=1").num_processes == 1  # one process, no ParallelismConfig: accepted


# --------------------------------------------------------------------------------------------------- Hugging Face


def test_hf_models_from_presets():
    pytest.importorskip("transformers", reason="extra 'hf' (transformers) not installed")
    import torch

    from lightning_autopar.models.hf import LitCausalLM, causal_lm

    for name, cls in (("llama_tiny", "LlamaForCausalLM"), ("mixtral_tiny", "MixtralForCausalLM")):
        spec = load_model_spec(name)
        module = LitCausalLM(causal_lm(spec))
        assert type(module.model).__name__ == cls
        idx = torch.randint(0, spec.vocab, (2, 8))
        loss = module.loss((idx, idx))
        assert loss.ndim == 0 and torch.isfinite(loss)
    with pytest.raises(ConfigError, match="model.ffn_kind"):
        causal_lm(load_model_spec("gpt_small"))
