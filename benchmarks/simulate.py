"""`autopar simulate` at the issue's sizes (issue 27): wall and CPU seconds, the simulating process's peak memory
(its maximum resident set), and per simulated rank the memory terms and collectives beside the planner's.

    python benchmarks/simulate.py [--cases llama3-8b-dp8,...] [--out simulate.json]

Each case runs in a fresh interpreter (``--one CASE``: imports, planning and every simulated rank included), so
its resident set is its own. Cases the simulation refuses (pipelines, plain DDP: lightning_autopar.simulate's
``check_simulable``) are recorded with the refusal.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (model, cluster, nodes, global batch, seq, fix, ranks). The plans at their world sizes; global
# batches are the smallest the plan allows (one micro-batch per data-parallel rank, pp micro-batches with a
# pipeline): a step of fake tensors costs its ops, so the time grows with micro-batches x layers per rank.
COMMON = "mbs=1,recompute=full,compile=false,precision=bf16-mixed"
PP_70B = "tp=8,sp=true,pp=4,vpp=2,schedule=interleaved,dp=16,zero=1,grad_accum=4"  # one stage, and all four
CASES = {  # name -> (model, cluster, nodes, global batch, seq, fix, ranks)
    name: (model, "a100-80g-dgx" if model == "gpt-1t" else "h100-sxm-dgx", nodes, batch, seq, f"{COMMON},{fix}", ranks)
    for name, model, nodes, batch, seq, fix, ranks in [
        ("llama3-8b-dp8", "llama3-8b", 1, 8, 8192, "dp=8,zero=3,tp=1,pp=1,cp=1,grad_accum=1", None),
        ("llama3-8b-128", "llama3-8b", 16, 16, 8192, "dp=16,tp=8,sp=true,zero=3,pp=1,cp=1,grad_accum=1", None),
        ("llama3-70b-512-pp", "llama3-70b", 64, 64, 8192, PP_70B, "first"),
        ("llama3-70b-512-pp-stages", "llama3-70b", 64, 64, 8192, PP_70B, "all-stages"),  # issue 27's target
        ("llama3-70b-512", "llama3-70b", 64, 64, 8192, "tp=8,sp=true,pp=1,dp=64,zero=3,cp=1,grad_accum=1", None),
        ("llama3-405b-cp2-1024", "llama3-405b", 128, 64, 8192,
         "tp=8,sp=true,cp=2,pp=1,dp=64,zero=3,grad_accum=1", None),
        ("mixtral-ep8-64", "mixtral-8x7b", 8, 64, 4096, "ep=8,dp=64,zero=3,tp=1,pp=1,cp=1,grad_accum=1", None),
        # `autopar plan --model gpt-1t --cluster a100-80g-dgx --nodes 384 --global-batch 3072`'s winner (A100s: the
        # issue's 3,072 GPUs), its first and last stages, at the smallest global batch it allows
        ("gpt-1t-3072", "gpt-1t", 384, 384, 2048,
         "dp=24,zero=1,tp=16,sp=true,pp=8,vpp=8,schedule=interleaved,cp=1,grad_accum=8,mbs=2,recompute=none",
         "first,last"),
    ]
}


def one(name: str) -> dict:
    from lightning_autopar.errors import AutoparError
    from lightning_autopar.simulate import simulate

    model, cluster, nodes, batch, seq, fix, ranks = CASES[name]
    started, cpu = time.perf_counter(), time.process_time()
    out: dict = {"case": name, "model": model, "cluster": cluster, "nodes": nodes, "global_batch": batch,
                 "seq_len": seq, "fix": fix}
    try:
        report = simulate(model, cluster, global_batch=batch, seq_len=seq, fix=fix, ranks=ranks, nodes=nodes)
        out["report"] = report.to_json_dict()
    except AutoparError as err:
        out["refused"] = str(err)
    out["wall_s"] = time.perf_counter() - started
    out["cpu_s"] = time.process_time() - cpu
    out["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of: " + ", ".join(CASES))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    results = []
    for name in [c for c in args.cases.split(",") if c]:
        if name not in CASES:
            parser.error(f"unknown case {name!r}; have {', '.join(CASES)}")
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            results.append({"case": name, "error": proc.stderr.strip().splitlines()[-1:]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(summary(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def summary(result: dict) -> str:
    head = f"{result['case']}: "
    if "error" in result:
        return head + f"failed: {result['error']}"
    head += f"{result['wall_s']:.1f} s wall, {result['cpu_s']:.1f} s CPU, {result['max_rss_gib']:.2f} GiB max RSS"
    if "refused" in result:
        return head + f"; refused: {result['refused']}"
    lines = [head + f"; {result['report']['plan']} at world {result['report']['world']}"]
    for r in result["report"]["ranks"]:
        terms = ", ".join(f"{k.removesuffix('_gib')} {r[k]:.2f}/{r['predicted_' + k]:.2f}"
                          for k in ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "peak_gib"))
        lines.append(f"  rank {r['rank']} (stage {r['stage']}), GiB simulated/predicted: {terms}")
    for c in result["report"]["collectives"]:
        pc = "-" if c["predicted_count"] is None else c["predicted_count"]
        pb = "-" if c["predicted_bytes"] is None else f"{c['predicted_bytes'] / 2**30:.3f}"
        lines.append(f"  {c['group']:5} {c['op']:15} count {c['count']}/{pc}, GiB {c['bytes'] / 2**30:.3f}/{pb}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
