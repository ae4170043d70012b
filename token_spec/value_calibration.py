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

from collections.abc import Hashable

CALIBRATION_BUCKETS = 10  # the estimate's range [0, 1] in this many equal parts, each with its own count
CALIBRATION_PRIOR = 8.0  # tokens' worth of belief in the estimate itself, per part
CALIBRATION_MEMORY = 512  # a part's count halves when it passes this many tokens


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

    def rates(self) -> dict[tuple[Hashable, int], tuple[int, float]]:
        """(key, part) -> (tokens counted, their accepted share), for logs and tests."""
        return {k: (round(c[0]), c[1] / c[0]) for k, c in self._counts.items() if c[0] > 0}
