"""`autopar simulate`: the flags of `autopar plan` plus ``--ranks``; the plan (the best, or the one ``--fix`` pins)
applied at its world size on a fake process group, one training step per rank (``lightning_autopar.simulate``),
printed beside the planner's numbers (a table, or one JSON object with ``--json``).

Exit codes: 0 ok; 2 bad input (one line naming the field); 3 no feasible plan (as `autopar plan`)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lightning_autopar.planner.cli_plan import add_arguments as plan_arguments

    plan_arguments(parser)
    for action in parser._actions:
        if action.dest == "model":
            action.help = "model preset (configs/model), YAML file, or pkg.module:factory returning the model"
    parser.add_argument("--ranks", default=None,
                        help="ranks to simulate: numbers and first, last, all-stages, comma separated "
                             "(default: the first rank of every pipeline stage)")


def run(args: argparse.Namespace) -> int:
    from lightning_autopar.planner.cli_plan import check_counts, precisions
    from lightning_autopar.simulate import simulate

    check_counts(args)
    report = simulate(args.model, args.cluster, global_batch=args.global_batch, seq_len=args.seq_len, fix=args.fix,
                      ranks=args.ranks, nodes=args.nodes, devices_per_node=args.devices_per_node,
                      precision=precisions(args), memory_fraction=args.memory_fraction)
    if args.json:
        sys.stdout.write(json.dumps(report.to_json_dict()) + "\n")
    else:
        from rich.console import Console

        report.print_table(Console() if sys.stdout.isatty() else Console(width=200, soft_wrap=False))
    return 0
