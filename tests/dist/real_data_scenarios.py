"""Real data (issue 18) under strategy="autopar" at world 4: ragged last batches (fewer rows than dp ranks, rows
not divisible by dp or by the micro-batches), a BatchNorm CNN with a 3-row last batch, a tiny Hugging Face Llama
on padded dict batches with attention_mask, an IterableDataset, a @dataclass batch and manual optimization.
Each scenario records the
logged losses of every step and the final state; tests/test_real_data.py compares them with the single-process
loop (``reference``, also here: the same data and module, one device). ``rank1_fails`` (its own launch, world 2)
raises a ConfigError on rank 1 in the second step: every rank must stop with that one line.

Usage: torchrun --nproc-per-node 4 tests/dist/real_data_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = 43  # 43 samples at batch 8: five full batches and a last one of 3 rows (< dp=4)
PAD = 0


@dataclass
class TokenBatch:
    """A user's own batch type: the strategy slices it by its batch dimension."""

    tokens: torch.Tensor
    targets: torch.Tensor
    note: str = "dataclass"


def gpt():
    from common import make_module

    return make_module()


def moe_gpt():
    """Our GPT with an MoE layer (4 experts): the expert counts of its balance loss are global over the ranks, so
    a stand-in's tokens must count as none (parallel.stand_in)."""
    from common import make_module

    return make_module(experts=4, moe_every=2)


def dataclass_gpt():
    """LitGPT taking a TokenBatch."""
    from lightning_autopar.models.lit import LitGPT
    from common import model_config

    class LitDataclassGPT(LitGPT):
        def loss(self, batch):
            return super().loss((batch.tokens, batch.targets))

    return LitDataclassGPT(model_config(), lr=0.1, momentum=0.9)


def manual_gpt():
    """LitGPT with manual optimization: the strategy weights its manual_backward by the rows of its slice."""
    from lightning_autopar.models.lit import LitGPT
    from common import model_config

    class LitManualGPT(LitGPT):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = self.loss(batch)
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            self.log("train_loss", loss)

    return LitManualGPT(model_config(), lr=0.1, momentum=0.9)


def llama():
    """The tiny HF Llama (tests/dist/tests_hf.py) on dict batches: per-row mean over real tokens, then the mean
    over rows (row-weighted, as the strategy weights micro-batches), attention_mask passed to the model."""
    from common import LitLM
    from tests_hf import make_hf_module

    class LitDictLlama(LitLM):
        def loss(self, batch: dict) -> torch.Tensor:
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            labels = batch["labels"]
            ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                 reduction="none").view(labels.shape)
            real = (labels != -100).float()
            return ((ce * real).sum(1) / real.sum(1).clamp(min=1)).mean()

    return LitDictLlama(make_hf_module().model)


def cnn():
    from any_model_models import MODELS

    return MODELS["cnn"].make()


def tokens(rows: int = ROWS) -> TensorDataset:
    from common import SEQ, VOCAB

    gen = torch.Generator().manual_seed(1234)
    data = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return TensorDataset(data[:, :-1], data[:, 1:])


def images(rows: int = ROWS) -> TensorDataset:
    from any_model_models import CLASSES

    gen = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(rows, 3, 8, 8, generator=gen), torch.randint(0, CLASSES, (rows,), generator=gen))


def padded(rows: int = ROWS) -> list[dict]:
    """HF-style samples right-padded to SEQ: real lengths 5..SEQ, labels -100 on padding."""
    from common import SEQ, VOCAB

    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(rows):
        n = int(torch.randint(5, SEQ + 1, (1,), generator=gen))
        ids = torch.full((SEQ + 1,), PAD)
        ids[:n + 1] = torch.randint(1, VOCAB, (n + 1,), generator=gen)
        mask = (torch.arange(SEQ) < n).long()
        labels = torch.where(mask.bool(), ids[1:], torch.tensor(-100))
        out.append({"input_ids": ids[:-1], "attention_mask": mask, "labels": labels})
    return out


class Stream(IterableDataset):
    """An unsized stream of token windows (no __len__): the plan comes from its first batch."""

    def __iter__(self):
        data = tokens()
        return (data[i] for i in range(len(data)))


