"""Runtime profiling at set-up: measure, on the live process group and within a time budget, what the cost model
needs for the candidate plans, and cache it on disk so a restart does not pay it again.

``profile_runtime`` is called on every rank at once. In priority order, each phase only when its estimated cost
fits what is left of the budget (else one phrase in ``RuntimeProfile.skipped``); every rank takes the same
decision because the elapsed time is the slowest rank's (one all-reduce per decision):

1. collectives on the groups the plans' meshes use (dp, dp_shard, tp, pp, cp, ep, as topology/mesh.py lays
   them out): all-reduce, all-gather, reduce-scatter at 4 KiB (latency) and at about the plan's gradient bytes
   (bandwidth; capped at 4 MiB on CPU, 64 MiB on GPU), p2p between pipeline neighbours, all-to-all for ep;
2. compute at the plans' distinct micro-batch sizes: whole forward + loss + backward passes of the model, every
   rank at once after a barrier (the contention training has), the slowest rank's median (a model that does not
   run on token ids alone: its blocks, embedding and head one by one); then one optimizer step;
The runtime's fixed host costs (specs.RuntimeCosts: FSDP2 units, DTensor dispatch, pipeline actions) do not
depend on the model: runtime/paths.py measures them once per cluster on the runtime's own paths.

The model, its gradients, the RNG streams and the process groups are as before afterwards.
The cache lives under ``cache_dir()`` (``$AUTOPAR_CACHE`` if set, else ~/.cache/lightning_autopar/profiles):
``<cluster_key>/<model_key>/profile.json`` + ``cluster.yaml`` (a ClusterSpec file ``autopar plan --cluster``
reads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_autopar.dims import ParallelDims
from lightning_autopar.profile.analyze import block_modules
from lightning_autopar.profile.measure import (block_pass_seconds, cluster_yaml, measure_blocks, median_time,
                                               optimizer_step_seconds, pass_seconds, token_forward, p2p_call,
                                               repeated_blocks, time_collective)
from lightning_autopar.specs import (BlockSample, ClusterSpec, CollectiveSample, ModelSpec, Plan, RuntimeCosts,
                                     RuntimeProfile)

# the user's training step on mbs rows of its first batch, as a loss to backward (the strategy builds it)
StepPass = Callable[[int], Callable[[], torch.Tensor]]
FORMAT = 1  # profile.json layout; another value is an old cache and is re-measured
COSTS_FILE = "runtime_costs.json"  # per cluster: the runtime's fixed costs (runtime/paths.py)
SMALL_BYTES = 4 << 10  # the latency message
LARGE_CAP = {"cpu": 4 << 20}  # bandwidth message cap per device type; others: GPU_LARGE_CAP
GPU_LARGE_CAP = 64 << 20
ITERS, WARMUP = 9, 1  # timed / untimed runs per collective (the median: shared cores make single runs noisy)
BLOCK_REPS = 3  # timed runs per block (measure.timeit keeps the minimum)
BLOCK_PASSES = 2 * BLOCK_REPS + 4  # forward + backward passes measure_blocks makes per kind (saved bytes, warm-ups)
MAX_MBS = 3  # distinct micro-batch sizes timed
MODEL_REPS = 3  # timed whole-model passes per mbs (the median, every rank at once)
OPTIMIZER_REPS = 3  # timed optimizer steps
COMPILE_REPS = 3  # timed eager / compiled block passes (the median of each)
COMPILE_WARMUP_S = 30.0  # a priori: inductor compiling one block's forward and backward (CPU, tiny blocks: ~20 s)
SYNC_CALLS = 8  # compute + all-reduce rounds timed for the collective sync cost
SYNC_CHUNK_S = (0.002, 0.02)  # the compute between two collectives: one block's forward, within these bounds
# A-priori link figures before any is measured (bytes/s, latency s): conservative so a budget is not overrun;
# replaced by the measured all-reduce as soon as there is one.
PRIOR = {"cpu": (2e8, 3e-4), "gpu": (5e9, 5e-5)}
GROUP_KINDS = ("dp", "dp_shard", "tp", "pp", "cp")  # dims.GROUP_DIMS names whose groups communicate (+ ep)


# --------------------------------------------------------------------------------------------- budget


@dataclass
class Clock:
    """The budget, decided on the slowest rank's elapsed time so that every rank takes the same decisions."""

    budget_s: float
    device: torch.device
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        """Seconds since the start on the slowest rank (an all-reduce: call on every rank)."""
        import torch.distributed as dist

        mine = torch.tensor([time.perf_counter() - self.start], dtype=torch.float64, device=self.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine)

    def fits(self, estimate_s: float) -> bool:
        return self.budget_s > 0 and self.elapsed() + estimate_s <= self.budget_s


