"""``AutoParallelStrategy``: glue between Lightning's hooks and the planner / apply layer.

Flow: process group -> (setup) analyse the user's model, read the global batch and sequence length from the
training DataLoader -> plan -> DeviceMesh -> apply in the canonical order (``parallel.apply``: PP split -> TP/SP
-> EP -> recompute -> FSDP/DP -> precision) -> optimizers built on the sharded parameters. Checkpoints go through torch.distributed.checkpoint (inherited from Lightning's
ModelParallelStrategy), keyed by the user's parameter names.

Any model: a model without a transformer stack (a CNN, a U-Net, Hugging Face ResNet) is analysed in unit form
(``profile.units``) from the user's own model call, captured on one row of the first batch; it is planned on
data parallelism (zero 0-3, dp_shard, recompute per unit), the other fields at 1 with their reasons in the report,
and its BatchNorm layers compute statistics over the dp group (``parallel.batchnorm``), as one device would.

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

The logic lives in a mixin so the same strategy is registered for ``lightning.pytorch`` and, when installed,
``pytorch_lightning`` (two packages with separate class hierarchies).
"""

from __future__ import annotations

import logging
import time
import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from lightning_autopar.errors import ConfigError, install_excepthook
from lightning_autopar.specs import ClusterSpec, Plan, parse_fix

log = logging.getLogger(__name__)

# What the runtime can apply today; the planner searches only inside it unless the user fixes a field.
# pp and ep are further restricted per model in _restrictions (a splittable stack of blocks; MoE layers).
RUNTIME_SUPPORT: dict[str, list[Any]] = {"cp": [1], "sp": [False], "schedule": ["gpipe", "1f1b", "interleaved"],
                                         "recompute": ["none", "selective", "full"]}


def _tree_leaves(obj: Any) -> list[Any]:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(obj)


def _leading_size(batch: Any) -> int | None:
    for leaf in _tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def _slice_batch(batch: Any, start: int, stop: int, size: int) -> Any:
    """Rows [start, stop) of every tensor leaf whose leading dim is the batch size; other leaves as they are."""
    from torch.utils._pytree import tree_map

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == size:
            return leaf[start:stop]
        if isinstance(leaf, (list, tuple)) and len(leaf) == size and not isinstance(leaf, torch.Size):
            return type(leaf)(leaf[start:stop])
        return leaf

    return tree_map(cut, batch)


