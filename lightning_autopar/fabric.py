"""The autopar strategy for Lightning Fabric: ``Fabric(strategy="autopar")``.

The same set-up stages as the Trainer strategy (``runtime.setup``, called by ``runtime.planning.PlanningMixin``,
over Fabric's ``ModelParallelStrategy`` instead of the Trainer's), so a plan means the same thing in both::

    fabric = Fabric(strategy="autopar", accelerator="cpu", devices=4)   # or AutoParallelFabricStrategy(fix="tp=2")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)                   # plans the layout and applies it
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=16))  # 16 = the global batch of one step
    for x, y in loader:                                                 # this rank's rows of each global batch
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step(); optimizer.zero_grad()

Where the plan's inputs come from:

* **global batch**: the ``global_batch=`` argument of the strategy, else the batch size of the training
  DataLoader passed to ``fabric.setup_dataloaders`` (the first one), in either order. Fabric's docs set up the
  model first (``model, optimizer = fabric.setup(model, optimizer)``, then ``setup_dataloaders``). Then
  ``fabric.setup`` plans the layout (dp, tp, zero, recompute, precision) for an assumed global batch of one
  sequence per device, at the model's own sequence length, and the first loader settles the fields that depend
  on the batch (``mbs``; ``grad_accum`` stays 1) within that layout: it re-prices the plan with the real batch
  and sequence length (``strategy.report.best``). A batch that does not split evenly over the layout's ``dp``
  ranks, or that the layout cannot hold in memory, stops with one line naming the largest batch that fits.
  Loader first, or ``global_batch=``, plans the layout for the real batch. The sequence length is read from
  the loader's first batch.
* **the batch**: as with the Trainer, a DataLoader batch is the global batch of one optimizer step (as on one
  device). The loader returned by ``setup_dataloaders`` yields this rank's contiguous slice of it (ranks of one
  tensor-parallel group get the same slice). Slices are equal (a batch that does not split evenly over ``dp``,
  such as a short last batch without ``drop_last=True``, is refused in one line), so the averaged gradient is
  the single-device one.
* **accumulation**: the user's loop calls backward, so the plan has one micro-batch per step
  (``grad_accum=1``) and no pipeline (``pp=1``); accumulate across steps with ``fabric.no_backward_sync``.
* **the step call** (``AutoParallelFabricStrategy(step_call=True)``): the loop calls
  ``loss = model.train_step(batch, loss_fn)`` on the global batch (the loader is not sliced), which runs every
  micro-batch's forward and backward (pp > 1: the pipeline schedule) and leaves the reduced gradients in
  ``.grad``; the planner then offers pp and grad_accum (docs/launching.md "Pipelines in loops you own").
* **the optimizer**: pass it to ``fabric.setup(model, optimizer)`` as usual; sharding replaces the parameters
  (DTensors), so its parameter groups (and any state) are re-pointed to the new ones by parameter name.
* **the model** needs no ``configure_model``; the analysis finds the transformer as for the Trainer. Any other
  model (a CNN, a U-Net: the unit form) is analysed by tracing it on the first tensor of the loader's first batch
  (one row, on meta tensors), taken as the model's input -- so set up the loader first
  (``fabric.setup_dataloaders`` before ``fabric.setup``); without one the setup stops with one line saying so.

``fabric run`` (the CLI) accepts only the strategies of its fixed ``--strategy`` list, so leave ``--strategy``
out and name the strategy in the code: ``fabric run examples/fabric_gpt.py --accelerator cpu --devices 4``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from contextlib import AbstractContextManager
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_autopar.errors import ConfigError
from lightning_autopar.runtime import lightning_private as private
from lightning_autopar.runtime.batches import last_batch_rows, leading_size, micro_batches, tree_leaves
from lightning_autopar.runtime.planning import PlanningMixin
from lightning_autopar.specs import Plan, PricedPlan
from lightning_autopar.strategy import register_flavours


def _unused_parallelize(module: nn.Module, mesh: Any) -> nn.Module:  # Fabric's parallelize_fn: setup_module plans
    return module


class _InjectParallelizeFn:
    """Sits between the mixin and Fabric's ModelParallelStrategy in the MRO to supply ``parallelize_fn``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(_unused_parallelize, **kwargs)  # type: ignore[call-arg]


