"""Speculative greedy decoding is token-identical to plain greedy decoding (float32)."""

from __future__ import annotations

import random

import pytest
import torch

from thinkahead.token_spec.controller import AdaptiveController, FixedController, MatchLengthController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.drafters import (
    DraftModelDrafter,
    HybridDrafter,
    PromptLookupDrafter,
    SuffixDrafter,
)
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.verify import SamplingParams

from tests.tiny_models import ARCHS, VOCAB


class Recording:
    """Wraps a drafter and remembers every draft it proposed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.model_free = inner.model_free
        self.drafts: list[Draft] = []

    def start(self, rid, prompt, params, session_id=None):
        self.inner.start(rid, prompt, params, session_id=session_id)

    def propose(self, rid, context, budget):
        d = self.inner.propose(rid, context, budget)
        self.drafts.append(d)
        return d

    def observe(self, rid, accepted, proposed):
        self.inner.observe(rid, accepted, proposed)

    def finish(self, rid):
        self.inner.finish(rid)


def repetitive_prompt(seed: int, length: int = 36) -> list[int]:
    rng = random.Random(seed)
    phrases = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 7))] for _ in range(4)]
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases)
    return out[:length]


def assert_suffix_speculation_is_exact(engine, tree: bool, seeds: int = 2) -> None:
    """Speculative greedy with the suffix drafter (chain or tree) equals plain greedy on `seeds`
    repetitive prompts, twice per prompt (the second pass drafts the whole answer from the global
    tree), and drafts are kept."""
    cache = SuffixCache(max_depth=24)
    decoder = SpeculativeDecoder(engine, SuffixDrafter(cache, tree=tree, min_token_prob=0.05), FixedController(6))
    accepted = 0
    for seed in range(seeds):
        prompt = repetitive_prompt(seed)
        reference = plain_greedy(engine, prompt, 40)
        if tree:
            seed_divergent_outputs(cache, reference, seed)
        for _ in range(2):
            result = decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[])
            assert result.token_ids == reference
            accepted += result.stats.spec_num_correct_drafts
    assert accepted > 0


def make_drafter(kind: str, draft_engine):
    if kind == "suffix":
        return SuffixDrafter(SuffixCache(max_depth=24))
    if kind == "suffix-tree":
        return SuffixDrafter(SuffixCache(max_depth=24), tree=True, min_token_prob=0.05)
    if kind == "prompt-lookup":
        return PromptLookupDrafter()
    if kind == "draft-model":
        return DraftModelDrafter(draft_engine)
    if kind == "hybrid":
        return HybridDrafter(SuffixDrafter(SuffixCache(max_depth=24)), DraftModelDrafter(draft_engine))
    raise AssertionError(kind)


def seed_divergent_outputs(cache: SuffixCache, reference: list[int], seed: int) -> None:
    """Earlier outputs that agree with the answer only in parts, so tree drafts branch."""
    rng = random.Random(seed)
    for k in range(3):
        variant = list(reference)
        for i in rng.sample(range(len(variant)), 6):
            variant[i] = rng.randrange(3, VOCAB)
        rid = f"variant-{seed}-{k}"
        cache.start_request(rid, [1])
        cache.extend(rid, variant)
        cache.stop_request(rid)


DRAFTERS = ["suffix", "suffix-tree", "prompt-lookup", "draft-model", "hybrid"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_equivalence_every_drafter(arch, kind, tiny_engine_factory) -> None:
    engine = tiny_engine_factory(arch)
    # the draft model is the same architecture with other weights: it agrees only sometimes
    draft_engine = tiny_engine_factory(arch, seed=1)
    drafter = Recording(make_drafter(kind, draft_engine))
    decoder = SpeculativeDecoder(engine, drafter, FixedController(6))
    accepted = 0
    for seed in range(3):  # later requests draft from earlier outputs (global suffix tree)
        prompt = repetitive_prompt(seed)
        reference = plain_greedy(engine, prompt, 40)
        if kind == "suffix-tree":
            seed_divergent_outputs(drafter.inner.cache, reference, seed)
        result = decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[])
        assert result.token_ids == reference
        assert result.finish_reason == "length"
        accepted += result.stats.spec_num_correct_drafts
        # the same prompt again: the global tree now holds the whole answer
        again = decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[])
        assert again.token_ids == reference
        accepted += again.stats.spec_num_correct_drafts
    assert accepted > 0, "no draft token was ever accepted: the test would not exercise rollback"
    if kind == "suffix-tree":
        assert any(not d.is_chain for d in drafter.drafts), "no branching tree was verified"


@pytest.mark.parametrize("controller", [FixedController(4), MatchLengthController(8), AdaptiveController(8)])
def test_greedy_equivalence_every_controller(controller, tiny_engine_factory) -> None:
    engine = tiny_engine_factory("llama")
    decoder = SpeculativeDecoder(engine, SuffixDrafter(SuffixCache(max_depth=16)), controller)
    for seed in range(3):
        prompt = repetitive_prompt(seed + 10, 50)
        assert decoder.generate(prompt, 50, stop_token_ids=[]).token_ids == plain_greedy(engine, prompt, 50)


def test_plain_greedy_reference_matches_transformers_generate(tiny_model_factory, tiny_engine_factory) -> None:
    model = tiny_model_factory("qwen2")
    engine = tiny_engine_factory("qwen2")
    prompt = repetitive_prompt(3)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert out[0, len(prompt):].tolist() == plain_greedy(engine, prompt, 30)


def test_stop_tokens_and_stats(tiny_engine_factory) -> None:
    engine = tiny_engine_factory("llama")
    prompt = repetitive_prompt(5)
    reference = plain_greedy(engine, prompt, 30)
    stop = reference[12]
    first = reference.index(stop)
    decoder = SpeculativeDecoder(engine, SuffixDrafter(), FixedController(8))
    decoder.generate(prompt, 30, stop_token_ids=[])  # warm the global tree with the full answer
    result = decoder.generate(prompt, 30, stop_token_ids=[stop])
    assert result.token_ids == reference[: first + 1]
    assert result.finish_reason == "stop"
    s = result.stats
    assert s.completion_tokens == first + 1
    assert s.spec_num_correct_drafts <= s.spec_num_proposed_drafts
    assert s.spec_accept_length == pytest.approx(s.completion_tokens / s.spec_verify_ct)
    assert s.spec_verify_ct < s.completion_tokens  # the warm cache let rounds accept several tokens
    assert s.draft_time_s > 0 and s.total_time_s >= s.verify_time_s


def test_bad_arguments(tiny_engine_factory) -> None:
    decoder = SpeculativeDecoder(tiny_engine_factory("llama"), SuffixDrafter())
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate([], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([5, 6], 0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1, top_p=0)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("kind", ["plain", "suffix"])
def test_token_logprobs_are_the_models_own(kind, tiny_engine_factory) -> None:
    """Each output token's log-probability, read off the verify rows, equals the log-softmax of a
    fresh full forward over prompt + output at that position (also after a stop token cut)."""
    engine = tiny_engine_factory("qwen2")
    prompt = repetitive_prompt(3)
    drafter = None if kind == "plain" else SuffixDrafter(SuffixCache(max_depth=24))
    decoder = SpeculativeDecoder(engine, drafter)
    result = decoder.generate(prompt, max_new_tokens=24, stop_token_ids=[], logprobs=True)
    out = result.token_ids
    assert len(result.token_logprobs) == len(out) == 24
    unasked = decoder.generate(prompt, max_new_tokens=24, stop_token_ids=[])  # not asked for: none computed
    assert unasked.token_ids == out and unasked.token_logprobs == []
    full = torch.log_softmax(engine.logits_for_prefix(prompt + out), dim=-1)
    expected = [float(full[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]
    assert result.token_logprobs == pytest.approx(expected, abs=1e-4)
    stop = out[5]
    cut = decoder.generate(prompt, max_new_tokens=24, stop_token_ids=[stop], logprobs=True)
    assert cut.token_ids == out[: out.index(stop) + 1]
    assert cut.token_logprobs == pytest.approx(expected[: len(cut.token_ids)], abs=1e-4)
