"""A generation's estimate of its drafts' acceptance (the share of draft tokens the target keeps, per token),
as the goodput plan reads it (thinkahead/models/engine/goodput.py): a moving average over its verified rounds
and over its unverified drafts (the probes a decoder drafts for free when a round has no room), each probe
checked at every depth against the tokens kept in the rounds after it.
"""

from __future__ import annotations

from thinkahead.token_spec.draft import Draft

ACCEPT_SMOOTHING = 0.25  # how far one round moves the estimate
PENDING_PROBES = 8  # unverified drafts a generation checks against the tokens it keeps, at most

Probe = tuple[list[int], int]  # an unverified draft's tokens, and the index of the next one to check


def first_chain(draft: Draft) -> list[int]:
    """A draft's tokens along its first path (all of a chain's)."""
    n = 1
    while n < len(draft.token_ids) and draft.parents[n] == n - 1:
        n += 1
    return draft.token_ids[:n]


def check_probes(probes: list[Probe], tokens: list[int]) -> tuple[list[Probe], int, int]:
    """Check unverified drafts against the tokens just kept: each draft token is a try, and a miss ends its draft.
    Returns the drafts still pending (the newest `PENDING_PROBES`), the hits and the tries. A draft is checked
    over the rounds after it, so the estimate weighs every depth of a draft, as a verify would, not only its
    first token (on chains of thought the first token of a suffix match hits far more often than the ones
    after it)."""
    hits = tries = 0
    pending = []
    for chain, at in probes:
        for token in tokens:
            tries += 1
            if chain[at] != token:
                at = -1
                break
            hits, at = hits + 1, at + 1
            if at == len(chain):
                break
        if 0 <= at < len(chain):
            pending.append((chain, at))
    return pending[-PENDING_PROBES:], hits, tries


def moved_by_checks(rate: float, hits: int, tries: int) -> float:
    """The estimate moved once by a round's share of hits among its checks (unchanged without any)."""
    return rate + ACCEPT_SMOOTHING * (hits / tries - rate) if tries else rate


def moved_accept_rate(rate: float, proposed: int, accepted: int, smoothing: float = ACCEPT_SMOOTHING) -> float:
    """An acceptance-rate estimate moved by one verified round: the verifier stops at the first miss, so
    `accepted` hits out of accepted + 1 tries (or `proposed` when all hit); unchanged when nothing was proposed."""
    if proposed <= 0:
        return rate
    tries = accepted + (1 if accepted < proposed else 0)
    return rate + smoothing * (accepted / tries - rate)
