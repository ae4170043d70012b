"""The suffix tree against a brute-force n-gram count of the same sequences."""

from __future__ import annotations

import random

import pytest

from thinkahead.token_spec.suffix_tree import SuffixTree


def ngram_count(seqs: list[list[int]], pattern: list[int], depth: int) -> int:
    """Occurrences of `pattern` in the stored suffixes (each cut at `depth`)."""
    if len(pattern) > depth:
        return 0
    n = len(pattern)
    return sum(1 for s in seqs for j in range(len(s) - n + 1) if s[j:j + n] == pattern)


def continuations(seqs, pattern, depth) -> dict[int, int]:
    out: dict[int, int] = {}
    if len(pattern) + 1 > depth:
        return out
    for s in seqs:
        for j in range(len(s) - len(pattern)):
            if s[j:j + len(pattern)] == pattern:
                t = s[j + len(pattern)]
                out[t] = out.get(t, 0) + 1
    return out


def check_chain(seqs, context_tail, draft, depth, min_prob):
    """The draft follows a most frequent continuation at every step, with exact probabilities."""
    s = list(context_tail)
    prob = 1.0
    for tok, p in zip(draft.token_ids, draft.probs):
        cont = continuations(seqs, s, depth)
        assert cont, "drafted past the end of the tree"
        assert cont[tok] == max(cont.values()), "not a most frequent continuation"
        prob *= cont[tok] / ngram_count(seqs, s, depth)
        assert p == pytest.approx(prob)
        assert p >= min_prob
        s.append(tok)
    return s


def random_corpus(rng: random.Random, n_seqs: int, vocab: int, length: int) -> list[list[int]]:
    """Sequences with lots of shared phrases, like repeated agent outputs."""
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 8))] for _ in range(6)]
    seqs = []
    for _ in range(n_seqs):
        s: list[int] = []
        while len(s) < length:
            s.extend(rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(vocab)])
        seqs.append(s[:length])
    return seqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth", [4, 9])
def test_counts_match_brute_force(seed: int, depth: int) -> None:
    rng = random.Random(seed)
    seqs = random_corpus(rng, 5, vocab=5, length=30)
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        # grow online in random chunk sizes, as a decoder would
        pos = 0
        while pos < len(s):
            k = rng.randint(1, 4)
            tree.extend(i, s[pos:pos + k])
            pos += k
        if rng.random() < 0.5:
            tree.finish(i)
    for _ in range(200):
        s = rng.choice(seqs)
        j = rng.randrange(len(s))
        pattern = s[j:j + rng.randint(1, depth)]
        positions = tree.match_positions(pattern)
        # every tail of the pattern that occurs is matched, with the right count
        for m in range(1, len(pattern) + 1):
            expected = ngram_count(seqs, pattern[-m:], depth)
            if m <= len(positions):
                node, _ = positions[m - 1]
                assert node.count == expected
            elif m < depth:
                assert expected == 0


@pytest.mark.parametrize("seed", range(8))
def test_chain_and_tree_drafts_follow_frequencies(seed: int) -> None:
    rng = random.Random(seed)
    depth = 8
    seqs = random_corpus(rng, 6, vocab=6, length=40)
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.add(i, s)
    for _ in range(60):
        s = rng.choice(seqs)
        j = rng.randrange(2, len(s))
        context = s[:j]
        positions = tree.match_positions(context)
        draft = tree.speculate(positions, max_tokens=6, min_token_prob=0.2)
        if draft.token_ids:
            m = draft.match_len
            assert 1 <= m <= len(positions)
            assert len(draft.token_ids) <= min(6, m)
            check_chain(seqs, context[-m:], draft, depth, 0.2)
            assert draft.parents == list(range(-1, len(draft) - 1))
            assert draft.score == pytest.approx(sum(draft.probs))
        tdraft = tree.speculate(positions, max_tokens=6, min_token_prob=0.2, tree=True)
        assert tdraft.score >= draft.score - 1e-9  # a tree can only add probability mass
        for i, (tok, par, p) in enumerate(zip(tdraft.token_ids, tdraft.parents, tdraft.probs)):
            assert par < i
            path = [tok]
            while par >= 0:
                path.append(tdraft.token_ids[par])
                par = tdraft.parents[par]
            path.reverse()
            base = context[-tdraft.match_len:]
            expected = ngram_count(seqs, base + path, depth) / ngram_count(seqs, base, depth)
            assert p == pytest.approx(expected)
            assert p >= 0.2


