"""The third-party model matrix (issue 12): tiny random-init models written by others, each in a LightningModule.

Every model is the library's own class, used unchanged (Hugging Face GPT-2, Llama, Mixtral, Qwen2, Phi-3, OLMoE,
BERT, ViT, BART, Whisper, T5, LLaVA, GPT-NeoX; litgpt's GPT dense and MoE), written here the way its authors write it (a nanoGPT-style model with one fused
c_attn and tied wte/lm_head), or the plain-loop MoE of the expert-parallel tests (plain_moe.py). Shapes follow
tests/dist/common.py: hidden 32, 2 layers, 4 heads, vocab 64, seq 16 (ViT: the 16 ids of a row as a 4x4 image);
MoE: 4 experts, top-2; fp32. Seed
(``L.seed_everything``) before calling a factory: the weights come from the global RNG, so the single-process
reference and every rank build the same model.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from common import SEQ, VOCAB, LitLM
from torch import nn

HIDDEN, LAYERS, HEADS, FFN = 32, 2, 4, 64
EXPERTS, TOP_K = 4, 2
LR, MOMENTUM = 0.1, 0.9
MOE_AUX_COEF = 0.5  # large, so a balance loss that were not exact under data / expert parallelism would show


# ------------------------------------------------------------------------------------------- Hugging Face


def _hf_lit(model: nn.Module) -> L.LightningModule:
    from lightning_autopar.models.hf import LitCausalLM

    return LitCausalLM(model, lr=LR, optimizer="sgd", momentum=MOMENTUM)


def _hf_common() -> dict:
    """Config fields every tiny HF model shares (token ids inside the tiny vocabulary, no dropout)."""
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=1, pad_token_id=None,
                attn_implementation="sdpa")


def make_gpt2(**_: object) -> L.LightningModule:
    """GPT2LMHeadModel: Conv1D projections (fused c_attn), learned positions, lm_head tied to wte."""
    import transformers as tf

    config = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                           n_inner=FFN, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=1, tie_word_embeddings=True, attn_implementation="sdpa")
    return _hf_lit(tf.GPT2LMHeadModel(config))


def make_llama(**_: object) -> L.LightningModule:
    import transformers as tf

    config = tf.LlamaConfig(num_key_value_heads=2, intermediate_size=FFN, tie_word_embeddings=False, **_hf_common())
    return _hf_lit(tf.LlamaForCausalLM(config))


def make_llama_frozen(**_: object) -> L.LightningModule:
    """Llama with its token embedding and first decoder layer frozen (requires_grad=False, as a fine-tune keeps
    the lower layers): no gradient, optimizer state or gradient reduction for them under FSDP, TP and PP."""
    lit = make_llama()
    lit.model.model.embed_tokens.requires_grad_(False)
    lit.model.model.layers[0].requires_grad_(False)
    return lit


def make_mixtral(**_: object) -> L.LightningModule:
    """MixtralForCausalLM: fused 3-D expert weights, balance loss on (weight MOE_AUX_COEF)."""
    import transformers as tf

    config = tf.MixtralConfig(num_key_value_heads=2, intermediate_size=FFN, num_local_experts=EXPERTS,
                              num_experts_per_tok=TOP_K, output_router_logits=True, router_aux_loss_coef=MOE_AUX_COEF,
                              tie_word_embeddings=False, **_hf_common())
    return _hf_lit(tf.MixtralForCausalLM(config))


def make_mixtral_default(**_: object) -> L.LightningModule:
    """MixtralForCausalLM at the library's defaults for the router (output_router_logits=False: no router logits
    returned, no balance loss): the MoE found from the traced routing alone."""
    import transformers as tf

    config = tf.MixtralConfig(num_key_value_heads=2, intermediate_size=FFN, num_local_experts=EXPERTS,
                              num_experts_per_tok=TOP_K, tie_word_embeddings=False, **_hf_common())
    assert not config.output_router_logits
    return _hf_lit(tf.MixtralForCausalLM(config))


def make_qwen2(**_: object) -> L.LightningModule:
    """Qwen2ForCausalLM: GQA with biases on q/k/v."""
    import transformers as tf

    config = tf.Qwen2Config(num_key_value_heads=2, intermediate_size=FFN, tie_word_embeddings=False,
                            use_sliding_window=False, **_hf_common())
    return _hf_lit(tf.Qwen2ForCausalLM(config))


def make_phi3(**_: object) -> L.LightningModule:
    """Phi3ForCausalLM: one fused qkv_proj and one fused gate_up_proj per layer (4 heads, 4 kv heads)."""
    import transformers as tf

    config = tf.Phi3Config(num_key_value_heads=HEADS, intermediate_size=FFN, tie_word_embeddings=False,
                           resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, original_max_position_embeddings=SEQ,
                           **_hf_common())
    return _hf_lit(tf.Phi3ForCausalLM(config))


def make_olmoe(**_: object) -> L.LightningModule:
    """OlmoeForCausalLM: q/k RMSNorms over the full projection width (not per head), fused 3-D experts,
    balance loss on."""
    import transformers as tf

    config = tf.OlmoeConfig(num_key_value_heads=HEADS, intermediate_size=FFN, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, output_router_logits=True, router_aux_loss_coef=MOE_AUX_COEF,
                            tie_word_embeddings=False, **_hf_common())
    return _hf_lit(tf.OlmoeForCausalLM(config))


def make_olmoe_default(**_: object) -> L.LightningModule:
    """OlmoeForCausalLM at the library's defaults for the router (output_router_logits=False: no router logits
    returned, no balance loss): the MoE found from the traced routing alone (issue 26, item 6)."""
    import transformers as tf

    config = tf.OlmoeConfig(num_key_value_heads=HEADS, intermediate_size=FFN, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, tie_word_embeddings=False, **_hf_common())
    return _hf_lit(tf.OlmoeForCausalLM(config))


def make_qwen2_moe(**_: object) -> L.LightningModule:
    """Qwen2MoeForCausalLM with the library's defaults for the router (output_router_logits=False: no balance
    loss, the MoE found from the structure alone): fused 3-D experts beside a shared expert and its gate."""
    import transformers as tf

    config = tf.Qwen2MoeConfig(num_key_value_heads=HEADS, intermediate_size=FFN, moe_intermediate_size=FFN,
                               shared_expert_intermediate_size=FFN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                               tie_word_embeddings=False, **_hf_common())
    return _hf_lit(tf.Qwen2MoeForCausalLM(config))


def make_qwen3_moe(**_: object) -> L.LightningModule:
    """Qwen3MoeForCausalLM at the library's defaults for the router: fused 3-D experts, and q/k norms over head_dim
    on each head (one weight for all heads: under TP its gradient is summed over the TP group)."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(num_key_value_heads=2, head_dim=HIDDEN // HEADS, intermediate_size=FFN,
                               moe_intermediate_size=FFN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                               tie_word_embeddings=False, **_hf_common())
    return _hf_lit(tf.Qwen3MoeForCausalLM(config))


