"""Which draft rows a verify should hold: of every set of rows taken worthiest first, the one with the most expected
tokens per second of forward (SmartSpec's goodput, per row).

A row's worth is the tokens it is expected to add (a draft node's chance of being accepted). `price_rows` weighs
the rows of one forward's calls, each call's worths non-increasing (its rows are cut from the end), against the
forward's cost by rows; a chain at acceptance rate a is the case of worths a, a^2, ... (`chain_gains`: the
scheduler's goodput plan, thinkahead/models/engine/goodput.py). Every prefix is weighed, not only until one more row
stops paying: on a CPU a row costs most in a forward's first few and least in full tiles, so a row that does not pay
can be followed by a dozen that do.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

NEGLIGIBLE_GAIN = 1e-3  # a draft row expected to add fewer tokens than this is not weighed


def price_rows(worths: list[list[float]], cost: Callable[[int], float], rows: int, expected: float,
               max_rows: int | None = None) -> list[int]:
    """How many of each call's draft rows to verify: `worths[i]` holds call i's draft rows' worths (the tokens each
    is expected to add, non-increasing: rows are kept from the first), beside `rows` rows that are verified anyway
    and expected to commit `expected` tokens. The same choice as `allocate`: of every prefix of rows taken worthiest
    first (up to `max_rows` rows in all), the one with the most expected tokens per second of forward."""
    return best_rows([monotone(w) for w in worths], cost, rows, expected, max_rows)


def chain_expected(rate: float, drafted: int) -> float:
    """The draft tokens a chain of `drafted` at acceptance rate `rate` is expected to keep: rate + ... + rate^drafted."""
    a = min(max(rate, 0.0), 0.999)
    return a * (1 - a ** drafted) / (1 - a)


def chain_gains(first: float, rate: float, most: int) -> Iterator[float]:
    gain = first
    for _ in range(most):
        yield gain
        gain *= rate


def monotone(worths: list[float]) -> Iterator[float]:
    low = 1.0
    for w in worths:
        low = min(low, max(w, 0.0))
        yield low


def best_rows(gains: list[Iterator[float]], cost: Callable[[int], float], rows: int, expected: float,
               max_rows: int | None) -> list[int]:
    """Rows taken one at a time, the next largest gain of any sequence first (each sequence's gains come in
    non-increasing order); the count per sequence of the prefix with the most expected tokens per second."""
    taken = [0] * len(gains)
    if rows <= 0:
        return taken
    heap = []  # (minus a sequence's next gain, sequence)
    for i, g in enumerate(gains):
        first = next(g, 0.0)
        if first >= NEGLIGIBLE_GAIN:
            heap.append((-first, i))
    heapq.heapify(heap)
    best_rate, best, order = expected / cost(rows - 1), 0, []
    while heap and (max_rows is None or rows < max_rows):
        minus_gain, i = heapq.heappop(heap)
        expected, rows = expected - minus_gain, rows + 1
        order.append(i)
        rate = expected / cost(rows - 1)
        if rate > best_rate:
            best_rate, best = rate, len(order)
        following = next(gains[i], 0.0)
        if following >= NEGLIGIBLE_GAIN:
            heapq.heappush(heap, (-following, i))
    for i in order[:best]:
        taken[i] += 1
    return taken
