"""Replay recorded outputs through a suffix cache, with no model, to judge drafting in seconds.

As ArcticInference's simulator: for each recorded (prompt, output) pair, speculate
from the context, accept greedily while the draft matches the real next tokens,
add one bonus token, and move on. Acceptance length = output tokens / verify
steps. Drafting changes can then be compared on thousands of outputs at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence
import itertools
import time

from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.verify import children_of


@dataclass(slots=True)
class ReplayStats:
    """Totals over a replay, plus raw per-call latencies for percentiles."""

    requests: int = 0
    output_tokens: int = 0
    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    speculate_s: list[float] = field(default_factory=list)
    extend_s_per_token: list[float] = field(default_factory=list)
    accept_length_per_request: list[float] = field(default_factory=list)

    @property
    def accept_length(self) -> float:
        return self.output_tokens / self.verify_steps if self.verify_steps else 0.0

    def percentile_us(self, values: list[float], q: float) -> float:
        if not values:
            return 0.0
        ordered = sorted(values)
        return 1e6 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "verify_steps": self.verify_steps,
            "accept_length": round(self.accept_length, 4),
            "draft_precision": round(self.accepted_tokens / self.proposed_tokens, 4) if self.proposed_tokens else 0.0,
            "speculate_p50_us": round(self.percentile_us(self.speculate_s, 0.50), 1),
            "speculate_p99_us": round(self.percentile_us(self.speculate_s, 0.99), 1),
            "extend_per_token_p50_us": round(self.percentile_us(self.extend_s_per_token, 0.50), 2),
            "extend_per_token_p99_us": round(self.percentile_us(self.extend_s_per_token, 0.99), 2),
        }


_request_ids = itertools.count()


def accepted_prefix(draft: Draft, actual: Sequence[int]) -> int:
    """Draft tokens a greedy verifier keeps when the target would produce `actual`."""
    children = children_of(draft.parents)
    node, n = -1, 0
    while n < len(actual):
        nxt = next((c for c in children.get(node, ()) if draft.token_ids[c] == actual[n]), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def replay(
    cache: SuffixCache,
    records: Iterable[tuple[Sequence[int], Sequence[int]]],
    max_tokens: int = 16,
    max_spec_factor: float = 1.0,
    max_spec_offset: float = 0.0,
    min_token_prob: float = 0.1,
    tree: bool = False,
    stats: ReplayStats | None = None,
) -> ReplayStats:
    """Replay (prompt ids, output ids) pairs in order; outputs join the global tree as they finish."""
    stats = stats or ReplayStats()
    clock = time.perf_counter
    for i, (prompt, output) in enumerate(records):
        rid = ("replay", next(_request_ids))  # unique across replays: a reused id would evict
        cache.start_request(rid, prompt)
        context = list(prompt)
        pos = steps = 0
        while pos < len(output):
            t0 = clock()
            draft = cache.speculate(rid, context, max_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree)
            stats.speculate_s.append(clock() - t0)
            hit = accepted_prefix(draft, output[pos:])
            new = list(output[pos:pos + hit + 1])
            stats.proposed_tokens += len(draft)
            stats.accepted_tokens += min(hit, len(new))
            t0 = clock()
            cache.extend(rid, new)
            stats.extend_s_per_token.append((clock() - t0) / len(new))
            context += new
            pos += len(new)
            steps += 1
        cache.stop_request(rid)
        stats.requests += 1
        stats.output_tokens += len(output)
        stats.verify_steps += steps
        stats.accept_length_per_request.append(len(output) / steps if steps else 0.0)
    return stats
