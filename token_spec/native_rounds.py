"""A replayed turn's verify rounds run inside the native extension, for the drafters it covers.

`simulator.verify_rounds` is the reference: per round, `propose`, keep the draft's matching prefix
plus a bonus token, `observe`. For `SuffixDrafter` and `CombinedDrafter` over the native suffix
tree, and `PromptLookupDrafter` over its native n-gram index, `_suffix_native.replay_*` run all of a
turn's rounds in one call, operation for operation the same (tests/test_simulator_native.py compares
every count), so a replay costs the tree's own work instead of several Python calls per round. What
happens once per turn (`start`, `finish`) stays the drafter's own; this module hands the extension
the live request's state and writes back what the rounds changed. Per-round timings are not taken.

`rounds_for(drafter)` is the entry: a function (rid, output, max_tokens) -> (steps, proposed,
accepted), or None where the extension does not cover the drafter (the python tree, a subclass,
the extension missing): then the Python loop runs. `shared_rounds(drafters)` does the same for several
drafters at once, growing one set of trees or one n-gram index for all (`simulator.replay_sessions_shared`).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

from thinkahead.token_spec import suffix_impl
from thinkahead.token_spec.combined_drafter import COMBINED_SOURCES, CombinedDrafter, SourceRate
from thinkahead.token_spec.drafters import PromptLookupDrafter, SuffixDrafter
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.suffix_drafts import _check_draft_args

Rounds = Callable[[Hashable, list[int], int], tuple[int, int, int]]


def rounds_for(drafter: Any) -> Rounds | None:
    """The native verify rounds of `drafter`'s turns, or None (then `simulator.verify_rounds` runs them)."""
    native = suffix_impl.native_module()
    if native is None or not hasattr(native, "replay_suffix"):  # none, or built before the rounds were added
        return None
    kind = type(drafter)  # exact types: a subclass may propose or observe differently
    if kind is SuffixDrafter and drafter.cache.tree_impl == "native":
        return lambda rid, output, max_tokens: _suffix_rounds(native, drafter, rid, output, max_tokens)
    if kind is CombinedDrafter and drafter.cache.tree_impl == "native" and _distinct(drafter.sources):
        return _CombinedRounds(native, drafter)
    if kind is PromptLookupDrafter and drafter.max_ngram <= native.NgramIndex.MAX_N:  # its indexes are native
        return lambda rid, output, max_tokens: _lookup_rounds(native, drafter, rid, output, max_tokens)
    return None


def _distinct(sources: tuple[str, ...]) -> bool:
    return len(set(sources)) == len(sources)


def _global_tree(cache: SuffixCache) -> Any:
    """The global tree while it holds responses (`SuffixCache.speculate` drafts from it only then), else None."""
    return cache.global_tree if cache._cached else None


def _suffix_rounds(native: Any, drafter: SuffixDrafter, rid: Hashable, output: list[int],
                   max_tokens: int) -> tuple[int, int, int]:
    cache = drafter.cache
    req = cache._request(rid)
    if output:  # as the first `propose` would
        _check_draft_args(max_tokens, drafter.max_spec_factor, drafter.min_token_prob)
    totals = native.replay_suffix(req.tree, _global_tree(cache), output, max_tokens, drafter.max_spec_factor,
                                  drafter.max_spec_offset, drafter.min_token_prob, drafter.tree)
    req.global_version = -1  # its global positions moved on in the extension: rematch on the next draft
    return totals


def _lookup_rounds(native: Any, drafter: PromptLookupDrafter, rid: Hashable, output: list[int],
                   max_tokens: int) -> tuple[int, int, int]:
    tokens, index = drafter._tokens.get(rid), drafter._index.get(rid)
    if tokens is None:
        raise ValueError(f"request {rid!r} was not started")
    if isinstance(index, dict):
        raise ValueError(f"request {rid!r} has a Python n-gram index: the native rounds need the native one")
    totals = native.replay_lookup(index, output, max_tokens, drafter.prefer == "recent")
    tokens.extend(output)  # what `observe` appends, round by round
    return totals


class _CombinedRounds:
    """CombinedDrafter's rounds: its rate estimates travel to the extension as tables by rate slot."""

    def __init__(self, native: Any, drafter: CombinedDrafter) -> None:
        self.native = native
        self.drafter = drafter
        keys = drafter._keys  # [source index][min(match_len, top)] -> rate key
        self.slot_keys = sorted({key for row in keys for key in row})
        slot = {key: i for i, key in enumerate(self.slot_keys)}
        self.slot_of = [[slot[key] for key in row] for row in keys]
        self.which = [COMBINED_SOURCES.index(src) for src in drafter.sources]
        default = SourceRate()
        self.default = (default.hits, default.tries)

    def _table(self, rates: dict[str, SourceRate]) -> tuple[list[float], list[float], list[bool]]:
        found = [rates.get(key) for key in self.slot_keys]
        return ([r.hits if r else 0.0 for r in found], [r.tries if r else 0.0 for r in found],
                [r is not None for r in found])

    def _write(self, rates: dict[str, SourceRate], table: tuple[list[float], list[float], list[bool]]) -> None:
        for key, hits, tries, has in zip(self.slot_keys, *table):
            if not has:
                continue
            rate = rates.get(key)
            if rate is None:
                rates[key] = SourceRate(hits, tries)
            else:
                rate.hits, rate.tries = hits, tries

    def args(self, rid: Hashable, max_tokens: int) -> tuple[Any, ...]:
        """replay_combined's arguments after max_tokens, for the live request `rid`."""
        d = self.drafter
        live = d._request(rid)
        return (d.max_spec_factor, d.max_spec_offset, d.min_token_prob, d.alternatives, d.min_score, d.decay,
                d.prior_weight, *self.default, self.which, self.slot_of, self._table(live.rates),
                self._table(d.pooled))

    def done(self, rid: Hashable, session: Any, pooled: Any) -> None:
        """Write back what the rounds changed: the rate tables, and the request's positions and last drafts."""
        d = self.drafter
        live = d._request(rid)
        self._write(live.rates, session)
        self._write(d.pooled, pooled)
        d.cache._request(rid).global_version = -1
        live.native, live.last = None, {}

    def __call__(self, rid: Hashable, output: list[int], max_tokens: int) -> tuple[int, int, int]:
        d = self.drafter
        args = self.args(rid, max_tokens)  # (a request the drafter did not start fails here, as in `propose`)
        req = d.cache._request(rid)
        if output and max_tokens > 0:  # as the first `propose` would
            _check_draft_args(max_tokens, d.max_spec_factor, d.min_token_prob)
        totals, session, pooled = self.native.replay_combined(req.tree, _global_tree(d.cache), output, max_tokens,
                                                              *args)
        self.done(rid, session, pooled)
        return totals


