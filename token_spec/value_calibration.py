"""`ValueCalibration`: a drafter's own estimate that a draft token is accepted, turned into the rate at which the
tokens it gave that estimate were accepted.

Why: a scheduler that prices every draft row by its worth (the expected accepted tokens it adds, `ForwardCall.values`)
needs worths that come true. Drafters' own estimates do not: measured on the 1.5B's chains of thought (3 in flight,
the README job), the draft head's path probabilities of 0.5-0.6 were accepted 36% of the time, the suffix tree's
0.5-0.6 21%, while the head's 0.9 and above held (91%). So each kind of estimate (a key: its source and depth) keeps,
per tenth of the estimate's range, how many tokens it gave that estimate and how many of them were accepted, and
answers (accepted + prior * estimate) / (given + prior): the estimate itself until tokens are counted, their rate
once many are. The counts halve past `CALIBRATION_MEMORY` tokens, so the rates follow a workload that changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

from thinkahead.token_spec.draft import Draft

CALIBRATION_BUCKETS = 10  # the estimate's range [0, 1] in this many equal parts, each with its own count
CALIBRATION_PRIOR = 8.0  # tokens' worth of belief in the estimate itself, per part
CALIBRATION_MEMORY = 512  # a part's count halves when it passes this many tokens
# A node's depth in its draft, as the calibration keys it: 1, 2, 3, 4, then up to 8, 16 and beyond (a copied chain's
# nodes far down are less sure than its first, whatever the drafter's estimate says).
CALIBRATION_DEPTHS = (1, 2, 3, 4, 8, 16)
COPY_MATCH = 8  # a model-free draft from a context match this long or longer is a copy (its own calibration kind)

Pending = tuple[tuple[Hashable, int], float, tuple[int, ...]]  # a drafted node: its calibration key, estimate and path


def depth_key(depth: int) -> int:
    """The calibration's depth key of a node `depth` tokens after the context (CALIBRATION_DEPTHS)."""
    for bound in CALIBRATION_DEPTHS:
        if depth <= bound:
            return bound
    return CALIBRATION_DEPTHS[-1] + 1


class ValueCalibration:
    """Calibrated worths by (key, estimate); `record` what became of a token given an estimate."""

    __slots__ = ("prior", "memory", "_counts")

    def __init__(self, prior: float = CALIBRATION_PRIOR, memory: int = CALIBRATION_MEMORY) -> None:
        if prior <= 0 or memory < 1:
            raise ValueError(f"prior must be > 0 and memory >= 1, got {prior} and {memory}")
        self.prior, self.memory = prior, memory
        self._counts: dict[tuple[Hashable, int], list[float]] = {}  # (key, part) -> [given, accepted]

    @staticmethod
    def _part(estimate: float) -> int:
        return min(max(int(estimate * CALIBRATION_BUCKETS), 0), CALIBRATION_BUCKETS - 1)

    def __call__(self, key: Hashable, estimate: float) -> float:
        estimate = min(max(float(estimate), 0.0), 1.0)
        count = self._counts.get((key, self._part(estimate)))
        if count is None:
            return estimate
        return (count[1] + self.prior * estimate) / (count[0] + self.prior)

    def record(self, key: Hashable, estimate: float, accepted: bool) -> None:
        count = self._counts.setdefault((key, self._part(estimate)), [0.0, 0.0])
        count[0] += 1.0
        count[1] += 1.0 if accepted else 0.0
        if count[0] > self.memory:
            count[0] *= 0.5
            count[1] *= 0.5

    def worths(self, draft: Draft, kind: Hashable, pending: list[Pending]) -> Draft:
        """`draft` with its nodes' estimates turned into calibrated worths (by `kind` and depth); each node is
        appended to `pending`, for `count` to learn what became of it."""
        depth: list[int] = []
        probs = []
        for path, parent, estimate in zip(draft.paths(), draft.parents, draft.probs):
            depth.append(1 if parent < 0 else depth[parent] + 1)
            key = (kind, depth_key(depth[-1]))
            pending.append((key, estimate, path))
            probs.append(self(key, estimate))
        return replace(draft, probs=probs, score=sum(probs))

    def count(self, pending: list[Pending], accepted: Sequence[int], verified: Draft) -> None:
        """Record each pending node the target verified (those in `verified`, a draft the scheduler may have cut):
        kept or not, by `accepted` (the round's tokens: the kept drafts, then the target's own)."""
        paths, kept = set(verified.paths()), tuple(accepted[:-1])
        for key, estimate, path in pending:
            if path in paths:
                self.record(key, estimate, kept[:len(path)] == path)

    def rates(self) -> dict[tuple[Hashable, int], tuple[int, float]]:
        """(key, part) -> (tokens counted, their accepted share), for logs and tests."""
        return {k: (round(c[0]), c[1] / c[0]) for k, c in self._counts.items() if c[0] > 0}


class CalibratedDrafter:
    """A model-free drafter whose drafts carry calibrated worths (`priced_drafts`): the decoder and the scheduler
    keep the rows that pay for their place in the forward. Its estimates are keyed "copy" (a match of COPY_MATCH
    tokens or more) or "match", by depth; counted over every request's verified nodes."""

    model_free = True
    priced_drafts = True

    def __init__(self, inner: Any) -> None:
        if not getattr(inner, "model_free", False):
            raise ValueError(f"only a model-free drafter's drafts are calibrated, got {type(inner).__name__}")
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)
        self.calibration = ValueCalibration()
        self._pending: dict[Hashable, list[Pending]] = {}

    def start(self, rid: Hashable, prompt_ids: Sequence[int], params: Any, session_id: Hashable | None = None) -> None:
        self.inner.start(rid, prompt_ids, params, session_id=session_id)
        self._pending[rid] = []

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        draft = self.inner.propose(rid, context, budget)
        pending: list[Pending] = []
        if rid in self._pending:
            self._pending[rid] = pending
        return self.calibration.worths(draft, "copy" if draft.match_len >= COPY_MATCH else "match", pending)

    def probe(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        return getattr(self.inner, "probe", self.inner.propose)(rid, context, budget)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        self.inner.observe(rid, accepted, proposed)
        pending = self._pending.get(rid)
        if pending:
            self.calibration.count(pending, accepted, proposed)
            self._pending[rid] = []

    def finish(self, rid: Hashable) -> None:
        self.inner.finish(rid)
        self._pending.pop(rid, None)
