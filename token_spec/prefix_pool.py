"""Keeps the KV caches of recent generations so that a prompt sharing their prefix skips that prefill.

Why: a step loop, a judge and an agent all send prompts that extend an earlier one (the problem and
the steps so far, then one more step). Re-reading that prefix costs far more than a decode step on
a CPU. The pool holds a few finished sessions with the token ids their KV covers; `acquire` hands
out the one sharing the longest prefix with the new prompt, cropped to that prefix (SGLang's radix
cache does the same on a GPU, for every request at once). Where the prompt shares only part of a cached
context (`COPY_REMAINDER` tokens or more of it would be cut) and the engine can copy a session's prefix
(`copy_prefix`), it hands out a copy and keeps the context whole: with runs in flight, a run's next step then
finds its own context where another run's prompt matched only the chat template's first tokens (20 GSM8K
chains 8 at a time: 364 of one run's 1,244 reused tokens were lost that way).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

from thinkahead.token_spec.names import common_prefix_len

COPY_REMAINDER = 32  # a cached context that would lose this many tokens or more is copied from, not cut


@dataclass(slots=True)
class _Entry:
    session: Any
    tokens: list[int]


class KVPrefixPool:
    """Up to `max_sessions` cached sessions of one engine holding `max_tokens` tokens in all (None: no bound),
    least recently used evicted first."""

    def __init__(self, engine: Any, max_sessions: int = 4, max_tokens: int | None = None) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        self.engine = engine
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._entries: list[_Entry] = []  # most recently used first
        self._lock = threading.Lock()
        self.hits = 0
        self.reused_tokens = 0

    def acquire(self, prompt: Sequence[int]) -> tuple[Any, int]:
        """A session whose KV holds the longest cached prefix of `prompt[:-1]`, and that prefix's length.

        The last prompt token is never taken from the cache: the decoder feeds it to get the first
        logits. The session is removed from the pool until `release`, unless it is a copy of a longer context's
        prefix (which stays pooled whole).
        """
        limit = len(prompt) - 1
        with self._lock:
            best, best_len = None, 0
            for entry in self._entries:
                n = common_prefix_len(entry.tokens, prompt, limit)
                if n > best_len:
                    best, best_len = entry, n
            if best is None:
                return self.engine.new_session(), 0
            self.hits += 1
            self.reused_tokens += best_len
            copy = getattr(self.engine, "copy_prefix", None)
            if copy is not None and len(best.tokens) - best_len >= COPY_REMAINDER:
                return copy(best.session, best_len), best_len  # under the lock: no one cuts it meanwhile
            self._entries.remove(best)
        self.engine.truncate(best.session, best_len)
        return best.session, best_len

    def release(self, session: Any, tokens: Sequence[int]) -> None:
        """Return `session`, whose KV covers exactly `tokens`, to the pool."""
        if session.length != len(tokens):
            raise ValueError(f"session holds {session.length} tokens but {len(tokens)} token ids were given")
        if not tokens:
            return
        with self._lock:
            self._entries.insert(0, _Entry(session, list(tokens)))
            del self._entries[self.max_sessions :]
            if self.max_tokens is not None:
                held = 0
                for k, entry in enumerate(self._entries):
                    held += len(entry.tokens)
                    if held > self.max_tokens:
                        del self._entries[k:]
                        break

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