def make_gpt_oss(**_: object) -> L.LightningModule:
    """GptOssForCausalLM: sliding-window and full attention alternating by ``config.layer_types[i]`` (read by the
    block's position in the model's loop), attention sinks (a parameter per head), fused MoE experts with biases
    (which TP does not split: tp=2 is refused for them)."""
    import transformers as tf

    config = tf.GptOssConfig(num_key_value_heads=2, head_dim=HIDDEN // HEADS, intermediate_size=FFN,
                             num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, sliding_window=SEQ // 2,
                             tie_word_embeddings=False, **{**_hf_common(), "attn_implementation": "eager"})
    return _hf_lit(tf.GptOssForCausalLM(config))


# ------------------------------------------------------------------------------------------- litgpt


def make_litgpt(**_: object) -> L.LightningModule:
    """litgpt's GPT, Llama-style (fused qkv Linear with GQA, LLaMAMLP, RMSNorm), in tests_litgpt's module."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, n_query_groups=2, vocab_size=VOCAB,
                    padded_vocab_size=VOCAB, block_size=SEQ, bias=False, mlp_class_name="LLaMAMLP",
                    intermediate_size=FFN, norm_class_name="RMSNorm", rotary_percentage=1.0, parallel_residual=False)
    return LitLM(GPT(config))


def make_litgpt_moe(**_: object) -> L.LightningModule:
    """litgpt's GPT with LLaMAMoE (a gate Linear, a ModuleList of LLaMAMLP experts looped over in forward), the
    same config as the dense one: plain_moe.py's factory, shared with the expert-parallel tests."""
    from plain_moe import make_litgpt_moe_module

    return make_litgpt_moe_module()


