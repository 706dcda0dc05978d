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
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

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


def destroy_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, whoever created it and for every backend
    (Lightning does it for NCCL only): torch warns about an undestroyed NCCL group, and an undestroyed gloo group's
    threads can abort the exit ("terminate called without an active exception", exit code -6, which torchrun
    reports as a failed run) -- seen here in about one of fifteen two-process runs. Registered once."""
    global _DESTROY_REGISTERED
    if not _DESTROY_REGISTERED:
        atexit.register(_destroy_process_group)
        _DESTROY_REGISTERED = True


_DESTROY_REGISTERED = False


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
