"""Measure on the live device: matmul rate and memory bandwidth (to calibrate a cluster preset), collective
latency/bandwidth over gloo, the timing of one collective on a live process group (shared by ``autopar probe``
and the set-up profile, profile/runtime.py), and the forward/backward time and activation memory of each
distinct block of a model (fed to the planner as ``plan(..., measured=measure_blocks(...))`` in place of the
analytic terms).

``python -m lightning_autopar.profile.measure`` prints a calibrated ``cpu`` cluster YAML for this machine.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_autopar.specs import BlockMeasure, Measured

DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (host timers measure nothing otherwise)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def timeit(fn: Callable[[], Any], device: torch.device, reps: int = 5, warmup: int = 1, budget_s: float = 1.0) -> float:
    """Minimum seconds of ``fn`` after warm-up (other work on a shared machine only adds time); fewer
    repetitions when one call is slow (``budget_s``)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
        if sum(times) > budget_s and len(times) >= 2:
            break
    return min(times)


# ============================================================================================ device


@dataclass
class DeviceCalibration:
    """Achieved rates on one device (one process's share of it)."""

    matmul_tflops: dict[str, float] = field(default_factory=dict)  # precision -> best achieved TFLOP/s
    curve: list[tuple[str, int, float]] = field(default_factory=list)  # (precision, n, TFLOP/s) for n x n x n
    memory_bandwidth_gbs: float = 0.0  # copy: read + write bytes / s
    kernel_overhead_us: float = 0.0  # one small op with autograd bookkeeping


def measure_device(device: str | torch.device | None = None, precisions: Sequence[str] = ("fp32", "bf16-mixed"),
                   sizes: Sequence[int] = (128, 256, 512, 1024, 2048), copy_mib: int = 64) -> DeviceCalibration:
    """Achieved matmul TFLOP/s per size (square n^3 GEMMs), streaming copy bandwidth and per-op overhead."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cal = DeviceCalibration()
    for prec in precisions:
        dtype = DTYPES[prec]
        best = 0.0
        for n in sizes:
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            t = timeit(lambda: a @ b, dev, reps=5)
            rate = 2 * n**3 / t / 1e12
            cal.curve.append((prec, n, rate))
            best = max(best, rate)
        cal.matmul_tflops[prec] = best
    x = torch.empty(copy_mib * 2**20 // 4, device=dev)
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), dev, reps=5)
    cal.memory_bandwidth_gbs = 2 * x.numel() * 4 / t / 1e9
    w = torch.ones(8, device=dev, requires_grad=True)
    small = torch.ones(8, device=dev)
    n_ops = 200

    def ops() -> None:
        out = small
        for _ in range(n_ops):
            out = out * w
        out.sum().backward()

    cal.kernel_overhead_us = timeit(ops, dev, reps=3) / (2 * n_ops) * 1e6
    return cal


# ============================================================================================ links


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _link_worker(rank: int, world: int, port: int, sizes: Sequence[int], out: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        result = []
        for n in sizes:
            t = torch.ones(max(n // 4, 1))
            dist.all_reduce(t)
            best = float("inf")
            for _ in range(7):  # the minimum: a shared machine only ever adds time
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                best = min(best, time.perf_counter() - start)
            result.append((n, best))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def measure_links(world: int = 2, sizes: Sequence[int] = (4, 2**16, 2**20, 2**23)) -> dict[str, float]:
    """All-reduce times over gloo on localhost; fit t = 2(n-1)/n * S/B + 2(n-1)*alpha (ring) for B and alpha."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_link_worker, args=(r, world, port, list(sizes), queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    (s0, t0), (s1, t1) = result[0], result[-1]
    k = 2 * (world - 1) / world
    beta = max((t1 - t0) / max(k * (s1 - s0), 1), 1e-15)  # s per byte
    alpha = max(t0 / (2 * (world - 1)), 0.0)
    return {"bandwidth_gbs": 1 / beta / 1e9, "latency_us": alpha * 1e6, "samples": result}


# ============================================================================================ live group


