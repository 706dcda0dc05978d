"""Shared fixtures: run torchrun scenario batches once per world size and cache their outputs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ["AUTOPAR_CACHE"] = tempfile.mkdtemp(prefix="autopar_cache")  # tests never read or write a user's cache
DIST = Path(__file__).resolve().parent / "dist"
sys.path.insert(0, str(DIST))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path | str, nproc: int, *args: str, timeout: int = 900, extra_env: dict | None = None,
             torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun on localhost; returns the completed process (output captured)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *torchrun_args, str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check_launch(proc: subprocess.CompletedProcess, what: str) -> None:
    """Fail unless the launch exited 0: a finished run exits cleanly on every rank (no abort at teardown is
    tolerated; topology/worker.start_heartbeat says what caused one)."""
    if proc.returncode != 0:
        pytest.fail(f"{what} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def run_scenarios(tmp_path_factory, nproc: int, names: list[str], script: str = "scenarios.py") -> Path:
    out = tmp_path_factory.mktemp(f"{Path(script).stem}_w{nproc}")
    proc = torchrun(DIST / script, nproc, str(out), ",".join(names))
    check_launch(proc, f"torchrun {script} ({nproc} procs)")
    return out
