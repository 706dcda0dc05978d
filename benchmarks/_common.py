"""Shared by the benchmark scripts: machine load, the self-launch, the barrier-synchronised step timer,
synthetic data, timed Trainer runs and small statistics. Benchmarks are scripts, never timed tests.

Threads: no benchmark sets a thread count or a thread variable. Every process trains with what a user's process
gets. ``--launcher lightning`` (the default) starts the ranks as Lightning's own launcher does for
``python train.py`` with ``devices=N``: no thread variable, every rank a process the Trainer did not start
(``LOCAL_RANK`` set). That is how Lightning's launcher leaves ranks 1..N-1. ``--launcher torchrun`` uses torchrun,
which sets ``OMP_NUM_THREADS=1`` itself when it is unset. Before each timed run every process is put back to its
thread state at start (``fresh_threads``): Lightning's ``DDPStrategy`` sets the threads of the process it runs
in, and that must not carry over into the next strategy's run."""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent


# ============================================================================================ the machine


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def wait_for_quiet(max_load: float = 2.5, max_busy: float = 0.25, max_wait_s: float = 1200,
                   step_s: float = 60) -> dict[str, Any]:
    """Sleep in ``step_s`` steps (up to ``max_wait_s``) while the 1-minute load average is above ``max_load``
    and the CPU is busy too (more than ``max_busy`` of it over 5 s: this machine's load average also counts
    tasks that use no CPU here, it read 12 with the CPU 1% busy). Returns what was seen: {load_before,
    load_start, busy_start, waited_s}; measuring goes ahead either way."""
    before = load_average()
    waited = 0.0
    while True:
        load, busy = load_average()[0], machine_busy(5.0)
        if load <= max_load or busy <= max_busy or waited >= max_wait_s:
            break
        print(f"load average {load:.2f} > {max_load} and CPU {100 * busy:.0f}% busy: waiting {step_s:.0f} s "
              f"({waited:.0f} s waited so far)", flush=True)
        time.sleep(step_s)
        waited += step_s
    return {"load_before": before, "load_start": load_average(), "busy_start": busy, "waited_s": waited}


def machine() -> dict[str, Any]:
    """CPU model, cores, memory and versions, for the report."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import lightning

    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem, 1), "torch": torch.__version__,
            "lightning": lightning.__version__, "python": platform.python_version()}


# ============================================================================================ launching


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_worker() -> bool:
    """Whether this process is one of the benchmark's ranks (started by torchrun or by ``relaunch``)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def global_rank() -> int:
    """This rank: torchrun's RANK, else (one node, Lightning's launcher sets no RANK) LOCAL_RANK."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def relaunch(script: str, nproc: int, argv: Sequence[str], timeout_s: float | None = None,
             launcher: str = "lightning") -> int:
    """Run ``script argv`` once on ``nproc`` CPU processes; the first non-zero return code, else 0. No thread
    variable is set. ``lightning``: ``nproc`` processes with the variables Lightning's launcher gives the
    ranks it starts (MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE). ``torchrun``: torchrun, which
    sets ``OMP_NUM_THREADS=1`` when it is unset."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", script, *argv]
        print("+", " ".join(cmd[2:]), flush=True)
        return subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s).returncode
    cmd = [sys.executable, script, *argv]
    print(f"+ {nproc} x", " ".join(cmd[1:]), "(started as Lightning's launcher starts ranks)", flush=True)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NODE_RANK="0", WORLD_SIZE=str(nproc))
    procs = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "LOCAL_RANK": str(rank)}) for rank in range(nproc)]
    return _wait_all(procs, timeout_s)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float | None) -> int:
    """Wait for every rank; when one fails (or the time is up) stop the others, which would wait for it forever."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed or (deadline is not None and time.monotonic() > deadline):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return failed[0] if failed else 124
        time.sleep(0.5)
    return next((p.returncode for p in procs if p.returncode), 0)


def common_args(parser: Any) -> Any:
    """The options every torchrun benchmark takes: processes, output folder, the quiet-machine waits."""
    parser.add_argument("--nproc", type=int, default=4, help="CPU processes (gloo)")
    parser.add_argument("--launcher", default="lightning", choices=("lightning", "torchrun"),
                        help="how the ranks start: as Lightning's launcher starts them (python train.py, "
                             "devices=N), or torchrun; no thread variable is set either way")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "benchmarks"), help="results folder")
    parser.add_argument("--max-load", type=float, default=2.5,
                        help="start when the 1-minute load average is below this")
    parser.add_argument("--max-wait", type=float, default=1200, help="seconds to wait for that before starting")
    parser.add_argument("--max-busy", type=float, default=0.25,
                        help="or when other processes keep at most this share of the CPU time busy")
    parser.add_argument("--max-slowdown", type=float, default=1.5,
                        help="pause before a run (and repeat a run once after which) the machine is this many times "
                             "slower than at its best (speed_check)")
    parser.add_argument("--max-pause", type=float, default=600, help="seconds to pause in all, at most")
    return parser


_PAUSED = [0.0]
RUN_LOADS: list[float] = []  # the 1-minute load average at the start of every run
RUN_OTHERS: list[float] = []  # the share of the machine's CPU time other processes took during every run
RUN_THREADS: list[int] = []  # torch's intra-op threads in this process during every timed run's steps


def _cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores summed (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - fields[3] - fields[4]) / hz, sum(fields) / hz


def machine_busy(seconds: float = 1.0) -> float:
    """Share of the machine's CPU time (0..1, all cores) in use over the next ``seconds``."""
    b0, t0 = _cpu_seconds()
    time.sleep(seconds)
    b1, t1 = _cpu_seconds()
    return (b1 - b0) / max(t1 - t0, 1e-9)


