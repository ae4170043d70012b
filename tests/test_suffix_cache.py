"""SuffixCache: local and global trees, incremental matching, eviction, persistence."""

from __future__ import annotations

import random

import pytest

from thinkahead.token_spec.suffix_cache import SuffixCache


def run_request(cache: SuffixCache, rid, prompt, output, chunk=3):
    cache.start_request(rid, prompt)
    for i in range(0, len(output), chunk):
        cache.extend(rid, output[i:i + chunk])
    cache.stop_request(rid)


def test_local_draft_comes_from_the_prompt() -> None:
    cache = SuffixCache(max_depth=32)
    phrase = [10, 11, 12, 13, 14, 15]
    cache.start_request("a", [1, 2] + phrase + [3, 4])
    cache.extend("a", [10, 11, 12])
    d = cache.speculate("a", [1, 2] + phrase + [3, 4, 10, 11, 12], max_tokens=8)
    assert d.token_ids == [13, 14, 15]  # budget = match length 3
    assert d.source == "suffix-local" and d.match_len == 3
    d = cache.speculate("a", [1, 2] + phrase + [3, 4, 10, 11, 12], max_tokens=8, max_spec_offset=2)
    assert d.token_ids == [13, 14, 15, 3, 4]


def test_global_tree_shares_outputs_across_requests() -> None:
    cache = SuffixCache(max_depth=32)
    answer = list(range(100, 130))
    run_request(cache, "first", [1, 2, 3], answer)
    assert cache.cached_requests == ["first"]
    cache.start_request("second", [7, 8, 9])
    cache.extend("second", answer[:10])
    d = cache.speculate("second", [7, 8, 9] + answer[:10], max_tokens=8)
    assert d.token_ids == answer[10:18] and d.source == "suffix-global"
    assert d.probs == [1.0] * 8


def test_global_disabled_with_zero_cached_requests() -> None:
    cache = SuffixCache(max_cached_requests=0)
    run_request(cache, "a", [1], [5, 6, 7, 8])
    cache.start_request("b", [5, 6, 7])
    assert cache.speculate("b", [5, 6, 7], max_tokens=4).token_ids == []


@pytest.mark.parametrize("tree", [False, True])
def test_incremental_matching_equals_matching_from_scratch(tree: bool) -> None:
    rng = random.Random(0)
    phrases = [[rng.randrange(30) for _ in range(rng.randint(3, 9))] for _ in range(8)]

    def text(n):
        out = []
        while len(out) < n:
            out += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(30)]
        return out[:n]

    cache = SuffixCache(max_depth=12)
    for i in range(20):
        run_request(cache, i, text(20), text(60), chunk=rng.randint(1, 5))
    prompt, out = text(25), text(80)
    cache.start_request("live", prompt)
    ctx = list(prompt)
    for i in range(0, len(out), 2):
        if i == 40:  # the global tree changes mid-request
            run_request(cache, "other", text(10), text(50))
        cache.extend("live", out[i:i + 2])
        ctx += out[i:i + 2]
        fast = cache.speculate("live", ctx, max_tokens=8, tree=tree)
        slow = cache.speculate("live", [0] + ctx, max_tokens=8, tree=tree)  # not its own context
        assert (fast.token_ids, fast.parents, fast.match_len) == (slow.token_ids, slow.parents, slow.match_len)
        assert fast.score == pytest.approx(slow.score)


def test_eviction_by_count_is_fifo() -> None:
    cache = SuffixCache(max_cached_requests=2)
    for rid in "abc":
        run_request(cache, rid, [1], [ord(rid)] * 5 + [2, 3, 4])
    assert cache.cached_requests == ["b", "c"]
    cache.start_request("q", [9])
    assert cache.speculate("q", [ord("a")] * 3, max_tokens=4).token_ids == []
    assert cache.speculate("q", [ord("c")] * 3, max_tokens=4).token_ids[:2] == [ord("c"), ord("c")]


