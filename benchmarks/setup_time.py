"""Set-up time before the first step (issue 25): what the Trainer strategy spends on one model before it builds
the mesh -- the analysis, the runtime's restrictions (the model's capabilities), the planning and ``check_plan``
-- with no profile and no trials, in one process planning for world 4 (``_plan_and_apply`` with the mesh and
the apply left out; the planning itself never needs the process group).

    python benchmarks/setup_time.py [--repeats 3] [--case gpt2 --case llama-1b ...]
    python benchmarks/setup_time.py --tree /tmp/base --tree . --repeats 3     # before/after, as ratios
    python benchmarks/setup_time.py --case readme --profile out.prof        # cProfile of one case
    python benchmarks/setup_time.py --pieces                                # the traced pieces alone

Cases: HF GPT-2 124M (seq 1024), a 1B HF Llama (LlamaConfig 2048 wide, 16 layers, GQA 32/8, seq 2048, built on
meta tensors), HF ResNet-152 (224x224, unit form) and README's main job (examples/train_gpt.py's gpt_small,
seq 64, global batch 16). Each measurement is a fresh interpreter (``--child``) with ``PYTHONPATH`` set to the tree
measured; with several trees, the runs alternate (tree A, tree B, A, B, ...) so that machine load hits both
alike. Prints per case and tree the median and best process CPU seconds of the repeats (a shared machine's load
moves wall time far more) and the median wall seconds, the CPU seconds per stage (analyse, restrictions, plan,
check_plan), and the speed-up of each tree's median CPU time over the first tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

CASES = ["gpt2", "llama-1b", "resnet152", "readme"]
WORLD = 4


# ============================================================================================ the child


def _module(case: str) -> tuple[Any, Any, Any]:
    """(LightningModule, DataLoader, cluster preset) of ``case``."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    if case == "readme":
        from lightning_autopar.config import gpt_config
        from lightning_autopar.data import ByteDataset
        from lightning_autopar.models.lit import LitGPT
        from lightning_autopar.specs import load_model_spec

        spec = load_model_spec(str(ROOT / "configs/model/gpt_small.yaml"))
        return (LitGPT(gpt_config(spec, seq_len=spec.seq_len), lr=3e-3),
                DataLoader(ByteDataset(seq_len=spec.seq_len), batch_size=16, drop_last=True), "cpu")
    import transformers as tf

    if case == "resnet152":
        from lightning_autopar.models.vision import LitImageClassifier, resnet152

        images = TensorDataset(torch.randn(16, 3, 224, 224), torch.randint(0, 1000, (16,)))
        return LitImageClassifier(resnet152()), DataLoader(images, batch_size=8), "h100-sxm-dgx"
    from lightning_autopar.models.hf import LitCausalLM

    if case == "gpt2":
        model, seq = tf.GPT2LMHeadModel(tf.GPT2Config()), 1024
        vocab = model.config.vocab_size
    elif case == "llama-1b":
        config = tf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048)
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(config)
        seq, vocab = 2048, config.vocab_size
    else:
        raise SystemExit(f"unknown case {case!r}: one of {CASES}")
    tokens = torch.randint(0, vocab, (16, seq + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    return LitCausalLM(model), loader, "h100-sxm-dgx"


class _Timer:
    """Process CPU seconds of the named strategy methods (re-entrant calls counted once): CPU time, which a shared
    machine's load disturbs far less than wall time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: Any, name: str, label: str) -> None:
        method = getattr(obj, name, None)
        if method is None:
            return
        depth = [0]

        def timed(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    self.seconds[label] = self.seconds.get(label, 0.0) + time.process_time() - start

        setattr(obj, name, timed)


def child(case: str, profile: str | None) -> dict[str, Any]:
    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.parallel import apply as apply_mod
    from lightning_autopar.runtime.analysis import step_model_call
    from lightning_autopar.specs import load_cluster_spec

    module, loader, preset = _module(case)
    cluster = load_cluster_spec(preset, nodes=1, devices_per_node=WORLD)
    timer = _Timer()

    class Bench(AutoParallelStrategy):  # the strategy's planning, minus the process group, mesh and apply
        @property
        def world_size(self) -> int:
            return WORLD

        @property
        def root_device(self) -> Any:  # no parallel devices without a Trainer; the stages run on the host
            import torch

            return torch.device("cpu")

        def _cluster_spec(self) -> Any:
            return cluster

        def _plan_loader(self) -> Any:
            return loader

        def _planned_steps(self) -> int | None:
            return 120

        def _model_call(self) -> Any:
            return step_model_call(self.lightning_module, self._first_batch(), "training_step")

        def _train_context(self) -> Any:
            return nullcontext()

        _eval_context = _train_context

        def _loss_scaler(self) -> Any:
            return None

        def _apply(self, plan: Any, *args: Any) -> None:
            # what apply_plan checks first; a tree with a capabilities record passes it (nothing traced again)
            if hasattr(args[0], "example"):  # the set-up stages: (analysed, capable, work)
                analysed, capable = args[0], args[1]
                apply_mod.check_plan(plan, analysed.analysis, self.lightning_module, analysed.model,
                                     analysed.example, capabilities=capable.capabilities)
            else:  # a tree before them (8b37e6c): (transformer, analysis, example)
                transformer, analysis, example = args
                apply_mod.check_plan(plan, analysis, self.lightning_module, transformer, example)

    strategy = Bench(cluster=preset, print_plan=False, profile=False, trials=0)
    strategy.connect(module)
    for name, label in [("_restrictions", "restrictions"), ("_apply", "check_plan")]:
        timer.wrap(strategy, name, label)
    try:
        from lightning_autopar.runtime import setup as setup_mod  # runtime.analysis.analyse, as the stage calls it
    except ImportError:  # a tree before the set-up stages (8b37e6c): planning.py calls it
        from lightning_autopar.runtime import planning as setup_mod
    timer.wrap(setup_mod, "analyse", "analyse")
    import lightning_autopar.planner.search as search

    timer.wrap(search, "plan", "plan")  # planning.py imports it inside the function: the patched one is found
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start, start_cpu = time.perf_counter(), time.process_time()
    strategy._plan_and_apply("32-true")
    total, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    return {"case": case, "wall_s": total, "cpu_s": cpu, "stages": timer.seconds, "plan": strategy.plan.short(),
            "excluded": sorted(strategy.excluded)}


def pieces(case: str) -> dict[str, float]:
    """CPU seconds (best of 3) of the traced pieces of a transformer's set-up, each alone: the analysis, the
    attention-call meta run (``context.attention_calls``) and the SP dry run of one block at tp=2."""
    from lightning_autopar.parallel import sequence
    from lightning_autopar.parallel.context import attention_calls
    from lightning_autopar.profile.analyze import analyze, find_transformer

    module = _module(case)[0]
    _, transformer = find_transformer(module)
    analysis = analyze(transformer, trace=True, runner=module)
    fqns = [b.fqn for b in analysis.blocks]
    runs = {"analyse": lambda: analyze(transformer, trace=True, runner=module),
            "attention run": lambda: attention_calls(transformer, fqns, 8),
            "sp dry run tp=2": lambda: sequence._dry_run(transformer, analysis, analysis.blocks[0], 2, module)}
    out = {}
    for name, run in runs.items():
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            run()
            best = min(best, time.process_time() - start)
        out[name] = round(best, 3)
    return out


# ============================================================================================ the parent

ROOT = Path(__file__).resolve().parent.parent


def run_child(tree: Path, case: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", case], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{case} on {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=CASES, help="repeatable; default: all")
    parser.add_argument("--tree", action="append", type=Path, help="a source tree to import (repeatable; "
                        "default: this one); the first is the baseline of the ratios")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", metavar="FILE", help="cProfile one run of the (single) case to FILE")
    parser.add_argument("--pieces", action="store_true", help="CPU seconds of the traced pieces alone (analysis, "
                        "attention meta run, SP dry run) of the transformer cases, in this process")
    parser.add_argument("--child", metavar="CASE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pieces:
        for case in args.case or [c for c in CASES if c != "resnet152"]:
            print(case, pieces(case), flush=True)
        return
    if args.child:
        print(json.dumps(child(args.child, args.profile)))
        return
    cases = args.case or CASES
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    if args.profile:
        env = {**os.environ, "PYTHONPATH": str(trees[-1])}
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", cases[0], "--profile",
                        args.profile], env=env, check=True)
        import pstats

        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(40)
        return
    results: dict[tuple[str, Path], list[dict[str, Any]]] = {}
    print(f"load average {os.getloadavg()[0]:.2f}; {args.repeats} repeats, trees alternated: "
          + ", ".join(str(t) for t in trees), flush=True)
    for case in cases:
        for r in range(args.repeats):
            for tree in trees:
                got = run_child(tree, case)
                results.setdefault((case, tree), []).append(got)
                print(f"  {case:10} {tree}  run {r + 1}: cpu {got['cpu_s']:.3f} s, wall {got['wall_s']:.3f} s; "
                      + " ".join(f"{k} {v:.3f}" for k, v in got["stages"].items()), flush=True)
    print()
    print(f"{'case':10} {'tree':24} {'cpu s':>6} {'best':>6} {'wall s':>7} {'ratio':>6}  stages (cpu s)  plan")
    for case in cases:
        base = None
        for tree in trees:
            runs = results[(case, tree)]
            median = statistics.median(r["cpu_s"] for r in runs)
            base = base or median
            labels = sorted({k for r in runs for k in r["stages"]})
            stages = " ".join(f"{k} {statistics.median(r['stages'].get(k, 0.0) for r in runs):.3f}" for k in labels)
            print(f"{case:10} {str(tree)[-24:]:24} {median:6.3f} {min(r['cpu_s'] for r in runs):6.3f} "
                  f"{statistics.median(r['wall_s'] for r in runs):7.3f} {base / median:5.2f}x  {stages}  "
                  f"{runs[-1]['plan']}")


if __name__ == "__main__":
    main()
