"""The two user-facing error kinds. Each carries one line naming the field and the fix.

The CLI maps ``ConfigError`` to exit code 2 and ``InfeasibleError`` to exit code 3; the strategy raises
them as they are, so a bad input never surfaces as a traceback from deep inside torch.
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base class: ``str(err)`` is the whole one-line message."""

    exit_code = 1


class ConfigError(AutoparError, ValueError):
    """Bad input: a config value, a spec, a rank table, a fixed plan field (exit code 2)."""

    exit_code = 2

    def __init__(self, field: str, problem: str, fix: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        msg = f"{field}: {problem}"
        if fix:
            msg += f"; fix: {fix}"
        super().__init__(msg)


class InfeasibleError(AutoparError, RuntimeError):
    """No plan fits (exit code 3). The message says the smallest memory any plan needs and what to relax."""

    exit_code = 3


def install_excepthook() -> None:
    """Make an uncaught AutoparError print its one line and exit with its code, instead of a traceback, on every
    rank: the failing rank publishes its line to the job's store (``topology.worker.publish_failure``) before it
    exits; a peer that then dies in a collective (gloo's "Connection closed by peer") finds it there
    (``topology.worker.peer_failure``; where rank 0 serves the store, the peers' ``watch_for_failures`` threads)
    and prints "autopar (rank k): stopped because rank j failed: <line>", exiting with the same code.

    Other exceptions keep the previous hook. Installed by the strategy and the Fabric integration, i.e. only in
    programs that use autopar."""
    import os
    import sys

    previous = sys.excepthook
    if getattr(previous, "_autopar", False):
        return

    def hook(kind, value, tb):  # type: ignore[no-untyped-def]
        from lightning_autopar.topology import worker

        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))  # Lightning's launcher sets only the latter
        if isinstance(value, AutoparError):
            worker.publish_failure(str(value), value.exit_code)
            prefix = f"autopar (rank {rank})" if rank not in (None, "0") else "autopar"
            worker.stop_with(f"{prefix}: {value}", value.exit_code)
        failed = worker.peer_failure(value)
        if failed is not None:
            worker.stop_with(failed.line_for(rank), failed.exit_code)
        previous(kind, value, tb)

    hook._autopar = True  # type: ignore[attr-defined]
    sys.excepthook = hook

