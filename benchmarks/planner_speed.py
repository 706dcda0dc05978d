"""Planner speed: candidates priced per second for a 1T GPT on 3072 A100s, a Mixtral-like MoE, ResNet-152 in unit
form and BERT-Large on 64 devices (issue 13: planning < 1 s each), and the analysis of a ResNet-152-size and a
BERT-Large-size model on meta tensors (issue 13: < 2 s each).

    python benchmarks/planner_speed.py [--repeat 3] [--cli]
    python benchmarks/planner_speed.py --before DIR [--repeat 5]

``--before DIR``: whole ``autopar plan --json`` calls, each in a fresh interpreter as users run it, of the tree
in DIR (e.g. ``git archive main | tar -x -C DIR``) and of this one, alternated in one run (CLI_CASES): wall and
CPU seconds (the child's user + sys, which a shared machine disturbs less), candidates evaluated.

Prints, per case: candidates evaluated, feasible, search seconds (best and median wall time of the repeats,
and the process CPU time, which a busy shared machine disturbs less; the explanation's what-if re-runs
included) and candidates/s. ``--cli`` also times ``autopar plan`` end to end
in a fresh interpreter (imports included).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = [
    # (label, model, cluster, nodes, global batch)
    ("gpt-1t on 384 x 8 A100-80G", "gpt-1t", "a100-80g-dgx", 384, 3072),
    ("mixtral-8x7b on 32 x 8 H100", "mixtral-8x7b", "h100-sxm-dgx", 32, 1024),
    ("resnet152 (unit form, 53 units) on 8 x 8 A100-80G", "resnet152", "a100-80g-dgx", 8, 2048),
    ("bert-large on 8 x 8 A100-80G", "bert-large", "a100-80g-dgx", 8, 1024),
]


CLI_CASES = [
    # (label, autopar plan arguments)
    ("1T GPT, 384 x 8 A100 (3,072 GPUs), gb 3072",
     "--model gpt-1t --cluster a100-80g-dgx --nodes 384 --global-batch 3072"),
    ("1T GPT, 12,288 x 8 A100 (98,304 GPUs), gb 3072",
     "--model gpt-1t --cluster a100-80g-dgx --nodes 12288 --global-batch 3072"),
    ("Llama-2-70B, 64 x 8 A100, gb 1024", "--model llama2-70b --cluster a100-80g-dgx --nodes 64 --global-batch 1024"),
    ("Mixtral 8x7B, 32 x 8 H100, gb 1024",
     "--model mixtral-8x7b --cluster h100-sxm-dgx --nodes 32 --global-batch 1024"),
]


def cli_call(tree: str, args: str) -> tuple[float, float, int]:
    """(wall s, CPU s, candidates evaluated) of one ``autopar plan --json`` call in a fresh interpreter on ``tree``."""
    import json
    import os
    import resource

    env = dict(os.environ, PYTHONPATH=tree)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "lightning_autopar.cli", "plan", *args.split(), "--json"], cwd=tree,
                         env=env, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(out)["evaluated"]


def compare_cli(before: str, repeat: int) -> None:
    """CLI_CASES on the tree in ``before`` and on this one, alternated; a markdown table."""
    import os

    after = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print("| case | candidates | wall before / after (median; best) | CPU before / after (median) | speed-up (CPU) |")
    print("|---|---|---|---|---|")
    for label, args in CLI_CASES:
        runs: dict[str, list] = {"before": [], "after": []}
        for i in range(repeat):
            for name, tree in (("before", before), ("after", after))[:: 1 if i % 2 == 0 else -1]:
                runs[name].append(cli_call(tree, args))
        med = {k: [statistics.median(r[j] for r in v) for j in (0, 1)] for k, v in runs.items()}
        best = {k: min(r[0] for r in v) for k, v in runs.items()}
        print(f"| {label} | {runs['after'][0][2]:,} | {med['before'][0]:.2f} / {med['after'][0]:.2f} s "
              f"({best['before']:.2f} / {best['after']:.2f}) | {med['before'][1]:.2f} / {med['after'][1]:.2f} s | "
              f"{med['before'][1] / med['after'][1]:.1f}x |", flush=True)


def bench(model: str, cluster: str, nodes: int, global_batch: int, repeat: int) -> dict:
    from lightning_autopar.planner.search import plan
    from lightning_autopar.specs import load_cluster_spec

    spec = load_cluster_spec(cluster, nodes=nodes)
    times, cpu, report = [], [], None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        report = plan(model, spec, global_batch=global_batch)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"evaluated": report.evaluated, "feasible": report.feasible, "priced": report.priced, "best_s": min(times), "cpu_s": min(cpu),
            "median_s": statistics.median(times), "plan": report.best.plan.short(),
            "mfu": report.best.mfu, "step_s": report.best.step_time_s}


def analysis_cases() -> list[tuple[str, object, tuple[tuple, dict]]]:
    """(label, model built on the meta device, its example call): Hugging Face ResNet-152 at 224x224 and a
    BERT-Large-size BertForMaskedLM (24 layers, hidden 1024, seq 512)."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from lightning_autopar.models.vision import resnet152

    with torch.device("meta"):
        resnet = resnet152()
        bert = BertForMaskedLM(BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                          intermediate_size=4096, max_position_embeddings=512))
    images = torch.zeros(1, 3, 224, 224, device="meta")
    tokens = torch.zeros(1, 512, dtype=torch.long, device="meta")
    return [("analysis: ResNet-152 (HF, 224x224)", resnet, ((), {"pixel_values": images})),
            ("analysis: BERT-Large MLM (seq 512)", bert, ((), {"input_ids": tokens}))]


def bench_analysis(model: object, example: tuple[tuple, dict], repeat: int) -> dict:
    from lightning_autopar.profile.units import analyze_model

    times, found = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        found = analyze_model(model, example)
        times.append(time.perf_counter() - start)
    form = f"{len(found.spec.units)} units" if found.spec.unit_form else f"transformer, {len(found.blocks)} blocks"
    return {"best_s": min(times), "median_s": statistics.median(times), "form": form}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cli", action="store_true", help="also time `python -m lightning_autopar.cli plan`")
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="time whole `autopar plan --json` calls of the tree in DIR against this one")
    args = parser.parse_args()
    if args.before:
        compare_cli(args.before, args.repeat)
        return
    for label, model, cluster, nodes, gb in CASES:
        r = bench(model, cluster, nodes, gb, args.repeat)
        print(f"{label}: {r['evaluated']:,} candidates, {r['feasible']:,} feasible, {r['priced']:,} step-priced, "
              f"{r['best_s']:.3f} s best / {r['median_s']:.3f} s median wall ({r['cpu_s']:.3f} s CPU) -> "
              f"{r['evaluated'] / r['best_s']:,.0f} candidates/s wall, {r['evaluated'] / r['cpu_s']:,.0f}/s CPU; best {r['plan']} "
              f"({r['step_s']:.3g} s/step, MFU {100 * r['mfu']:.1f}%)")
        if args.cli:
            cmd = [sys.executable, "-m", "lightning_autopar.cli", "plan", "--model", model, "--cluster", cluster,
                   "--nodes", str(nodes), "--global-batch", str(gb), "--json"]
            start = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            print(f"  autopar plan end to end (fresh interpreter, imports included): "
                  f"{time.perf_counter() - start:.2f} s")
    for label, model, example in analysis_cases():
        r = bench_analysis(model, example, args.repeat)
        print(f"{label}: {r['form']}, {r['best_s']:.2f} s best / {r['median_s']:.2f} s median wall")


if __name__ == "__main__":
    main()
