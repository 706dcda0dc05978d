"""Plan the parallel layout of a model on a cluster: ranked plans, breakdown, explanation (autopar plan).

Exit codes: 0 ok; 2 bad input (one line naming the field and the fix); 3 no feasible plan (also when a
``--fix``-ed plan does not fit: it is still priced and printed, flagged, before the one-line error).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from lightning_autopar.errors import ConfigError, InfeasibleError
from lightning_autopar.planner.forms import form_of
from lightning_autopar.specs import ModelSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model preset (configs/model) or YAML file")
    parser.add_argument("--cluster", required=True, help="cluster preset (configs/cluster) or YAML file")
    parser.add_argument("--nodes", type=int, default=None, help="override the cluster's node count")
    parser.add_argument("--devices-per-node", type=int, default=None, help="override devices per node")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--fix", default=None, help="pin plan fields, e.g. 'tp=2,pp=2,zero=1'")
    parser.add_argument("--top", type=int, default=10, help="how many ranked plans to show")
    parser.add_argument("--precision", default=None,
                        help="fp32, bf16-mixed, fp16-mixed, or a comma list to search (default: the device's fastest)")
    parser.add_argument("--memory-fraction", type=float, default=0.9,
                        help="share of device memory a plan may use (default 0.9)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--report", default=None, metavar="FILE.png", help="write a PNG of the ranked plans")
    parser.add_argument("--no-explain", action="store_true", help="skip the what-if re-runs of the explanation")
    parser.add_argument("--explain-model", action="store_true",
                        help="print the model's units (name, kinds, params, FLOPs, activations per sample) first")


def print_model(model: ModelSpec, out: TextIO) -> None:
    """--explain-model: the units table of a unit-form model (profile.units.describe_units, imported only when
    called: it needs torch), or the transformer's fields (forms.ModelForm.describe). With --json it goes to stderr
    so stdout stays one object."""
    out.write(form_of(model).describe(model, _units_table))


def _units_table(model: ModelSpec) -> str:
    from lightning_autopar.profile.units import describe_units

    return describe_units(model)


def check_counts(args: argparse.Namespace) -> None:
    """The positive-integer flags (``autopar plan`` and ``autopar simulate``): one ConfigError naming the flag."""
    for name in ("nodes", "devices_per_node", "global_batch", "seq_len", "top"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be a positive integer, got {value}")


def precisions(args: argparse.Namespace) -> list[str] | None:
    """--precision as the planner takes it: a list, or None for the device's fastest."""
    return [p for p in args.precision.split(",") if p.strip()] if args.precision else None


def run(args: argparse.Namespace) -> int:
    from lightning_autopar.planner.search import plan
    from lightning_autopar.specs import load_cluster_spec, load_model_spec

    check_counts(args)
    model = load_model_spec(args.model)
    form_of(model).check_seq_len(args.model, args.seq_len)
    if args.explain_model:
        print_model(model, sys.stderr if args.json else sys.stdout)
    cluster = load_cluster_spec(args.cluster, nodes=args.nodes, devices_per_node=args.devices_per_node)
    precision = precisions(args)
    # the what-if re-plans feed only the explanation, which the table prints and the JSON (contract) leaves out
    report = plan(model, cluster, global_batch=args.global_batch, seq_len=args.seq_len, fix=args.fix,
                  top=args.top, precision=precision, memory_fraction=args.memory_fraction,
                  allow_infeasible=bool(args.fix), explain_choice=not (args.no_explain or args.json))
    if args.json:
        sys.stdout.write(json.dumps(report.to_json_dict()) + "\n")
    else:
        from rich.console import Console

        console = Console() if sys.stdout.isatty() else Console(width=200, soft_wrap=False)
        report.print_table(console)
    if args.report:
        path = report.save_png(args.report)
        if not args.json:
            print(f"report written to {path}")
    if not report.best.feasible:
        from lightning_autopar.planner.search import relax_hints, smallest_line
        from lightning_autopar.specs import parse_fix

        best = report.smallest or report.best
        relax = relax_hints(model, cluster, best.plan, args.memory_fraction, parse_fix(args.fix),
                            host_short="host memory" in best.reason)
        raise InfeasibleError(
            f"the fixed plan does not fit: the smallest memory any plan with {args.fix} needs is "
            f"{smallest_line(best.plan, best.memory_gib_per_device, best.host_gib_per_device)} (capacity "
            f"{cluster.device.memory_gib:g} GiB x fraction {args.memory_fraction:g}); relax: {', '.join(relax)}")
    return 0
