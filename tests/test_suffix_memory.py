"""The suffix cache's memory cap and its eviction: default cap, honest estimate, cost per eviction."""

from __future__ import annotations

import gc
import itertools
import json
import random
import sys
import time
import tracemalloc
import types

import pytest

import thinkahead.token_spec.suffix_eviction as eviction
from thinkahead.token_spec.suffix_cache import DEFAULT_MAX_MEMORY_BYTES, SuffixCache
from thinkahead.token_spec.suffix_tree import SuffixTree


class Responses:
    """Agent-like responses: Zipf-distributed ids from a vocabulary of thousands, recurring phrases.

    Every token is a new int object, as a tokenizer's `.tolist()` hands them out.
    """

    def __init__(self, seed: int = 0, vocab: int = 4000, lengths: tuple[int, int] = (50, 200)) -> None:
        self.rng = random.Random(seed)
        self.lengths = lengths
        self.vocab = range(300, 300 + vocab)  # above CPython's small-int cache
        self.weights = list(itertools.accumulate(1.0 / (r + 1) for r in range(vocab)))
        self.phrases = [self.tokens(self.rng.randint(3, 20)) for _ in range(2000)]
        self.phrase_weights = list(itertools.accumulate(1.0 / (r + 1) ** 0.8 for r in range(len(self.phrases))))

    def tokens(self, k: int) -> list[int]:
        return self.rng.choices(self.vocab, cum_weights=self.weights, k=k)

    def __call__(self) -> list[int]:
        n = self.rng.randint(*self.lengths)
        out: list[int] = []
        while len(out) < n:
            if self.rng.random() < 0.6:
                out += self.rng.choices(self.phrases, cum_weights=self.phrase_weights, k=1)[0]
            else:
                out += self.tokens(1)
        return [t + 1 - 1 for t in out[:n]]  # fresh int objects


def deep_bytes(cache: SuffixCache) -> int:
    """What the global tree holds, object by object (sys.getsizeof): nodes, dicts, lists, ints, CountOrders."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str)
    seen: set[int] = set()
    total = 0
    stack: list[object] = [cache.global_tree, cache._cached]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip) or (type(obj) is int and -5 <= obj <= 256):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def fill(cache: SuffixCache, responses: Responses, count: int, cap: int, checks: int = 0) -> None:
    """Send `count` responses through the cache: its estimate respects `cap` after each one and,
    at `checks` points along the way, is within 15% of `deep_bytes`."""
    for i in range(count):
        output = responses()
        cache.start_request(i, [1, 2, 3])
        cache.extend(i, output)
        del output
        cache.stop_request(i)
        assert cache.estimated_bytes <= cap
        if checks and (i + 1) % (count // checks) == 0:
            held = deep_bytes(cache)
            assert 0.85 <= cache.estimated_bytes / held <= 1.15, (i, cache.estimated_bytes, held)


def test_default_memory_cap_suits_a_laptop_and_is_settable(tmp_path) -> None:
    assert DEFAULT_MAX_MEMORY_BYTES == 256 * 2**20
    assert SuffixCache().max_memory_bytes == DEFAULT_MAX_MEMORY_BYTES
    assert SuffixCache(max_memory_bytes=8 << 20).max_memory_bytes == 8 << 20
    assert SuffixCache(max_memory_bytes=None).max_memory_bytes is None  # no cap: count only
    cache = SuffixCache(max_memory_bytes=8 << 20)
    cache.save(tmp_path / "c.bin")
    assert SuffixCache.load(tmp_path / "c.bin").max_memory_bytes == 8 << 20
    uncapped = SuffixCache(max_memory_bytes=None)
    uncapped.save(tmp_path / "u.bin")
    assert SuffixCache.load(tmp_path / "u.bin").max_memory_bytes is None
    # a file from before the default (version 2, null cap) loads with the default
    header, payload = (tmp_path / "u.bin").read_bytes().split(b"\n", 1)
    old = json.loads(header)
    old["version"] = 2
    (tmp_path / "v2.bin").write_bytes(json.dumps(old).encode() + b"\n" + payload)
    assert SuffixCache.load(tmp_path / "v2.bin").max_memory_bytes == DEFAULT_MAX_MEMORY_BYTES


@pytest.mark.slow  # ~10 s: keeps `-m "not slow"` under 3 minutes; CI runs it
def test_memory_estimate_tracks_tracemalloc_and_the_cap_holds() -> None:
    """The Python tree's estimate against tracemalloc (the native tree counts its own arrays: test_suffix_native)."""
    count, cap = 800, 1 << 20
    responses = Responses(seed=1)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        cache = SuffixCache(request_depth=2, max_cached_requests=-1, max_memory_bytes=cap, tree_impl="python")
        fill(cache, responses, count, cap)
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - base  # every Python allocation the cache made
    finally:
        tracemalloc.stop()
    assert 20 < len(cache.cached_requests) < count // 4  # the cap bounded the cache, which turned over
    assert cache.estimated_bytes > 0.9 * cap  # and it was filled up to the cap
    assert 0.9 <= cache.estimated_bytes / measured <= 1.15, (cache.estimated_bytes, measured)
    # deep_bytes (what the slow test checks along the way) measures what tracemalloc does
    assert 0.95 <= deep_bytes(cache) / measured <= 1.05, (deep_bytes(cache), measured)


