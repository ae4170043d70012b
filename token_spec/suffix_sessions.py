"""The session half of `SuffixCache`: idle sessions' trees, their expiry and their limits.

A mixin, so the cache's public API stays one class; the state (`_sessions`,
`_held`, `_session_bytes`, `session_stats`) lives on the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator

from thinkahead.token_spec import suffix_impl as impl
from thinkahead.token_spec.suffix_eviction import request_tree_bytes

if TYPE_CHECKING:  # pragma: no cover
    from thinkahead.token_spec.suffix_cache import _Request


@dataclass(slots=True)
class _Session:
    """An idle session: the tree over its last prompt + output, waiting for the next turn."""

    tree: Any  # a SuffixTree of either implementation (suffix_impl)
    last_used: float
    bytes: int


@dataclass(slots=True)
class SessionStats:
    """What happened to sessions so far: how turns were served and how sessions ended."""

    session_starts: int = 0  # a request opened a session the cache did not hold
    session_extends: int = 0  # a request continued its session: only new tokens were added
    session_rebuilds: int = 0  # the prompt did not extend the session (an edited history)
    session_busy: int = 0  # another live request held the session's tree: built a private one
    sessions_ended: int = 0  # by end_session
    sessions_expired: int = 0  # idle longer than session_idle_s
    sessions_evicted: int = 0  # least recently used, over max_sessions or max_session_bytes
    extended_tokens: int = 0  # prompt tokens appended to continued sessions
    rebuilt_tokens: int = 0  # prompt tokens of session requests that were built from scratch


class SessionsMixin:
    """Idle sessions of a `SuffixCache` (see its docstring)."""

    _sessions: OrderedDict[Hashable, _Session]  # idle, least recently used first
    _held: dict[Hashable, Hashable]  # session id -> the live request holding its tree
    _requests: dict[Hashable, _Request]
    _session_bytes: int
    _request_depth: int
    tree_impl: str
    session_stats: SessionStats
    session_idle_s: float | None
    max_sessions: int | None
    max_session_bytes: int | None
    clock: Callable[[], float]

    @property
    def sessions(self) -> list[Hashable]:
        """Sessions the cache holds: idle ones (least recently used first), then those in use."""
        return list(self._sessions) + [s for s in self._held if s not in self._sessions]

    @property
    def session_bytes(self) -> int:
        """Estimated memory of the idle sessions' trees (what `max_session_bytes` caps)."""
        return self._session_bytes

    def end_session(self, session_id: Hashable) -> None:
        """Forget a session now; a live request of it keeps its tree until it stops, then drops it."""
        live = [req for req in self._requests.values() if req.session_id == session_id]
        if session_id not in self._sessions and not live:
            raise ValueError(f"session {session_id!r} is not held by the cache")
        self._discard_idle(session_id)
        self._held.pop(session_id, None)
        for req in live:
            req.session_id = None
        self.session_stats.sessions_ended += 1

    def expire_sessions(self) -> int:
        """End sessions idle longer than `session_idle_s` now; returns how many ended."""
        return self._expire(self.clock())

    def _discard_idle(self, session_id: Hashable) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._session_bytes -= session.bytes

    def _park(self, rid: Hashable, req: _Request) -> None:
        """Keep a stopped request's tree as its session's state (the latest stop wins)."""
        session_id = req.session_id
        if self._held.get(session_id) == rid:
            del self._held[session_id]
        self._discard_idle(session_id)
        self._add_idle(session_id, req.tree, self.clock())
        self._expire(self._sessions[session_id].last_used)
        self._enforce_session_limits()

    def _add_idle(self, session_id: Hashable, tree: Any, now: float) -> None:
        size = request_tree_bytes(tree)
        self._sessions[session_id] = _Session(tree=tree, last_used=now, bytes=size)
        self._session_bytes += size

    def _restore_session(self, session_id: Hashable, tokens: list[int], now: float) -> None:
        """An idle session read from a file (suffix_persist)."""
        self._add_idle(session_id, build_request_tree(self._request_depth, tokens, self.tree_impl), now)

    def _idle_session_tokens(self) -> Iterator[tuple[Hashable, list[int]]]:
        """(session id, last prompt + output) of each idle session, least recently used first."""
        for session_id, session in self._sessions.items():
            yield session_id, session.tree.tokens(0)

    def _expire(self, now: float) -> int:
        if self.session_idle_s is None:
            return 0
        expired = 0
        while self._sessions:
            session_id, session = next(iter(self._sessions.items()))
            if now - session.last_used <= self.session_idle_s:
                break  # least recently used first: the rest are fresher
            del self._sessions[session_id]
            self._session_bytes -= session.bytes
            expired += 1
        self.session_stats.sessions_expired += expired
        return expired

    def _enforce_session_limits(self) -> None:
        def over() -> bool:
            if self.max_sessions is not None and len(self._sessions) > self.max_sessions:
                return True
            return self.max_session_bytes is not None and self._session_bytes > self.max_session_bytes

        while self._sessions and over():
            _, session = self._sessions.popitem(last=False)
            self._session_bytes -= session.bytes
            self.session_stats.sessions_evicted += 1

    def session_tokens(self, session_id: Hashable) -> list[int]:
        """A copy of an idle session's tokens (its last prompt + output)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise ValueError(f"session {session_id!r} is not held idle by the cache")
        return list(session.tree.tokens(0))


def build_request_tree(max_depth: int, tokens: list[int], tree_impl: str | None = None) -> Any:
    """A request tree (one live sequence, id 0) over `tokens`, of the chosen implementation (suffix_impl)."""
    tree = impl.new_tree(max_depth, tree_impl)
    tree.extend(0, tokens)
    return tree
