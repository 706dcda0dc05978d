"""Plan quality: the planner's predicted step time against the measured one, for every feasible plan it lists.

    python benchmarks/plan_quality.py [--nproc 4] [--rounds 2] [--steps 6] [--warmup 2] [--models gpt,moe] [--all]

One torchrun launch (``--nproc`` CPU processes, gloo, one thread each) that, in-process:

1. calibrates: ``autopar probe`` (topology.probe.run_probe: collectives on the live group, and the device rates
   of profile.measure) writes ``OUT/cluster-probed.yaml`` (``--cluster FILE`` skips the probe); then one
   plain forward+backward+AdamW step of the dense model's per-rank micro-batch is timed on every rank at once
   (sustained, no collective, no Lightning) and the probed compute rates are scaled so that the planner's
   compute term for that step matches: ``OUT/cluster-calibrated.yaml``, the cluster every plan below is
   planned with (``cluster=`` of the strategy);
2. per model (a small GPT, a small MoE GPT): runs ``strategy="autopar"`` unpinned with ``top`` large, so
   ``strategy.report.candidates`` is every feasible plan inside what the runtime supports (RUNTIME_SUPPORT and
   the model's own restrictions, read at run time: pp / ep plans appear as soon as the runtime supports them);
   that run is also the timed run of the planner's first choice;
3. times profile.measure.measure_blocks on every rank at once (the planner's ``measured=`` input);
4. runs, each with a new Trainer on the same process group and ``fix=`` the whole plan, one plan per
   structure (dp, tp, pp, ep, zero with 1 and 2 merged as the runtime applies them alike, hybrid shard, schedule,
   vpp), the one the planner ranks best among its micro-batch / recompute variants (``--all``: every plan),
   plus the first choice of each predictor below; in ``--rounds`` rounds, every other one in reverse order, so
   that load drift on a shared machine spreads over the plans (drift = last round / first round, per plan);
5. prints, per model, predicted vs measured step time (median of the ``--steps`` optimizer steps after
   ``--warmup`` of every run, pooled over the rounds, each step timed between two barriers) and, for four
   predictors -- the calibrated cluster (what the strategy planned with), the probed cluster as written, the
   probed cluster + measured blocks, the built-in ``cpu`` preset -- Spearman rank correlation, median
   |error|, and regret = measured time of the predictor's first choice / best measured time; then a
   least-squares fit measured ~ a*compute + b*comm + c*bubble + d over the plans (which term is off, by how
   much), measured/predicted per plan class, and the pure data-parallel plan (zero=0, one micro-batch)
   split into the plain step of step 1 (the compute term) and the rest (collectives, Lightning, autopar).

Results: OUT/plan_quality.json (default OUT: outputs/benchmarks). On a shared machine the launcher first waits
(60 s steps, up to ``--max-wait`` s) for the 1-minute load average to drop to ``--max-load``; before every run
the workers pause (10 s steps, up to ``--max-pause`` s in all) while other processes keep more than
``--max-busy`` of the CPU time busy, and the share other processes took during every run is recorded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    RUN_SLOWDOWN,
    bench_main,
    common_args,
    guarded_run,
    init_workers,
    is_rank0,
    load_summary,
    median,
    pause_while_slow,
    spearman,
    timed_fit,
    token_loader,
    write_result,
)

TARGETS = {"spearman": 0.9, "regret": 1.05, "median_error": 0.15}
PREDICTORS = ("calibrated", "probe", "probe+blocks", "cpu preset")


def model_configs(seq_len: int) -> dict[str, Any]:
    from lightning_autopar.models import GPTConfig

    dense = dict(vocab=256, seq_len=seq_len, layers=4, hidden=256, heads=4, ffn_hidden=1024)
    return {"gpt": GPTConfig(**dense),  # 3.3 M parameters
            "moe": GPTConfig(**{**dense, "ffn_hidden": 512, "experts": 4, "top_k": 2})}  # 4 experts top-2, 8.6 M


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--models", default="gpt,moe")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per plan and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per run")
    p.add_argument("--rounds", type=int, default=2, help="runs per plan, every other round in reverse order")
    p.add_argument("--precision", default="32-true", help="Trainer precision (the plan's precision follows it)")
    p.add_argument("--all", action="store_true", help="run every feasible plan, not one per structure")
    p.add_argument("--max-plans", type=int, default=0, help="cap on plans run per model (0: no cap)")
    p.add_argument("--cluster", default=None, help="a cluster YAML to use instead of probing")
    return p.parse_args(argv)


# ============================================================================================ workers


def probe(args: argparse.Namespace, out: Path) -> str:
    """The probed cluster YAML: ``--cluster``, else what ``autopar probe`` writes (OUT/cluster-probed.yaml)."""
    import torch.distributed as dist

    if args.cluster:
        return args.cluster
    from lightning_autopar.topology.probe import render, run_probe, spec_yaml

    started = time.perf_counter()
    result = run_probe()
    path = out / "cluster-probed.yaml"
    if is_rank0():
        from rich.console import Console

        for table in render(result):
            Console(width=120).print(table)
        path.write_text(spec_yaml(result.spec, result))
        print(f"probe: {time.perf_counter() - started:.1f} s, wrote {path}", flush=True)
    dist.barrier()
    return str(path)


def calibrate(args: argparse.Namespace, out: Path, probed: str, cfg: Any) -> tuple[str, dict[str, float]]:
    """OUT/cluster-calibrated.yaml: the probed cluster with its compute rates (matmul peaks, memory bandwidth,
    per-op overhead) scaled by one factor, so that the predicted compute of a plain data-parallel step of
    ``cfg`` matches a sustained plain forward+backward+AdamW step timed on every rank at once (local_step).
    The probe times short kernels and keeps the fastest run, which is a whole core per process even when the
    processes outnumber the cores; training runs them all at once."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from lightning_autopar import Plan, estimate, load_cluster_spec
    from lightning_autopar.models import GPT
    from lightning_autopar.parallel.precision import plan_precision
    from lightning_autopar.specs import PeakTflops
    from lightning_autopar.topology.probe import spec_yaml

    world = dist.get_world_size()
    mbs = args.global_batch // world
    local = local_step(cfg, mbs, args)
    spec = load_cluster_spec(probed)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = Plan(dp=world, zero=0, mbs=mbs, grad_accum=1, precision=plan_precision(args.precision))
    pred = estimate(model, spec, plan, global_batch=args.global_batch, seq_len=cfg.seq_len).breakdown.compute_s
    f = local / pred
    dev = spec.device
    pk = dev.peak_tflops
    r = lambda x: float(f"{x:.4g}")  # noqa: E731
    device = dataclasses.replace(dev, peak_tflops=PeakTflops(bf16=r(pk.bf16 / f), fp16=r(pk.fp16 / f),
                                                             fp32=r(pk.fp32 / f)),
                                 memory_bandwidth_gbs=r(dev.memory_bandwidth_gbs / f),
                                 kernel_overhead_us=r(dev.kernel_overhead_us * f))
    calibrated = dataclasses.replace(spec, name=f"{spec.name}-calibrated", device=device)
    path = out / "cluster-calibrated.yaml"
    if is_rank0():
        path.write_text(f"# {probed} with compute rates / {f:.3f}: a plain dp={world} step of the dense model's "
                        f"micro-batch took {1e3 * local:.1f} ms on every rank at once, predicted compute "
                        f"{1e3 * pred:.1f} ms\n" + spec_yaml(calibrated))
        print(f"calibration: plain fwd+bwd+AdamW step (mbs {mbs}, every rank at once) {1e3 * local:.1f} ms vs "
              f"predicted compute {1e3 * pred:.1f} ms on the probed cluster: compute rates / {f:.2f}; wrote {path}",
              flush=True)
    dist.barrier()
    return str(path), {"factor": f, "local_step_s": local, "pred_compute_s": pred}


