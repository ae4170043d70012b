"""Replay recorded outputs through a drafter, with no model, to judge drafting in seconds.

As ArcticInference's simulator: for each recorded (prompt, output) pair, speculate
from the context, accept greedily while the draft matches the real next tokens,
add one bonus token, and move on. Acceptance length = output tokens / verify
steps. Drafting changes can then be compared on thousands of outputs at once.

- `replay`: independent (prompt, output) records through a `SuffixCache`.
- `replay_sessions`: multi-turn agent sessions (each turn's prompt normally
  extends the previous turn's prompt + output) through any `Drafter`, passing
  the session id so drafters can continue their per-session state; it also times
  each turn's prompt ingestion (`Drafter.start`), the per-turn cache update.

Both run a request's verify rounds through one loop, `verify_rounds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator, Sequence
import itertools
import time

from thinkahead.token_spec.names import MAX_DRAFT, SUFFIX_MIN_TOKEN_PROB, SUFFIX_SPEC_FACTOR, SUFFIX_SPEC_OFFSET
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.suffix_cache import SuffixCache


@dataclass(slots=True)
class ReplayStats:
    """Totals over a replay, plus raw per-call latencies for percentiles."""

    requests: int = 0
    output_tokens: int = 0
    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    speculate_s: list[float] = field(default_factory=list)
    extend_s_per_token: list[float] = field(default_factory=list)
    accept_length_per_request: list[float] = field(default_factory=list)

    @property
    def accept_length(self) -> float:
        return self.output_tokens / self.verify_steps if self.verify_steps else 0.0

    def percentile_us(self, values: list[float], q: float) -> float:
        if not values:
            return 0.0
        ordered = sorted(values)
        return 1e6 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "verify_steps": self.verify_steps,
            "accept_length": round(self.accept_length, 4),
            "draft_precision": round(self.accepted_tokens / self.proposed_tokens, 4) if self.proposed_tokens else 0.0,
            "speculate_p50_us": round(self.percentile_us(self.speculate_s, 0.50), 1),
            "speculate_p99_us": round(self.percentile_us(self.speculate_s, 0.99), 1),
            "extend_per_token_p50_us": round(self.percentile_us(self.extend_s_per_token, 0.50), 2),
            "extend_per_token_p99_us": round(self.percentile_us(self.extend_s_per_token, 0.99), 2),
        }


_request_ids = itertools.count()


def accepted_prefix(draft: Draft, actual: Sequence[int], start: int = 0) -> int:
    """Draft tokens a greedy verifier keeps when the target would produce `actual[start:]`.

    At each node the first child (in draft order) whose token matches is followed, as
    `verify_greedy` does. Parents precede their children, so one pass over the draft finds
    them all: the next node on the path is the first later node whose parent is the current
    one and whose token is the next actual token.
    """
    ids, parents = draft.token_ids, draft.parents
    end = len(actual)
    node, pos = -1, start
    for i in range(len(ids)):
        if pos >= end:
            break
        if parents[i] == node and ids[i] == actual[pos]:
            node, pos = i, pos + 1
    return pos - start


def verify_rounds(
    propose: Callable[[list[int]], Draft],
    observe: Callable[[list[int], Draft], object],
    context: list[int],
    output: list[int],
    propose_s: list[float],
    observe_s: list[float],
    per_token: bool = False,
) -> tuple[int, int, int]:
    """One request's verify rounds against its recorded `output`: (steps, proposed, accepted) tokens.

    Each round `propose(context)` drafts, the greedy verifier keeps the draft's matching prefix plus
    one bonus token, and `observe(new, draft)` gets the committed tokens, which join `context` (in
    place). Appends each round's propose and observe seconds (per committed token with `per_token`).
    """
    clock = time.perf_counter
    pos = steps = proposed = accepted = 0
    end = len(output)
    while pos < end:
        t0 = clock()
        draft = propose(context)
        t1 = clock()
        hit = accepted_prefix(draft, output, pos)  # at most end - pos: all of it is committed
        new = output[pos:pos + hit + 1]
        t2 = clock()
        observe(new, draft)
        t3 = clock()
        propose_s.append(t1 - t0)
        observe_s.append((t3 - t2) / len(new) if per_token else t3 - t2)
        proposed += len(draft)
        accepted += hit
        context += new
        pos += len(new)
        steps += 1
    return steps, proposed, accepted


def replay(
    cache: SuffixCache,
    records: Iterable[tuple[Sequence[int], Sequence[int]]],
    max_tokens: int = MAX_DRAFT,
    max_spec_factor: float = SUFFIX_SPEC_FACTOR,
    max_spec_offset: float = SUFFIX_SPEC_OFFSET,
    min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
    tree: bool = False,
    stats: ReplayStats | None = None,
) -> ReplayStats:
    """Replay (prompt ids, output ids) pairs in order; outputs join the global tree as they finish."""
    stats = stats or ReplayStats()
    params = (max_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree)
    for prompt, output in records:
        rid = ("replay", next(_request_ids))  # unique across replays: a reused id would evict
        cache.start_request(rid, prompt)
        output = list(output)
        steps, proposed, accepted = verify_rounds(
            lambda context, rid=rid: cache.speculate(rid, context, *params),
            lambda new, draft, rid=rid: cache.extend(rid, new),
            list(prompt), output, stats.speculate_s, stats.extend_s_per_token, per_token=True,
        )
        stats.proposed_tokens += proposed
        stats.accepted_tokens += accepted
        cache.stop_request(rid)
        stats.requests += 1
        stats.output_tokens += len(output)
        stats.verify_steps += steps
        stats.accept_length_per_request.append(len(output) / steps if steps else 0.0)
    return stats


@dataclass(slots=True)
class Turn:
    """One request of a session: the prompt it was sent and the output the model produced."""

    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(slots=True)
class SessionReplayStats:
    """Totals over a multi-turn replay, plus raw per-turn and per-call timings for percentiles."""

    sessions: int = 0
    turns: int = 0
    extending_turns: int = 0  # turns whose prompt extends the previous turn's prompt + output
    prompt_tokens: int = 0
    new_prompt_tokens: int = 0  # prompt tokens beyond the previous turn's prompt + output
    output_tokens: int = 0
    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    update_s: list[float] = field(default_factory=list)  # Drafter.start per turn
    update_prompt_tokens: list[int] = field(default_factory=list)  # that turn's prompt length
    update_new_tokens: list[int] = field(default_factory=list)  # that turn's new prompt tokens
    finish_s: list[float] = field(default_factory=list)  # Drafter.finish per turn
    propose_s: list[float] = field(default_factory=list)
    observe_s: list[float] = field(default_factory=list)
    tokens_per_step_per_turn: list[float] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        """Committed tokens per verify step: accepted draft tokens + 1 bonus, averaged."""
        return self.output_tokens / self.verify_steps if self.verify_steps else 0.0

    def summary(self) -> dict[str, float]:
        ms = _percentile_ms
        return {
            "sessions": self.sessions,
            "turns": self.turns,
            "extending_turns": self.extending_turns,
            "prompt_tokens": self.prompt_tokens,
            "new_prompt_tokens": self.new_prompt_tokens,
            "output_tokens": self.output_tokens,
            "verify_steps": self.verify_steps,
            "tokens_per_step": round(self.tokens_per_step, 4),
            "draft_precision": round(self.accepted_tokens / self.proposed_tokens, 4) if self.proposed_tokens else 0.0,
            "update_p50_ms": round(ms(self.update_s, 0.50), 3),
            "update_p99_ms": round(ms(self.update_s, 0.99), 3),
            "finish_p50_ms": round(ms(self.finish_s, 0.50), 3),
            "propose_p50_us": round(1e3 * ms(self.propose_s, 0.50), 1),
            "propose_p99_us": round(1e3 * ms(self.propose_s, 0.99), 1),
        }


def _percentile_ms(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def replay_sessions(
    drafter,  # any Drafter
    sessions: Iterable[Sequence[Turn | tuple[Sequence[int], Sequence[int]]]],
    max_tokens: int = 32,
    stats: SessionReplayStats | None = None,
    use_sessions: bool = True,
    tag: Hashable = "replay",
    native_rounds: bool = False,
) -> SessionReplayStats:
    """Replay sessions turn by turn through `drafter`, accepting greedily against the recorded outputs.

    Each round the drafter proposes up to `max_tokens` tokens (a chain or a tree),
    the longest matching path is kept plus one bonus token, and `observe` gets the
    committed tokens, as in the decoder. With `use_sessions` each turn passes its
    session's id to `Drafter.start` (drafts do not change, only the update cost);
    without it every turn starts from scratch. With `native_rounds` a turn's rounds run in the native
    extension where it covers the drafter (`native_rounds.rounds_for`): the same counts, but no
    per-call timings (`propose_s`, `observe_s` stay empty for those turns).
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    # here, not at the top: verify loads torch (for the model-facing checks), which a replay does not need
    from thinkahead.token_spec.verify import SamplingParams

    stats = stats or SessionReplayStats()
    clock = time.perf_counter
    params = SamplingParams()
    propose, observe = drafter.propose, drafter.observe
    propose_s, observe_s = stats.propose_s, stats.observe_s
    native = None
    if native_rounds:
        from thinkahead.token_spec.native_rounds import rounds_for  # the drafters' internals: only when asked

        native = rounds_for(drafter)
    for session_id, turns in _sessions(sessions, tag):
        for turn in turns:
            rid = turn.rid
            t0 = clock()
            if use_sessions:
                drafter.start(rid, turn.prompt, params, session_id=session_id)
            else:
                drafter.start(rid, turn.prompt, params)
            stats.update_s.append(clock() - t0)
            stats.update_prompt_tokens.append(len(turn.prompt))
            stats.update_new_tokens.append(turn.new_tokens)
            if native is not None:
                steps, proposed, accepted = native(rid, turn.output, max_tokens)
            else:
                steps, proposed, accepted = verify_rounds(
                    lambda context, rid=rid: propose(rid, context, max_tokens),
                    lambda new, draft, rid=rid: observe(rid, new, draft),
                    list(turn.prompt), turn.output, propose_s, observe_s,
                )
            t0 = clock()
            drafter.finish(rid)
            stats.finish_s.append(clock() - t0)
            _count_turn(stats, turn, steps, proposed, accepted)
        stats.sessions += 1
    return stats