def test_eviction_by_memory_cap() -> None:
    rng = random.Random(1)
    cache = SuffixCache(max_depth=16, max_cached_requests=-1, max_memory_bytes=60_000)
    for i in range(40):
        run_request(cache, i, [1], [rng.randrange(1000) for _ in range(50)])
        assert cache.estimated_bytes <= 60_000 or len(cache.cached_requests) == 1
    assert 1 < len(cache.cached_requests) < 40
    assert cache.cached_requests == list(range(40 - len(cache.cached_requests), 40))


def test_save_and_load_round_trip(tmp_path) -> None:
    rng = random.Random(2)
    cache = SuffixCache(max_depth=20, max_cached_requests=50)
    outputs = [[rng.randrange(40) for _ in range(30)] for _ in range(10)]
    for i, out in enumerate(outputs):
        run_request(cache, f"r{i}", [1, 2], out)
    path = tmp_path / "cache.bin"
    cache.save(path)
    loaded = SuffixCache.load(path)
    assert loaded.cached_requests == cache.cached_requests
    assert loaded.max_depth == 20 and loaded.max_cached_requests == 50
    assert loaded.global_tree.num_nodes == cache.global_tree.num_nodes
    for c in (cache, loaded):
        c.start_request("probe", [5])
    for out in outputs:
        ctx = out[:12]
        a = cache.speculate("probe", ctx, max_tokens=10, tree=True)
        b = loaded.speculate("probe", ctx, max_tokens=10, tree=True)
        assert (a.token_ids, a.parents, a.probs) == (b.token_ids, b.parents, b.probs)
    assert SuffixCache.load(path, max_cached_requests=3).cached_requests == ["r7", "r8", "r9"]


def test_load_rejects_bad_files(tmp_path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"hello\n")
    with pytest.raises(ValueError, match="not a thinkahead suffix cache"):
        SuffixCache.load(bad)
    cache = SuffixCache()
    run_request(cache, "a", [1], [1, 2, 3, 4])
    good = tmp_path / "good.bin"
    cache.save(good)
    good.write_bytes(good.read_bytes()[:-4])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        SuffixCache.load(good)


def test_bad_input_names_the_problem() -> None:
    cache = SuffixCache()
    cache.start_request("a", [1, 2])
    with pytest.raises(ValueError, match="already active"):
        cache.start_request("a", [1])
    with pytest.raises(ValueError, match="not active"):
        cache.extend("zzz", [1])
    with pytest.raises(ValueError, match="not active"):
        cache.speculate("zzz", [1])
    with pytest.raises(ValueError, match="non-negative"):
        cache.extend("a", [3, -1])
    with pytest.raises(ValueError, match="integer token ids"):
        cache.extend("a", [1.5])
    with pytest.raises(ValueError, match="sequence of token ids"):
        cache.start_request("b", "hello")
    with pytest.raises(ValueError, match="min_token_prob"):
        cache.speculate("a", [1, 2], min_token_prob=2.0)
    with pytest.raises(ValueError, match="max_tokens"):
        cache.speculate("a", [1, 2], max_tokens=-1)
    with pytest.raises(ValueError, match="max_memory_bytes"):
        SuffixCache(max_memory_bytes=0)
    cache.stop_request("a")
    with pytest.raises(ValueError, match="not active"):
        cache.stop_request("a")


def test_clear_forgets_outputs_but_not_while_requests_are_live() -> None:
    from thinkahead.token_spec.suffix_cache import SuffixCache

    cache = SuffixCache()
    cache.start_request("a", [1, 2, 3])
    cache.extend("a", [4, 5, 6, 7])
    with pytest.raises(ValueError, match="live"):
        cache.clear()
    cache.stop_request("a")
    cache.start_request("b", [9, 4, 5])
    assert cache.speculate("b", [9, 4, 5], max_tokens=4, max_spec_factor=4).token_ids == [6, 7]
    cache.stop_request("b")
    cache.clear()
    assert cache.cached_requests == []
    cache.start_request("c", [9, 4, 5])
    assert cache.speculate("c", [9, 4, 5], max_tokens=4, max_spec_factor=4).token_ids == []


