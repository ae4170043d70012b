"""Keeps the KV caches of recent generations so that a prompt sharing their prefix skips that prefill.

Why: a step loop, a judge and an agent all send prompts that extend an earlier one (the problem and
the steps so far, then one more step). Re-reading that prefix costs far more than a decode step on
a CPU. The pool holds a few finished sessions with the token ids their KV covers; `acquire` hands
out the one sharing the longest prefix with the new prompt, cropped to that prefix (SGLang's radix
cache does the same on a GPU, for every request at once).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

from thinkahead.token_spec.names import common_prefix_len


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
        logits. The session is removed from the pool until `release`.
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
            self._entries.remove(best)
            self.hits += 1
            self.reused_tokens += best_len
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