@dataclass(slots=True)
class _Turn:
    """One recorded turn as a replay feeds it."""

    rid: tuple  # a fresh request id
    prompt: list[int]  # the drafter's own copy
    output: list[int]  # only read
    extending: bool  # its prompt extends the previous turn's prompt + output (never the session's first)
    new_tokens: int  # prompt tokens past that (all of them where it does not extend)


def _sessions(sessions: Iterable[Sequence[Turn | tuple[Sequence[int], Sequence[int]]]],
              tag: Hashable) -> Iterator[tuple[tuple, Iterator[_Turn]]]:
    """(session id, its turns) per session; ids are unique (a reused one would continue another replay)."""
    for session in sessions:
        yield (tag, "session", next(_request_ids)), _turns(session, tag)


def _turns(session: Sequence[Turn | tuple[Sequence[int], Sequence[int]]], tag: Hashable) -> Iterator[_Turn]:
    previous: list[int] = []  # the previous turn's prompt + output
    for turn in session:
        prompt, output = (turn.prompt_ids, turn.output_ids) if isinstance(turn, Turn) else turn
        prompt = list(prompt)
        if not isinstance(output, list):
            output = list(output)
        if not prompt:
            raise ValueError("every turn needs a non-empty prompt")
        extends = len(prompt) >= len(previous) and prompt[:len(previous)] == previous
        new_tokens = len(prompt) - len(previous) if extends else len(prompt)
        yield _Turn((tag, next(_request_ids)), prompt, output, extends and bool(previous), new_tokens)
        previous = prompt + output


