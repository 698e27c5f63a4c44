"""Language models from Hugging Face `transformers` configs (no weight download).

Attention runs through torch's scaled_dot_product_attention (attn_implementation="sdpa"):
that is what a training run uses, and its fused kernels keep only the output and the
log-sum-exp for backward, not the s×s probability matrix the "eager" path stores, so the
captured saved-activation bytes match a real run. Dropout on the attention probabilities is
0 (as in Llama and most current recipes): torch's CPU kernel has no fused dropout, so with it
a fake-tensor capture would fall back to the unfused math path that a GPU run does not take.
XLNet has only its own (eager) attention.
use_cache=False: training keeps no KV cache.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _finish(model: Any) -> nn.Module:  # a transformers PreTrainedModel
    model.config.use_cache = False
    return model


def gpt2(
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    vocab: int = 50257,
    positions: int = 1024,
    dropout: float = 0.1,
) -> nn.Module:
    """GPT-2 (Radford et al., 2019) with the LM head tied to the token embedding; `dropout`
    on embeddings and residual branches (0 makes training deterministic, for tests)."""
    # transformers takes seconds to import: only when a Hugging Face model is built
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        attn_pdrop=0.0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return _finish(GPT2LMHeadModel(cfg))


def bert(
    hidden: int = 1024,
    layers: int = 24,
    heads: int = 16,
    ffn: int = 4096,
    vocab: int = 30522,
    positions: int = 512,
    dropout: float = 0.1,
) -> nn.Module:
    """BERT with its masked-LM head (Devlin et al., 2019); defaults: BERT-large."""
    # transformers takes seconds to import: only when a Hugging Face model is built
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=positions,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=dropout,
        attn_implementation="sdpa",
    )
    return BertForMaskedLM(cfg)


def xlnet(
    hidden: int = 1024, layers: int = 24, heads: int = 16, ffn: int = 4096, vocab: int = 32000, dropout: float = 0.1
) -> nn.Module:
    """XLNet with its LM head (Yang et al., 2019); defaults: XLNet-large."""
    # transformers takes seconds to import: only when a Hugging Face model is built
    from transformers import XLNetConfig, XLNetLMHeadModel

    cfg = XLNetConfig(
        d_model=hidden,
        n_layer=layers,
        n_head=heads,
        d_inner=ffn,
        vocab_size=vocab,
        use_mems_train=False,
        use_mems_eval=False,
        mem_len=None,
        dropout=dropout,
    )
    return XLNetLMHeadModel(cfg)


def llama(
    hidden: int = 512,
    layers: int = 4,
    heads: int = 8,
    kv_heads: int | None = None,
    ffn: int = 1376,
    vocab: int = 32000,
    positions: int = 4096,
    tie: bool = False,
) -> nn.Module:
    """A Llama-architecture decoder (RMSNorm, SwiGLU, rotary positions, grouped KV heads)."""
    # transformers takes seconds to import: only when a Hugging Face model is built
    from transformers import LlamaConfig, LlamaForCausalLM

    return _decoder(LlamaConfig, LlamaForCausalLM, hidden, layers, heads, kv_heads or heads, ffn, vocab, positions, tie)


def _decoder(config_cls, model_cls, hidden, layers, heads, kv_heads, ffn, vocab, positions, tie, **extra) -> nn.Module:
    """A Llama-style decoder of transformers' `model_cls` (Llama, Mistral, Qwen2 share these
    config fields), SDPA attention, no KV cache."""
    cfg = config_cls(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=positions,
        tie_word_embeddings=tie,
        use_cache=False,
        attn_implementation="sdpa",
        **extra,
    )
    return _finish(model_cls(cfg))


def tinyllama() -> nn.Module:
    """TinyLlama-1.1B (Zhang et al., 2024): hidden 2048, FFN 5632, 22 layers, 32 heads,
    4 KV heads, vocab 32000, untied head: 1,100,048,384 parameters (HF model card)."""
    return llama(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, positions=2048)


def mistral(
    hidden: int = 4096,
    layers: int = 32,
    heads: int = 32,
    kv_heads: int = 8,
    ffn: int = 14336,
    vocab: int = 32000,
    positions: int = 32768,
    window: int | None = 4096,
) -> nn.Module:
    """Mistral (Jiang et al., 2023): Llama's blocks with grouped KV heads and sliding-window
    attention over `window` tokens; defaults: Mistral-7B-v0.1 (HF config)."""
    # transformers takes seconds to import: only when a Hugging Face model is built
    from transformers import MistralConfig, MistralForCausalLM

    return _decoder(
        MistralConfig,
        MistralForCausalLM,
        hidden,
        layers,
        heads,
        kv_heads,
        ffn,
        vocab,
        positions,
        False,
        sliding_window=window,
    )


def qwen2(
    hidden: int = 3584,
    layers: int = 28,
    heads: int = 28,
    kv_heads: int = 4,
    ffn: int = 18944,
    vocab: int = 152064,
    positions: int = 131072,
    tie: bool = False,
) -> nn.Module:
    """Qwen2 (Qwen team, 2024): Llama-style blocks with biases on the query, key and value
    projections and grouped KV heads; defaults: Qwen2-7B (HF config)."""
    # transformers takes seconds to import: only when a Hugging Face model is built
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _decoder(Qwen2Config, Qwen2ForCausalLM, hidden, layers, heads, kv_heads, ffn, vocab, positions, tie)


def gpt_neo(
    hidden: int = 2560,
    layers: int = 32,
    heads: int = 20,
    vocab: int = 50257,
    positions: int = 2048,
    window: int = 256,
    dropout: float = 0.0,
) -> nn.Module:
    """GPT-Neo (Black et al., 2021): GPT-2-style blocks alternating global and local (a
    `window`-token) attention, head tied to the embedding; defaults: GPT-Neo 2.7B (HF config).
    transformers runs its attention eagerly (no SDPA path), as training with it does."""
    # transformers takes seconds to import: only when a Hugging Face model is built
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=positions,
        window_size=window,
        attention_types=[[["global", "local"], layers // 2]],
        attention_dropout=0.0,
        resid_dropout=dropout,
        embed_dropout=dropout,
        use_cache=False,
    )
    return _finish(GPTNeoForCausalLM(cfg))


def opt(
    hidden: int = 2048,
    layers: int = 24,
    heads: int = 32,
    ffn: int = 8192,
    vocab: int = 50272,
    positions: int = 2048,
    dropout: float = 0.1,
) -> nn.Module:
    """OPT (Zhang et al., 2022): pre-norm decoder with learned positions (offset by 2) and the
    head tied to the embedding; defaults: OPT-1.3B (HF config)."""
    # transformers takes seconds to import: only when a Hugging Face model is built
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        ffn_dim=ffn,
        vocab_size=vocab,
        max_position_embeddings=positions,
        word_embed_proj_dim=hidden,
        dropout=dropout,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return _finish(OPTForCausalLM(cfg))
