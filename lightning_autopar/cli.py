"""`autopar plan | ranktable | probe`: thin wiring; each subcommand lives beside its code.

Exit codes (contract): 0 ok; 2 bad input (one line naming the field and the fix); 3 no feasible plan.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lightning_autopar.errors import AutoparError

# subcommand name -> module providing ``add_arguments(parser)`` and ``run(args) -> int``
SUBCOMMANDS = {
    "plan": "lightning_autopar.planner.cli_plan",
    "ranktable": "lightning_autopar.topology.ranktable",
    "probe": "lightning_autopar.topology.probe",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other bad input
        self.exit(2, f"autopar: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(prog="autopar", description="Automatic parallelism planner for PyTorch Lightning")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except AutoparError as err:
        print(f"autopar {args.command}: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
