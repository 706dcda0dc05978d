"""The analysis finds blocks, attention, MLP and MoE by structure, on meta tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autopar.models import GPT, GPTConfig
from lightning_autopar.profile.analyze import analyze, find_transformer, model_spec_from_module


def test_dense_gpt_structure_and_costs():
    cfg = GPTConfig(vocab=128, seq_len=32, layers=3, hidden=64, heads=4, kv_heads=2, ffn_kind="swiglu")
    model = GPT(cfg)
    a = analyze(model, batch=2)
    assert a.blocks_fqn == "blocks" and len(a.blocks) == 3
    attn, mlp = a.blocks[0].attention, a.blocks[0].mlp
    assert (attn.q, attn.k, attn.v, attn.o) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert (attn.heads, attn.kv_heads, attn.head_dim) == (4, 2, 16)
    assert attn.heads_attrs == ["n_heads"] and attn.kv_heads_attrs == ["n_kv_heads"]
    assert (mlp.up, mlp.gate, mlp.down, mlp.ffn_hidden) == ("up_proj", "gate_proj", "down_proj", 256)
    spec = a.spec
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn_kind, spec.vocab) == (
        3, 64, 4, 2, "swiglu", 128)
    assert a.token_embedding == "tok_emb" and a.position_embedding == "pos_emb"
    assert a.lm_head == "lm_head" and a.final_norm == "ln_f" and not a.tied_embeddings
    assert a.unclassified == []
    # FLOPs: forward + backward matmuls of one block = 3 x forward; forward = 2 * tokens * params + attention
    tokens = 2 * 32
    block_matmul_params = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 256
    attn_fwd = 2 * 2 * 2 * 4 * 32 * 32 * 16  # QK^T and AV, batch 2, 4 heads
    assert a.blocks[0].flops == pytest.approx(3 * (2 * tokens * block_matmul_params + attn_fwd), rel=0.01)
    assert a.blocks[0].activation_bytes > 0
    assert all(p.device.type == "cpu" for p in model.parameters())  # the analysis never moved the model


def test_moe_and_tied_embeddings():
    model = GPT(GPTConfig(experts=4, top_k=2, moe_every=2, tied_embeddings=True))
    a = analyze(model, trace=False)
    moe_blocks = [b.index for b in a.blocks if b.moe]
    assert moe_blocks == [1, 3]
    moe = a.blocks[1].moe
    assert (moe.router, moe.experts, moe.num_experts, moe.top_k) == ("router", "experts", 4, 2)
    assert a.spec.experts == 4 and a.spec.moe_every == 2 and a.spec.tied_embeddings


def test_fused_qkv_is_recognised():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_head = 4
            self.c_attn = nn.Linear(32, 96)
            self.c_proj = nn.Linear(32, 32)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(32, dim=2)
            q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, c))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.fc, self.proj = Attn(), nn.Linear(32, 128), nn.Linear(128, 32)

        def forward(self, x):
            x = x + self.attn(x)
            return x + self.proj(torch.relu(self.fc(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.h, self.head = nn.Embedding(50, 32), nn.ModuleList(Block() for _ in range(2)), nn.Linear(32, 50)

        def forward(self, idx):
            x = self.wte(idx)
            for b in self.h:
                x = b(x)
            return self.head(x)

    a = analyze(Net(), seq_len=8)
    attn = a.blocks[0].attention
    assert attn.fused and attn.qkv == "c_attn" and attn.o == "c_proj" and attn.heads == 4
    assert a.blocks[0].mlp.up == "fc" and a.blocks[0].mlp.down == "proj"


def test_find_transformer_inside_a_lightning_module():
    from lightning_autopar.models.lit import LitGPT

    module = LitGPT(GPTConfig(layers=2))
    name, transformer = find_transformer(module)
    assert name == "model" and transformer is module.model
    assert model_spec_from_module(module, seq_len=64).layers == 2


def test_model_without_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="no repeated blocks"):
        analyze(nn.Sequential(nn.Linear(4, 4)))


def test_hugging_face_llama_heads_come_from_its_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    for trace in (False, True):
        a = analyze(transformers.LlamaForCausalLM(cfg), seq_len=16, trace=trace)
        attn = a.blocks[0].attention
        assert (attn.q, attn.k, attn.v, attn.o) == ("q_proj", "k_proj", "v_proj", "o_proj")
        assert (a.spec.heads, a.spec.kv_heads, a.spec.ffn_kind, a.spec.layers) == (4, 2, "swiglu", 2)
        assert a.unclassified == []


def test_bert_attention_and_mlp_across_sibling_modules_come_from_the_dataflow():
    """HF BERT: q/k/v in ``attention.self``, o in the sibling ``attention.output``, the MLP from
    ``intermediate.dense`` to ``output.dense``: found by what feeds what in the trace, for every layer."""
    transformers = pytest.importorskip("transformers")
    from lightning_autopar.parallel.tensor import block_layout, check_tp

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=16, attn_implementation="sdpa")
    model = transformers.BertForMaskedLM(cfg)
    a = analyze(find_transformer(model)[1], runner=model)
    assert a.blocks_fqn == "encoder.layer" and a.unclassified == []
    for block in a.blocks:
        attn, mlp = block.attention, block.mlp
        assert (attn.fqn, attn.q, attn.k, attn.v, attn.o) == ("attention", "self.query", "self.key", "self.value",
                                                              "output.dense")
        assert (mlp.fqn, mlp.up, mlp.down, mlp.gate, mlp.ffn_hidden) == ("", "intermediate.dense", "output.dense",
                                                                         None, 64)
    attn = a.blocks[0].attention
    assert attn.tp_validated and attn.tp_refusal is None and a.blocks[0].mlp.tp_refusal is None
    check_tp(a, 2)
    assert sorted(block_layout(a.blocks[0])) == ["attention.output.dense", "attention.self.key",
                                                 "attention.self.query", "attention.self.value",
                                                 "intermediate.dense", "output.dense"]
    # the structure alone cannot tell o from v among four 32 x 32 linears: TP is refused, not guessed
    untraced = analyze(find_transformer(model)[1], trace=False)
    with pytest.raises(Exception, match="attention projections not recognised"):
        check_tp(untraced, 2, structure_only=True)


def test_vit_is_traced_with_the_example_call():
    """A ViT takes pixel values, not token ids: with the model's real call (``example``, cut to ``batch`` rows) the
    trace runs, finds its attention and MLP and counts the FLOPs of that call. Eager attention (softmax, no SDPA):
    torch's FLOP counter counts no CPU SDPA kernel, so only eager attention compares with a real run."""
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=3, attn_implementation="eager")
    model = transformers.ViTForImageClassification(cfg)
    pixels = torch.randn(4, 3, 8, 8)
    assert any("meta forward failed" in u for u in analyze(model).unclassified)  # token ids do not fit
    a = analyze(model, batch=2, example=((), {"pixel_values": pixels}))
    assert a.unclassified == [] and a.blocks_fqn == "vit.layers"
    attn, mlp = a.blocks[0].attention, a.blocks[0].mlp
    assert (attn.fqn, attn.q, attn.k, attn.v, attn.o) == ("attention", "q_proj", "k_proj", "v_proj", "o_proj")
    assert (attn.heads, attn.head_dim, attn.tp_validated, attn.tp_refusal) == (4, 8, True, None)
    assert (mlp.fqn, mlp.up, mlp.down, mlp.ffn_hidden) == ("mlp", "fc1", "fc2", 64)
    with FlopCounterMode(display=False) as counter:
        model(pixel_values=pixels[:2]).logits.sum().backward()
    assert a.flops_total == pytest.approx(counter.get_total_flops(), rel=1e-6)
    assert all(p.device.type == "cpu" for p in model.parameters())


