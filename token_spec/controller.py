"""Speculation-length control: how many draft tokens to verify each round.

- `FixedController`: always the same budget.
- `MatchLengthController`: SuffixDecoding's rule, budget = min(max_tokens,
  floor(match_len * factor + offset)): a longer context match earns a longer draft.
  The suffix cache applies it inside its search; for other model-free drafts the
  controller trims to it.
- `AdaptiveController`: picks the budget that maximises expected tokens per
  second from an online estimate of the acceptance rate and of the measured cost
  of verifying k tokens; when drafts keep failing it drops to zero (plain
  decoding) and keeps probing with free, unverified drafts, so text with nothing
  to copy runs at plain-decoding speed.
"""

from __future__ import annotations

from typing import Protocol

from thinkahead.token_spec.acceptance import moved_accept_rate
from thinkahead.token_spec.names import MAX_DRAFT
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.pricing import price_rows


class SpeculationController(Protocol):
    name: str
    max_tokens: int

    def budget(self) -> int:
        """Draft tokens to ask for this round (0 = decode one token plainly)."""
        ...

    def trim(self, draft: Draft) -> Draft:
        """Cut a proposed draft to what this round should verify."""
        ...

    def update(self, proposed: int, accepted: int, fed: int | None = None, seconds: float | None = None) -> None:
        """Learn from one round; `fed`/`seconds` are the verify forward's size and time (None for a probe)."""
        ...


class FixedController:
    """Always propose `max_tokens` tokens."""

    def __init__(self, max_tokens: int = 8) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.name = f"fixed-{max_tokens}"

    def budget(self) -> int:
        return self.max_tokens

    def trim(self, draft: Draft) -> Draft:
        return draft.truncated(self.max_tokens)

    def update(self, proposed: int, accepted: int, fed: int | None = None, seconds: float | None = None) -> None:
        pass


class MatchLengthController(FixedController):
    """SuffixDecoding's rule: budget = min(max_tokens, floor(match_len * factor + offset))."""

    def __init__(self, max_tokens: int = MAX_DRAFT, factor: float = 1.0, offset: float = 0.0) -> None:
        super().__init__(max_tokens)
        if factor < 0:
            raise ValueError(f"factor must be >= 0, got {factor}")
        self.factor = factor
        self.offset = offset
        self.name = "match-length"

    def trim(self, draft: Draft) -> Draft:
        cap = self.max_tokens
        if draft.match_len > 0:
            cap = min(cap, int(draft.match_len * self.factor + self.offset + 1e-6))
        return draft.truncated(max(cap, 0))


def moving_average(average: float | None, value: float, smoothing: float) -> float:
    """`average` moved `smoothing` of the way to `value`; the first value (`average` None) as it is."""
    return value if average is None else average + smoothing * (value - average)


class CostCurve:
    """Seconds of a round by its size k (draft tokens): a moving average for every size measured; any other
    size costs what the least-squares line through the measured ones says (a CPU's verify cost grows about
    linearly with k), or, before two sizes are measured, the measured one (else 1.0) scaled by `prior_slope`
    per token.

    A size not measured in the last `max_age` measurements is forgotten: a cost taken while the machine
    was busy would otherwise keep that size from ever being chosen, hence measured, again.
    """

    def __init__(self, smoothing: float, prior_slope: float, max_age: int = 64) -> None:
        if max_age < 1:
            raise ValueError(f"max_age must be >= 1, got {max_age}")
        self.smoothing = smoothing
        self.prior_slope = prior_slope
        self.max_age = max_age
        self.measured: dict[int, float] = {}
        self._when: dict[int, int] = {}  # size -> the count of measurements at its last one
        self._count = 0
        self._line: tuple[float, float, float] | None = None  # mean k, mean seconds, slope; None: to refit

    def update(self, k: int, seconds: float) -> None:
        self.measured[k] = moving_average(self.measured.get(k), seconds, self.smoothing)
        self._count += 1
        self._when[k] = self._count
        for stale in [size for size, when in self._when.items() if self._count - when >= self.max_age]:
            del self.measured[stale], self._when[stale]
        self._line = None

    def __call__(self, k: int) -> float:
        measured = self.measured
        if k in measured:
            return measured[k]
        if len(measured) >= 2:
            if self._line is None:
                n = len(measured)
                mean_k, mean_t = sum(measured) / n, sum(measured.values()) / n
                var = sum((x - mean_k) ** 2 for x in measured)
                slope = max(0.0, sum((x - mean_k) * (t - mean_t) for x, t in measured.items()) / var)
                self._line = (mean_k, mean_t, slope)
            mean_k, mean_t, slope = self._line
            return max(mean_t + slope * (k - mean_k), min(measured.values()))  # never cheaper than any measured
        base = measured.get(0)
        if base is None and measured:
            k0, t0 = next(iter(measured.items()))
            base = t0 / (1 + self.prior_slope * k0)
        return (base or 1.0) * (1 + self.prior_slope * k)


class AdaptiveController:
    """Goodput-maximising budget from online acceptance and verification-cost estimates.

    With per-token acceptance rate a, a draft of k tokens yields on average
    E(k) = (1 - a^(k+1)) / (1 - a) tokens per verify pass; the pass costs c(k),
    the measured time to verify k draft tokens (an exponential moving average per
    k; an unmeasured k costs what the least-squares line through the measured ones says, or, before two
    are measured, what `cost_slope` says). The budget is argmax E(k) / c(k).
    """

    def __init__(
        self,
        max_tokens: int = MAX_DRAFT,
        smoothing: float = 0.25,
        initial_accept_rate: float = 0.5,
        cost_slope: float = 0.03,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.max_tokens = max_tokens
        self.smoothing = smoothing
        self.accept_rate = initial_accept_rate
        self.cost_slope = cost_slope
        self.name = "adaptive"
        self.cost = CostCurve(smoothing, cost_slope)  # draft tokens -> seconds per verify pass

    def budget(self) -> int:
        a = min(self.accept_rate, 0.999)
        best_k, best_rate = 0, 1.0 / self.cost(0)
        expected = 1.0
        for k in range(1, self.max_tokens + 1):
            expected += a ** k
            rate = expected / self.cost(k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def trim(self, draft: Draft) -> Draft:
        return draft.truncated(self.max_tokens)

    def price(self, draft: Draft) -> Draft:
        """A draft whose probs are its rows' worths (calibrated chances: `priced_drafts`), cut to the rows that
        raise the expected tokens per second of its verify by the measured cost (pricing.price_rows)."""
        return draft.truncated(price_rows([draft.probs[:self.max_tokens]], self.cost, 1, 1.0)[0])

    def update(self, proposed: int, accepted: int, fed: int | None = None, seconds: float | None = None) -> None:
        self.accept_rate = moved_accept_rate(self.accept_rate, proposed, accepted, self.smoothing)
        if fed is not None and seconds is not None:
            self.cost.update(fed - 1, seconds)