def split_rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` when ``total`` rows are split into ``parts`` contiguous near-equal parts."""
    base, rem = divmod(total, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


class _LogRecorder:
    """Stands in for ``LightningModule.log`` during the micro-batch loop: values are weighted by each
    micro-batch's share of the global batch, then summed over the data-parallel group and logged once."""

    def __init__(self) -> None:
        self.weight = 1.0
        self.values: dict[str, list[Any]] = {}  # name -> [weighted sum or last value, kwargs, aggregatable]

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:  # positional prog_bar, logger, ... as in LightningModule.log
            keys = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph", "sync_dist")
            kwargs.update(zip(keys, args))
        numeric = isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                                        and value.is_floating_point())
        if numeric:
            contribution = torch.as_tensor(value, dtype=torch.float64).detach().cpu() * self.weight
            entry = self.values.setdefault(name, [torch.zeros((), dtype=torch.float64), kwargs, True])
            entry[0] = entry[0] + contribution
            entry[1] = kwargs
        else:
            self.values[name] = [value, kwargs, False]

    def flush(self, module: Any, reduce: Callable[[torch.Tensor], torch.Tensor], batch_size: int) -> None:
        names = [n for n, (_, _, agg) in self.values.items() if agg]
        if names:
            summed = reduce(torch.stack([self.values[n][0] for n in names]).float())
            for name, value in zip(names, summed):
                self.values[name][0] = value
        for name, (value, kwargs, agg) in self.values.items():
            kwargs = dict(kwargs)
            if agg:
                kwargs["sync_dist"] = False  # already the global mean
                kwargs.setdefault("batch_size", batch_size)
            module.log(name, value, **kwargs)
        self.values.clear()


class AutoParallelMixin:
    """The strategy's logic, independent of which Lightning package provides the base class."""

    strategy_name = "autopar"

    def __init__(
        self,
        fix: str | Mapping[str, Any] | None = None,
        cluster: str | Mapping[str, Any] | ClusterSpec | None = None,
        global_batch: int | None = None,
        restrict: Mapping[str, list[Any]] | None = None,
        top: int = 5,
        print_plan: bool = True,
        memory_fraction: float = 0.9,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        save_distributed_checkpoint: bool = True,
        moe_capacity_factor: float | None = None,
    ) -> None:
        from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

        install_excepthook()
        super().__init__(
            data_parallel_size=1,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout or default_pg_timeout,
        )
        self._fix = parse_fix(fix)  # bad keys and values fail here, before any process starts
        self._cluster_arg = cluster
        self._global_batch_arg = global_batch
        self._restrict = dict(restrict or {})
        self._top = top
        self._print_plan = print_plan
        self._memory_fraction = memory_fraction
        self.plan: Plan | None = None
        self.report: Any = None
        self.mesh_layout: Any = None
        self.analysis: Any = None
        self.excluded: dict[str, str] = {}  # plan field -> why the runtime cannot apply its other values here
        self._fsdp_roots: list[nn.Module] = []
        self._global_batch = 0
        self._capacity_factor = moe_capacity_factor  # None: no token dropped (parallel.experts)
        self._applied: Any = None
        self._applied_to: Any = None  # the LightningModule the plan was applied to
        self._pipeline: Any = None  # parallel.pipeline.Pipeline when pp > 1
        self._pipeline_grads: dict[Any, Any] | None = None  # the schedule's gradients, until backward()
        self._held_grads: dict[Any, Any] = {}  # earlier micro-batches' gradients, until the last one's backward
        self._first_of: tuple[Any, Any] | None = None  # (plan DataLoader, its first batch)

    # ------------------------------------------------------------------ environment and setup

    def setup_environment(self) -> None:
        # Process group only: the mesh depends on the plan, which needs the data (see setup()). Before it, this
        # process's CPU thread share and, under torchrun's shared store, keys of its own per restart attempt
        # (topology/worker.py: Lightning's ModelParallelStrategy does neither).
        self._worker_setup()
        self._setup_distributed()

    def _worker_setup(self) -> None:
        from lightning_autopar.topology import worker

        assert self.accelerator is not None
        worker.share_cpu_threads(self.num_processes)
        worker.destroy_at_exit()  # whichever path creates the group below (worker.destroy_at_exit says why)
        if worker.uses_shared_agent_store():
            self.accelerator.setup_device(self.root_device)
            device_id = self.root_device if self.root_device.type != "cpu" else None
            worker.init_process_group(self._get_process_group_backend(), self._timeout, device_id=device_id)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank reads the whole global batch and takes its slice in training_step.
        return {"num_replicas": 1, "rank": 0}

    def process_dataloader(self, dataloader: Any) -> Any:
        """Keep the user's sampler (and so its order); a RandomSampler becomes a seeded one-replica
        DistributedSampler so that all ranks draw the same permutation."""
        import os

        from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

        if isinstance(dataloader, DataLoader) and isinstance(dataloader.sampler, RandomSampler):
            from lightning.pytorch.utilities.data import _update_dataloader

            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            sampler = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
            return _update_dataloader(dataloader, sampler)
        return dataloader

    def setup(self, trainer: Any) -> None:
        from lightning.fabric.utilities.init import _materialize_distributed_module
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        # Lightning would shard (and always shuffle) the training data per rank; we slice global batches instead.
        trainer._accelerator_connector.use_distributed_sampler = False
        if self._applied is None or self._applied_to is not self.lightning_module:
            # once per module: trainer.validate / test / predict after fit (or a second fit) keep the plan
            # already applied to it, so a model is never parallelised twice
            _materialize_distributed_module(self.model, self.root_device)
            self._plan_and_apply(trainer)
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
            _optimizers_to_device(self.optimizers, self.root_device)
            self._keep_optimizer_layouts(self.optimizers, self.model)

    @staticmethod
    def _keep_optimizer_layouts(optimizers: list[Any], model: nn.Module) -> None:
        """Optimizer states of TP weights stored in another row order show the single-device order in state dicts
        (``parallel.tensor.keep_optimizer_row_order``), so optimizer checkpoints reshard across plans."""
        from lightning_autopar.parallel.tensor import keep_optimizer_row_order

        for optimizer in optimizers:
            keep_optimizer_row_order(getattr(optimizer, "_optimizer", optimizer), model)

    def _cluster_spec(self) -> ClusterSpec:
        from lightning_autopar.specs import load_cluster_spec

        if self._cluster_arg is not None:
            return load_cluster_spec(self._cluster_arg, nodes=self.num_nodes, devices_per_node=self.num_processes)
        from lightning_autopar.topology import discover

        return discover.discover_cluster()

    def _plan_loader(self, trainer: Any) -> Any:
        """The DataLoader whose batches the plan is for: the training one when fitting, else the one of the stage
        being run (validate / test / predict without fit: its batch is the global batch); the Fabric strategy
        returns the one it was given."""
        loop = {"fit": trainer.fit_loop, "validate": trainer.validate_loop, "test": trainer.test_loop,
                "predict": trainer.predict_loop}.get(str(getattr(trainer.state.fn, "value", trainer.state.fn)))
        if loop is None:
            return None
        loader = loop._data_source.dataloader()
        return loader[0] if isinstance(loader, (list, tuple)) and loader else loader

    def _automatic_optimization(self) -> bool:
        """Whether the strategy runs the micro-batches' backward itself (Fabric: no, the user's loop does)."""
        return bool(getattr(self.lightning_module, "automatic_optimization", True))

    def _first_batch(self, trainer: Any) -> Any:
        """The first batch of the plan's DataLoader (None without one); read once per loader."""
        loader = self._plan_loader(trainer)
        if loader is None:
            return None
        cached = self._first_of
        if cached is not None and cached[0] is loader:
            return cached[1]
        try:
            first = next(iter(loader))
        except (TypeError, StopIteration):
            first = None
        self._first_of = (loader, first)
        return first

    def _batch_geometry(self, trainer: Any, transformer_seq: int | None, traced: bool = False) -> tuple[int, int]:
        """(global batch, sequence length) from the training DataLoader, as on one device. A model in unit form
        has no sequence: a sample is one batch row (seq 1); a transformer traced on the user's call (``traced``:
        a ViT on pixels) has the length its attention saw, not the batch's second dimension."""
        global_batch, seq_len = self._global_batch_arg, None
        loader = self._plan_loader(trainer)
        if loader is not None and global_batch is None:
            global_batch = getattr(loader, "batch_size", None)
        first = self._first_batch(trainer)
        if first is not None:
            global_batch = global_batch or _leading_size(first)
            seq_len = next((int(t.shape[1]) for t in _tree_leaves(first)
                            if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
        if not global_batch:
            global_batch = self.world_size
        if self.analysis is not None and self.analysis.spec.unit_form:
            seq_len = 1
        elif traced and transformer_seq:
            seq_len = transformer_seq
        return int(global_batch), int(seq_len or transformer_seq or 1)

    def _model_call(self, trainer: Any) -> Any:
        """The user's call of its model (``profile.units.ModelCall``): the step of the stage being run, on two rows
        of the plan DataLoader's first batch, stopped at its first module call (logs discarded)."""
        from functools import partial

        from lightning_autopar.profile.units import find_model_call

        first = self._first_batch(trainer)
        total = _leading_size(first) if first is not None else None
        module = self.lightning_module
        if total is None:
            raise ConfigError("DataLoader", f"{type(module).__name__}: no transformer blocks found, so the model is "
                              "analysed by running the step on a batch, and the DataLoader gave none with a batch "
                              "dimension", "pass a DataLoader whose batches hold tensors")
        stage = str(getattr(trainer.state.fn, "value", trainer.state.fn))
        hook = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}.get(stage,
                                                                                                 "training_step")
        with self._recording_logs(_LogRecorder()):
            # two rows where there are: torch.export (the traced pipeline) would specialise a batch of one
            rows = min(2, total)
            return find_model_call(module, partial(getattr(module, hook), _slice_batch(first, 0, rows, total), 0))

    def _analyse(self, trainer: Any) -> tuple[nn.Module, Any, tuple[tuple, dict] | None]:
        """(the model the plan applies to, its analysis, the user's call of it or None). A transformer (repeated
        blocks with attention, an MLP or MoE layers found) is analysed as before, on token ids; any other model
        in unit form (``profile.units``), from the user's own call of it on one row of the first batch."""
        from lightning_autopar.profile.analyze import analyze, find_transformer
        from lightning_autopar.profile.units import analyze_model, is_transformer

        module = self.lightning_module
        try:
            _, transformer = find_transformer(module)
            analysis = analyze(transformer, trace=True, runner=module)  # what the code does (views, fused layouts)
        except ValueError:  # no repeated blocks, or none a transformer spec describes (a ResNet's: no width)
            analysis = None
        traced = analysis is not None and not any(u.startswith("meta forward failed") for u in analysis.unclassified)
        if analysis is not None and is_transformer(analysis) and traced:
            return transformer, analysis, None
        call = self._model_call(trainer)
        example = (tuple(call.args), dict(call.kwargs))
        # a transformer that does not run on token ids (ViT: pixels) is traced on the user's own call
        return call.module, analyze_model(call.module, example, runner=module), example

    def _exclude(self, restrict: dict[str, list[Any]], name: str, values: list[Any], reason: str) -> None:
        """Narrow plan field ``name`` to ``values`` because the runtime cannot apply the others to this model;
        ``reason`` is shown in the plan report (``PlanReport.excluded``), so nothing is dropped silently."""
        restrict[name] = list(values)
        self.excluded[name] = reason

    def _restrictions(self, trainer: Any, analysis: Any, precision: str) -> dict[str, list[Any]]:
        from lightning_autopar.parallel.tensor import check_tp

        restrict: dict[str, list[Any]] = {k: list(v) for k, v in RUNTIME_SUPPORT.items()}
        self.excluded = {}
        try:  # tp=2 is the smallest split: what refuses it refuses every tp > 1 for this model's structure
            check_tp(analysis, 2, structure_only=True)
        except ConfigError as err:
            self._exclude(restrict, "tp", [1], str(err))
        if not self._automatic_optimization():
            # the user's own loop does backward: one micro-batch per step
            self._exclude(restrict, "grad_accum", [1], "the user's loop runs backward (manual optimization)")
        for name, (values, reason) in self._pipeline_expert_restrictions(analysis).items():
            self._exclude(restrict, name, values, reason)
        restrict.update(self._restrict)
        return restrict

    def _unit_restrictions(self, analysis: Any, model: nn.Module, example: tuple[tuple, dict]) -> dict[str, list[Any]]:
        """The runtime's limits for a model in unit form (the planner itself keeps tp = cp = ep = 1 and, with
        BatchNorm, grad_accum = 1 unless fixed): pp where its stages can be traced (``check_unit_pipeline``, the
        reason in the report otherwise). A grad_accum the user fixes on a BatchNorm model gets one warning."""
        from lightning_autopar.parallel.apply import check_unit_pipeline
        from lightning_autopar.parallel.batchnorm import batchnorm_modules

        restrict: dict[str, list[Any]] = {k: list(v) for k, v in RUNTIME_SUPPORT.items()}
        self.excluded = {}
        if not self._automatic_optimization():
            self._exclude(restrict, "grad_accum", [1], "the user's loop runs backward (manual optimization)")
            self._exclude(restrict, "pp", [1], "pipeline parallelism runs backward itself; manual optimization cannot")
        else:
            try:
                check_unit_pipeline(self.lightning_module, model, analysis, example, 2)
            except ConfigError as err:
                self._exclude(restrict, "pp", [1], str(err))
        fixed = self._fix.get("grad_accum")
        if batchnorm_modules(model) and fixed is not None and fixed > 1 and self.global_rank == 0:
            warnings.warn(f"autopar: grad_accum={fixed} is fixed and {analysis.spec.name} has BatchNorm: its "
                          "statistics (and running buffers) are per micro-batch, as on one device running "
                          f"{fixed} micro-batches per step, not the whole batch at once", stacklevel=2)
        restrict.update(self._restrict)
        return restrict

    def _plan_and_apply(self, trainer: Any) -> None:
        from lightning_autopar.parallel.apply import apply_plan
        from lightning_autopar.parallel.precision import plan_precision
        from lightning_autopar.parallel.tensor import check_tp
        from lightning_autopar.planner.search import plan as make_plan
        from lightning_autopar.topology.mesh import build_mesh

        module = self.lightning_module
        transformer, analysis, example = self._analyse(trainer)
        self.analysis = analysis
        unit_form = analysis.spec.unit_form
        global_batch, seq_len = self._batch_geometry(trainer, analysis.spec.seq_len, traced=example is not None)
        self._global_batch = global_batch
        analysis.spec.seq_len = seq_len
        precision = plan_precision(trainer.precision)
        if "tp" in self._fix and not unit_form:  # unit form: the planner refuses tp > 1 (check_unit_fix)
            check_tp(analysis, self._fix["tp"])
        started = time.perf_counter()
        restrict = (self._unit_restrictions(analysis, transformer, example) if unit_form
                    else self._restrictions(trainer, analysis, precision))
        self.report = make_plan(
            analysis.spec, self._cluster_spec(), global_batch=global_batch, seq_len=seq_len, fix=self._fix,
            top=self._top, restrict=restrict, precision=precision, memory_fraction=self._memory_fraction,
        )
        self.report.excluded = {**self.report.excluded, **self.excluded}  # the planner's own (unit form) and the runtime's
        plan = self.plan = self.report.best.plan
        if self.global_rank == 0 and self._print_plan:
            self.report.print_table()
            print(f"autopar: planned in {time.perf_counter() - started:.2f}s for world {self.world_size}, "
                  f"global batch {global_batch}, seq {seq_len}: {plan.short()}", flush=True)
            from lightning_autopar.launch import print_env_hints

            print_env_hints(plan, self.report.cluster)
        layout = self.mesh_layout = build_mesh(plan, self.root_device.type)
        self._device_mesh = layout.mesh
        module._device_mesh = layout.mesh
        if (plan.pp > 1 or plan.ep > 1) and not self._save_distributed_checkpoint:
            raise ConfigError("save_distributed_checkpoint", "with pp>1 or ep>1 each rank holds different "
                              "parameters, so a single-file checkpoint from rank 0 would miss them",
                              "keep save_distributed_checkpoint=True")
        if plan.pp > 1 and not module.automatic_optimization:
            raise ConfigError("plan.pp", "pipeline parallelism runs forward and backward itself, which manual "
                              "optimization cannot do", "use pp=1, or automatic optimization")
        self._broadcast_module(module)
        self._transformer = transformer
        applied = self._applied = apply_plan(
            module, transformer, analysis, plan, layout, self._dp_mesh(plan), self.root_device,
            loss_fn=lambda output, target: self._pipeline_loss(output, target),
            layers_per_stage=self.report.best.layers_per_stage, capacity_factor=self._capacity_factor,
            example=example)
        self._fsdp_roots = applied.fsdp_roots
        self._pipeline = applied.pipeline
        self._transformer = applied.pipeline_root or transformer  # what the user's steps call
        self._first_of = None  # the batch is not held for the whole run

    def _dp_mesh(self, plan: Plan) -> Any:
        if plan.shard_size < plan.dp:
            return self.mesh_layout["dp"]  # 2-D: HSDP, or DDP as HSDP with shard groups of one
        return self.mesh_layout["dp_shard"]

    @staticmethod
    def _broadcast_module(module: nn.Module) -> None:
        """Start every rank from rank 0's weights: the model the user built is the model trained."""
        import torch.distributed as dist

        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                if tensor.device.type != "meta":
                    dist.broadcast(tensor.data, src=0)

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

    # ------------------------------------------------------------------ the step

    def _dp_rank_and_size(self) -> tuple[int, int]:
        mesh = self.mesh_layout["dp_flat"]
        return mesh.get_local_rank(), mesh.size()

    def _reduce_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        mesh = self.mesh_layout["dp_flat"]
        if mesh.size() > 1:
            tensor = tensor.to(self.root_device)
            dist.all_reduce(tensor, group=mesh.get_group())
        return tensor.cpu()

    def _micro_batches(self, batch: Any, grad_accum: int) -> Iterator[tuple[Any, float, int]]:
        """(micro-batch, its weight in the loss, rows) for this rank's slice of the global batch."""
        total = _leading_size(batch)
        if total is None:
            raise ConfigError("training batch", "no tensor with a batch dimension found",
                              "return tensors (or tuples/dicts of tensors) from the DataLoader")
        dp_rank, dp = self._dp_rank_and_size()
        start, stop = split_rows(total, dp, dp_rank)
        if stop - start < 1:
            raise ConfigError("DataLoader.batch_size", f"a batch of {total} rows cannot feed {dp} data-parallel "
                              "ranks", f"use a global batch >= {dp} (or drop_last=True)")
        local = stop - start
        parts = min(grad_accum, local)
        for i in range(parts):
            lo, hi = split_rows(local, parts, i)
            mb = _slice_batch(batch, start + lo, start + hi, total)
            # FSDP averages gradients over dp ranks, so weight = rows * dp / global rows gives the global mean
            yield mb, (hi - lo) * dp / total, hi - lo

    @contextmanager
    def _recording_logs(self, recorder: _LogRecorder) -> Iterator[None]:
        module = self.lightning_module
        module.log = recorder  # instance attribute shadows the method (log_dict goes through it too)
        try:
            yield
        finally:
            del module.log

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        from lightning_autopar.callbacks.accumulation import lightning_accumulation
        from lightning_autopar.parallel.fsdp import set_gradient_sync

        assert self.plan is not None
        batch, rest = args[0], args[1:]
        if self._pipeline is not None:
            return self._pipeline_training_step(batch, rest, kwargs)
        module = self.lightning_module
        automatic = module.automatic_optimization
        micro = list(self._micro_batches(batch, self.plan.grad_accum if automatic else 1))
        # Lightning's accumulate_grad_batches around the plan's micro-batches (callbacks/accumulation.py)
        lightning_k, stepping = lightning_accumulation(module.trainer) if automatic else (1, True)
        total = _leading_size(batch) or 1
        recorder = _LogRecorder()
        local_loss = torch.zeros((), device=self.root_device)
        rows_local = sum(rows for _, _, rows in micro)
        output = None
        self._held_grads = {}  # none left from a step whose backward Lightning skipped
        with self._gradients_set_aside(automatic) as produced:
            for i, (mb, weight, rows) in enumerate(micro):
                last = i == len(micro) - 1
                if automatic:
                    set_gradient_sync(self._fsdp_roots, last and stepping)
                recorder.weight = rows / total
                with self._recording_logs(recorder), self.precision_plugin.train_step_context():
                    output = module.training_step(mb, *rest, **kwargs)
                loss = output["loss"] if isinstance(output, Mapping) else output
                if not automatic or loss is None:
                    break
                local_loss = local_loss + loss.detach() * (rows / rows_local)
                if not last:
                    self.backward(loss * weight / lightning_k, None)
        self._held_grads = produced  # DDP keeps them in .grad until the last backward reduces them all
        recorder.flush(module, self._reduce_over_dp, total)
        if not automatic or output is None:
            return output
        weighted = loss * weight
        # value: this rank's mean loss; gradient: the last micro-batch's weighted loss
        combined = weighted + (local_loss - weighted).detach()
        if isinstance(output, Mapping):
            return {**output, "loss": combined}
        return combined

    def _eval_step(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        batch, rest = args[0], args[1:]
        total = _leading_size(batch)
        if total is None or self.plan is None:
            return getattr(self.lightning_module, hook)(*args, **kwargs)
        if self._pipeline is not None:
            return self._pipeline_eval_step(hook, batch, rest, kwargs)
        dp_rank, dp = self._dp_rank_and_size()
        start, stop = split_rows(total, dp, dp_rank)
        recorder = _LogRecorder()
        recorder.weight = (stop - start) / total
        with self._recording_logs(recorder), self.precision_plugin.val_step_context():
            out = getattr(self.lightning_module, hook)(_slice_batch(batch, start, stop, total), *rest, **kwargs)
        recorder.flush(self.lightning_module, self._reduce_over_dp, total)
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:  # forward-only through the stages; the predictions are on the last
            return self._pipeline_eval_step("predict_step", args[0], args[1:], kwargs)
        return super().predict_step(*args, **kwargs)

    # ------------------------------------------------------------------ pipeline and expert parallelism

    def _pipeline_expert_restrictions(self, analysis: Any) -> dict[str, tuple[list[Any], str]]:
        """pp and ep values the runtime can apply to this model: pp needs a splittable stack of blocks and
        automatic optimization; ep needs MoE layers with a route() method, the fused layout of HF Mixtral or the
        plain layout (parallel.experts). Field -> (allowed values, why the others are not)."""
        from lightning_autopar.parallel.apply import has_moe, pipeline_split
        from lightning_autopar.parallel.experts import moe_modules, supports_ep
        from lightning_autopar.parallel.pipeline import check_pipeline
        from lightning_autopar.profile.analyze import find_transformer

        module = self.lightning_module
        _, transformer = find_transformer(module)
        out: dict[str, tuple[list[Any], str]] = {}
        pipeline_refusal = ""
        try:
            split, split_analysis = pipeline_split(module, transformer, analysis)
            check_pipeline(split_analysis, split, module, 2)
            splittable = True
        except ConfigError as err:
            splittable, pipeline_refusal = False, str(err)
        moe = has_moe(analysis)
        if not splittable:
            out["pp"] = ([1], pipeline_refusal)
        elif not self._automatic_optimization():
            out["pp"] = ([1], "pipeline parallelism runs backward itself; manual optimization cannot")
        if not moe:
            out["ep"] = ([1], "no MoE layers found")
        elif not all(supports_ep(m, info) for _, m, info in moe_modules(transformer, analysis)):
            out["ep"] = ([1], "MoE layout not supported by expert parallelism (parallel/experts.py)")
        return out

    def _norm_parts(self) -> list[Any] | None:
        """Parameter parts for gradient clipping when ranks hold different parameters (stages, experts)."""
        applied, plan = self._applied, self.plan
        if applied is None or plan is None:
            return None
        pp = [self.mesh_layout["pp"].get_group()] if plan.pp > 1 else []
        parts: list[Any] = []
        if applied.expert_meshes:
            ids = applied.expert_params()
            parts.append((lambda p: id(p) in ids, [applied.expert_meshes["ep"].get_group(), *pp]))
        if not parts and not pp:
            return None
        return parts + [(lambda p: True, pp)]

    def _pipeline_training_step(self, batch: Any, rest: tuple, kwargs: dict) -> Any:
        """Run the schedule (forward and backward of every micro-batch) as the training step. The user's
        training_step runs twice per micro-batch: up to its model call (to get the model's inputs, on every
        rank) and, on the last stage, with the model call returning the pipeline's output (its own loss code).
        Gradients are held until backward() so Lightning's zero_grad (after the step) does not clear them."""
        from functools import partial

        from lightning_autopar.parallel.pipeline import capture_model_call

        pipe, module, plan = self._pipeline, self.lightning_module, self.plan
        total = _leading_size(batch) or 0
        micro = list(self._micro_batches(batch, plan.grad_accum))
        if total != self._global_batch or len(micro) != plan.grad_accum:
            raise ConfigError("DataLoader.batch_size", "pipeline parallelism runs fixed-size micro-batches: every "
                              f"batch must hold the planned global batch of {self._global_batch} rows, got {total}",
                              "use a fixed batch size and drop_last=True")
        with self._recording_logs(_LogRecorder()):
            inputs = [capture_model_call(self._transformer, partial(module.training_step, mb, *rest, **kwargs))
                      for mb, _, _ in micro]
        self._pp_step = (micro, rest, kwargs, total, _LogRecorder(), [])
        try:
            with self._gradients_set_aside() as produced, self.precision_plugin.train_step_context():
                pipe.train_step(inputs)
        finally:
            self._pipeline_grads = produced
            _, _, _, _, recorder, losses = self._pp_step
            self._pp_step = None
        payload = None
        if pipe.has_last:
            payload = (float(sum(losses)) / sum(rows for *_, rows in micro), recorder.values)
        mean, recorder.values = pipe.broadcast_from_last(payload)
        recorder.flush(module, self._reduce_over_dp, total)
        return torch.tensor(mean, device=self.root_device)

    def _pipeline_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss on the last stage: the user's training_step on micro-batch ``target``, its model
        call returning the pipeline output; weighted like the non-pipelined micro-batch losses."""
        from lightning_autopar.parallel.pipeline import model_call_replaced

        micro, rest, kwargs, total, recorder, losses = self._pp_step
        pipe = self._pipeline
        mb, weight, rows = micro[int(target.reshape(-1)[0])]
        rec = _LogRecorder() if pipe.inferring else recorder  # shape inference: a real pass, not recorded
        rec.weight = rows / total
        model_output = pipe.last_chunk.rebuild(output)
        with self._recording_logs(rec), model_call_replaced(self._transformer, lambda *a, **k: model_output):
            out = self.lightning_module.training_step(mb, *rest, **kwargs)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ConfigError("training_step", "with pipeline parallelism the training_step must return the loss",
                              "return a loss tensor (or a dict with 'loss')")
        if not pipe.inferring:
            losses.append(loss.detach().float().cpu() * rows)
        loss = loss * weight
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler.scale(loss) if scaler is not None else loss

    def _pipeline_eval_step(self, hook: str, batch: Any, rest: tuple, kwargs: dict) -> Any:
        """Forward-only through the pipeline, then the user's hook on the last stage; logs reach every rank."""
        from functools import partial

        from lightning_autopar.parallel.pipeline import capture_model_call, model_call_replaced

        pipe, module = self._pipeline, self.lightning_module
        total = _leading_size(batch)
        dp_rank, dp = self._dp_rank_and_size()
        start, stop = split_rows(total, dp, dp_rank)
        step = partial(getattr(module, hook), _slice_batch(batch, start, stop, total), *rest, **kwargs)
        with self._recording_logs(_LogRecorder()):
            inputs = capture_model_call(self._transformer, step, hook)
        recorder = _LogRecorder()
        recorder.weight = (stop - start) / total
        out = None
        with self.precision_plugin.val_step_context():
            output = pipe.forward_only(inputs)
            if pipe.has_last:
                with self._recording_logs(recorder), model_call_replaced(self._transformer, lambda *a, **k: output):
                    out = step()
        recorder.values = pipe.broadcast_from_last(recorder.values if pipe.has_last else None)
        recorder.flush(module, self._reduce_over_dp, total)
        return out

    @contextmanager
    def _gradients_set_aside(self, enabled: bool = True) -> Iterator[dict[Any, Any]]:
        """Run the block on fresh gradients and put the earlier ones back after it; yields a dict that then holds
        what the block produced. Lightning's zero_grad runs after training_step and before the last backward, so
        gradients made inside the step (earlier micro-batches; the pipeline schedule) wait outside ``.grad``
        until ``backward()`` puts them back."""
        produced: dict[Any, Any] = {}
        params = list(self.lightning_module.parameters()) if enabled else []
        previous = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        try:
            yield produced
        finally:
            produced.update({p: p.grad for p in params if p.grad is not None})
            for p in params:
                p.grad = previous[p]

    @staticmethod
    def _restore_gradients(grads: dict[Any, Any]) -> None:
        for p, grad in grads.items():
            p.grad = grad if p.grad is None else p.grad + grad

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The earlier micro-batches' gradients go back into ``.grad`` before the last micro-batch's backward
        (which DDP then reduces with them). With pipeline parallelism the schedule already ran backward in
        training_step: Lightning's hooks run, autograd does not; its gradients are put in place."""
        held, self._held_grads = self._held_grads, {}
        self._restore_gradients(held)
        grads = self._pipeline_grads
        if grads is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self._pipeline_grads = None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._restore_gradients(grads)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------ checkpoints

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Sharded checkpoints store the optimizer state flattened: every entry (states and param-group
        settings) keyed by parameter name, so ranks holding different parameters (pipeline stages, expert
        ranks) write disjoint keys, and a checkpoint reshards across plans."""
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        from lightning_autopar.parallel.tensor import plain_shards

        optimizer = getattr(optimizer, "_optimizer", optimizer)
        options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
        return plain_shards(get_optimizer_state_dict(self.model, optimizer, options=options))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state as Lightning saves it; TP-fused projections (strided shards, which DCP cannot write)
        as plain shards of the same global tensors (``parallel.tensor.plain_shards``)."""
        from lightning_autopar.parallel.tensor import plain_shards

        state = super().lightning_module_state_dict()
        return plain_shards(state) if self._save_distributed_checkpoint else state

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint (model, flattened optimizer states, metadata) into this rank's parameters."""
        from pathlib import Path

        import torch.distributed.checkpoint as dcp
        from lightning.fabric.strategies.fsdp import _METADATA_FILENAME
        from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        from lightning_autopar.parallel.tensor import plain_shards, restore_layout

        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        state = {"state_dict": get_model_state_dict(self.model)}
        for i, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, optimizer, options=options)
        plain = plain_shards(state)  # DCP reads plain shards; then back to the model's own (strided) layout
        dcp.load(plain, checkpoint_id=path)
        state = restore_layout(plain, like=state)
        self.model.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[f"optimizer_{i}"], options=options)
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Automatic parallelism planned by autopar")


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
