"""Tiny random causal LMs built in code (no model hub): Llama, Qwen2 and Gemma3 text.

Weights are drawn with a larger initializer range than the default 0.02 so that logits spread
over several units and attention patterns actually matter: a mask or position mistake then shows
up far above float32 noise. Each model builds in well under a second on a CPU.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ARCHS = ("llama", "qwen2", "gemma3")
VOCAB = 160
GEMMA3_SLIDING_WINDOW = 16

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """Build a tiny random `arch` model ("llama", "qwen2" or "gemma3") in eval mode, sdpa attention.

    gemma3 has 4 layers mixing sliding-window (window `GEMMA3_SLIDING_WINDOW`) and full layers;
    llama and qwen2 have 2 full-attention layers. The same seed gives the same weights.
    """
    if arch == "llama":
        config = LlamaConfig(num_hidden_layers=2, **_COMMON)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        config = Qwen2Config(num_hidden_layers=2, **_COMMON)
        cls = Qwen2ForCausalLM
    elif arch == "gemma3":
        config = Gemma3TextConfig(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            sliding_window=GEMMA3_SLIDING_WINDOW,
            query_pre_attn_scalar=16,
            **_COMMON,
        )
        cls = Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(config)
    return model.to(dtype).eval()


# Byte-level BPE merges of the tiny tokenizer: JSON punctuation and a few words, so that a text has
# several tokenizations (a grammar's forced bytes are not one token each).
BYTE_MERGES = (('{', '"'), ('"', ':'), ('"', ','), ('"', '}'), ('n', 'a'), ('m', 'e'), ('na', 'me'), ('t', 'r'),
               ('u', 'e'), ('tr', 'ue'), ('Ġ', '"'), ('a', 'b'))


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map (the byte-level pre-tokenizer's alphabet)."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = list(kept), 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            symbols.append(256 + extra)
            extra += 1
    return {b: chr(s) for b, s in zip(kept, symbols)}


def byte_tokenizer():
    """A byte-level BPE tokenizer over printable ASCII and newline with `BYTE_MERGES` (under `VOCAB`
    ids), as real GPT-2/Qwen-style tokenizers are built: grammars compile against it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbol = _byte_symbols()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for b in [*range(32, 127), 10]:
        vocab[symbol[b]] = len(vocab)
    for a, b in BYTE_MERGES:
        vocab[a + b] = len(vocab)
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(BYTE_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
