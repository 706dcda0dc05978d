"""Tensor parallelism on the layouts the analysis finds from what the code does: attention whose head count is
only in a ``view(b, s, -1, head_dim)``, GPT-2 (Conv1D, fused ``c_attn``), litgpt (fused ``qkv``; with GQA its
unequal [q | k | v], stored row-permuted), Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``; with GQA too) and a
BERT-style encoder (the attention's o and the MLP's halves in sibling modules, heads in a submodule's attributes).
Each trains at tp=2 under strategy="autopar"; results are compared with the single-process loop
(tests/test_tp_layouts.py).

Usage: torchrun --nproc-per-node N tests/dist/tp_layout_scenarios.py OUT_DIR name[,name...]
(name: a model of ``MODELS``, trained at tp=2, dp=1; or a scenario of ``PLANS``)
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SEQ, VOCAB, LitLM  # noqa: E402

HIDDEN, HEAD_DIM, LAYERS = 32, 8, 2


class ViewAttention(nn.Module):
    """Heads appear only in ``view(b, s, -1, HEAD_DIM)``: no head-count (or head size) attribute to read."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class NanoAttention(nn.Module):
    """nanoGPT's attention: one fused c_attn, and ``view(B, T, n_head, C // n_head)`` with C the full input width,
    which no division of its attributes makes run on a TP rank's local heads."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.n_embd = HIDDEN // HEAD_DIM, HIDDEN
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class EncoderSelfAttention(nn.Module):
    """Hugging Face BERT's self-attention as written before transformers 4.48: q/k/v only (the output projection
    sits in a sibling module), eager softmax attention, heads and widths taken from its own attributes
    (``num_attention_heads``, ``all_head_size``), which TP must divide on this submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads = HIDDEN // HEAD_DIM
        self.attention_head_size = HEAD_DIM
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query, self.key, self.value = (nn.Linear(HIDDEN, self.all_head_size) for _ in range(3))

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size()[:-1] + (self.num_attention_heads, self.attention_head_size))
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.transpose_for_scores(p(hidden_states)) for p in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.attention_head_size ** 0.5
        context = torch.matmul(scores.softmax(dim=-1), v).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size()[:-2] + (self.all_head_size,))


class EncoderOutput(nn.Module):
    """BERT's ``SelfOutput`` / ``Output``: a projection back to the hidden width, the residual add, LayerNorm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(width, HIDDEN), nn.LayerNorm(HIDDEN)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class EncoderAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self, self.output = EncoderSelfAttention(), EncoderOutput(HIDDEN)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states), hidden_states)


class EncoderIntermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, 2 * HIDDEN)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(hidden_states))


class EncoderLayer(nn.Module):
    """BERT's layer: attention (q/k/v in ``attention.self``, o in ``attention.output``), then an MLP spanning two
    sibling modules (``intermediate.dense`` -> ``output.dense``), post-norm."""

    def __init__(self) -> None:
        super().__init__()
        self.attention, self.intermediate, self.output = EncoderAttention(), EncoderIntermediate(), \
            EncoderOutput(2 * HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class EncoderLM(nn.Module):
    """A BERT-style masked LM (token and position embeddings, post-norm layers, a linear decoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.layer = nn.ModuleList(EncoderLayer() for _ in range(LAYERS))
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layer:
            x = layer(x)
        return self.decoder(x)


class Block(nn.Module):
    def __init__(self, attention: type) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = attention()
        self.fc, self.proj = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, attention: type) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def view_model() -> nn.Module:
    return TinyLM(ViewAttention)


def nano_model() -> nn.Module:
    return TinyLM(NanoAttention)


def encoder_model() -> nn.Module:
    return EncoderLM()


def gpt2_model() -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS,
                                  n_head=HIDDEN // HEAD_DIM, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def phi3_model(kv_heads: int = HIDDEN // HEAD_DIM) -> nn.Module:
    import transformers

    cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                  num_hidden_layers=LAYERS, num_attention_heads=HIDDEN // HEAD_DIM,
                                  num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
                                  pad_token_id=0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return transformers.Phi3ForCausalLM(cfg)


def litgpt_model(query_groups: int = HIDDEN // HEAD_DIM) -> nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    cfg = Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HIDDEN // HEAD_DIM, n_query_groups=query_groups,
                 vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=SEQ, bias=True, mlp_class_name="LLaMAMLP",
                 intermediate_size=2 * HIDDEN, norm_class_name="RMSNorm", rotary_percentage=1.0,
                 parallel_residual=False)
    return GPT(cfg)


def litgpt_gqa_model() -> nn.Module:
    """litgpt with GQA (4 heads, 2 query groups): its fused ``qkv`` is [q | k | v] of unequal widths."""
    return litgpt_model(query_groups=2)


def phi3_gqa_model() -> nn.Module:
    """Phi-3 with GQA (4 heads, 2 kv heads): its fused ``qkv_proj`` output is sliced into unequal q, k, v."""
    return phi3_model(kv_heads=2)


