"""Shared definitions for the multi-process equivalence tests and their single-process references."""

from __future__ import annotations

import gc

import lightning.pytorch as L
import torch
from torch.utils.data import TensorDataset

GLOBAL_BATCH = 8
STEPS = 8
BATCHES_PER_EPOCH = 4
SEQ = 16
VOCAB = 64


def settled(items):
    """Each of ``items`` (a launch's scenarios), after collecting what the previous one left as garbage and freezing
    what survives (the imports' ~460k objects, caches), so no later full collection rescans them. Python's gen-2
    collections walk every tracked object; in these processes that is 0.1-0.2 s each, and a scenario's set-up
    (traces, FX graphs, DTensor specs) triggers them. Measured on every 5th world-4 scenario (52, one launch,
    alternated): 148.8 -> 134.7 CPU-s and 83.5 -> 76.0 s wall. Objects created later are collected as usual; after
    the last item everything is unfrozen, so the exit's own collection (topology.worker.destroy_at_exit: groups no
    longer held are destroyed there) sees it all."""
    for item in items:
        gc.collect()
        gc.freeze()
        yield item
    gc.unfreeze()


def model_config(**overrides):
    from lightning_autopar.models import GPTConfig

    base = dict(vocab=VOCAB, seq_len=SEQ, layers=2, hidden=32, heads=4, ffn_hidden=64)
    base.update(overrides)
    return GPTConfig(**base)


def make_module(**overrides):
    from lightning_autopar.models.lit import LitGPT

    return LitGPT(model_config(**overrides), lr=0.1, momentum=0.9)


def make_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * BATCHES_PER_EPOCH, SEQ + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


_REFERENCE_RUNS: dict[tuple, tuple[list[float], dict]] = {}


def reference_run(steps: int = STEPS, clip: float | None = None, seed: int = 0, micro_batches: int = 1, dp: int = 1,
                  make=None, data=None, **overrides):
    """``_reference_run`` once per process for each set of arguments (many test files compare with the same plain
    loop); each caller gets its own copy. A run on caller-given ``data`` is not kept."""
    key = (steps, clip, seed, micro_batches, dp, make, torch.get_default_dtype(), tuple(sorted(overrides.items())))
    try:
        hash(key)
    except TypeError:  # an unhashable override: run it, unkept
        data = data if data is not None else make_data()
    if data is not None:
        return _reference_run(steps, clip, seed, micro_batches, dp, make, data, **overrides)
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = _reference_run(steps, clip, seed, micro_batches, dp, make, None, **overrides)
    losses, state = _REFERENCE_RUNS[key]
    return list(losses), {k: v.clone() for k, v in state.items()}


def _reference_run(steps: int, clip: float | None, seed: int, micro_batches: int, dp: int, make, data, **overrides):
    """The plain single-process loop: same model (``make(**overrides)``, default our GPT with ``overrides`` of its
    config), data (``data``, default the token windows of ``make_data``), seed and optimizer. Returns (losses,
    state dict, buffers included).

    ``micro_batches > 1``: each step accumulates that many micro-batches, micro-batch m being the m-th slice of
    every one of ``dp`` data-parallel slices (the strategy's split). Only an MoE model's balance loss, which is
    not linear in the tokens, tells this apart from one pass over the whole batch."""
    import lightning.pytorch as L

    L.seed_everything(seed, verbose=False)
    module = (make or make_module)(**overrides)
    opt = module.configure_optimizers()
    data = make_data() if data is None else data
    losses = []
    rows = GLOBAL_BATCH // (dp * micro_batches)
    for step in range(steps):
        i = step % (len(data) // GLOBAL_BATCH)  # the batches of an unshuffled epoch, in order
        x, y = data[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH]
        loss = 0.0
        for m in range(micro_batches):
            picked = torch.cat([torch.arange(r * GLOBAL_BATCH // dp + m * rows, r * GLOBAL_BATCH // dp + (m + 1) * rows)
                                for r in range(dp)])
            part = module.loss((x[picked], y[picked])) / micro_batches
            part.backward()
            loss = loss + part.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}



class LitLM(L.LightningModule):
    """Any module mapping token ids to logits (a tensor, or an output with ``.logits``) in a LightningModule:
    next-token loss, SGD with momentum; the model is the user's, unchanged, only this wrapper is ours. Subclasses
    change ``loss`` for models that compute their own (nanoGPT) or add a balance loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def loss(self, batch) -> torch.Tensor:
        from lightning_autopar.models.gpt import lm_loss

        idx, targets = batch
        out = self.model(idx)
        return lm_loss(out if isinstance(out, torch.Tensor) else out.logits, targets)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def single_device_run(make, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain single-process loop: seed 0, ``make()``'s module, its optimizer, its ``loss`` on each batch,
    backward, step. Returns (losses, state dict): what a scenario's multi-process run must equal."""
    import lightning.pytorch as L

    L.seed_everything(0, verbose=False)
    module = make()
    opt = module.configure_optimizers()
    losses = []
    for batch in batches:
        loss = module.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}