def measured_blocks(cfg: Any, mbs: int, seq_len: int, precision: str) -> Any:
    """measure_blocks on every rank at once (the contention of training); the slowest rank's figures."""
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist

    from lightning_autopar.models import GPT
    from lightning_autopar.profile.measure import measure_blocks

    L.seed_everything(0, verbose=False)
    meas = measure_blocks(GPT(cfg), mbs=mbs, seq_len=seq_len, precision=precision, reps=5)
    kinds = sorted(meas.blocks)
    flat = torch.tensor([[meas.blocks[k].fwd_s, meas.blocks[k].bwd_s] for k in kinds], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    for k, (fwd, bwd) in zip(kinds, flat.tolist()):
        meas.blocks[k].fwd_s, meas.blocks[k].bwd_s = fwd, bwd
    return meas


def local_step(cfg: Any, mbs: int, args: argparse.Namespace) -> float:
    """Median seconds of one plain optimizer step (forward, backward, AdamW) of one ``mbs`` micro-batch on
    every rank at once, no collective inside and no Lightning: the compute a data-parallel step cannot avoid."""
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist

    from lightning_autopar.models import GPT, lm_loss

    L.seed_everything(0, verbose=False)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab, (mbs, cfg.seq_len))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    times = []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        with autocast:
            loss = lm_loss(model(x), x)
            if cfg.experts:
                loss = loss + model.aux_loss()
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return median(times[args.warmup:])


