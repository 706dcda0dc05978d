"""Scenarios for the training-time callbacks, run under torchrun by tests/test_callbacks.py.

Usage: torchrun --nproc-per-node N [--max-restarts R] tests/dist/callback_scenarios.py OUT_DIR name[,name...]
Each scenario writes OUT_DIR/<name>.pt on rank 0 (see scenarios.record), or OUT_DIR/<name>.crash.pt with the
traceback. A scenario already recorded is skipped, so after a restart (torchrun --max-restarts) the job continues
with the interrupted scenario.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scenarios  # noqa: E402
from common import GLOBAL_BATCH, STEPS  # noqa: E402
from scenarios import fit, full_state, record  # noqa: E402

import lightning.pytorch as L  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_autopar.callbacks import AutoCheckpoint, Overlap, Rebalance, StepMonitor  # noqa: E402

PLAN = "dp=2,zero=3,grad_accum=2"  # sharded states and two micro-batches per rank: nothing trivial to restore
KILL_AT = 5


def overlap() -> Overlap:
    """Deeper prefetching and two reduce-scatter buffers: must not change a bit of the training."""
    return Overlap(forward_prefetch=2, backward_prefetch=2, reduce_scatter_buffers=2)


class KillRank(L.Callback):
    """SIGKILL this process (rank ``rank``) after optimizer step ``at``, once per ``flag`` file."""

    def __init__(self, flag: Path, rank: int = 1, at: int = KILL_AT) -> None:
        self.flag, self.rank, self.at = flag, rank, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at and trainer.global_rank == self.rank and not self.flag.exists():
            self.flag.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)


class SlowRank(L.Callback):
    """A busy loop of ``seconds`` on rank ``rank`` at the start of every step: a slow host."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank:
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                pass


def names(paths) -> list[str]:
    return [p.name for p in paths]


def checkpointed(out: Path, name: str, *callbacks, steps: int = STEPS, fix: str = PLAN, **kwargs):
    """One fit with an AutoCheckpoint in out/name every 2 steps; returns (trainer, module, losses, plan, ckpt)."""
    ckpt = AutoCheckpoint(out / name, every_n_steps=2, keep_last=3, **kwargs.pop("ckpt_kwargs", {}))
    trainer, module, losses, plan = fit(fix, steps=steps, extra_callbacks=[ckpt, *callbacks], enable_checkpointing=True,
                                        **kwargs)
    return trainer, module, losses, plan, ckpt


def run(out: Path, name: str) -> None:
    rank = int(os.environ.get("RANK", 0))
    if name == "plain":
        # uninterrupted, with the monitor and a CSV logger (its report is checked too)
        monitor = StepMonitor(warmup_steps=2, window=3, probe_every_n_steps=3, report_path=out / "monitor.png")
        logger = L.loggers.CSVLogger(out / "logs", name="plain", version=0)
        knobs = overlap()
        trainer, module, losses, plan, ckpt = checkpointed(out, name, monitor, knobs, logger=logger)
        record(out, name, losses=losses, state=full_state(module), plan=plan, saved=names(ckpt.saved),
               overlap=knobs.applied,
               records=[vars(r) for r in monitor.records], warnings=monitor.warnings,
               png=str(monitor.png_path), csv=str(monitor.csv_path), log_dir=trainer.log_dir)
    elif name == "killed":
        # rank 1 is SIGKILLed after step 5; torchrun restarts the job, which resumes from step 4
        trainer, module, losses, plan, ckpt = checkpointed(out, name, overlap(), KillRank(out / "killed.flag"))
        record(out, name, losses=losses, state=full_state(module), plan=plan,
               resumed_from=str(ckpt.resumed_from), restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
               agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
               opt_out=os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"))
    elif name == "truncated":
        checkpointed(out, name, steps=4)
        dist.barrier()
        if rank == 0:  # newest: truncate a shard; a newer folder without marker; a stale temp folder
            shard = sorted((out / name / "step=00000004").glob("*.distcp"))[0]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            (out / name / "step=00000006").mkdir()
            (out / name / ".tmp-step=00000008").mkdir()
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer, module, losses, plan, ckpt = checkpointed(out, name)
        record(out, name, losses=losses, state=full_state(module), resumed_from=str(ckpt.resumed_from),
               warnings=[str(w.message) for w in caught if "autopar" in str(w.message)],
               left=sorted(p.name for p in (out / name).iterdir()))
    elif name == "rebalance":
        # the user pinned a slow split; the re-plan moves to a faster one with the same global batch
        monitor = StepMonitor(warmup_steps=1, window=2, probe_every_n_steps=2, report_path=False)
        rebalance = Rebalance(check_every_n_steps=3, patience=1, tolerance=0.0, respect_fix=False)
        trainer, module, losses, plan, ckpt = checkpointed(out, name, monitor, rebalance,
                                                           fix="dp=2,zero=0,mbs=1,grad_accum=4")
        record(out, name, losses=losses, state=full_state(module), plan=plan, switches=rebalance.switches,
               saved=names(ckpt.saved))
    elif name == "lightning_accum":
        # Lightning accumulates 2 loader batches of 4 rows; the plan cuts each into 2 micro-batches per rank
        trainer, module, losses, plan = fit("dp=2,zero=3,grad_accum=2", batch_size=GLOBAL_BATCH // 2,
                                            accumulate_grad_batches=2)
        record(out, name, losses=losses, state=full_state(module), plan=plan)
    elif name == "elastic_save":
        # 4 processes, a tensor-parallel plan, async checkpoints; stops after step 4
        trainer, module, losses, plan, ckpt = checkpointed(out, "elastic", steps=STEPS // 2, fix="tp=2,dp=2,zero=3",
                                                           ckpt_kwargs={"async_save": True})
        record(out, name, losses=losses, plan=plan, saved=names(ckpt.saved))
    elif name == "straggler":
        # rank 3 computes 0.3 s longer every step; every step profiled after the first
        monitor = StepMonitor(warmup_steps=1, window=3, probe_every_n_steps=1, report_path=out / "straggler.png")
        trainer, module, losses, plan = fit("dp=4,zero=0", extra_callbacks=[monitor, SlowRank(3, 0.3)])
        record(out, name, warnings=monitor.warnings, stragglers=monitor.stragglers, png=str(monitor.png_path),
               rank_times=[[vars(r) for r in probe] for probe in monitor.rank_times])
    elif name == "elastic_resume":
        # the same directory on 2 processes: planned for 2, resharded by DCP, continues at step 5
        trainer, module, losses, plan, ckpt = checkpointed(out, "elastic", fix=None)
        record(out, name, losses=losses, state=full_state(module), plan=plan, resumed_from=str(ckpt.resumed_from))
    else:
        scenarios.run(out, name)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2].split(","):
        if (out / f"{name}.pt").exists():
            continue  # done before a restart
        try:
            run(out, name)
        except Exception:
            record(out, f"{name}.crash", crash=traceback.format_exc())  # not <name>.pt: a restart retries it
            raise
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main()
