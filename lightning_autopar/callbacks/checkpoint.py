"""``AutoCheckpoint``: periodic sharded checkpoints that are complete or invisible, and automatic resume.

Layout of ``dirpath``::

    step=00000040/          a published checkpoint: the strategy's own format (torch.distributed.checkpoint
      .metadata, __*.distcp   shards of model and optimizers, plus ``meta.pt`` with loops, LR schedulers,
      meta.pt                 callback states ...),
      steps/rank=00000.json   every rank's own step, written by that rank (a checkpoint whose ranks disagree is
                              refused: ``mixed_steps``), and
      COMPLETE.json           the completion marker: step, world size, plan, every file with its size
    .tmp-step=00000048/     being written (never read)

A checkpoint is written into ``.tmp-*`` by ``trainer.save_checkpoint`` (all ranks), then rank 0 writes the
marker and renames the folder to its final name: readers see a whole checkpoint or none. The last
``keep_last`` complete checkpoints are kept.

Resume: when ``fit()`` is called without ``ckpt_path`` and ``dirpath`` holds a complete checkpoint, the newest
one is restored. Lightning restores a ``ModelParallelStrategy`` checkpoint after ``strategy.setup`` (which
plans for the live world size), from the ``ckpt_path`` that ``fit()`` resolved before any callback runs;
``setup()`` therefore wraps the trainer's checkpoint connector's ``resume_start`` (``runtime.lightning_private``)
so that a missing path becomes the newest complete checkpoint. DCP reshards to the new plan, so a run saved on 4 processes
continues on 2. A checkpoint that fails verification (no marker, a missing or truncated file) or fails to
load is skipped with a warning and the previous one is used.

Fault recovery: run under ``torchrun --max-restarts N`` (a killed rank makes torchrun restart every worker, and
the new ``fit()`` resumes here). Nothing else is needed: the workers share the elastic agent's store across
attempts, and the strategy gives each attempt's process group keys of its own (``topology/worker.py``), so a
restarted worker never reads the dead attempt's addresses.

What is saved besides model, optimizers and LR schedulers (Lightning's checkpoint): every rank's RNG
states (torch, CUDA, numpy, python) and the position in the epoch. Lightning resumes a plain DataLoader
at the start of the epoch; the training DataLoader is made resumable (``make_resumable``: Lightning's
``state_dict``/``load_state_dict`` protocol for loaders), so the data continues at the next batch.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import time
import warnings
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Checkpoint

from lightning_autopar.callbacks._io import write_json
from lightning_autopar.files import fsync_dir
from lightning_autopar.runtime import lightning_private as private

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"
STEPS_DIR = "steps"
_NAME = re.compile(r"^step=(\d+)$")
_TMP_PREFIX = ".tmp-"


def checkpoint_name(step: int) -> str:
    return f"step={step:08d}"


# ============================================================================================ RNG states


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` accepts."""
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ============================================================================================ resumable loader


class _SkipFirst:
    """An index sampler whose next iteration starts after ``skip`` items; its length stays the full epoch's
    (Lightning counts the batches already done itself)."""

    def __init__(self, base: Any, skip: int) -> None:
        self.base, self.skip = base, skip

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self) -> Any:
        # consumed when the first index is drawn: DataLoader iterators may call iter() more than once
        skip, self.skip = self.skip, 0
        yield from islice(iter(self.base), skip, None)


