"""Tests for step segmentation (`thinkahead.step_spec.segment`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from thinkahead.step_spec.segment import (
    MAX_STEP_TOKENS,
    THINK_CLOSE,
    SegmentConfig,
    Step,
    cut_step,
    has_final_answer,
    is_repeated,
    join_steps,
    split_steps,
    stop_strings,
    strip_think_tags,
)

DELIM = SegmentConfig()
SENT = SegmentConfig(mode="sentence")

TRACE = (
    "Let me set up the equation.\n\n"
    "We have 2x + 3 = 11, so 2x = 8.\n\n"
    "\n"  # a stray extra newline: it starts the next step
    "Thus x = 4. Check: 2*4 + 3 = 11.\n\n"
    "So the answer is \\boxed{4}."
)


# --- config -------------------------------------------------------------------------------------


def test_config_defaults() -> None:
    assert DELIM.mode == "delimiter"
    assert DELIM.delimiter == "\n\n"
    assert DELIM.max_step_tokens == MAX_STEP_TOKENS == 128
    assert DELIM.min_step_chars == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"delimiter": ""}, "delimiter"),
        ({"max_step_tokens": 0}, "max_step_tokens"),
        ({"max_step_tokens": -5}, "max_step_tokens"),
        ({"min_step_chars": -1}, "min_step_chars"),
        ({"mode": "paragraph"}, "mode"),
        ({"delimeter": "\n"}, "delimeter"),  # misspelt: extra fields are forbidden
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        SegmentConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    assert [err["loc"] for err in info.value.errors()] == [(field,)]
    assert field in str(info.value)


def test_stop_strings() -> None:
    assert stop_strings(DELIM) == ["\n\n", THINK_CLOSE]
    assert stop_strings(SegmentConfig(delimiter="###")) == ["###", THINK_CLOSE]
    sentence = stop_strings(SENT)
    assert sentence[-1] == THINK_CLOSE
    assert {". ", ".\n", "? ", "! ", "\n"} <= set(sentence)
    assert "\n\n" not in sentence


# --- delimiter mode -----------------------------------------------------------------------------


def test_delimiter_cut_keeps_delimiter_and_rest() -> None:
    generated = "First, expand the square.\n\nThen collect terms.\n\nMore"
    step = cut_step(generated, DELIM, hit_token_cap=False)
    assert step == Step(
        text="First, expand the square.\n\n", kind="step", rest="Then collect terms.\n\nMore"
    )
    assert step.consumed + step.rest == generated


def test_stop_string_at_end_leaves_empty_rest() -> None:
    step = cut_step("Expand the square.\n\n", DELIM, hit_token_cap=False)
    assert (step.text, step.kind, step.rest) == ("Expand the square.\n\n", "step", "")


def test_custom_delimiter() -> None:
    step = cut_step("a step### next", SegmentConfig(delimiter="###"), hit_token_cap=False)
    assert (step.text, step.rest) == ("a step###", " next")


def test_round_trip_cutting_repeatedly() -> None:
    texts: list[str] = []
    kinds: list[str] = []
    remaining = TRACE
    while remaining:
        step = cut_step(remaining, DELIM, hit_token_cap=False)
        assert step.consumed + step.rest == remaining
        texts.append(step.text)
        kinds.append(step.kind)
        remaining = step.rest
    assert "".join(texts) == TRACE
    assert join_steps(texts) == TRACE
    assert texts[2] == "\nThus x = 4. Check: 2*4 + 3 = 11.\n\n"
    assert kinds == ["step", "step", "step", "final"]
    assert [s.text for s in split_steps(TRACE, DELIM)] == texts


def test_round_trip_sentence_mode() -> None:
    steps = split_steps(TRACE, SENT)
    assert "".join(s.consumed for s in steps) == TRACE
    assert len(steps) > len(split_steps(TRACE, DELIM))


def test_round_trip_through_end_of_thinking() -> None:
    text = "Step one.\n\nStep two.</think>The answer is 4."
    steps = split_steps(text, DELIM)
    assert [s.kind for s in steps] == ["step", "end_think"]
    assert "".join(s.consumed for s in steps) + steps[-1].rest == text
    assert steps[-1].rest == "The answer is 4."
    assert split_steps("", DELIM) == []


# --- token cap ----------------------------------------------------------------------------------


def test_truncated_at_token_cap() -> None:
    generated = "We keep expanding the product term by term and"
    step = cut_step(generated, DELIM, hit_token_cap=True)
    assert (step.text, step.kind, step.rest) == (generated, "truncated", "")
    # The same text without the cap: the model stopped (or the backend trimmed the stop string).
    assert cut_step(generated, DELIM, hit_token_cap=False).kind == "step"


def test_cap_hit_after_a_boundary_is_a_normal_step() -> None:
    step = cut_step("One step.\n\nThe next one runs on and", DELIM, hit_token_cap=True)
    assert (step.text, step.kind) == ("One step.\n\n", "step")
    assert step.rest == "The next one runs on and"


# --- final answers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "So the result is \\boxed{42}.",
        "Hence $\\boxed {x+1}$",
        "Answer: 42",
        "We are done.\nFinal answer: 7",
        "**Final Answer:** 7",
        "  answer: yes",
    ],
)
def test_has_final_answer(text: str) -> None:
    assert has_final_answer(text)


@pytest.mark.parametrize(
    "text",
    ["The answer: we still need the sum.", "We want the final answer soon.", "boxed in", ""],
)
def test_no_final_answer(text: str) -> None:
    assert not has_final_answer(text)


def test_final_step_is_cut_at_its_delimiter() -> None:
    step = cut_step("Thus \\boxed{4}.\n\nWait, let me double-check.", DELIM, hit_token_cap=False)
    assert (step.text, step.kind) == ("Thus \\boxed{4}.\n\n", "final")
    assert step.rest == "Wait, let me double-check."
    assert cut_step("Answer: 4\n\n", DELIM, hit_token_cap=False).kind == "final"
    # The answer in the rest does not make the step final.
    assert cut_step("Almost there.\n\nAnswer: 4", DELIM, hit_token_cap=False).kind == "step"


# --- </think> -----------------------------------------------------------------------------------


def test_end_think_at_start() -> None:
    step = cut_step("</think>\n\nThe answer is 4.", DELIM, hit_token_cap=False)
    assert step == Step(text="", kind="end_think", rest="\n\nThe answer is 4.", ends_thinking=True)
    assert step.consumed == THINK_CLOSE


def test_end_think_in_the_middle() -> None:
    generated = "So x = 4 works.</think>\n\nThe answer is 4.\n\nDone."
    step = cut_step(generated, DELIM, hit_token_cap=False)
    assert (step.text, step.kind, step.ends_thinking) == ("So x = 4 works.", "end_think", True)
    assert step.rest == "\n\nThe answer is 4.\n\nDone."
    assert step.consumed + step.rest == generated


def test_end_think_after_a_blank_line_joins_the_step() -> None:
    step = cut_step("So x = 4 works.\n\n</think>ok", DELIM, hit_token_cap=False)
    assert (step.text, step.kind, step.rest) == ("So x = 4 works.\n\n", "end_think", "ok")


def test_boundary_before_end_think_wins() -> None:
    step = cut_step("First.\n\nSecond.</think>ok", DELIM, hit_token_cap=False)
    assert (step.text, step.kind, step.ends_thinking) == ("First.\n\n", "step", False)
    assert step.rest == "Second.</think>ok"


def test_final_answer_before_end_think() -> None:
    step = cut_step("So \\boxed{4}.</think>", DELIM, hit_token_cap=False)
    assert (step.kind, step.ends_thinking, step.text) == ("final", True, "So \\boxed{4}.")


def test_think_tags() -> None:
    step = cut_step("<think>Start here.\n\nNext", DELIM, hit_token_cap=False)
    assert step.text == "<think>Start here.\n\n"
    assert strip_think_tags("<think>a</think>b <think>c") == "ab c"


# --- sentence mode ------------------------------------------------------------------------------


def test_sentence_mode_skips_decimals_and_abbreviations() -> None:
    generated = "Pi is about 3.14 here, e.g. for unit circles, i.e. r = 1. Then we square it. Done."
    step = cut_step(generated, SENT, hit_token_cap=False)
    assert step.text == "Pi is about 3.14 here, e.g. for unit circles, i.e. r = 1. "
    assert step.rest == "Then we square it. Done."


def test_sentence_mode_other_ends() -> None:
    assert cut_step("Is it odd? Yes.", SENT, hit_token_cap=False).text == "Is it odd? "
    assert cut_step("Wow! Nice.", SENT, hit_token_cap=False).text == "Wow! "
    assert cut_step("x = 5\ny = 6", SENT, hit_token_cap=False).text == "x = 5\n"
    factorial = cut_step("So 5! = 120 here. Next", SENT, hit_token_cap=False)
    assert factorial.text == "So 5! = 120 here. "
    assert cut_step("1. Expand it. Then", SENT, hit_token_cap=False).text == "1. Expand it. "
    # A number ending a sentence still ends it.
    assert cut_step("Thus x = 3. Next", SENT, hit_token_cap=False).text == "Thus x = 3. "


def test_sentence_mode_stop_inside_abbreviation_keeps_whole_text() -> None:
    # The backend stopped at the stop string ". " of "e.g. ": no sentence end, nothing cut.
    step = cut_step("Take a prime, e.g. ", SENT, hit_token_cap=False)
    assert (step.text, step.kind, step.rest) == ("Take a prime, e.g. ", "step", "")


# --- empty steps --------------------------------------------------------------------------------


@pytest.mark.parametrize("generated", ["", "\n\n", "   \n", "\n\n\n\n"])
def test_empty_steps(generated: str) -> None:
    step = cut_step(generated, DELIM, hit_token_cap=False)
    assert (step.kind, step.text, step.rest) == ("empty", generated, "")
    assert cut_step(generated, DELIM, hit_token_cap=True).kind == "empty"


def test_leading_blank_line_is_not_a_step_boundary() -> None:
    step = cut_step("\n\nReal step.\n\nNext", DELIM, hit_token_cap=False)
    assert (step.text, step.kind, step.rest) == ("\n\nReal step.\n\n", "step", "Next")
    eager = cut_step("\n\nReal step.\n\nNext", SegmentConfig(min_step_chars=0), hit_token_cap=False)
    assert (eager.text, eager.kind) == ("\n\n", "empty")


def test_min_step_chars_skips_short_steps() -> None:
    config = SegmentConfig(min_step_chars=10)
    step = cut_step("Ok.\n\nNow the real work.\n\nMore", config, hit_token_cap=False)
    assert step.text == "Ok.\n\nNow the real work.\n\n"


def test_cut_step_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        cut_step(None, DELIM, hit_token_cap=False)  # type: ignore[arg-type]


# --- repetition ---------------------------------------------------------------------------------


def test_exact_repeat_within_window() -> None:
    previous = ["Compute the sum.\n\n", "Let me  verify\nthe result.\n\n", "Now divide.\n\n"]
    assert is_repeated("let me verify the result.", previous)
    assert not is_repeated("Let me verify the total.", previous)


def test_repeat_outside_window_is_not_a_repeat() -> None:
    previous = ["Check the parity.", "a", "b", "c", "d"]
    assert not is_repeated("Check the parity.", previous, window=4)
    assert is_repeated("Check the parity.", previous, window=5)
    assert not is_repeated("Check the parity.", previous, window=0)
    with pytest.raises(ValueError, match="window"):
        is_repeated("x", previous, window=-1)


def test_degenerate_loop() -> None:
    assert is_repeated("Let me check.\nLet me check.\nLet me check.\nLet me check.\n", [])
    # Prose before the loop, and a loop cut mid-line by the token cap.
    assert is_repeated("We compute the sum first. " + "Wait, is that right? " * 8 + "Wait, is", [])
    assert not is_repeated("Let me check.\nLet me check.", [])  # twice: not a long repetition
    assert not is_repeated("2, 4, 2, 4, 2, 4, 2, 4, 2, 4, 2, 4, 2, 4", [])
    assert not is_repeated("The sum is 12, the product is 35, and the difference is 2.", [])
    assert not is_repeated("  \n ", ["  \n "])


# --- joining ------------------------------------------------------------------------------------


def test_join_steps_restores_trimmed_delimiters() -> None:
    assert join_steps(["a", "b\n", "c\n\n", "d"]) == "a\n\nb\n\nc\n\nd"
    assert join_steps(["a", "", "b"]) == "a\n\nb"
    assert join_steps(["a. ", "b."], delimiter="") == "a. b."
    assert join_steps([]) == ""


def test_closes_step_sees_a_boundary_or_end_of_thinking_anywhere() -> None:
    from thinkahead.step_spec.segment import closes_step

    delim = SegmentConfig()
    assert closes_step("The total is 5.\n\n", delim) and closes_step("a\n\nb", delim)
    assert not closes_step("The total is 5.\n", delim) and not closes_step("\n\nabc", delim)  # nothing before it yet
    assert closes_step("so 5</think>", delim)
    sentence = SegmentConfig(mode="sentence")
    assert closes_step("It costs 3. Then", sentence) and not closes_step("It costs 3.14 then", sentence)
