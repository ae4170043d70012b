"""Token-by-token streaming under the server: the decoder's round callback, exact incremental
detokenisation (`TextStream`), `LocalModel.stream` (text, logprobs, cancellation) and the default
`LanguageModel.stream` of backends that cannot stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from thinkahead.models import ScriptedModel
from thinkahead.models.base import Completion, GenerationRequest, TextDelta
from thinkahead.models.local import LocalModel
from thinkahead.models.streaming import TextStream

QUESTION = [{"role": "user", "content": "w5 w6 w7 w8"}]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LocalModel(str(tiny_model_dir), dtype="float32", name="tiny")


def collect(model, request, **kw) -> tuple[list[TextDelta], Completion]:
    async def run():
        return [item async for item in model.stream(request, **kw)]

    items = asyncio.run(run())
    assert isinstance(items[-1], Completion) and all(isinstance(d, TextDelta) for d in items[:-1])
    return items[:-1], items[-1]


# ---------------------------------------------------------------------------------------------- TextStream

def utf8_stream(stops=(), stop_ids=frozenset()):
    """A byte-level 'tokenizer': token i is byte i, decoded as a real BPE decoder would (bad bytes -> U+FFFD)."""
    return TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), stops, stop_ids)


def feed(stream: TextStream, ids, final: str) -> list:
    pieces = [stream.push(ids[i:i + 1]) for i in range(len(ids))] + [stream.finish(final)]
    return [p for p in pieces if p is not None]


def test_text_stream_never_sends_half_a_character_and_concatenates_to_the_final_text():
    text = "naïve 日本 ok"
    ids = list(text.encode())
    pieces = feed(utf8_stream(), ids, text)
    assert "".join(p.text for p in pieces) == text
    assert all("\ufffd" not in p.text for p in pieces)
    assert [t for p in pieces for t in p.token_ids] == ids
    assert len(pieces) > 3  # it streams: not one piece at the end


def test_text_stream_holds_back_what_a_stop_string_may_cut():
    stream = utf8_stream(stops=["STOP"])
    sent = []
    for b in b"ab ST":
        piece = stream.push([b])
        sent.append(piece.text if piece else "")
    assert "".join(sent) == "ab"  # " ST" may be the start of "STOP": held back (the space too)
    piece = stream.push(list(b"Ox"))  # "ab STOx": no stop, all of it is text
    assert piece.text == " STOx"
    stream = utf8_stream(stops=["STOP"])
    pieces = feed(stream, list(b"ab STOP"), "ab ")
    assert "".join(p.text for p in pieces) == "ab "
    assert [t for p in pieces for t in p.token_ids] == list(b"ab STO")  # the completing token is no content


def test_text_stream_drops_the_stop_token_from_the_content_ids():
    pieces = feed(utf8_stream(stop_ids=frozenset({0})), [104, 105, 0], "hi\x00")
    assert [t for p in pieces for t in p.token_ids] == [104, 105]


# ---------------------------------------------------------------------------------------------- the decoder

@pytest.mark.parametrize("with_stop", [False, True])
def test_the_decoders_round_callback_sees_a_prefix_of_the_final_tokens(tiny, with_stop):
    prompt = tiny.encode(tiny.render(QUESTION))
    own = tiny.generate_sync(GenerationRequest(messages=QUESTION, max_new_tokens=30, temperature=0))
    words = own.text.split()
    stops = [f"{words[4]} {words[5]}"] if with_stop else []
    rounds: list[list[int]] = []
    result = tiny._speculative.generate(prompt, 30, stop_token_ids=tiny.stop_token_ids, stop_strings=stops,
                                        on_tokens=rounds.append)
    assert [t for r in rounds for t in r] == result.token_ids
    assert len(rounds) == result.stats.spec_verify_ct and all(rounds)
    if stops:
        assert result.matched_stop == stops[0] and result.text == " ".join(words[:4]) + " "


def test_a_callback_that_raises_stops_the_decoder_within_a_round(tiny):
    prompt = tiny.encode(tiny.render(QUESTION))
    seen = []

    def stop_after_two(ids):
        seen.append(ids)
        if len(seen) == 2:
            raise KeyboardInterrupt  # anything: the decoder frees its state and lets it through

    with pytest.raises(KeyboardInterrupt):
        tiny._plain.generate(prompt, 50, stop_token_ids=[], on_tokens=stop_after_two)
    assert len(seen) == 2
    again = tiny._plain.generate(prompt, 5, stop_token_ids=[])  # the decoder works on afterwards
    assert len(again.token_ids) == 5


# ---------------------------------------------------------------------------------------------- LocalModel.stream

@pytest.mark.parametrize("speculative", [True, False])
def test_local_stream_is_the_generation_piece_by_piece_with_its_logprobs(tiny, speculative):
    request = GenerationRequest(messages=QUESTION, max_new_tokens=24, temperature=0, speculative=speculative)
    own = tiny.generate_sync(request)
    deltas, completion = collect(tiny, request, top_logprobs=2)
    assert "".join(d.text for d in deltas) == own.text == completion.text
    assert completion.token_ids == own.token_ids and completion.finish_reason == own.finish_reason
    assert len(deltas) > 1
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == own.token_ids[:len(ids)] and len(ids) >= len(own.token_ids) - 1
    prompt = tiny.encode(tiny.render(QUESTION))
    expected = tiny.token_logprobs_sync(prompt + ids, len(prompt), 2)
    got = [t for d in deltas for t in d.logprobs]
    assert [t.token_id for t in got] == [t.token_id for t in expected]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in expected], abs=1e-5)
    assert [[a for a, _, _ in t.top] for t in got] == [[a for a, _, _ in t.top] for t in expected]


def test_local_stream_with_a_stop_string_sends_nothing_the_stop_cuts(tiny):
    words = tiny.generate_sync(GenerationRequest(messages=QUESTION, max_new_tokens=12, temperature=0)).text.split()
    request = GenerationRequest(messages=QUESTION, max_new_tokens=12, temperature=0, stop=[words[6]])
    own = tiny.generate_sync(request)
    deltas, completion = collect(tiny, request)
    assert "".join(d.text for d in deltas) == own.text == completion.text
    assert completion.matched_stop == words[6] and words[6] not in "".join(d.text for d in deltas)


def slow_forwards(model, delay_s: float):
    """Counts the engine's forwards and slows each down, and lets the model write on past its end-of-turn
    token (the tiny model ends greedy replies after ~11 tokens); returns the counter list."""
    model.stop_token_ids = []
    calls = []
    forward = model.engine.forward

    def slow(*args, **kwargs):
        calls.append(time.monotonic())
        time.sleep(delay_s)
        return forward(*args, **kwargs)

    model.engine.forward = slow
    return calls


def assert_stopped(calls: list[float], started: int) -> None:
    """The forwards since `started`: some ran, then none (400 tokens at 20 ms a forward would take 8 s)."""
    time.sleep(0.2)
    before = len(calls)
    time.sleep(0.3)
    assert len(calls) == before and started + 2 < before < started + 100


def test_closing_a_stream_or_cancelling_a_generation_stops_the_decoder(tiny_model_dir):
    model = LocalModel(str(tiny_model_dir), dtype="float32", name="tiny", drafter="none")
    calls = slow_forwards(model, 0.02)
    request = GenerationRequest(messages=QUESTION, max_new_tokens=400, temperature=0)

    async def read_three_then_leave():
        stream = model.stream(request)
        got = [await anext(stream) for _ in range(3)]
        await stream.aclose()
        return got

    assert [type(d) for d in asyncio.run(read_three_then_leave())] == [TextDelta] * 3
    assert_stopped(calls, 0)

    async def cancel_generate():
        task = asyncio.ensure_future(model.generate(request))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = len(calls)
    asyncio.run(cancel_generate())
    assert_stopped(calls, started)
    deadline = time.monotonic() + 2
    while model.scheduler.live and time.monotonic() < deadline:  # and the generation has left the batch
        time.sleep(0.01)
    assert model.scheduler.live == 0


def test_the_default_stream_yields_the_whole_text_once():
    model = ScriptedModel(outputs=["one two three"])
    deltas, completion = collect(model, GenerationRequest(prompt="q", max_new_tokens=8))
    assert [d.text for d in deltas] == ["one two three"] and completion.text == "one two three"
