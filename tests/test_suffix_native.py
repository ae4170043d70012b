"""The native suffix tree against the Python reference: the same trees, matches and drafts, bit for bit.

Random sequences over small vocabularies (much repetition: splits, merges, ties) and large ones
(wide nodes, count orders after removals) are appended, extended token by token, finished and
removed in random orders; after every step both trees must agree on their counters, on the match
lengths of random contexts and on every draft (tokens, parents, probabilities, scores, match length).
Caches built on either tree must draft the same through sessions and save/load round trips, and
their files load under the other implementation.
"""

from __future__ import annotations

import logging
import random

import pytest

from thinkahead.token_spec import suffix_impl
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.suffix_tree import SuffixTree

native = pytest.importorskip("thinkahead.token_spec._suffix_native")


def same_draft(a: Draft, b: Draft) -> None:
    assert (a.token_ids, a.parents, a.probs, a.score, a.match_len, a.source) == (
        b.token_ids, b.parents, b.probs, b.score, b.match_len, b.source
    )


def check_drafts(py: SuffixTree, nt, rng: random.Random, vocab: int, pool: list[list[int]]) -> None:
    for _ in range(3):
        if pool and rng.random() < 0.7:  # a context that ends inside stored text
            src = rng.choice(pool)
            cut = rng.randrange(1, len(src) + 1)
            context = src[max(0, cut - rng.randrange(1, 2 * py.max_depth)):cut]
        else:
            context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        pp, npos = py.match_positions(context), nt.match_positions(context)
        assert len(pp) == len(npos)
        params = dict(
            max_tokens=rng.choice([1, 4, 16, 40]),
            max_spec_factor=rng.choice([0.5, 1.0, 2.5, 8.0]),
            max_spec_offset=rng.choice([-1.0, 0.0, 3.0, 8.0]),
            min_token_prob=rng.choice([0.0, 0.05, 0.1, 0.3]),
        )
        for tree in (False, True):
            same_draft(py.speculate(pp, tree=tree, **params), nt.speculate(npos, tree=tree, **params))
        if len(pp) > 1:  # incremental matching agrees with matching from scratch
            token = rng.randrange(vocab)
            a, b = py.advance_positions(pp, token), nt.advance_positions(npos, token)
            assert len(a) == len(b)
            same_draft(py.speculate(a, 8, 2.0, 1.0, 0.1, True), nt.speculate(b, 8, 2.0, 1.0, 0.1, True))



class Twins:
    """A Python and a native tree driven by the same operations, and the sequences they hold."""

    def __init__(self, depth: int) -> None:
        self.py, self.nt = SuffixTree(depth), native.SuffixTree(depth)
        self.live: dict[int, list[int]] = {}
        self.done: dict[int, list[int]] = {}
        self.next_id = 0

    def add(self, seq: list[int]) -> None:  # a whole finished sequence
        self.py.add(self.next_id, seq)
        self.nt.add(self.next_id, seq)
        self.done[self.next_id] = seq
        self.next_id += 1

    def extend(self, sid: int | None, new: list[int]) -> None:  # sid None: a new live sequence
        if sid is None:
            sid, self.next_id = self.next_id, self.next_id + 1
            self.live[sid] = []
        self.py.extend(sid, new)
        self.nt.extend(sid, new)
        self.live[sid] += new

    def finish(self, rng: random.Random) -> None:
        sid = rng.choice(list(self.live))
        self.py.finish(sid)
        self.nt.finish(sid)
        self.done[sid] = self.live.pop(sid)

    def remove(self, rng: random.Random) -> None:
        sid = rng.choice(list(self.done))
        self.py.remove(sid)
        self.nt.remove(sid)
        del self.done[sid]


