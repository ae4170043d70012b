"""Torch-free pieces of the token core: drafter names (configs, `--help` and the server list them
without loading torch) and token-sequence helpers that HTTP clients share with the decoder.

`thinkahead.token_spec.presets` says what each drafter name builds.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_DRAFT = 64  # draft tokens per verify round at most: the default of the config, LocalModel, build_decoder, simulate
# (1.5B on 2 CPU cores, self-refine rewrites: 32 makes them ~15% faster than 16, 64 another ~10% than 32
# (a verify's fixed cost, streaming the weights, spread over twice the tokens); the adaptive controller
# picks shorter drafts wherever acceptance or the verify cost calls for them)

MODEL_FREE_KINDS = ("suffix", "suffix-tree", "prompt-lookup", "prompt-lookup-recent", "combined")
MODEL_DRAFT_KINDS = ("draft-model", "hybrid")  # these need a second (draft) model
DRAFTER_KINDS = (*MODEL_FREE_KINDS, *MODEL_DRAFT_KINDS, "none")
SINGLE_MODEL_KINDS = (*MODEL_FREE_KINDS, "none")  # what a `LocalModel` (one model, no draft engine) can use


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