_CHECKS: list[float] = []  # every speed_check's kernel time in this script
RUN_SLOWDOWN: list[float] = []  # speed_check right after every kept run
_RETRIED = [0]


def speed_check(reps: int = 7) -> float:
    """This machine's slowdown now: a fixed matmul loop (about 20 ms a repetition, longer than a scheduler time
    slice) on every rank at once, the slowest rank's median, over the lower quartile of every check so far in
    this script (1.0: as fast as usual at its quietest; a quartile, not the minimum, because four processes on
    two cores sometimes get a lucky schedule). Every rank gets the same figure."""
    import torch
    import torch.distributed as dist

    a = torch.randn(256, 256)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(40):
            a @ a
        times.append(time.perf_counter() - start)
    t = torch.tensor([median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    _CHECKS.append(float(t))
    ordered = sorted(_CHECKS)
    return float(t) / ordered[(len(ordered) - 1) // 4]


def pause_while_slow(args: Any) -> None:
    """Before a timed run: while speed_check says the machine is more than ``args.max_slowdown`` times slower
    than usual (other work on it; this machine's load average and CPU counters do not show all of it), every
    rank sleeps in 10 s steps, up to ``args.max_pause`` seconds over the whole script."""
    if not _CHECKS:
        for _ in range(5):  # a first reference
            speed_check()
    while speed_check() > args.max_slowdown and _PAUSED[0] < args.max_pause:
        time.sleep(10)
        _PAUSED[0] += 10
    RUN_LOADS.append(load_average()[0])


def guarded_run(fn: Any, args: Any) -> Any:
    """``fn()`` after pause_while_slow; repeated once when speed_check right after it finds the machine more
    than ``args.max_slowdown`` times slower than at its best (the run was likely slowed too)."""
    for attempt in (1, 2):
        pause_while_slow(args)
        out = fn()
        after = speed_check()
        if after <= args.max_slowdown or attempt == 2:
            break
        _RETRIED[0] += 1
    RUN_SLOWDOWN.append(after)
    return out


@contextmanager
def others_share() -> Iterator[None]:
    """Record in RUN_OTHERS the share of the machine's CPU time that processes other than this benchmark's
    ranks used while the block ran (machine busy time minus every rank's own CPU time)."""
    import torch
    import torch.distributed as dist

    b0, t0 = _cpu_seconds()
    c0 = time.process_time()
    yield
    ours = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(ours)
    b1, t1 = _cpu_seconds()
    RUN_OTHERS.append(max(b1 - b0 - float(ours), 0.0) / max(t1 - t0, 1e-9))


def load_summary() -> dict[str, float]:
    """The machine during this script's runs: load average at their start, speed_check right after them, other
    processes' CPU share during them (median, max), runs repeated, seconds paused for a quieter machine."""
    def spread(values: list[float], name: str) -> dict[str, float]:
        v = sorted(values) or [float("nan")]
        return {f"{name}_median": median(v), f"{name}_min": v[0], f"{name}_max": v[-1]}

    return {"runs": len(RUN_SLOWDOWN), **spread(RUN_LOADS, "run_load"), **spread(RUN_SLOWDOWN, "slowdown_after"),
            **spread(RUN_OTHERS, "others_cpu_share"), "repeated": _RETRIED[0], "paused_s": _PAUSED[0]}


def bench_main(script: str, args: Any, worker: Any, result_file: str) -> int:
    """A benchmark's entry point: the worker under torchrun, else the launcher (launch_and_record)."""
    if is_worker():
        worker(args)
        return 0
    return launch_and_record(script, args, result_file)


def write_result(args: Any, result_file: str, data: dict, seconds: float, label: str) -> None:
    """Write ``data`` as JSON to ``args.out/result_file`` (rank 0 calls it) and say so."""
    import json

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / result_file).write_text(json.dumps(data, indent=1, default=float))
    load = data.get("load") or {}
    if load:
        print(f"{label}: {load['runs']} runs; load average at their start {load['run_load_median']:.2f} (median; "
              f"{load['run_load_min']:.2f}-{load['run_load_max']:.2f}); machine slowdown right after them "
              f"{load['slowdown_after_median']:.2f} (median; max {load['slowdown_after_max']:.2f}); other processes "
              f"used {100 * load['others_cpu_share_median']:.0f}% of the CPU time during them (median; max "
              f"{100 * load['others_cpu_share_max']:.0f}%); {load['repeated']} runs repeated, "
              f"{load['paused_s']:.0f} s paused for a quieter machine", flush=True)
    print(f"{label}: {seconds:.0f} s in the workers; wrote {out / result_file}", flush=True)


def launch_and_record(script: str, args: Any, result_file: str) -> int:
    """The launcher side of a benchmark: wait for a quieter machine, run ``script`` once under torchrun with
    ``args.nproc`` processes (same arguments), then add the machine and its load to ``args.out/result_file``."""
    import json

    wait = wait_for_quiet(args.max_load, args.max_busy, args.max_wait)
    print(f"machine: {machine()}; load average before {fmt_load(wait['load_before'])}, at start "
          f"{fmt_load(wait['load_start'])} with the CPU {100 * wait['busy_start']:.0f}% busy (waited "
          f"{wait['waited_s']:.0f} s)", flush=True)
    rc = relaunch(script, args.nproc, sys.argv[1:], launcher=args.launcher)
    print(f"load average at the end {fmt_load(load_average())}", flush=True)
    path = Path(args.out) / result_file
    if rc == 0 and path.exists():
        data = json.loads(path.read_text())
        data.update(machine=machine(), load_before=wait["load_before"], load_start=wait["load_start"],
                    busy_start=wait["busy_start"], load_end=load_average(), waited_s=wait["waited_s"])
        path.write_text(json.dumps(data, indent=1))
    return rc


_FRESH: list[tuple[int, str | None]] = []  # this process's (torch threads, OMP_NUM_THREADS) before any Trainer


def init_workers() -> tuple[int, int]:
    """In a rank: the gloo process group (reused by every Trainer); (rank, world). Threads stay as the process
    started (none set here); that state is kept for fresh_threads."""
    import torch
    import torch.distributed as dist

    if not _FRESH:
        _FRESH.append((torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=global_rank(), world_size=int(os.environ["WORLD_SIZE"]))
    return dist.get_rank(), dist.get_world_size()


def fresh_threads() -> None:
    """Put this process's thread state back to how it started (init_workers): a strategy that sets threads
    (Lightning's DDPStrategy does, through its launcher) must not leave them to the next run."""
    import torch

    threads, omp = _FRESH[0]
    torch.set_num_threads(threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


def is_rank0() -> bool:
    return global_rank() == 0


# ============================================================================================ timing


def step_timer(warmup: int) -> Any:
    """A Lightning callback timing each optimizer step between two barriers (every rank done with the step
    before and after); ``.times`` drops the first ``warmup`` steps. One batch is one optimizer step (autopar
    runs the plan's micro-batches inside it; accumulate_grad_batches stays 1)."""
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.all: list[float] = []
            self.losses: list[float] = []
            self.threads = 0  # torch's intra-op threads while training
            self._start = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.threads = torch.get_num_threads()
            sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            sync()
            self.all.append(time.perf_counter() - self._start)
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                self.losses.append(float(loss.detach()))

        @property
        def times(self) -> list[float]:
            return self.all[warmup:]

    return StepTimer()


def token_loader(rows: int, seq_len: int, batch_size: int, vocab: int = 256, seed: int = 1234) -> Any:
    """Synthetic next-token data (random bytes): ``rows`` sequences, fixed order, full batches only."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=gen)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size, shuffle=False,
                      drop_last=True)


def timed_fit(module: Any, strategy: Any, loader: Any, steps: int, warmup: int, precision: str = "32-true",
              devices: int | None = None) -> tuple[list[float], Any]:
    """Fit ``steps + warmup`` optimizer steps on CPU with a fresh Trainer; (timed step seconds, trainer). The
    process starts it with its thread state at start (fresh_threads); the threads it trained with go to
    RUN_THREADS."""
    import lightning.pytorch as L

    if _FRESH:
        fresh_threads()
    timer = step_timer(warmup)
    import torch.distributed as dist

    # the world from the process group: Lightning's environment removes WORLD_SIZE when a Trainer tears down
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices or dist.get_world_size(),
                        max_steps=warmup + steps, precision=precision, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[timer])
    with others_share():
        trainer.fit(module, loader)
    RUN_THREADS.append(timer.threads)
    return timer.times, trainer


# ============================================================================================ statistics


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson on tie-averaged ranks)."""
    import numpy as np

    if len(a) < 2:
        return float("nan")
    ra, rb = np.array(ranks(a)), np.array(ranks(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(np.sqrt((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / den) if den else float("nan")


def fmt_load(load: Sequence[float]) -> str:
    return "/".join(f"{x:.2f}" for x in load)
