"""`import lightning_autopar` registers "autopar" with every Lightning flavour, without importing Lightning
itself (the planner CLI stays fast)."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_import_is_light_and_registers_once_lightning_loads():
    """One interpreter (each costs seconds of imports): autopar first, then Lightning, then pytorch_lightning
    where it is installed."""
    out = run(
        "import sys, importlib.util, lightning_autopar\n"
        "print('lightning' in sys.modules)\n"
        "import lightning.pytorch as L\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "print('autopar' in L.strategies.StrategyRegistry, 'autopar' in STRATEGY_REGISTRY)\n"
        "print(L.Trainer(strategy='autopar', accelerator='cpu', devices=1).strategy.__class__.__name__)\n"
        "if importlib.util.find_spec('pytorch_lightning') is None:\n"
        "    print('no pytorch_lightning')\n"
        "else:\n"
        "    import pytorch_lightning as pl\n"
        "    print('autopar' in pl.strategies.StrategyRegistry)\n"
    )
    lines = out.splitlines()
    assert lines[:3] == ["False", "True True", "AutoParallelStrategy"]
    assert lines[3] in ("True", "no pytorch_lightning")  # pytorch_lightning's registry too, where installed


def test_registers_when_lightning_was_imported_first():
    out = run("import lightning.pytorch as L, lightning_autopar\nprint('autopar' in L.strategies.StrategyRegistry)")
    assert out == "True"
