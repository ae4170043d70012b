"""Drafters: where guessed tokens come from. All speak one small protocol.

- `SuffixDrafter`: SuffixDecoding over a shared `SuffixCache` (the prompt, the
  output so far, and earlier outputs of every request and agent).
- `PromptLookupDrafter`: n-gram lookup in the context, as transformers' prompt
  lookup decoding.
- `DraftModelDrafter`: a small model with the same tokenizer, run autoregressively
  on its own KV cache.
- `HybridDrafter`: per round, the suffix draft when its score is high enough,
  else the draft model.
- `CombinedDrafter`: one tree from several model-free sources at once (the most
  recent context match as a deep chain, branches from the suffix trees), with
  the budget split by each source's acceptance rate learned online per session.

Every drafter's `start` takes an optional `session_id`: requests of one agent
session (each prompt extends the previous prompt + output) then reuse the
previous turn's index instead of rebuilding it over the whole prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Protocol, Sequence, runtime_checkable
import array

from thinkahead.token_spec.names import SUFFIX_MIN_TOKEN_PROB, SUFFIX_SPEC_FACTOR, SUFFIX_SPEC_OFFSET
from thinkahead.token_spec import suffix_impl
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.suffix_cache import SuffixCache, prompt_extension
from thinkahead.token_spec.suffix_drafts import check_spec_limits
from thinkahead.token_spec.verify import SamplingParams



@runtime_checkable
class Drafter(Protocol):
    """Proposes drafts for a request and learns from what the target kept.

    `model_free` drafters cost next to nothing to call, so the decoder may ask
    them for a draft it will not verify, just to see whether it would have hit (their `probe(rid, context,
    budget)` where they have one, else `propose`).
    A drafter that runs a model also has `propose_rounds(rid, context, budget)`: `propose` as a coroutine that
    yields its model's forwards (`ForwardCall`s naming the draft engine), so a scheduler batches them; and it may
    have `propose_free(rid, context, budget)`, its model-free draft, which the decoder takes instead while the
    sequence shares its verify forward with others.
    """

    name: str
    model_free: bool

    def start(
        self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> None: ...

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft: ...

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        """`accepted`: the tokens committed this round (kept drafts + the bonus)."""
        ...

    def finish(self, rid: Hashable) -> None: ...


class SuffixDrafter:
    """SuffixDecoding: drafts from the per-request and global suffix trees."""

    model_free = True

    def __init__(
        self,
        cache: SuffixCache | None = None,
        max_spec_factor: float = SUFFIX_SPEC_FACTOR,
        max_spec_offset: float = SUFFIX_SPEC_OFFSET,
        min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
        tree: bool = False,
    ) -> None:
        check_spec_limits(max_spec_factor, max_spec_offset, min_token_prob)
        self.cache = cache if cache is not None else SuffixCache()
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.tree = tree
        self.name = "suffix-tree" if tree else "suffix"

    def start(
        self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> None:
        self.cache.start_request(rid, prompt_ids, session_id=session_id)

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        return self.cache.speculate(
            rid,
            context,
            max_tokens=budget,
            max_spec_factor=self.max_spec_factor,
            max_spec_offset=self.max_spec_offset,
            min_token_prob=self.min_token_prob,
            tree=self.tree,
        )

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        self.cache.extend(rid, accepted)

    def finish(self, rid: Hashable) -> None:
        self.cache.stop_request(rid)


class PromptLookupDrafter:
    """Copies what followed the last n-gram's earlier occurrence in the context.

    As transformers' prompt lookup decoding: try n-gram sizes from `max_ngram`
    down to `min_ngram`; `prefer="first"` takes the earliest occurrence (as
    transformers does), `"recent"` (alias `"last"`) the latest one. Occurrences
    are indexed incrementally per request, so a lookup costs a dict access (a
    native `NgramIndex` where the suffix tree's extension loads: the same drafts); a
    session's index is kept between its requests and extended with each turn's
    new tokens. Kept indexes are capped by count (`max_sessions`) and by their
    total tokens (`max_session_tokens`; an index costs roughly 100-200 bytes per
    token and n-gram size), least recently used dropped first.
    """

    model_free = True

    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
        prefer: str = "first",
        max_sessions: int = 256,
        max_session_tokens: int = 2_000_000,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if prefer not in ("first", "recent", "last"):
            raise ValueError(f"prefer must be 'first' or 'recent' (alias 'last'), got {prefer!r}")
        if max_sessions < 0 or max_session_tokens < 0:
            raise ValueError(f"session caps must be >= 0, got {max_sessions} sessions, {max_session_tokens} tokens")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.prefer = "recent" if prefer == "last" else prefer
        self.max_sessions = max_sessions
        self.max_session_tokens = max_session_tokens
        self._session_tokens = 0  # tokens held by the kept session indexes
        self.name = "prompt-lookup"
        self._tokens: dict[Hashable, list[int]] = {}
        # rid -> n-gram -> end positions (exclusive) of its occurrences, in order (or a native NgramIndex)
        self._index: dict[Hashable, Any] = {}
        self._session_of: dict[Hashable, Hashable] = {}
        self._sessions: OrderedDict[Hashable, tuple[list[int], Any]] = OrderedDict()

    def start(
        self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> None:
        self._session_of.pop(rid, None)
        if session_id is not None and self.max_sessions > 0:
            self._session_of[rid] = session_id
            saved = self._sessions.pop(session_id, None)
            if saved is not None:
                self._session_tokens -= len(saved[0])
                new = prompt_extension(saved[0], prompt_ids)
                if new is not None:  # the prompt continues the session: index only the new tokens
                    self._tokens[rid], self._index[rid] = saved
                    self._append(rid, new)
                    return
        self._tokens[rid] = []
        self._index[rid] = self._new_index()
        self._append(rid, prompt_ids)

    def _new_index(self) -> Any:
        """An empty n-gram index: the native one (`NgramIndex`, the same lookups) where the extension loads."""
        native = suffix_impl.native_module()
        if native is not None and self.max_ngram <= native.NgramIndex.MAX_N:
            return native.NgramIndex(self.min_ngram, self.max_ngram)
        return {}

    def _append(self, rid: Hashable, token_ids: Sequence[int]) -> None:
        tokens = self._tokens[rid]
        first_new = len(tokens)
        if type(token_ids) is list:  # integers in one C-level pass (array takes ints and __index__ objects)
            try:
                tokens.extend(array.array("q", token_ids).tolist())
            except (TypeError, OverflowError):  # floats and the like: `int` converts them, as below
                tokens.extend(int(t) for t in token_ids)
        else:
            tokens.extend(int(t) for t in token_ids)
        self._index_ngrams(tokens, self._index[rid], first_new)

    def _index_ngrams(self, tokens: list[int], index: Any, first_new: int) -> None:
        """Record the n-grams ending at each of tokens[first_new:]."""
        if not isinstance(index, dict):  # native
            index.extend(tokens[first_new:])
            return
        for end in range(first_new + 1, len(tokens) + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index.setdefault(tuple(tokens[end - n:end]), []).append(end)

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        tokens = self._tokens.get(rid)
        if tokens is None:
            raise ValueError(f"request {rid!r} was not started")
        if len(context) != len(tokens) or list(context[-self.max_ngram:]) != tokens[-self.max_ngram:]:
            tokens = list(context)  # a foreign context: index it on the fly
            index: Any = {}
            self._index_ngrams(tokens, index, 0)
        else:
            index = self._index[rid]
        if budget <= 0:
            return Draft(source=self.name)
        if not isinstance(index, dict):  # native: the same choice, made in one call
            end, n = index.find(self.prefer == "recent")
            if end < 0:
                return Draft(source=self.name)
            return Draft.chain(tokens[end:end + budget], match_len=n, source=self.name)
        last = len(tokens)
        for n in range(min(self.max_ngram, last - 1), self.min_ngram - 1, -1):
            ends = index.get(tuple(tokens[last - n:]))
            if not ends:
                continue
            candidates = ends if self.prefer == "first" else reversed(ends)
            for end in candidates:
                if end < last:  # not the occurrence that is the context's own tail
                    return Draft.chain(tokens[end:end + budget], match_len=n, source=self.name)
        return Draft(source=self.name)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        self._append(rid, accepted)

    def finish(self, rid: Hashable) -> None:
        tokens = self._tokens.pop(rid, None)
        index = self._index.pop(rid, None)
        session_id = self._session_of.pop(rid, None)
        if session_id is None or tokens is None or index is None:
            return
        self.end_session(session_id)
        self._sessions[session_id] = (tokens, index)  # the latest finished request of a session wins
        self._session_tokens += len(tokens)
        while self._sessions and (
            len(self._sessions) > self.max_sessions or self._session_tokens > self.max_session_tokens
        ):
            _, (dropped, _) = self._sessions.popitem(last=False)
            self._session_tokens -= len(dropped)

    def end_session(self, session_id: Hashable) -> None:
        """Forget a session's index (a no-op for a session it does not hold)."""
        saved = self._sessions.pop(session_id, None)
        if saved is not None:
            self._session_tokens -= len(saved[0])


# The combined drafter lives in its own module; these names stay importable from here.
from thinkahead.token_spec.combined_drafter import (
    COMBINED_SOURCES,
    CombinedDrafter,
    SourceRate,
    followed,
    merge_drafts,
)
from thinkahead.token_spec.model_drafter import DraftModelDrafter, HybridDrafter

__all__ = [
    "COMBINED_SOURCES", "CombinedDrafter", "DraftModelDrafter", "Drafter", "HybridDrafter", "PromptLookupDrafter",
    "SourceRate", "SuffixDrafter", "followed", "merge_drafts",
]
