"""Context parallelism (``parallel.context``) under strategy="autopar": our GPT at cp2 x dp2 (zero 3; zero 0 with
accumulation and full recompute), cp4, tp2 x cp2 (sp off and on), pp2 x cp2, the tiny Hugging Face Llama (GQA, LM head outside
the split model) at cp2 x dp2, the heads flavour (cp_kind=heads: GPT at cp2 x dp2, cp4, tp2 x cp2 + SP; the Llama
at cp4, its kv heads repeated), the refusals (a padding mask; a RoPE computed from the sequence length), and the
bytes saved for backward at cp1 vs cp2. Results are compared with the single-process loop
(tests/test_context_parallel.py).

Usage: torchrun --nproc-per-node N tests/dist/cp_scenarios.py OUT_DIR name[,name...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LitLM  # noqa: E402


# scenario -> (plan fields, model maker or None for our GPT)
PLANS = {
    "gpt_cp2_dp2": "cp=2,dp=2,zero=3",
    "gpt_cp2_dp2_zero0_accum": "cp=2,dp=2,zero=0,grad_accum=2,recompute=full",
    "gpt_cp4": "cp=4,dp=1",
    "gpt_tp2_cp2": "tp=2,cp=2,dp=1,sp=false",
    "gpt_tp2_cp2_sp": "tp=2,cp=2,dp=1,sp=true",
    "gpt_pp2_cp2": "pp=2,cp=2,dp=1,mbs=2,grad_accum=4",
    "llama_cp2_dp2": "cp=2,dp=2,zero=2",
    # the heads flavour (parallel.context_heads, DeepSpeed-Ulysses): GPT's 4 heads over cp=2 and cp=4, over
    # tp2 x cp2 with SP (one head per rank), and the Llama's 2 kv heads repeated at cp=4
    "gpt_cp2_dp2_heads": "cp=2,dp=2,zero=3,cp_kind=heads",
    "gpt_cp4_heads": "cp=4,dp=1,cp_kind=heads",
    "gpt_tp2_cp2_sp_heads": "tp=2,cp=2,dp=1,sp=true,cp_kind=heads",
    "llama_cp4_heads": "cp=4,dp=1,cp_kind=heads",
    "llama_cp2_heads_right_padding": "cp=2,dp=2,zero=2,cp_kind=heads",
}


class PaddedLM(LitLM):
    """The tiny Llama called with a padding mask (each row's first token padding): refused under cp."""

    def loss(self, batch) -> torch.Tensor:
        from lightning_autopar.models.gpt import lm_loss

        idx, targets = batch
        mask = torch.ones_like(idx)
        mask[:, 0] = 0
        return lm_loss(self.model(idx, attention_mask=mask).logits, targets)


class RightPaddedLM(LitLM):
    """The tiny Llama called with a padding mask whose last 3 tokens of each row are padding (right padding: every
    query still sees a real key), which the heads flavour applies over the whole sequence."""

    def loss(self, batch) -> torch.Tensor:
        from lightning_autopar.models.gpt import lm_loss

        idx, targets = batch
        mask = torch.ones_like(idx)
        mask[:, -3:] = 0
        return lm_loss(self.model(idx, attention_mask=mask).logits, targets)


class RopeAttention(nn.Module):
    """Attention rotating q and k by angles of ``arange(sequence length)`` computed inside: no position input the
    runtime could pass, so every cp rank would rotate its tokens as if they started the sequence."""

    def __init__(self) -> None:
        super().__init__()
        from tp_layout_scenarios import HIDDEN

        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tp_layout_scenarios import HEAD_DIM

        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        angle = torch.arange(s, device=x.device)[:, None] / 10.0 ** torch.arange(HEAD_DIM // 2, device=x.device)
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)

        def rotate(t: torch.Tensor) -> torch.Tensor:
            half = t.shape[-1] // 2
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def make_for(name: str):
    from tests_hf import make_hf_module

    if name.endswith("_right_padding"):
        return lambda **_: RightPaddedLM(make_hf_module().model)
    if name.startswith("llama"):
        return lambda **_: make_hf_module()
    if name == "refuse_padding":
        return lambda **_: PaddedLM(make_hf_module().model)
    if name == "refuse_rope":
        from tp_layout_scenarios import TinyLM

        return lambda **_: LitLM(TinyLM(RopeAttention))
    return None


def saved_bytes(model: nn.Module, idx: torch.Tensor) -> int:
    """Bytes autograd keeps for backward over one forward of ``model`` on ``idx`` (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx).float().square().mean().backward()
    return sum(seen.values())


def memory(out: Path, name: str) -> None:
    """Activation memory of our GPT on a long sequence with a small hidden size (activations dominate): bytes
    saved for backward on one rank at cp=1 (the plain model) and at cp=2 (the cp hooks over ranks {0,1}, {2,3})."""
    import torch.distributed as dist

    from common import model_config
    from scenarios import record

    from lightning_autopar.models.gpt import GPT
    from lightning_autopar.parallel.context import apply_context_parallel

    seq = 512
    torch.manual_seed(0)
    model = GPT(model_config(seq_len=seq, hidden=16, heads=2, layers=4, ffn_hidden=32))
    idx = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(0))
    plain = saved_bytes(model, idx)
    if not dist.is_initialized():  # run first in its launch: no strategy set the group up yet
        dist.init_process_group("gloo")
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    apply_context_parallel(model, list(model.blocks), groups[dist.get_rank() // 2], "GPT")
    split = saved_bytes(model, idx)
    record(out, name, cp1=plain, cp2=split)


def run(out: Path, name: str) -> None:
    from pp_scenarios import gathered_state
    from scenarios import fit, full_state, record, record_error

    if name == "memory":
        memory(out, name)
        return
    make = make_for(name)
    kwargs = {"make": make} if make is not None else {}
    if name.startswith("refuse_"):
        record_error(out, name, "cp=2,dp=2,zero=3", **kwargs)
        return
    trainer, module, losses, plan = fit(PLANS[name], **kwargs)
    state = gathered_state(module) if plan["pp"] > 1 else full_state(module)
    record(out, name, losses=losses, state=state, plan=plan)


if __name__ == "__main__":
    from scenarios import main

    main(run)
