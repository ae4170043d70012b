"""Small helpers of `SuffixCache`: argument and token checks, and the "alt" source's tree of chains."""

from __future__ import annotations

from typing import Sequence
import array
import math
import operator

from thinkahead.token_spec.names import SUFFIX_SPEC_OFFSET
from thinkahead.token_spec.draft import Draft

MAX_DRAFT_TOKENS = 2**31 - 1  # a draft's budget: the native tree takes a C int


def _check_draft_args(max_tokens: int, max_spec_factor: float, min_token_prob: float,
                      max_spec_offset: float = SUFFIX_SPEC_OFFSET) -> None:
    try:
        count = -1 if isinstance(max_tokens, bool) else operator.index(max_tokens)  # any integer type, no bool
    except TypeError:
        count = -1
    if not 0 <= count <= MAX_DRAFT_TOKENS:
        raise ValueError(f"max_tokens must be an integer from 0 to {MAX_DRAFT_TOKENS}, got {max_tokens!r}")
    check_spec_limits(max_spec_factor, max_spec_offset, min_token_prob)


def check_spec_limits(max_spec_factor: float, max_spec_offset: float, min_token_prob: float) -> None:
    """A ValueError naming the setting unless the draft budget rule `floor(m * max_spec_factor +
    max_spec_offset)` and the probability cut-off are real numbers (NaN or inf would draft nothing)."""
    if not 0.0 <= min_token_prob <= 1.0:  # (false for NaN)
        raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
    if not (math.isfinite(max_spec_factor) and max_spec_factor >= 0):
        raise ValueError(f"max_spec_factor must be a finite number >= 0, got {max_spec_factor}")
    if not math.isfinite(max_spec_offset):
        raise ValueError(f"max_spec_offset must be a finite number, got {max_spec_offset}")


def _tree_of_chains(chains: list[tuple[int, list[int]]], source: str) -> Draft:
    """One draft tree holding every chain (shared prefixes merged); match_len is the longest chain's match."""
    index: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for _, chain in chains:
        node = -1
        for token in chain:
            nxt = index.get((node, token))
            if nxt is None:
                nxt = index[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = nxt
    probs = [1.0] * len(tokens)
    match_len = max((m for m, _ in chains), default=0)
    return Draft(
        token_ids=tokens, parents=parents, probs=probs, score=float(len(tokens)), match_len=match_len, source=source
    )


def _checked_tokens(token_ids: Sequence[int], what: str) -> list[int]:
    """Token ids as a list of non-negative ints, or a ValueError naming the problem (a string, an
    array of more than one dimension, a bool or anything else that is not an integer)."""
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of token ids, not {type(token_ids).__name__}")
    ndim = getattr(token_ids, "ndim", None)  # a numpy array or a torch tensor
    if ndim is not None:
        if ndim != 1:
            raise ValueError(f"{what} must be a 1-D sequence of token ids, got a {ndim}-D {type(token_ids).__name__}")
        token_ids = token_ids.tolist()  # Python scalars (a bool array's stay bools)
    if type(token_ids) in (list, tuple):  # read twice at most (an iterator would not survive a failed try)
        if bool in set(map(type, token_ids)):  # (array "q" and operator.index take True as 1)
            raise ValueError(f"{what} must hold integer token ids, found a bool")
        try:  # the common case in one C-level pass: integers (or __index__ objects) that fit in 64 bits
            fast = array.array("q", token_ids)
        except (TypeError, OverflowError):
            pass  # a non-integer or a huge one: the loop below says which
        else:
            if fast and min(fast) < 0:
                raise ValueError(f"{what} must hold non-negative token ids, found {min(fast)}")
            return fast.tolist()
    out = []
    for t in token_ids:
        if isinstance(t, bool) or type(t).__name__ == "bool_":  # (numpy's bool)
            raise ValueError(f"{what} must hold integer token ids, found a bool ({t!r})")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"{what} must hold integer token ids, found {t!r}") from None
    if out and min(out) < 0:
        raise ValueError(f"{what} must hold non-negative token ids, found {min(out)}")
    if out and max(out) >= 2**63:
        raise ValueError(f"{what} must hold token ids below 2**63, found {max(out)}")
    return out