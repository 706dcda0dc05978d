"""`import lightning_autopar` registers "autopar" with every Lightning flavour, without importing Lightning
itself (the planner CLI stays fast)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_import_is_light_and_registers_once_lightning_loads():
    out = run(
        "import sys, lightning_autopar\n"
        "print('lightning' in sys.modules)\n"
        "import lightning.pytorch as L\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "print('autopar' in L.strategies.StrategyRegistry, 'autopar' in STRATEGY_REGISTRY)\n"
        "print(L.Trainer(strategy='autopar', accelerator='cpu', devices=1).strategy.__class__.__name__)\n"
    )
    assert out.splitlines() == ["False", "True True", "AutoParallelStrategy"]


def test_registers_when_lightning_was_imported_first():
    out = run("import lightning.pytorch as L, lightning_autopar\nprint('autopar' in L.strategies.StrategyRegistry)")
    assert out == "True"


def test_pytorch_lightning_registry_when_installed():
    pytest.importorskip("pytorch_lightning")
    out = run("import lightning_autopar, pytorch_lightning as pl\nprint('autopar' in pl.strategies.StrategyRegistry)")
    assert out == "True"