# ------------------------------------------------------------------------------------------- nanoGPT


@dataclass
class NanoGPTConfig:
    block_size: int = SEQ
    vocab_size: int = VOCAB
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_embd: int = HIDDEN
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    """As in Karpathy's nanoGPT model.py: one c_attn for q, k, v; head size from the input width C."""

    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT: wte/wpe, a ModuleList of blocks, ln_f, lm_head tied to wte by assigning the Parameter;
    forward(idx, targets) returns (logits, loss) as nanoGPT does."""

    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position
            loss = None
        return logits, loss


class LitNanoGPT(LitLM):
    """nanoGPT's training loop in Lightning form: the model computes its own loss from (idx, targets)."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        _, loss = self.model(idx, targets)
        return loss


def make_nanogpt(**_: object) -> L.LightningModule:
    return LitNanoGPT(NanoGPT(NanoGPTConfig()))


# ------------------------------------------------------------------------------------------- plain-loop MoE


def make_plain_moe(**_: object) -> L.LightningModule:
    """The plain-loop MoE GPT of plain_moe.py: a router nn.Linear, an nn.ModuleList of expert MLPs and the top-k
    loop over the experts in forward (no route() method), with a router z-loss (a token mean)."""
    from plain_moe import make_plain_moe_module

    return make_plain_moe_module()


# ------------------------------------------------------------------------------------------- an encoder


class LitMaskedLM(LitLM):
    """A Hugging Face masked LM trained on (input_ids, labels): the model computes its own loss."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        return self.model(idx, labels=targets).loss


def make_bert(**_: object) -> L.LightningModule:
    """BertForMaskedLM: an encoder whose MLP spans two modules (intermediate.dense -> output.dense), attention's
    output projection outside the attention module, and the decoder tied to the word embeddings."""
    import transformers as tf

    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return LitMaskedLM(tf.BertForMaskedLM(config))


# ------------------------------------------------------------------------------------------- encoder-decoders


class LitSeq2Seq(LitLM):
    """A Hugging Face encoder-decoder trained on (input_ids, labels): the encoder reads the row, the decoder is
    teacher-forced on the same ids (``decoder_input_ids``) and the model computes its own loss from ``labels``."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        return self.model(input_ids=idx, decoder_input_ids=idx, labels=targets.contiguous()).loss


def make_bart(**_: object) -> L.LightningModule:
    """BartForConditionalGeneration: two block stacks (encoder; decoder with cross-attention), learned positions
    per stack, one ``shared`` embedding tied to the encoder's and decoder's token embeddings and the lm_head."""
    import transformers as tf

    config = tf.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                           encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                           decoder_ffn_dim=FFN, max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
                           activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           decoder_start_token_id=2, forced_eos_token_id=None, attn_implementation="sdpa")
    return LitSeq2Seq(tf.BartForConditionalGeneration(config))


def make_t5(**_: object) -> L.LightningModule:
    """T5ForConditionalGeneration at the library's defaults for ties (one ``shared`` embedding for encoder, decoder
    and lm_head) and a relative position bias (an Embedding [buckets, heads] in each stack's first layer, which TP
    shards with the heads), gated-free ReLU MLPs, RMS layer norms without bias."""
    import transformers as tf

    config = tf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS,
                         num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
                         dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return LitSeq2Seq(tf.T5ForConditionalGeneration(config))


def make_switch(**_: object) -> L.LightningModule:
    """SwitchTransformersForConditionalGeneration: T5's encoder-decoder with a top-1 MoE feed-forward in every
    other block of each stack (4 experts in an ``nn.ModuleDict``, called with a one-hot dispatch mask); the router
    drops a sequence's tokens past an expert's capacity (4 of the 16 per sequence: some tokens skip the MoE). No
    jitter (random) and no router losses in the step (the model's default)."""
    import transformers as tf

    config = tf.SwitchTransformersConfig(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
                                         num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                                         num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=4,
                                         expert_capacity=SEQ // 4, router_jitter_noise=0.0,
                                         relative_attention_num_buckets=8, dropout_rate=0.0,
                                         decoder_start_token_id=0, pad_token_id=0)
    return LitSeq2Seq(tf.SwitchTransformersForConditionalGeneration(config))


MELS = 8  # Whisper's log-mel bins here; the encoder reads 2 * max_source_positions frames (its conv2 has stride 2)