class _GlobalBatchSlices:
    """The user's DataLoader (one global batch per step) yielding this rank's data-parallel rows of each batch."""

    def __init__(self, loader: Any, strategy: FabricAutoParallelMixin) -> None:
        self.loader = loader
        self.strategy = strategy
        for name in ("dataset", "batch_size", "sampler", "batch_sampler", "drop_last", "num_workers"):
            setattr(self, name, getattr(loader, name, None))

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.strategy.plan is None:
                raise ConfigError("fabric.setup", "the data was iterated before the model was set up, so there is "
                                  "no plan to slice the batch with", "call fabric.setup(model, ...) first")
            check_even_rows(leading_size(batch), self.strategy.plan.dp)  # sized loaders: checked at set-up
            yield micro_batches(batch, 1, *self.strategy._step_env.group.rank_and_size())[0].batch


def first_tensor_call(module: nn.Module, first: Any, where: str, fix: str) -> Any:
    """The call a model in unit form is traced on: the model itself, on one row of the first tensor of the
    loader's first batch (the user's loop calls ``model(x)``; Fabric and Accelerate have no training_step to
    capture). Without such a batch, one ConfigError line naming ``where`` and ``fix``."""
    from lightning_autopar.profile.units import ModelCall

    x = next((t for t in tree_leaves(first) if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
    if x is None:
        raise ConfigError(where, f"{type(module).__name__} has no transformer blocks, so it is analysed by tracing "
                          "it on a batch, and no DataLoader with tensors was set up before it", fix)
    return ModelCall("", module, (x[:1],), {})


def check_even_rows(rows: int | None, dp: int) -> None:
    """One ConfigError line when a batch of ``rows`` does not split evenly over ``dp`` ranks: the user's loop
    averages its own slice's loss, so unequal slices would weight the ranks unequally (not the single-device
    gradient)."""
    if rows is not None and rows % dp:
        raise ConfigError("DataLoader.drop_last", f"a batch of {rows} rows does not split evenly over the {dp} "
                          "data-parallel ranks", f"use drop_last=True and a batch size divisible by {dp}")


class _NoBackwardSync:
    """``fabric.no_backward_sync(model)``: Fabric's own only reaches FSDP2 modules; plain data parallelism runs
    on ``replicate`` (DDP) modules (``parallel.fsdp.apply_replicate``), which take the same switch."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
        from lightning_autopar.parallel.fsdp import gradient_sync_off

        return gradient_sync_off(module, enabled)


class FabricAutoParallelMixin(PlanningMixin):
    """Fabric's side of the strategy: setup_module plans and applies; the data is sliced per dp rank."""

    def __init__(self, *args: Any, step_call: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._step_call = step_call  # the loop calls model.train_step(batch, loss_fn): pp, grad_accum offered
        self._autopar_module: nn.Module | None = None
        self._loader: Any = None
        self._batch_assumed = False  # planned at fabric.setup before any DataLoader: mbs not yet settled
        self._backward_sync_control = _NoBackwardSync()

    @property
    @override
    def lightning_module(self) -> nn.Module | None:  # what the shared planning code analyses
        return self._autopar_module

    def _automatic_optimization(self) -> bool:
        # a loop calling backward: one micro-batch per step, no pipeline schedule; with step_call, the loop calls
        # model.train_step and the step runs every micro-batch's forward and backward (the pipeline's schedule)
        return self._step_call

    def _plan_loader(self) -> Any:
        return self._loader

    def _train_context(self) -> AbstractContextManager[Any]:
        return self.precision.forward_context()

    def _eval_context(self) -> AbstractContextManager[Any]:
        return self.precision.forward_context()

    def _loss_scaler(self) -> Any:
        return getattr(self.precision, "scaler", None)

    def _model_call(self) -> Any:
        """The call a model in unit form is traced on (``first_tensor_call``)."""
        return first_tensor_call(self._autopar_module, self._first_batch(), "fabric.setup",
                                 "call fabric.setup_dataloaders(...) before fabric.setup(model, ...)")

    @override
    def setup_environment(self) -> None:
        # Fabric's base: set the device, then the process group; the mesh waits for the plan (setup_module).
        # _worker_setup: this process's CPU thread share, and per-attempt keys under torchrun's shared store
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        self._worker_setup()
        self._setup_distributed()

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        if self._loader is None:
            self._loader = dataloader
            if self.plan is not None and self._batch_assumed:  # fabric.setup came first: settle the batch now
                self._settle_batch()
        if self._step_call:  # model.train_step takes the global batch and slices it itself
            return dataloader
        if self.plan is not None:  # the last batch fails here, not mid-epoch
            check_even_rows(last_batch_rows(dataloader), self.plan.dp)
        return _GlobalBatchSlices(dataloader, self)

    def _settle_batch(self) -> None:
        """The first DataLoader after ``fabric.setup``: re-price the applied layout for its global batch and
        sequence length (``settle_global_batch``); the plan and ``report.best`` become that priced plan."""
        global_batch, seq_len = self._batch_geometry(self.report.seq_len)
        priced = settle_global_batch(self.report, self.plan, global_batch, seq_len)
        self.plan, self.report.best, self._global_batch = priced.plan, priced, global_batch
        self.report.global_batch, self.report.seq_len = global_batch, seq_len
        self._batch_assumed = False
        if self.global_rank == 0 and self._print_plan:
            print(f"autopar: global batch {global_batch}, seq {seq_len} from the DataLoader: {priced.plan.short()} "
                  f"(layout planned at fabric.setup), predicted {priced.step_time_s:.4g} s/step, "
                  f"{priced.memory_gib_per_device:.3g} GiB per device", flush=True)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        from lightning_autopar.parallel.offload import module_to_device
        from lightning_autopar.parallel.precision import ShardedGradScaler

        if self.plan is not None:
            raise ConfigError("fabric.setup", "the autopar strategy plans one model per Fabric",
                              "set up one model (wrap several in one nn.Module)")
        # Fabric's documented order sets the model up first: plan the layout for an assumed batch (_batch_geometry:
        # one sequence per device) and settle the batch-dependent fields when the loader comes (_settle_batch)
        self._batch_assumed = self._global_batch_arg is None and self._loader is None
        if self._batch_assumed and self._step_call:
            raise ConfigError("fabric.setup", "with step_call=True the plan (pp, grad_accum) is for the loader's global "
                              "batch, and no DataLoader was set up before the model",
                              "call fabric.setup_dataloaders(...) before fabric.setup(model, ...), or pass global_batch=")
        self._autopar_module = module
        private.materialize_distributed_module(module, self.root_device)
        self._plan_and_apply(self.precision.precision)
        check_even_rows(last_batch_rows(self._loader), self.plan.dp)  # the last batch fails here, not mid-epoch
        module_to_device(module, self.root_device, self.plan.offload)  # offload=params: parameters stay on the host
        if self._step_call:
            module.train_step = lambda batch, loss_fn: self._pipeline_steps.loop_step(
                batch, loss_fn, self.plan.grad_accum, lambda loss: self.backward(loss, module))
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            self.precision.scaler = ShardedGradScaler(device=self.root_device.type)
        return module

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[nn.Module, list[Optimizer], Any]:
        names = {id(p): name for name, p in module.named_parameters()}
        module = self.setup_module(module)
        for optimizer in optimizers:
            rebind_optimizer(optimizer, names, dict(module.named_parameters()))
        optimizers = [self.setup_optimizer(o) for o in optimizers]
        self._keep_optimizer_layouts(optimizers, module)
        self._offload_optimizers(optimizers)
        return module, optimizers, scheduler

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Any] | None = None) -> None:
        # every plan's model saves through torch.distributed.checkpoint, also zero=0 (no DTensor parameters)
        with private.distributed_models([self._autopar_module]):
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        with private.distributed_models([self._autopar_module]):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float | int,
                            norm_type: float | int = 2.0, error_if_nonfinite: bool = True) -> Any:
        from lightning_autopar.parallel.clip import clip_grad_norm_

        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        return clip_grad_norm_(params, max_norm, norm_type, parts=self._norm_parts())