def structure(plan: Any) -> tuple:
    """What the runtime does differently: layout, sharding (zero 1 and 2 are applied alike), schedule."""
    return (plan.dp, plan.tp, plan.pp, plan.ep, plan.cp, 1 if plan.zero in (1, 2) else plan.zero,
            plan.dp_shard if plan.dp_shard not in (None, plan.dp) else None,
            plan.schedule if plan.pp > 1 else "", plan.vpp if plan.pp > 1 else 1, plan.sp)


def plan_class(plan: Any) -> str:
    dims = [d for d in ("tp", "pp", "ep", "cp") if getattr(plan, d) > 1]
    if plan.dp > 1 and plan.zero == 3:
        dims.append("fsdp")
    return "+".join(dims) or "dp"


def run_one(cfg: Any, fix: Any, cluster: str, args: argparse.Namespace) -> tuple[list[float], Any]:
    """One timed run of ``fix`` (None: the planner's own choice) with a fresh Trainer: (step seconds, strategy)."""
    import lightning.pytorch as L

    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.models.lit import LitGPT

    def attempt() -> tuple[list[float], Any]:
        L.seed_everything(0, verbose=False)
        module = LitGPT(cfg, optimizer="adamw", lr=1e-3)
        # unpinned: every feasible plan in the report; pinned: the plan alone
        strategy = AutoParallelStrategy(fix=fix, cluster=cluster, top=1_000_000 if fix is None else 1,
                                        print_plan=False)
        loader = token_loader(args.global_batch * (args.steps + args.warmup), cfg.seq_len, args.global_batch)
        times, _ = timed_fit(module, strategy, loader, args.steps, args.warmup, precision=args.precision)
        return times, strategy

    return guarded_run(attempt, args)


