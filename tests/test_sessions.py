"""Agent sessions in the suffix cache: continued trees draft exactly as rebuilt ones, and sessions end."""

from __future__ import annotations

import random

import pytest

from thinkahead.token_spec.drafters import CombinedDrafter, PromptLookupDrafter, SuffixDrafter
from thinkahead.token_spec.simulator import Turn, replay_sessions
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.verify import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def phrase_text(rng: random.Random, phrases: list[list[int]], n: int, vocab: int = 40) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(phrases) if rng.random() < 0.75 else [rng.randrange(vocab)]
    return out[:n]


def make_session(rng: random.Random, turns: int, edit_rate: float = 0.0) -> list[Turn]:
    """Turns whose prompts extend the previous prompt + output, sometimes with an edited history."""
    phrases = [[rng.randrange(40) for _ in range(rng.randint(2, 8))] for _ in range(6)]
    prompt = phrase_text(rng, phrases, rng.randint(5, 40))
    session = []
    for _ in range(turns):
        output = phrase_text(rng, phrases, rng.randint(1, 30))
        session.append(Turn(list(prompt), output))
        prompt = prompt + output + phrase_text(rng, phrases, rng.randint(0, 25))
        if rng.random() < edit_rate:
            kind = rng.choice(["change", "cut", "drop-output"])
            if kind == "change":
                prompt[rng.randrange(len(prompt))] = rng.randrange(40, 50)
            elif kind == "cut":
                prompt = prompt[: rng.randrange(1, len(prompt))]
            else:
                prompt = session[-1].prompt_ids + phrase_text(rng, phrases, rng.randint(1, 10))
    return session


def draft_key(draft):
    return (draft.token_ids, draft.parents, [round(p, 12) for p in draft.probs], draft.match_len, draft.source)


def all_drafts(cache: SuffixCache, rid, context: list[int]) -> list:
    out = []
    for tree in (False, True):
        for factor, offset in ((1.0, 0.0), (2.0, 3.0)):
            out.append(draft_key(cache.speculate(rid, context, 12, factor, offset, 0.1, tree)))
    for name, draft in sorted(cache.speculate_sources(rid, context, 12, 1.0, 1.0, 0.05).items()):
        out.append((name, draft_key(draft)))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_continued_sessions_draft_exactly_as_full_rebuilds(seed: int) -> None:
    """Randomised: the same turns through a session cache and a rebuild-every-turn cache give equal drafts."""
    rng = random.Random(seed)
    depth = rng.choice([4, 8, 16])
    with_sessions = SuffixCache(max_depth=depth)
    rebuilt = SuffixCache(max_depth=depth)
    sessions = [make_session(rng, rng.randint(2, 6), edit_rate=0.3) for _ in range(3)]
    order = [(s, t) for s in range(3) for t in range(len(sessions[s]))]
    rng.shuffle(order)
    order.sort(key=lambda st: st[1])  # turns of different sessions interleave; each session in order
    for s, t in order:
        turn = sessions[s][t]
        rid = f"r{s}-{t}"
        with_sessions.start_request(rid, turn.prompt_ids, session_id=f"s{s}")
        rebuilt.start_request(rid, turn.prompt_ids)
        context = list(turn.prompt_ids)
        assert all_drafts(with_sessions, rid, context) == all_drafts(rebuilt, rid, context)
        pos = 0
        while pos < len(turn.output_ids):
            chunk = turn.output_ids[pos:pos + rng.randint(1, 4)]
            pos += len(chunk)
            for cache in (with_sessions, rebuilt):
                cache.extend(rid, chunk)
            context += chunk
            assert all_drafts(with_sessions, rid, context) == all_drafts(rebuilt, rid, context)
            foreign = context[-rng.randint(1, 6):]
            assert all_drafts(with_sessions, rid, foreign) == all_drafts(rebuilt, rid, foreign)
        assert with_sessions.output(rid) == rebuilt.output(rid) == turn.output_ids
        with_sessions.stop_request(rid)
        rebuilt.stop_request(rid)
    stats = with_sessions.session_stats
    assert stats.session_starts == 3
    assert stats.session_extends + stats.session_rebuilds == len(order) - 3
    assert stats.session_extends > 0
    assert rebuilt.session_stats.session_extends == 0