class _ResumableLoader:
    """Methods given to a DataLoader's class (see ``make_resumable``): Lightning's loader
    ``state_dict``/``load_state_dict`` protocol, so a checkpoint taken mid-epoch resumes at the next batch.
    Skipping happens on the indices: no sample is loaded for it."""

    _autopar_resumable = True
    _autopar_trainer: Any = None
    _autopar_skip = 0
    _autopar_skipping = 0

    def state_dict(self) -> dict[str, int]:
        trainer = self._autopar_trainer
        if trainer is None:
            return {"batches": 0}
        return {"epoch": int(trainer.current_epoch),
                "batches": int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        batches = int(state.get("batches", 0))
        self._autopar_skip = batches if 0 < batches < len(self) else 0  # type: ignore[arg-type]

    @property
    def _index_sampler(self) -> Any:
        base = super(type(self), self)._index_sampler
        return _SkipFirst(base, self._autopar_skipping) if self._autopar_skipping else base

    def _get_iterator(self) -> Any:
        self._autopar_skipping, self._autopar_skip = self._autopar_skip, 0
        try:
            return super(type(self), self)._get_iterator()
        finally:
            self._autopar_skipping = 0


@lru_cache(maxsize=None)
def _resumable_class(cls: type) -> type:
    # a direct subclass with the same layout, so that an existing loader can switch to it in place
    methods = {k: v for k, v in vars(_ResumableLoader).items() if not k.startswith("__")}
    return type(f"Resumable{cls.__name__}", (cls,), {**methods, "__module__": cls.__module__})


def make_resumable(loader: Any, trainer: Any) -> Any:
    """Give a map-style DataLoader (any subclass) the loader state protocol, in place; other iterables and
    loaders that already have it are returned unchanged."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if not getattr(loader, "_autopar_resumable", False):
        if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
            return loader  # e.g. torchdata's StatefulDataLoader
        loader.__class__ = _resumable_class(type(loader))
    loader._autopar_trainer = trainer
    return loader


# ============================================================================================ the directory


def verify(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at ``path`` cannot be used, or None when it is complete."""
    import json

    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        return "no completion marker (partial write)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable completion marker ({err})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        got = f.stat().st_size
        if got != size:
            return f"{name} is truncated or altered ({got} of {size} bytes)"
    return None


def mixed_steps(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at ``path`` must not be loaded because its ranks saved different steps (a save that
    did not wait for a common step boundary), or None. Checkpoints without step records pass."""
    import json

    by_step: dict[int, list[int]] = {}
    for record in sorted((Path(path) / STEPS_DIR).glob("rank=*.json")):
        data = json.loads(record.read_text())
        by_step.setdefault(int(data["step"]), []).append(int(data["rank"]))
    if len(by_step) < 2:
        return None
    parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(r)))} at step {s}"
             for s, r in sorted(by_step.items(), key=lambda item: min(item[1]))]
    return f"checkpoint {path} is mixed: {'; '.join(parts)}; delete it or resume from an earlier one"


def refuse_mixed(path: Any) -> None:
    """Raise the one-line ``mixed_steps`` error when the checkpoint folder at ``path`` is mixed."""
    from lightning_autopar.errors import AutoparError

    if path is not None and Path(path).is_dir() and (reason := mixed_steps(path)) is not None:
        raise AutoparError(reason)


def published(dirpath: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of the published checkpoint folders, newest first (complete or not)."""
    root = Path(dirpath)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def complete_checkpoints(dirpath: str | os.PathLike, warn: bool = True) -> list[Path]:
    """The usable checkpoints, newest first; the others are skipped with a warning."""
    usable = []
    for _, path in published(dirpath):
        reason = verify(path)
        if reason is None:
            usable.append(path)
        elif warn:
            warnings.warn(f"autopar: skipping checkpoint {path}: {reason}", stacklevel=2)
    return usable


def latest_checkpoint(dirpath: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``dirpath`` (what ``AutoCheckpoint`` resumes from)."""
    usable = complete_checkpoints(dirpath)
    return usable[0] if usable else None


# ============================================================================================ the callback


class AutoCheckpoint(Checkpoint):
    """Periodic sharded checkpoints (atomic, last ``keep_last`` kept) and automatic resume from ``dirpath``.

    A Lightning ``Checkpoint`` callback: the Trainer runs it after the other callbacks (a ``StepMonitor`` does
    not count the save in the step time) and adds no default ``ModelCheckpoint`` beside it; it needs
    ``enable_checkpointing=True`` (the default).

    Args:
        dirpath: where checkpoints live; a later ``fit()`` resumes from the newest complete one.
        every_n_steps: save after every n optimizer steps (default 100 unless ``every_n_minutes`` is given).
        every_n_minutes: save when that much wall time has passed since the last save (rank 0's clock).
        keep_last: complete checkpoints to keep.
        async_save: write the shards in the background (``torch.distributed.checkpoint.async_save`` on a
            separate gloo group); the checkpoint is published once written, at the latest by the next save
            or the end of training. Needs a strategy saving distributed checkpoints (``autopar``,
            ``ModelParallelStrategy``); otherwise it falls back to a synchronous save.
        save_on_train_end: also save the final state (if that step is not saved yet).
        resume: restore the newest complete checkpoint when ``fit()`` gets no ``ckpt_path``.
    """

    def __init__(self, dirpath: str | os.PathLike, every_n_steps: int | None = None,
                 every_n_minutes: float | None = None, keep_last: int = 3, async_save: bool = False,
                 save_on_train_end: bool = True, resume: bool = True) -> None:
        from lightning_autopar.errors import ConfigError

        if every_n_steps is None and every_n_minutes is None:
            every_n_steps = 100
        if every_n_steps is not None and every_n_steps < 1:
            raise ConfigError("AutoCheckpoint.every_n_steps", f"must be >= 1, got {every_n_steps}")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ConfigError("AutoCheckpoint.every_n_minutes", f"must be > 0, got {every_n_minutes}")
        if keep_last < 1:
            raise ConfigError("AutoCheckpoint.keep_last", f"must be >= 1, got {keep_last}",
                              "keep at least the newest checkpoint")
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.keep_last = keep_last
        self.async_save = async_save
        self.save_on_train_end = save_on_train_end
        self.resume = resume
        self.resumed_from: Path | None = None
        self.saved: list[Path] = []  # published by this run, in order
        self._candidates: list[str] = []
        self._last_step = -1
        self._last_save_time = time.monotonic()
        self._pending_rng: list[dict[str, Any]] | None = None
        self._pending_async: tuple[Any, Path, Path, int] | None = None
        self._async_group: Any = None
        self._restore: list[tuple[Any, str, Any]] = []

    @property
    def last_model_path(self) -> str:
        """The newest checkpoint this run published ("" before the first)."""
        return str(self.saved[-1]) if self.saved else ""

    best_model_path = ""  # no monitored metric: ckpt_path="best" is not served (use last_model_path)

    # ------------------------------------------------------------------ setup: resume and loader position

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        self._last_step, self.resumed_from = -1, None  # a Trainer may fit more than once
        candidates: list[str] = []
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            for stale in self.dirpath.glob(_TMP_PREFIX + "*"):
                shutil.rmtree(stale, ignore_errors=True)  # a save a crash interrupted: never published
            if self.resume:
                candidates = [str(p) for p in complete_checkpoints(self.dirpath)]
        self._candidates = strategy.broadcast(candidates)
        self._unpatch()  # from a fit that ended without teardown
        self._patch(private.checkpoint_connector(trainer), "resume_start", self._resume_start(trainer))
        self._patch(strategy, "process_dataloader", self._process_dataloader(trainer))
        self._last_save_time = time.monotonic()
        if self.async_save and self._async_group is None and _distributed():
            import torch.distributed as dist

            self._async_group = dist.new_group(backend="gloo")

    def _patch(self, obj: Any, name: str, replacement: Any) -> None:
        self._restore.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, replacement)

    def _resume_start(self, trainer: Any) -> Any:
        original = private.checkpoint_connector(trainer).resume_start

        def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
            if checkpoint_path is not None or trainer.state.fn != "fit" or not self._candidates:
                refuse_mixed(checkpoint_path)
                return original(checkpoint_path, weights_only)
            for path in self._candidates:
                refuse_mixed(path)  # never loaded, and no silent fallback past it either
                try:
                    original(path, weights_only)
                except Exception as err:  # noqa: BLE001 - any load failure means: use the previous one
                    warnings.warn(f"autopar: checkpoint {path} failed to load ({type(err).__name__}: {err}); "
                                  "trying the previous one", stacklevel=2)
                    continue
                self.resumed_from = Path(path)
                if trainer.is_global_zero:
                    print(f"autopar: resuming from {path} on {trainer.world_size} processes", flush=True)
                return None
            return original(None, weights_only)

        return resume_start

    def _process_dataloader(self, trainer: Any) -> Any:
        original = trainer.strategy.process_dataloader

        def process_dataloader(dataloader: Any) -> Any:
            dataloader = original(dataloader)
            return make_resumable(dataloader, trainer) if trainer.training else dataloader

        return process_dataloader

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._pending_async is not None:  # an error ended training: let the write finish, publish nothing
            future, self._pending_async = self._pending_async[0], None
            try:
                future.result(timeout=120)
            except Exception as err:  # noqa: BLE001 - a peer may be gone; the checkpoint stays invisible
                warnings.warn(f"autopar: background checkpoint write did not finish ({err})", stacklevel=2)
        self._unpatch()

    def _unpatch(self) -> None:
        while self._restore:
            obj, name, previous = self._restore.pop()
            if previous is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, previous)

    # ------------------------------------------------------------------ state carried in the checkpoint

    def state_dict(self) -> dict[str, Any]:
        states = [rng_state()]
        if _distributed():
            import torch.distributed as dist

            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, rng_state())
        return {"rng": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._pending_rng:  # last, so nothing between restore and the first step moves the generators
            states = self._pending_rng
            set_rng_state(states[trainer.global_rank % len(states)])
            self._pending_rng = None

    # ------------------------------------------------------------------ saving

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # Lightning is accumulating: no optimizer step since the last call
            return
        self._last_step = step
        if self._due(trainer, step):
            self.save(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_on_train_end:
            self.save(trainer)
        self._publish_async(trainer)

    def _due(self, trainer: Any, step: int) -> bool:
        if self.every_n_steps is not None and step % self.every_n_steps == 0:
            return True
        if self.every_n_minutes is None:
            return False
        elapsed = time.monotonic() - self._last_save_time >= 60 * self.every_n_minutes
        return bool(trainer.strategy.broadcast(elapsed))  # rank 0's clock decides for everyone

    def save(self, trainer: Any, wait: bool = False) -> Path | None:
        """Save the current state now (all ranks call it); returns the published path (None while async, unless
        ``wait``: then an async write is published before returning)."""
        step = trainer.global_step
        final = self.dirpath / checkpoint_name(step)
        tmp = self.dirpath / (_TMP_PREFIX + final.name)
        self._publish_async(trainer)
        exists = False
        if trainer.is_global_zero:
            exists = final.is_dir() and verify(final) is None
            if not exists:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(final, ignore_errors=True)
                tmp.mkdir(parents=True)
        if trainer.strategy.broadcast(exists):
            return final  # this step is already saved (same state: training is deterministic per step)
        started = time.monotonic()
        self._last_save_time = started
        # this rank's own step, beside the shards: the loader refuses a folder whose ranks disagree
        write_json(tmp / STEPS_DIR / f"rank={trainer.global_rank:05d}.json", {"rank": trainer.global_rank, "step": step})
        if self.async_save and self._can_save_async(trainer):
            future = self._save_async(trainer, tmp)
            self._pending_async = (future, tmp, final, step)
            if not wait:
                return None
            self._publish_async(trainer)
            return final
        trainer.save_checkpoint(tmp)
        return self._publish(trainer, tmp, final, step, started)

    def _can_save_async(self, trainer: Any) -> bool:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = trainer.strategy
        if isinstance(strategy, ModelParallelStrategy) and private.saves_distributed_checkpoint(strategy):
            return True
        warnings.warn("autopar: async_save needs a strategy that saves distributed checkpoints; saving "
                      "synchronously", stacklevel=2)
        self.async_save = False
        return False

    def _save_async(self, trainer: Any, tmp: Path) -> Any:
        import torch.distributed.checkpoint as dcp

        checkpoint = private.dump_checkpoint(trainer)
        # the layout ModelParallelStrategy.save_checkpoint writes (and load_checkpoint reads)
        shards = {"state_dict": checkpoint.pop("state_dict")}
        shards.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        future = dcp.async_save(shards, checkpoint_id=tmp, process_group=self._async_group)
        if trainer.is_global_zero:
            torch.save(checkpoint, tmp / private.metadata_filename())
        return future

    def _publish_async(self, trainer: Any) -> None:
        if self._pending_async is None:
            return
        future, tmp, final, step = self._pending_async
        self._pending_async = None
        future.result()
        trainer.strategy.barrier("autopar-async-checkpoint")
        self._publish(trainer, tmp, final, step, self._last_save_time)

    def _publish(self, trainer: Any, tmp: Path, final: Path, step: int, started: float) -> Path:
        """Rank 0: completion marker, then one rename makes the checkpoint visible; prune; all ranks wait."""
        if trainer.is_global_zero:
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
            plan = getattr(trainer.strategy, "plan", None)
            write_json(tmp / MARKER, {
                "format": 1, "step": step, "epoch": trainer.current_epoch, "world_size": trainer.world_size,
                "plan": plan.to_dict() if plan is not None else None, "files": files, "created": time.time(),
            })
            os.rename(tmp, final)
            fsync_dir(self.dirpath)
            self._prune()
            log.info("autopar: checkpoint %s (%.2fs)", final, time.monotonic() - started)
        trainer.strategy.barrier("autopar-checkpoint-published")
        self.saved.append(final)
        return final

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints and anything newer; delete the rest."""
        kept = 0
        for _, path in published(self.dirpath):
            if kept >= self.keep_last:
                shutil.rmtree(path, ignore_errors=True)
            elif verify(path) is None:
                kept += 1


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
