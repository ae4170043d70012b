"""SuffixDecoding's cache: a tree per live request, one global tree of earlier outputs, and sessions.

One `SuffixCache` serves every request and agent that talks to one target model.
A live request's own tree covers its prompt and its output so far; when the
request stops, its output joins the global tree, where every later request (of
any agent) can draft from it. The global tree evicts whole responses, oldest
first, by count and by an estimated memory cap (`DEFAULT_MAX_MEMORY_BYTES` unless
set); an eviction costs the evicted response's own suffixes, whatever the size
of the tree (suffix_eviction). `save` / `load` keep a warm cache between batch
jobs (suffix_persist).

Sessions: an agent sends the same growing conversation turn after turn. A
request started with a `session_id` keeps its tree when it stops; the session's
next request, whose prompt normally extends the previous prompt + output, then
appends only the new tokens to that tree instead of rebuilding it over the whole
prompt (cost proportional to the new tokens, plus one list comparison of the old
prefix). Because the tree is built token by token either way, a continued tree
is the very tree a rebuild would give, so the drafts are identical. A prompt
that does not extend the session (an edited history) is rebuilt and counted in
`session_stats`. Sessions end by `end_session`, after `session_idle_s` without
use (checked lazily on start/stop calls, against an injectable clock), and by
least-recently-used eviction under `max_sessions` / `max_session_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence
import os
import time

from thinkahead.token_spec.names import MAX_DRAFT, SUFFIX_MIN_TOKEN_PROB, SUFFIX_SPEC_FACTOR, SUFFIX_SPEC_OFFSET
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec import suffix_impl as impl
from thinkahead.token_spec.suffix_drafts import _check_draft_args, _checked_tokens, _tree_of_chains
from thinkahead.token_spec.suffix_eviction import global_tree_bytes, shared_ids
from thinkahead.token_spec.suffix_sessions import SessionsMixin, SessionStats, _Session, build_request_tree

# The global tree's default memory cap: a quarter GiB, 2-3% of an 8-16 GB laptop next to a small
# model. At the ~240 bytes per response token measured on GSM8K answers (bench/suffix_cache.py) it
# holds about 1.1M tokens: ~9,000 responses of ~120 tokens, close to the 10,000 `max_cached_requests`
# allows, so longer responses meet the memory cap first (before it, 14.5k responses took 632 MB).
DEFAULT_MAX_MEMORY_BYTES = 256 * 2**20


@dataclass(slots=True)
class _Request:
    tree: Any  # a SuffixTree (suffix_impl) over prompt + output; its one sequence has id 0
    prompt_len: int
    global_positions: Any = None  # matches in the global tree (the tree's own position type)
    global_version: int = -1  # the global tree version the positions belong to
    session_id: Hashable | None = None  # where the tree goes when the request stops


class SuffixCache(SessionsMixin):
    """Per-request and global suffix trees with SuffixDecoding's semantics, plus sessions.

    Args:
        max_depth: longest suffix stored in the global tree (and so the longest match
            tried there, minus one).
        request_depth: the same for the trees over each request's prompt + output and
            each session's conversation; None means min(max_depth, 32). These trees are
            built or extended on every request, on the critical path, and their upkeep is
            proportional to the depth; a match of 32 tokens already allows a 32-token draft.
            Measured on the recorded agent sessions (BFCL react, self-refine): 32 drafts
            the same tokens per verify step as 64 at about half the update time.
        max_cached_requests: responses kept in the global tree; 0 disables the
            global tree, a negative value means no limit.
        max_memory_bytes: cap on the global tree's estimated memory (`estimated_bytes`: its
            nodes, the responses' tokens and their bookkeeping, within ~10% of what tracemalloc
            measures), `DEFAULT_MAX_MEMORY_BYTES` (256 MiB) unless set; None: no cap (only
            `max_cached_requests` bounds the global tree).
        max_sessions: idle sessions kept (least recently used evicted first); 0
            disables sessions (every request builds its own tree), None means no limit.
        max_session_bytes: estimated memory cap over all idle sessions' trees, or None.
        session_idle_s: a session unused for longer than this ends, or None (never).
        clock: seconds as a float, for idle timeouts (tests inject a fake one).
        tree_impl: "native" or "python" (`suffix_impl`); None: `$THINKAHEAD_SUFFIX_IMPL` (`suffix_impl.ENV_VAR`), else native
            when its extension loads.
    """

    def __init__(
        self,
        max_depth: int = 64,
        request_depth: int | None = None,
        max_cached_requests: int = 10_000,
        max_memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES,
        max_sessions: int | None = 1024,
        max_session_bytes: int | None = 1 << 30,
        session_idle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        tree_impl: str | None = None,
    ) -> None:
        if not isinstance(max_cached_requests, int):
            raise ValueError(f"max_cached_requests must be an integer, got {max_cached_requests!r}")
        if max_memory_bytes is not None and max_memory_bytes <= 0:
            raise ValueError(f"max_memory_bytes must be positive or None, got {max_memory_bytes!r}")
        if max_sessions is not None and (not isinstance(max_sessions, int) or max_sessions < 0):
            raise ValueError(f"max_sessions must be a non-negative integer or None, got {max_sessions!r}")
        if max_session_bytes is not None and max_session_bytes <= 0:
            raise ValueError(f"max_session_bytes must be positive or None, got {max_session_bytes!r}")
        if session_idle_s is not None and not session_idle_s > 0:
            raise ValueError(f"session_idle_s must be positive or None, got {session_idle_s!r}")
        if request_depth is not None and (not isinstance(request_depth, int) or request_depth < 2):
            raise ValueError(f"request_depth must be an integer >= 2 or None, got {request_depth!r}")
        self.tree_impl = impl.tree_impl(tree_impl)
        self.global_tree = impl.new_tree(max_depth, self.tree_impl)  # checks max_depth
        self.max_depth = max_depth
        self.request_depth = request_depth
        self._request_depth = request_depth if request_depth is not None else min(max_depth, 32)
        self.max_cached_requests = max_cached_requests
        self.max_memory_bytes = max_memory_bytes
        self.max_sessions = max_sessions
        self.max_session_bytes = max_session_bytes
        self.session_idle_s = session_idle_s
        self.clock = clock
        self.session_stats = SessionStats()
        self._requests: dict[Hashable, _Request] = {}
        self._cached: OrderedDict[Hashable, int] = OrderedDict()  # rid -> seq id, oldest first
        self._next_seq_id = 0
        self._evicted = 0  # responses removed from the global tree (its turnover, for `estimated_bytes`)
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()  # idle, least recently used first
        self._session_bytes = 0
        self._held: dict[Hashable, Hashable] = {}  # session id -> the live request holding its tree

    def clear(self) -> None:
        """Forget every cached output and session (a cold cache), e.g. between benchmark runs that must not share."""
        if self._requests:
            raise ValueError(f"cannot clear the suffix cache while requests are live: {list(self._requests)[:5]}")
        self.global_tree = impl.new_tree(self.max_depth, self.tree_impl)
        self._cached.clear()
        self._evicted = 0
        self._sessions.clear()
        self._session_bytes = 0

    # --------------------------------------------------------------- lifecycle
    @property
    def active_requests(self) -> list[Hashable]:
        return list(self._requests)

    @property
    def cached_requests(self) -> list[Hashable]:
        """Requests whose outputs are in the global tree, oldest first."""
        return list(self._cached)

    def start_request(self, rid: Hashable, prompt_ids: Sequence[int], session_id: Hashable | None = None) -> None:
        """Begin a request: build its own tree over the prompt, or continue its session's tree.

        With a `session_id` the cache holds (from the session's previous request),
        a prompt that starts with that request's prompt + output costs only its
        new tokens; any other prompt is rebuilt from scratch and counted in
        `session_stats.session_rebuilds`.
        """
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already active")
        if session_id is not None and self.max_sessions == 0:
            session_id = None  # sessions disabled: serve the request on its own
        if session_id is None:
            tokens = _checked_tokens(prompt_ids, "prompt_ids")
            tree = build_request_tree(self._request_depth, tokens, self.tree_impl)
            self._requests[rid] = _Request(tree=tree, prompt_len=len(tokens))
            return
        self._expire(self.clock())
        stats = self.session_stats
        busy = session_id in self._held
        session = None if busy else self._sessions.get(session_id)
        tree: Any = None
        if session is not None:
            new = impl.extension_of(session.tree, prompt_ids)
            if new is not None:
                new = _checked_tokens(new, "prompt_ids")
                self._discard_idle(session_id)
                tree = session.tree
                tree.extend(0, new)
                stats.session_extends += 1
                stats.extended_tokens += len(new)
        if tree is None:
            tokens = _checked_tokens(prompt_ids, "prompt_ids")
            tree = build_request_tree(self._request_depth, tokens, self.tree_impl)
            if busy:
                stats.session_busy += 1
            else:
                if session is not None:
                    stats.session_rebuilds += 1
                    self._discard_idle(session_id)  # its tree no longer describes the conversation
                else:
                    stats.session_starts += 1
                stats.rebuilt_tokens += len(tokens)
        if not busy:
            self._held[session_id] = rid
        self._requests[rid] = _Request(tree=tree, prompt_len=impl.seq_len(tree), session_id=session_id)

    def continue_session(self, rid: Hashable, session_id: Hashable, new_token_ids: Sequence[int]) -> None:
        """Begin a request whose prompt is the session's last prompt + output + `new_token_ids`.

        For callers that track the conversation as tokens (an agent loop that
        appends tool results to its own token list): nothing is compared, so the
        cost is the new tokens' alone. Raises ValueError when the cache does not
        hold the session idle (never seen, ended, expired, evicted or in use by
        another request); the caller then sends the full prompt to `start_request`.
        """
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already active")
        new = _checked_tokens(new_token_ids, "new_token_ids")
        self._expire(self.clock())
        if session_id in self._held or session_id not in self._sessions:
            state = "in use by another request" if session_id in self._held else "not held by the cache"
            raise ValueError(f"session {session_id!r} is {state}: start the request with its full prompt")
        session = self._sessions[session_id]
        self._discard_idle(session_id)
        session.tree.extend(0, new)
        self.session_stats.session_extends += 1
        self.session_stats.extended_tokens += len(new)
        self._held[session_id] = rid
        tree = session.tree
        self._requests[rid] = _Request(tree=tree, prompt_len=impl.seq_len(tree), session_id=session_id)

    def extend(self, rid: Hashable, token_ids: Sequence[int]) -> None:
        """Append generated tokens to a live request."""
        req = self._request(rid)
        token_ids = _checked_tokens(token_ids, "token_ids")
        req.tree.extend(0, token_ids)
        if req.global_version == self.global_tree.version:
            req.global_positions = impl.advance_many(self.global_tree, req.global_positions, token_ids)

    def output(self, rid: Hashable) -> list[int]:
        """The tokens generated so far for a live request."""
        req = self._request(rid)
        return impl.tokens_from(req.tree, req.prompt_len)

    def stop_request(self, rid: Hashable) -> None:
        """End a request; its output joins the global tree (evicting as needed).

        A request of a session leaves its tree (prompt + output) to the session,
        for the session's next request to continue.
        """
        req = self._requests.pop(rid, None)
        if req is None:
            raise ValueError(f"request {rid!r} is not active")
        response = impl.tokens_from(req.tree, req.prompt_len)
        if req.session_id is not None:
            self._park(rid, req)
        if self.max_cached_requests == 0 or not response:
            return
        if rid in self._cached:
            self.evict(rid)
        self._insert(rid, response)

    # ------------------------------------------------------------ global tree
    def _insert(self, rid: Hashable, response: Sequence[int]) -> None:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        tree = self.global_tree
        tree.add(seq_id, response if impl.is_native(tree) else shared_ids(tree, response))
        self._cached[rid] = seq_id
        self._enforce_limits(keep=rid)

    def _responses(self) -> Iterator[tuple[Hashable, list[int]]]:
        """(request id, output tokens) of each cached response, oldest first."""
        for rid, seq_id in self._cached.items():
            yield rid, self.global_tree.tokens(seq_id)

    def evict(self, rid: Hashable) -> None:
        """Drop one cached response from the global tree (cost: that response's own suffixes)."""
        seq_id = self._cached.pop(rid, None)
        if seq_id is None:
            raise ValueError(f"request {rid!r} has no cached response")
        self.global_tree.remove(seq_id)
        self._evicted += 1

    def _enforce_limits(self, keep: Hashable) -> None:
        def over() -> bool:
            if 0 < self.max_cached_requests < len(self._cached):
                return True
            return self.max_memory_bytes is not None and self.estimated_bytes > self.max_memory_bytes

        while over() and len(self._cached) > 1:
            oldest = next(iter(self._cached))
            if oldest == keep:
                break
            self.evict(oldest)

    @property
    def estimated_bytes(self) -> int:
        """Estimated memory of the global tree and its responses (what `max_memory_bytes` caps)."""
        return global_tree_bytes(self.global_tree, len(self._cached), self._evicted)

    # ----------------------------------------------------------------- drafting
    def speculate(
        self,
        rid: Hashable,
        context: Sequence[int],
        max_tokens: int = MAX_DRAFT,
        max_spec_factor: float = SUFFIX_SPEC_FACTOR,
        max_spec_offset: float = SUFFIX_SPEC_OFFSET,
        min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
        tree: bool = False,
    ) -> Draft:
        """Draft a continuation of `context` from the request's tree and the global tree.

        Every tail of the context is matched; the budget for a match of length m
        is min(max_tokens, floor(m * max_spec_factor + max_spec_offset)); tokens
        stop below `min_token_prob`; the higher-scoring of the local and global
        draft wins (the local one on a tie). `context` is normally the request's
        prompt + output so far, which is matched incrementally; any other context
        is matched from scratch.
        """
        req = self._request(rid)
        _check_draft_args(max_tokens, max_spec_factor, min_token_prob, max_spec_offset)
        if not context or max_tokens == 0:
            return Draft(source="suffix")
        is_own = self._is_own(req, context)
        params = (max_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree)
        local_positions = req.tree.live_positions(0) if is_own else req.tree.match_positions(context)
        best = req.tree.speculate(local_positions, *params)
        best.source = "suffix-local"
        if self._cached:
            draft = self.global_tree.speculate(self._global_positions(req, context, is_own), *params)
            if draft.score > best.score:
                draft.source = "suffix-global"
                best = draft
        return best

    def speculate_batch(
        self,
        requests: Sequence[tuple[Hashable, Sequence[int]]],
        max_tokens: int = MAX_DRAFT,
        max_spec_factor: float = SUFFIX_SPEC_FACTOR,
        max_spec_offset: float = SUFFIX_SPEC_OFFSET,
        min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
        tree: bool = False,
    ) -> list[Draft]:
        """`speculate` for many (request id, context) pairs at once, the same drafts as one call each.

        For serving loops: with the native tree every request's local and global drafts are
        computed in two calls that release the GIL (`suffix_impl.speculate_many`).
        """
        _check_draft_args(max_tokens, max_spec_factor, min_token_prob, max_spec_offset)
        out: list[Draft] = [Draft(source="suffix") for _ in requests]
        todo: list[int] = []
        local_trees, local_pos, global_pos = [], [], []
        has_global = bool(self._cached)
        for i, (rid, context) in enumerate(requests):
            req = self._request(rid)
            if not context or max_tokens == 0:
                continue
            is_own = self._is_own(req, context)
            todo.append(i)
            local_trees.append(req.tree)
            local_pos.append(req.tree.live_positions(0) if is_own else req.tree.match_positions(context))
            if has_global:
                global_pos.append(self._global_positions(req, context, is_own))
        params = (max_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree)
        local = impl.speculate_many(local_trees, local_pos, *params)
        glob = impl.speculate_many([self.global_tree] * len(todo), global_pos, *params) if has_global else []
        for k, i in enumerate(todo):
            best = local[k]
            best.source = "suffix-local"
            if has_global and glob[k].score > best.score:
                best = glob[k]
                best.source = "suffix-global"
            out[i] = best
        return out

    def speculate_sources(
        self,
        rid: Hashable,
        context: Sequence[int],
        max_tokens: int = MAX_DRAFT,
        max_spec_factor: float = SUFFIX_SPEC_FACTOR,
        max_spec_offset: float = SUFFIX_SPEC_OFFSET,
        min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
        tree: bool = True,
        alternatives: int = 3,
    ) -> dict[str, Draft]:
        """Each source's own draft, for drafters that combine them instead of picking one.

        - "recent": what followed the most recent earlier occurrence of the longest
          match in the request's own prompt + output (a chain of up to `max_tokens`
          tokens, not limited by the match length).
        - "alt": up to `alternatives` other copies (older occurrences, shorter
          matches) as one tree of chains (`SuffixTree.recent_alternatives`).
        - "local": SuffixDecoding's frequency draft from the request's own tree.
        - "global": SuffixDecoding's frequency draft from earlier outputs.
        The last two follow `speculate`'s budget rule and probability cut-off.
        """
        self._request(rid)  # unknown requests first, as `speculate`
        _check_draft_args(max_tokens, max_spec_factor, min_token_prob, max_spec_offset)
        if not context or max_tokens == 0:
            return {name: Draft(source=name) for name in ("recent", "alt", "local", "global")}
        params = (max_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree)
        local_tree, local_positions, global_tree, global_positions = self.draft_positions(rid, context)
        recent = local_tree.recent_draft(local_positions, max_tokens)
        alt = _tree_of_chains(local_tree.recent_alternatives(local_positions, max_tokens, alternatives), "alt")
        local = local_tree.speculate(local_positions, *params)
        local.source = "local"
        glob = global_tree.speculate(global_positions, *params) if global_tree is not None else Draft()
        glob.source = "global"
        return {"recent": recent, "alt": alt, "local": local, "global": glob}

    def draft_positions(self, rid: Hashable, context: Sequence[int]) -> tuple[Any, Any, Any, Any]:
        """(request tree, its positions, global tree, its positions) for drafting from `context` (non-empty);
        the global pair is (None, None) while no response is cached. For native drafting code."""
        req = self._request(rid)
        is_own = self._is_own(req, context)
        local_positions = req.tree.live_positions(0) if is_own else req.tree.match_positions(context)
        if not self._cached:
            return req.tree, local_positions, None, None
        return req.tree, local_positions, self.global_tree, self._global_positions(req, context, is_own)

    def _is_own(self, req: _Request, context: Sequence[int]) -> bool:
        """Whether `context` is the request's own prompt + output (so positions are incremental)."""
        return impl.is_own_context(req.tree, context, self.max_depth - 1)

    def _global_positions(self, req: _Request, context: Sequence[int], is_own: bool) -> Any:
        gtree = self.global_tree
        if is_own and req.global_version == gtree.version:
            return req.global_positions
        positions = gtree.match_positions(context)
        if is_own:
            req.global_positions, req.global_version = positions, gtree.version
        return positions

    def _request(self, rid: Hashable) -> _Request:
        req = self._requests.get(rid)
        if req is None:
            raise ValueError(f"request {rid!r} is not active (call start_request first)")
        return req

    def max_token_id(self) -> int | None:
        """The largest token id the cache holds (responses and idle sessions); None when it holds none.

        A cache is only valid for the vocabulary it was built with: a loader compares this with the
        model's vocabulary size before drafting from it."""
        largest = None
        for _, seq in (*self._responses(), *self._idle_session_tokens()):
            if seq:
                top = max(seq)
                largest = top if largest is None or top > largest else largest
        return largest

    # -------------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write the cache: config, cached responses (oldest first), then idle sessions (least recent first).

        The file is a JSON header line followed by the responses' and the sessions'
        tokens as little-endian int32. A session is saved as its tokens (last prompt
        + output) and rebuilt on load; sessions whose tree a live request holds are
        not saved (they are mid-turn). Request and session ids must be JSON values.
        The file is written to a temporary name and renamed, so a crash never leaves
        a truncated cache behind.
        """
        from thinkahead.token_spec.suffix_persist import write_cache  # here: only save / load need it

        write_cache(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, **overrides: Any) -> SuffixCache:
        """Rebuild a cache written by `save`; keyword arguments override its config (and set `clock`).

        Loaded sessions count as used at load time (idle clocks do not survive a
        restart). JSON stores tuple ids as lists; they come back as tuples. Files
        written before the memory cap had a default load with today's default.
        """
        from thinkahead.token_spec.suffix_persist import read_cache

        return read_cache(cls, path, overrides)


def prompt_extension(old: list[int], prompt_ids: Sequence[int]) -> list[int] | None:
    """The checked tokens `prompt_ids` adds after `old`, or None when it does not start with `old`.

    A list prompt is compared by value in one C-level list comparison (the old
    prefix was checked when it was first added), so only the new tokens are
    converted; other sequences (tuples, arrays) are converted whole first.
    """
    n = len(old)
    if not isinstance(prompt_ids, list):
        prompt_ids = _checked_tokens(prompt_ids, "prompt_ids")
    if len(prompt_ids) < n or prompt_ids[:n] != old:
        return None
    return _checked_tokens(prompt_ids[n:], "prompt_ids")