def test_a_continued_turn_appends_only_the_new_tokens_to_the_same_tree() -> None:
    cache = SuffixCache(max_depth=8)
    prompt, output = [1, 2, 3, 4, 5, 1, 2], [3, 9, 9]
    cache.start_request("t1", prompt, session_id="chat")
    tree = cache._requests["t1"].tree
    cache.extend("t1", output)
    cache.stop_request("t1")
    assert cache.sessions == ["chat"]
    new = [7, 1, 2]
    cache.start_request("t2", prompt + output + new, session_id="chat")
    assert cache._requests["t2"].tree is tree  # continued, not rebuilt
    assert cache.output("t2") == []
    s = cache.session_stats
    assert (s.session_starts, s.session_extends, s.session_rebuilds) == (1, 1, 0)
    assert s.extended_tokens == 3 and s.rebuilt_tokens == len(prompt)
    # the previous output is in the tree: after [1, 2] the most recent continuation is [3, 9, 9, 7, ...]
    assert cache.speculate_sources("t2", prompt + output + new, 4)["recent"].token_ids == [3, 9, 9, 7]
    cache.extend("t2", [3])
    assert cache.output("t2") == [3]
    cache.stop_request("t2")
    assert cache.cached_requests == ["t1", "t2"]  # outputs still join the global tree


def test_edited_history_falls_back_to_a_rebuild() -> None:
    cache = SuffixCache(max_depth=8)
    cache.start_request("t1", [5, 6, 7, 8, 20, 21, 22], session_id="chat")
    cache.extend("t1", [30, 31])
    cache.stop_request("t1")
    # the agent rewrote its history: 20 21 22 is gone
    edited = [5, 6, 7, 8, 40, 41, 30, 31, 5, 6, 7, 8]
    cache.start_request("t2", edited, session_id="chat")
    s = cache.session_stats
    assert (s.session_extends, s.session_rebuilds, s.rebuilt_tokens) == (0, 1, 7 + len(edited))
    assert cache._requests["t2"].tree.tokens(0) == edited
    # the stale continuation 20 21 22 must not be drafted: only what the edited prompt says
    assert cache.speculate("t2", edited, 3, max_spec_factor=1.0).token_ids == [40, 41, 30]
    cache.stop_request("t2")
    # a prompt shorter than the session (the same turn retried) is also a rebuild
    cache.start_request("t3", edited[:5], session_id="chat")
    assert s.session_rebuilds == 2
    cache.stop_request("t3")
    cache.start_request("t4", edited[:5] + [1], session_id="chat")
    assert s.session_extends == 1


def test_bad_tokens_in_a_continued_prompt_leave_the_session_intact() -> None:
    cache = SuffixCache()
    cache.start_request("t1", [1, 2, 3], session_id="s")
    cache.stop_request("t1")
    with pytest.raises(ValueError, match="non-negative"):
        cache.start_request("t2", [1, 2, 3, -4], session_id="s")
    with pytest.raises(ValueError, match="integer token ids"):
        cache.start_request("t2", [1, 2, "x"], session_id="s")
    assert cache.sessions == ["s"] and cache.active_requests == []
    cache.start_request("t2", (1, 2, 3, 4), session_id="s")  # any sequence type works
    assert cache.session_stats.session_extends == 1
    cache.stop_request("t2")


def test_sessions_end_explicitly_and_by_idle_timeout() -> None:
    clock = FakeClock()
    cache = SuffixCache(session_idle_s=10.0, clock=clock)
    for name in ("a", "b"):
        cache.start_request(name, [1, 2, 3], session_id=name)
        cache.stop_request(name)
    cache.end_session("a")
    assert cache.sessions == ["b"]
    with pytest.raises(ValueError, match="not held"):
        cache.end_session("a")
    clock.now = 5.0
    cache.start_request("b2", [1, 2, 3, 4], session_id="b")  # used at t=5: fresh again
    cache.stop_request("b2")
    cache.start_request("c", [9], session_id="c")
    cache.stop_request("c")
    clock.now = 15.5  # b last used at 5.0 (idle 10.5 s): expired; c at 5.0 too
    assert cache.expire_sessions() == 2
    assert cache.sessions == []
    clock.now = 16.0
    cache.start_request("b3", [1, 2, 3, 4, 5], session_id="b")
    s = cache.session_stats
    assert (s.sessions_ended, s.sessions_expired, s.session_starts, s.session_extends) == (1, 2, 4, 1)
    cache.stop_request("b3")


