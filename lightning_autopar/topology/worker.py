"""What one worker process settles for itself before training: its share of the CPU threads and where its process
group keeps its keys. Both work with any launcher and no environment variable set by the user.

CPU threads. torch starts every process with one intra-op thread per core. Four processes on a machine then run
four times as many threads as there are cores, and each step waits on threads that are descheduled. torchrun
avoids this by setting ``OMP_NUM_THREADS=1`` when it is unset, and so does Lightning's launcher for
``DDPStrategy``. Lightning's ``ModelParallelStrategy`` (the base of autopar's strategies) configures no launcher
in a process someone else started, so processes 1..N-1 of ``python train.py`` with ``devices=N`` kept all
their threads. :func:`share_cpu_threads` gives each process an equal share of the cores. A thread count the
user set (``OMP_NUM_THREADS``, or a ``torch.set_num_threads`` that already fits) is kept.

Restarts. With torchrun's c10d rendezvous the workers use the elastic agent's TCP store
(``TORCHELASTIC_USE_AGENT_STORE=True``), and that store outlives a restart. torch names process-group keys by
group number, which starts again at 0 in a restarted worker, so the new workers read the dead attempt's gloo
addresses and fail to connect (torchrun then spends its restarts and exits 1). :func:`init_process_group`
prefixes every key with the attempt (``TORCHELASTIC_RESTART_COUNT``) and this process's init count. Each attempt
then has its own keys in the shared store.

Failures. An autopar error on one rank must stop every rank with its one line, not with gloo "Connection closed
by peer" tracebacks from the others. The failing rank publishes its line to the process group's store
(:func:`publish_failure`, called by ``install_excepthook``) before it exits; a peer whose collective then
fails finds it (:func:`peer_failure`) and prints it. Under torchrun the store is the agent's and outlives the
workers. Under Lightning's launcher rank 0 serves it, and its peers' collectives fail only once it has exited
(closing or aborting a gloo group does not end them), so there the other ranks' heartbeat thread looks for a
failure once a second (:func:`start_heartbeat`), and a failing rank 0 waits until they have read its line.

Hangs. A peer that stops (SIGSTOP, a hung host) raises nothing: the others' next collective times out (the
process-group timeout, ``topology.mesh.pg_timeout``). Every rank's one heartbeat thread writes a beat and what
it is doing to the store once a second; a rank whose collective failed names the peers whose beat stopped
(:func:`stop_for_peer`) in one line and exits 1, which torchrun's ``--max-restarts`` restarts.
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

PG_TIMEOUT_ENV = "AUTOPAR_PG_TIMEOUT"  # the process-group timeout in seconds (read by topology.mesh.pg_timeout)
_INITS = [0]  # process groups this process has created through init_process_group (every rank: the same count)


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask: a cgroup or taskset limit counts, the host's total
    does not)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_cpu_threads(local_processes: int) -> int:
    """Limit torch's intra-op threads to this process's share of the cores (``cores // local_processes``, at
    least 1), unless the user chose a count (``OMP_NUM_THREADS``) or the current one already fits. Returns the
    thread count in effect. Only torch's own setting changes; the environment is left as it is."""
    import torch

    current = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ:
        return current
    share = max(1, cpu_count() // max(1, local_processes))
    if current > share:
        torch.set_num_threads(share)
    return torch.get_num_threads()


def uses_shared_agent_store() -> bool:
    """Whether torchrun's agent lends its rendezvous TCP store to the workers. That store outlives a restart."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_prefix() -> str:
    """The key prefix of the next process group this process creates. It contains the restart attempt and this
    process's init count, so neither a dead attempt nor an earlier group in this process shares its keys."""
    return f"autopar/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/init_{_INITS[0] + 1}/"


def attempt_store(store: Any) -> Any:
    """``store`` seen through :func:`attempt_prefix`, for the next process group of this process."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(attempt_prefix(), store)
    _INITS[0] += 1
    return prefixed


def init_process_group(backend: str, timeout: timedelta, **kwargs: Any) -> bool:
    """Create the default process group on the agent's store under :func:`attempt_prefix` when torchrun shares
    its store (rank and world from its RANK / WORLD_SIZE, the store at MASTER_ADDR:MASTER_PORT). Returns False
    and does nothing otherwise (no shared store, or a group already exists); the caller's usual initialisation
    then runs."""
    import torch.distributed as dist

    if not uses_shared_agent_store() or dist.is_initialized():
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=attempt_store(store), rank=rank, world_size=world, timeout=timeout,
                            **kwargs)
    destroy_at_exit()
    return True


def destroy_at_exit(release: Callable[[], None] | None = None) -> None:
    """Destroy the default process group when the interpreter exits, whoever created it and for every backend
    (Lightning does it for NCCL only), then let go of the groups: ``release`` (registered once per callable) drops
    what a caller holds that keeps process groups alive (topology.mesh's meshes), and a collection follows.

    Why (issue 28, the teardown abort: "terminate called without an active exception", exit -6, about one
    two-process run in fifteen under load, which torchrun reports as a failed run): ``destroy_process_group``
    unregisters the groups but does not end a gloo group's worker threads; only the group object's destructor joins
    them, and anything still holding the object -- a DeviceMesh's group registry, which torch's DTensor sharding
    caches keep alive -- lets the threads outlive the exit hooks. A worker that finished the last collective drops
    that work a moment later; if Python freed the work's tensors in between, the drop decrefs their Python objects
    and must take the GIL. Once the interpreter is finalizing, CPython ends a thread that asks for the GIL with
    ``pthread_exit``; its forced unwind crosses gloo's noexcept work destructor and ``std::terminate`` aborts the
    process after all its work (seen in a core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
    ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). Destroying the groups here, before
    finalization, joins their threads while the GIL can still be taken (torch releases it in the destructor)."""
    global _DESTROY_REGISTERED
    if release is not None and release not in _RELEASES:
        _RELEASES.append(release)
    if not _DESTROY_REGISTERED:
        atexit.register(_destroy_process_group)
        _DESTROY_REGISTERED = True


_DESTROY_REGISTERED = False
_RELEASES: list[Callable[[], None]] = []  # what drops references to process groups at exit (destroy_at_exit)


def _destroy_process_group() -> None:
    import gc
    import sys

    import torch.distributed as dist

    stop_heartbeat()  # before its store goes away
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if hasattr(sys, "last_value"):  # an uncaught error: a group may still wait on a peer; leave without joining
        return
    for release in _RELEASES:
        release()
    gc.collect()  # groups no longer held are destroyed now, their worker threads joined
    settle_group_threads()  # groups the user's own objects still hold keep their threads: let them go idle


GROUP_THREAD = "pt_gloo_runloop"  # the name torch gives a gloo group's worker threads (torch 2.13)


def settle_group_threads(limit_s: float = 2.0, calm_s: float = 0.05) -> bool:
    """Wait, with the GIL released, until every gloo worker thread of this process has been asleep for ``calm_s``
    (at most ``limit_s``): a worker that just finished a collective is running or about to take the GIL to drop
    the work's tensors, and must do it before the interpreter finalizes (destroy_at_exit says why); one whose peer
    is a moment behind sleeps briefly in the collective, hence a calm period rather than one look. Reads the thread
    states from /proc (Linux; elsewhere returns False at once). True when they settled."""
    import time

    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return False
    now = time.monotonic()
    deadline, calm_since = now + limit_s, now
    while now < deadline:
        time.sleep(0.002)  # releases the GIL: a worker waiting for it takes it now
        now = time.monotonic()
        states = [state for tid in os.listdir(tasks) if (state := _thread_state(tasks, tid)) is not None]
        if not states:  # no gloo group left (the usual case once the collection destroyed them)
            return True
        if any(state in ("R", "D") for state in states):
            calm_since = now
        elif now - calm_since >= calm_s:
            return True
    return False


def _thread_state(tasks: str, tid: str) -> str | None:
    """The scheduler state of thread ``tid`` if it is a gloo group worker (GROUP_THREAD), else None."""
    try:
        with open(f"{tasks}/{tid}/comm") as f:
            if f.read().strip() != GROUP_THREAD:
                return None
        with open(f"{tasks}/{tid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:  # the thread ended meanwhile
        return None


# ------------------------------------------------------------------ one line on every rank (install_excepthook)

FAILED_KEY = "autopar/failed"
SEEN_KEY = "autopar/failed_seen"  # peers that have read the failure
PEER_WAIT_S = 5.0  # how long a rank that died in a collective looks for a peer's published failure
_STOPPING = threading.Lock()  # held by the thread printing this process's last line (stop_with)


@dataclass(frozen=True)
class PeerFailure:
    """The first autopar error a rank of this job published: its rank, exit code and one line."""

    rank: int
    exit_code: int
    line: str

    def line_for(self, rank: str | None) -> str:
        return f"autopar (rank {rank}): stopped because rank {self.rank} failed: {self.line}"


def stop_with(line: str, code: int) -> None:
    """Print ``line`` on the real stderr and leave now with ``code`` (once per process: a second thread that
    gets here waits for the first one's exit)."""
    import sys
    import time

    if not _STOPPING.acquire(blocking=False):
        while True:
            time.sleep(1.0)
    # the real stderr: torch.distributed's own hook buffers sys.stderr to prefix "[rankN]:" lines
    stream = sys.__stderr__ or sys.stderr
    print(line, file=stream, flush=True)
    sys.stdout.flush()
    os._exit(code)  # a plain exit would run teardown hooks that may hang on peers


def _job_store() -> Any:
    """The default process group's store: torchrun's agent store (under this attempt's prefix) or the TCPStore
    Lightning's launcher made (rank 0 serves it). None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _serves_store() -> bool:
    """Whether this process serves the job's store (rank 0 without torchrun's agent store): it must outlive
    its peers' reading of a failure."""
    import torch.distributed as dist

    return not uses_shared_agent_store() and dist.get_rank() == 0


def publish_failure(line: str, exit_code: int) -> None:
    """Record this rank's error ``line`` in the job's store (the first one published wins), so its peers print
    it instead of gloo tracebacks. A process serving the store stays until every peer has read it (at most
    2 * PEER_WAIT_S; the peers' heartbeat threads (:func:`start_heartbeat`) see it within HEARTBEAT_S). Best effort:
    a store that cannot be reached leaves the peers' own errors."""
    import time

    import torch.distributed as dist

    try:
        store = _job_store()
        if store is None:
            return
        store.compare_set(FAILED_KEY, "", f"{dist.get_rank()}\t{exit_code}\t{line}")
        if _serves_store():
            peers, deadline = dist.get_world_size() - 1, time.monotonic() + 2 * PEER_WAIT_S
            while store.add(SEEN_KEY, 0) < peers and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # noqa: BLE001 -- the failing rank's own line is printed whatever the store does
        pass


def _read_failure(store: Any) -> PeerFailure:
    rank, code, line = store.get(FAILED_KEY).decode().split("\t", 2)
    store.add(SEEN_KEY, 1)  # a failed rank serving the store waits for this (publish_failure)
    return PeerFailure(int(rank), int(code), line)


def looks_collective(error: BaseException) -> bool:
    """Whether ``error`` is what a collective raises when a peer is gone (gloo: "Connection closed by peer",
    a DistBackendError / DistNetworkError, a timeout: "Application timeout caused pair closure")."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    words = ("gloo", "connection", "peer", "timed out", "timeout")
    return isinstance(error, RuntimeError) and any(w in text for w in words)


def peer_failure(error: BaseException) -> PeerFailure | None:
    """The failure a peer published, if any: waits up to PEER_WAIT_S when ``error`` looks like a collective
    that lost its peer (the peer publishes before it exits, so the key is normally there already), else looks
    once. None without a process group, a reachable store or a published failure."""
    import time

    try:
        store = _job_store()
        if store is None:
            return None
        deadline = time.monotonic() + (PEER_WAIT_S if looks_collective(error) else 0.0)
        while not store.check([FAILED_KEY]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return _read_failure(store)
    except Exception:  # noqa: BLE001 -- the store went with the failed rank: the error stays as it is
        return None


# ------------------------------------------------------------------ the heartbeat: stopped peers, failures

HEARTBEAT_KEY = "autopar/heartbeat/"  # + rank: "<beats>\t<what it is doing>", rewritten every HEARTBEAT_S
HEARTBEAT_S = 1.0
BEAT_GAP_S = 0.1  # at least this between two beats: a note per step must not turn into a store call per step
STALL_S = 2.5  # a peer whose beat count has not moved over this long has stopped answering
_DOING = ["setting up"]  # what this rank is doing, e.g. "training step 3", published with each beat (note_doing)
_HEARTBEAT: list[Any] = []  # (thread, stop event) while this process's one heartbeat thread runs
_NEWS = threading.Event()  # set by note_doing: the heartbeat publishes the change without waiting HEARTBEAT_S


def note_doing(doing: str) -> None:
    """Record what this rank is doing ("training step 3"), for the heartbeat its peers read."""
    _DOING[0] = doing
    _NEWS.set()


def start_heartbeat() -> None:
    """Start this process's one heartbeat thread (once): every HEARTBEAT_S it writes its beat count and what the
    rank is doing (:func:`note_doing`) to the job's store, so that a rank whose collective timed out can name the
    peer that stopped answering (:func:`stalled_peers`). Where rank 0 serves the store (Lightning's launcher, no
    torchrun agent store), a peer blocked in a collective would see a failed rank 0 only when it exits, taking
    the store and its line with it; the same thread on every other rank therefore also looks for a published
    failure and stops this process with its line (:func:`stop_with`).

    The thread is stopped and joined at interpreter exit (:func:`stop_heartbeat`, also called at the strategy's
    teardown): a daemon thread still making store calls when the interpreter finalizes is ended by
    ``pthread_exit`` inside pybind11's GIL re-acquisition, a noexcept frame, and the process aborts with
    "terminate called without an active exception" (exit -6) after all its work."""
    if _HEARTBEAT:
        return
    stop = threading.Event()
    thread = threading.Thread(target=_beat, args=(stop,), name="autopar-heartbeat", daemon=True)
    _HEARTBEAT.append((thread, stop))
    atexit.unregister(stop_heartbeat)  # registered once, after destroy_at_exit's hook: it runs first
    atexit.register(stop_heartbeat)
    thread.start()


def stop_heartbeat() -> None:
    """Stop and join the heartbeat thread, if it runs (its store calls are short; a store that went away fails
    them at once)."""
    if _HEARTBEAT:
        thread, stop = _HEARTBEAT.pop()
        stop.set()
        _NEWS.set()
        if thread is not threading.current_thread():
            thread.join(timeout=5 * HEARTBEAT_S)


def _beat(stop: threading.Event) -> None:
    import torch.distributed as dist

    beats = 0
    while True:
        _NEWS.wait(HEARTBEAT_S)
        _NEWS.clear()
        if stop.is_set():
            return
        try:
            store = _job_store()
            if store is None:
                continue  # the group is not created yet (or already destroyed)
            beats += 1
            rank = dist.get_rank()
            store.set(f"{HEARTBEAT_KEY}{rank}", f"{beats}\t{_DOING[0]}")
            if rank != 0 and not uses_shared_agent_store() and store.check([FAILED_KEY]):
                failure = _read_failure(store)
                stop_with(failure.line_for(str(rank)), failure.exit_code)
        except Exception:  # noqa: BLE001 -- the store is gone (the run ended, or its server exited)
            if stop.wait(HEARTBEAT_S):
                return
        if stop.wait(BEAT_GAP_S):
            return


@dataclass(frozen=True)
class StalledPeer:
    """A rank whose heartbeat stopped advancing, with what it last said it was doing."""

    rank: int
    doing: str


def _heartbeats(store: Any, ranks: list[int]) -> dict[int, tuple[str, str]]:
    """(beat count, what it is doing) of each of ``ranks`` that has beaten at least once."""
    keys = {r: f"{HEARTBEAT_KEY}{r}" for r in ranks}
    return {r: tuple(store.get(k).decode().split("\t", 1)) for r, k in keys.items() if store.check([k])}


def stalled_peers() -> list[StalledPeer]:
    """The peers whose heartbeat did not advance over STALL_S (a stopped or hung process, or one that died
    without a word). Empty without a process group, a reachable store or a running heartbeat here."""
    import time

    import torch.distributed as dist

    try:
        store = _job_store()
        if store is None or not _HEARTBEAT:
            return []
        me = dist.get_rank()
        ranks = [r for r in range(dist.get_world_size()) if r != me]
        before = _heartbeats(store, ranks)
        time.sleep(STALL_S)
        after = _heartbeats(store, ranks)
    except Exception:  # noqa: BLE001 -- the store went with a peer: nothing to name
        return []
    return [StalledPeer(r, after.get(r, ("", "before its first heartbeat"))[1]) for r in ranks
            if after.get(r, ("",))[0] == before.get(r, ("",))[0]]


def _what_failed(error: BaseException) -> str:
    """The collective ``error`` came from and how it failed, in a few words ("an all_reduce timed out"): the
    innermost torch.distributed function in its traceback (gloo's message names no operation)."""
    import traceback

    ops = [f.name for f in traceback.extract_tb(error.__traceback__) if f.filename.endswith("distributed_c10d.py")]
    what = ops[-1] if ops else "a collective"
    text = str(error).lower()
    return f"{what} timed out" if ("timeout" in text or "timed out" in text) else f"{what} failed ({error})"


def stop_for_peer(error: BaseException) -> None:
    """Stop this process with one line naming the cause of ``error``: the failure a peer published
    (:func:`peer_failure`), else, for a failed collective, the peers whose heartbeat stopped
    (:func:`stalled_peers`) and what they were doing. Returns only when neither explains it."""
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))  # Lightning's launcher sets only the latter
    failed = peer_failure(error)
    if failed is not None:
        stop_with(failed.line_for(rank), failed.exit_code)
    stalled = stalled_peers() if looks_collective(error) else []
    if stalled:
        peers = "; ".join(f"rank {p.rank} stopped answering (last seen in {p.doing})" for p in stalled)
        stop_with(f"autopar (rank {rank}): {peers}; here {_what_failed(error)} in {_DOING[0]} (the limit is "
                  f"the strategy's timeout= or {PG_TIMEOUT_ENV})", 1)


def install_excepthook() -> None:
    """Make an uncaught AutoparError print its one line and exit with its code, instead of a traceback, on every
    rank: the failing rank publishes its line to the job's store (``publish_failure``) before it
    exits; a peer that then dies in a collective (gloo's "Connection closed by peer") finds it there
    (``peer_failure``; where rank 0 serves the store, the peers' heartbeat threads)
    and prints "autopar (rank k): stopped because rank j failed: <line>", exiting with the same code. A failed
    collective with no published failure names the peers that stopped answering (:func:`stop_for_peer`).

    Other exceptions keep the previous hook. Installed by the strategy and the Fabric integration, i.e. only in
    programs that use autopar."""
    import sys

    from lightning_autopar.errors import AutoparError

    previous = sys.excepthook
    if getattr(previous, "_autopar", False):
        return

    def hook(kind, value, tb):  # type: ignore[no-untyped-def]
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))  # Lightning's launcher sets only the latter
        if isinstance(value, AutoparError):
            publish_failure(str(value), value.exit_code)
            prefix = f"autopar (rank {rank})" if rank not in (None, "0") else "autopar"
            stop_with(f"{prefix}: {value}", value.exit_code)
        stop_for_peer(value)
        previous(kind, value, tb)

    hook._autopar = True  # type: ignore[attr-defined]
    sys.excepthook = hook