class LitSpeech2Text(LitLM):
    """A Hugging Face speech-to-text model on the shared token data: the row's SEQ ids become MELS x SEQ
    "log-mel" features (a fixed function of the ids: the same on every rank and in the single-process reference),
    the decoder is teacher-forced on the ids and the model computes its own loss from ``labels``."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        bins = torch.arange(1, MELS + 1, dtype=torch.float32, device=idx.device)
        features = torch.sin(idx.float()[:, None, :] * bins[:, None] * (1.0 / VOCAB))
        return self.model(input_features=features, decoder_input_ids=idx, labels=targets.contiguous()).loss


def make_whisper(**_: object) -> L.LightningModule:
    """WhisperForConditionalGeneration: a Conv1d front-end (stride 1, then 2), the encoder's sinusoidal position
    table (an Embedding frozen by the library), a learned decoder position embedding, decoder cross-attention, and
    ``proj_out`` tied to the decoder's token embedding."""
    import transformers as tf

    config = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=MELS, d_model=HIDDEN, encoder_layers=LAYERS,
                              decoder_layers=LAYERS, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                              encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_source_positions=SEQ // 2,
                              max_target_positions=SEQ, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                              suppress_tokens=None, begin_suppress_tokens=None, attn_implementation="sdpa")
    return LitSpeech2Text(tf.WhisperForConditionalGeneration(config))


# ------------------------------------------------------------------------------------------- a vision transformer


IMAGE, PATCH, CHANNELS, LABELS = 4, 2, 1, 4  # a token row (SEQ = 16 ids) is one 4x4 one-channel image


class LitImageClassifier(LitLM):
    """A Hugging Face image classifier on the shared token data read as images: the SEQ token ids of a row are one
    IMAGE x IMAGE image (scaled to [-1, 1)), the row's last target token modulo LABELS its label -- random images
    and labels, the same on every rank and in the single-process reference. Cross-entropy on the logits."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        pixels = (idx.to(torch.get_default_dtype()) * (2.0 / VOCAB) - 1.0).view(-1, CHANNELS, IMAGE, IMAGE)
        return F.cross_entropy(self.model(pixel_values=pixels).logits, targets[:, -1] % LABELS)


def make_vit(**_: object) -> L.LightningModule:
    """ViTForImageClassification: a Conv2d patch embedding, CLS token and position embeddings as plain
    parameters (no nn.Embedding), q/k/v/o and a two-linear MLP per layer, a linear classifier on the CLS token."""
    import transformers as tf

    config = tf.ViTConfig(image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, hidden_size=HIDDEN,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=LABELS,
                          attn_implementation="sdpa")
    return LitImageClassifier(tf.ViTForImageClassification(config))


# ------------------------------------------------------------------------------------------- a vision-language model


IMAGE_TOKEN = VOCAB  # LLaVA's image placeholder: one id past the data's, so no data token is taken for one
PATCHES = (IMAGE // PATCH) ** 2  # image features per row (CLIP's CLS dropped: "default" feature selection)


class LitVisionLanguage(LitLM):
    """A Hugging Face VLM on the shared token data: the row's SEQ ids are also one IMAGE x IMAGE image (as
    LitImageClassifier reads them); the text is the row with its first PATCHES ids replaced by the image
    placeholder (where the projected image features go), the next-token loss over the text positions."""

    def loss(self, batch) -> torch.Tensor:
        from lightning_autopar.models.gpt import lm_loss

        idx, targets = batch
        pixels = (idx.float() * (2.0 / VOCAB) - 1.0).view(-1, CHANNELS, IMAGE, IMAGE)
        ids = torch.cat([torch.full_like(idx[:, :PATCHES], IMAGE_TOKEN), idx[:, PATCHES:]], 1)
        logits = self.model(input_ids=ids, pixel_values=pixels).logits
        return lm_loss(logits[:, PATCHES:], targets[:, PATCHES:])


def make_llava(**_: object) -> L.LightningModule:
    """LlavaForConditionalGeneration with its CLIP vision tower frozen (the usual VLM fine-tune): two block stacks
    (the tower's encoder layers, the Llama text model's), a projector between them, a CLS embedding and position
    table outside either stack, and the tower's ``post_layernorm`` never used (LLaVA reads a hidden layer)."""
    import transformers as tf

    vision = tf.CLIPVisionConfig(image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS, hidden_size=HIDDEN,
                                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                                 attention_dropout=0.0)
    text = tf.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=FFN,
                          max_position_embeddings=SEQ, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                            vision_feature_layer=-1, vision_feature_select_strategy="default",
                            projector_hidden_act="gelu", attn_implementation="sdpa")
    model = tf.LlavaForConditionalGeneration(config)
    model.model.vision_tower.requires_grad_(False)
    return LitVisionLanguage(model)