def test_idle_timeout_is_checked_lazily_on_calls() -> None:
    clock = FakeClock()
    cache = SuffixCache(session_idle_s=1.0, clock=clock)
    cache.start_request("a", [1, 2], session_id="old")
    cache.stop_request("a")
    clock.now = 3.0
    assert cache.sessions == ["old"]  # nothing checks until the next start or stop
    cache.start_request("b", [7], session_id="new")
    assert cache.sessions == ["new"] and cache.session_stats.sessions_expired == 1


def test_ending_a_session_while_its_request_runs_drops_the_tree_at_stop() -> None:
    cache = SuffixCache()
    cache.start_request("a", [1, 2, 3], session_id="s")
    cache.end_session("s")
    cache.extend("a", [4])
    cache.stop_request("a")
    assert cache.sessions == [] and cache.session_bytes == 0
    assert cache.cached_requests == ["a"]


def test_session_memory_cap_evicts_least_recently_used() -> None:
    rng = random.Random(3)
    cap = 200_000
    cache = SuffixCache(max_depth=16, max_session_bytes=cap, max_sessions=None)
    prompts: dict[str, list[int]] = {}
    for step in range(40):
        name = f"s{rng.randrange(8)}"
        old = prompts.get(name, [])
        prompt = old + [rng.randrange(500) for _ in range(rng.randint(20, 120))]
        cache.start_request(step, prompt, session_id=name)
        output = [rng.randrange(500) for _ in range(10)]
        cache.extend(step, output)
        cache.stop_request(step)
        prompts[name] = prompt + output
        assert cache.session_bytes <= cap
        assert cache.session_bytes == sum(s.bytes for s in cache._sessions.values())
        assert cache.sessions[-1] == name or name not in cache.sessions  # the latest is most recent
    assert cache.session_stats.sessions_evicted > 0
    assert cache.session_stats.session_extends > 0
    # a session bigger than the cap on its own is not kept
    cache.start_request("huge", list(range(5000)), session_id="huge")
    cache.stop_request("huge")
    assert "huge" not in cache.sessions and cache.session_bytes <= cap


def test_session_count_cap_keeps_the_most_recently_used() -> None:
    cache = SuffixCache(max_sessions=2)
    for name in ("a", "b", "c"):
        cache.start_request(name, [1, 2], session_id=name)
        cache.stop_request(name)
    assert cache.sessions == ["b", "c"]
    cache.start_request("b2", [1, 2, 3], session_id="b")
    cache.stop_request("b2")
    cache.start_request("d", [4], session_id="d")
    cache.stop_request("d")
    assert cache.sessions == ["b", "d"]
    assert cache.session_stats.sessions_evicted == 2
    off = SuffixCache(max_sessions=0)  # sessions disabled: requests still work
    off.start_request("x", [1, 2], session_id="s")
    off.stop_request("x")
    assert off.sessions == []


def test_a_session_in_use_gives_a_concurrent_request_its_own_tree() -> None:
    cache = SuffixCache(max_depth=8)
    cache.start_request("a", [1, 2, 3, 4], session_id="s")
    cache.start_request("b", [1, 2, 3, 4, 5], session_id="s")  # a fork of the same conversation
    assert cache._requests["a"].tree is not cache._requests["b"].tree
    assert cache.session_stats.session_busy == 1
    assert cache.sessions == ["s"]
    cache.extend("a", [6])
    cache.stop_request("a")
    cache.extend("b", [7])
    cache.stop_request("b")  # the latest stop becomes the session
    assert cache._sessions["s"].tree.tokens(0) == [1, 2, 3, 4, 5, 7]
    cache.start_request("c", [1, 2, 3, 4, 5, 7, 8], session_id="s")
    assert cache.session_stats.session_extends == 1