def to_dataclass(samples: list) -> TokenBatch:
    x, y = zip(*samples)
    return TokenBatch(torch.stack(x), torch.stack(y))


@dataclass(frozen=True)
class Case:
    make: Callable[[], Any]
    data: Callable[[], Any]
    fix: str
    batch_size: int = 8
    collate: Callable | None = None
    strategy_kwargs: dict | None = None


CASES = {
    "dp4_zero0": Case(gpt, tokens, "dp=4,zero=0"),
    "dp4_zero3": Case(gpt, tokens, "dp=4,zero=3"),
    "tp2_dp2": Case(gpt, tokens, "tp=2,dp=2,zero=1"),
    # 43 rows at batch 6: slices of 2,2,1,1 rows in 2 micro-batches (stand-ins fill the short ranks), and a last
    # batch of one row; the plan is priced for a global batch of 8 (the planner wants dp | batch)
    "dp4_accum2_rows6": Case(gpt, tokens, "dp=4,zero=3,grad_accum=2,mbs=1", batch_size=6,
                             strategy_kwargs={"global_batch": 8}),
    "cnn_dp4": Case(cnn, images, "dp=4,zero=0"),
    "llama_dict_dp4": Case(llama, padded, "dp=4,zero=2"),
    "llama_dict_tp2_dp2": Case(llama, padded, "tp=2,dp=2,zero=0"),
    "iterable_dp4": Case(gpt, Stream, "dp=4,zero=0"),
    "manual_dp4": Case(manual_gpt, tokens, "dp=4,zero=0"),
    "dataclass_tp2_dp2": Case(dataclass_gpt, tokens, "tp=2,dp=2,zero=0", collate=to_dataclass),
    "moe_dp4": Case(moe_gpt, tokens, "dp=4,zero=3,ep=1"),
}


def loader(case: Case, data: Any = None) -> DataLoader:
    return DataLoader(case.data() if data is None else data, batch_size=case.batch_size, shuffle=False,
                      collate_fn=case.collate)


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device: the same module, seed, data and batches; the module's loss, backward, SGD step."""
    from common import single_device_run

    case = CASES[name]
    return single_device_run(case.make, loader(case))


def run(out: Path, name: str) -> None:
    from scenarios import LossCollector, full_state, record

    import lightning.pytorch as L

    from lightning_autopar import AutoParallelStrategy

    case = CASES[name]
    L.seed_everything(0, verbose=False)
    module = case.make()
    collector = LossCollector()
    strategy = AutoParallelStrategy(fix=case.fix, cluster="cpu", print_plan=False, trials=0, profile=False,
                                    **(case.strategy_kwargs or {}))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=4, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[collector])
    trainer.fit(module, loader(case))
    payload = {"losses": collector.losses, "state": full_state(module), "plan": strategy.plan.to_dict()}
    if name == "dp4_zero0":  # evaluation: 11 rows at batch 8, a last batch of 3 (< dp): weighted by its rows
        payload["val"] = trainer.validate(module, loader(case, tokens(11)), verbose=False)[0]["val_loss"]
    record(out, name, **payload)


def rank1_fails(out: Path) -> None:
    """Rank 1 raises a ConfigError in its second training step, after rank 0 has entered the step."""
    import os
    import warnings

    import lightning.pytorch as L

    from lightning_autopar import AutoParallelStrategy
    from lightning_autopar.errors import ConfigError
    from lightning_autopar.models.lit import LitGPT
    from common import model_config

    warnings.filterwarnings("ignore")  # the user's choice: only autopar's line on stderr

    class Failing(LitGPT):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1 and os.environ["RANK"] == "1":
                raise ConfigError("training batch", "rank 1's rows are bad", "fix rank 1's data")
            return super().training_step(batch, batch_idx)

    L.seed_everything(0, verbose=False)
    strategy = AutoParallelStrategy(fix="dp=2,zero=0", cluster="cpu", print_plan=False, trials=0, profile=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Failing(model_config(), lr=0.1, momentum=0.9), DataLoader(tokens(32), batch_size=8))


if __name__ == "__main__":
    if sys.argv[2] == "rank1_fails":
        rank1_fails(Path(sys.argv[1]))
    else:
        from scenarios import main

        main(run)