def settle_global_batch(report: Any, plan: Plan, global_batch: int, seq_len: int) -> PricedPlan:
    """``plan`` (a layout applied for an assumed batch) re-priced for the real ``global_batch`` and ``seq_len``:
    ``mbs = global_batch / dp``, ``grad_accum = 1`` (the user's loop runs backward once per step). Raises one
    ConfigError when the batch does not split evenly over ``dp`` or the layout cannot hold it in memory; the
    message names the largest batch that fits."""
    dp = plan.dp
    hint = "or call fabric.setup_dataloaders before fabric.setup (or pass global_batch=N) to plan for this batch"
    if global_batch < dp or global_batch % dp:
        raise ConfigError("DataLoader.batch_size", f"a global batch of {global_batch} rows does not split evenly "
                          f"over the dp={dp} data-parallel ranks of the layout planned at fabric.setup",
                          f"use a multiple of {dp}, {hint}")
    priced = _price_rows(report, plan, global_batch // dp, seq_len)
    if priced.feasible:
        return priced
    fits = next((m for m in range(global_batch // dp - 1, 0, -1) if _price_rows(report, plan, m, seq_len).feasible),
                0)
    limit = report.cluster.device.memory_gib * report.memory_fraction
    largest = f"at most {fits * dp}" if fits else "none"
    raise ConfigError("DataLoader.batch_size", f"a global batch of {global_batch} (seq {seq_len}) needs "
                      f"{priced.memory_gib_per_device:.3g} GiB per device with the layout planned at fabric.setup "
                      f"({plan.short()}); {limit:.3g} GiB allow {largest}",
                      f"use a smaller batch and accumulate with fabric.no_backward_sync, {hint}")


def _price_rows(report: Any, plan: Plan, mbs: int, seq_len: int) -> PricedPlan:
    """``plan`` with ``mbs`` rows per data-parallel rank and one micro-batch per step, priced as the report's."""
    from lightning_autopar.planner.search import estimate

    wanted = dataclasses.replace(plan, mbs=mbs, grad_accum=1)
    return estimate(report.model, report.cluster, wanted, global_batch=wanted.global_batch, seq_len=seq_len,
                    memory_fraction=report.memory_fraction)


def rebind_optimizer(optimizer: Optimizer, names: dict[int, str], params: dict[str, nn.Parameter]) -> None:
    """Point ``optimizer`` at the parameters that replaced the originals (same names); parameters this rank no
    longer holds (other pipeline stages, remote experts) are dropped, and any state follows its parameter."""
    mapping = {old: params[name] for old, name in names.items() if name in params}
    for group in optimizer.param_groups:
        group["params"] = [mapping[id(p)] for p in group["params"] if id(p) in mapping]
    state = defaultdict(dict)
    for p, value in optimizer.state.items():
        if id(p) in mapping:
            state[mapping[id(p)]] = value
    optimizer.state = state


def _strategy_class(base: type, module_name: str) -> type:
    return type("AutoParallelFabricStrategy", (FabricAutoParallelMixin, _InjectParallelizeFn, base),
                {"__module__": module_name, "__doc__": __doc__})


from lightning.fabric.strategies import ModelParallelStrategy as _FabricModelParallel  # noqa: E402

AutoParallelFabricStrategy = _strategy_class(_FabricModelParallel, __name__)


def register() -> None:
    """Register "autopar" in lightning.fabric's and (when installed) lightning_fabric's STRATEGY_REGISTRY."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    register_flavours(STRATEGY_REGISTRY, AutoParallelFabricStrategy, "lightning_fabric.strategies",
                      "STRATEGY_REGISTRY", lambda m: _strategy_class(m.ModelParallelStrategy, __name__),
                      "LFAutoParallelFabricStrategy", globals())
