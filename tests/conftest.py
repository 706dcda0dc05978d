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


# A rank can abort in the interpreter's teardown after its work is done (a C++ thread destroyed while joinable,
# seen about once in fifteen gloo launches here, with the process group destroyed at exit or not); the root cause
# is open (see BENCHMARKS.md / the issue notes). When every scenario's result file was written before it, the results
# stand and the abort is reported as a warning; anything else still fails the launch.
EXIT_ABORT = "terminate called without an active exception"


def aborted_only_at_exit(proc: subprocess.CompletedProcess, files: list[Path]) -> bool:
    """A launch whose only failure is a rank's abort in interpreter teardown (EXIT_ABORT, exit -6) after every one
    of ``files`` was written: the work is done and checked by the test (the abort is an open issue, not a result)."""
    text = proc.stdout + proc.stderr
    return (EXIT_ABORT in text and (proc.returncode == -6 or "exitcode: -6" in text)
            and all(f.exists() for f in files))


def check_launch(proc: subprocess.CompletedProcess, files: list[Path], what: str) -> None:
    """Fail on a failed launch, unless it only aborted at exit after writing ``files`` (then a warning)."""
    if proc.returncode == 0:
        return
    if aborted_only_at_exit(proc, files):
        import warnings

        warnings.warn(f"{what}: a rank aborted at exit after writing every result ({EXIT_ABORT})", stacklevel=2)
        return
    pytest.fail(f"{what} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def run_scenarios(tmp_path_factory, nproc: int, names: list[str], script: str = "scenarios.py") -> Path:
    out = tmp_path_factory.mktemp(f"{Path(script).stem}_w{nproc}")
    proc = torchrun(DIST / script, nproc, str(out), ",".join(names))
    check_launch(proc, [out / f"{n}.pt" for n in names], f"torchrun {script} ({nproc} procs)")
    return out
