"""``AutoParallelStrategy``: glue between Lightning's hooks and the planner / apply layer.

Flow: process group -> (setup) analyse the user's model, read the global batch and sequence length from the
training DataLoader -> plan -> DeviceMesh -> apply in the canonical order (``parallel.apply``: PP split -> TP/SP
-> EP -> BatchNorm sync -> recompute -> FSDP/DP -> precision) -> optimizers built on the sharded parameters.
Checkpoints go through torch.distributed.checkpoint (inherited from Lightning's ModelParallelStrategy), keyed by
the user's parameter names.

Any model: a model without a transformer stack (a CNN, a U-Net, Hugging Face ResNet) is analysed in unit form
(``profile.units``) from the user's own model call, captured on two rows of the first batch; it is planned on
data parallelism (zero 0-3, dp_shard, recompute per unit) and pipeline stages traced from that call where they
can be, the other fields at 1 with their reasons in the report; its BatchNorm layers compute statistics over the
dp group (``parallel.batchnorm``), as one device would.

Batch semantics: the DataLoader's batch is the global batch of one optimizer step, exactly as on one device.
Each step it is cut into ``dp`` contiguous slices (ranks of one TP/PP group get the same slice), each slice into
``grad_accum`` micro-batches; every micro-batch loss is weighted by its share of the global batch so the
summed gradient equals the single-device one. Values logged with ``self.log`` are averaged the same way.

Pipeline parallelism (pp > 1): the training step is the schedule (GPipe, 1F1B or interleaved 1F1B over the
``grad_accum`` micro-batches, ``parallel.pipeline``). The user's ``training_step`` is not rewritten: it runs up
to its model call on every rank (to get the model's inputs for each micro-batch) and, on the last stage, in full
with the model call returning the pipeline's output, so its own loss (and ``self.log``) code computes the loss.
Logged values are broadcast from the last stage; Lightning's backward then only runs its hooks (the schedule
did the backward; gradients are held until then so zero_grad cannot clear them). Validation, test and predict
run forward-only through the stages.

This module is the glue over the Trainer's hooks; the work is in ``runtime/``: the set-up stages (analyse ->
capabilities -> plan -> measure -> apply, ``runtime.setup`` and ``runtime.measure``, called by
``runtime.planning.PlanningMixin``, shared with the Fabric strategy), the micro-batch step (``runtime.step``),
the pipeline steps (``runtime.pipeline_step``), batch slicing, the log recorder and the gradient hold;
Lightning's private API only through ``runtime.lightning_private``. The hooks live in a mixin so the same
strategy is registered for ``lightning.pytorch`` and, when installed, ``pytorch_lightning`` (two packages with
separate class hierarchies).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from typing_extensions import override

from lightning_autopar.runtime import lightning_private as private
from lightning_autopar.runtime.analysis import STAGE_HOOKS, step_model_call
from lightning_autopar.runtime.batches import leading_size
from lightning_autopar.runtime.planning import RUNTIME_SUPPORT, PlanningMixin
from lightning_autopar.runtime.step import Accumulation, eval_step, training_step
from lightning_autopar.topology import worker

__all__ = ["RUNTIME_SUPPORT", "AutoParallelMixin", "AutoParallelStrategy", "register", "register_flavours"]


class AutoParallelMixin(PlanningMixin):
    """The Trainer strategy's hooks, independent of which Lightning package provides the base class.

    ``simulate=True`` (``simulate_ranks``: ``autopar simulate``'s ``--ranks``): plan the user's module for
    ``cluster`` at the Trainer's ``num_nodes`` x ``devices`` from this one process, simulate the plan's ranks there
    (``lightning_autopar.simulate``: the apply layer and one step on a fake process group, fake tensors), print
    the report (kept as ``strategy.simulation``) and train nothing: no processes are launched, no process group
    is made, the module is left as it was."""

    def __init__(self, *args: Any, simulate: bool = False, simulate_ranks: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if simulate and self._cluster_arg is None:
            from lightning_autopar.errors import ConfigError

            raise ConfigError("simulate", "simulate=True plans for a cluster this process is not on",
                              "pass cluster= (a preset such as 'a100-80g-dgx' or a YAML) with the Trainer's "
                              "num_nodes and devices")
        self._simulate = bool(simulate)
        self._simulate_ranks = simulate_ranks
        self.simulation: Any = None  # simulate.SimulationReport, with simulate=True

    # ------------------------------------------------------------------ environment and setup

    @override
    def _configure_launcher(self) -> None:
        if self._simulate:  # the simulated ranks live in this process
            self._launcher = None
            return
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        if self._simulate:
            return  # no process group: the simulation makes its own fake one
        # Process group only: the mesh depends on the plan, which needs the data (see setup()). Before it, this
        # process's CPU thread share and, under torchrun's shared store, keys of its own per restart attempt
        # (topology/worker.py: Lightning's ModelParallelStrategy does neither).
        self._worker_setup()
        self._setup_distributed()
        self._add_preemption()

    def _add_preemption(self) -> None:
        """A ``Preemption`` callback unless the trainer has one: SIGUSR1/SIGTERM stop every rank at one step
        boundary with one checkpoint and a non-zero exit (callbacks/preemption.py). Before the checkpoint
        callbacks, which Lightning keeps last."""
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import Checkpoint

        from lightning_autopar.callbacks.preemption import Preemption

        trainer = self.lightning_module.trainer
        if not isinstance(trainer, pl.Trainer) or any(isinstance(c, Preemption) for c in trainer.callbacks):
            return  # pytorch_lightning's Trainer takes its own package's callbacks
        at = next((i for i, c in enumerate(trainer.callbacks) if isinstance(c, Checkpoint)), len(trainer.callbacks))
        trainer.callbacks.insert(at, Preemption())

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Keep the user's sampler (and so its order); a RandomSampler becomes a seeded one-replica
        DistributedSampler so that all ranks draw the same permutation."""
        import os

        from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

        if isinstance(dataloader, DataLoader) and isinstance(dataloader.sampler, RandomSampler):
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            sampler = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
            return private.update_dataloader(dataloader, sampler)
        return dataloader

    def _simulate_plan(self, trainer: Any) -> None:
        """``simulate=True``: the user's module, at its first batch, planned for the cluster and simulated
        (``simulate.simulate``); the report printed on this process and the fit ended before its first step."""
        from lightning_autopar.parallel.precision import plan_precision
        from lightning_autopar.runtime.setup import analyse_model
        from lightning_autopar.simulate import meta_factory, simulate

        work = self._workload()
        analysed = analyse_model(work, self._model_call, self._global_batch_arg, self.world_size)
        self.simulation = simulate(meta_factory(self.lightning_module), self._cluster_spec(), analysed.global_batch,
                                   analysed.seq_len, fix=self._fix or None, ranks=self._simulate_ranks,
                                   precision=plan_precision(str(trainer.precision)),
                                   memory_fraction=self._memory_fraction, batch=work.first_batch,
                                   # a model analysed on token ids is not analysed again (unit form: per build,
                                   # from each copy's own call)
                                   analysed=None if analysed.example is not None else (
                                       self.lightning_module, analysed.model, analysed.analysis))
        if self._print_plan:
            self.simulation.print_table()
        # nothing trains: the fit loop ends before its first step (Trainer.should_stop, public), and the sanity
        # check's validation batches are not run either
        trainer.should_stop = True
        trainer.num_sanity_val_steps = 0

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        if self._simulate:
            self.accelerator.setup(trainer)
            self._simulate_plan(trainer)
            return
        self.accelerator.setup(trainer)
        private.disable_distributed_sampler(trainer)  # we slice global batches instead
        if self._applied is None or self._applied_to is not self.lightning_module:
            # once per module: trainer.validate / test / predict after fit (or a second fit) keep the plan
            # already applied to it, so a model is never parallelised twice
            private.materialize_distributed_module(self.model, self.root_device)
            self._plan_and_apply(trainer.precision)
            self._applied_to = self.lightning_module
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == "fit"
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._patch_precision_plugin()
        if fitting:
            private.optimizers_to_device(self.optimizers, self.root_device)
            self._keep_optimizer_layouts(self.optimizers, self.model)
            self._offload_optimizers(self.optimizers)

    @override
    def model_to_device(self) -> None:
        """As Lightning's, but with plan.offload=params the parameters stay on the host (``parallel.offload``)."""
        from lightning_autopar.parallel.offload import module_to_device

        module_to_device(self.model, self.root_device, self.plan.offload if self.plan is not None else "none")

    def _patch_precision_plugin(self) -> None:
        """Clip gradients across meshes, and use a rank-agreeing scaler for fp16."""
        from lightning_autopar.parallel.clip import clip_grad_norm_
        from lightning_autopar.parallel.precision import ShardedGradScaler

        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            clip_grad_norm_(params, clip_val, parts=self._norm_parts())

        plugin.clip_grad_by_norm = clip_grad_by_norm
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            plugin.scaler = ShardedGradScaler(device=self.root_device.type)

    # ------------------------------------------------------------------ what the planning reads from the Trainer

    def _stage(self) -> str:
        fn = self.lightning_module.trainer.state.fn
        return str(getattr(fn, "value", fn))

    def _plan_loader(self) -> Any:
        """The DataLoader whose batches the plan is for: the training one when fitting, else the one of the stage
        being run (validate / test / predict without fit: its batch is the global batch)."""
        trainer = self.lightning_module.trainer
        loop = {"fit": trainer.fit_loop, "validate": trainer.validate_loop, "test": trainer.test_loop,
                "predict": trainer.predict_loop}.get(self._stage())
        if loop is None:
            return None
        loader = private.stage_dataloader(loop)
        return loader[0] if isinstance(loader, (list, tuple)) and loader else loader

    def _planned_steps(self) -> int | None:
        """Optimizer steps of the planned fit (0 when not fitting), for the set-up budget: max_steps, or max_epochs
        x the epoch's batches (limit_train_batches) / accumulate_grad_batches, whichever is smaller; None when
        neither is known (an unsized DataLoader and no max_steps)."""
        import math

        if self._stage() != "fit":
            return 0
        trainer = self.lightning_module.trainer
        steps = [trainer.max_steps] if trainer.max_steps and trainer.max_steps > 0 else []
        loader = self._plan_loader()
        try:
            batches = len(loader)
        except TypeError:  # no loader, or an unsized one (an IterableDataset without __len__)
            batches = 0
        limit = trainer.limit_train_batches
        batches = min(batches, limit) if isinstance(limit, int) else int(batches * (limit or 1.0))
        if batches and trainer.max_epochs and trainer.max_epochs > 0:
            steps.append(trainer.max_epochs * math.ceil(batches / trainer.accumulate_grad_batches))
        return min(steps) if steps else None

    def _model_call(self) -> Any:
        """The user's call of its model: the step of the stage being run on two rows of the first batch."""
        hook = STAGE_HOOKS.get(self._stage(), "training_step")
        return step_model_call(self.lightning_module, self._first_batch(), hook)

    def _train_context(self) -> AbstractContextManager[Any]:
        return self.precision_plugin.train_step_context()

    def _eval_context(self) -> AbstractContextManager[Any]:
        return self.precision_plugin.val_step_context()

    def _loss_scaler(self) -> Any:
        return getattr(self.precision_plugin, "scaler", None)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        worker.note_doing(f"training step {self.lightning_module.trainer.global_step + 1}")  # the heartbeat's word

    @override
    def on_exception(self, exception: BaseException) -> None:
        # a collective that lost its peer: one line naming it, now (teardown and the excepthook could wait on it)
        if worker.looks_collective(exception):
            worker.stop_for_peer(exception)

    @override
    def teardown(self) -> None:
        worker.stop_heartbeat()  # joined, not left in a store call at exit (worker.start_heartbeat says why)
        super().teardown()

    # ------------------------------------------------------------------ the step (runtime.step, runtime.pipeline_step)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        from lightning_autopar.callbacks.accumulation import lightning_accumulation

        assert self.plan is not None and self._step_env is not None
        batch, rest = args[0], args[1:]
        self._check_batch(batch)
        if self._pipeline_steps.pipe is not None:
            return self._pipeline_steps.train(batch, rest, kwargs, self.plan.grad_accum)
        module = self.lightning_module
        automatic = module.automatic_optimization
        # Lightning's accumulate_grad_batches around the plan's micro-batches (callbacks/accumulation.py)
        k, stepping = lightning_accumulation(module.trainer) if automatic else (1, True)
        acc = Accumulation(self.plan.grad_accum, automatic, k, stepping)
        return training_step(self._step_env, batch, rest, kwargs, acc, lambda loss: self.backward(loss, None))

    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        batch, rest = args[0], args[1:]
        if leading_size(batch) is None or self.plan is None:
            return getattr(self.lightning_module, hook)(*args, **kwargs)
        if self._pipeline_steps.pipe is not None:
            return self._pipeline_steps.evaluate(hook, batch, rest, kwargs)
        return eval_step(self._step_env, hook, batch, rest, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline_steps is not None and self._pipeline_steps.pipe is not None:
            # forward-only through the stages; the predictions are on the last
            return self._pipeline_steps.evaluate("predict_step", args[0], args[1:], kwargs)
        return super().predict_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The earlier micro-batches' gradients go back into ``.grad`` before the last micro-batch's backward
        (which DDP then reduces with them). With pipeline parallelism the schedule already ran backward in
        training_step: Lightning's hooks run, autograd does not; its gradients are put in place."""
        from lightning_autopar.runtime.grads import restore_gradients

        hold = self._step_env.hold if self._step_env is not None else None
        grads = None
        if hold is not None:
            hold.put_back_held()
            grads = hold.take_pipeline()
        if grads is None:
            if hold is not None and not self.lightning_module.automatic_optimization:
                # manual_backward: the micro-batch's share of the global batch (0 for a stand-in), as the
                # automatic step weights its loss (runtime.step)
                closure_loss = closure_loss * self._step_env.manual_weight
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        restore_gradients(grads)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------ checkpoints
    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Sharded checkpoints store the optimizer state flattened: every entry (states and param-group
        settings) keyed by parameter name, so ranks holding different parameters (pipeline stages, expert
        ranks) write disjoint keys, and a checkpoint reshards across plans."""
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from lightning_autopar.parallel.tp_placement import plain_shards

        optimizer = private.unwrap_optimizer(optimizer)
        options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
        return plain_shards(get_optimizer_state_dict(self.model, optimizer, options=options))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state as Lightning saves it; TP-fused projections (strided shards, which DCP cannot write)
        as plain shards of the same global tensors (``parallel.tp_placement.plain_shards``)."""
        from lightning_autopar.parallel.tp_placement import plain_shards

        state = super().lightning_module_state_dict()
        return plain_shards(state) if self._save_distributed_checkpoint else state

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint (model, flattened optimizer states, metadata) into this rank's parameters."""
        from pathlib import Path

        path = Path(self.broadcast(checkpoint_path))
        if not private.is_sharded_checkpoint(path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        load_sharded(path, self.model, self.optimizers, strict=self.lightning_module.strict_loading,
                     keys=("state_dict", "optimizer_{}"))
        return torch.load(path / private.metadata_filename(), weights_only=weights_only)


def _sharded_state(model: Any, optimizers: list[Any], keys: tuple[str, str]) -> tuple[dict[str, Any], Any]:
    """The model's and optimizers' state dicts (optimizer states flattened, keyed by parameter name) under ``keys``
    (the model's, the optimizers' with ``{}`` for the index), and the options they were read with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {keys[0]: get_model_state_dict(model)}
    for i, optimizer in enumerate(optimizers):
        state[keys[1].format(i)] = get_optimizer_state_dict(model, optimizer, options=options)
    return state, options


def save_sharded(path: Any, model: Any, optimizers: list[Any], keys: tuple[str, str] = ("model", "optimizer_{}")) -> None:
    """``model`` and ``optimizers`` saved with torch.distributed.checkpoint (every rank), in single-device names
    (TP-fused projections as plain shards), so the state loads at any plan (``load_sharded``)."""
    import torch.distributed.checkpoint as dcp

    from lightning_autopar.parallel.tp_placement import plain_shards

    dcp.save(plain_shards(_sharded_state(model, optimizers, keys)[0]), checkpoint_id=path)


def load_sharded(path: Any, model: Any, optimizers: list[Any], strict: bool = True,
                 keys: tuple[str, str] = ("model", "optimizer_{}")) -> None:
    """Load a sharded checkpoint (the model, flattened optimizer states) into this rank's parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from lightning_autopar.parallel.tp_placement import plain_shards, restore_layout

    state, options = _sharded_state(model, optimizers, keys)
    plain = plain_shards(state)  # DCP reads plain shards; then back to the model's own (strided) layout
    dcp.load(plain, checkpoint_id=path)
    state = restore_layout(plain, like=state)
    model.load_state_dict(state[keys[0]], strict=strict)
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state[keys[1].format(i)], options=options)


def _make_strategy_class(base: type, module_name: str) -> type:
    return type("AutoParallelStrategy", (AutoParallelMixin, base),
                {"__module__": module_name, "__doc__": AutoParallelMixin.__doc__})


from lightning.pytorch.strategies import ModelParallelStrategy as _PLModelParallel  # noqa: E402


class AutoParallelStrategy(AutoParallelMixin, _PLModelParallel):
    """Lightning strategy that plans and applies DP / FSDP / TP automatically (``strategy="autopar"``)."""


def register_flavours(registry: Any, cls: type, twin: str, twin_registry: str, make: Callable[[Any], type],
                      alias: str, namespace: dict[str, Any]) -> None:
    """Register ``cls`` as "autopar" in ``registry`` and, when the standalone twin package ``twin`` (e.g.
    ``pytorch_lightning.strategies``) is installed, ``make(twin module)`` in its ``twin_registry``, kept in
    ``namespace`` as ``alias`` (idempotent)."""
    import importlib

    if "autopar" not in registry:
        cls.register_strategies(registry)
    try:
        module = importlib.import_module(twin)
    except ImportError:
        return
    if "autopar" not in getattr(module, twin_registry):
        namespace[alias] = make(module)
        namespace[alias].register_strategies(getattr(module, twin_registry))


def register() -> None:
    """Register "autopar" in lightning.pytorch's and (when installed) pytorch_lightning's registries."""
    from lightning.pytorch.strategies import StrategyRegistry

    register_flavours(StrategyRegistry, AutoParallelStrategy, "pytorch_lightning.strategies", "StrategyRegistry",
                      lambda m: _make_strategy_class(m.ModelParallelStrategy, __name__), "PLAutoParallelStrategy",
                      globals())
