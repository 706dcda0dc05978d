"""Hugging Face ``Trainer``: autopar's plan inside the Trainer's own loop (extras ``hf`` and ``accelerate``).

``AutoparTrainer(model, args, ..., fix=None, planner_options=None)`` is a ``transformers.Trainer`` that plans and
applies through ``accelerate.AcceleratePlanning.setup``, the code behind ``lightning_autopar.accelerate.prepare``
(the set-up stages of the Trainer and Fabric strategies), on the process group and the ``Accelerator`` the
Trainer made. The rest is the Trainer's: its loop, accumulation, loss, optimizer and scheduler, logging, eval.

* **The batch.** ``TrainingArguments.per_device_train_batch_size`` rows per *data-parallel* rank (the ranks of one
  tp / cp group read the same rows): one optimizer step takes ``per_device_train_batch_size x dp x
  gradient_accumulation_steps`` rows, as one device reading that batch. The plan is made at the first DataLoader
  the Trainer asks for (``get_train_dataloader``, at ``train()``), priced per micro-batch (``mbs`` the per-device
  batch, ``grad_accum=1``, ``pp=1``: the Trainer's loop calls backward; it accumulates
  ``gradient_accumulation_steps`` micro-batches with ``accelerator.no_sync``).
* **Read from TrainingArguments** (through the Accelerator the Trainer builds from them): the per-device batch,
  ``gradient_accumulation_steps``, ``bf16`` / ``fp16`` (the plan's precision; the forward runs under the
  Accelerator's autocast) and ``max_grad_norm`` (clipped over every mesh by autopar's clip, ``parallel.clip``).
* **Refused** in one line naming the field and the fix: the Trainer's own ``fsdp`` / ``deepspeed`` /
  ``torch_compile`` / ``activation_checkpointing`` (``gradient_checkpointing``) — the plan chooses sharding,
  compile and recompute — and ``save_strategy`` other than ``"no"``: the Trainer's checkpoints pickle the model and
  optimizer per rank; save with ``trainer.autopar.save(folder)`` (torch.distributed.checkpoint, single-device
  names, loads at any plan with ``trainer.autopar.load(folder)``).
* **Public hooks** only, but one: ``get_train_dataloader`` / ``get_eval_dataloader`` (the Trainer's DataLoader,
  sharded over the plan's dp ranks instead of every process: Accelerate's ``prepare_data_loader`` passes it through
  while the Trainer builds it), ``create_optimizer`` (the optimizer adopted by the
  plan), ``get_tp_size`` (the ranks that read one batch: the Trainer's total batch and token count), and Accelerate's
  ``prepare_model(..., evaluation_mode=True)`` (autocast only; the model is marked prepared, so the Trainer's
  ``accelerator.prepare`` does not wrap it in DDP a second time). Private, checked against transformers 5.25:
  ``Trainer._mixed_mesh_grads = False``. The Trainer clips DTensor gradients on several meshes with its own
  per-mesh norm when it sees them (``_has_mixed_mesh_grads``), which knows nothing of the plan's replicated and
  pipeline parts; set to False it calls ``accelerator.clip_grad_norm_``, which autopar hooks to its clip.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from torch import nn
from transformers import Trainer, TrainingArguments

from lightning_autopar.accelerate import AcceleratePlanning
from lightning_autopar.errors import ConfigError

# TrainingArguments fields whose value hands a part of the plan to the Trainer: (field, why, fix)
REFUSED = (
    ("fsdp", "the plan shards the model (zero, dp_shard)", "leave fsdp unset; pin zero with fix='zero=3'"),
    ("deepspeed", "the plan shards the model (zero, dp_shard)", "leave deepspeed unset; pin zero with fix='zero=3'"),
    ("torch_compile", "the plan compiles per block (compile)",
     "leave torch_compile off; pin it with fix='compile=true'"),
    # transformers 5 folds its deprecated alias gradient_checkpointing into this field
    ("activation_checkpointing", "the plan recomputes (recompute)", "leave it off; pin it with fix='recompute=full'"),
)


def check_arguments(args: TrainingArguments) -> None:
    """One ConfigError line for the first TrainingArguments field AutoparTrainer cannot honour."""
    for name, why, fix in REFUSED:
        if getattr(args, name, None):
            raise ConfigError(f"TrainingArguments.{name}", f"{getattr(args, name)!r}: {why}", fix)
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy != "no":
        raise ConfigError("TrainingArguments.save_strategy", f"{strategy!r}: the Trainer's checkpoints pickle each "
                          "rank's shards", "save_strategy='no', and save with trainer.autopar.save(folder)")


@contextmanager
def traceable_on_meta(model: nn.Module) -> Iterator[None]:
    """An HF model's ``config.use_cache`` on while it is planned: with the cache off (the Trainer's default)
    transformers builds its causal mask through a ``.item()`` the meta trace cannot run; restored after."""
    config = getattr(model, "config", None)
    before = getattr(config, "use_cache", None)
    if before is not None:
        config.use_cache = True
    try:
        yield
    finally:
        if before is not None:
            config.use_cache = before


class AutoparTrainer(Trainer):
    """A ``transformers.Trainer`` whose model runs autopar's plan (see the module docstring); ``fix`` pins plan
    fields (``"tp=2"``, ``{"zero": 3}``), ``planner_options`` are ``prepare``'s (``cluster``, ``top``,
    ``print_plan``, ...). After ``train()`` starts, ``trainer.autopar`` holds the plan, the report and
    ``save`` / ``load``. Without ``args``: ``TrainingArguments(output_dir="tmp_trainer", save_strategy="no")``."""

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, *more: Any,
                 fix: str | Mapping[str, Any] | None = None, planner_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer", save_strategy="no")
        check_arguments(args)  # before the Trainer builds an Accelerator for options the plan replaces
        options = dict(planner_options or {})
        if "global_batch" in options:
            raise ConfigError("global_batch", "AutoparTrainer reads the batch from TrainingArguments",
                              "set per_device_train_batch_size and leave global_batch out")
        self._autopar_options = {"fix": fix, **options}
        self.autopar: AcceleratePlanning | None = None
        super().__init__(model, args, *more, **kwargs)

    # ------------------------------------------------------------- the data, over the plan's dp ranks
    def get_train_dataloader(self) -> Any:
        return self._over_dp_ranks(super().get_train_dataloader)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return self._over_dp_ranks(lambda: super(AutoparTrainer, self).get_eval_dataloader(eval_dataset))

    def _over_dp_ranks(self, build: Callable[[], Any]) -> Any:
        """The Trainer's DataLoader (its collator, sampler and workers) before Accelerate shards it over every
        process, planned on (the first one), then sharded over the plan's data-parallel ranks. While ``build`` runs,
        this Trainer's Accelerator hands DataLoaders back as they are (its public ``prepare_data_loader``, set on
        the instance and removed after), so the Trainer's own loader construction is reused unchanged."""
        acc = self.accelerator
        acc.prepare_data_loader = lambda loader, *_, **__: loader
        try:
            loader = build()
        finally:
            del acc.prepare_data_loader  # Accelerate's own method again
        planning = self.autopar if self.autopar is not None else self._plan(loader)
        return planning.prepare_loader(loader)

    # ------------------------------------------------------------- planning and applying
    def _plan(self, loader: Any) -> AcceleratePlanning:
        """Plan and apply on ``self.model`` (autopar's layers, in place), keep a user's optimizer on the new
        parameters, and let Accelerate add only its autocast to the model."""
        model = self.model
        planning = AcceleratePlanning(self.accelerator, model, loader, **self._autopar_options)
        names = {id(p): name for name, p in model.named_parameters()}
        with traceable_on_meta(model):
            planning.setup(model, None, autocast=False)
        if self.optimizer is not None:  # passed as Trainer(optimizers=(optimizer, scheduler))
            planning.adopt_optimizer(self.optimizer, names)
        # autocast as Accelerate adds it; the model is marked prepared, so the Trainer's prepare does not wrap it
        self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        self._mixed_mesh_grads = False  # private (module docstring): the Trainer clips through the Accelerator
        self.autopar = planning
        return planning

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """The Trainer's optimizer, built on the applied parameters, adopted by the plan (TP row order, offload,
        checkpoints)."""
        built = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if built and self.autopar is not None:
            self.autopar.adopt_optimizer(optimizer)
        return optimizer

    def get_tp_size(self) -> int:
        """The ranks that read one batch (world / dp): the Trainer divides the processes by this for its total
        batch (``get_total_train_batch_size``: per-device x accumulation x dp) and its token count across
        processes, so each row counts once."""
        if self.autopar is None or self.autopar.plan is None:
            return super().get_tp_size()
        return self.accelerator.num_processes // self.autopar.plan.dp
