"""Torch-free pieces of the token core: drafter names (configs, `--help` and the server list them
without loading torch) and token-sequence helpers that HTTP clients share with the decoder.

`thinkahead.token_spec.presets` says what each drafter name builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

ACCEPT_PRIOR = 0.5  # a generation's draft acceptance estimate before its first round (nothing else known)
MAX_DRAFT = 64  # draft tokens per verify round at most: the default of the config, LocalModel, build_decoder, simulate
# (1.5B on 2 CPU cores, self-refine rewrites: 32 makes them ~15% faster than 16, 64 another ~10% than 32
# (a verify's fixed cost, streaming the weights, spread over twice the tokens); the adaptive controller
# picks shorter drafts wherever acceptance or the verify cost calls for them)

# SuffixDecoding's draft limits: a draft from a match of m tokens holds at most SUFFIX_SPEC_FACTOR * m +
# SUFFIX_SPEC_OFFSET tokens, each at least SUFFIX_MIN_TOKEN_PROB likely (ArcticInference's defaults); read by the
# suffix cache, its drafter, the simulator and SGLang's suffix backend (the combined drafter sets its own).
SUFFIX_SPEC_FACTOR = 1.0
SUFFIX_SPEC_OFFSET = 0.0
SUFFIX_MIN_TOKEN_PROB = 0.1

# The batch scheduler's (thinkahead/models/engine/scheduler.py): prompt tokens per step while other sequences decode (1.5B on 2
# cores: ~0.7 s a step), and rows of one step's forward at most.
PREFILL_CHUNK = 64
MAX_BATCH_ROWS = 512

MODEL_FREE_KINDS = ("suffix", "suffix-tree", "prompt-lookup", "prompt-lookup-recent", "combined")
MODEL_DRAFT_KINDS = ("draft-model", "hybrid")  # these need a second (draft) model
MODEL_DRAFT_SOURCE = "draft-model"  # the `source` of a draft the small model wrote (token stats count them apart)
HEAD_SOURCE = "draft-head"  # the `source` of a draft the target's draft head wrote (alone or beside another's)
HEAD_KIND = "head"  # the target's own trained draft head (token_spec/head_drafter.py), where one is packaged for it
HEADS_DIR = Path(__file__).resolve().parent / "heads"  # the packaged draft heads: <model spec>.safetensors
DRAFTER_KINDS = (*MODEL_FREE_KINDS, *MODEL_DRAFT_KINDS, HEAD_KIND, "none")


AUTO_DRAFTER = "auto"  # the default: HEAD_KIND where a head is packaged for the model, else SOLO_DRAFTER (below)
# With a draft head: `head`, which drafts with `combined` beside it. Measured on a Xeon with AMX, 1.5B GGUF: one stream
# (`bench/token_spec.py`) cot 26.4 tok/s against combined's 21.0, code 47.1 against 45.0, pipeline 28.4 against 28.9;
# GSM8K chains of thought in flight (`bench/batching.py`) 41.1 against 35.8 (3 streams) and 68.1 against 60.6 (8),
# plain decoding 35.9 and 61.4 (docs/results/token_spec_head.md, batching_head.md).
# A model alone: the combined model-free drafter, the best model-free one measured (`bench/token_spec.py --dtype gguf`,
# 1.5B, refine/cot/code/pipeline: 1.16-2.39x llama.cpp's plain decode; hybrid, the pair's, 1.16-2.35x).
SOLO_DRAFTER = "combined"
# `hybrid` (the small model drafts too) is not the default: one run at a time it beat `combined` (README job, 1.5B:
# 4.8 against 5.1 s/run, plain 6.3), but with 8 runs in flight, the default, it took 47.6 s/run against 30.0 on 125
# GSM8K problems (docs/results/step_frontier.md): a generation alone for a moment drafts with the small model,
# which first reads its whole prompt while every other sequence waits.
DRAFTER_CHOICES = (AUTO_DRAFTER, *DRAFTER_KINDS)  # what a config or `--drafter` may name


def resolve_drafter(kind: str, has_draft_model: bool, has_head: bool = False) -> str:
    """The drafter `kind` names for a model with (or without) a draft model beside it and a draft head for it:
    `auto` is `HEAD_KIND` with a head, else `SOLO_DRAFTER`; a kind that needs a draft model or a head and has none is
    a ValueError."""
    check_drafter(kind, DRAFTER_CHOICES)
    if kind == AUTO_DRAFTER:
        return HEAD_KIND if has_head else SOLO_DRAFTER
    if kind in MODEL_DRAFT_KINDS and not has_draft_model:
        raise ValueError(f"drafter {kind!r} needs a draft model: a small local model with the same tokenizer")
    if kind == HEAD_KIND and not has_head:
        raise ValueError(f"drafter {kind!r} needs a draft head trained for the model; packaged for: "
                         f"{', '.join(packaged_heads()) or 'none'}")
    return kind


def packaged_head(spec: str | None) -> Path | None:
    """The draft head packaged for model `spec` (a packaged model's name: `HEADS_DIR`/<spec>.safetensors)."""
    path = HEADS_DIR / f"{spec}.safetensors"
    return path if spec and "/" not in spec and ":" not in spec and path.is_file() else None


def packaged_heads() -> list[str]:
    """The models a draft head is packaged for."""
    return sorted(p.name.removesuffix(".safetensors") for p in HEADS_DIR.glob("*.safetensors"))


def check_drafter(kind: str, allowed: tuple[str, ...] = DRAFTER_KINDS) -> str:
    """`kind` if it is one of `allowed`; else a ValueError that lists them."""
    if kind not in allowed:
        raise ValueError(f"unknown drafter {kind!r}; expected one of {', '.join(allowed)}")
    return kind


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens `a` and `b` share (at most `limit`)."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
