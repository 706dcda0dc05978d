"""Hugging Face Accelerate: autopar's own plan inside an Accelerate loop (``prepare``), or a plan mapped to
Accelerate's ``ParallelismConfig`` (dp_replicate / dp_shard / tp / cp) + an FSDP2 plugin.

``prepare(accelerator, model, optimizer, loader, fix=None, **planner_options)`` plans and applies with autopar's
analysis, planner and apply layer (the set-up stages of the Trainer and Fabric strategies) on the process group
the Accelerator set up, and returns ``(model, optimizer, loader)`` for the user's Accelerate loop; it runs on CPU
processes (``Accelerator(cpu=True)`` under torchrun) and GPUs. See its docstring and docs/launching.md.

``accelerate_mapping(plan)`` is the pure, documented mapping to Accelerate's own implementation (no Accelerate
import):

==================  ====================================================================================
plan                Accelerate
==================  ====================================================================================
dp, zero=0          plain DDP: no ParallelismConfig (Accelerate rejects dp_replicate > 1 with dp_shard = 1)
dp, zero>=1         dp_shard_size = dp_shard (all of dp by default), dp_replicate_size = dp / dp_shard (HSDP)
zero=3 / 1, 2       FSDP2 plugin, reshard_after_forward True / False (as ``parallel/fsdp.py`` does)
tp, cp              tp_size, cp_size (TP needs a model loaded with ``tp_plan="auto"``; not with DDP)
mbs, grad_accum     the per-process DataLoader batch size, ``gradient_accumulation_steps``
precision           mixed_precision "no" / "bf16" / "fp16"
recompute=full      the FSDP plugin's ``activation_checkpointing=True``
==================  ====================================================================================

What Accelerate cannot express raises a one-line ``ConfigError`` naming the field (pp > 1, ep > 1, sp,
selective recompute, tp with zero=0). ``accelerator(plan)`` builds the ``Accelerator``; Accelerate refuses a
ParallelismConfig on several CPU processes (it needs FSDP2 or a multi-device GPU/NPU type), which is reported in
one line too: on CPUs use ``prepare``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_autopar.errors import ConfigError
from lightning_autopar.runtime.planning import PlanningMixin
from lightning_autopar.specs import Plan, parse_fix

MIXED_PRECISION = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
CPU_REFUSAL = ("Accelerate refuses a ParallelismConfig on CPU processes (it needs FSDP2 or a multi-device GPU/NPU "
               "type; under torchrun on CPU it sees one process)")


@dataclass
class AccelerateMapping:
    """The Accelerate settings of one plan (see the module table)."""

    parallelism: dict[str, int] | None  # ParallelismConfig kwargs; None: plain DDP / one process
    fsdp: dict[str, Any] | None  # FullyShardedDataParallelPlugin kwargs; None: no FSDP
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    per_process_batch_size: int = 1  # the DataLoader batch each process gets (plan.mbs)
    notes: list[str] = field(default_factory=list)


def _as_plan(plan: Plan | dict | str) -> Plan:
    if isinstance(plan, Plan):
        return plan
    return Plan(**parse_fix(plan))


def accelerate_mapping(plan: Plan | dict | str) -> AccelerateMapping:
    """Map ``plan`` (a Plan, a dict or ``"dp=4,zero=3"``) to Accelerate's settings, or raise ConfigError."""
    plan = _as_plan(plan)
    plan.validate()
    for name, value, fix in (("pp", plan.pp, "pp=1"), ("ep", plan.ep, "ep=1"), ("sp", plan.sp, "sp=false")):
        if value is True or value > 1:
            raise ConfigError(f"plan.{name}", f"Accelerate has no {name}={value} (its ParallelismConfig is "
                              "dp_replicate x dp_shard x tp x cp)", f"plan with {fix}, or use strategy='autopar'")
    if plan.compile:
        raise ConfigError("plan.compile", "Accelerate compiles the whole model (its dynamo plugin), not each block",
                          "plan with compile=false (and set Accelerate's dynamo backend yourself), or use "
                          "strategy='autopar'")
    if plan.recompute == "selective":
        raise ConfigError("plan.recompute", "Accelerate only checkpoints whole blocks (activation_checkpointing)",
                          "plan with recompute=full or none")
    sharded = plan.zero > 0 and plan.dp > 1
    if plan.tp > 1 and plan.dp > 1 and not sharded:
        raise ConfigError("plan.zero", "Accelerate cannot combine tensor parallelism with DDP (zero=0)",
                          "plan with zero>=1 (FSDP2 + TP) or dp=1")
    notes = []
    parallelism = None
    if sharded or plan.tp > 1 or plan.cp > 1:
        shard = plan.shard_size if sharded else 1
        parallelism = dict(dp_replicate_size=plan.dp // shard, dp_shard_size=shard, tp_size=plan.tp,
                           cp_size=plan.cp)
    elif plan.dp > 1:
        notes.append(f"zero=0: plain DDP over {plan.dp} processes (no ParallelismConfig)")
    fsdp = None
    if sharded or plan.cp > 1:
        fsdp = dict(fsdp_version=2, reshard_after_forward=plan.zero == 3,
                    activation_checkpointing=plan.recompute == "full")
        if plan.zero in (1, 2):
            notes.append(f"zero={plan.zero}: FSDP2 keeping parameters gathered between forward and backward")
    elif plan.recompute == "full":
        raise ConfigError("plan.recompute", "Accelerate applies activation checkpointing through its FSDP plugin, "
                          "which this plan does not use", "plan with zero>=1 and dp>1, or recompute=none")
    return AccelerateMapping(parallelism=parallelism, fsdp=fsdp, mixed_precision=MIXED_PRECISION[plan.precision],
                             gradient_accumulation_steps=plan.grad_accum, per_process_batch_size=plan.mbs,
                             notes=notes)


