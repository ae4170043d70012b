"""`CombinedDrafter` on the native tree (sources drafted and merged in C++) against the Python reference.

Both drafters see the same random workloads (requests, sessions, partly accepted drafts, evictions)
with random settings; every proposal must be identical (tokens, parents, probabilities, score, match
length, source) and so must the learned acceptance rates after every observation.
"""

from __future__ import annotations

import random

import pytest

from thinkahead.token_spec import combined_drafter
from thinkahead.token_spec.combined_drafter import COMBINED_SOURCES, CombinedDrafter
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.verify import SamplingParams

native = pytest.importorskip("thinkahead.token_spec._suffix_native")


def fields(d) -> tuple:
    return (d.token_ids, d.parents, d.probs, d.score, d.match_len, d.source)


def settings(rng: random.Random) -> dict:
    k = rng.randrange(1, len(COMBINED_SOURCES) + 1)
    return dict(
        sources=tuple(rng.sample(COMBINED_SOURCES, k)),
        max_spec_factor=rng.choice([0.5, 1.0, 8.0]),
        max_spec_offset=rng.choice([-1.0, 0.0, 8.0]),
        min_token_prob=rng.choice([0.0, 0.05, 0.3]),
        min_score=rng.choice([0.0, 0.0, 0.2]),
        match_bands=rng.choice([(), (1, 2, 4, 8, 16, 32), (3, 5)]),
        alternatives=rng.choice([0, 1, 3]),
        decay=rng.choice([0.5, 0.95]),
    )


def drive(drafter: CombinedDrafter, seed: int, rounds: int) -> list:
    """A random workload through `drafter`; returns every proposal's fields and the rates after each step."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 12, 200])
    out: list = []
    convo: dict[int, list[int]] = {}
    for r in range(rounds):
        session = rng.randrange(3) if rng.random() < 0.5 else None
        if session is not None and session in convo and rng.random() < 0.8:
            prompt = convo[session] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 15))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        drafter.start(r, prompt, SamplingParams(), session_id=session)
        context = list(prompt)
        for _ in range(rng.randrange(1, 10)):
            budget = rng.choice([0, 1, 4, 16, 40])
            own = rng.random() < 0.9
            ctx = context if own else [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
            draft = drafter.propose(r, ctx, budget)
            out.append(fields(draft))
            # The target follows the draft's first branch for a while, then says something else.
            take = rng.randrange(0, len(draft.token_ids) + 1)
            accepted = [t for i, t in enumerate(draft.token_ids[:take]) if draft.parents[i] == i - 1]
            accepted.append(rng.randrange(vocab))
            drafter.observe(r, accepted, draft)
            context.extend(accepted)
            out.append(sorted(drafter.rates(r).items()))
        drafter.finish(r)
        if session is not None:
            convo[session] = context
    out.append(sorted((k, v.hits, v.tries) for k, v in drafter.pooled.items()))
    return out


@pytest.mark.parametrize("block", range(3))
def test_combined_drafts_agree_under_both_trees(block: int, monkeypatch) -> None:
    used_native = []
    real = CombinedDrafter._propose_native

    def spy(self, *args, **kwargs):
        used_native.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CombinedDrafter, "_propose_native", spy)
    for seed in range(block * 12, block * 12 + 12):
        rng = random.Random(seed)
        kw = settings(rng)
        depth = rng.choice([4, 16, 64])
        cap = rng.choice([3, 20])
        runs = {}
        for impl in ("python", "native"):
            cache = SuffixCache(max_depth=depth, max_cached_requests=cap, max_memory_bytes=None, tree_impl=impl)
            runs[impl] = drive(CombinedDrafter(cache, **kw), seed, 25)
        assert runs["python"] == runs["native"], (seed, kw)
    assert used_native  # the C++ path ran


def test_native_sources_are_the_caches_source_drafts() -> None:
    rng = random.Random(4)
    caches = {impl: SuffixCache(max_depth=16, tree_impl=impl) for impl in ("python", "native")}
    for r in range(12):
        seq = [rng.randrange(6) for _ in range(40)]
        for cache in caches.values():
            cache._insert(("old", r), seq)
    prompt = [rng.randrange(6) for _ in range(80)]
    for cache in caches.values():
        cache.start_request("r", prompt)
    for cut in (1, 5, 30, 80):
        context = prompt[:cut]
        expected = caches["python"].speculate_sources("r", context, 12, 8.0, 8.0, 0.05, True, 3)
        sources = native.speculate_sources(
            *caches["native"].draft_positions("r", context), 12, 8.0, 8.0, 0.05, True, 3
        )
        got = sources.drafts()
        assert list(got) == list(COMBINED_SOURCES)
        assert {k: fields(v) for k, v in got.items()} == {k: fields(v) for k, v in expected.items()}
        assert sources.match_lens == tuple(expected[k].match_len for k in COMBINED_SOURCES)
        actual = [rng.randrange(6) for _ in range(5)]
        assert sources.followed(actual) == [combined_drafter.followed(expected[k], actual) for k in COMBINED_SOURCES]
        which, rates = [3, 0, 2], [0.7, 0.4, 0.0]
        merged = sources.merge(which, rates, 9, 0.01, "combined")
        reference = combined_drafter.merge_drafts([(expected[COMBINED_SOURCES[i]], r) for i, r in zip(which, rates)],
                                                  9, min_score=0.01)
        assert fields(merged) == fields(reference)
    with pytest.raises(ValueError, match="which and rates differ"):
        sources.merge([0, 1], [0.5], 4)
    with pytest.raises(ValueError, match="source index out of range"):
        sources.merge([4], [0.5], 4)
