"""The combined drafter: merged anisotropic trees, online per-source rates, lossless greedy decoding."""

from __future__ import annotations

import random

import pytest

from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.drafters import CombinedDrafter, SourceRate, followed, merge_drafts
from thinkahead.token_spec.draft_head import DraftHead
from thinkahead.token_spec.names import HEAD_KIND
from thinkahead.token_spec.presets import DRAFTER_KINDS, build_decoder
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.suffix_tree import SuffixTree
from thinkahead.token_spec.verify import SamplingParams

from tests.test_speculative_decoding import Recording, repetitive_prompt, seed_divergent_outputs
from tests.tiny_models import ARCHS, VOCAB

GREEDY = SamplingParams()


def test_merge_gives_the_trusted_source_a_deep_chain() -> None:
    chain = Draft.chain([10, 11, 12])
    branches = Draft(token_ids=[10, 20], parents=[-1, -1], probs=[0.5, 0.5])
    merged = merge_drafts([(chain, 0.8), (branches, 0.5)], budget=8)
    # 10 is proposed by both: 1 - (1 - 0.8)(1 - 0.5 * 0.5) = 0.85; the chain goes on at 0.8^d
    assert merged.token_ids == [10, 11, 12, 20]
    assert merged.parents == [-1, 0, 1, -1]
    assert merged.probs == pytest.approx([0.85, 0.64, 0.512, 0.25])
    assert merged.score == pytest.approx(sum(merged.probs))
    assert merged.source == "combined"
    assert merge_drafts([(chain, 0.8), (branches, 0.5)], budget=3).token_ids == [10, 11, 12]


def test_merge_widens_near_the_root_when_the_chain_is_unsure() -> None:
    chain = Draft.chain([10, 11, 12], match_len=4)
    branches = Draft(token_ids=[10, 20], parents=[-1, -1], probs=[0.5, 0.5], match_len=2)
    merged = merge_drafts([(chain, 0.5), (branches, 0.5)], budget=3)
    # 11 (0.5^2) and 20 (0.5 * 0.5) tie: the shallower node comes first
    assert (merged.token_ids, merged.parents) == ([10, 20, 11], [-1, -1, 0])
    assert merged.probs == pytest.approx([0.625, 0.25, 0.25])
    assert merged.match_len == 4
    assert not merged.is_chain


def test_merge_keeps_parents_before_children_and_drops_worthless_nodes() -> None:
    odd = Draft(token_ids=[1, 2, 3], parents=[-1, 0, 1], probs=[0.2, 0.9, 0.05])  # a child claiming more
    merged = merge_drafts([(odd, 1.0)], budget=5, min_score=0.1)
    assert (merged.token_ids, merged.parents) == ([1, 2], [-1, 0])
    assert merged.probs == pytest.approx([0.2, 0.2])
    assert merge_drafts([(odd, 0.0)], budget=5).token_ids == []  # a source with rate 0 adds nothing
    assert merge_drafts([(odd, 1.0)], budget=0).token_ids == []
    # duplicates across sources collapse into one node
    twice = merge_drafts([(Draft.chain([4, 5]), 0.5), (Draft.chain([4, 5]), 0.5)], budget=5)
    assert (twice.token_ids, twice.parents) == ([4, 5], [-1, 0])
    assert twice.probs == pytest.approx([0.75, 1 - 0.75 ** 2])


def test_followed_counts_hits_and_only_observed_misses() -> None:
    assert followed(Draft.chain([1, 2, 3]), [1, 2, 9]) == (2, 1)
    assert followed(Draft.chain([1, 2, 3]), [1, 2]) == (2, 0)  # verified tokens ran out
    assert followed(Draft.chain([1, 2, 3]), [1, 2, 3, 4]) == (3, 0)  # the draft ran out
    tree = Draft(token_ids=[1, 5, 2, 6], parents=[-1, -1, 0, 1], probs=[1.0] * 4)
    assert followed(tree, [5, 6, 7]) == (2, 0)
    assert followed(tree, [5, 7]) == (1, 1)
    assert followed(Draft(), [1]) == (0, 0)


def test_source_rate_is_discounted_hits_over_tries() -> None:
    rate = SourceRate(hits=1.0, tries=2.0)
    rate.update(3, 1, decay=0.5)
    assert (rate.hits, rate.tries) == (3.5, 5.0)
    assert rate.rate == pytest.approx(0.7)