def test_save_and_load_carry_idle_sessions(tmp_path) -> None:
    rng = random.Random(5)
    cache = SuffixCache(max_depth=12, max_sessions=10, session_idle_s=60.0)
    sessions = [make_session(rng, 3) for _ in range(3)]
    for s, session in enumerate(sessions):
        for t, turn in enumerate(session[:2]):
            cache.start_request(f"{s}-{t}", turn.prompt_ids, session_id=("agent", s))
            cache.extend(f"{s}-{t}", turn.output_ids)
            cache.stop_request(f"{s}-{t}")
    cache.start_request("live", [1, 2, 3], session_id="mid-turn")  # held by a live request: not saved
    path = tmp_path / "cache.bin"
    cache.save(path)
    cache.stop_request("live")
    loaded = SuffixCache.load(path)
    assert loaded.sessions == [("agent", 0), ("agent", 1), ("agent", 2)]
    assert (loaded.max_sessions, loaded.session_idle_s) == (10, 60.0)
    assert loaded.session_bytes == sum(cache._sessions[k].bytes for k in loaded.sessions)
    for s, session in enumerate(sessions):
        turn = session[2]
        for c in (cache, loaded):
            c.start_request(f"{s}-2", turn.prompt_ids, session_id=("agent", s))
        context = turn.prompt_ids
        assert all_drafts(loaded, f"{s}-2", context) == all_drafts(cache, f"{s}-2", context)
    assert loaded.session_stats.session_extends == sum(
        1 for session in sessions if session[2].prompt_ids[: len(session[1].prompt_ids)] == session[1].prompt_ids
    )


def test_version_1_files_still_load(tmp_path) -> None:
    import json

    path = tmp_path / "v1.bin"
    header = {
        "format": "thinkahead-suffix-cache",
        "version": 1,
        "max_depth": 8,
        "max_cached_requests": 5,
        "max_memory_bytes": None,
        "request_ids": ["a"],
        "lengths": [3],
    }
    path.write_bytes(json.dumps(header).encode() + b"\n" + (7).to_bytes(4, "little") * 3)
    loaded = SuffixCache.load(path)
    assert loaded.cached_requests == ["a"] and loaded.sessions == []
    assert loaded.global_tree.tokens(0) == [7, 7, 7]


def test_bad_session_config_names_the_problem() -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        SuffixCache(max_sessions=-1)
    with pytest.raises(ValueError, match="max_session_bytes"):
        SuffixCache(max_session_bytes=0)
    with pytest.raises(ValueError, match="session_idle_s"):
        SuffixCache(session_idle_s=0)
    with pytest.raises(ValueError, match="not held"):
        SuffixCache().end_session("nobody")


@pytest.mark.parametrize("drafter_kind", ["suffix", "prompt-lookup", "combined"])
def test_replayed_sessions_draft_the_same_with_and_without_session_reuse(drafter_kind: str) -> None:
    """Session reuse changes only the update cost: every turn's acceptance is identical."""
    rng = random.Random(11)
    sessions = [make_session(rng, 5, edit_rate=0.2) for _ in range(4)]

    def build(max_sessions: int):
        if drafter_kind == "suffix":
            return SuffixDrafter(SuffixCache(max_depth=16, max_sessions=max_sessions))
        if drafter_kind == "prompt-lookup":
            return PromptLookupDrafter(prefer="last", max_sessions=max_sessions)
        # the combined drafter learns its rates per session either way; only the cache differs
        return CombinedDrafter(SuffixCache(max_depth=16, max_sessions=max_sessions))

    reusing, rebuilding = build(64), build(0)
    reused = replay_sessions(reusing, sessions, max_tokens=8)
    fresh = replay_sessions(rebuilding, sessions, max_tokens=8)
    assert reused.tokens_per_step_per_turn == fresh.tokens_per_step_per_turn
    assert (reused.verify_steps, reused.accepted_tokens) == (fresh.verify_steps, fresh.accepted_tokens)
    if drafter_kind != "prompt-lookup":
        assert reusing.cache.session_stats.session_extends > 0
        assert rebuilding.cache.session_stats.session_extends == 0
    assert reused.turns == 20 and reused.sessions == 4 and len(reused.update_s) == 20
    assert reused.extending_turns == sum(
        1 for session in sessions for a, b in zip(session, session[1:])
        if b.prompt_ids[: len(a.prompt_ids) + len(a.output_ids)] == a.prompt_ids + a.output_ids
    )
    assert reused.output_tokens == sum(len(t.output_ids) for s in sessions for t in s)
    assert reused.tokens_per_step > 1.0
    summary = reused.summary()
    assert summary["tokens_per_step"] == round(reused.output_tokens / reused.verify_steps, 4)
    assert summary["update_p99_ms"] >= summary["update_p50_ms"] > 0
    no_ids = replay_sessions(build(64), sessions, max_tokens=8, use_sessions=False)
    if drafter_kind != "combined":  # without session ids, combined rates restart each request
        assert no_ids.tokens_per_step_per_turn == reused.tokens_per_step_per_turn


