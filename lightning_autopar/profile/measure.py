"""Measure on the live device: matmul rate and memory bandwidth (to calibrate a cluster preset), collective
latency/bandwidth over gloo, and the forward/backward time and activation memory of each distinct block of a
model (fed to the planner as ``plan(..., measured=measure_blocks(...))`` in place of the analytic terms).

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
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# ============================================================================================ blocks


def _blocks(model: nn.Module) -> list[nn.Module]:
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


def _time_fwd_bwd(fn: Callable[[], torch.Tensor], device: torch.device, params: set[int],
                  reps: int) -> BlockMeasure:
    out, saved = _saved_bytes(fn, params)
    grad = torch.ones_like(out)
    out.backward(grad)
    fwd = timeit(lambda: fn(), device, reps=reps, warmup=1)

    def both() -> None:
        fn().backward(grad)

    total = timeit(both, device, reps=reps, warmup=0)
    return BlockMeasure(fwd_s=fwd, bwd_s=max(total - fwd, 0.0), activation_bytes=float(saved))


def measure_blocks(model: nn.Module, mbs: int = 1, seq_len: int | None = None, precision: str = "fp32",
                   device: str | torch.device | None = None, reps: int = 5) -> Measured:
    """Time forward and backward of each distinct block (dense, MoE), the embedding and the LM head + loss,
    and the activation bytes each block saves, at (mbs, seq_len, precision) with tp=1."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(dev)
    blocks = _blocks(model)
    if not blocks:
        raise ValueError("measure_blocks: no repeated transformer blocks (an nn.ModuleList of one class) found")
    hidden = next(p for p in blocks[0].parameters() if p.dim() >= 2).shape[-1]
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
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding) and (vocab is None or m.num_embeddings == vocab)), None)
        head = next((m for m in reversed(list(model.modules())) if isinstance(m, nn.Linear)
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