def test_request_trees_have_their_own_depth(tmp_path) -> None:
    # a 50-token repeat: the global tree (depth 64) matches all of it, a request tree only 32 tokens
    text = list(range(100, 150))
    cache = SuffixCache()
    assert (cache.max_depth, cache.request_depth) == (64, None)
    cache.start_request("r", text + [7] + text[:40])
    assert cache._requests["r"].tree.max_depth == 32
    draft = cache.speculate("r", text + [7] + text[:40], max_tokens=64, max_spec_factor=4.0)
    assert draft.token_ids[:10] == text[40:]  # the match is cut at 32 tokens, still enough to draft the rest
    assert SuffixCache(max_depth=8)._request_depth == 8  # never deeper than the global tree by default
    assert SuffixCache(request_depth=64)._request_depth == 64
    deep = SuffixCache(max_depth=40, request_depth=16)
    deep.save(tmp_path / "c.bin")
    assert SuffixCache.load(tmp_path / "c.bin").request_depth == 16
    for bad in (1, 2.5, "32"):
        with pytest.raises(ValueError, match="request_depth"):
            SuffixCache(request_depth=bad)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixCache(max_depth=1)


@pytest.mark.parametrize("setting, value", [("max_spec_factor", float("nan")), ("max_spec_factor", float("inf")),
                                            ("max_spec_offset", float("nan")), ("max_spec_offset", float("inf")),
                                            ("max_spec_offset", float("-inf"))])
def test_a_draft_budget_that_is_not_a_finite_number_is_refused(setting, value) -> None:
    """NaN or inf in the budget rule floor(m * max_spec_factor + max_spec_offset) drafted nothing, silently."""
    from thinkahead.token_spec.drafters import CombinedDrafter, SuffixDrafter

    cache = SuffixCache()
    cache.start_request("a", [1, 2, 3, 1, 2, 3])
    message = f"{setting} must be a finite number"
    for call in (lambda: cache.speculate("a", [1, 2, 3, 1, 2], max_tokens=4, **{setting: value}),
                 lambda: cache.speculate_batch([("a", [1, 2, 3, 1, 2])], max_tokens=4, **{setting: value}),
                 lambda: cache.speculate_sources("a", [1, 2, 3, 1, 2], max_tokens=4, **{setting: value}),
                 lambda: SuffixDrafter(cache, **{setting: value}), lambda: CombinedDrafter(cache, **{setting: value})):
        with pytest.raises(ValueError, match=message):
            call()
    assert cache.speculate("a", [1, 2, 3, 1, 2], max_tokens=4, max_spec_offset=-1.0).token_ids == [3]


@pytest.mark.parametrize("max_tokens", [2**31, 2**62, -1, True, 2.0])
def test_a_draft_budget_beyond_a_c_int_or_not_an_integer_is_refused(max_tokens) -> None:
    """2**62 reached the native tree and raised pybind's dump of its signature."""
    cache = SuffixCache()
    cache.start_request("a", [1, 2, 3, 1, 2, 3])
    with pytest.raises(ValueError, match=r"max_tokens must be an integer from 0 to 2147483647"):
        cache.speculate("a", [1, 2, 3, 1, 2], max_tokens=max_tokens)


@pytest.mark.parametrize("prompt, message", [
    ([1, True], "must hold integer token ids, found a bool"),
    ((1, False), "must hold integer token ids, found a bool"),
    (iter([1, True]), "must hold integer token ids, found a bool"),
    ("numpy-2d", "must be a 1-D sequence of token ids, got a 2-D ndarray"),  # raised StopIteration
    ("numpy-bool", "must hold integer token ids, found a bool"),
    ([1, 2.5], "must hold integer token ids, found 2.5"),
    ([2**64], "must hold token ids below 2\\*\\*63"),  # an OverflowError in the native tree
])
def test_token_ids_that_are_not_integers_are_refused_by_name(prompt, message) -> None:
    import numpy as np

    prompt = {"numpy-2d": np.array([[1, 2], [3, 4]]), "numpy-bool": np.array([True, False])}.get(prompt, prompt) \
        if isinstance(prompt, str) else prompt
    cache = SuffixCache()
    with pytest.raises(ValueError, match=f"prompt_ids {message}"):
        cache.start_request("a", prompt)
    cache.start_request("b", np.array([1, 2, 3]))  # a 1-D array is a sequence of ids
    with pytest.raises(ValueError, match="token_ids must hold integer token ids, found a bool"):
        cache.extend("b", [4, True])
