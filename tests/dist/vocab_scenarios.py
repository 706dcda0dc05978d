"""Vocabulary parallelism (``parallel.vocab``) under strategy="autopar": our GPT with tied embedding and head at tp=2,
tp=4 and tp=2 x dp=2 zero=3, a tiny Hugging Face Llama (untied; its ``labels=`` loss too), GPT-2 (tied), a loss
that is not the token cross-entropy (the logits gathered, with one line), one with ignored targets and
``reduction="none"``, and pp=2 x tp=2 (our untied GPT, the
Llama's ``labels=`` loss, the Llama with SP). Each records the losses, the final state,
the plan, the embedding / head bytes this rank holds and the lines the run printed (tests/test_vocab_parallel.py
compares them with the single-process loop).

Usage: torchrun --nproc-per-node N tests/dist/vocab_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LitLM, make_module  # noqa: E402

# scenario -> (model, plan fields)
PLANS = {
    "gpt_tied_tp2": ("gpt_tied", "tp=2,dp=1"),
    "gpt_tied_tp4": ("gpt_tied", "tp=4,dp=1"),
    "gpt_tied_tp2_dp2_zero3": ("gpt_tied", "tp=2,dp=2,zero=3"),
    "llama_tp2": ("llama", "tp=2,dp=1"),
    "llama_labels_tp2": ("llama_labels", "tp=2,dp=1"),
    "gpt2_tp2": ("gpt2", "tp=2,dp=1"),
    "gpt_fallback_tp2": ("gpt_fallback", "tp=2,dp=1"),
    "gpt_ignore_none_tp2": ("gpt_ignore_none", "tp=2,dp=1"),
    # under a pipeline each stage shards what it holds: the first the embedding, the last the head and the loss
    "gpt_tp2_pp2": ("gpt", "tp=2,pp=2,dp=1"),
    "llama_labels_tp2_pp2": ("llama_labels", "tp=2,pp=2,dp=1"),
    "llama_tp2_pp2_sp": ("llama", "tp=2,pp=2,dp=1,sp=1"),
}
WORLD2 = ["gpt_tied_tp2", "llama_tp2", "llama_labels_tp2", "gpt2_tp2", "gpt_fallback_tp2", "gpt_ignore_none_tp2"]
WORLD4 = ["gpt_tied_tp4", "gpt_tied_tp2_dp2_zero3", "gpt_tp2_pp2", "llama_labels_tp2_pp2", "llama_tp2_pp2_sp"]


class LabelsLM(LitLM):
    """A Hugging Face causal LM trained through its own ``labels=`` loss (``ForCausalLMLoss``)."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        return self.model(input_ids=idx, labels=targets, use_cache=False).loss


class LogSoftmaxLM(LitLM):
    """A loss the runtime does not see through: log-softmax and a gather of the target's log-probability (the
    token cross-entropy by hand), so the vocab-parallel logits are gathered."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        logp = F.log_softmax(self.model(idx).float(), dim=-1)
        return -logp.gather(-1, targets.unsqueeze(-1)).mean()


class IgnoredNoneLM(LitLM):
    """The token cross-entropy per token (``reduction="none"``) with every third target ignored (-100), summed and
    divided by the targets kept: the vocab-parallel loss's ``ignore_index`` and its other reduction."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        targets = targets.clone()
        targets[:, ::3] = -100
        logits = self.model(idx)
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        return per_token.sum() / (targets != -100).sum()


def make(model: str):
    """The LightningModule factory for ``model`` (the single-process reference uses the same)."""
    if model == "gpt_tied":
        return lambda **_: make_module(tied_embeddings=True)
    if model == "gpt":
        return lambda **_: make_module(tied_embeddings=False)
    if model == "gpt_ignore_none":
        return lambda **_: IgnoredNoneLM(make_module(tied_embeddings=True).model)
    if model == "gpt_fallback":
        return lambda **_: LogSoftmaxLM(make_module(tied_embeddings=True).model)
    if model in ("llama", "llama_labels"):
        from tests_hf import make_hf_module

        if model == "llama":
            return lambda **_: make_hf_module()
        return lambda **_: LabelsLM(make_hf_module().model)
    from tp_layout_scenarios import gpt2_model

    return lambda **_: LitLM(gpt2_model())


def held_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of the token embedding's and LM head's weights each rank holds (a tie counted once), over the ranks
    (under a pipeline a stage holds one of them): name -> the bytes every rank holding it holds (-1 where ranks
    differ)."""
    import torch.distributed as dist

    everyone: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, _held_here(module))
    out: dict[str, int] = {}
    for held in everyone:
        for name, nbytes in held.items():
            out[name] = nbytes if out.get(name, nbytes) == nbytes else -1
    return out


def _held_here(module: torch.nn.Module) -> dict[str, int]:
    from common import VOCAB
    from torch.distributed.tensor import DTensor

    seen, out = set(), {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.dim() == 2 and p.shape[0] == VOCAB and _vocab_name(name) and id(p) not in seen:
            seen.add(id(p))
            local = p.to_local() if isinstance(p, DTensor) else p
            out[name] = local.numel() * local.element_size()
    return out


def _vocab_name(name: str) -> bool:
    """The token embedding's or the LM head's weight (ours, HF Llama's, GPT-2's names)."""
    return any(part in name for part in ("tok_emb", "embed_tokens", "wte", "lm_head"))


def every_ranks_lines(mine: list[str]) -> list[str]:
    """The autopar lines every rank printed, in rank order (under a pipeline the head's stage prints the gather
    line)."""
    import torch.distributed as dist

    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    return [line for lines in everyone for line in lines]


def run(out: Path, name: str) -> None:
    from pp_scenarios import gathered_state
    from scenarios import fit, record

    model, fix = PLANS[name]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer, module, losses, plan = fit(fix, make=make(model))
    lines = every_ranks_lines([line for line in printed.getvalue().splitlines() if line.startswith("autopar:")])
    record(out, name, losses=losses, state=gathered_state(module), plan=plan, held=held_bytes(module), lines=lines)


if __name__ == "__main__":
    from scenarios import main

    main(run)
