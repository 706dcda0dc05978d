"""Overhead against Lightning's own strategies: the same model, data and global batch per optimizer step.

    python benchmarks/overhead.py [--models gpt,llama] [--nproc 4] [--repeats 5] [--steps 10] [--warmup 3]
                                  [--launcher lightning|torchrun] [--diagnose]

Models: our GPT (``gpt``: hidden 256, 4 layers, 4 heads, GELU MLP 1024) and a Hugging Face ``LlamaForCausalLM``
(``llama``: the same width and depth, 4 heads over 2 KV heads, SwiGLU 688, RMSNorm, RoPE; models/hf.py), both
vocab 256, seq ``--seq-len``, AdamW. Pairs, per model, all in one launch (``--nproc`` CPU processes, gloo; the
process group is reused by every Trainer). No thread count or thread variable is set anywhere: each run gets
what a user's process gets from its strategy and launcher (``_common``: ``--launcher``, ``fresh_threads``), and
the threads each strategy trained with are reported:

* ``DDPStrategy`` vs ``AutoParallelStrategy(fix="dp=N,zero=0,mbs=B/N,grad_accum=1")``;
* ``ModelParallelStrategy`` with FSDP2 (the user's ``configure_model`` applies ``fully_shard`` to every block,
  then to the model) vs ``AutoParallelStrategy(fix="dp=N,zero=3,mbs=B/N,grad_accum=1")``.

Under ``--launcher lightning`` Lightning's ``ModelParallelStrategy`` leaves every rank it did not start with
torch's default threads (one per core); ``--launcher torchrun`` gives every strategy one thread per process.

Batch semantics: autopar's DataLoader batch is the global batch (it slices it over the ranks); DDP's and
ModelParallelStrategy's is per rank (Lightning adds a DistributedSampler). Both get the same global batch B per
optimizer step (the same rows, too). A pair's two runs are adjacent, which one goes first alternates between
repeats, and the pairs and the models rotate (``run_order``); each run is a fresh Trainer timed per optimizer step between barriers
after ``--warmup`` steps. Reported per model: the median step time per strategy over every timed step of every
repeat, throughput ratio = baseline step / autopar step (>= 0.98 is the target), the median of the per-repeat
paired ratios (adjacent runs, robust to load drift), the threads per process each strategy trained with and
the plan autopar applied. ``--diagnose`` adds two runs to each repeat, compared with DDP: FSDP2 on the (dp, 1) replicate mesh
autopar applies for zero=0, in plain Lightning, and autopar zero=0 with a training_step that logs nothing.
Results: OUT/overhead.json (default OUT: outputs/benchmarks). Quiet-machine waits and repeats as in
plan_quality.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    RUN_THREADS,
    bench_main,
    common_args,
    guarded_run,
    init_workers,
    load_summary,
    median,
    timed_fit,
    token_loader,
    write_result,
)
from plan_quality import model_configs  # noqa: E402

TARGET = 0.98
PAIRS = (("ddp", "autopar dp zero=0"), ("fsdp2", "autopar dp zero=3"))
# --diagnose: where a gap to DDP comes from -- FSDP2 on the replicate mesh autopar uses for zero=0, in plain
# Lightning; autopar zero=0 without the training_step's self.log (its per-step all-reduce of logged values)
DIAGNOSE = ("fsdp2 replicate", "autopar dp zero=0 no log")
APPLIED: dict[tuple[str, str], str] = {}  # (model, strategy) -> the plan autopar applied in its last run


def parse_args() -> argparse.Namespace:
    p = common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama, moe (our GPT with 4 experts)")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--diagnose", action="store_true", help=f"also run {' and '.join(DIAGNOSE)} (against ddp)")
    return p.parse_args()


def llama_spec(seq_len: int) -> Any:
    """The Hugging Face Llama of this benchmark: our GPT's width and depth, GQA and SwiGLU (about as many
    parameters: 3 x 688 vs 2 x 1024 MLP columns)."""
    from lightning_autopar.specs import ModelSpec

    return ModelSpec(name="llama-bench", layers=4, hidden=256, heads=4, kv_heads=2, ffn_hidden=688,
                     ffn_kind="swiglu", vocab=256, seq_len=seq_len)


def model_config(name: str, seq_len: int) -> Any:
    """What ``lit_module`` builds for model ``name``: a GPTConfig (gpt, moe) or the Llama's ModelSpec."""
    return llama_spec(seq_len) if name == "llama" else model_configs(seq_len)[name]


def lit_module(name: str, cfg: Any, shard: str | None = None, log: bool = True) -> Any:
    """The model's LightningModule (AdamW, lr 1e-3): LitGPT, or LitCausalLM over a random-init
    LlamaForCausalLM. ``shard``: its configure_model applies FSDP2 as a ModelParallelStrategy user writes it
    (``fully_shard`` on every block, then on the model) over the data-parallel mesh ("shard"), or over a
    (dp, 1) replicate x shard mesh ("replicate": the layout autopar applies for zero=0); ``log=False``: a
    training_step that logs nothing."""
    if name == "llama":
        from lightning_autopar.models.hf import LitCausalLM as base
        from lightning_autopar.models.hf import causal_lm
    else:
        from lightning_autopar.models.lit import LitGPT as base

    def blocks(module: Any) -> Any:  # the repeated layers: HF's decoder layers, our GPT's blocks
        return module.model.model.layers if name == "llama" else module.model.blocks

    class Module(base):  # type: ignore[valid-type,misc]
        def configure_model(self) -> None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if shard is None:
                return
            mesh = self.device_mesh["data_parallel"]
            if shard == "replicate":
                mesh = init_device_mesh("cpu", (mesh.size(), 1), mesh_dim_names=("dp_replicate", "dp_shard"))
            for block in blocks(self):
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch, batch_idx) if log else self.loss(batch)

    if name == "llama":
        return Module(causal_lm(cfg), optimizer="adamw", lr=1e-3)
    return Module(cfg, optimizer="adamw", lr=1e-3)


