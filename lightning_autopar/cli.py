"""`autopar plan | analyze | ranktable | simulate | probe`: thin wiring; each subcommand lives beside its code.

Exit codes (contract): 0 ok; 2 bad input (one line naming the field and the fix); 3 no feasible plan.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from lightning_autopar.errors import AutoparError

# subcommand name -> (module providing ``add_arguments(parser)`` and ``run(args) -> int``, one-line help).
# Only the module of the subcommand being run is imported, so one subcommand's imports never slow another.
SUBCOMMANDS = {
    "plan": ("lightning_autopar.planner.cli_plan", "rank parallel plans for a model on a cluster"),
    "analyze": ("lightning_autopar.profile.cli_analyze", "describe a model (any nn.Module) and write its model spec"),
    "ranktable": ("lightning_autopar.topology.cli_ranktable", "build, validate and convert rank tables (HCCL, generic)"),
    "simulate": ("lightning_autopar.cli_simulate", "apply a plan at its world size on one CPU (fake process group, "
                 "fake tensors): memory and collectives per rank beside the planner's"),
    "probe": ("lightning_autopar.runtime.probe", "measure collective bandwidth on the live group (torchrun)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other bad input
        self.exit(2, f"autopar: {message}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's module is imported and given its arguments."""
    import importlib

    parser = _Parser(prog="autopar", description="Automatic parallelism planner for PyTorch Lightning")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if only in (None, name):
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except AutoparError as err:
        print(f"autopar {args.command}: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