# ------------------------------------------------------------------------------------------- issue 26


def _third_party():
    """tests/dist/third_party_models.py (the matrix's rows), importable from here."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
    import third_party_models

    return third_party_models


def test_torchtitan_blocks_in_a_module_dict_and_its_autocast_router_are_traced():
    """torchtitan keeps its blocks in a ModuleDict (``layers``) and its MoE router calls
    ``torch.autocast(device_type=x.device.type)``: the blocks are found, the trace runs (no 'meta forward
    failed'), attention (GQA) and MLP / MoE are found from it, and TP is validated."""
    tp = _third_party()
    dense = analyze(tp.TitanTransformer())
    assert dense.blocks_fqn == "layers" and [b.fqn for b in dense.blocks] == ["layers.0", "layers.1"]
    assert dense.unclassified == [] and dense.flops_total > 0
    attn = dense.blocks[0].attention
    assert (attn.q, attn.k, attn.v, attn.o, attn.heads, attn.kv_heads) == ("wq", "wk", "wv", "wo", 4, 2)
    assert attn.tp_validated and attn.tp_refusal is None
    assert dense.blocks[0].mlp is not None and dense.blocks[0].mlp.ffn_hidden == tp.FFN
    moe = analyze(tp.TitanTransformer(moe=True))
    assert not any("meta forward failed" in u or "autocast" in u for u in moe.unclassified), moe.unclassified
    assert moe.spec.experts == tp.EXPERTS and all(b.moe is not None for b in moe.blocks)


def test_meta_friendly_autocast_and_batchnorm_are_restored():
    """Inside ``meta_friendly``: autocast takes the meta device type, BatchNorm in train mode takes one value per
    channel on meta tensors; both are torch's own again afterwards."""
    import torch.nn.functional as F

    from lightning_autopar.profile.analyze import meta_friendly

    bn = nn.BatchNorm2d(3).train()
    x = torch.empty(1, 3, 1, 1, device="meta")
    autocast, batch_norm = torch.autocast, F.batch_norm
    with meta_friendly(bn):
        with torch.autocast(device_type=x.device.type, enabled=False):
            assert bn.to_empty(device="meta")(x).shape == (1, 3, 1, 1)
    assert torch.autocast is autocast and F.batch_norm is batch_norm
    with pytest.raises(RuntimeError):
        torch.autocast(device_type="meta")


def test_cifar_resnet_traces_with_a_one_by_one_feature_map():
    """HF ResNet on 32x32 images ends on a 1x1 map: the unit trace of one row runs through BatchNorm in train
    mode (no 'Expected more than 1 value per channel', no division by n - 1 = 0)."""
    pytest.importorskip("transformers")
    from lightning_autopar.profile.units import analyze_units

    model = _third_party().make_resnet().model.train()
    a = analyze_units(model, ((), {"pixel_values": torch.randn(2, 1, 32, 32)}))
    assert a.failure == "" and a.has_batchnorm and sum(u.flops for u in a.units) > 0


def test_unused_parameters_are_found_and_frozen_ones_are_not_unused():
    """The two-tower model: its vision ``post_norm`` and ``unused_head`` are trainable and never used by the
    forward; its frozen vision layers are not listed. A torchtitan Llama uses every parameter."""
    from lightning_autopar.profile.units import analyze_model

    model = _third_party().TwoTower()
    a = analyze_model(model, ((torch.zeros(2, 16, dtype=torch.long),), {}))
    assert a.unused_params == ["vision.post_norm.weight", "vision.post_norm.bias", "unused_head.weight",
                               "unused_head.bias"]
    assert analyze(_third_party().TitanTransformer()).unused_params == []


def test_an_lm_head_is_never_a_block_of_another_stack():
    """An encoder-decoder's planned stack is the decoder; the encoder's MLP is outside it but inside a block of the
    other stack, and with its width equal to the vocabulary (here 64 = FFN) it has the head's shape: the head is
    the Linear outside every stack (BART's lm_head, tied to the shared embedding), never that MLP."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=16, pad_token_id=1)
    model = transformers.BartForConditionalGeneration(cfg)
    a = analyze(model, trace=False)
    assert a.blocks_fqn == "model.decoder.layers"
    assert a.lm_head == "lm_head" and a.token_embedding == "model.shared" and a.tied_embeddings


def test_of_two_stacks_the_one_the_token_embedding_feeds_is_the_blocks():
    """A vision-language shape whose vision tower (a patch projection, no embedding table) has more parameters
    than its text model (Mistral 3's Pixtral tower at tiny sizes): the blocks are the text model's, the stack the
    token table feeds; a tower with a position table of its own (LLaVA's CLIP) does not count as holding it."""
    from lightning_autopar.profile.analyze import find_block_list

    class Tower(nn.Module):
        def __init__(self, positions: bool) -> None:
            super().__init__()
            self.patch = nn.Linear(16, 64)
            self.positions = nn.Embedding(5, 64) if positions else None
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(64, 4, 256, batch_first=True) for _ in range(3))

    class Text(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(100, 32)
            self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True) for _ in range(2))

    for positions in (False, True):
        vlm = nn.Module()
        vlm.vision_tower, vlm.language_model = Tower(positions), Text()
        vlm.lm_head = nn.Linear(32, 100)
        assert find_block_list(vlm)[0] == "language_model.layers"
        assert find_transformer(vlm)[0] == "language_model"
    alone = Tower(positions=False)  # no token table anywhere: the stack with the most parameters
    assert find_block_list(alone)[0] == "layers"


def test_dropout_in_the_blocks_is_read_from_the_traced_call():
    """``ModelSpec.dropout`` (the masks a block keeps for backward, planner.cost_memory): what the blocks' code
    calls on meta tensors -- our GPT (dropout 0, inside SDPA only) and HF Llama none; HF GPT-2 with its default
    0.1 (``nn.Dropout`` in its blocks) some; without a trace Korthikanti's count keeps them."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt = GPT(GPTConfig(vocab=64, seq_len=16, layers=2, hidden=32, heads=4))
    assert not analyze(gpt, trace=True).spec.dropout
    assert analyze(gpt, trace=False).spec.dropout
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16))
    _, transformer = find_transformer(gpt2)
    assert analyze(transformer, trace=True, runner=gpt2).spec.dropout
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    _, transformer = find_transformer(gpt2)
    assert not analyze(transformer, trace=True, runner=gpt2).spec.dropout