class LitMixedVisionLanguage(LitVisionLanguage):
    """LitVisionLanguage where only the rows whose first id is even carry an image (the others: text only, no
    placeholder): a data-parallel rank whose rows have none skips the tower and the projector."""

    def loss(self, batch) -> torch.Tensor:
        from lightning_autopar.models.gpt import lm_loss

        idx, targets = batch
        image = idx[:, 0] % 2 == 0
        pixels = (idx.float() * (2.0 / VOCAB) - 1.0).view(-1, CHANNELS, IMAGE, IMAGE)[image]
        slots = image[:, None] & (torch.arange(idx.shape[1], device=idx.device) < PATCHES)[None, :]
        ids = torch.where(slots, torch.full_like(idx, IMAGE_TOKEN), idx)
        logits = self.model(input_ids=ids, pixel_values=pixels if bool(image.any()) else None).logits
        return lm_loss(logits[:, PATCHES:], targets[:, PATCHES:])


def make_llava_mixed(**_: object) -> L.LightningModule:
    """LLaVA with its tower trained, on batches where some rows have no image: in the matrix's data, one of the
    four data-parallel ranks' second batch has none."""
    lit = make_llava()
    lit.model.model.vision_tower.requires_grad_(True)
    return LitMixedVisionLanguage(lit.model)


# ------------------------------------------------------------------------------------------- fused per-head qkv


def make_neox(**_: object) -> L.LightningModule:
    """GPTNeoXForCausalLM (Pythia): one ``query_key_value`` whose output the attention views as (heads,
    3 * head_dim) and chunks into q, k, v, so the three are interleaved per head; partial rotary, a parallel
    residual, an untied ``embed_out`` head."""
    import transformers as tf

    config = tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=SEQ,
                              hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
                              attn_implementation="sdpa")
    return LitLM(tf.GPTNeoXForCausalLM(config))


# ------------------------------------------------------------------------------------------- torchtitan-style


class TitanAttention(nn.Module):
    """torchtitan's Llama 3 attention: wq/wk/wv/wo, GQA by repeating k/v heads, rotary on q/k (cos/sin tables
    here, where torchtitan multiplies by a complex ``freqs_cis``: the same rotation)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def heads(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (batch, heads, seq, head_dim): rotated, k and v repeated to the query heads."""
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = _rotate(xq, rope[:seqlen]), _rotate(xk, rope[:seqlen])
        rep = xq.shape[2] // xk.shape[2]
        xk, xv = xk.repeat_interleave(rep, dim=2), xv.repeat_interleave(rep, dim=2)
        return xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        out = F.scaled_dot_product_attention(*self.heads(x, rope), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanRouterGate(nn.Linear):
    """torchtitan's router scores: the gate computed with autocast off for the tensor's own device type
    (``torch.autocast(device_type=x.device.type, enabled=False)``), in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return super().forward(x.float())


def titan_moe(dim: int, hidden_dim: int, experts: int, top_k: int) -> nn.Module:
    """An MoE layer of torchtitan's shape: the autocast router gate, top-k SwiGLU experts (the plain-loop MoE
    of plain_moe.py with its gate and experts replaced)."""
    from plain_moe import PlainMoE

    moe = PlainMoE(dim, hidden_dim, experts, top_k)
    moe.gate = TitanRouterGate(dim, experts, bias=False)
    moe.experts = nn.ModuleList(TitanFeedForward(dim, hidden_dim) for _ in range(experts))
    return moe


class GroupedExperts(nn.Module):
    """torchtitan's experts (its for-loop path): 3-D ``w1`` [E, hidden, dim], ``w2`` [E, dim, hidden], ``w3`` like
    ``w1``, called with the tokens grouped by expert and the count per expert."""

    def __init__(self, dim: int, hidden_dim: int, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, hidden_dim, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden_dim) * hidden_dim ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden_dim, dim) * dim ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist())):
            outs.append((F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)) @ self.w2[e].T)
        return torch.cat(outs)


class TokenChoiceTopKRouter(nn.Module):
    """torchtitan's router: a ``gate`` Linear, softmax scores, top-k experts per token and the count per expert."""

    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.num_experts, self.top_k = experts, top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.softmax(self.gate(x).float(), dim=-1)
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        counts = torch.histc(selected.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts)
        return top_scores, selected, counts


