"""KV prefix reuse across generations, and stop strings in the decoder."""

from __future__ import annotations

import pytest

from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.drafters import SuffixDrafter
from thinkahead.token_spec.prefix_pool import KVPrefixPool
from thinkahead.token_spec.suffix_cache import SuffixCache

from tests.test_speculative_decoding import repetitive_prompt


class LetterTokenizer:
    """Token id -> one letter (ids 0-2 decode to a space), enough to test stop strings."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(" " if i < 3 else chr(ord("a") + i % 26) for i in ids)


def test_prefix_pool_reuses_kv_and_output_is_unchanged(tiny_engine_factory) -> None:
    engine = tiny_engine_factory("qwen2")
    pool = KVPrefixPool(engine, max_sessions=2)
    decoder = SpeculativeDecoder(engine, SuffixDrafter(SuffixCache()), FixedController(4), prefix_pool=pool)
    prompt = repetitive_prompt(5, 40)
    first = decoder.generate(prompt, 20, stop_token_ids=[])
    assert first.stats.cached_tokens == 0
    # the next "step": the prompt grows by the output and a few new tokens
    longer = prompt + first.token_ids + [7, 8, 9]
    second = decoder.generate(longer, 20, stop_token_ids=[])
    assert second.stats.cached_tokens == len(prompt) + len(first.token_ids) - 1
    assert second.token_ids == plain_greedy(engine, longer, 20)
    # an edited history shares only part of the prefix; the output is still exact
    edited = prompt[:10] + [5] + prompt[11:]
    third = decoder.generate(edited, 20, stop_token_ids=[])
    assert third.stats.cached_tokens == 10
    assert third.token_ids == plain_greedy(engine, edited, 20)
    assert pool.hits == 2


def test_prefix_pool_evicts_least_recently_used(tiny_engine_factory) -> None:
    engine = tiny_engine_factory("llama")
    pool = KVPrefixPool(engine, max_sessions=1)
    decoder = SpeculativeDecoder(engine, None, FixedController(0), prefix_pool=pool)
    a, b = repetitive_prompt(1, 30), repetitive_prompt(2, 30)
    decoder.generate(a, 5, stop_token_ids=[])
    decoder.generate(b, 5, stop_token_ids=[])  # evicts a's session
    assert decoder.generate(a + [4], 5, stop_token_ids=[]).stats.cached_tokens == 0
    with pytest.raises(ValueError, match="max_sessions"):
        KVPrefixPool(engine, max_sessions=0)


def test_stop_strings_cut_text_and_tokens(tiny_engine_factory) -> None:
    engine = tiny_engine_factory("llama")
    tokenizer = LetterTokenizer()
    prompt = repetitive_prompt(7, 30)
    reference = plain_greedy(engine, prompt, 30)
    text = tokenizer.decode(reference)
    stop = text[12:14]  # two letters the reference really produces
    end = text.find(stop) + len(stop)  # the stop completes at this character = token index
    decoder = SpeculativeDecoder(engine, SuffixDrafter(SuffixCache()), FixedController(6), tokenizer=tokenizer)
    decoder.generate(prompt, 30, stop_token_ids=[])  # warm the global tree: later drafts run past the stop
    result = decoder.generate(prompt, 30, stop_token_ids=[], stop_strings=[stop])
    assert result.finish_reason == "stop" and result.matched_stop == stop
    assert result.token_ids == reference[:end]
    assert result.text == text[: end - len(stop)]
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeDecoder(engine, None).generate(prompt, 5, stop_strings=["x"])


def test_a_stop_string_before_a_stop_token_in_the_same_round_still_ends_the_text(tiny_engine_factory) -> None:
    """One verify round may accept both a stop string and, after it, a stop token (an agent's reply
    seen before drafts whole): the text must end before the stop string, not run on to the token."""
    engine = tiny_engine_factory("llama")
    tokenizer = LetterTokenizer()
    prompt = repetitive_prompt(7, 30)
    reference = plain_greedy(engine, prompt, 30)
    text = tokenizer.decode(reference)
    stop = text[8:10]
    end = text.find(stop) + len(stop)
    # a token first produced right after the stop string completes: "...STOP<end of turn>"
    later = next(i for i in range(end, len(reference)) if reference[i] not in reference[:i])
    decoder = SpeculativeDecoder(engine, SuffixDrafter(SuffixCache()), FixedController(16), tokenizer=tokenizer)
    decoder.generate(prompt, 30, stop_token_ids=[])  # the global tree now drafts past both
    result = decoder.generate(prompt, 30, stop_token_ids=[reference[later]], stop_strings=[stop])
    assert result.stats.spec_verify_ct < end  # rounds did accept several tokens at once
    assert result.finish_reason == "stop" and result.matched_stop == stop
    assert result.token_ids == reference[:end]
    assert result.text == text[: end - len(stop)]


def test_prefix_pool_holds_at_most_its_token_budget(tiny_engine_factory) -> None:
    engine = tiny_engine_factory("llama")
    pool = KVPrefixPool(engine, max_sessions=8, max_tokens=25)
    prompts = [[3 + k] + list(range(10, 19)) for k in range(3)]  # 10 tokens each
    for p in prompts:
        session = engine.new_session()
        engine.forward(session, p)
        pool.release(session, p)
    assert pool.acquire(prompts[0] + [7])[1] == 0  # the oldest went: 30 tokens would pass 25
    assert pool.acquire(prompts[2] + [7])[1] == 10 and pool.acquire(prompts[1] + [7])[1] == 10
    with pytest.raises(ValueError, match="max_tokens"):
        KVPrefixPool(engine, max_tokens=0)


def test_the_default_kv_budget_is_a_share_of_free_memory_by_the_models_kv_bytes(tiny_model_factory) -> None:
    from thinkahead.models.local import kv_token_budget

    model = tiny_model_factory("qwen2")
    text = model.config
    per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * text.head_dim * 4
    budget = kv_token_budget(model, share=0.5)
    free = __import__("os").sysconf("SC_AVPHYS_PAGES") * __import__("os").sysconf("SC_PAGE_SIZE")
    assert abs(budget - free * 0.5 / per_token) / budget < 0.2  # free memory moves a little between the reads
    assert kv_token_budget(object(), 0.5) is None


def test_a_prompt_sharing_part_of_a_pooled_context_copies_it_and_the_context_stays_whole(tiny_engine_factory) -> None:
    engine = tiny_engine_factory("qwen2")
    pool = KVPrefixPool(engine, max_sessions=4)
    decoder = SpeculativeDecoder(engine, None, FixedController(0), prefix_pool=pool)
    template = repetitive_prompt(3, 8)  # a chat template's first tokens, shared by two runs
    a, b = template + repetitive_prompt(5, 40), template + repetitive_prompt(6, 40)
    first = decoder.generate(a, 10, stop_token_ids=[])
    other = decoder.generate(b, 10, stop_token_ids=[])  # run b's prompt matches the template only: a copy
    assert other.stats.cached_tokens == len(template) and other.token_ids == plain_greedy(engine, b, 10)
    # run a's next step finds its whole context (cut to the template, it would re-read 48 tokens)
    step = a + first.token_ids + [7, 8]
    again = decoder.generate(step, 10, stop_token_ids=[])
    assert again.stats.cached_tokens == len(a) + len(first.token_ids) - 1
    assert again.token_ids == plain_greedy(engine, step, 10)


def test_a_copied_prefix_holds_the_same_kv_and_the_original_is_unchanged(tiny_engine_factory) -> None:
    import torch

    engine = tiny_engine_factory("llama")
    ids = repetitive_prompt(4, 24)
    source = engine.new_session()
    engine.forward(source, ids)
    copy = engine.copy_prefix(source, 10)
    assert (copy.length, source.length) == (10, 24)
    for mine, theirs in zip(copy.cache.layers, source.cache.layers):
        assert torch.equal(mine.keys, theirs.keys[..., :10, :]) and torch.equal(mine.values, theirs.values[..., :10, :])
    engine.forward(copy, [9, 9, 9])  # appending to the copy leaves the source's K/V as they were
    assert torch.equal(source.cache.layers[0].keys[..., 10:13, :], engine.copy_prefix(source, 24).cache.layers[0].keys[
        ..., 10:13, :])
    with pytest.raises(ValueError, match=r"copy length must be an int in \[0, 24\], got 25"):
        engine.copy_prefix(source, 25)