@pytest.mark.slow
def test_memory_cap_holds_over_100k_responses() -> None:
    # tracemalloc would slow 100k responses fivefold: deep_bytes measures the cache instead
    # short responses and a shallow tree keep it to about a minute; the cap is what is under test
    count, cap = 100_000, 2 << 20
    cache = SuffixCache(max_depth=16, request_depth=2, max_cached_requests=-1, max_memory_bytes=cap, tree_impl="python")
    fill(cache, Responses(seed=2, lengths=(20, 60)), count, cap, checks=20)
    assert 50 < len(cache.cached_requests) < 2000


def test_eviction_drops_the_oldest_responses_and_their_drafts() -> None:
    responses = Responses(seed=7, vocab=3000)
    cache = SuffixCache(max_depth=32, max_cached_requests=-1, max_memory_bytes=1 << 20)
    markers = {}
    for i in range(400):
        marker = [100 + (i % 150), 10_000 + i, 20_000 + i, 30_000 + i, 40_000 + i]  # unique to response i
        markers[i] = marker
        cache.start_request(i, [1, 2])
        cache.extend(i, responses()[:40] + marker + responses()[:40])
        cache.stop_request(i)
        assert cache.estimated_bytes <= 1 << 20
    kept = cache.cached_requests
    assert 10 < len(kept) < 400 and kept == list(range(400 - len(kept), 400))  # oldest first out
    cache.start_request("probe", [5])
    for i, marker in markers.items():
        draft = cache.speculate("probe", marker[:3], max_tokens=4, max_spec_factor=2.0)
        if i in kept:
            assert draft.token_ids[:2] == marker[3:5] and draft.source == "suffix-global"
        else:
            assert draft.token_ids[:2] != marker[3:5]
    # what stays is exactly a tree over the kept responses
    fresh = SuffixTree(32)
    for rid in kept:
        fresh.add(rid, cache.global_tree.tokens(cache._cached[rid]))
    assert fresh.num_tokens == cache.global_tree.num_tokens
    assert fresh.num_nodes == cache.global_tree.num_nodes


def walk(tree: SuffixTree):
    stack = [(tree.root, [])]
    while stack:
        node, path = stack.pop()
        yield node, path
        for child in (node.children or {}).values():
            stack.append((child, path + child.seq[child.start:child.start + child.length]))


def occurrences(seqs, pattern: list[int], depth: int) -> int:
    n = len(pattern)
    return sum(1 for s in seqs for j in range(len(s) - n + 1) if s[j:j + n] == pattern) if n <= depth else 0


@pytest.mark.parametrize("seed", range(12))
def test_removal_keeps_the_tree_exact(monkeypatch, seed: int) -> None:
    # small thresholds so that CountOrders are built, used and dropped on small trees
    monkeypatch.setattr(eviction, "WIDE_CHILDREN", 3)
    monkeypatch.setattr(eviction, "NARROW_CHILDREN", 2)
    rng = random.Random(seed)
    depth, vocab = rng.choice([(3, 6), (5, 12), (8, 4), (8, 12)])
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 6))] for _ in range(5)]
    tree, seqs, removed = SuffixTree(depth), {}, []
    for step in range(150):
        if seqs and rng.random() < 0.45:
            seq_id = min(seqs) if rng.random() < 0.7 else rng.choice(list(seqs))
            removed.append(tree.tokens(seq_id))
            tree.remove(seq_id)
            del seqs[seq_id]
        else:
            s: list[int] = []
            while len(s) < rng.randint(1, 25):
                s += rng.choice(phrases) if rng.random() < 0.6 else [rng.randrange(vocab)]
            tree.add(step, s)
            seqs[step] = s
        if step % 15 and step != 149:
            continue
        dead = {id(s) for s in removed}
        nodes = 0
        for node, path in walk(tree):
            nodes += 1
            if node is tree.root:
                continue
            assert node.count == occurrences(seqs.values(), path, depth) > 0  # every count is exact
            assert id(node.seq) not in dead  # no node keeps a removed response's tokens alive
            if node.children:
                assert node.best.count == max(c.count for c in node.children.values())
                assert len(node.children) > 1 or node.best.count < node.count  # path-compressed again
                order = tree._orders.get(node)
                if order is not None:
                    assert {c: c.count for c in node.children.values()} == {
                        c: count for count, group in order.groups.items() for c in group
                    }
            else:
                assert node.best is None and node not in tree._orders
        assert nodes == tree.num_nodes
        assert tree._order_entries == sum(len(order) for order in tree._orders.values())
    for seq_id in list(seqs):
        tree.remove(seq_id)
    assert tree.num_nodes == 1 and tree.root.count == 0 and not tree._orders


def test_eviction_cost_does_not_grow_with_the_tree() -> None:
    # 20,000 responses [7, t] give the root and node 7 20,000 children each; the probe response
    # makes 7 -> 8 node 7's most frequent child, so removing it lowers the best child's count at
    # the root and at node 7: the old code rescanned all 20,000 children at every such step.
    probe = [7, 8, 7, 8, 7, 8, 7, 8]

    def removal_time(tree: SuffixTree) -> float:
        best = float("inf")
        for k in range(15):
            tree.add(-1, probe)
            t0 = time.process_time()
            tree.remove(-1)
            best = min(best, time.process_time() - t0)
        return best

    small, big = SuffixTree(8), SuffixTree(8)
    for i in range(20):
        small.add(i, [7, 1000 + i])
    for i in range(20_000):
        big.add(i, [7, 1000 + i])
    small_s, big_s = removal_time(small), removal_time(big)
    assert big_s < 10 * small_s + 200e-6, (small_s, big_s)