class TitanGroupedMoE(nn.Module):
    """torchtitan's ``MoE``: ``router`` (a module holding the gate Linear), ``experts`` (GroupedExperts, 3-D
    weights), tokens sorted by expert, run, weighted and scattered back."""

    def __init__(self, dim: int, hidden_dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, experts, top_k)
        self.experts = GroupedExperts(dim, hidden_dim, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected, counts = self.router(x)
        order = torch.argsort(selected.view(-1), stable=True)
        token = order // self.router.top_k
        out = self.experts(x[token], counts.long()) * top_scores.view(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, out).view(bs, seq, dim)


class SinkAttention(TitanAttention):
    """TitanAttention with GPT-OSS's attention sinks: one learned logit per head (a plain parameter of the
    attention module) joins each query's scores before the softmax and is dropped after it."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__(dim, n_heads, n_kv_heads)
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, n_heads))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = self.heads(x, rope)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).triu(1), -1e9)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(bs, -1, seqlen, 1)
        weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return self.wo((weights @ v).transpose(1, 2).reshape(bs, seqlen, -1))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, moe: bool | str, sinks: bool = False) -> None:
        super().__init__()
        self.attention = (SinkAttention if sinks else TitanAttention)(dim, HEADS, 2)
        self.feed_forward = (TitanGroupedMoE(dim, FFN, EXPERTS, TOP_K) if moe == "grouped" else
                             titan_moe(dim, FFN, EXPERTS, TOP_K) if moe else TitanFeedForward(dim, FFN))
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanTransformer(nn.Module):
    """torchtitan's Llama 3 ``Transformer``: ``tok_embeddings``, the blocks in an ``nn.ModuleDict`` named
    ``layers`` (keys "0", "1", ...: torchtitan keeps the names stable when pipeline stages delete layers), a
    non-persistent rotary buffer, ``norm``, ``output``; forward runs ``self.layers.values()`` in order."""

    def __init__(self, moe: bool | str = False, sinks: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        # as torchtitan, for a max_seq_len above the training length; the forward takes its first seqlen rows
        self.register_buffer("rope", _rope_table(HIDDEN // HEADS, TITAN_MAX_SEQ), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(HIDDEN, moe, sinks) for i in range(LAYERS)})
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))


TITAN_MAX_SEQ = 2048


def _rope_table(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def make_titan_llama(**_: object) -> L.LightningModule:
    return LitLM(TitanTransformer())


def make_titan_moe(**_: object) -> L.LightningModule:
    """The torchtitan-style Llama with an MoE feed-forward per block (the autocast router)."""
    return LitLM(TitanTransformer(moe=True))


def make_titan_sinks(**_: object) -> L.LightningModule:
    """The torchtitan-style Llama with GPT-OSS's attention sinks (a parameter per head, split with the heads by TP)."""
    return LitLM(TitanTransformer(sinks=True))


def make_titan_grouped_moe(**_: object) -> L.LightningModule:
    """The torchtitan-style Llama with torchtitan's own MoE layout: a router module and 3-D GroupedExperts."""
    return LitLM(TitanTransformer(moe="grouped"))


# ------------------------------------------------------------------------------------------- a small-image CNN


CIFAR = 32  # a CIFAR-size image: the 4x4 token image upsampled; ResNet's last feature map is 1x1


class LitSmallImageClassifier(LitImageClassifier):
    """The token rows as 4x4 images (LitImageClassifier), upsampled to CIFAR x CIFAR (nearest)."""

    def loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        pixels = (idx.to(torch.get_default_dtype()) * (2.0 / VOCAB) - 1.0).view(-1, CHANNELS, IMAGE, IMAGE)
        pixels = F.interpolate(pixels, size=(CIFAR, CIFAR), mode="nearest")
        return F.cross_entropy(self.model(pixel_values=pixels).logits, targets[:, -1] % LABELS)

    def configure_optimizers(self):
        # BatchNorm over 8 rows of a 1x1 map amplifies fp32 rounding at lr 0.1 (SyncBatchNorm's sums vs one
        # device's: ~3e-6 apart after 6 steps); a smaller step keeps that below the tolerance, not the physics
        return torch.optim.SGD(self.parameters(), lr=SMALL_IMAGE_LR, momentum=MOMENTUM)


SMALL_IMAGE_LR = 0.01


def make_resnet(**_: object) -> L.LightningModule:
    """ResNetForImageClassification (BatchNorm in every conv block) on 32x32 images: stem /4, then three
    stride-2 stages, so the last feature map is 1x1 (one value per channel and row)."""
    import transformers as tf

    config = tf.ResNetConfig(num_channels=CHANNELS, embedding_size=8, hidden_sizes=[8, 8, 16, 16],
                             depths=[1, 1, 1, 1], layer_type="basic", num_labels=LABELS)
    return LitSmallImageClassifier(tf.ResNetForImageClassification(config))


# ------------------------------------------------------------------------------------------- a two-tower model


class TwoTower(nn.Module):
    """A vision-language shape: a "vision" tower frozen but for its ``post_norm`` (requires_grad=False, the
    usual VLM fine-tune), a ``post_norm`` never called (LLaVA never uses its vision tower's ``post_layernorm``),
    a projector and a trained text tower (nn.Sequential of blocks) over token embeddings plus the projected
    image feature, and a head the forward never calls: two trainable parameter sets without gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.ModuleDict(dict(
            patch=nn.Linear(IMAGE * IMAGE, HIDDEN), encoder=nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()),
            post_norm=nn.LayerNorm(HIDDEN)))
        self.vision["patch"].requires_grad_(False)
        self.vision["encoder"].requires_grad_(False)
        self.projector = nn.Linear(HIDDEN, HIDDEN)
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.text = nn.Sequential(*(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, FFN), nn.GELU(),
                                                  nn.Linear(FFN, HIDDEN)) for _ in range(LAYERS)))
        self.unused_head = nn.Linear(HIDDEN, VOCAB)  # a head this forward never calls
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pixels = idx.float().div(VOCAB)
        image = self.vision["encoder"](self.vision["patch"](pixels))  # post_norm skipped, as LLaVA does
        x = self.tok(idx) + self.projector(image)[:, None, :]
        return self.head(self.text(x))


def make_two_tower(**_: object) -> L.LightningModule:
    return LitLM(TwoTower())


# ------------------------------------------------------------------------------------------- no meta trace


class PadSkipping(nn.Module):
    """A token model that runs its MLP on the non-padding tokens only (``x[keep]``, boolean indexing: a
    ``nonzero``, which has no meta kernel, outside any block): its forward does not run on meta tensors, so
    only data parallelism is planned for it."""

    PAD = VOCAB  # never in the data: every token is kept

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        keep = idx != self.PAD
        out = torch.zeros_like(x)
        out[keep] = self.mlp(x[keep])
        return self.head(x + out)


def make_pad_skipping(**_: object) -> L.LightningModule:
    return LitLM(PadSkipping())


# ------------------------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class ThirdPartyModel:
    """A matrix row: how to build it and what its structure allows.

    ``moe``: has MoE layers (gets the ep2 column). ``balance_loss``: its loss has a term over all tokens of a
    step that is not a sum over rows (the router balance loss), so its single-process reference must see the
    same micro-batches as the plan (``reference_run(micro_batches=..., dp=...)``); so do BatchNorm's statistics. ``tied``: shares its input
    embedding with its output head (a pipeline split would put the two on different stages). ``float64``: columns
    whose cell (and its single-process reference) runs in float64 (``cell_dtype``), where float32 rounding alone,
    amplified by the model's arithmetic, exceeds the matrix's tolerance."""

    make: Callable[..., L.LightningModule]
    moe: bool = False
    balance_loss: bool = False
    tied: bool = False
    not_run: tuple[str, ...] = ()  # columns left out of the matrix (each with its reason at the row)
    float64: tuple[str, ...] = ()


@contextmanager
def cell_dtype(model: str, column: str) -> Iterator[None]:
    """The default dtype a cell's model is built and fed in: float64 for ``MODELS[model].float64`` columns."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if column in MODELS[model].float64 else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


MODELS: dict[str, ThirdPartyModel] = {
    "gpt2": ThirdPartyModel(make_gpt2, tied=True),
    "llama": ThirdPartyModel(make_llama),
    # frozen parameters (issue 26) where their sharding differs from DDP's: FSDP, TP, and a pipeline whose first
    # stage trains only part of its layers; auto and ga2 run as llama's
    "llama_frozen": ThirdPartyModel(make_llama_frozen, not_run=("auto", "ga2")),
    "mixtral": ThirdPartyModel(make_mixtral, moe=True, balance_loss=True),
    "qwen2": ThirdPartyModel(make_qwen2),
    "phi3": ThirdPartyModel(make_phi3),
    "olmoe": ThirdPartyModel(make_olmoe, moe=True, balance_loss=True),
    # issue 26: HF MoEs at their default configs (no router logits), where expert parallelism is the point
    "olmoe_default": ThirdPartyModel(make_olmoe_default, moe=True, not_run=("zero3", "tp2", "pp2", "ga2")),
    "mixtral_default": ThirdPartyModel(make_mixtral_default, moe=True, not_run=("zero3", "tp2", "pp2", "ga2")),
    "qwen2_moe": ThirdPartyModel(make_qwen2_moe, moe=True, not_run=("auto", "zero3", "tp2", "pp2", "ga2")),
    # issue 26: Qwen3-MoE (per-head q/k norms, fused experts), at its default config
    "qwen3_moe": ThirdPartyModel(make_qwen3_moe, moe=True),
    # issue 26: GPT-OSS (per-layer attention kinds read by position: a pipeline stage sees its own layers' kinds)
    "gpt_oss": ThirdPartyModel(make_gpt_oss, moe=True),
    "litgpt": ThirdPartyModel(make_litgpt),
    "litgpt_moe": ThirdPartyModel(make_litgpt_moe, moe=True),
    "nanogpt": ThirdPartyModel(make_nanogpt, tied=True),
    "plain_moe": ThirdPartyModel(make_plain_moe, moe=True),
    "bert": ThirdPartyModel(make_bert, tied=True),
    "vit": ThirdPartyModel(make_vit),
    # encoder-decoders (issue 26): two block stacks, cross-attention, embeddings tied across the stacks
    "bart": ThirdPartyModel(make_bart, tied=True),
    "whisper": ThirdPartyModel(make_whisper, tied=True),
    "t5": ThirdPartyModel(make_t5, tied=True),
    # an encoder-decoder MoE (issue 26): experts in a ModuleDict called with a one-hot mask, capacity per sequence
    "switch": ThirdPartyModel(make_switch, moe=True, tied=True),
    # a vision-language model (issue 26): a frozen CLIP tower, a projector, a Llama text model
    "llava": ThirdPartyModel(make_llava),
    # images in some rows only (issue 26: parameters a rank's batch may skip); tp2, pp2 and ga2 run as llava's
    "llava_mixed": ThirdPartyModel(make_llava_mixed, not_run=("tp2", "pp2", "ga2")),
    "titan_llama": ThirdPartyModel(make_titan_llama),
    # q, k and v fused and interleaved per head (``view(..., heads, 3 * head_dim)``, then ``chunk(3, -1)``): the
    # row's point is tp2; zero3 and ga2 run as llama's
    "neox": ThirdPartyModel(make_neox, not_run=("zero3", "ga2")),
    "titan_moe": ThirdPartyModel(make_titan_moe, moe=True),
    # attention sinks (issue 26: a per-head parameter TP shards with the heads); the other columns run as titan_llama's
    "titan_sinks": ThirdPartyModel(make_titan_sinks, not_run=("zero3", "pp2", "ga2")),
    # torchtitan's own MoE layout (issue 26: found as MoE from its router and 3-D experts): ga2 runs as titan_moe's
    "titan_grouped_moe": ThirdPartyModel(make_titan_grouped_moe, moe=True, not_run=("ga2",)),
    # BatchNorm statistics: per micro-batch. A pinned grad_accum=2 gives 1 row per rank and micro-batch, 4 values
    # per channel through the 1x1 map: float32 rounding divided by so few values' deviation ends 1.1e-5 (relative)
    # off one device, so ga2 runs in float64, where it is equal to 1e-14; the planner's own plan excludes
    # grad_accum for BatchNorm with its reason
    "resnet": ThirdPartyModel(make_resnet, balance_loss=True, float64=("ga2",)),
    "two_tower": ThirdPartyModel(make_two_tower),
    "pad_skipping": ThirdPartyModel(make_pad_skipping),
}