def sources_of(drafter: CombinedDrafter, rid, context, budget) -> dict[str, Draft]:
    return drafter.cache.speculate_sources(
        rid, context, budget, drafter.max_spec_factor, drafter.max_spec_offset, drafter.min_token_prob,
        alternatives=drafter.alternatives,
    )


def test_recent_source_prefers_the_latest_copy() -> None:
    drafter = CombinedDrafter(SuffixCache(max_depth=8))
    prompt = [1, 2, 3, 10, 11, 50, 1, 2, 3, 20, 21, 60, 1, 2, 3]
    drafter.start("r", prompt, GREEDY)
    sources = sources_of(drafter, "r", prompt, 6)
    assert sources["recent"].token_ids == [20, 21, 60, 1, 2, 3]
    assert sources["recent"].match_len == 3
    draft = drafter.propose("r", prompt, 6)
    # no evidence yet: every source is rated at the prior 0.5
    expected = merge_drafts([(sources[s], 0.5) for s in ("recent", "alt", "local", "global")], 6)
    assert (draft.token_ids, draft.parents, draft.probs) == (expected.token_ids, expected.parents, expected.probs)
    assert draft.token_ids[0] == 20 and draft.parents[0] == -1
    assert draft.parents[draft.token_ids.index(10)] == -1  # the older continuation is a branch at the root


def test_alternatives_come_from_other_recent_copies() -> None:
    cache = SuffixCache(max_depth=8)
    text = [1, 2, 3, 4, 30, 8, 3, 4, 77, 1, 2, 3, 4]
    cache.start_request("r", text)
    sources = cache.speculate_sources("r", text, 5, alternatives=3)
    assert sources["recent"].token_ids == [30, 8, 3, 4, 77]  # after the latest 1 2 3 4
    assert sources["alt"].token_ids == [77, 1, 2, 3, 4]  # after the latest 3 4 that is not part of it
    assert sources["alt"].parents == [-1, 0, 1, 2, 3] and sources["alt"].match_len == 2
    assert cache.speculate_sources("r", text, 5, alternatives=0)["alt"].token_ids == []


def brute_recent(seq: list[int], depth: int, k: int, count: int):
    """The longest tail (< depth) with an earlier occurrence: its latest copy, then the alternatives' copies."""
    n = len(seq)
    seen: list[int] = []
    chains = []
    for m in range(min(n, depth - 1), 0, -1):
        tail = seq[n - m:]
        ends = [e for e in range(n - 1, m - 2, -1) if seq[e - m + 1:e + 1] == tail][:2]  # two most recent
        for e in ends:
            if e + 1 < n and e not in seen:
                seen.append(e)
                chains.append((m, seq[e + 1:e + 1 + k]))
    return chains[:1], chains[1:1 + count]


@pytest.mark.parametrize("seed", range(40))
def test_recent_copies_match_a_brute_force_search(seed: int) -> None:
    rng = random.Random(seed)
    depth, vocab = rng.choice([3, 5, 8, 16]), rng.choice([2, 3, 6, 20])
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    seq: list[int] = []
    while len(seq) < rng.randint(5, 120):
        seq += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(vocab)]
    tree = SuffixTree(depth)
    for i in range(len(seq)):
        tree.extend(0, seq[i:i + 1])
        k, count = rng.randint(1, 9), rng.randint(0, 4)
        positions = tree.live_positions(0)
        primary, alternatives = brute_recent(seq[:i + 1], depth, k, count)
        draft = tree.recent_draft(positions, k)
        assert [(draft.match_len, draft.token_ids)] == primary or (not primary and not draft.token_ids)
        assert tree.recent_alternatives(positions, k, count) == alternatives