def bench_model(name: str, cfg: Any, cluster: str, probed: str, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_autopar import AutoparError, estimate, load_cluster_spec

    say = (lambda *a: print(*a, flush=True)) if is_rank0() else (lambda *a: None)
    started = time.perf_counter()
    times, strategy = run_one(cfg, None, cluster, args)  # the planner's own choice; lists every feasible plan
    report = strategy.report
    cands = report.candidates
    spec, gb, seq = report.model, report.global_batch, report.seq_len
    say(f"[{name}] planner: {report.feasible} feasible of {report.evaluated}; first choice "
        f"{report.best.plan.short()} measured {1e3 * median(times):.1f} ms, predicted "
        f"{1e3 * report.best.step_time_s:.1f} ms")
    meas = measured_blocks(cfg, cands[0].plan.mbs, seq, cands[0].plan.precision)
    preset = load_cluster_spec("cpu", devices_per_node=report.cluster.devices_per_node)
    raw = load_cluster_spec(probed)
    price = lambda clus, **kw: [estimate(spec, clus, c.plan, global_batch=gb, seq_len=seq,  # noqa: E731
                                         **kw).step_time_s for c in cands]
    preds = {"calibrated": [c.step_time_s for c in cands], "probe": price(raw),
             "probe+blocks": price(raw, measured=meas), "cpu preset": price(preset)}
    first = {k: min(range(len(cands)), key=lambda i, v=v: v[i]) for k, v in preds.items()}

    chosen: list[int] = []
    seen: set[tuple] = set()
    for i, c in enumerate(cands):  # ranked best first: the first of each structure
        key = structure(c.plan)
        if args.all or key not in seen:
            seen.add(key)
            chosen.append(i)
    if args.max_plans:
        chosen = chosen[:args.max_plans]
    chosen += [i for i in first.values() if i not in chosen]

    # rounds over the plans, every other one in reverse order, so that load drift on this shared machine
    # spreads over all plans; the planning run above is the first choice's sample of round 1
    rounds: dict[int, list[list[float]]] = {0: [times]}
    slow: dict[int, list[float]] = {0: [RUN_SLOWDOWN[-1]]}  # the machine's slowdown right after each run
    errors: dict[int, str] = {}
    for r in range(args.rounds):
        order = chosen if r % 2 == 0 else chosen[::-1]
        for n, i in enumerate(order, 1):
            if i in errors or len(rounds.get(i, ())) > r:
                continue
            plan = cands[i].plan
            try:
                got, _ = run_one(cfg, plan.to_dict(), cluster, args)
            except AutoparError as err:  # raised alike on every rank before any step
                errors[i] = str(err).splitlines()[0]
                say(f"[{name}] round {r + 1} {n}/{len(order)} {plan.short()}: not run: {errors[i]}")
                continue
            rounds.setdefault(i, []).append(got)
            slow.setdefault(i, []).append(RUN_SLOWDOWN[-1])
            say(f"[{name}] round {r + 1} {n}/{len(order)} {plan.short()}: measured {1e3 * median(got):.1f} ms, "
                f"predicted {1e3 * cands[i].step_time_s:.1f} ms")
    measured = {i: [t for run in runs for t in run] for i, runs in rounds.items()}
    drift = [median(runs[-1]) / median(runs[0]) for runs in rounds.values() if len(runs) > 1]
    local = local_step(cfg, gb // report.cluster.world_size, args)
    ddp = next((i for i in measured if structure(cands[i].plan)[:7] == (report.cluster.world_size, 1, 1, 1, 1, 0, None)
                and cands[i].plan.grad_accum == 1), None)
    split = None
    if ddp is not None:
        b = cands[ddp].breakdown
        split = {"plan": cands[ddp].plan.short(), "measured_step_s": median(measured[ddp]), "local_step_s": local,
                 "pred_compute_s": b.compute_s + b.recompute_s, "pred_comm_s": b.comm_exposed_s,
                 "pred_step_s": cands[ddp].step_time_s}
    rows = []
    for i in sorted(measured, key=lambda j: median(measured[j])):
        c = cands[i]
        b = c.breakdown
        rows.append({"plan": c.plan.short(), "fix": c.plan.to_dict(), "class": plan_class(c.plan), "rank": i + 1,
                     "measured_s": median(measured[i]), "samples_s": measured[i],
                     "round_medians_s": [median(run) for run in rounds[i]], "slowdown_after": slow[i],
                     **{f"pred_{k}_s": preds[k][i] for k in PREDICTORS},
                     "breakdown": {"compute_s": b.compute_s + b.recompute_s, "comm_s": b.comm_exposed_s,
                                   "bubble_s": b.bubble_s},
                     "first_choice_of": [k for k, j in first.items() if j == i]})
    return {"model": {"name": name, "params": spec.total_params(),
                      **{k: getattr(cfg, k) for k in ("layers", "hidden", "heads", "ffn_hidden", "experts",
                                                     "top_k", "seq_len", "vocab")}},
            "global_batch": gb, "seq_len": seq, "feasible": report.feasible, "evaluated": report.evaluated,
            "rows": rows, "failed": [{"plan": cands[i].plan.short(), "error": e} for i, e in errors.items()],
            "first_choice": {k: cands[j].plan.short() for k, j in first.items()},
            "drift": median(drift) if drift else float("nan"), "seconds": time.perf_counter() - started,
            "measured_blocks": {k: vars(v) for k, v in meas.blocks.items()}, "dp_split": split}


# ============================================================================================ analysis


def scores(rows: list[dict], key: str) -> dict[str, float]:
    measured = [r["measured_s"] for r in rows]
    pred = [r[f"pred_{key}_s"] for r in rows]
    best = min(measured)
    mine = [r for r in rows if key in r["first_choice_of"]]
    errs = sorted(abs(p / m - 1) for p, m in zip(pred, measured))
    return {"spearman": spearman(pred, measured), "median_error": median(errs),
            "regret": mine[0]["measured_s"] / best if mine else float("nan"),
            "bias": median([m / p for p, m in zip(pred, measured)])}


def term_fit(rows: list[dict]) -> dict[str, float]:
    """Least squares measured ~ a*compute + b*comm + c*bubble + d over the plans (terms of the strategy's prediction)."""
    import numpy as np

    names = ["compute_s", "comm_s", "bubble_s"]
    X = np.array([[r["breakdown"][n] for n in names] + [1.0] for r in rows])
    y = np.array([r["measured_s"] for r in rows])
    used = [j for j in range(X.shape[1]) if np.abs(X[:, j]).max() > 0]
    coef = np.zeros(X.shape[1])
    if len(rows) > len(used) + 1:
        coef[used] = np.linalg.lstsq(X[:, used], y, rcond=None)[0]
    fit = X @ coef
    r2 = 1 - ((y - fit) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30)
    return {"compute_x": coef[0], "comm_x": coef[1], "bubble_x": coef[2], "fixed_s": coef[3], "r2": float(r2)}


def by_class(rows: list[dict]) -> dict[str, tuple[int, float]]:
    """Per plan class: (plans, median measured/predicted) for the strategy's (calibrated) prediction."""
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(r["class"], []).append(r["measured_s"] / r["pred_calibrated_s"])
    return {k: (len(v), median(v)) for k, v in sorted(out.items())}


def print_model(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    m = res["model"]
    table = Table(title=f"{m['name']}: {m['layers']} layers, hidden {m['hidden']}, experts {m['experts']}, "
                        f"global batch {res['global_batch']} x seq {res['seq_len']}; {res['feasible']} feasible plans")
    for col in ("plan", "class", "rank", "measured ms", "spread ms", "slow", "pred calib", "err", "pred probe", "err",
                "pred +blocks", "err", "pred preset", "err", "first choice of"):
        table.add_column(col, justify="left" if col in ("plan", "class", "first choice of") else "right")
    for r in res["rows"]:
        meas = r["measured_s"]
        s = sorted(r["samples_s"])
        spread = f"{1e3 * s[len(s) // 4]:.0f}-{1e3 * s[(3 * len(s)) // 4]:.0f}"
        cells = []
        for k in PREDICTORS:
            p = r[f"pred_{k}_s"]
            cells += [f"{1e3 * p:.1f}", f"{100 * (p / meas - 1):+.0f}%"]
        table.add_row(r["plan"], r["class"], str(r["rank"]), f"{1e3 * meas:.1f}", spread,
                      f"{max(r['slowdown_after']):.2f}", *cells,
                      ", ".join(r["first_choice_of"]))
    console.print(table)
    console.print("slow: the machine's largest slowdown (speed_check) right after the plan's runs; spread: "
                  "interquartile range of its steps; rank: the planner's rank (calibrated)", highlight=False)
    for f in res["failed"]:
        console.print(f"not run: {f['plan']}: {f['error']}")
    for k in PREDICTORS:
        s = res["scores"][k]
        ok = lambda name, good: "met" if good else "MISSED"  # noqa: E731
        console.print(f"{k:>12}: Spearman {s['spearman']:.3f} ({ok('s', s['spearman'] >= TARGETS['spearman'])}), "
                      f"median |error| {100 * s['median_error']:.1f}% "
                      f"({ok('e', s['median_error'] <= TARGETS['median_error'])}), regret {s['regret']:.3f} "
                      f"({ok('r', s['regret'] <= TARGETS['regret'])}); measured/predicted median {s['bias']:.2f}; "
                      f"first choice {res['first_choice'][k]}", highlight=False)
    t = res["term_fit"]
    if t["r2"] == t["r2"] and any(t[k] for k in ("compute_x", "comm_x", "bubble_x", "fixed_s")):
        console.print(f"fit over {len(res['rows'])} plans: measured = {t['compute_x']:.2f} x compute + {t['comm_x']:.2f} x "
                      f"exposed comm + {t['bubble_x']:.2f} x bubble + {1e3 * t['fixed_s']:.1f} ms (R^2 {t['r2']:.2f})",
                      highlight=False)
    console.print("measured/predicted (calibrated) by class: " + ", ".join(
        f"{k} {v:.2f} (n={n})" for k, (n, v) in res["by_class"].items()), highlight=False)
    d = res.get("dp_split")
    if d:
        console.print(f"{d['plan']}: plain fwd+bwd+AdamW of one rank's micro-batch (every rank at once, no collective, "
                      f"no Lightning) {1e3 * d['local_step_s']:.1f} ms vs predicted compute {1e3 * d['pred_compute_s']:.1f} "
                      f"ms (x{d['local_step_s'] / d['pred_compute_s']:.2f}); the rest of the measured step "
                      f"{1e3 * (d['measured_step_s'] - d['local_step_s']):.1f} ms (collectives, Lightning, autopar) vs "
                      f"predicted exposed comm {1e3 * d['pred_comm_s']:.1f} ms", highlight=False)
    console.print(f"drift: last round / first round, median over plans = {res['drift']:.3f}; "
                  f"{res['seconds']:.0f} s for this model", highlight=False)


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    rank, world = init_workers()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    configs = model_configs(args.seq_len)
    pause_while_slow(args)
    probed = probe(args, out)
    pause_while_slow(args)
    cluster, calibration = calibrate(args, out, probed, configs["gpt"])
    results = {"world": world, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
               "precision": args.precision, "cluster": cluster, "probed": probed, "calibration": calibration,
               "models": {}}
    for name in args.models.split(","):
        res = bench_model(name, configs[name], cluster, probed, args)
        res["scores"] = {k: scores(res["rows"], k) for k in PREDICTORS}
        res["term_fit"] = term_fit(res["rows"])
        res["by_class"] = by_class(res["rows"])
        results["models"][name] = res
        if rank == 0:
            print_model(res)
    results["seconds"] = time.perf_counter() - started
    results["load"] = load_summary()
    if rank == 0:
        write_result(args, "plan_quality.json", results, results["seconds"], "plan_quality")


def main() -> int:
    return bench_main(__file__, parse_args(), worker, "plan_quality.json")


if __name__ == "__main__":
    sys.exit(main())