class SharedRounds:
    """Several drafters' rounds over one SuffixCache in one native call (`_suffix_native.replay_shared`).

    Replaying suffix, suffix-tree and combined one after another builds the same request and global trees
    three times over; their drafting never changes a tree, so all of them can draft from one set, each
    when the shared context reaches its own position. `lead` starts and finishes each turn's request
    (the CombinedDrafter where there is one: its own per-turn state lives in `start` / `finish`).
    """

    def __init__(self, native: Any, drafters: list[Any]) -> None:
        self.native = native
        self.drafters = drafters
        self.suffix = [d for d in drafters if type(d) is SuffixDrafter]
        combined = [d for d in drafters if type(d) is CombinedDrafter]
        self.combined = _CombinedRounds(native, combined[0]) if combined else None
        self.lead = combined[0] if combined else drafters[0]
        self.cache: SuffixCache = drafters[0].cache

    def __call__(self, rid: Hashable, output: list[int], max_tokens: int) -> list[tuple[int, int, int]]:
        """(steps, proposed, accepted) per drafter, in `drafters` order."""
        req = self.cache._request(rid)
        for d in self.drafters:  # as each first `propose` would
            if output and (max_tokens > 0 or type(d) is SuffixDrafter):
                _check_draft_args(max_tokens, d.max_spec_factor, d.min_token_prob)
        combined = self.combined.args(rid, max_tokens) if self.combined is not None else None
        suffix = [(d.max_spec_factor, d.max_spec_offset, d.min_token_prob, d.tree) for d in self.suffix]
        totals, together = self.native.replay_shared(req.tree, _global_tree(self.cache), output, max_tokens,
                                                     suffix, combined)
        req.global_version = -1
        if self.combined is not None:
            self.combined.done(rid, *together[1:])
        by_drafter = iter(totals)
        return [together[0] if type(d) is CombinedDrafter else next(by_drafter) for d in self.drafters]


class SharedLookupRounds:
    """PromptLookupDrafters of one n-gram configuration in one native call (`replay_lookup_shared`).

    Their indexes and token lists grow alike (the context), whichever n-gram occurrence each prefers:
    `lead`'s are kept and serve all, and the others' stay unused.
    """

    def __init__(self, native: Any, drafters: list[PromptLookupDrafter]) -> None:
        self.native = native
        self.lead = drafters[0]
        self.recent = [d.prefer == "recent" for d in drafters]

    def __call__(self, rid: Hashable, output: list[int], max_tokens: int) -> list[tuple[int, int, int]]:
        lead = self.lead
        tokens, index = lead._tokens.get(rid), lead._index.get(rid)
        if tokens is None:
            raise ValueError(f"request {rid!r} was not started")
        if isinstance(index, dict):
            raise ValueError(f"request {rid!r} has a Python n-gram index: the native rounds need the native one")
        totals = self.native.replay_lookup_shared(index, output, max_tokens, self.recent)
        tokens.extend(output)  # what `observe` appends, round by round
        return totals


def _lookup_config(d: PromptLookupDrafter) -> tuple[int, ...]:
    return d.min_ngram, d.max_ngram, d.max_sessions, d.max_session_tokens


def shared_rounds(drafters: list[Any]) -> SharedRounds | SharedLookupRounds | None:
    """The drafters' rounds in one native call, or None where the extension does not cover them.

    It covers SuffixDrafters and at most one CombinedDrafter (exact types, as `rounds_for`), all over
    one native-tree SuffixCache (`replay_shared`); or PromptLookupDrafters that differ in `prefer` only
    (`replay_lookup_shared`).
    """
    native = suffix_impl.native_module()
    if native is None or not hasattr(native, "replay_shared") or not drafters:
        return None
    if all(type(d) is PromptLookupDrafter for d in drafters):
        same = all(_lookup_config(d) == _lookup_config(drafters[0]) for d in drafters)
        fits = drafters[0].max_ngram <= native.NgramIndex.MAX_N  # (its indexes are native)
        return SharedLookupRounds(native, drafters) if same and fits else None
    cache = getattr(drafters[0], "cache", None)
    if not isinstance(cache, SuffixCache) or cache.tree_impl != "native":
        return None
    combined = 0
    for d in drafters:
        if type(d) is CombinedDrafter and _distinct(d.sources):
            combined += 1
        elif type(d) is not SuffixDrafter:
            return None
        if d.cache is not cache:
            return None
    return SharedRounds(native, drafters) if combined <= 1 else None
