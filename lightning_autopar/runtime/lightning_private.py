"""Every touch of Lightning's private API, in one place.

Checked against lightning 2.6.6 (``lightning.__version__`` in the project's environment) with torch 2.13. When
Lightning changes one of these, this module is the only one to fix; each entry says why the public API does not
suffice. Members the strategies inherit from Lightning's ModelParallelStrategy and use as its subclasses
(``_setup_distributed``, ``_get_process_group_backend``, ``_timeout``, ``_device_mesh``,
``_save_distributed_checkpoint``, Fabric's ``_backward_sync_control``) are the base class's extension points and
stay where the subclass uses them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

CHECKED_AGAINST = "lightning 2.6.6"


def disable_distributed_sampler(trainer: Any) -> None:
    """The strategy slices each global batch itself; Lightning would otherwise shard (and always shuffle) the
    training data per rank. ``Trainer(use_distributed_sampler=False)`` is the user's switch; the strategy has
    only the accelerator connector that holds it."""
    trainer._accelerator_connector.use_distributed_sampler = False


def stage_dataloader(loop: Any) -> Any:
    """The DataLoader(s) of a fit / validate / test / predict loop, before the loop iterates them: the plan is
    made at strategy setup, and no public accessor exists then (``trainer.train_dataloader`` is set later)."""
    return loop._data_source.dataloader()


def should_accumulate(trainer: Any) -> bool:
    """Whether the optimizer skips the step after the current batch (``accumulate_grad_batches``): the micro-batch
    loop reduces gradients only on the batch the optimizer steps on. Only the fit loop knows it."""
    return bool(trainer.fit_loop._should_accumulate())


def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning's own logging uses for ``logger.log_metrics`` (``trainer.global_step`` counts optimizer
    steps of every optimizer, which loggers do not)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """``LightningModule.device_mesh`` (what a user's ``configure_model`` reads) is backed by this attribute,
    which Lightning's ModelParallelStrategy sets in its own setup, replaced here."""
    module._device_mesh = mesh


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper (torch's state-dict helpers need it)."""
    return getattr(optimizer, "_optimizer", optimizer)


def checkpoint_connector(trainer: Any) -> Any:
    """The trainer's checkpoint connector: auto-resume wraps its ``resume_start`` (patched and restored by the
    callback) to try the newest checkpoint and fall back to older ones inside the load Lightning runs
    (``ckpt_path`` offers no fallback)."""
    return trainer._checkpoint_connector


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint dict ``trainer.save_checkpoint`` would write, without writing it: async saving hands the
    shards to ``torch.distributed.checkpoint.async_save`` instead."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether a ModelParallelStrategy writes sharded (DCP) checkpoints: its constructor argument, kept private."""
    return bool(getattr(strategy, "_save_distributed_checkpoint", False))


def materialize_distributed_module(module: Any, device: Any) -> None:
    """Lightning's meta-device materialisation (``reset_parameters`` per module), as its own strategies do it."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """The user's DataLoader re-created with another sampler (all its other arguments kept), as Lightning does."""
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(dataloader, sampler)


def metadata_filename() -> str:
    """The file of a sharded checkpoint that holds everything but the shards (Lightning's layout)."""
    from lightning.fabric.strategies.fsdp import _METADATA_FILENAME

    return _METADATA_FILENAME


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint in the layout Lightning's ModelParallelStrategy writes."""
    from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint

    return bool(_is_sharded_checkpoint(path))


@contextmanager
def distributed_models(modules: Any) -> Iterator[None]:
    """Fabric's ModelParallelStrategy saves and loads only a model with DTensor parameters (its check
    ``_has_dtensor_modules``); the model autopar set up is distributed under every plan, also the data-parallel
    one without sharding (zero=0: DDP's ``replicate``, plain tensors), which torch.distributed.checkpoint saves and
    loads as well. While active, the check also accepts ``modules``."""
    from lightning.fabric.strategies import model_parallel

    original = model_parallel._has_dtensor_modules
    ours = {id(m) for m in modules if m is not None}
    model_parallel._has_dtensor_modules = lambda module: original(module) or id(module) in ours
    try:
        yield
    finally:
        model_parallel._has_dtensor_modules = original


def take_over_signal_handlers(trainer: Any, install: Any) -> Any:
    """Make the trainer install ``install()``'s signal handlers where Lightning installs its own (just before the
    run stage); returns the undo. Lightning's SLURM auto-requeue handler saves a checkpoint from inside the signal
    handler on the rank that got the signal alone (a deadlock in any collective of the save) and its SIGTERM path
    exits 0 mid-training; the public API cannot turn either off. Lightning's own teardown still restores the
    handlers found before (``_original_handlers``), so nothing of ours outlives the fit."""
    connector = trainer._signal_connector

    def register_signal_handlers() -> None:
        connector.received_sigterm = False
        connector._original_handlers = connector._get_current_signal_handlers()
        install()

    previous = connector.__dict__.get("register_signal_handlers")
    connector.register_signal_handlers = register_signal_handlers

    def undo() -> None:
        if previous is None:
            connector.__dict__.pop("register_signal_handlers", None)
        else:
            connector.register_signal_handlers = previous

    return undo
