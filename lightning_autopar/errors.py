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
    """Make an uncaught AutoparError print its one line and exit with its code, instead of a traceback.

    Other exceptions keep the previous hook. Installed by the strategy and the Fabric integration, i.e. only in
    programs that use autopar."""
    import os
    import sys

    previous = sys.excepthook
    if getattr(previous, "_autopar", False):
        return

    def hook(kind, value, tb):  # type: ignore[no-untyped-def]
        if isinstance(value, AutoparError):
            rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))  # Lightning's launcher sets only the latter
            prefix = f"autopar (rank {rank})" if rank not in (None, "0") else "autopar"
            # the real stderr: torch.distributed's own hook buffers sys.stderr to prefix "[rankN]:" lines
            stream = sys.__stderr__ or sys.stderr
            print(f"{prefix}: {value}", file=stream, flush=True)
            sys.stdout.flush()
            os._exit(value.exit_code)  # a plain exit would run teardown hooks that may hang on peers
        previous(kind, value, tb)

    hook._autopar = True  # type: ignore[attr-defined]
    sys.excepthook = hook
