"""The drafter names, in one torch-free place: configs, `--help` and the server list them without loading torch.

`thinkahead.token_spec.presets` says what each name builds.
"""

from __future__ import annotations

MODEL_FREE_KINDS = ("suffix", "suffix-tree", "prompt-lookup", "prompt-lookup-recent", "combined")
MODEL_DRAFT_KINDS = ("draft-model", "hybrid")  # these need a second (draft) model
DRAFTER_KINDS = (*MODEL_FREE_KINDS, *MODEL_DRAFT_KINDS, "none")
SINGLE_MODEL_KINDS = (*MODEL_FREE_KINDS, "none")  # what a `LocalModel` (one model, no draft engine) can use


def check_drafter(kind: str, allowed: tuple[str, ...] = DRAFTER_KINDS) -> str:
    """`kind` if it is one of `allowed`; else a ValueError that lists them."""
    if kind not in allowed:
        raise ValueError(f"unknown drafter {kind!r}; expected one of {', '.join(allowed)}")
    return kind
