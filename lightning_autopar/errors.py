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

    def __reduce__(self) -> tuple:
        # rebuilt from its parts (pickle's default calls the class with the one-line message alone): the
        # capabilities rank 0 gives the other ranks hold the checks' errors (runtime.setup.Live.shared)
        return type(self), (self.field, self.problem, self.fix)


class InfeasibleError(AutoparError, RuntimeError):
    """No plan fits (exit code 3). The message says the smallest memory any plan needs and what to relax."""

    exit_code = 3