def run(model: str, name: str, cfg: Any, args: argparse.Namespace, world: int) -> list[float]:
    """One timed run of strategy ``name`` on ``model`` with a fresh Trainer (guarded_run: paused / repeated on a
    busy machine)."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_autopar import AutoParallelStrategy

    import lightning.pytorch as L

    gb, per_rank = args.global_batch, args.global_batch // world

    def attempt() -> list[float]:
        L.seed_everything(0, verbose=False)
        if name == "ddp":
            module, strategy, batch = lit_module(model, cfg), DDPStrategy(process_group_backend="gloo"), per_rank
        elif name.startswith("fsdp2"):
            module, batch = lit_module(model, cfg, shard="replicate" if "replicate" in name else "shard"), per_rank
            strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                             process_group_backend="gloo")
        else:  # "autopar dp zero=Z[ no log]"
            zero = name.split("zero=")[1][0]
            strategy = AutoParallelStrategy(fix=f"dp={world},zero={zero},mbs={per_rank},grad_accum=1", cluster="cpu",
                                            print_plan=False)
            module, batch = lit_module(model, cfg, log="no log" not in name), gb
        loader = token_loader(gb * (args.steps + args.warmup), cfg.seq_len, batch)
        times, trainer = timed_fit(module, strategy, loader, args.steps, args.warmup)
        applied = getattr(trainer.strategy, "plan", None)
        APPLIED[model, name] = applied.short() + f" recompute={applied.recompute}" if applied is not None else ""
        return times

    return guarded_run(attempt, args)


def run_order(repeat: int, diagnose: bool) -> list[str]:
    """The strategies of one model in repeat ``repeat``: each pair's two runs next to each other (their paired
    ratio sees the same machine load), which of the two goes first alternating between repeats, the pairs in
    a rotated order; the --diagnose runs last."""
    pairs = PAIRS[repeat % len(PAIRS):] + PAIRS[:repeat % len(PAIRS)]
    order = [name for pair in pairs for name in (pair if repeat % 2 == 0 else pair[::-1])]
    return order + (list(DIAGNOSE) if diagnose else [])


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    rank, world = init_workers()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must divide over {world} processes")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    cfgs = {m: model_config(m, args.seq_len) for m in models}
    names = [n for pair in PAIRS for n in pair] + (list(DIAGNOSE) if args.diagnose else [])
    samples: dict[tuple[str, str], list[list[float]]] = {(m, n): [] for m in models for n in names}
    threads: dict[tuple[str, str], list[int]] = {key: [] for key in samples}
    started = time.perf_counter()
    for r in range(args.repeats):
        order = run_order(r, args.diagnose)
        for model in models[r % len(models):] + models[:r % len(models)]:
            for name in order:
                samples[model, name].append(run(model, name, cfgs[model], args, world))
                threads[model, name].append(RUN_THREADS[-1])
                if rank == 0:
                    print(f"repeat {r + 1}/{args.repeats} {model} {name}: {1e3 * median(samples[model, name][-1]):.1f} "
                          f"ms/step ({RUN_THREADS[-1]} threads per process) {APPLIED.get((model, name), '')}",
                          flush=True)
    if rank != 0:
        return
    result = {"world": world, "models": models, "launcher": args.launcher, "global_batch": args.global_batch,
              "seq_len": args.seq_len, "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
              "pairs": {}, "seconds": time.perf_counter() - started, "load": load_summary()}
    pairs = list(PAIRS) + [("ddp", name) for name in (DIAGNOSE if args.diagnose else ())]
    missed = 0
    for model in models:
        for base, mine in pairs:
            b_runs, m_runs = samples[model, base], samples[model, mine]
            b_all, m_all = [t for x in b_runs for t in x], [t for x in m_runs for t in x]
            paired = [median(b) / median(m) for b, m in zip(b_runs, m_runs)]
            ratio = median(b_all) / median(m_all)
            result["pairs"][f"{model}: {mine} vs {base}"] = {
                "baseline_ms": 1e3 * median(b_all), "autopar_ms": 1e3 * median(m_all), "throughput_ratio": ratio,
                "paired_ratio_median": median(paired), "paired_ratios": paired,
                "threads": {base: sorted(set(threads[model, base])), mine: sorted(set(threads[model, mine]))},
                "plan": APPLIED.get((model, mine), ""),
                "per_run_ms": {base: [1e3 * median(x) for x in b_runs], mine: [1e3 * median(x) for x in m_runs]}}
            verdict = ""
            if (base, mine) in PAIRS:
                verdict = f" ({'met' if ratio >= TARGET else 'MISSED'} >= {TARGET})"
                missed += ratio < TARGET
            print(f"{model}: {mine} vs {base}: {1e3 * median(m_all):.1f} vs {1e3 * median(b_all):.1f} ms/step -> "
                  f"throughput ratio {ratio:.3f}{verdict}; paired per-repeat ratios "
                  f"{', '.join(f'{x:.3f}' for x in paired)} (median {median(paired):.3f}); threads per process "
                  f"{threads[model, mine][0]} vs {threads[model, base][0]}", flush=True)
    result["missed"] = missed
    write_result(args, "overhead.json", result, result["seconds"], "overhead")


def main() -> int:
    return bench_main(__file__, parse_args(), worker, "overhead.json")


if __name__ == "__main__":
    sys.exit(main())
