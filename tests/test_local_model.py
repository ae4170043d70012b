"""`LocalModel` on the real SmolLM2-135M (float32): the LanguageModel contract end to end."""

from __future__ import annotations

import asyncio
import math

import pytest

from thinkahead.models import GenerationRequest, LocalModel

pytestmark = pytest.mark.slow

QUESTION = "List the numbers from 1 to 12, one per line, then list them again in reverse order."


@pytest.fixture(scope="module")
def local(smollm2_fp32):
    model, tokenizer = smollm2_fp32
    return LocalModel(model=model, tokenizer=tokenizer, dtype="float32", name="smollm2")


def test_speculative_and_plain_generation_agree(local) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    plain = asyncio.run(local.generate(GenerationRequest(messages=messages, max_new_tokens=60, speculative=False)))
    spec = asyncio.run(local.generate(GenerationRequest(messages=messages, max_new_tokens=60)))
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.completion_tokens == len(spec.token_ids) > 0
    assert spec.spec.spec_verify_ct < spec.completion_tokens  # drafts were accepted
    assert spec.cached_tokens > 0  # the second call reused the first call's prompt KV
    assert spec.model == "smollm2" and spec.finish_reason in ("stop", "length")


def test_stop_strings_and_continuing_a_partial_assistant_message(local) -> None:
    partial = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "1\n2\n3\n"}]
    prompt = local.render(partial, continue_final=True)
    assert prompt.endswith("1\n2\n3\n")
    out = asyncio.run(local.generate(GenerationRequest(messages=partial, continue_final=True, max_new_tokens=30, stop=["\n"])))
    assert out.finish_reason == "stop" and out.matched_stop == "\n"
    assert "\n" not in out.text and out.text.strip() == "4"
    with pytest.raises(ValueError, match="assistant"):
        local.render([{"role": "user", "content": "hi"}], continue_final=True)


def test_next_token_logprobs(local) -> None:
    prompt = local.render([{"role": "user", "content": "Reply with one digit: what is 2 + 2?"}])
    top = asyncio.run(local.next_token_logprobs(prompt, top_k=5))
    assert 1 <= len(top) <= 5
    values = list(top.values())
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    again = asyncio.run(local.next_token_logprobs(prompt, top_k=5))  # served from the prefix pool
    assert again.keys() == top.keys()
    assert all(abs(again[k] - top[k]) < 1e-4 for k in top)
    with pytest.raises(ValueError, match="top_k"):
        asyncio.run(local.next_token_logprobs(prompt, top_k=0))


def test_continuation_scores_mark_where_the_model_disagrees(local) -> None:
    prompt = local.render([{"role": "user", "content": QUESTION}])
    own = asyncio.run(local.generate(GenerationRequest(prompt=prompt, max_new_tokens=12, speculative=False))).text
    scores = asyncio.run(local.continuation_scores(prompt, own))
    assert "".join(t.text for t in scores) == own
    assert all(t.gap == 0.0 and t.top_text == t.text for t in scores)  # its own greedy text: every token is its top choice
    logprobs = asyncio.run(local.continuation_logprobs(prompt, own))
    assert [round(t.logprob, 5) for t in scores] == [round(lp, 5) for lp in logprobs]
    edited = own.replace("1", "7", 1) if "1" in own else own + " 7"
    edited_scores = asyncio.run(local.continuation_scores(prompt, edited))
    at = max(range(len(edited_scores)), key=lambda i: edited_scores[i].gap)
    worst = edited_scores[at]
    assert "7" in worst.text and worst.gap > 1.0  # the edited digit is what the model objects to
    before = "".join(t.text for t in edited_scores[:at])
    assert own.startswith(before + worst.top_text)  # its own token there: the one we edited away


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="drafter"):
        LocalModel("smollm2-135m", drafter="draft-model")
    with pytest.raises(ValueError, match="either"):
        LocalModel()


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, True, 1.5])
def test_a_seed_that_is_not_a_64_bit_integer_is_refused_by_the_request(seed):
    """2**70 reached torch's generator deep in the decoder: 'Overflow when unpacking long long'."""
    from thinkahead.models.base import GenerationRequest

    with pytest.raises(ValueError, match="seed must be a 64-bit integer"):
        GenerationRequest(prompt="w5", seed=seed)
    assert GenerationRequest(prompt="w5", seed=2**64 - 1).seed == 2**64 - 1