def slowest(values: Sequence[float], device: torch.device) -> list[float]:
    """Each figure's maximum over the ranks (what a collective step waits for)."""
    import torch.distributed as dist

    if not values:
        return []
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# --------------------------------------------------------------------------------------------- groups


@dataclass(frozen=True)
class GroupKind:
    """One partition of the ranks into groups of one kind (all groups of a plan's mesh dim)."""

    kind: str  # dp | dp_shard | tp | pp | cp | ep
    groups: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.groups[0])

    @property
    def stride(self) -> int:
        return self.groups[0][1] - self.groups[0][0]


def plan_groups(plan: Plan) -> list[GroupKind]:
    """The communicating groups (size > 1) of ``plan``'s mesh, by kind (dims.py's rank order)."""
    dims = ParallelDims.from_plan(plan)
    found = {kind: dims.groups(kind) for kind in GROUP_KINDS}
    found["ep"] = dims.groups("ep") if plan.ep > 1 else [[0]]
    if plan.zero == 0 or plan.shard_size == plan.dp:  # dp_shard is dp itself or not sharded: no extra group
        found.pop("dp_shard")
    return [GroupKind(kind, tuple(tuple(g) for g in groups)) for kind, groups in found.items() if len(groups[0]) > 1]


def distinct_groups(plans: Sequence[Plan]) -> list[GroupKind]:
    """Each partition once (the first plan's kind name), in the plans' order."""
    seen: dict[tuple, GroupKind] = {}
    for plan in plans:
        for g in plan_groups(plan):
            seen.setdefault((g.groups, g.kind == "ep", g.kind == "pp"), g)
    return list(seen.values())


@contextlib.contextmanager
def subgroups(groups: tuple[tuple[int, ...], ...]) -> Iterator[Any]:
    """This rank's process group of the partition (every rank creates all of them), destroyed on exit."""
    import torch.distributed as dist

    mine, made = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    try:
        yield mine
    finally:
        for group in made:
            dist.destroy_process_group(group)


def neighbour_pairs(groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, int]]:
    """Disjoint pipeline-neighbour pairs (stage 0-1, 2-3, ... of each pipeline) for the p2p ping-pong."""
    return [(g[i], g[i + 1]) for g in groups for i in range(0, len(g) - 1, 2)]


# --------------------------------------------------------------------------------------------- phase 1


@dataclass
class LinkEstimate:
    """Seconds one collective is expected to take: latency + bytes / bandwidth, a prior until measured."""

    latency_s: float
    seconds_per_byte: float

    @classmethod
    def prior(cls, device: torch.device) -> LinkEstimate:
        bytes_per_s, latency_s = PRIOR["cpu" if device.type == "cpu" else "gpu"]
        return cls(latency_s, 1 / bytes_per_s)

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    def learn(self, sample: CollectiveSample) -> None:
        """Take a measured all-reduce (the same on every rank): the small one sets the latency, the large one
        the time per byte."""
        if sample.nbytes <= SMALL_BYTES:
            self.latency_s = sample.seconds
        elif sample.seconds > self.latency_s:
            self.seconds_per_byte = (sample.seconds - self.latency_s) / sample.nbytes