def test_budget_follows_match_length() -> None:
    tree = SuffixTree(64)
    tree.add(0, list(range(100, 140)))
    # context matches 3 tokens: budget = floor(3 * 1.0 + 0) = 3
    d = tree.speculate(tree.match_positions([7, 100, 101, 102]), max_tokens=16)
    assert d.token_ids == [103, 104, 105] and d.match_len == 3 and d.probs == [1.0] * 3
    d = tree.speculate(tree.match_positions([7, 100, 101, 102]), max_tokens=16, max_spec_factor=2.0, max_spec_offset=1)
    assert d.token_ids == list(range(103, 110))
    d = tree.speculate(tree.match_positions(list(range(100, 130))), max_tokens=16)
    assert d.token_ids == list(range(130, 140))  # runs out of stored text
    assert tree.speculate(tree.match_positions([1, 2, 3]), max_tokens=16).token_ids == []


def test_probabilities_and_min_token_prob() -> None:
    tree = SuffixTree(16)
    for i in range(3):
        tree.add(i, [1, 2, 3, 4])
    tree.add(3, [1, 2, 9, 9])
    d = tree.speculate(tree.match_positions([1, 2]), max_tokens=8)
    assert d.token_ids == [3, 4]
    assert d.probs == pytest.approx([0.75, 0.75])
    d = tree.speculate(tree.match_positions([1, 2]), max_tokens=8, min_token_prob=0.8)
    assert d.token_ids == []
    t = tree.speculate(tree.match_positions([1, 2]), max_tokens=8, max_spec_factor=2.0, tree=True)
    assert sorted(zip(t.token_ids, t.parents)) == [(3, -1), (4, 0), (9, -1), (9, 2)]


def test_remove_restores_counts() -> None:
    rng = random.Random(3)
    seqs = random_corpus(rng, 6, vocab=4, length=25)
    depth = 6
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.add(i, s)
    nodes_all = tree.num_nodes
    for i in (1, 4, 0):
        tree.remove(i)
    kept = [s for i, s in enumerate(seqs) if i not in (1, 4, 0)]
    fresh = SuffixTree(depth)
    for i, s in enumerate(kept):
        fresh.add(i, s)
    for s in kept:
        for j in range(len(s)):
            pattern = s[j:j + depth]
            pos = tree.match_positions(pattern)
            assert len(pos) == len(fresh.match_positions(pattern))
            for m, (node, _) in enumerate(pos, start=1):
                assert node.count == ngram_count(kept, pattern[-m:], depth)
    assert tree.num_nodes < nodes_all
    for i in (2, 3, 5):
        tree.remove(i)
    assert tree.num_nodes == 1 and tree.root.count == 0 and not tree.root.children


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(1)
    tree = SuffixTree(8)
    tree.add(0, [1, 2])
    with pytest.raises(ValueError, match="already"):
        tree.add(0, [3])
    with pytest.raises(ValueError, match="finished"):
        tree.extend(0, [3])
    with pytest.raises(ValueError, match="not in the tree"):
        tree.remove(7)
    tree.extend(1, [5])
    with pytest.raises(ValueError, match="live"):
        tree.remove(1)


def test_interleaved_live_sequences_keep_their_cursors_through_merges() -> None:
    """A merge while another sequence is live moves that sequence's cursor: its text stays matchable.

    Sequence 1 repeating sequence 0's "1 0" merges the node sequence 0's cursor sat at into its parent;
    the cursor used to stay on the detached node, so sequence 0's later tokens went nowhere.
    """
    tree = SuffixTree(4)
    tree.extend(0, [1, 0])
    tree.extend(1, [1, 0])
    tree.extend(2, [1])
    tree.extend(0, [0])
    tree.extend(2, [0])
    assert len(tree.match_positions([1, 0, 0])) == 3
    fresh = SuffixTree(4)
    for seq_id, tokens in ((0, [1, 0, 0]), (1, [1, 0]), (2, [1, 0])):
        fresh.add(seq_id, tokens)
    assert tree.num_nodes == fresh.num_nodes
