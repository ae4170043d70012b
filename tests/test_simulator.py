"""The replay simulator: greedy acceptance against recorded outputs, no model."""

from __future__ import annotations

from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.simulator import accepted_prefix, replay
from thinkahead.token_spec.suffix_cache import SuffixCache


def test_accepted_prefix_chain_and_tree() -> None:
    assert accepted_prefix(Draft.chain([1, 2, 3]), [1, 2, 9]) == 2
    assert accepted_prefix(Draft.chain([1, 2, 3]), [4]) == 0
    tree = Draft(token_ids=[1, 5, 2, 6], parents=[-1, -1, 0, 1], probs=[1.0] * 4)
    assert accepted_prefix(tree, [5, 6, 7]) == 2
    assert accepted_prefix(tree, [1, 2]) == 2
    assert accepted_prefix(tree, [9, 5, 6, 7], start=1) == 2  # from an offset, without slicing
    assert accepted_prefix(tree, [5, 6], start=2) == 0  # nothing left to match


def test_accepted_prefix_follows_the_first_matching_child_as_the_verifier_does() -> None:
    """The one-pass walk agrees with a walk over each node's children (verify_greedy's order) on random trees."""
    import random

    from thinkahead.token_spec.verify import children_of

    def by_children(draft: Draft, actual: list[int]) -> int:
        children = children_of(draft.parents)
        node, n = -1, 0
        while n < len(actual):
            nxt = next((c for c in children.get(node, ()) if draft.token_ids[c] == actual[n]), None)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n

    rng = random.Random(0)
    for _ in range(3000):
        size = rng.randint(0, 12)
        draft = Draft(token_ids=[rng.randint(0, 3) for _ in range(size)],
                      parents=[rng.randint(-1, i - 1) for i in range(size)])
        actual = [rng.randint(0, 3) for _ in range(rng.randint(0, 8))]
        start = rng.randint(0, 3)
        assert accepted_prefix(draft, actual, start) == by_children(draft, actual[start:]), (draft, actual, start)


def test_repeated_outputs_are_drafted_from_the_global_tree() -> None:
    answer = list(range(500, 560))
    records = [([1, 2, 3], answer), ([4, 5, 6], answer), ([7, 8, 9], answer)]
    stats = replay(SuffixCache(), records, max_tokens=16)
    first, second, third = stats.accept_length_per_request
    assert first == 1.0  # nothing to copy yet: one token per step
    assert second > 5 and third > 5  # the answer is in the global tree now
    assert stats.output_tokens == 180
    assert stats.accepted_tokens <= stats.proposed_tokens
    s = stats.summary()
    assert s["speculate_p50_us"] > 0 and s["accept_length"] == round(180 / stats.verify_steps, 4)


def test_recordings_keep_their_token_lists_and_refuse_what_is_not_token_ids(tmp_path) -> None:
    """`read_sessions` checks ids without copying them: integers pass as parsed, anything else names the line."""
    import json

    import pytest

    from thinkahead.token_spec.recording import TokenRecorder, read_sessions

    path = tmp_path / "tokens.jsonl"
    recorder = TokenRecorder(path)
    recorder.record("m", "s1", [1, 2, 3], [4, 5])
    recorder.record("m", "s1", [1, 2, 3, 4, 5, 6], [2**40])
    recorder.record("m", None, [7], [])
    sessions = read_sessions(path)
    assert [[(t.prompt_ids, t.output_ids) for t in s] for s in sessions] == [
        [([1, 2, 3], [4, 5]), ([1, 2, 3, 4, 5, 6], [2**40])], [([7], [])]]
    for bad in (["1", 2], [1.5], [2**70], "123", {"1": 2}, None):
        broken = tmp_path / "broken.jsonl"
        broken.write_text(path.read_text() + json.dumps(
            {"model": "m", "session_id": "s2", "prompt_ids": [1], "output_ids": bad}) + "\n")
        with pytest.raises(ValueError, match=r"broken.jsonl:4: not a token record"):
            read_sessions(broken)