class T5LM(nn.Module):
    """Hugging Face T5 (an encoder-decoder) on token ids: the encoder reads the row, the decoder reads it too
    (teacher forcing on the same ids). Its attention adds a relative position bias, an Embedding
    [buckets, heads] in each stack's first layer, which TP shards with the heads."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HEAD_DIM, d_ff=2 * HIDDEN,
                                    num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HIDDEN // HEAD_DIM,
                                    relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
                                    pad_token_id=0, tie_word_embeddings=False)
        self.t5 = transformers.T5ForConditionalGeneration(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=idx, decoder_input_ids=idx, use_cache=False).logits


MODELS = {"view": view_model, "gpt2": gpt2_model, "litgpt": litgpt_model, "phi3": phi3_model,
          "litgpt_gqa": litgpt_gqa_model, "phi3_gqa": phi3_gqa_model, "encoder": encoder_model,
          "t5": T5LM}


def make(name: str):
    return lambda **_: LitLM(MODELS[name]())


def placements(module: nn.Module) -> dict[str, str]:
    """How each TP-sharded parameter is laid out (its DTensor placements), by name."""
    from torch.distributed.tensor import DTensor

    return {n: str(p.placements) for n, p in module.named_parameters() if isinstance(p, DTensor)}


def save_dcp(module: nn.Module, path: Path, plain: bool) -> None:
    """The sharded model state as DCP writes it (``plain``: through ``parallel.tp_placement.plain_shards`` first)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lightning_autopar.parallel.tp_placement import plain_shards

    state = {"model": get_model_state_dict(module)}
    dcp.save(plain_shards(state) if plain else state, checkpoint_id=str(path))


def reload_dcp(module: nn.Module, path: Path) -> None:
    """Zero the sharded parameters, then load them back from DCP the way a resume does: read into plain shards,
    ``restore_layout`` to the parameters' placements, ``load_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lightning_autopar.parallel.tp_placement import plain_shards, restore_layout

    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    state = {"model": get_model_state_dict(module)}
    plain = plain_shards(state)
    dcp.load(plain, checkpoint_id=str(path))
    module.load_state_dict(restore_layout(plain, like=state)["model"])


def optimizer_state(trainer: L.Trainer, module: nn.Module) -> dict:
    """The optimizer's states by parameter name, whole tensors as the single-device names and order hold them
    (on rank 0; other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(module, trainer.optimizers[0], options=opts).get("state", {})
    return {name: {k: v.clone() for k, v in entry.items() if isinstance(v, torch.Tensor)}
            for name, entry in state.items()}


def reload_optimizer_dcp(trainer: L.Trainer, module: nn.Module, path: Path) -> None:
    """The optimizer's states through DCP the way the strategy's checkpoints go: saved sharded, the live states
    zeroed, loaded back (``plain_shards`` / ``restore_layout``, ``set_optimizer_state_dict``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from lightning_autopar.parallel.tp_placement import plain_shards, restore_layout

    optimizer = trainer.optimizers[0]
    dcp.save(plain_shards({"optim": get_optimizer_state_dict(module, optimizer)}), checkpoint_id=str(path))
    with torch.no_grad():
        for entry in optimizer.state.values():
            for value in entry.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
    state = {"optim": get_optimizer_state_dict(module, optimizer)}
    plain = plain_shards(state)
    dcp.load(plain, checkpoint_id=str(path))
    set_optimizer_state_dict(module, optimizer, optim_state_dict=restore_layout(plain, like=state)["optim"])


# scenario -> (model, plan fields); a bare model name trains at tp=2, dp=1
PLANS = {"view_pp2_tp2_dp2": ("view", "pp=2,tp=2,dp=2,mbs=1,grad_accum=4"),
         "litgpt_gqa_tp2_dp4_zero3": ("litgpt_gqa", "tp=2,dp=4,zero=3")}
ROW_ORDERED = {"litgpt_gqa", "phi3_gqa", "litgpt_gqa_tp2_dp4_zero3"}  # also record the optimizer states (row-permuted)


# scenario -> (model, plan saved with, plan resumed at): a Lightning checkpoint of the strategy (DCP, sharded)
# saved mid-run under one plan, resumed under another
RESUMES = {"litgpt_gqa_resume_tp2_to_dp2": ("litgpt_gqa", "tp=2,dp=1", "dp=2,zero=3")}


def resume_across_plans(out: Path, name: str) -> None:
    """Save at step STEPS / 2 under the first plan, resume from it under the second, from another init seed."""
    from common import STEPS
    from scenarios import fit, full_state, record

    model, saved_at, resumed_at = RESUMES[name]
    saver = L.callbacks.ModelCheckpoint(dirpath=out / f"{name}_ckpts", every_n_train_steps=STEPS // 2,
                                        save_top_k=-1)
    fit(saved_at, make=make(model), enable_checkpointing=True, extra_callbacks=[saver])
    ckpt = out / f"{name}_ckpts" / f"epoch=0-step={STEPS // 2}.ckpt"
    trainer, module, losses, plan = fit(resumed_at, make=make(model), ckpt_path=str(ckpt), seed=123)
    record(out, name, losses=losses, state=full_state(module), plan=plan)


def run(out: Path, name: str) -> None:
    from pp_scenarios import gathered_state
    from scenarios import fit, full_state, record

    if name in RESUMES:
        resume_across_plans(out, name)
        return
    model, fix = PLANS.get(name, (name, "tp=2,dp=1"))
    trainer, module, losses, plan = fit(fix, make=make(model))
    if plan["pp"] > 1:  # each stage holds its own blocks: gathered from all ranks
        record(out, name, losses=losses, state=gathered_state(module), plan=plan)
        return
    state = full_state(module)
    extra = {}
    if name in ROW_ORDERED:
        extra["optim"] = optimizer_state(trainer, module)
        reload_optimizer_dcp(trainer, module, out / f"{name}_optim_dcp")
        extra["optim_reloaded"] = optimizer_state(trainer, module)
    save_dcp(module, out / f"{name}_dcp", plain=True)
    reload_dcp(module, out / f"{name}_dcp")
    record(out, name, losses=losses, state=state, plan=plan, placements=placements(module),
           reloaded=full_state(module), **extra)


if __name__ == "__main__":
    from scenarios import main

    main(run)
