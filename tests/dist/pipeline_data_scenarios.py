"""Pipeline parallelism on real data (issue 18): ragged last batches, sequence lengths that change between
batches, micro-batches of unequal rows, padded batches with an attention mask and Hugging Face dict batches.

Usage: torchrun --nproc-per-node 4 tests/dist/pipeline_data_scenarios.py OUT_DIR name[,name...]
Every scenario trains at pp=2 x dp=2 through the strategy on ``ROWS_SEQS`` batches (rows 8, 8, 7, 3, 1; lengths
alternating 32 and 16; a DataLoader of pre-built batches); rank 0 writes OUT_DIR/<name>.pt: per-step logged losses
and the full final state dict (single-device names). ``reference`` is the single-process loop;
tests/test_pipeline_data.py compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import VOCAB, make_module  # noqa: E402
from pp_scenarios import gathered_state  # noqa: E402
from scenarios import LossCollector, main, record  # noqa: E402

import lightning.pytorch as L  # noqa: E402

SEQ = 32
ROWS_SEQS = [(8, 32), (8, 16), (7, 16), (3, 32), (1, 16)]  # 7 rows -> 4 + 3 per dp rank, 3 -> 2 + 1, 1 -> 1 + 0
GRAD_ACCUM = 2
DP = 2
LR, MOMENTUM = 0.1, 0.9


class LitDictLM(L.LightningModule):
    """A Hugging Face causal LM trained on dict batches (input_ids, attention_mask, labels), its own loss."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_autopar.models.hf import causal_lm
        from lightning_autopar.specs import ModelSpec

        spec = ModelSpec(name="llama-test", layers=4, hidden=32, heads=4, kv_heads=2, ffn_hidden=64,
                         ffn_kind="swiglu", vocab=VOCAB, seq_len=SEQ)
        self.model = causal_lm(spec)

    def loss(self, batch) -> torch.Tensor:
        return self.model(**batch).loss

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def make_gpt() -> L.LightningModule:
    return make_module(seq_len=SEQ, layers=4)


def token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for rows, seq in ROWS_SEQS:
        tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def dict_batches() -> list[dict[str, torch.Tensor]]:
    """Right-padded rows (row i keeps seq - 3 * (i % 3) tokens): attention_mask 0 and labels -100 on the padding."""
    out = []
    for ids, _ in token_batches():
        rows, seq = ids.shape
        keep = torch.tensor([seq - 3 * (i % 3) for i in range(rows)])
        mask = (torch.arange(seq)[None, :] < keep[:, None]).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def make_unet() -> L.LightningModule:
    from any_model_models import LitVision, UNet3d

    return LitVision(UNet3d(), lambda m, x: m(x))


def volume_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """3D images and per-voxel classes for the traced (unit-form) U-Net: the rows of ``ROWS_SEQS``, fixed size."""
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(rows, 1, 8, 8, 8, generator=gen), torch.randint(0, 2, (rows, 8, 8, 8), generator=gen))
            for rows, _ in ROWS_SEQS]


def validation_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of a shape no training batch had (5 rows: 3 + 2 per dp rank; sequence 24)."""
    tokens = torch.randint(0, VOCAB, (5, 25), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def resized_volumes() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A second batch of another volume size: the trace fixed every dimension but the batch's."""
    gen = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 1, n, n, n, generator=gen), torch.randint(0, 2, (8, n, n, n), generator=gen))
            for n in (8, 4)]


# name -> (fix, module maker, batches); zero=3 and zero=1: FSDP reduces each run's gradients, added up
SCENARIOS = {
    "gpt_1f1b": (f"pp=2,dp={DP},zero=3,grad_accum={GRAD_ACCUM},schedule=1f1b", make_gpt, token_batches),
    "gpt_gpipe": (f"pp=2,dp={DP},grad_accum={GRAD_ACCUM},schedule=gpipe", make_gpt, token_batches),
    "gpt_interleaved": (f"pp=2,dp={DP},zero=1,grad_accum={GRAD_ACCUM},schedule=interleaved,vpp=2", make_gpt,
                        token_batches),
    "gpt_zbv": (f"pp=2,dp={DP},grad_accum={GRAD_ACCUM},schedule=zbv,vpp=2", make_gpt, token_batches),
    "gpt_interleaved_zb": (f"pp=2,dp={DP},grad_accum={GRAD_ACCUM},schedule=interleaved-zb,vpp=2", make_gpt,
                           token_batches),
    # DualPipeV needs 2*pp micro-batches: runs with fewer (the short batches) are filled with zero-weight copies
    "gpt_dualpipev": (f"pp=2,dp={DP},grad_accum=4,schedule=dualpipev,vpp=2", make_gpt, token_batches),
    "hf_dict_mask": (f"pp=2,dp={DP},grad_accum={GRAD_ACCUM},schedule=1f1b", LitDictLM, dict_batches),
    "unet_traced": (f"pp=2,dp={DP},grad_accum={GRAD_ACCUM}", make_unet, volume_batches),
}


# the traced pipeline refuses what its trace fixed: one line on every rank, before the schedule's collectives
REFUSED = {"unet_resized_refused": (f"pp=2,dp={DP},grad_accum={GRAD_ACCUM}", make_unet, resized_volumes)}


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process loop over the same batches: each step's loss is the strategy's row-weighted sum of the
    micro-batch losses (micro-batch m of dp slice r, as ``runtime.batches.micro_batches`` cuts them)."""
    from lightning_autopar.runtime.batches import leading_size, micro_batches

    fix, make, batches = SCENARIOS[name]
    grad_accum = int(dict(f.split("=") for f in fix.split(","))["grad_accum"])
    L.seed_everything(0, verbose=False)
    module = make()
    opt = module.configure_optimizers()
    losses = []
    for batch in batches():
        total = leading_size(batch)
        loss = 0.0
        for rank in range(DP):
            for mb in micro_batches(batch, grad_accum, rank, DP):
                if mb.rows:
                    part = module.loss(mb.batch) * (mb.rows / total)
                    part.backward()
                    loss += float(part.detach())
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def reference_validation(name: str) -> float:
    """The single-process validation loss of ``validation_batch`` after the reference's training."""
    _, make, _ = SCENARIOS[name]
    L.seed_everything(0, verbose=False)
    module = make()
    module.load_state_dict(reference(name)[1])
    module.eval()
    with torch.no_grad():
        return float(module.loss(validation_batch()))


def run(out: Path, name: str) -> None:
    import os

    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_autopar import AutoParallelStrategy, AutoparError

    fix, make, batches = {**SCENARIOS, **REFUSED}[name]
    L.seed_everything(0, verbose=False)
    module = make()
    collector = LossCollector()
    strategy = AutoParallelStrategy(fix=fix, cluster="cpu", print_plan=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_epochs=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        logger=False, callbacks=[collector])
    if name in REFUSED:
        try:
            trainer.fit(module, DataLoader(batches(), batch_size=None, shuffle=False))
            error = None
        except AutoparError as err:
            error = str(err)
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        record(out, name, errors=errors, steps=len(collector.losses))
        return
    trainer.fit(module, DataLoader(batches(), batch_size=None, shuffle=False))
    state = gathered_state(module)
    val = None
    if make is make_gpt:  # forward-only through the stages on a shape the training never had
        metrics = trainer.validate(module, DataLoader([validation_batch()], batch_size=None), verbose=False)
        val = float(metrics[0]["val_loss"])
    record(out, name, losses=collector.losses, state=state, val_loss=val, plan=strategy.plan.to_dict())


if __name__ == "__main__":
    main(run)
