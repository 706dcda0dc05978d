"""Shared fixtures: run torchrun scenario batches once per world size and cache their outputs."""

from __future__ import annotations

import functools
import gc
import inspect
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_SESSION_DIRS = {"AUTOPAR_CACHE": tempfile.mkdtemp(prefix="autopar_cache"),  # tests never touch a user's cache
                 # inductor's compiled kernels: shared by the session's processes (a graph built once is loaded by
                 # the next process that compiles it), never by an earlier session's, so a run does not depend on
                 # what ran before it
                 "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="autopar_inductor")}
os.environ.update(_SESSION_DIRS)
DIST = Path(__file__).resolve().parent / "dist"
# no garbage collection while the test modules and what they import load: those objects are never garbage (see
# tests/dist/common.settled); pytest_collection_finish freezes them and turns collection back on
gc.disable()
sys.path.insert(0, str(DIST))
# this process's own work (single-process references, planner and meta tests) on one core: the launches beside it
# take the other (the lanes below), and with two intra-op threads each small op here would also wait on a spinning
# second thread (measured: 25% more CPU, slower, for the same tests); the launches' workers run one thread each
torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path | str, nproc: int, *args: str, timeout: int = 900, extra_env: dict | None = None,
             torchrun_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun on localhost; returns the completed process (output captured)."""
    env = {**launch_environ(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *torchrun_args, str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def check_launch(proc: subprocess.CompletedProcess, what: str) -> None:
    """Fail unless the launch exited 0: every rank, including its interpreter teardown (issue 28: the teardown
    abort's cause, gloo threads outliving the exit, is fixed in topology.worker.destroy_at_exit; no tolerance)."""
    if proc.returncode == 0:
        return
    pytest.fail(f"{what} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


# ------------------------------------------------------------------------- lanes beside the main thread
#
# This machine has 2 cores, and the main thread's single-process tests use one of them. Two lanes (one thread
# each) run the launches beside it from the moment collection ends:
# * "batches": one launch per world size (run_batch, below), in the order the tests first need them;
# * "waiting": launches that mostly wait (a collective's timeout and a restart, two torchrun agents' rendezvous,
#   killed and restarted ranks): module fixtures whose body is decorated with @background_launch.
# Modules that need no launch, and the tests that stand alone, run first (pytest_collection_modifyitems), so the
# launches overlap them; a fixture or run_scenarios call that needs a launch's result waits for it there (its
# failure, a pytest.fail included, is raised there). Lane bodies only launch and collect; they start from the
# environment as the session began, so a main-thread test's monkeypatched variable never leaks into a launch.

_LANES: dict[str, ThreadPoolExecutor] = {}
_STARTED: dict[Callable, Future] = {}  # @background_launch fixture -> its run
_BATCHES: dict[int, Future] = {}  # world size -> its batch's run
_SESSION_ENV: dict[str, str] = {}
_on_lane = threading.local()


def launch_environ() -> dict[str, str]:
    """The environment a launch starts from: the session's first one on a lane, else the live one."""
    return dict(_SESSION_ENV) if getattr(_on_lane, "active", False) else dict(os.environ)


def _submit(lane: str, fn: Callable, *args: Any) -> Future:
    if lane not in _LANES:
        _LANES[lane] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lane-{lane}")

    def run():
        _on_lane.active = True
        return fn(*args)

    return _LANES[lane].submit(run)


def background_launch(body: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Run the module fixture body ``body(tmp_path_factory)`` on the "waiting" lane (see above)."""

    @functools.wraps(body)
    def fixture(tmp_path_factory):
        future = _STARTED.get(fixture)
        return body(tmp_path_factory) if future is None else future.result()

    fixture.background_body = body
    return fixture


def _fixture_funcs(item) -> list[Callable]:
    """The functions of a test's fixtures (the closest definition of each name)."""
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    return [defs[-1].func for defs in fixtureinfo.name2fixturedefs.values()] if fixtureinfo else []


def _requests_scenarios(func: Callable) -> bool:
    """Whether a fixture body calls run_scenarios (a batch's launch)."""
    code = getattr(func, "__code__", None)
    return code is not None and "run_scenarios" in code.co_names


def _uses_launch(item) -> bool:
    """Whether a test's fixtures include a launch (a batch's run_scenarios or a @background_launch body)."""
    return any(getattr(func, "background_body", None) is not None or _requests_scenarios(func)
               for func in _fixture_funcs(item))


def _stands_alone(item) -> bool:
    """Whether a test needs nothing its module sets up once: no launch, and only function- or session-scoped
    fixtures (running it apart from its module then sets up nothing twice). A test taking ``request`` may ask
    for a launch's fixture by name as it runs (``getfixturevalue``): never alone."""
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    code = getattr(getattr(item, "function", None), "__code__", None)
    if fixtureinfo is None or code is None or _uses_launch(item) or "request" in item.fixturenames:
        return False
    if {"run_scenarios", "getfixturevalue"} & set(code.co_names):
        return False
    return all(defs[-1].scope in ("function", "session") for defs in fixtureinfo.name2fixturedefs.values())


def pytest_collection_modifyitems(session, config, items):
    """Test modules that need no launch first (in their order), then the others (in theirs): see the lanes. The
    tests of a launching module that stand alone (a subprocess of their own, a planner check) go first too: left
    in their module, they ran after its batch, and the last modules' ones after every lane had ended, on one
    core (measured: 25 s of four `python -c` runs at the end of the suite)."""
    launching = {item.path for item in items if _uses_launch(item)}
    items[:] = sorted(items, key=lambda item: item.path in launching and not _stands_alone(item))


def pytest_sessionfinish(session, exitstatus):
    """Launches not yet begun are dropped when the session ends early (-x, an interrupt)."""
    for lane in _LANES.values():
        lane.shutdown(wait=False, cancel_futures=True)


def pytest_unconfigure(config):
    """The session's cache directories go with it (they were left in the temp dir by every run)."""
    for path in _SESSION_DIRS.values():
        shutil.rmtree(path, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--launch-each", action="store_true",
                     help="launch each test file's scenarios on their own (one launch per file and world size, "
                          "for debugging) instead of one launch per world size for the whole session")


# ------------------------------------------------------------------------- batches: one launch per world size
#
# Test files ask for their scenarios with run_scenarios(tmp_path_factory, nproc, names, script=...) in a module
# fixture, as before. Before the first test runs, each such fixture of a selected test is called once in
# "declare" mode (run_scenarios records its request and stops the fixture), and every selected file's scenarios
# of world N are launched together (tests/dist/batch.py) on the "batches" lane; a request waits for its batch. A scenario that fails, or
# that the launch dies or hangs in, gets <name>.pt = {"crash": why} (its own test fails with it) and the
# scenarios not yet run are relaunched. Scripts whose __main__ is not ``main(run)`` keep their own launch.

BATCH_SCRIPT = DIST / "batch.py"
STALL_S = 600  # one scenario running this long: the launch hangs; the scenario is recorded as failed


class _Declared(Exception):
    """Stops a fixture body at its run_scenarios call while requests are being collected."""


_declaring: list[tuple[int, str, list[str]]] | None = None
_planned: dict[int, list[tuple[str, str]]] = {}  # world size -> (script, name) of the selected tests, in order
_launched: dict[int, Path] = {}  # world size -> its batch's output folder
_attempted: set[tuple[int, str, str]] = set()
_launch_each = False


def batchable(script: str) -> bool:
    """``script`` runs its scenarios with scenarios.main(run): its ``run(out, name)`` can run in any launch."""
    import ast

    tree = ast.parse((DIST / script).read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "main"
                and [getattr(a, "id", None) for a in node.args] == ["run"]):
            return True
    return False


def pytest_configure(config):
    global _launch_each
    _launch_each = config.getoption("--launch-each")


def pytest_collection_finish(session):
    """Collect the scenario requests of the selected tests' fixtures (see above)."""
    global _declaring
    _SESSION_ENV.update(os.environ)
    gc.collect()
    gc.freeze()  # the imports and collected modules: later full collections skip them
    gc.enable()
    if session.config.option.collectonly:  # nothing runs: nothing is launched either
        return
    factory = session.config._tmp_path_factory
    for item in session.items:  # the waiting launches, on their lane from now on
        for func in _fixture_funcs(item):
            if getattr(func, "background_body", None) is not None and func not in _STARTED:
                _STARTED[func] = _submit("waiting", func.background_body, factory)
    if _launch_each:
        return
    seen, worlds = set(), {}  # worlds: fixture -> the world sizes its requests launch at
    for item in session.items:
        for func in _fixture_funcs(item):
            if func in seen or not _requests_scenarios(func):
                continue
            seen.add(func)
            if list(inspect.signature(func).parameters) != ["tmp_path_factory"]:
                continue  # not declarable: it launches on its own when it runs
            _declaring = []
            try:
                func(None)
            except BaseException:  # noqa: BLE001  (_Declared, a skip, or a body that needs more than a request)
                pass
            for nproc, script, names in _declaring:
                worlds.setdefault(func, set()).add(nproc)
                if batchable(script):
                    todo = _planned.setdefault(nproc, [])
                    todo += [(script, n) for n in names if (script, n) not in todo]
            _declaring = None
    _after_their_batches(session.items, worlds)
    for nproc, todo in _planned.items():  # in the order the tests first ask for them
        _launched[nproc] = factory.mktemp(f"batch_w{nproc}")
        _attempted.update((nproc, *s) for s in todo)
        _BATCHES[nproc] = _submit("batches", run_batch, _launched[nproc], nproc, list(todo))


def _after_their_batches(items: list, worlds: dict) -> None:
    """Reorder the modules that launch (in place, each module kept whole: its module fixtures run once) by the
    last batch each needs, in the lane's order, and those with a waiting-lane launch after them: the main thread
    checks one batch's results while the next runs, and what it does itself (reference runs, single-process
    tests of those modules) is not left for after the last batch. Modules that need no launch, and the tests
    that stand alone, stay first; the order among modules with the same key stays."""
    lane = list(_planned)
    last: dict = {}
    for item in items:
        funcs = _fixture_funcs(item)
        needs = [lane.index(n) for func in funcs for n in worlds.get(func, ()) if n in _planned]
        if any(getattr(func, "background_body", None) is not None for func in funcs):
            needs.append(len(lane))  # the waiting lane's launches end before the batches: last, never waited on
        elif _uses_launch(item) and not needs:
            needs.append(len(lane))  # a module that launches on its own when it runs
        last[item.path] = max([last.get(item.path, -1), *needs])
    items[:] = sorted(items, key=lambda item: -1 if _stands_alone(item) else last[item.path])


def run_scenarios(tmp_path_factory, nproc: int, names: list[str], script: str = "scenarios.py") -> Path:
    """The folder holding ``<name>.pt`` for each of ``names`` of ``script`` run at world ``nproc``."""
    if _declaring is not None:
        _declaring.append((nproc, script, list(names)))
        raise _Declared
    if not batchable(script):
        out = tmp_path_factory.mktemp(f"{Path(script).stem}_w{nproc}")
        proc = torchrun(DIST / script, nproc, str(out), ",".join(names))
        check_launch(proc, f"torchrun {script} ({nproc} procs)")
        return out
    wanted = [(script, n) for n in names]
    if _launch_each:
        out = tmp_path_factory.mktemp(f"{Path(script).stem}_w{nproc}")
        run_batch(out, nproc, wanted)
        return out / Path(script).stem
    if nproc in _BATCHES:
        _BATCHES[nproc].result()  # the batch started when collection ended
    if nproc not in _launched:
        _launched[nproc] = tmp_path_factory.mktemp(f"batch_w{nproc}")
    todo = [s for s in [*_planned.get(nproc, []), *wanted] if (nproc, *s) not in _attempted]
    if todo:
        _attempted.update((nproc, *s) for s in todo)
        run_batch(_launched[nproc], nproc, list(dict.fromkeys(todo)))
    return _launched[nproc] / Path(script).stem


def last_error_line(log: str) -> str:
    """The last line of a torchrun log that reads like an exception ("SomeError: ..."), else its last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0].split()[-1] if ":" in line else ""
        if head.endswith(("Error", "Exception", "Timeout")):
            return line
    return lines[-1] if lines else "no output"


def _descendants(pid: int) -> list[int]:
    """The process ids below ``pid`` (torchrun's workers run in sessions of their own, so killing torchrun's
    process group would leave them running)."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids = [int(k) for k in children.read_text().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid, *_descendants(kid)]
    return found


def kill_launch(proc: subprocess.Popen) -> None:
    """End a stalled launch: torchrun and each of its workers, by process id."""
    import signal

    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_batch(out: Path, nproc: int, scenarios: list[tuple[str, str]]) -> None:
    """Run ``scenarios`` ((script, name) pairs) at world ``nproc`` in as few launches as they allow: when a launch
    ends early, the scenario that failed (its rank's crash record) or that it hung or died in is recorded as
    failed with the reason, and the scenarios not yet run are relaunched."""
    import time

    progress = out / "_progress"

    def state(script: str, name: str, what: str) -> Path:
        return progress / f"{Path(script).stem}.{name}.{what}"

    def fail(script: str, name: str, why: str) -> None:
        crashes = sorted(progress.glob(f"{Path(script).stem}.{name}.crash_r*.txt"))
        text = "\n".join(c.read_text() for c in crashes) or why
        result = out / Path(script).stem / f"{name}.pt"
        result.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"crash": f"{script}:{name} (batch of world {nproc}): {text}"}, result)

    def done(script: str, name: str) -> bool:
        return len(list(progress.glob(f"{Path(script).stem}.{name}.done_r*"))) == nproc

    env = {**launch_environ(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # as torchrun()
    while todo := [s for s in scenarios if not done(*s) and not state(*s, "failed").exists()]:
        for s in todo:  # a scenario some ranks ran in a launch that ended early runs again from the start
            for mark in progress.glob(f"{Path(s[0]).stem}.{s[1]}.*"):
                mark.unlink()
        log_path = out / f"launch_{len(list(out.glob('launch_*.log')))}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(BATCH_SCRIPT), str(out),
               ",".join(f"{script}:{name}" for script, name in todo)]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            began, stalled = time.time(), False
            while proc.poll() is None:
                time.sleep(1)
                marks = [p.stat().st_mtime for p in progress.glob("*")] if progress.exists() else []
                if time.time() - max([began, *marks]) > STALL_S:
                    stalled = True
                    kill_launch(proc)
        text = log_path.read_text(errors="replace")
        finished = [s for s in todo if done(*s)]
        crashed = [s for s in todo if list(progress.glob(f"{Path(s[0]).stem}.{s[1]}.crash_r*.txt"))]
        if len(finished) == len(todo) and not crashed:
            if proc.returncode != 0:  # the results stand (each test checks its own); the exit is reported
                warnings.warn(f"batch of world {nproc}: exit {proc.returncode} after every scenario was done: "
                              f"{last_error_line(text)} (log: {log_path})")
            continue
        # the scenario that failed, else the first one not every rank finished (the launch hung or died in it)
        blamed = crashed or [s for s in todo if state(*s, "started").exists() and s not in finished][:1]
        reason = (f"launch stalled: no progress in {STALL_S} s" if stalled else
                  f"launch exit {proc.returncode}: {last_error_line(text)}")
        if not blamed and not finished:  # nothing ran: relaunching would fail the same way
            blamed, reason = todo, f"not run, {reason}"
        for s in blamed:
            fail(*s, f"{reason}\n{text[-8000:]}")
            state(*s, "failed").touch()