def test_rates_are_learned_per_session_and_pooled_for_new_ones() -> None:
    cache = SuffixCache(max_depth=16)
    for rid, answer in (("earlier", list(range(100, 130))), ("earlier-2", list(range(200, 230)))):
        cache.start_request(rid, [1])
        cache.extend(rid, answer)
        cache.stop_request(rid)
    drafter = CombinedDrafter(cache, sources=("recent", "global"))
    # the prompt's own copy of 100 101 102 says 7; the earlier output says 103
    prompt = [100, 101, 102, 7, 7, 7, 7, 100, 101, 102]
    drafter.start("t1", prompt, GREEDY, session_id="agent")
    first = drafter.propose("t1", prompt, 4)
    assert first.token_ids[0] == 7  # no evidence yet: a tie, the recent copy first
    assert first.parents[first.token_ids.index(103)] == -1
    drafter.observe("t1", [103, 104, 105, 106], first)  # the target followed the earlier output
    rates = drafter.rates("t1")
    assert rates["recent@2"] < 0.5 < rates["global@2"]  # matches of 2-3 tokens (this one is 3)
    drafter.finish("t1")
    # the session's next turn: the same disagreement on other tokens; the session now trusts the global tree
    turn2 = prompt + [103, 104, 105, 106] + [200, 201, 202, 8, 8, 8, 8, 200, 201, 202]
    drafter.start("t2", turn2, GREEDY, session_id="agent")
    assert drafter.cache.session_stats.session_extends == 1
    second = drafter.propose("t2", turn2, 8)
    assert second.token_ids[:4] == [203, 204, 205, 206] and second.parents[:4] == [-1, 0, 1, 2]
    assert second.parents[second.token_ids.index(8)] == -1  # the distrusted source still gets a branch, later
    # a new session starts from the pooled rates, weighted lightly
    drafter.start("other", turn2, GREEDY)
    assert drafter.rates("other") == {}
    drafter.propose("other", turn2, 4)
    fresh = drafter._live["other"].rates["global@2"]
    pooled = drafter.pooled["global@2"]
    assert fresh.rate == pytest.approx(pooled.rate)
    assert fresh.tries == pytest.approx(min(drafter.prior_weight, pooled.tries))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="sources"):
        CombinedDrafter(sources=("recent", "oracle"))
    with pytest.raises(ValueError, match="decay"):
        CombinedDrafter(decay=0.0)
    with pytest.raises(ValueError, match="match_bands"):
        CombinedDrafter(match_bands=(4, 2))
    with pytest.raises(ValueError, match="not started"):
        CombinedDrafter().propose("nobody", [1], 4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_greedy_equivalence_every_preset(arch, kind, tiny_engine_factory) -> None:
    """Every registered drafter kind, as the CLI builds it, decodes exactly as plain greedy."""
    engine = tiny_engine_factory(arch)
    cache = SuffixCache(max_depth=24)
    head = DraftHead(engine.model.config.hidden_size, 8, engine.vocab_size // 2) if kind == HEAD_KIND else None
    decoder = build_decoder(kind, engine, draft_engine=tiny_engine_factory(arch, seed=1), cache=cache, max_draft=8,
                            draft_head=head)
    for seed in range(2):
        prompt = repetitive_prompt(seed)
        reference = plain_greedy(engine, prompt, 40)
        for _ in range(2):  # the second time, earlier outputs are in the global tree
            result = decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[])
            assert result.token_ids == reference


@pytest.mark.parametrize("arch", ARCHS)
def test_combined_trees_verify_losslessly(arch, tiny_engine_factory) -> None:
    engine = tiny_engine_factory(arch)
    drafter = Recording(CombinedDrafter(SuffixCache(max_depth=24)))
    decoder = SpeculativeDecoder(engine, drafter, FixedController(8))
    accepted = 0
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        reference = plain_greedy(engine, prompt, 40)
        seed_divergent_outputs(drafter.inner.cache, reference, seed)
        for _ in range(2):
            result = decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[])
            assert result.token_ids == reference
            accepted += result.stats.spec_num_correct_drafts
    assert accepted > 0
    assert any(not d.is_chain for d in drafter.drafts), "no branching tree was verified"
    assert any(len(d) == 8 for d in drafter.drafts)


def test_multi_turn_session_through_the_decoder(tiny_engine_factory) -> None:
    engine = tiny_engine_factory("qwen2")
    cache = SuffixCache(max_depth=24)
    decoder = SpeculativeDecoder(engine, CombinedDrafter(cache), FixedController(6))
    rng = random.Random(4)
    prompt = repetitive_prompt(7)
    for turn in range(3):
        result = decoder.generate(prompt, max_new_tokens=30, stop_token_ids=[], session_id="agent-1")
        assert result.token_ids == plain_greedy(engine, prompt, 30)
        prompt = prompt + result.token_ids + [rng.randrange(3, VOCAB) for _ in range(5)]
    s = cache.session_stats
    assert (s.session_starts, s.session_extends, s.session_rebuilds) == (1, 2, 0)
    assert s.extended_tokens == 2 * 5  # the outputs are already in the tree: only the new messages