def large_bytes(spec: ModelSpec, plans: Sequence[Plan], device: torch.device) -> int:
    """The bandwidth message: about the largest per-rank fp32 gradient of the plans (params / (tp * pp)),
    capped by device type (a larger one adds time, not information)."""
    grads = max(spec.total_params() * 4 // (p.tp * p.pp) for p in plans) if plans else SMALL_BYTES
    return int(max(SMALL_BYTES * 4, min(grads, LARGE_CAP.get(device.type, GPU_LARGE_CAP))))


def measure_group(kind: GroupKind, sizes: Sequence[int], device: torch.device) -> list[CollectiveSample]:
    """Every op a group of this kind runs, at each size: this rank's medians, then the slowest rank's."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ops = ["all_reduce", "all_gather", "reduce_scatter"] + (["all_to_all"] if kind.kind == "ep" else [])
    samples: list[CollectiveSample] = []
    local: list[float] = []
    with subgroups(kind.groups) as group:
        for op in ops:
            for size in sizes:
                seconds, nbytes, note = time_collective(op, size, kind.size, group, device, ITERS, WARMUP)
                if note:  # emulated: not the op the plans run
                    continue
                samples.append(CollectiveSample(op, kind.size, kind.stride, nbytes, 0.0))
                local.append(seconds)
    if kind.kind == "pp":
        mine = next((p for p in neighbour_pairs(kind.groups) if rank in p), None)
        for size in sizes:
            round_trip = median_time(p2p_call(mine, rank, size, device), device, None, ITERS, WARMUP)
            samples.append(CollectiveSample("p2p", 2, kind.stride, max(4, size // 4 * 4), 0.0))
            local.append(round_trip / 2 if mine else 0.0)
    for sample, seconds in zip(samples, slowest(local, device)):
        sample.seconds = seconds
    return samples


def phase_collectives(plans: Sequence[Plan], spec: ModelSpec, clock: Clock, link: LinkEstimate,
                      profile: RuntimeProfile) -> None:
    sizes = (SMALL_BYTES, large_bytes(spec, plans, clock.device))
    for kind in distinct_groups(plans):
        n_ops = 3 + (kind.kind == "ep") + (kind.kind == "pp")
        estimate = n_ops * (ITERS + WARMUP) * sum(2 * link.seconds(s) for s in sizes)  # + a barrier per run
        if not clock.fits(estimate):
            profile.skipped.append(f"collectives on {kind.kind} groups of {kind.size} (stride {kind.stride}): "
                                   f"~{estimate:.2f} s over the budget")
            continue
        for sample in measure_group(kind, sizes, clock.device):
            profile.collectives.append(sample)
            if sample.op == "all_reduce":
                link.learn(sample)


# --------------------------------------------------------------------------------------------- phase 2


@contextlib.contextmanager
def kept_gradients(model: nn.Module) -> Iterator[None]:
    """The model's ``.grad`` as before on exit (timing a block's backward accumulates into them)."""
    params = list(model.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


def _named(model: nn.Module, name: str | None) -> nn.Module | None:
    if not name:
        return None
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def model_blocks(model: nn.Module, analysis: Any) -> tuple[list[nn.Module], nn.Module | None, nn.Module | None]:
    """(blocks, token embedding, LM head) as the analysis named them (else found by shape; None: measure_blocks
    finds the embedding and head by the vocabulary)."""
    holder = _named(model, getattr(analysis, "blocks_fqn", None))
    holds = holder is not None and getattr(analysis, "blocks_fqn", "")  # "": a model in unit form, no stack
    blocks = [m for _, m in block_modules(holder)] if holds else repeated_blocks(model)
    head = _named(model, getattr(analysis, "lm_head", None))
    embedding = _named(model, getattr(analysis, "token_embedding", None))
    return blocks, embedding, head if isinstance(head, nn.Linear) else None


def phase_blocks(model: nn.Module, analysis: Any, plans: Sequence[Plan], seq_len: int, precision: str,
                 clock: Clock, profile: RuntimeProfile, step_pass: StepPass | None = None) -> None:
    """Compute at the plans' distinct mbs (at most MAX_MBS, best plan's first): whole forward + loss + backward
    passes -- of the user's own training step when ``step_pass`` gives one, else of the model on token ids --
    every rank at once (phase_model_passes); a model that runs neither way falls back to its blocks one by one
    (phase_block_parts). Then one optimizer step."""
    spec: ModelSpec = analysis.spec
    sizes = list(dict.fromkeys(p.mbs for p in plans))
    for mbs in sizes[MAX_MBS:]:
        profile.skipped.append(f"model passes at mbs={mbs}: at most {MAX_MBS} micro-batch sizes")
    if step_pass is None and spec.unit_form:
        profile.skipped.append("model passes: a unit-form model runs only on the user's batch (none here)")
    elif not phase_model_passes(model, spec, sizes[:MAX_MBS], seq_len, precision, clock, profile, step_pass):
        if spec.unit_form:
            profile.skipped.append("model passes: the training step did not run on its own")
        else:
            phase_block_parts(model, analysis, sizes[:MAX_MBS], seq_len, precision, clock, profile)
    phase_optimizer(model, precision, clock, profile)


def phase_model_passes(model: nn.Module, spec: ModelSpec, sizes: Sequence[int], seq_len: int, precision: str,
                       clock: Clock, profile: RuntimeProfile, step_pass: StepPass | None = None) -> bool:
    """BlockSample(kind "model") per mbs: the slowest rank's median forward + loss and backward of the whole
    model (measure.pass_seconds) -- ``step_pass(mbs)``, the user's step on mbs rows, else token ids. Each mbs is
    priced at the pace of the last one timed, the first at a pilot pass. False when it does not run (the caller
    times the blocks instead)."""
    pace = 0.0  # seconds per sample of one forward + backward

    def forward(mbs: int) -> Callable[[], torch.Tensor]:
        if step_pass is not None:
            return step_pass(mbs)
        return token_forward(model, mbs, seq_len, spec.vocab, precision, clock.device)

    for mbs in sizes:
        if not pace:
            if not clock.fits(0.0):
                profile.skipped.append("model passes: no budget left")
                return True
            pilot = _guarded(lambda: sum(pass_seconds(forward(mbs), clock.device, reps=1, warmup=0)), model,
                             clock.device)
            if pilot is None:
                return False
            pace = slowest([pilot], clock.device)[0] / mbs
        estimate = pace * mbs * (MODEL_REPS + 1)
        if not clock.fits(estimate):
            profile.skipped.append(f"model pass at mbs={mbs}: ~{estimate:.2f} s over the budget")
            continue
        started = time.perf_counter()
        got = _guarded(lambda: pass_seconds(forward(mbs), clock.device, reps=MODEL_REPS, warmup=1), model,
                       clock.device)
        if got is None:
            return False
        fwd, bwd = slowest(list(got), clock.device)
        profile.blocks.append(BlockSample("model", mbs, seq_len, precision, fwd, bwd))
        pace = slowest([time.perf_counter() - started], clock.device)[0] / (mbs * (MODEL_REPS + 1))
    return True


def phase_sync(analysis: Any, clock: Clock, profile: RuntimeProfile) -> None:
    """RuntimeCosts.sync_us: what a blocking collective costs beyond its own latency when the ranks come to it
    from compute rather than from a barrier, as in training (every rank at once): SYNC_CALLS rounds of a compute
    chunk (about one block's forward, from the model passes) then a 4-byte all-reduce on the world group, against
    the same rounds without it; the difference per call, less the aligned latency (phase 1), the slowest rank's."""
    import torch.distributed as dist

    passes = [b for b in profile.blocks if b.kind == "model"]
    layers = max(int(getattr(analysis.spec, "layers", 1) or 1), 1)
    chunk_s = min(max(passes[0].fwd_s / (2 * layers) if passes else SYNC_CHUNK_S[0], SYNC_CHUNK_S[0]),
                  SYNC_CHUNK_S[1])
    if dist.get_world_size() < 2:  # nothing to wait for
        return
    if not clock.fits(2.5 * SYNC_CALLS * chunk_s):
        profile.skipped.append("collective sync: over the budget")
        return
    device = clock.device
    a = torch.randn(256, 256, device=device)
    reps = max(1, round(chunk_s / max(median_time(lambda: a @ a, device, None, 3, 1), 1e-6)))
    one = torch.zeros(1, device=device)

    def rounds(with_sync: bool) -> float:
        dist.barrier()
        started = time.perf_counter()
        for _ in range(SYNC_CALLS):
            for _ in range(reps):
                a @ a
            if with_sync:
                dist.all_reduce(one)
        dist.barrier()
        return time.perf_counter() - started

    rounds(True)  # warm-up
    extra = (rounds(True) - rounds(False)) / SYNC_CALLS
    aligned = [c.seconds for c in profile.collectives if c.op == "all_reduce" and c.nbytes <= SMALL_BYTES]
    sync = max(extra - (min(aligned) if aligned else 0.0), 0.0)
    profile.runtime.sync_us = round(slowest([sync], device)[0] * 1e6, 1)


def phase_optimizer(model: nn.Module, precision: str, clock: Clock, profile: RuntimeProfile) -> None:
    """BlockSample(kind "optimizer", fwd_s = one AdamW step over copies of the model's parameters), the slowest
    rank's median: what the optimizer term (cost.optimizer_time) costs on this machine."""
    params = [p for p in model.parameters() if p.requires_grad]
    pilot = 4.0 * 16 * sum(p.numel() for p in params) / 1e9  # ~4 passes of 16 B/param at a pessimistic 1 GB/s
    if not params or not clock.fits(pilot * (OPTIMIZER_REPS + 1)):
        profile.skipped.append("optimizer step: over the budget")
        return
    seconds = optimizer_step_seconds(params, clock.device, OPTIMIZER_REPS)
    profile.blocks.append(BlockSample("optimizer", 0, 0, precision, slowest([seconds], clock.device)[0], 0.0))


def phase_block_parts(model: nn.Module, analysis: Any, sizes: Sequence[int], seq_len: int, precision: str,
                      clock: Clock, profile: RuntimeProfile) -> None:
    """The blocks at ``sizes`` one by one (measure_blocks). Each mbs is priced at the pace of the last one timed
    (seconds per sample, the slowest rank's); the first at a pilot: one block's forward + backward x
    BLOCK_PASSES x the kinds timed (distinct blocks, embedding, head)."""
    spec: ModelSpec = analysis.spec
    blocks, embedding, head = model_blocks(model, analysis)
    kinds = 2 + (1 if spec.experts == 0 else 2)
    pace = 0.0  # seconds per sample of a full measurement
    for mbs in sizes:
        if not pace and clock.fits(0.0):
            pace = _guarded(lambda: block_pass_seconds(blocks[0], mbs, seq_len, precision, clock.device), model,
                            clock.device) if blocks else None
            if pace is None:
                name = type(blocks[0]).__name__ if blocks else "the model"
                profile.skipped.append(f"blocks: {name} does not run on hidden states alone (trials measure it)")
                return
            pace *= BLOCK_PASSES * kinds / mbs
        estimate = pace * mbs
        if not pace or not clock.fits(estimate):
            why = f"~{estimate:.2f} s over the budget" if pace else "no budget left"
            profile.skipped.append(f"blocks at mbs={mbs}: {why}")
            continue
        started = time.perf_counter()
        measured = _guarded(lambda: measure_blocks(model, mbs, seq_len, precision, clock.device, BLOCK_REPS, blocks,
                                                   embedding, head).blocks, model, clock.device)
        if measured is None:
            profile.skipped.append(f"blocks at mbs={mbs}: {type(blocks[0]).__name__} failed to run alone")
            return
        found = sorted(measured.items())
        figures = slowest([t for _, b in found for t in (b.fwd_s, b.bwd_s)], clock.device)
        for i, (kind, _) in enumerate(found):
            profile.blocks.append(BlockSample(kind, mbs, seq_len, precision, figures[2 * i], figures[2 * i + 1]))
        pace = slowest([time.perf_counter() - started], clock.device)[0] / mbs


def phase_compile(model: nn.Module, analysis: Any, plans: Sequence[Plan], seq_len: int, precision: str,
                  clock: Clock, profile: RuntimeProfile) -> None:
    """RuntimeCosts.compile_speedup when a plan has compile=true: one block's forward + backward eager over
    the same compiled (``torch.compile`` of the block, the module untouched), at the first such plan's mbs, the
    slowest rank's figures. The compile warm-up (COMPILE_WARMUP_S a priori) is set-up time, checked against the
    budget; a block that does not run on hidden states alone, or does not compile, is skipped (one phrase)."""
    wanted = [p for p in plans if p.compile]
    if not wanted:
        return
    blocks, _, _ = model_blocks(model, analysis)
    if not blocks:
        profile.skipped.append("compile speed-up: no block to time")
        return
    if not clock.fits(COMPILE_WARMUP_S):
        profile.skipped.append(f"compile speed-up: ~{COMPILE_WARMUP_S:.0f} s of compile warm-up over the budget")
        return
    block, mbs = blocks[0], wanted[0].mbs
    compiled = torch.compile(block)

    def times() -> list[float]:
        block_pass_seconds(compiled, mbs, seq_len, precision, clock.device)  # the warm-up: compiles fwd and bwd
        reps = [(block_pass_seconds(block, mbs, seq_len, precision, clock.device),
                 block_pass_seconds(compiled, mbs, seq_len, precision, clock.device)) for _ in range(COMPILE_REPS)]
        return [statistics.median(r[0] for r in reps), statistics.median(r[1] for r in reps)]

    try:
        measured = _guarded(times, model, clock.device)
    except Exception:  # noqa: BLE001 -- inductor's own errors: no speed-up measured, compile priced as eager
        measured = None
    failed = slowest([0.0 if measured else 1.0], clock.device)[0]
    if failed:
        profile.skipped.append(f"compile speed-up: {type(block).__name__} did not run compiled on hidden states")
        return
    eager_s, compiled_s = slowest(measured, clock.device)
    profile.runtime.compile_speedup = eager_s / max(compiled_s, 1e-9)


def _guarded(run: Callable[[], Any], model: nn.Module, device: torch.device) -> Any:
    """``run()`` with the model's gradients kept; None on every rank when it failed on any (a block that needs
    more than hidden states: HF blocks' position embeddings), so that every rank takes the same path."""
    try:
        with kept_gradients(model):
            value, failed = run(), 0.0
    except (RuntimeError, TypeError, ValueError, IndexError, AttributeError):
        value, failed = None, 1.0
    return None if slowest([failed], device)[0] else value


# --------------------------------------------------------------------------------------------- entry


def profile_runtime(model: nn.Module, analysis: Any, plans: Sequence[Plan], seq_len: int, precision: str,
                    budget_s: float, device: torch.device, step_pass: StepPass | None = None) -> RuntimeProfile:
    """Measure collectives and compute for ``plans`` (best first) on the live default process
    group within ``budget_s`` seconds (module docstring); call on every rank at once. Prints nothing; leaves the
    model, its gradients, the RNG streams and the process groups as they were."""
    spec: ModelSpec = analysis.spec
    profile = RuntimeProfile(budget_s=float(budget_s))
    clock = Clock(float(budget_s), device)
    link = LinkEstimate.prior(device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the blocks' inputs and dropout draw from it
        phase_collectives(plans, spec, clock, link, profile)
        phase_blocks(model, analysis, plans, seq_len, precision, clock, profile, step_pass)
        phase_compile(model, analysis, plans, seq_len, precision, clock, profile)
        phase_sync(analysis, clock, profile)
    profile.seconds = clock.elapsed()
    return profile


def _digest(parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cluster_fingerprint(cluster: ClusterSpec) -> str:
    """Short hex of what a runtime profile depends on besides the model: device name, world, nodes x devices,
    threads per process, torch version, process-group backend."""
    import torch.distributed as dist

    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
    return _digest([cluster.device.name, cluster.world_size, cluster.nodes, cluster.devices_per_node,
                    torch.get_num_threads(), torch.__version__, backend])


def model_fingerprint(spec: ModelSpec, global_batch: int, seq_len: int, precision: str) -> str:
    """Short hex of the model spec (every field, units included) and the batch, sequence and precision."""
    return _digest([dataclasses.asdict(spec), global_batch, seq_len, precision])


def cache_dir() -> Path:
    """``$AUTOPAR_CACHE`` if set (optional), else ~/.cache/lightning_autopar/profiles."""
    root = os.environ.get("AUTOPAR_CACHE", "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "lightning_autopar" / "profiles"


def profile_folder(cluster_key: str, model_key: str | None = None, cache: Path | None = None) -> Path:
    """Where the cache keeps a (cluster, model) profile -- or, without ``model_key``, what it keeps per cluster."""
    folder = Path(cache or cache_dir()) / cluster_key
    return folder / model_key if model_key else folder



def load_cluster_costs(cluster_key: str, cache: Path | None = None) -> RuntimeCosts | None:
    """The runtime fixed costs cached for a cluster (runtime/paths.py measures them), or None when absent or
    unreadable (then they are measured again)."""
    try:
        data = json.loads((profile_folder(cluster_key, None, cache) / COSTS_FILE).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        return RuntimeCosts(**data["runtime"])
    except Exception:  # noqa: BLE001 - any damage means re-measure
        return None


def save_cluster_costs(cluster_key: str, costs: RuntimeCosts, detail: Any, cache: Path | None = None) -> None:
    """Write the cluster's runtime fixed costs (and ``detail``: what they were fitted from) atomically, rank 0."""
    import torch.distributed as dist

    from lightning_autopar.files import atomic_file

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    text = json.dumps({"format": FORMAT, "runtime": dataclasses.asdict(costs), "detail": detail}, indent=1,
                      default=str)
    with atomic_file(profile_folder(cluster_key, None, cache) / COSTS_FILE) as tmp:
        tmp.write_text(text, encoding="utf-8")


def load_profile(cluster_key: str, model_key: str,
                 cache: Path | None = None) -> tuple[RuntimeProfile, ClusterSpec] | None:
    """The cached (profile, calibrated cluster) for these keys, or None when absent, of another format or
    unreadable (then it is measured again: a cache never stops a run)."""
    from lightning_autopar.specs import load_cluster_spec

    folder = profile_folder(cluster_key, model_key, cache)
    try:
        data = json.loads((folder / "profile.json").read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        profile = RuntimeProfile(**data["profile"])
        if (profile.cluster_key, profile.model_key) != (cluster_key, model_key):
            return None
        return profile, load_cluster_spec(str(folder / "cluster.yaml"))
    except Exception:  # noqa: BLE001 - any damage (missing, truncated, old fields, bad YAML) means re-measure
        return None


def save_profile(profile: RuntimeProfile, calibrated: ClusterSpec, cache: Path | None = None) -> Path:
    """Write ``profile.json`` and ``cluster.yaml`` under <cache>/<cluster_key>/<model_key>/ (rank 0 only, each
    file atomically); return the folder."""
    import torch.distributed as dist

    from lightning_autopar.files import atomic_file

    folder = profile_folder(profile.cluster_key, profile.model_key, cache)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return folder
    texts = {"profile.json": json.dumps({"format": FORMAT, "profile": dataclasses.asdict(profile)}, indent=1),
             "cluster.yaml": cluster_yaml(calibrated, f"calibrated by lightning_autopar ({profile.runtime.source})")}
    for name, text in texts.items():
        with atomic_file(folder / name) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return folder