def run_global(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 20, 300])
    depth = rng.choice([2, 4, 8, 16])
    twins = Twins(depth)
    py, nt = twins.py, twins.nt
    motif = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]

    def tokens(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:  # repeated motifs make shared, compressed and re-split edges
            out.extend(motif if rng.random() < 0.3 else [rng.randrange(vocab)])
        return out[:n]

    for _ in range(steps):
        op = rng.random()
        if op < 0.35:
            twins.add(tokens(rng.randrange(1, 40)))
        elif op < 0.6:
            sid = rng.choice(list(twins.live)) if twins.live and rng.random() < 0.7 else None
            twins.extend(sid, tokens(rng.randrange(1, 6)))
        elif op < 0.7 and twins.live:
            twins.finish(rng)
        elif twins.done:
            twins.remove(rng)
        assert (py.num_nodes, py.num_tokens, py.version, py._order_entries) == (
            nt.num_nodes, nt.num_tokens, nt.version, nt._order_entries
        )
        check_drafts(py, nt, rng, vocab, list(twins.done.values()) + list(twins.live.values()))
    for sid, seq in {**twins.done, **twins.live}.items():
        assert nt.tokens(sid) == seq == py.tokens(sid)


def run_request(seed: int, length: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([2, 4, 16, 1000])
    depth = rng.choice([3, 8, 32])
    py, nt = SuffixTree(depth), native.SuffixTree(depth)
    seq: list[int] = []
    while len(seq) < length:
        chunk = seq[-rng.randrange(1, 30):] if seq and rng.random() < 0.4 else [rng.randrange(vocab)]
        chunk = chunk[: rng.randrange(1, len(chunk) + 1)]
        py.extend(0, chunk)
        nt.extend(0, chunk)
        seq.extend(chunk)
        assert (py.num_nodes, py.num_tokens) == (nt.num_nodes, nt.num_tokens)
        pp, npos = py.live_positions(0), nt.live_positions(0)
        assert len(pp) == len(npos)
        budget = rng.choice([1, 8, 40])
        same_draft(py.recent_draft(pp, budget), nt.recent_draft(npos, budget))
        same_draft(py.recent_draft(pp, budget, 3), nt.recent_draft(npos, budget, 3))
        count = rng.choice([1, 3])
        assert py.recent_alternatives(pp, budget, count) == nt.recent_alternatives(npos, budget, count)
        same_draft(py.speculate(pp, budget, 8.0, 8.0, 0.05, True), nt.speculate(npos, budget, 8.0, 8.0, 0.05, True))
        same_draft(py.speculate(pp, budget), nt.speculate(npos, budget))
    check_drafts(py, nt, rng, vocab, [seq])


@pytest.mark.parametrize("block", range(4))
def test_global_trees_agree(block: int) -> None:
    for seed in range(block * 60, block * 60 + 60):
        run_global(seed, 60)


@pytest.mark.parametrize("block", range(2))
def test_request_trees_agree(block: int) -> None:
    for seed in range(block * 60, block * 60 + 60):
        run_request(seed, 150)


def test_wide_nodes_and_count_orders_agree() -> None:
    """Many short sequences over a large vocabulary: wide nodes, hash indexes, count orders on removal."""
    rng = random.Random(7)
    py, nt = SuffixTree(4), native.SuffixTree(4)
    seqs = {}
    for i in range(3000):
        seqs[i] = [rng.randrange(400) for _ in range(rng.randrange(1, 8))]
        py.add(i, seqs[i])
        nt.add(i, seqs[i])
        if i > 300 and rng.random() < 0.8:
            victim = rng.choice(list(seqs))
            py.remove(victim)
            nt.remove(victim)
            del seqs[victim]
        if i % 50 == 0:
            assert (py.num_nodes, py._order_entries) == (nt.num_nodes, nt._order_entries)
            check_drafts(py, nt, rng, 400, list(seqs.values()))
    assert py._order_entries > 0  # the count orders were exercised
    assert (py.num_nodes, py._order_entries) == (nt.num_nodes, nt._order_entries)


def structure(tree: SuffixTree) -> tuple:
    """The reference tree as the native `_structure()` gives it: per node (edge tokens, count, last, prev,
    position of `best` among the children, [children in order], count order as [(count, [positions])])."""

    def walk(node) -> tuple:
        kids = list(node.children.values()) if node.children else []
        at = {id(c): i for i, c in enumerate(kids)}
        best = at[id(node.best)] if node.best is not None else -1
        order = tree._orders.get(node)
        if order is not None:
            order = tuple((k, tuple(at[id(c)] for c in order.groups[k])) for k in sorted(order.groups))
        edge = tuple(node.seq[node.start:node.start + node.length])
        return (edge, node.count, node.last, node.prev, best, tuple(walk(c) for c in kids), order)

    return walk(tree.root)


def as_tuples(x):
    return tuple(as_tuples(y) for y in x) if isinstance(x, (list, tuple)) else x


@pytest.mark.parametrize("block", range(2))
def test_trees_agree_node_for_node(block: int) -> None:
    """Both trees node for node (counts, `best`, children order, count orders) after every step.

    A motif repeated inside and across sequences makes long shared edges that end in wide nodes:
    appending walks through them (a split, then the merge back, which the native tree does the
    other way round when the lower node is wide), with several live sequences and removals between.
    """
    for seed in range(block * 25, block * 25 + 25):
        rng = random.Random(seed)
        vocab = rng.choice([2, 3, 50, 400])
        depth = rng.choice([3, 4, 8, 16])
        twins = Twins(depth)
        py, nt = twins.py, twins.nt
        motif = [rng.randrange(vocab) for _ in range(rng.randrange(2, 10))]
        for _ in range(150):
            op = rng.random()
            if op < 0.5:
                seq: list[int] = []
                while len(seq) < rng.randrange(2, 30):
                    seq += motif if rng.random() < 0.5 else [rng.randrange(vocab)]
                if twins.live and rng.random() < 0.5:
                    twins.extend(rng.choice(list(twins.live)), seq)
                else:
                    twins.add(seq)
            elif op < 0.6:
                twins.extend(None, [rng.randrange(vocab)])
            elif op < 0.65 and twins.live:
                twins.finish(rng)
            elif twins.done:
                twins.remove(rng)
            assert (py.num_nodes, py._order_entries) == (nt.num_nodes, nt._order_entries)
            assert structure(py) == as_tuples(nt._structure()), seed
        for sid in twins.live:  # the live sequences' cursors, through the drafts they give
            pp, npos = py.live_positions(sid), nt.live_positions(sid)
            assert len(pp) == len(npos)
            same_draft(py.speculate(pp, 8, 2.0, 1.0, 0.1, True), nt.speculate(npos, 8, 2.0, 1.0, 0.1, True))


@pytest.mark.slow
def test_trees_agree_at_length() -> None:
    for seed in range(1000, 1600):
        run_global(seed, 150)
    for seed in range(2000, 2200):
        run_request(seed, 600)


# ------------------------------------------------------------------------------------------- caches


def drive(cache: SuffixCache, rng: random.Random, rounds: int) -> list[tuple]:
    """A random workload of requests, sessions and drafts; returns every draft's fields."""
    out: list[tuple] = []
    vocab = 12
    convo: dict[int, list[int]] = {}
    for r in range(rounds):
        session = rng.randrange(4) if rng.random() < 0.6 else None
        if session is not None and session in convo and rng.random() < 0.8:
            prompt = convo[session] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        cache.start_request(r, prompt, session_id=session)
        context = list(prompt)
        for _ in range(rng.randrange(1, 6)):
            tree = rng.random() < 0.5
            d = cache.speculate(r, context, max_tokens=8, max_spec_factor=2.0, max_spec_offset=1.0, tree=tree)
            out.append((d.token_ids, d.parents, d.probs, d.score, d.match_len, d.source))
            for src, d in sorted(cache.speculate_sources(r, context, max_tokens=12).items()):
                out.append((src, d.token_ids, d.parents, d.probs, d.score, d.match_len))
            new = d.token_ids[: rng.randrange(0, 4)] + [rng.randrange(vocab)]
            cache.extend(r, new)
            context.extend(new)
        cache.stop_request(r)
        if session is not None:
            convo[session] = context
        out.append(tuple(cache.cached_requests))
    return out


def test_caches_agree_through_sessions_and_files(tmp_path) -> None:
    for seed in range(6):
        kw = dict(max_depth=12, max_cached_requests=15, max_memory_bytes=None, max_sessions=3)
        py, nt = SuffixCache(tree_impl="python", **kw), SuffixCache(tree_impl="native", **kw)
        assert suffix_impl.is_native(nt.global_tree) and not suffix_impl.is_native(py.global_tree)
        assert drive(py, random.Random(seed), 40) == drive(nt, random.Random(seed), 40)
        py.save(tmp_path / "py.bin")
        nt.save(tmp_path / "nt.bin")
        assert (tmp_path / "py.bin").read_bytes() == (tmp_path / "nt.bin").read_bytes()
        # A file written under one implementation loads under the other and drafts the same.
        a = SuffixCache.load(tmp_path / "py.bin", tree_impl="native")
        b = SuffixCache.load(tmp_path / "nt.bin", tree_impl="python")
        assert suffix_impl.is_native(a.global_tree) and not suffix_impl.is_native(b.global_tree)
        assert a.global_tree.num_nodes == b.global_tree.num_nodes == py.global_tree.num_nodes
        assert drive(a, random.Random(seed + 100), 15) == drive(b, random.Random(seed + 100), 15)


def test_batched_drafts_equal_one_at_a_time() -> None:
    rng = random.Random(3)
    for impl in ("python", "native"):
        cache = SuffixCache(max_depth=16, tree_impl=impl)
        for r in range(30):
            cache.start_request(("old", r), [1, 2, 3])
            cache.extend(("old", r), [rng.randrange(6) for _ in range(30)])
            cache.stop_request(("old", r))
        contexts = {r: [rng.randrange(6) for _ in range(rng.randrange(1, 50))] for r in range(64)}
        for r, ctx in contexts.items():
            cache.start_request(r, ctx)
        for tree in (False, True):
            batch = cache.speculate_batch(list(contexts.items()), max_tokens=7, tree=tree)
            for r, ctx in contexts.items():
                one = cache.speculate(r, ctx, max_tokens=7, tree=tree)
                same_draft(batch[r], one)
        assert any(len(d) for d in batch) and {d.source for d in batch} >= {"suffix-global", "suffix-local"}


# ----------------------------------------------------------------------------------------- fallback


def test_fallback_to_python_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.delenv(suffix_impl.ENV_VAR, raising=False)
    monkeypatch.setattr(suffix_impl, "NATIVE_MODULE", "thinkahead.token_spec._no_such_extension")
    suffix_impl._reset()
    try:
        with caplog.at_level(logging.WARNING, logger=suffix_impl.__name__):
            first, second = SuffixCache(), SuffixCache()
        assert first.tree_impl == second.tree_impl == "python"
        assert isinstance(first.global_tree, SuffixTree)
        warnings = [r for r in caplog.records if r.name == suffix_impl.__name__]
        assert len(warnings) == 1 and "_no_such_extension" in warnings[0].getMessage()
        monkeypatch.setenv(suffix_impl.ENV_VAR, "native")
        with pytest.raises(ValueError, match="THINKAHEAD_SUFFIX_IMPL=native.*_no_such_extension"):
            SuffixCache()
    finally:
        suffix_impl._reset()


def test_env_var_picks_the_implementation(monkeypatch) -> None:
    monkeypatch.setenv(suffix_impl.ENV_VAR, "python")
    assert SuffixCache().tree_impl == "python"
    monkeypatch.setenv(suffix_impl.ENV_VAR, "native")
    assert SuffixCache().tree_impl == "native"
    assert not isinstance(SuffixCache().global_tree, SuffixTree)
    monkeypatch.delenv(suffix_impl.ENV_VAR)
    assert SuffixCache().tree_impl == "native"  # the default where the extension loads
    monkeypatch.setenv(suffix_impl.ENV_VAR, "rust")
    with pytest.raises(ValueError, match="THINKAHEAD_SUFFIX_IMPL must be one of"):
        SuffixCache()


def test_native_tree_is_three_times_smaller_and_invisible_to_the_gc() -> None:
    import gc

    rng = random.Random(5)
    responses = [[rng.randrange(8000) if rng.random() < 0.5 else rng.randrange(50) for _ in range(120)]
                 for _ in range(300)]
    sizes = {}
    for impl in ("python", "native"):
        cache = SuffixCache(max_depth=32, max_cached_requests=-1, max_memory_bytes=None, tree_impl=impl)
        gc.collect()
        before = len(gc.get_objects())
        for rid, response in enumerate(responses):
            cache._insert(rid, response)
        gc.collect()
        sizes[impl] = (cache.estimated_bytes, len(gc.get_objects()) - before)
    assert sizes["python"][0] >= 2.8 * sizes["native"][0], sizes  # 2.88x here: 8,000 distinct ids, 36k tokens
    assert sizes["native"][1] < 50 < sizes["python"][1], sizes  # no Python object per node


def test_sglang_corpus_drafts_a_whole_batch_in_one_call(monkeypatch) -> None:
    from thinkahead.token_spec.backends.sglang_suffix import SuffixCorpus, SuffixSettings, draft_row

    rng = random.Random(11)
    cache = SuffixCache(max_depth=16, tree_impl="native")
    for r in range(20):
        cache._insert(("old", r), [rng.randrange(5) for _ in range(40)])
    corpus = SuffixCorpus(cache, 6, SuffixSettings(max_depth=16, tree=True))
    prompts = {f"r{i}": [rng.randrange(5) for _ in range(rng.randrange(2, 30))] for i in range(16)}
    for rid, prompt in prompts.items():
        corpus.begin(rid, prompt)
    expected = []
    for rid, prompt in prompts.items():  # one request at a time, as the plugin used to
        draft = cache.speculate(rid, prompt, max_tokens=5, max_spec_factor=corpus.settings.max_spec_factor,
                                max_spec_offset=corpus.settings.max_spec_offset,
                                min_token_prob=corpus.settings.min_token_prob, tree=True)
        expected.extend(draft_row(prompt[-1], draft, 6)[0])
    calls = []
    batch = cache.speculate_batch
    monkeypatch.setattr(cache, "speculate", lambda *a, **k: pytest.fail("drafted one request at a time"))
    monkeypatch.setattr(cache, "speculate_batch", lambda *a, **k: calls.append(len(a[0])) or batch(*a, **k))
    tokens, _ = corpus.batch_get(list(prompts), [p[-4:] for p in prompts.values()], [len(p) for p in prompts.values()])
    assert calls == [16] and tokens.tolist() == expected


def test_the_sglang_plugins_tree_setting_does_not_pick_the_implementation(monkeypatch) -> None:
    """THINKAHEAD_SUFFIX_TREE=0|1 is the SGLang plugin's tree-draft switch: caches still build on either tree."""
    from thinkahead.token_spec.backends.sglang_suffix import SuffixSettings

    monkeypatch.setenv("THINKAHEAD_SUFFIX_TREE", "0")
    monkeypatch.setenv(suffix_impl.ENV_VAR, "python")
    settings = SuffixSettings.from_env()
    assert settings.tree is False and settings.build_cache().tree_impl == "python"
    monkeypatch.setenv(suffix_impl.ENV_VAR, "native")
    assert settings.build_cache().tree_impl == "native"


@pytest.mark.parametrize("prefer", ["first", "recent"])
def test_prompt_lookup_native_index_drafts_as_the_dict_index(monkeypatch, prefer: str) -> None:
    """PromptLookupDrafter with the native n-gram index against its Python dict index: the same drafts
    through sessions (a kept index extended by the next turn), foreign contexts and every n-gram range."""
    from thinkahead.token_spec.drafters import PromptLookupDrafter
    from thinkahead.token_spec.verify import SamplingParams

    params = SamplingParams()
    for seed in range(40):
        rng = random.Random(seed)
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 4)
        vocab = rng.choice([2, 5, 30])
        nt = PromptLookupDrafter(max_ngram=max_n, min_ngram=min_n, prefer=prefer)
        py = PromptLookupDrafter(max_ngram=max_n, min_ngram=min_n, prefer=prefer)
        monkeypatch.setattr(py, "_new_index", dict)
        assert not isinstance(nt._new_index(), dict)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        for turn in range(3):
            rid = (seed, turn)
            for d in (nt, py):
                d.start(rid, prompt, params, session_id=seed)
            context = list(prompt)
            for _ in range(25):
                budget = rng.choice([0, 1, 4, 16])
                a, b = nt.propose(rid, context, budget), py.propose(rid, context, budget)
                same_draft(a, b)
                foreign = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
                same_draft(nt.propose(rid, foreign, 8), py.propose(rid, foreign, 8))
                new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
                for d in (nt, py):
                    d.observe(rid, new, a)
                context += new
            for d in (nt, py):
                d.finish(rid)
            prompt = context + [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
