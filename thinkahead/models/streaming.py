"""Incremental detokenisation for streaming: the text of a growing list of token ids, released in
pieces whose concatenation is exactly the final text.

A piece is released only when no later token can change it:
- a decoded tail that ends in U+FFFD (half a UTF-8 character, whose other bytes come with the next
  token) is held back;
- a trailing run of whitespace is held back (a tokenizer that cleans up spaces drops " " before a
  "," that comes next);
- text from the first stop string on is never released, and the longest tail that is a prefix of a
  stop string is held back until the next token says whether the stop string completes.

Decoding is incremental (as vLLM does it): only the tokens since the last settled point are decoded
again each round, so a long reply costs linear, not quadratic, time; `finish` checks the pieces
against the decoder's own final text.

The token ids travel with the text: each piece carries the ids pushed since the previous piece, less
an end-of-turn token or the token that completed a stop string (they are no content), so that
per-piece logprobs line up with the text as OpenAI's chunks do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


@dataclass(slots=True)
class TextPiece:
    text: str
    token_ids: list[int]


@dataclass(slots=True)
class TextStream:
    """Feed it the committed ids (`push`), then the final text (`finish`); both return the piece to send."""

    decode: Callable[[list[int]], str]  # the decoder's own decode of the whole output
    stops: Sequence[str] = ()
    stop_ids: frozenset[int] = frozenset()
    ids: list[int] = field(default_factory=list)
    sent: str = ""
    pending: list[int] = field(default_factory=list)  # ids whose text is not released yet
    stopped: bool = False  # a stop string or stop token was seen: nothing more is content
    text: str = ""  # the decoded text of ids[:read]
    prefix: int = 0  # ids[prefix:read] are decoded again with each new token, for context
    read: int = 0
    prefix_text: str = ""  # decode(ids[prefix:read])

    def push(self, new_ids: Sequence[int]) -> TextPiece | None:
        """The piece that `new_ids` make safe to send, or None."""
        if self.stopped:
            return None
        self.ids.extend(new_ids)
        self.pending.extend(new_ids)
        if self.pending and self.pending[-1] in self.stop_ids:
            self.pending.pop()
            self.stopped = True
        text = self._decoded()
        cut = min((i for i in (text.find(s) for s in self.stops if s) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
            if self.pending:
                self.pending.pop()  # the token that completed the stop string
            self.stopped = True
        if not self.stopped:
            text = self._held_back(text)
        return self._release(text)

    def finish(self, final_text: str) -> TextPiece | None:
        """The rest, given the generation's final text (which every piece sent so far begins)."""
        if not self.stopped and self.pending and self.pending[-1] in self.stop_ids:
            self.pending.pop()
        self.stopped = True
        if not final_text.startswith(self.sent):
            log.error("streamed text %r is not a prefix of the final text %r", self.sent[-40:], final_text[-40:])
            return self._piece(final_text[len(self.sent):]) if len(final_text) > len(self.sent) else None
        return self._release(final_text)

    def _decoded(self) -> str:
        """The text of all ids so far, decoding only those since `prefix`; a tail that ends in half a
        character is left out until the token that completes it comes."""
        window = self.decode(self.ids[self.prefix:])
        if len(window) <= len(self.prefix_text) or window.endswith(REPLACEMENT) \
                or not window.startswith(self.prefix_text):
            return self.text
        self.text += window[len(self.prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self.decode(self.ids[self.prefix:self.read])
        return self.text

    def _held_back(self, text: str) -> str:
        text = text.rstrip(REPLACEMENT).rstrip()
        for n in range(min(len(text), max((len(s) for s in self.stops), default=0)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stops):
                return text[:-n].rstrip()
        return text

    def _release(self, text: str) -> TextPiece | None:
        if not text.startswith(self.sent):  # an earlier piece changed on decoding more: wait for the final text
            return None
        if len(text) == len(self.sent) and not (self.stopped and self.pending):
            return None
        return self._piece(text[len(self.sent):])

    def _piece(self, delta: str) -> TextPiece:
        self.sent += delta
        piece = TextPiece(delta, self.pending)
        self.pending = []
        return piece
