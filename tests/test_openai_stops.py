"""Step boundaries on servers that never say which stop string ended a text (llama.cpp's OpenAI endpoint):
`OpenAIModel` streams such requests without server-side stops and cuts them itself (thinkahead/models/openai.py)."""

from __future__ import annotations

import time

from thinkahead.models.base import GenerationRequest

from tests.test_openai_model import make_model, run_model, server  # noqa: F401 - the fixture


def test_a_server_that_never_says_which_stop_ended_a_text_is_streamed_and_cut_client_side(server) -> None:
    """llama.cpp's OpenAI endpoint reports neither `stop_reason` nor `matched_stop`: the step loop must still
    know a step boundary ("\n\n") from the end of the answer (an end-of-text token) and from the length."""
    server.stop_field = None
    server.responder = lambda p: "Step 1: 6 * 7 = 42.\n\nStep 2: so the answer is 42. " + "More words. " * 40
    model = make_model(server)
    step = run_model(model, lambda m: m.generate(GenerationRequest(prompt="q", stop=["\n\n", "</s>"])))
    assert step.text == "Step 1: 6 * 7 = 42." and step.finish_reason == "stop" and step.matched_stop == "\n\n"
    sent = server.requests[-1]
    assert sent["stream"] is True and "stop" not in sent  # the server was not told the stops
    total = -(-len(server.responder({})) // server.chunk_chars)
    time.sleep(0.2)
    assert server.chunks_sent[-1] < total // 2  # the stream was closed at the boundary, not read to its end
    server.responder = lambda p: "The answer is 42."  # ends at an end-of-text token: no stop string
    end = run_model(model, lambda m: m.generate(GenerationRequest(prompt="q", stop=["\n\n"])))
    assert end.text == "The answer is 42." and end.finish_reason == "stop" and end.matched_stop is None
    server.responder = lambda p: "one two three four five"
    capped = run_model(model, lambda m: m.generate(GenerationRequest(prompt="q", stop=["\n\n"], max_new_tokens=2)))
    assert capped.text == "one two" and capped.finish_reason == "length" and capped.matched_stop is None
    server.chunk_chars = 1  # a stop string split over chunks
    step = run_model(model, lambda m: m.generate(GenerationRequest(prompt="q", stop=["</step>"])))
    assert step.text == "one two three four five" and step.matched_stop is None
    server.responder = lambda p: "ab</step>cd"
    step = run_model(model, lambda m: m.generate(GenerationRequest(prompt="q", stop=["</step>"])))
    assert step.text == "ab" and step.matched_stop == "</step>"
    assert not model.reports_stops


def test_first_stop_finds_the_earliest_stop_string() -> None:
    from thinkahead.models.openai import first_stop

    assert first_stop("a\n\nb</s>", ["</s>", "\n\n"]) == (1, "\n\n")
    assert first_stop("ab", ["x"]) is None and first_stop("xax", ["x"], start=1) == (2, "x")
    assert first_stop("a</s>", ["</s", "</s>"]) == (1, "</s>")
