"""Repeated faults: a 60-step run under ``torchrun --max-restarts 5`` with 3 SIGKILLs at random ranks and times
(inside a step, or inside a checkpoint write), against the same run uninterrupted.

    python scripts/soak.py [--runs 5] [--seed 0] [--steps 60] [--kills 3] [--out /tmp/autopar-soak]

Each run draws its kills from its own seed (``seed + run``): a rank, a step and a phase each; "step" kills the
rank before that step's optimizer step, "write" kills it at a random moment of the first checkpoint write at or
after that step (the shards part-written, or written and not yet published). Checks per run: the job ends with
exit 0 after every kill happened; each resume loaded a checkpoint that was complete (marker and every file size),
whose ranks' step records agree, at the step its name and marker say; the final parameters equal the
uninterrupted run's (bit for bit; the largest difference is printed). The model, data and plan are the callback
tests' (tests/dist): the tiny GPT on 2 processes, dp=2 zero=3 with 2 micro-batches, a checkpoint every 5 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = "dp=2,zero=3,grad_accum=2"
EVERY = 5
WORLD = 2


# ============================================================================================ the worker


def worker(run_dir: Path, steps: int) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "dist"))
    import lightning.pytorch as L
    import torch
    from scenarios import fit, full_state

    from lightning_autopar.callbacks import AutoCheckpoint
    from lightning_autopar.callbacks.checkpoint import MARKER, mixed_steps, verify

    rank = int(os.environ["RANK"])
    kills = json.loads((run_dir / "kills.json").read_text()) if (run_dir / "kills.json").exists() else []
    pending = next((i for i in range(len(kills)) if not (run_dir / f"kill{i}.done").exists()), None)

    def die(i: int) -> None:
        (run_dir / f"kill{i}.done").write_text(json.dumps({"rank": rank, "time": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)

    class Faults(L.Callback):
        """Arms this attempt's next kill on its rank; audits what the attempt resumed from."""

        def on_train_start(self, trainer, pl_module):
            ckpt = next(c for c in trainer.callbacks if isinstance(c, AutoCheckpoint))
            if rank == 0:
                path = ckpt.resumed_from
                entry = {"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), "path": str(path),
                         "global_step": trainer.global_step}
                if path is not None:
                    entry.update(incomplete=verify(path), mixed=mixed_steps(path),
                                 marker_step=json.loads((path / MARKER).read_text())["step"])
                with open(run_dir / "resumes.jsonl", "a") as f:
                    f.write(json.dumps(entry) + "\n")
            if pending is None or kills[pending]["rank"] != rank or kills[pending]["phase"] != "write":
                return
            kill, strategy = kills[pending], trainer.strategy
            original = strategy.save_checkpoint

            def save_checkpoint(*args, **kwargs):
                if trainer.global_step < kill["step"]:
                    return original(*args, **kwargs)
                threading.Timer(kill["delay"], die, (pending,)).start()  # somewhere inside the write
                original(*args, **kwargs)
                die(pending)  # the write finished first: killed before the checkpoint is published

            strategy.save_checkpoint = save_checkpoint

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if pending is None:
                return
            kill = kills[pending]
            if kill["rank"] == rank and kill["phase"] == "step" and trainer.global_step + 1 == kill["step"]:
                die(pending)

    ckpt = AutoCheckpoint(run_dir / "checkpoints", every_n_steps=EVERY, keep_last=2)
    _, module, _, _ = fit(PLAN, steps=steps, extra_callbacks=[ckpt, Faults()], enable_checkpointing=True)
    state = full_state(module)
    if rank == 0:
        torch.save(state, run_dir / "final.pt")


# ============================================================================================ the driver


def launch(run_dir: Path, steps: int, restarts: int) -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", f"--max-restarts={restarts}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", str(Path(__file__).resolve()),
           "--worker", str(run_dir), "--steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(run_dir / "launch.log", "w") as log:
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)


def draw_kills(seed: int, steps: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    kills = [{"rank": rng.randrange(WORLD), "step": rng.randrange(2, steps - EVERY), "phase": rng.choice(["step", "write"]),
              "delay": round(rng.uniform(0.0, 0.05), 4)} for _ in range(count)]
    return sorted(kills, key=lambda k: k["step"])


def soak_run(out: Path, run: int, seed: int, steps: int, count: int, reference: dict) -> dict:
    import torch

    run_dir = out / f"run{run}"
    run_dir.mkdir(parents=True)
    kills = draw_kills(seed, steps, count)
    (run_dir / "kills.json").write_text(json.dumps(kills))
    started = time.monotonic()
    proc = launch(run_dir, steps, restarts=5)
    wall = time.monotonic() - started
    problems = []
    if proc.returncode != 0:
        problems.append(f"launch exit {proc.returncode} (see {run_dir / 'launch.log'})")
    done = [(run_dir / f"kill{i}.done").exists() for i in range(count)]
    if not all(done):
        problems.append(f"kills not delivered: {[i for i, d in enumerate(done) if not d]}")
    resumes = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    loaded = [r for r in resumes if r["path"] != "None"]
    for r in loaded:
        if r["incomplete"] or r["mixed"] or r["marker_step"] != r["global_step"] \
                or not r["path"].endswith(f"step={r['global_step']:08d}"):
            problems.append(f"attempt {r['attempt']} loaded a bad checkpoint: {r}")
    diff = None
    if (run_dir / "final.pt").exists():
        final = torch.load(run_dir / "final.pt", weights_only=True)
        diff = max((final[k] - v).abs().max().item() for k, v in reference.items())
        if set(final) != set(reference) or any(not torch.equal(final[k], v) for k, v in reference.items()):
            problems.append(f"final parameters differ from the uninterrupted run (max |diff| {diff:.3g})")
    else:
        problems.append("no final parameters")
    return {"run": run, "seed": seed, "kills": kills, "attempts": len(resumes),
            "resumed_from": [Path(r["path"]).name for r in loaded], "max_diff": diff, "wall_s": round(wall, 1),
            "problems": problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/autopar-soak"))
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps)
        return
    import shutil

    import torch

    shutil.rmtree(args.out, ignore_errors=True)
    ref_dir = args.out / "reference"
    ref_dir.mkdir(parents=True)
    proc = launch(ref_dir, args.steps, restarts=0)
    if proc.returncode != 0:
        sys.exit(f"soak: the uninterrupted run failed (exit {proc.returncode}, see {ref_dir / 'launch.log'})")
    reference = torch.load(ref_dir / "final.pt", weights_only=True)
    results = [soak_run(args.out, i, args.seed + i, args.steps, args.kills, reference) for i in range(args.runs)]
    for r in results:
        kills = ", ".join(f"rank {k['rank']} {k['phase']}@{k['step']}" for k in r["kills"])
        print(f"run {r['run']} (seed {r['seed']}): kills {kills}; {r['attempts']} attempts, resumed from "
              f"{r['resumed_from']}; max |diff| {r['max_diff']}; {r['wall_s']} s; "
              f"{'OK' if not r['problems'] else 'FAILED: ' + '; '.join(r['problems'])}")
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    failed = [r for r in results if r["problems"]]
    print(f"soak: {len(results) - len(failed)}/{len(results)} runs equal to the uninterrupted run, "
          f"no incomplete or mixed checkpoint loaded" if not failed else f"soak: {len(failed)} runs FAILED")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