def group_device(backend: str) -> torch.device:
    """The device a process group's tensors live on: this process's accelerator for nccl / hccl, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")


def median_time(fn: Callable[[], None], device: torch.device, group: Any, iters: int, warmup: int) -> float:
    """Median wall time of ``fn`` over ``iters`` runs, each started after a barrier of ``group`` (every member
    calls; the median, not the minimum, because a collective's time is set by its slowest member)."""
    import statistics

    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def collective_call(op: str, nbytes: int, n: int, group: Any, device: torch.device) -> tuple[Callable[[], None], int]:
    """The call for one collective (all_reduce, all_gather, reduce_scatter, all_to_all) of about ``nbytes`` (the
    full buffer, nccl-tests' convention) on a group of ``n`` ranks, and the exact byte count."""
    import torch.distributed as dist

    count = max(n, nbytes // 4 // n * n)  # float32 elements, divisible by n
    full = torch.zeros(count, device=device)
    part = torch.zeros(count // n, device=device)
    out = torch.zeros_like(full)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {"all_reduce": lambda: dist.all_reduce(full, group=group),
             "all_gather": lambda: gather(full, part, group=group),
             "reduce_scatter": lambda: scatter(part, full, group=group),
             "all_to_all": lambda: dist.all_to_all_single(out, full, group=group)}
    return calls[op], count * 4


def time_collective(op: str, nbytes: int, n: int, group: Any, device: torch.device, iters: int,
                    warmup: int) -> tuple[float, int, str]:
    """(this rank's median seconds, exact bytes, note) of one collective; a reduce-scatter the backend lacks is
    timed as the all-reduce of the same buffer and the note says so (the caller takes the slowest rank)."""
    fn, exact = collective_call(op, nbytes, n, group, device)
    note = ""
    if op == "reduce_scatter":
        try:
            fn()
        except (RuntimeError, NotImplementedError, ValueError):  # not in this backend: emulate
            note = "emulated by all_reduce"
            fn, exact = collective_call("all_reduce", nbytes, n, group, device)
    return median_time(fn, device, group, iters, warmup), exact, note


def p2p_call(pair: tuple[int, int] | None, rank: int, nbytes: int, device: torch.device) -> Callable[[], None]:
    """Ping-pong with the partner (no-op for ranks without one); the measured time is a round trip."""
    import torch.distributed as dist

    if pair is None:
        return lambda: None
    buf = torch.zeros(max(1, nbytes // 4), device=device)
    first, partner = pair[0] == rank, pair[1] if pair[0] == rank else pair[0]

    def ping() -> None:
        if first:
            dist.send(buf, partner)
            dist.recv(buf, partner)
        else:
            dist.recv(buf, partner)
            dist.send(buf, partner)

    return ping


def cluster_yaml(spec: Any, comment: str = "") -> str:
    """A ClusterSpec as the YAML ``autopar plan --cluster FILE`` reads (every field, ``runtime:`` included),
    under a ``# comment`` line: the one writer of probed and calibrated cluster files."""
    import dataclasses

    from omegaconf import OmegaConf

    head = f"# {comment}\n" if comment else ""
    return head + OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(spec)))


# ============================================================================================ blocks


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the ModuleList of one class holding the most parameters (not the experts)."""
    best: list[nn.Module] = []
    best_params = 0
    for mod in model.modules():
        kids = list(mod) if isinstance(mod, nn.ModuleList) else []
        if kids and all(type(k) is type(kids[0]) for k in kids) and any(p.dim() >= 2 for p in kids[0].parameters()):
            params = sum(p.numel() for p in mod.parameters())
            if params > best_params:
                best, best_params = kids, params
    return best


def _is_moe(block: nn.Module) -> bool:
    return any("moe" in type(m).__name__.lower() or isinstance(getattr(m, "experts", None), nn.ModuleList)
               for m in block.modules())


def _saved_bytes(fn: Callable[[], torch.Tensor], params: set[int]) -> tuple[torch.Tensor, int]:
    """Run ``fn`` recording the bytes autograd saves for backward (unique storages, parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def block_width(block: nn.Module) -> int:
    """The hidden size a block takes: the input width of its first matrix."""
    return next(p for p in block.parameters() if p.dim() >= 2).shape[-1]


def block_pass_seconds(block: nn.Module, mbs: int, seq_len: int, precision: str, device: torch.device) -> float:
    """One forward + backward of ``block`` on random hidden states (mbs, seq_len, width), untimed warm-up
    excluded: the pace a caller prices a full ``measure_blocks`` with. Accumulates into the block's ``.grad``."""
    dtype = DTYPES[precision]
    x = torch.randn(mbs, seq_len, block_width(block), device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32"):
        return timeit(lambda: _first_tensor(block(x)).sum().backward(), device, reps=1, warmup=0)


def _first_tensor(out: Any) -> torch.Tensor:
    """A block's output tensor (HF blocks return tuples, the hidden states first)."""
    while not isinstance(out, torch.Tensor):
        out = out[0]
    return out


def _time_fwd_bwd(call: Callable[[], Any], device: torch.device, params: set[int],
                  reps: int) -> BlockMeasure:
    fn = lambda: _first_tensor(call())  # noqa: E731
    out, saved = _saved_bytes(fn, params)
    grad = torch.ones_like(out)
    out.backward(grad)
    fwd = timeit(lambda: fn(), device, reps=reps, warmup=1)

    def both() -> None:
        fn().backward(grad)

    total = timeit(both, device, reps=reps, warmup=0)
    return BlockMeasure(fwd_s=fwd, bwd_s=max(total - fwd, 0.0), activation_bytes=float(saved))


def measure_blocks(model: nn.Module, mbs: int = 1, seq_len: int | None = None, precision: str = "fp32",
                   device: str | torch.device | None = None, reps: int = 5,
                   blocks: Sequence[nn.Module] | None = None, embedding: nn.Module | None = None,
                   head: nn.Module | None = None) -> Measured:
    """Time forward and backward of each distinct block (dense, MoE), the embedding and the LM head + loss,
    and the activation bytes each block saves, at (mbs, seq_len, precision) with tp=1. ``blocks``,
    ``embedding`` and ``head`` are the model's own modules when an analysis named them (else found by shape).
    Backward accumulates into the parameters' ``.grad``: callers that keep the model clear them after."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(dev)
    blocks = list(blocks) if blocks else repeated_blocks(model)
    if not blocks:
        raise ValueError("measure_blocks: no repeated transformer blocks (an nn.ModuleList of one class) found")
    hidden = block_width(blocks[0])
    cfg = getattr(model, "config", None)
    seq = int(seq_len or getattr(cfg, "seq_len", 0) or 128)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    dtype = DTYPES[precision]
    autocast = (torch.autocast(dev.type, dtype=dtype) if precision != "fp32" else torch.autocast(dev.type, enabled=False))
    found: dict[str, BlockMeasure] = {}
    with autocast:
        for block in blocks:
            kind = "moe" if _is_moe(block) else "dense"
            if kind in found:
                continue
            x = torch.randn(mbs, seq, hidden, device=dev, requires_grad=True)
            found[kind] = _time_fwd_bwd(lambda b=block, x=x: b(x), dev, params, reps)
        vocab = getattr(cfg, "vocab", None)
        emb = embedding or next((m for m in model.modules() if isinstance(m, nn.Embedding)
                                 and (vocab is None or m.num_embeddings == vocab)), None)
        head = head or next((m for m in reversed(list(model.modules())) if isinstance(m, nn.Linear)
                             and (vocab is None or m.out_features == vocab)), None)
        if emb is not None:
            idx = torch.randint(0, emb.num_embeddings, (mbs, seq), device=dev)
            found["embedding"] = _time_fwd_bwd(lambda: emb(idx), dev, params, reps)
        if head is not None:
            x = torch.randn(mbs, seq, head.in_features, device=dev, requires_grad=True)
            tgt = torch.randint(0, head.out_features, (mbs * seq,), device=dev)

            def head_loss() -> torch.Tensor:
                logits = head(x)
                return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt)

            found["head"] = _time_fwd_bwd(head_loss, dev, params, reps)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return Measured(mbs=mbs, seq_len=seq, precision=precision, blocks=found, device=name)


# ============================================================================================ cpu preset


def cpu_cluster_yaml(processes: int = 2, links: bool = True) -> str:
    """A ``cpu`` ClusterSpec YAML for this machine: one device per process, rates measured with one thread (the
    caller's thread count is restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cal = measure_device("cpu", precisions=("fp32", "bf16-mixed", "fp16-mixed"), sizes=(256, 512, 1024))
    finally:
        torch.set_num_threads(threads)
    link = measure_links(min(processes, 2)) if links else {"bandwidth_gbs": 1.0, "latency_us": 60.0}
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / processes
    tf = cal.matmul_tflops
    return f"""name: cpu
nodes: 1
devices_per_node: {processes}
device:
  name: cpu
  memory_gib: {mem_gib:.1f}
  peak_tflops: {{bf16: {tf['bf16-mixed']:.3f}, fp16: {tf['fp16-mixed']:.3f}, fp32: {tf['fp32']:.3f}}}
  memory_bandwidth_gbs: {cal.memory_bandwidth_gbs:.1f}
  gemm_efficiency: 1.0
  memory_efficiency: 1.0
  compute_units: 0
  tile: 1
  kernel_overhead_us: {cal.kernel_overhead_us:.1f}
  reserved_gib: 0.3
links:
  - {{level: node, bandwidth_gbs: {link['bandwidth_gbs']:.2f}, latency_us: {link['latency_us']:.1f}, topology: switch, efficiency: 1.0}}
"""


if __name__ == "__main__":
    print(cpu_cluster_yaml())


# ============================================================================================ whole passes


def _logits(out: Any) -> torch.Tensor:
    """The logits of a language model's output (a tensor, or an object / tuple holding them first)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else _first_tensor(out)


def token_forward(model: nn.Module, mbs: int, seq_len: int, vocab: int, precision: str,
                  device: torch.device) -> Callable[[], torch.Tensor]:
    """A forward + loss of the whole language model on random token ids (mbs, seq_len): the fp32 cross-entropy
    the LM head term prices (for a model whose own training step is not at hand)."""
    ids = torch.randint(0, vocab, (mbs, seq_len), device=device)
    target = torch.randint(0, vocab, (mbs * seq_len,), device=device)
    autocast = torch.autocast(device.type, dtype=DTYPES[precision], enabled=precision != "fp32")

    def forward() -> torch.Tensor:
        with autocast:
            logits = _logits(model(ids))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target)

    return forward


def pass_seconds(forward: Callable[[], torch.Tensor], device: torch.device, reps: int = 3,
                 warmup: int = 1) -> tuple[float, float]:
    """(forward, backward) median seconds of ``forward()`` (a loss) and its backward, every rank of the default
    group at once, each run started after a barrier: the pace training has when the processes share the machine
    (timings taken one rank at a time are optimistic on shared cores). Accumulates into the parameters' .grad."""
    import statistics

    import torch.distributed as dist

    for _ in range(warmup):
        forward().backward()
    fwd, bwd = [], []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        loss = forward()
        _sync(device)
        mid = time.perf_counter()
        loss.backward()
        _sync(device)
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
    return statistics.median(fwd), statistics.median(bwd)


def optimizer_step_seconds(params: Sequence[torch.Tensor], device: torch.device, reps: int = 3) -> float:
    """Median seconds of one AdamW step (torch's default implementation for the device) over fp32 copies of
    ``params`` with gradients, every rank at once after a barrier (the cost model prices Adam: cost.optimizer_time)."""
    copies = [torch.zeros_like(p, device=device, dtype=torch.float32, requires_grad=True) for p in params]
    for c in copies:
        c.grad = torch.full_like(c, 1e-3)
    opt = torch.optim.AdamW(copies, lr=1e-3)
    return median_time(opt.step, device, None, reps, warmup=1)  # the warm-up step allocates the states
