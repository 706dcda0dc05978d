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
from common import GLOBAL_BATCH, STEPS, settled  # noqa: E402
from pp_scenarios import gathered_state  # noqa: E402
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

class SignalAt(L.Callback):
    """Send ``signum`` to this process on ``ranks`` inside step ``at`` (before its optimizer step), once per
    ``flag`` file and rank."""

    def __init__(self, flag: Path, signum: int, ranks: tuple[int, ...], at: int) -> None:
        self.flag, self.signum, self.ranks, self.at = flag, signum, ranks, at

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        flag = self.flag.with_name(f"{self.flag.name}.r{trainer.global_rank}")
        if trainer.global_step + 1 == self.at and trainer.global_rank in self.ranks and not flag.exists():
            flag.write_text("signalled")
            os.kill(os.getpid(), self.signum)


def stopped_with(out: Path, name: str, rank: int, fit_call):
    """Run ``fit_call``; a SystemExit (a preemption stop) is written to out/name.exit.r<rank> and re-raised."""
    try:
        return fit_call()
    except SystemExit as stop:
        (out / f"{name}.exit.r{rank}").write_text(str(stop.code))
        raise


def exit_codes(out: Path, name: str) -> list[int]:
    return [int((out / f"{name}.exit.r{r}").read_text()) for r in range(int(os.environ["WORLD_SIZE"]))]


def slurm_variables(out: Path, rank: int) -> dict[str, str]:
    """The variables an ``srun`` task of a 1-node, WORLD_SIZE-task job gets, and a stand-in ``scontrol`` first
    on PATH that appends its arguments to out/scontrol.log."""
    bin_dir = out / f"bin.r{rank}"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {out / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    world = os.environ["WORLD_SIZE"]
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": world,
            "SLURM_NTASKS_PER_NODE": world, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": os.environ["LOCAL_RANK"], "SLURM_NODELIST": "127.0.0.1",
            "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def names(paths) -> list[str]:
    return [p.name for p in paths]


def checkpointed(out: Path, name: str, *callbacks, steps: int = STEPS, fix: str = PLAN, **kwargs):
    """One fit with an AutoCheckpoint in out/name every 2 steps; returns (trainer, module, losses, plan, ckpt)."""
    ckpt = AutoCheckpoint(out / name, **{"every_n_steps": 2, "keep_last": 3, **kwargs.pop("ckpt_kwargs", {})})
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
    elif name in ("killed", "killed_node1"):
        # killed: rank 1 is SIGKILLed after step 5; torchrun restarts the job, which resumes from step 4.
        # killed_node1 (a two-node launch, HSDP with the shards inside a node): the same for the last rank, on the
        # second node; both agents restart their workers.
        world = int(os.environ["WORLD_SIZE"])
        rank, fix = (1, PLAN) if name == "killed" else (world - 1, f"dp={world},zero=3,dp_shard=2,grad_accum=2")
        trainer, module, losses, plan, ckpt = checkpointed(out, name, overlap(),
                                                           KillRank(out / f"{name}.flag", rank=rank), fix=fix)
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
    elif name == "preempt_usr1":
        # SLURM's requeue signal to rank 0 alone inside step 3, under SLURM's variables (Lightning's SLURMEnvironment
        # with auto-requeue): both ranks stop after step 3 with one checkpoint, rank 0 runs `scontrol requeue`,
        # every process exits 138; torchrun restarts the job (as SLURM would requeue it) and it resumes
        from lightning.fabric.plugins.environments import SLURMEnvironment

        saved_env = dict(os.environ)
        os.environ.update(slurm_variables(out, rank))
        try:
            trainer, module, losses, plan, ckpt = stopped_with(out, name, rank, lambda: checkpointed(
                out, name, SignalAt(out / name, signal.SIGUSR1, (0,), 3), plugins=[SLURMEnvironment()]))
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
        log = out / "scontrol.log"
        record(out, name, losses=losses, state=full_state(module), resumed_from=str(ckpt.resumed_from),
               exit_codes=exit_codes(out, name), requeue_calls=log.read_text().splitlines() if log.exists() else [],
               restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    elif name == "preempt_term":
        # SIGTERM to every rank inside step 5 of a pipeline plan (pp=2): one checkpoint of step 5 with both stages
        # at step 5, exit code 143 on both (not Lightning's 0); the next fit resumes there
        fix = "pp=2,grad_accum=2"
        try:
            stopped_with(out, name, rank, lambda: checkpointed(out, name, SignalAt(out / name, signal.SIGTERM, (0, 1), 5),
                                                               fix=fix))
        except SystemExit as stop:
            stopped = stop.code
        else:
            stopped = None
        first = sorted(p.name for p in (out / name).iterdir())
        trainer, module, losses, plan, ckpt = checkpointed(out, name, fix=fix)
        record(out, name, losses=losses, state=gathered_state(module), plan=plan, resumed_from=str(ckpt.resumed_from),
               stopped=stopped, exit_codes=exit_codes(out, name), after_stop=first)
    elif name == "mixed":
        # preempt_term's newest checkpoint, hand-edited so that rank 1's record says step 4 (the marker still
        # verifies): refused in one line, never loaded
        import shutil

        from lightning_autopar.errors import AutoparError

        source = sorted((out / "preempt_term").glob("step=*"))[-1]
        target = out / name / source.name
        if rank == 0:
            shutil.copytree(source, target)
            (target / "steps" / "rank=00001.json").write_text(
                (target / "steps" / "rank=00001.json").read_text().replace('"step": 8', '"step": 7'))
        dist.barrier()
        try:
            checkpointed(out, name, fix="pp=2,grad_accum=2")
        except AutoparError as err:
            record(out, name, error=str(err), target=str(target))
        else:
            record(out, name, error=None, target=str(target))
    else:
        scenarios.run(out, name)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in settled(sys.argv[2].split(",")):
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