def accelerator_kwargs(plan: Plan | dict | str) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` (ParallelismConfig and FSDP plugin objects built)."""
    from accelerate import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    mapping = accelerate_mapping(plan)
    kwargs: dict[str, Any] = dict(mixed_precision=mapping.mixed_precision,
                                  gradient_accumulation_steps=mapping.gradient_accumulation_steps)
    if mapping.parallelism is not None:
        kwargs["parallelism_config"] = ParallelismConfig(**mapping.parallelism)
    if mapping.fsdp is not None:
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(**mapping.fsdp)
    return kwargs


def _accelerator_device() -> bool:
    """Whether a GPU (CUDA) or an NPU is present: what Accelerate's ParallelismConfig needs."""
    import torch

    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def accelerator(plan: Plan | dict | str, **kwargs: Any) -> Any:
    """An ``accelerate.Accelerator`` running ``plan``; ConfigError (one line) where Accelerate refuses it."""
    from accelerate import Accelerator

    merged = {**accelerator_kwargs(plan), **kwargs}
    config = merged.get("parallelism_config")
    if config is not None and config.total_size > 1 and not _accelerator_device():
        raise ConfigError("accelerate", CPU_REFUSAL, "run on GPUs, or use lightning_autopar.accelerate.prepare")
    try:
        return Accelerator(**merged)
    except ValueError as err:
        text = " ".join(str(err).split())
        if "ParallelismConfig" in text or "parallelism" in text.lower():
            raise ConfigError("accelerate", text[:300], "adjust the plan, or use strategy='autopar'") from None
        raise


# ---------------------------------------------------------------------------------------- prepare: autopar's own plan

ACCELERATE_TO_LIGHTNING = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def prepare(accelerator: Any, model: Any, optimizer: Any, loader: Any, fix: str | dict | None = None,
            step_call: bool = False, **planner_options: Any) -> tuple[Any, Any, Any]:
    """Plan ``model`` with autopar and apply the plan with autopar's own layers, on the process group ``accelerator``
    set up; returns ``(model, optimizer, loader)`` for the user's Accelerate loop (see docs/launching.md
    "Accelerate"). ``planner_options`` are the strategies' (``cluster``, ``restrict``, ``top``, ``print_plan``,
    ``memory_fraction``, ``moe_capacity_factor``, ``trials``, ``profile``, ...; not ``global_batch``: the loader
    gives it).

    * **the batch**: with ``Accelerator(split_batches=True)`` a loader batch is the global batch of one step and
      each data-parallel rank gets its contiguous slice; without it each data-parallel rank reads its own loader
      batch (the tp / cp ranks of one data-parallel rank read the same one), so a step's global batch is
      ``batch_size x dp``: ``dp`` consecutive loader batches, as one device reading batches that large.
    * **the loop** stays Accelerate's: ``accelerator.backward``, ``optimizer.step()`` / ``zero_grad()`` (skipped
      inside ``accelerator.accumulate(model)`` until the gradients sync, as for Accelerate's own optimizer),
      ``accelerator.accumulate(model)`` / ``no_sync(model)`` (the plan's FSDP2 / DDP gradient reduction skipped),
      ``accelerator.clip_grad_norm_(model.parameters(), ...)`` (autopar's clip over every mesh, ``parallel.clip``),
      ``accelerator.autocast`` around the model's forward (its mixed precision is the plan's precision), and
      ``accelerator.save_state`` / ``load_state`` (the model and optimizer through torch.distributed.checkpoint in
      single-device names, so a state saved at one plan loads at another; Accelerate keeps the RNG states, the
      step, schedulers and the scaler).
    * **the plan** has one micro-batch per backward (``grad_accum=1``) and ``pp=1``: the user's loop calls
      backward; accumulate with ``accelerator.accumulate``.
    * **step_call=True**: the loop calls ``loss = model.train_step(batch, loss_fn)`` instead of forward and
      backward (``loss_fn(micro_batch)`` calls the model and returns the loss, like a ``training_step``); the
      step runs every micro-batch's forward and backward, so the planner offers ``pp > 1`` (the pipeline
      schedule) and ``grad_accum > 1``. Needs ``split_batches=True``: every rank gets the whole global batch.
    """
    if "global_batch" in planner_options:
        raise ConfigError("global_batch", "prepare() reads the global batch from the DataLoader and the "
                          "Accelerator's split_batches", "leave global_batch out")
    planning = AcceleratePlanning(accelerator, model, loader, step_call=step_call, fix=fix, **planner_options)
    model, optimizer = planning.setup(model, optimizer)
    return model, optimizer, planning.prepare_loader(loader)


class _AccelerateBase:
    """What ``PlanningMixin`` reads from a Lightning strategy's constructor, kept for an Accelerator."""

    def __init__(self, save_distributed_checkpoint: bool = True, timeout: Any = None, **_: Any) -> None:
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._timeout = timeout


class AcceleratePlanning(PlanningMixin, _AccelerateBase):
    """The set-up stages (``runtime.setup``, through ``runtime.planning.PlanningMixin`` as the Trainer and Fabric
    strategies call them) on an Accelerator's process group, device and precision; ``prepare`` is its front."""

    def __init__(self, accelerator: Any, module: Any, loader: Any, step_call: bool = False, **options: Any) -> None:
        super().__init__(**options)
        self._step_call = step_call
        self._acc = accelerator
        self._module = module
        self._loader = loader
        self._optimizer: Any = None  # the AcceleratedOptimizer prepare returns (None: the Accelerator's own)
        self._torch_optimizer: Any = None  # the torch optimizer inside it, saved and loaded with the model
        if accelerator.mixed_precision not in ACCELERATE_TO_LIGHTNING:
            raise ConfigError("Accelerator.mixed_precision", f"{accelerator.mixed_precision!r} has no autopar plan",
                              "use mixed_precision 'no', 'bf16' or 'fp16'")

    # -------------------------------------------------------- what PlanningMixin reads from the framework
    @property
    def lightning_module(self) -> Any:
        return self._module

    @property
    def global_rank(self) -> int:
        return self._acc.process_index

    @property
    def world_size(self) -> int:
        return self._acc.num_processes

    @property
    def root_device(self) -> Any:
        return self._acc.device

    @property
    def num_processes(self) -> int:  # processes per node, as Lightning's strategies count them
        import os

        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.num_processes)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj], from_process=src)[0] if self.world_size > 1 else obj

    def _plan_loader(self) -> Any:
        return self._loader

    def _automatic_optimization(self) -> bool:
        # a loop calling backward: one micro-batch per backward, no pipeline schedule; step_call: model.train_step
        return self._step_call

    def _model_call(self) -> Any:
        from lightning_autopar.fabric import first_tensor_call

        return first_tensor_call(self._module, self._first_batch(), "accelerate.prepare",
                                 "pass a DataLoader whose batches hold the model's input tensor")

    def _train_context(self) -> Any:
        return self._acc.autocast()

    def _eval_context(self) -> Any:
        return self._acc.autocast()

    def _loss_scaler(self) -> Any:
        return self._acc.scaler

    # -------------------------------------------------------- set-up
    def setup(self, module: Any, optimizer: Any, autocast: bool = True) -> tuple[Any, Any]:
        """Plan and apply (as ``fabric.setup`` does), re-point the optimizer, and hook the model, the optimizer and
        the Accelerator's clip, no_sync, autocast and save/load to the applied plan. ``optimizer`` None: none yet
        (the HF Trainer creates its own after the plan; it hands it to ``adopt_optimizer``). ``autocast=False``:
        the forward is left as it is (the caller has Accelerate's ``prepare_model`` wrap it instead)."""
        from lightning_autopar.parallel.fsdp import gradient_sync_off

        names = {id(p): name for name, p in module.named_parameters()}
        self._plan_and_apply_here(module)
        if optimizer is not None:
            optimizer = self.adopt_optimizer(optimizer, names)
            # not registered in the Accelerator's optimizers: save_state would pickle its shards on rank 0 alone
            optimizer = self._optimizer = self._accelerated(optimizer)
        module.no_sync = lambda: gradient_sync_off(module)  # what accelerator.no_sync / accumulate call
        module.autopar = self  # the plan, report, analysis and mesh of this model (``model.autopar.plan``)
        if self._step_call:
            module.train_step = self.train_step
        if autocast and self._acc.mixed_precision != "no":
            self._autocast_forward(module)
        self._hook_accelerator(module)
        return module, optimizer

    def _plan_and_apply_here(self, module: Any) -> None:
        """The set-up stages on this process group, the batch settled by the Accelerator's convention, the model
        on the device and the loss scaler one that sees sharded gradients."""
        from lightning_autopar.fabric import check_even_rows, settle_global_batch
        from lightning_autopar.parallel.offload import module_to_device
        from lightning_autopar.parallel.precision import ShardedGradScaler
        from lightning_autopar.runtime import lightning_private as private
        from lightning_autopar.runtime.batches import last_batch_rows

        acc = self._acc
        self._single_process_group()
        rows = getattr(self._loader, "batch_size", None)
        split = acc.split_batches
        if self._step_call and not split:
            raise ConfigError("Accelerator.split_batches", "model.train_step takes the global batch of one step",
                              "Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))")
        if not split and rows:  # planned for one loader batch per process, settled below for the plan's dp
            self._global_batch_arg = rows * self.world_size
        private.materialize_distributed_module(module, self.root_device)
        self._plan_and_apply(ACCELERATE_TO_LIGHTNING[acc.mixed_precision])
        plan = self.plan
        if split:
            check_even_rows(last_batch_rows(self._loader), plan.dp)
        elif rows and rows * plan.dp != self._global_batch:  # tp / cp ranks share a batch: B x dp per step
            priced = settle_global_batch(self.report, plan, rows * plan.dp, self.report.seq_len)
            self.plan, self.report.best = priced.plan, priced
            self._global_batch = self.report.global_batch = rows * plan.dp
        module_to_device(module, self.root_device, plan.offload)
        if acc.scaler is not None and not isinstance(acc.scaler, ShardedGradScaler):
            acc.scaler = ShardedGradScaler(device=self.root_device.type)

    def adopt_optimizer(self, optimizer: Any, names: dict[int, str] | None = None) -> Any:
        """``optimizer`` on the applied model: re-pointed from the parameters named ``names`` (the ones it was built
        on, before the plan replaced them), its TP states kept in single-device row order and offloaded as the plan
        says; kept for ``save`` / ``load``."""
        from lightning_autopar.fabric import rebind_optimizer

        if names is not None:
            rebind_optimizer(optimizer, names, dict(self._module.named_parameters()))
        self._keep_optimizer_layouts([optimizer], self._module)
        self._offload_optimizers([optimizer])
        self._torch_optimizer = optimizer
        return optimizer

    def _accelerated(self, optimizer: Any) -> Any:
        from accelerate.optimizer import AcceleratedOptimizer

        return AcceleratedOptimizer(optimizer, device_placement=False, scaler=self._acc.scaler)

    def _autocast_forward(self, module: Any) -> None:
        """As Accelerate's prepare_model: the forward under the Accelerator's autocast, its outputs in fp32."""
        from types import MethodType

        from accelerate.utils import convert_outputs_to_fp32

        acc, forward = self._acc, convert_outputs_to_fp32(module.forward)

        def autocast_forward(_self: Any, *args: Any, **kwargs: Any) -> Any:
            with acc.autocast():
                return forward(*args, **kwargs)

        module.forward = MethodType(autocast_forward, module)

    def train_step(self, batch: Any, loss_fn: Any) -> Any:
        """``model.train_step(batch, loss_fn)`` (``step_call=True``): forward and backward of every micro-batch of
        the plan on the global ``batch`` (pp > 1: the pipeline schedule), gradients left reduced in ``.grad``;
        returns this rank's mean loss (``runtime.pipeline_step.PipelineSteps.loop_step``)."""
        scaler = self._acc.scaler

        def backward(loss: Any) -> None:
            (scaler.scale(loss) if scaler is not None else loss).backward()

        return self._pipeline_steps.loop_step(batch, loss_fn, self.plan.grad_accum, backward)

    def _single_process_group(self) -> None:
        """One process (``python script.py``, Accelerate's simple launcher) has no process group, and the plan's
        mesh needs one: a world of one on an in-memory store, as Lightning's strategies make it."""
        import torch.distributed as dist

        from lightning_autopar.topology import worker

        if self.world_size == 1 and not dist.is_initialized():
            backend = "cuda:nccl,cpu:gloo" if self.root_device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            worker.destroy_at_exit()

    def _hook_accelerator(self, module: Any) -> None:
        """``accelerator.clip_grad_norm_`` on this model's parameters clips over every mesh (``parallel.clip``, with
        the plan's norm parts); ``save_state`` / ``load_state`` save and load the model and optimizer sharded."""
        from lightning_autopar.parallel.clip import clip_grad_norm_

        acc, ours = self._acc, {id(p) for p in module.parameters()}
        accelerate_clip = acc.clip_grad_norm_

        def clip(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            params = list(parameters)
            if not params or any(id(p) not in ours for p in params):
                return accelerate_clip(params, max_norm, norm_type)
            acc.unscale_gradients(optimizer=self._optimizer)
            return clip_grad_norm_(params, max_norm, norm_type, parts=self._norm_parts())

        acc.clip_grad_norm_ = clip
        acc.register_save_state_pre_hook(lambda models, weights, folder: self.save(folder))
        acc.register_load_state_pre_hook(lambda models, folder: self.load(folder))

    def save(self, folder: str) -> None:
        """The model and optimizer under ``folder/autopar`` (torch.distributed.checkpoint, every rank)."""
        from pathlib import Path

        from lightning_autopar.strategy import save_sharded

        save_sharded(Path(folder) / "autopar", self._module, [self._torch_optimizer])

    def load(self, folder: str) -> None:
        from pathlib import Path

        from lightning_autopar.strategy import load_sharded

        load_sharded(Path(folder) / "autopar", self._module, [self._torch_optimizer])

    def prepare_loader(self, loader: Any) -> Any:
        """The user's DataLoader as Accelerate's ``DataLoaderShard`` over the plan's data-parallel ranks (not the
        world: tp / cp ranks of one data-parallel rank read the same rows), on the device."""
        from accelerate.data_loader import prepare_data_loader

        acc = self._acc
        config = acc.dataloader_config
        dp_rank, dp = self._step_env.group.rank_and_size()
        if self._step_call:  # model.train_step takes the whole global batch on every rank and slices it itself
            dp_rank, dp = 0, 1
        return prepare_data_loader(loader, acc.device, num_processes=dp, process_index=dp_rank,
                                   split_batches=acc.split_batches, put_on_device=acc.device_placement,
                                   rng_types=list(acc.rng_types), dispatch_batches=False,
                                   even_batches=acc.even_batches, use_seedable_sampler=config.use_seedable_sampler,
                                   data_seed=config.data_seed, non_blocking=config.non_blocking)
