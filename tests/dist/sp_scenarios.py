"""Sequence parallelism (plan.sp) on top of tp=2 under strategy="autopar": our GPT (also x dp=2 zero=3, with full
recompute, with MoE blocks (also over ep=2 x dp=2), in two pipeline stages), a tiny Hugging Face Llama and Mixtral (fused 3-D experts), GPT-2 (fused ``c_attn``, Conv1D); results are compared
with the single-process loop (tests/test_sequence_parallel.py). ``*_saved`` scenarios record the bytes autograd
saves for backward in one training step (activations only: parameter storages left out), at tp=2 with and
without sp.

Usage: torchrun --nproc-per-node N tests/dist/sp_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_module  # noqa: E402

# scenario -> (model, plan fields, model kwargs)
PLANS = {
    "gpt_sp": ("gpt", "tp=2,dp=1,sp=true", {}),
    "gpt_sp_recompute": ("gpt", "tp=2,dp=1,sp=true,recompute=full", {}),
    "gpt_moe_sp": ("gpt", "tp=2,dp=1,sp=true", {"experts": 4, "moe_every": 2}),
    "llama_sp": ("llama", "tp=2,dp=1,sp=true", {}),
    "gpt2_sp": ("gpt2", "tp=2,dp=1,sp=true", {}),
    "mixtral_sp": ("mixtral", "tp=2,dp=1,sp=true", {}),
    "gpt_sp_dp2_zero3": ("gpt", "tp=2,dp=2,zero=3,sp=true", {}),
    "gpt_moe_sp_dp2_ep2": ("gpt", "tp=2,dp=2,zero=3,ep=2,sp=true", {"experts": 4, "moe_every": 2}),
    "gpt_sp_pp2": ("gpt", "pp=2,tp=2,dp=1,sp=true,mbs=2,grad_accum=4", {"layers": 4}),
    "gpt_tp_saved": ("gpt", "tp=2,dp=1,sp=false", {"hidden": 16, "heads": 2, "ffn_hidden": 32}),
    "gpt_sp_saved": ("gpt", "tp=2,dp=1,sp=true", {"hidden": 16, "heads": 2, "ffn_hidden": 32}),
}


def make(model: str):
    """The LightningModule factory for ``model`` (the single-process reference uses the same)."""
    if model == "gpt":
        return make_module
    if model == "llama":
        from tests_hf import make_hf_module

        return lambda **_: make_hf_module()
    if model == "mixtral":
        from tests_hf import make_hf_moe_module

        return lambda **_: make_hf_moe_module()
    from common import LitLM
    from tp_layout_scenarios import gpt2_model

    return lambda **_: LitLM(gpt2_model())


class SavedBytes:
    """Bytes of the distinct non-parameter storages autograd saves for backward during one training step."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.bytes, self._seen = module, 0, set()

    def _parameter_storages(self) -> set[int]:
        from torch.distributed.tensor import DTensor

        return {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                for p in self.module.parameters()}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage.data_ptr() not in self._params and storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t

    def wrap(self) -> None:
        step = self.module.training_step

        def measured(batch, batch_idx):
            if self.bytes:  # the first step only
                return step(batch, batch_idx)
            self._params = self._parameter_storages()
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                return step(batch, batch_idx)

        self.module.training_step = measured


def run(out: Path, name: str) -> None:
    from scenarios import fit, full_state, record

    model, fix, kwargs = PLANS[name]
    if name.endswith("_saved"):
        meters = {}

        def made(**kw):
            module = make(model)(**kw)
            meters["m"] = SavedBytes(module)
            meters["m"].wrap()
            return module

        _, _, losses, plan = fit(fix, steps=1, model_kwargs=kwargs, make=made)
        record(out, name, saved=meters["m"].bytes, plan=plan)
        return
    trainer, module, losses, plan = fit(fix, model_kwargs=kwargs, make=make(model))
    if plan["pp"] > 1 or plan["ep"] > 1:  # each stage (EP rank) holds its own blocks (experts): gathered from all
        from pp_scenarios import gathered_state

        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
        return
    record(out, name, losses=losses, state=full_state(module), plan=plan)


if __name__ == "__main__":
    from scenarios import main

    main(run)