def test_prompt_lookup_continues_its_session_index() -> None:
    plain, reused = PromptLookupDrafter(prefer="last"), PromptLookupDrafter(prefer="last")
    params = SamplingParams()
    plain.start("a", [1, 2, 3, 4], params)
    reused.start("a", [1, 2, 3, 4], params, session_id="s")
    for d in (plain, reused):
        d.observe("a", [1, 2, 9], None)
        d.finish("a")
    index = reused._sessions["s"][1]
    plain.start("b", [1, 2, 3, 4, 1, 2, 9, 5, 1, 2], params)
    reused.start("b", [1, 2, 3, 4, 1, 2, 9, 5, 1, 2], params, session_id="s")
    assert reused._index["b"] is index  # extended, not rebuilt
    context = [1, 2, 3, 4, 1, 2, 9, 5, 1, 2]
    assert reused.propose("b", context, 3).token_ids == plain.propose("b", context, 3).token_ids == [9, 5, 1]


def test_continue_session_appends_new_tokens_without_a_comparison() -> None:
    rng = random.Random(8)
    session = make_session(rng, 4)
    by_tokens, by_prompt = SuffixCache(max_depth=8), SuffixCache(max_depth=8)
    previous: list[int] = []
    for t, turn in enumerate(session):
        if t == 0:
            by_tokens.start_request(t, turn.prompt_ids, session_id="s")
        else:
            assert by_tokens.session_tokens("s") == previous
            by_tokens.continue_session(t, "s", turn.prompt_ids[len(previous):])
        by_prompt.start_request(t, turn.prompt_ids, session_id="s")
        assert all_drafts(by_tokens, t, turn.prompt_ids) == all_drafts(by_prompt, t, turn.prompt_ids)
        for cache in (by_tokens, by_prompt):
            cache.extend(t, turn.output_ids)
            cache.stop_request(t)
        previous = turn.prompt_ids + turn.output_ids
    assert by_tokens.session_stats == by_prompt.session_stats
    with pytest.raises(ValueError, match="not held"):
        by_tokens.continue_session("x", "unknown", [1])
    by_tokens.start_request("busy", previous, session_id="s")
    with pytest.raises(ValueError, match="in use"):
        by_tokens.continue_session("y", "s", [1])
    with pytest.raises(ValueError, match="non-negative"):
        by_tokens.continue_session("y", "s", [-1])
    with pytest.raises(ValueError, match="not held idle"):
        by_tokens.session_tokens("s")


def test_prompt_lookup_session_indexes_are_capped_by_tokens() -> None:
    drafter = PromptLookupDrafter(prefer="last", max_session_tokens=25)
    params = SamplingParams()
    for name in ("a", "b", "c"):
        drafter.start(name, list(range(10)), params, session_id=name)
        drafter.finish(name)
    assert list(drafter._sessions) == ["b", "c"] and drafter._session_tokens == 20
    drafter.start("b2", list(range(12)), params, session_id="b")  # continues b: 2 new tokens
    assert list(drafter._sessions) == ["c"] and drafter._session_tokens == 10
    drafter.finish("b2")
    assert list(drafter._sessions) == ["c", "b"] and drafter._session_tokens == 22
    drafter.end_session("c")
    assert list(drafter._sessions) == ["b"] and drafter._session_tokens == 12
    with pytest.raises(ValueError, match="session caps"):
        PromptLookupDrafter(max_session_tokens=-1)
