"""Launched with plain ``python`` (Lightning's / Fabric's own process launcher, ``devices=2``, no thread variable
set): every rank writes the intra-op thread count it trains with to OUT_DIR/<mode>_rank<r>.txt.

Usage: python tests/dist/launcher_threads.py OUT_DIR trainer|fabric
Lightning's launcher sets the threads of DDPStrategy processes only; the autopar strategies set each process's
share themselves (topology/worker.py), in the launching process and the ones it starts alike.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GLOBAL_BATCH, make_data, make_module  # noqa: E402

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class ThreadProbe(L.Callback):
    def __init__(self) -> None:
        self.threads = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.threads = torch.get_num_threads()


def trainer_threads() -> tuple[int, int]:
    from lightning_autopar import AutoParallelStrategy

    probe = ThreadProbe()
    trainer = L.Trainer(strategy=AutoParallelStrategy(cluster="cpu", print_plan=False), accelerator="cpu", devices=2,
                        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[probe])
    trainer.fit(make_module(), DataLoader(make_data(), batch_size=GLOBAL_BATCH))
    return trainer.global_rank, probe.threads


def fabric_threads() -> tuple[int, int]:
    from lightning.fabric import Fabric

    from lightning_autopar.fabric import AutoParallelFabricStrategy
    from lightning_autopar.models import lm_loss

    fabric = Fabric(strategy=AutoParallelFabricStrategy(cluster="cpu", print_plan=False), accelerator="cpu",
                    devices=2)
    fabric.launch()
    module = make_module()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    x, y = next(iter(fabric.setup_dataloaders(DataLoader(make_data(), batch_size=GLOBAL_BATCH))))
    fabric.backward(lm_loss(model(x), y))
    optimizer.step()
    return fabric.global_rank, torch.get_num_threads()


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank, threads = trainer_threads() if mode == "trainer" else fabric_threads()
    (out / f"{mode}_rank{rank}.txt").write_text(str(threads))
