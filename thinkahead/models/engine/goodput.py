"""The goodput plan: each sequence's draft length in a batch (`allocate`), from what a forward costs by its rows
(`RowCost`: the shape measured once on the engine, the level followed online).

The plan weighs every draft row against what it adds to the step's time, so it needs the cost of a forward
at row counts it has not chosen yet. Learning that curve only from the steps
it runs is a trap: the plan measures the sizes it chooses, a line through them prices the others, and a dear
guess keeps a size from ever being chosen, hence measured (measured on the 1.5B GGUF: the plan kept 4 copy
streams that accept 95% of drafts at one draft token among them, docs/results/goodput_sweep.md).

On a CPU the curve is not a line either. The GGUF kernels read the weights once per pass of up to 8 rows
and once per tile of 16 rows from 9 rows on (kernels/native/kquant_tiles.inc), so rows cost most in the first
few and least in full tiles, and the curve bends where tiles start and past each full tile (the measured sizes
and the 1.5B's curve: `CALIBRATION_ROWS`).

So `measure_rows` times real forwards of `CALIBRATION_ROWS` rows once (a scratch sequence),
`RowCost` interpolates between them, and each step's measured time moves only the curve's level (a moving
average of measured / calibrated): a longer KV or a busy machine raises every size alike, while the shape
stays the engine's. An engine that was never calibrated falls back to `CostCurve`'s line.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable

from thinkahead.token_spec.controller import CostCurve, moving_average
from thinkahead.token_spec.pricing import best_rows, chain_gains
from thinkahead.token_spec.engine import TargetEngine
from thinkahead.token_spec.names import MAX_DRAFT

logger = logging.getLogger(__name__)

# Forward sizes timed once per engine and machine (kept across processes: calibration.py), once each (the 1.5B on
# a Zen 5: about 1.3 s in all). A slow outlier only makes the plan avoid one size for a while. The curve bends
# where the kernels turn to tiles and past each full tile (1.5B, 512-bit tiles of 16 rows from 9 on: 8 rows 56
# ms, 9 rows 63, 16 rows 70-77, 17 rows about 100: the 17th row runs row by row, reading every weight again); joined
# by one line from 8 to 16 and from 16 to 32 it made 9-11 and 17-21 rows look cheap, and at 16 streams the plan
# drafted into them (suffix 0.86x plain). So the sizes either side of those bends are measured too.
CALIBRATION_ROWS = (1, 2, 4, 8, 9, 12, 16, 17, 20, 24, 32, 48, 64)
CALIBRATION_CONTEXT = 16  # tokens of KV the calibrated rows attend to
CALIBRATION_REPEATS = 1  # the fastest of this many timings per size
COST_SLOPE = 0.09  # a forward's cost per extra row relative to one row, before any is measured (1.5B: 8 rows 1.6x)
COST_SMOOTHING = 0.25  # how far one step's measured time moves the curve's level
TRUST_DECAY = 0.95  # the share of the plan's record of expected and accepted draft tokens kept from step to step
TRUST_PRIOR = 2.0  # draft tokens' worth of record that came true as expected, before any
TRUST_MIN, TRUST_MAX = 0.1, 1.5  # the bounds of that trust (tree drafts can beat a chain's estimate)


def allocate(accept_rates: list[float], cost: Callable[[int], float], most: int = MAX_DRAFT,
             max_rows: int | None = None, trust: float = 1.0) -> list[int]:
    """Draft lengths for sequences with these acceptance rates that maximise the expected tokens per second of
    one forward (SmartSpec's goodput): a sequence drafting k tokens at rate a commits 1 + a + ... + a^k tokens on
    average, and the forward of R rows in all costs `cost(R - 1)` seconds. Draft tokens are taken likeliest
    accepted first; of every such prefix (up to `max_rows` rows) the plan is the one with the most tokens per
    second. Every prefix is weighed, not only until one more token stops paying: on a CPU a row costs most in
    a forward's first few and least in full tiles (see above), so a draft row that does not pay can be
    followed by a dozen that do. `trust` scales every draft token's expected gain (`Trust.factor`)."""
    rates = [min(max(a, 0.0), 0.999) for a in accept_rates]
    gains = [chain_gains(a * trust, a, most) for a in rates]
    return best_rows(gains, cost, len(rates), float(len(rates)), max_rows)


def measure_rows(engine: TargetEngine, rows: tuple[int, ...] = CALIBRATION_ROWS,
                 context: int = CALIBRATION_CONTEXT, repeats: int = CALIBRATION_REPEATS) -> dict[int, float]:
    """Seconds of one forward of each size in `rows` (as rows - 1 -> seconds) over a scratch sequence of
    `context` tokens, the fastest of `repeats` timings; the sequence is rolled back after each."""
    if not rows or min(rows) < 1 or context < 1 or repeats < 1:
        raise ValueError(f"rows must be >= 1 and context, repeats >= 1, got {rows}, {context}, {repeats}")
    vocab = max(int(engine.vocab_size), 1)
    ids = [(17 + 7919 * i) % vocab for i in range(context + max(rows))]  # any tokens: the cost is the same
    session = engine.new_session()
    engine.forward(session, ids[:context], last_only=True)
    measured: dict[int, float] = {}
    for n in sorted(set(rows)):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.forward(session, ids[context:context + n])
            best = min(best, time.perf_counter() - t0)
            engine.truncate(session, context)
        measured[n - 1] = best
    return measured


class Trust:
    """How far the plan's expected accepted draft tokens come true: (accepted + TRUST_PRIOR) / (expected +
    TRUST_PRIOR) over the drafts it sized, within [TRUST_MIN, TRUST_MAX]; both sums fade by TRUST_DECAY a step.

    An acceptance estimate that moves with every round overrates the drafts it leads to: a sequence drafts right
    after a run of hits, and chains of thought regress from there (the 1.5B, 8 GSM8K chains at once: the plan
    drafted at estimates of 0.77 a token, drafted rows were accepted at about 0.35, and speculation made the
    batch slower than none). The factor scales every draft token's expected gain, so the plan prices that in.
    The sums fade (by half in 14 steps), so a plan that stopped drafting tries again some dozens of steps later
    (the workload may have changed), at the cost of a few rows each time.
    """

    __slots__ = ("accepted", "expected")

    def __init__(self) -> None:
        self.accepted = self.expected = 0.0

    def update(self, expected: float, accepted: int) -> None:
        if expected < 0 or accepted < 0:
            raise ValueError(f"expected and accepted draft tokens must be >= 0, got {expected} and {accepted}")
        self.expected += expected
        self.accepted += accepted

    def step(self) -> None:
        self.expected *= TRUST_DECAY
        self.accepted *= TRUST_DECAY

    @property
    def factor(self) -> float:
        return min(max((self.accepted + TRUST_PRIOR) / (self.expected + TRUST_PRIOR), TRUST_MIN), TRUST_MAX)


class RowCost:
    """Seconds of a forward by its size k (rows - 1), as `CostCurve` answers it (`update(k, s)`, `cost(k)`).

    After `calibrate(points)`: the calibrated points, made non-decreasing (a size is never cheaper than a
    smaller one) and joined by straight lines (past the largest, the last segment's slope), times `level`, the
    moving average of measured / calibrated over the steps since. Before: `CostCurve`'s fit of what it measured.
    """

    __slots__ = ("smoothing", "level", "_sizes", "_seconds", "_fallback")

    def __init__(self, smoothing: float = COST_SMOOTHING, prior_slope: float = COST_SLOPE) -> None:
        self.smoothing = smoothing
        self.level = 1.0
        self._sizes: list[int] = []
        self._seconds: list[float] = []
        self._fallback = CostCurve(smoothing, prior_slope)

    @property
    def calibrated(self) -> bool:
        return bool(self._sizes)

    def calibrate(self, points: dict[int, float]) -> None:
        """Take the shape from measured forwards (size k -> seconds, k >= 0, seconds > 0)."""
        if not points or min(points) < 0 or min(points.values()) <= 0:
            raise ValueError(f"calibration points must be sizes >= 0 with seconds > 0, got {points}")
        sizes = sorted(points)
        self._sizes, self._seconds, self.level = sizes, list(itertools.accumulate((points[k] for k in sizes), max)), 1.0

    def _shape(self, k: int) -> float:
        sizes, seconds = self._sizes, self._seconds
        if len(sizes) == 1 or k <= sizes[0]:
            return seconds[0]
        i = min(bisect.bisect_right(sizes, k), len(sizes) - 1)  # the segment [i - 1, i] holds k (or ends below)
        k0, k1, s0, s1 = sizes[i - 1], sizes[i], seconds[i - 1], seconds[i]
        return s0 + (s1 - s0) * (k - k0) / (k1 - k0)

    def update(self, k: int, seconds: float) -> None:
        if self._sizes:
            self.level = moving_average(self.level, seconds / self._shape(k), self.smoothing)
        else:  # the line is read only until the shape is measured
            self._fallback.update(k, seconds)

    def __call__(self, k: int) -> float:
        return self.level * self._shape(k) if self._sizes else self._fallback(k)

    def describe(self) -> str:
        """The calibrated curve, for the log: rows: ms."""
        return " ".join(f"{k + 1}:{s * 1000:.0f}" for k, s in zip(self._sizes, self._seconds))
