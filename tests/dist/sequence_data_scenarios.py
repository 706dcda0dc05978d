"""Sequence parallelism and context parallelism on real data (issue 18): sequence lengths that change between
batches, lengths tp (SP) or 2*cp (CP) do not divide (padded at the split, dropped where gathered back; causal
attention only), and Hugging Face Llama on right-padded batches with an ``attention_mask``. Results are compared
with the single-process loop over the same batches (tests/test_sequence_data.py); the ``*_refused`` scenarios
record the one line a bidirectional encoder with an indivisible length gets.

Usage: torchrun --nproc-per-node 4 tests/dist/sequence_data_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GLOBAL_BATCH, VOCAB, make_module  # noqa: E402

STEPS = 4
MAX_SEQ = 64  # our GPT's position table: every length below fits

# scenario -> (model, plan fields, sequence lengths of the batches in order)
PLANS = {
    "gpt_alternating_dp": ("gpt", "dp=4,zero=0", [64, 32]),
    "gpt_alternating_sp": ("gpt", "tp=2,dp=2,zero=3,sp=true", [64, 32]),
    "gpt_alternating_cp": ("gpt", "cp=2,dp=2,zero=3", [64, 32]),
    "gpt_30_sp": ("gpt", "tp=4,dp=1,sp=true", [30]),
    "gpt_31_sp_pp2": ("gpt", "tp=2,pp=2,dp=1,sp=true", [31]),  # padded, and sent split between the stages
    "gpt_30_cp": ("gpt", "cp=2,dp=2,zero=3", [30]),
    "llama_mask_cp": ("llama_masked", "cp=2,dp=2,zero=3", [16]),
    "llama_mask_sp": ("llama_masked", "tp=2,dp=2,zero=3,sp=true", [16]),
    "encoder_30_sp_refused": ("encoder", "tp=4,dp=1,sp=true", [30]),
    "encoder_30_cp_refused": ("encoder", "cp=2,dp=2,zero=3", [30]),
}


def batches(model: str, lengths: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """STEPS global batches of GLOBAL_BATCH rows, the i-th of length ``lengths[i % len(lengths)]``: (ids, targets)
    of random token windows, or for ``llama_masked`` (ids, attention_mask, targets) right-padded to the length
    (real lengths 9..16, each half of the rows -- one data-parallel rank's -- with the same count of real tokens)."""
    gen = torch.Generator().manual_seed(4321)
    out = []
    for step in range(STEPS):
        seq = lengths[step % len(lengths)]
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, seq + 1), generator=gen)
        ids, targets = tokens[:, :-1], tokens[:, 1:]
        if model != "llama_masked":
            out.append((ids, targets))
            continue
        half = torch.randint(seq // 2 + 1, seq + 1, (GLOBAL_BATCH // 2,), generator=gen)
        real = torch.cat([half, half.flip(0)])
        mask = (torch.arange(seq)[None, :] < real[:, None]).long()
        out.append((ids * mask, mask, targets))
    return out


def masked_llama():
    """The tiny HF Llama (tests_hf) trained on (ids, attention_mask, targets): the loss over every position (the
    padded ones too: their outputs are well defined, attending to the real keys before them)."""
    from tests_hf import make_hf_module

    from lightning_autopar.models.gpt import lm_loss

    module = make_hf_module()

    def loss(batch):
        ids, mask, targets = batch
        return lm_loss(module.model(input_ids=ids, attention_mask=mask, use_cache=False).logits, targets)

    module.loss = loss
    return module


def encoder():
    """Our GPT with bidirectional attention (SDPA without a causal mask): padding the sequence would change what
    every real token sees."""
    from lightning_autopar.models.gpt import CausalSelfAttention

    class Bidirectional(CausalSelfAttention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bsz, seq, _ = x.shape
            q, k, v = (p(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
            return self.o_proj(y.transpose(1, 2).reshape(bsz, seq, -1))

    module = make("gpt")()
    for block in module.model.blocks:
        block.attn.__class__ = Bidirectional
    return module


def make(model: str):
    """The LightningModule factory for ``model`` (the single-process reference uses the same)."""
    if model == "gpt":
        return lambda **_: make_module(seq_len=MAX_SEQ)
    if model == "encoder":
        return lambda **_: encoder()
    return lambda **_: masked_llama()


def fit(name: str):
    """Train scenario ``name`` for STEPS steps on its batches (a ``batch_size=None`` loader of pre-built global
    batches): (module, logged losses, plan dict)."""
    import lightning.pytorch as L
    from scenarios import LossCollector
    from torch.utils.data import DataLoader

    from lightning_autopar import AutoParallelStrategy

    model, fix, lengths = PLANS[name]
    L.seed_everything(0, verbose=False)
    module = make(model)()
    collector = LossCollector()
    strategy = AutoParallelStrategy(fix=fix, cluster="cpu", print_plan=False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=STEPS,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        logger=False, callbacks=[collector])
    trainer.fit(module, DataLoader(batches(model, lengths), batch_size=None, shuffle=False))
    return module, collector.losses, strategy.plan.to_dict()


def run(out: Path, name: str) -> None:
    from pp_scenarios import gathered_state
    from scenarios import record

    from lightning_autopar import AutoparError

    if name.endswith("_refused"):
        try:
            fit(name)
        except AutoparError as err:
            record(out, name, error=str(err))
        else:
            record(out, name, error=None)
        return
    module, losses, plan = fit(name)
    record(out, name, losses=losses, state=gathered_state(module), plan=plan)  # pipeline stages merged


if __name__ == "__main__":
    from scenarios import main

    main(run)