def _count_turn(stats: SessionReplayStats, turn: _Turn, steps: int, proposed: int, accepted: int) -> None:
    stats.proposed_tokens += proposed
    stats.accepted_tokens += accepted
    stats.turns += 1
    stats.extending_turns += int(turn.extending)
    stats.prompt_tokens += len(turn.prompt)
    stats.new_prompt_tokens += turn.new_tokens
    stats.output_tokens += len(turn.output)
    stats.verify_steps += steps
    stats.tokens_per_step_per_turn.append(len(turn.output) / steps if steps else 0.0)


def replay_sessions_shared(
    drafters: Sequence,  # SuffixDrafters and at most one CombinedDrafter over one SuffixCache, or PromptLookupDrafters
    sessions: Iterable[Sequence[Turn | tuple[Sequence[int], Sequence[int]]]],
    max_tokens: int = 32,
    tag: Hashable = "replay",
) -> list[SessionReplayStats] | None:
    """`replay_sessions(d, sessions, max_tokens, native_rounds=True)` for each of `drafters` at once.

    Their drafting never changes the cache's trees (or the prompt-lookup index), so one request per
    turn (started and finished by one of them) serves all, and the native extension runs every
    drafter's rounds over it in lockstep (`native_rounds.shared_rounds`): the counts of one replay
    each, a third of the tree work for three. The update and finish timings are the shared request's.
    None where the extension does not cover the drafters (then replay them one by one).
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    from thinkahead.token_spec.native_rounds import shared_rounds
    from thinkahead.token_spec.verify import SamplingParams

    rounds = shared_rounds(list(drafters))
    if rounds is None:
        return None
    all_stats = [SessionReplayStats() for _ in drafters]
    clock, params, lead = time.perf_counter, SamplingParams(), rounds.lead
    for session_id, turns in _sessions(sessions, tag):
        for turn in turns:
            t0 = clock()
            lead.start(turn.rid, turn.prompt, params, session_id=session_id)
            update_s = clock() - t0
            results = rounds(turn.rid, turn.output, max_tokens)
            t0 = clock()
            lead.finish(turn.rid)
            finish_s = clock() - t0
            for stats, (steps, proposed, accepted) in zip(all_stats, results):
                stats.update_s.append(update_s)
                stats.update_prompt_tokens.append(len(turn.prompt))
                stats.update_new_tokens.append(turn.new_tokens)
                stats.finish_s.append(finish_s)
                _count_turn(stats, turn, steps, proposed, accepted)
        for stats in all_stats:
            stats.sessions += 1
    return all_stats
