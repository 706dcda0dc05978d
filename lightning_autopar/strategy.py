"""``AutoParallelStrategy``: glue between Lightning's hooks and the planner / apply layer.

Flow: process group -> (setup) analyse the user's model, read the global batch and sequence length from the
training DataLoader -> plan -> DeviceMesh -> apply (TP -> recompute -> FSDP/DP, precision) -> optimizers built
on the sharded parameters. Checkpoints go through torch.distributed.checkpoint (inherited from Lightning's
ModelParallelStrategy), keyed by the user's parameter names.

Batch semantics: the DataLoader's batch is the global batch of one optimizer step, exactly as on one device.
Each step it is cut into ``dp`` contiguous slices (ranks of one TP/PP group get the same slice), each slice into
``grad_accum`` micro-batches; every micro-batch loss is weighted by its share of the global batch so the
summed gradient equals the single-device one. Values logged with ``self.log`` are averaged the same way.

The logic lives in a mixin so the same strategy is registered for ``lightning.pytorch`` and, when installed,
``pytorch_lightning`` (two packages with separate class hierarchies).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from lightning_autopar.errors import ConfigError, install_excepthook
from lightning_autopar.specs import ClusterSpec, Plan, parse_fix

log = logging.getLogger(__name__)

# What the runtime can apply today; the planner searches only inside it unless the user fixes a field.
RUNTIME_SUPPORT: dict[str, list[Any]] = {"pp": [1], "cp": [1], "ep": [1], "sp": [False], "recompute": ["none"]}


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
        self._fsdp_roots: list[nn.Module] = []
        self._global_batch = 0

    # ------------------------------------------------------------------ environment and setup

    def setup_environment(self) -> None:
        # Process group only: the mesh depends on the plan, which needs the data (see setup()).
        self._setup_distributed()

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
        _materialize_distributed_module(self.model, self.root_device)
        self._plan_and_apply(trainer)
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

    def _cluster_spec(self) -> ClusterSpec:
        from lightning_autopar.specs import load_cluster_spec

        if self._cluster_arg is not None:
            return load_cluster_spec(self._cluster_arg, nodes=self.num_nodes, devices_per_node=self.num_processes)
        from lightning_autopar.topology import discover

        return discover.discover_cluster()

    def _batch_geometry(self, trainer: Any, transformer_seq: int | None) -> tuple[int, int]:
        """(global batch, sequence length) from the training DataLoader, as on one device."""
        global_batch, seq_len = self._global_batch_arg, None
        if trainer.state.fn == "fit":
            loader = trainer.fit_loop._data_source.dataloader()
            if global_batch is None:
                global_batch = getattr(loader, "batch_size", None)
            try:
                first = next(iter(loader))
            except (TypeError, StopIteration):
                first = None
            if first is not None:
                global_batch = global_batch or _leading_size(first)
                seq_len = next((int(t.shape[1]) for t in _tree_leaves(first)
                                if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
        if not global_batch:
            global_batch = self.world_size
        return int(global_batch), int(seq_len or transformer_seq or 1)

    def _restrictions(self, trainer: Any, analysis: Any, precision: str) -> dict[str, list[Any]]:
        restrict: dict[str, list[Any]] = {k: list(v) for k, v in RUNTIME_SUPPORT.items()}
        restrict["precision"] = [precision]
        first = analysis.blocks[0] if analysis.blocks else None
        if first is None or first.attention is None or first.attention.fused or first.attention.o is None:
            restrict["tp"] = [1]  # the analysis could not find splittable attention
        if not self.lightning_module.automatic_optimization:
            restrict["grad_accum"] = [1]  # the user's own loop does backward: one micro-batch per step
        restrict.update(self._restrict)
        return restrict

    def _plan_and_apply(self, trainer: Any) -> None:
        from lightning_autopar.parallel.fsdp import apply_data_parallel
        from lightning_autopar.parallel.precision import plan_precision
        from lightning_autopar.parallel.tensor import apply_tensor_parallel, check_tp
        from lightning_autopar.planner.search import plan as make_plan
        from lightning_autopar.profile.analyze import analyze, find_transformer
        from lightning_autopar.topology.mesh import build_mesh

        module = self.lightning_module
        prefix, transformer = find_transformer(module)
        analysis = analyze(transformer, trace=False)
        self.analysis = analysis
        global_batch, seq_len = self._batch_geometry(trainer, analysis.spec.seq_len)
        self._global_batch = global_batch
        analysis.spec.seq_len = seq_len
        precision = plan_precision(trainer.precision)
        if "tp" in self._fix:
            check_tp(analysis, self._fix["tp"])
        started = time.perf_counter()
        self.report = make_plan(
            analysis.spec, self._cluster_spec(), global_batch=global_batch, seq_len=seq_len, fix=self._fix,
            top=self._top, restrict=self._restrictions(trainer, analysis, precision),
            memory_fraction=self._memory_fraction,
        )
        plan = self.plan = self.report.best.plan
        if self.global_rank == 0 and self._print_plan:
            self.report.print_table()
            print(f"autopar: planned in {time.perf_counter() - started:.2f}s for world {self.world_size}, "
                  f"global batch {global_batch}, seq {seq_len}: {plan.short()}", flush=True)
        layout = self.mesh_layout = build_mesh(plan, self.root_device.type)
        self._device_mesh = layout.mesh
        module._device_mesh = layout.mesh
        self._broadcast_module(module)
        apply_tensor_parallel(transformer, analysis, layout["tp"])
        block_fqns = [b.fqn for b in analysis.blocks]
        self._fsdp_roots = apply_data_parallel(module, transformer, block_fqns, self._dp_mesh(plan),
                                               plan.zero, plan.precision)

    def _dp_mesh(self, plan: Plan) -> Any:
        layout = self.mesh_layout
        replicate = plan.dp // plan.shard_size
        if plan.dp > 1 and replicate > 1 and plan.shard_size > 1 or plan.zero == 0 and plan.dp > 1:
            return layout["dp"]  # 2-D: HSDP, or DDP as HSDP with shard groups of one
        return layout["dp_shard"]

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
            clip_grad_norm_(params, clip_val)

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
        from lightning_autopar.parallel.fsdp import set_gradient_sync

        assert self.plan is not None
        batch, rest = args[0], args[1:]
        module = self.lightning_module
        automatic = module.automatic_optimization
        micro = list(self._micro_batches(batch, self.plan.grad_accum if automatic else 1))
        total = _leading_size(batch) or 1
        recorder = _LogRecorder()
        local_loss = torch.zeros((), device=self.root_device)
        rows_local = sum(rows for _, _, rows in micro)
        output = None
        for i, (mb, weight, rows) in enumerate(micro):
            last = i == len(micro) - 1
            if automatic:
                set_gradient_sync(self._fsdp_roots, last)
            recorder.weight = rows / total
            with self._recording_logs(recorder), self.precision_plugin.train_step_context():
                output = module.training_step(mb, *rest, **kwargs)
            loss = output["loss"] if isinstance(output, Mapping) else output
            if not automatic or loss is None:
                break
            local_loss = local_loss + loss.detach() * (rows / rows_local)
            if not last:
                self.backward(loss * weight, None)
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

    def teardown(self) -> None:
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Automatic parallelism planned by autopar")


def _make_strategy_class(base: type, module_name: str) -> type:
    return type("AutoParallelStrategy", (AutoParallelMixin, base),
                {"__module__": module_name, "__doc__": AutoParallelMixin.__doc__})


from lightning.pytorch.strategies import ModelParallelStrategy as _PLModelParallel  # noqa: E402


class AutoParallelStrategy(AutoParallelMixin, _PLModelParallel):
    """Lightning strategy that plans and applies DP / FSDP / TP automatically (``strategy="autopar"``)."""


def register() -> None:
    """Register "autopar" in lightning.pytorch's and (when installed) pytorch_lightning's registries."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "autopar" not in StrategyRegistry:
        AutoParallelStrategy.register_strategies(StrategyRegistry)
    try:
        import pytorch_lightning.strategies as pl_strategies
    except ImportError:
        return
    if "autopar" not in pl_strategies.StrategyRegistry:
        cls = _make_strategy_class(pl_strategies.ModelParallelStrategy, __name__)
        globals()["PLAutoParallelStrategy"] = cls
        cls.register_strategies(pl_strategies.StrategyRegistry)
