"""Clean exits: N consecutive 2-process launches of a finished tiny run, as users launch it (plain torchrun,
nothing in the environment), counting the exit codes. A finished run must exit 0 every time: a rank that
aborts in interpreter teardown ("terminate called without an active exception", -6) makes torchrun report
the job as failed and, under --max-restarts, run it again.

    python scripts/exit_loop.py                 # 100 launches
    python scripts/exit_loop.py -n 30 --nproc 2

Each launch trains a tiny GPT for 4 steps with strategy="autopar" (dp=2) and a checkpoint every 2 steps
(the callback's threads and store calls are part of what has to end cleanly). Prints one line per failed
launch (its exit code and last stderr line) and a summary: launches, exit-code counts, seconds per launch.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(out: Path) -> None:
    """The tiny run of one launch (run by each torchrun worker)."""
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_autopar.callbacks import AutoCheckpoint
    from lightning_autopar.models import GPTConfig
    from lightning_autopar.models.lit import LitGPT
    from lightning_autopar.strategy import AutoParallelStrategy

    L.seed_everything(0, verbose=False)
    tokens = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    module = LitGPT(GPTConfig(vocab=64, seq_len=16, layers=2, hidden=32, heads=4, ffn_hidden=64))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=4,
                        strategy=AutoParallelStrategy(fix="dp=2", cluster="cpu", print_plan=False),
                        callbacks=[AutoCheckpoint(out, every_n_steps=2)], logger=False,
                        enable_checkpointing=True, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(Path(__file__).resolve()), "--worker", str(out)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--launches", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--keep-logs", type=Path, help="write each failed launch's output to DIR/launch_N.log")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    codes: collections.Counter[int] = collections.Counter()
    aborts = 0
    start = time.monotonic()
    for i in range(args.launches):
        with tempfile.TemporaryDirectory(prefix="exit_loop") as out:
            proc = launch(args.nproc, Path(out))
        codes[proc.returncode] += 1
        text = proc.stdout + proc.stderr
        aborts += "terminate called" in text
        if proc.returncode != 0:
            errors = [line for line in text.splitlines() if "Error" in line or "error" in line or "terminate" in line]
            print(f"launch {i + 1}: exit {proc.returncode}: {(errors or ['(no error line)'])[-1][:300]}", flush=True)
            if args.keep_logs:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                (args.keep_logs / f"launch_{i + 1}.log").write_text(text)
    took = time.monotonic() - start
    summary = ", ".join(f"exit {code}: {count}" for code, count in sorted(codes.items()))
    print(f"{args.launches} launches of {args.nproc} processes: {summary}; 'terminate called' in {aborts}; "
          f"{took / max(1, args.launches):.1f} s per launch")
    sys.exit(0 if set(codes) == {0} else 1)


if __name__ == "__main__":
    main()
