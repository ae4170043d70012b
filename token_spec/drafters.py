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
from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence, runtime_checkable

import torch
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.names import common_prefix_len
from thinkahead.token_spec.suffix_cache import SuffixCache, prompt_extension
from thinkahead.token_spec.verify import SamplingParams, children_of, target_probs


@runtime_checkable
class Drafter(Protocol):
    """Proposes drafts for a request and learns from what the target kept.

    `model_free` drafters cost next to nothing to call, so the decoder may ask
    them for a draft it will not verify, just to see whether it would have hit.
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
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        tree: bool = False,
    ) -> None:
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
    are indexed incrementally per request, so a lookup costs a dict access; a
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
        # rid -> n-gram -> end positions (exclusive) of its occurrences, in order
        self._index: dict[Hashable, dict[tuple[int, ...], list[int]]] = {}
        self._session_of: dict[Hashable, Hashable] = {}
        self._sessions: OrderedDict[Hashable, tuple[list[int], dict[tuple[int, ...], list[int]]]] = OrderedDict()

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
        self._index[rid] = {}
        self._append(rid, prompt_ids)

    def _append(self, rid: Hashable, token_ids: Sequence[int]) -> None:
        tokens = self._tokens[rid]
        first_new = len(tokens)
        tokens.extend(int(t) for t in token_ids)
        self._index_ngrams(tokens, self._index[rid], first_new)

    def _index_ngrams(self, tokens: list[int], index: dict[tuple[int, ...], list[int]], first_new: int) -> None:
        """Record the n-grams ending at each of tokens[first_new:]."""
        for end in range(first_new + 1, len(tokens) + 1):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index.setdefault(tuple(tokens[end - n:end]), []).append(end)

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        tokens = self._tokens.get(rid)
        if tokens is None:
            raise ValueError(f"request {rid!r} was not started")
        if len(context) != len(tokens) or list(context[-self.max_ngram:]) != tokens[-self.max_ngram:]:
            tokens = list(context)  # a foreign context: index it on the fly
            index: dict[tuple[int, ...], list[int]] = {}
            self._index_ngrams(tokens, index, 0)
        else:
            index = self._index[rid]
        if budget <= 0:
            return Draft(source=self.name)
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


class DraftModelDrafter:
    """A small model with the target's tokenizer drafts a chain autoregressively.

    Greedy requests get the draft model's argmax tokens (deterministic, verified
    as point masses). Sampling requests get tokens sampled from the draft model's
    own distribution q, which travels with the draft so the verifier can accept
    with min(1, p/q).
    """

    model_free = False

    def __init__(self, engine, seed: int = 0) -> None:  # engine: an Engine (e.g. HFEngine)
        self.engine = engine
        self.name = "draft-model"
        self._sessions: dict[Hashable, object] = {}
        self._fed: dict[Hashable, list[int]] = {}  # tokens whose K/V are in the draft session
        self._params: dict[Hashable, SamplingParams] = {}
        self._generator = torch.Generator().manual_seed(seed)

    def start(
        self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> None:
        # Sessions change nothing here: the draft model's KV is rebuilt per request.
        self._sessions[rid] = self.engine.new_session()
        self._fed[rid] = []
        self._params[rid] = params

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        session = self._sessions.get(rid)
        if session is None:
            raise ValueError(f"request {rid!r} was not started")
        if budget <= 0 or not context:
            return Draft(source=self.name)
        fed = self._fed[rid]
        keep = common_prefix_len(fed, context, limit=len(context) - 1)
        self.engine.truncate(session, keep)
        del fed[keep:]
        logits = self.engine.forward(session, list(context[keep:]), last_only=True)
        fed.extend(context[keep:])
        params = self._params[rid]
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        probs: list[float] = []
        for step in range(budget):
            if step:
                logits = self.engine.forward(session, [tokens[-1]])
                fed.append(tokens[-1])
            if params.greedy:
                dist = torch.softmax(logits[-1].float(), dim=-1)
                token = int(dist.argmax())
            else:
                dist = target_probs(logits[-1:], params)[0]
                token = int(torch.multinomial(dist, 1, generator=self._generator))
                q_rows.append(dist)
            tokens.append(token)
            probs.append(float(dist[token]))
        q = torch.stack(q_rows) if q_rows else None
        return Draft.chain(tokens, probs, source=self.name, q=q)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        pass  # the next propose re-syncs the KV cache to the committed context

    def finish(self, rid: Hashable) -> None:
        self._sessions.pop(rid, None)
        self._fed.pop(rid, None)
        self._params.pop(rid, None)


class HybridDrafter:
    """Per round: the suffix draft if its score reaches `min_score`, else the draft model.

    A suffix draft's score is its expected number of accepted tokens, so a high
    score means a confident, free guess; otherwise the draft model's (costly but
    broadly right) guess is worth its time.
    """

    def __init__(
        self,
        suffix: SuffixDrafter,
        model: DraftModelDrafter,
        min_score: float = 2.0,
        model_max_tokens: int | None = None,
    ) -> None:
        self.suffix = suffix
        self.model = model
        self.min_score = min_score
        self.model_max_tokens = model_max_tokens  # model drafts cost per token: cap them separately
        self.name = "hybrid"
        self.model_free = False
        self.rounds_by_source = {"suffix": 0, "draft-model": 0}

    def start(
        self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> None:
        self.suffix.start(rid, prompt_ids, params, session_id=session_id)
        self.model.start(rid, prompt_ids, params)

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        draft = self.suffix.propose(rid, context, budget)
        if draft.score >= min(self.min_score, budget) and len(draft):
            self.rounds_by_source["suffix"] += 1
            return draft
        self.rounds_by_source["draft-model"] += 1
        if self.model_max_tokens is not None:
            budget = min(budget, self.model_max_tokens)
        return self.model.propose(rid, context, budget)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        self.suffix.observe(rid, accepted, proposed)
        self.model.observe(rid, accepted, proposed)

    def finish(self, rid: Hashable) -> None:
        self.suffix.finish(rid)
        self.model.finish(rid)


COMBINED_SOURCES = ("recent", "alt", "local", "global")


@dataclass(slots=True)
class SourceRate:
    """Online estimate of how often a source's next drafted token is right.

    Discounted hits over discounted tries: after each round, a source's own draft
    is walked along the tokens the target committed; every token it had right is
    a hit and a try, the first token it had wrong is one more try. Where its draft
    ran out, or the committed tokens did, nothing is known (censored, not a miss),
    so the ratio estimates the per-token acceptance rate of a geometric model.
    """

    hits: float = 1.0
    tries: float = 2.0

    @property
    def rate(self) -> float:
        return self.hits / self.tries if self.tries > 0 else 0.0

    def update(self, hits: int, missed: int, decay: float) -> None:
        self.hits = decay * self.hits + hits
        self.tries = decay * self.tries + hits + missed


@dataclass(slots=True)
class _CombinedRequest:
    key: tuple[str, Hashable]  # ("session", id) or ("request", rid): whose rates these are
    rates: dict[str, SourceRate]  # rate key -> estimate, shared by the requests of one session
    last: dict[str, Draft] = field(default_factory=dict)  # rate key -> that source's draft from the last proposal


class CombinedDrafter:
    """One draft tree from several model-free sources, split by their learned acceptance.

    Sources (see `SuffixCache.speculate_sources`): "recent", a deep chain copied
    from the most recent earlier occurrence of the longest context match (prompt
    lookup preferring the latest copy); "alt", other copies (older occurrences,
    shorter matches) as a small tree; "local" and "global", SuffixDecoding's
    frequency trees over this request and over earlier outputs.

    Each source has a per-token acceptance rate r learned online (`SourceRate`)
    per session (per request without one) and per match-length band
    (`match_bands`: a 40-token match is copied text, a 1-token match a guess),
    starting from the drafter-wide (pooled) rates. A drafted node at depth d whose
    source gives it path probability p is worth r^d * p; nodes several sources
    propose combine as a noisy-or; the `budget` most valuable nodes form the tree
    (`merge_drafts`). A trusted source thus gets a deep chain while the others add
    short branches near the root: an anisotropic tree, verified in one forward pass.
    """

    model_free = True

    def __init__(
        self,
        cache: SuffixCache | None = None,
        *,
        sources: Sequence[str] = COMBINED_SOURCES,
        max_spec_factor: float = 8.0,
        max_spec_offset: float = 8.0,
        min_token_prob: float = 0.05,
        decay: float = 0.95,
        prior_weight: float = 4.0,
        min_score: float = 0.0,
        max_tracked: int = 4096,
        match_bands: Sequence[int] = (1, 2, 4, 8, 16, 32),
        alternatives: int = 3,
    ) -> None:
        unknown = [src for src in sources if src not in COMBINED_SOURCES]
        if unknown or not sources:
            raise ValueError(f"sources must be a non-empty subset of {COMBINED_SOURCES}, got {list(sources)}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be positive, got {prior_weight}")
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1, got {max_tracked}")
        if list(match_bands) != sorted(set(match_bands)) or any(b < 1 for b in match_bands):
            raise ValueError(f"match_bands must be increasing match lengths >= 1, got {list(match_bands)}")
        self.cache = cache if cache is not None else SuffixCache()
        self.sources = tuple(sources)
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.decay = decay
        self.prior_weight = prior_weight
        self.min_score = min_score
        self.max_tracked = max_tracked
        self.match_bands = tuple(match_bands)
        self.alternatives = alternatives
        self.name = "combined"
        self.pooled: dict[str, SourceRate] = {}  # rate key -> every observation; the prior for new sessions
        self._live: dict[Hashable, _CombinedRequest] = {}
        self._rates: OrderedDict[Hashable, dict[str, SourceRate]] = OrderedDict()  # session or request key

    def start(
        self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> None:
        self.cache.start_request(rid, prompt_ids, session_id=session_id)
        key = ("session", session_id) if session_id is not None else ("request", rid)
        rates = self._rates.pop(key, None)
        if rates is None:
            rates = {}
        self._rates[key] = rates  # most recently used last
        while len(self._rates) > self.max_tracked:
            self._rates.popitem(last=False)
        self._live[rid] = _CombinedRequest(key=key, rates=rates)

    def rate_key(self, source: str, match_len: int) -> str:
        """Which estimate a draft feeds: its source and its match-length band ("recent@8": matches of 8 to 15)."""
        band = 0
        for lo in self.match_bands:
            if match_len >= lo:
                band = lo
        return f"{source}@{band}" if self.match_bands else source

    def _rate(self, rates: dict[str, SourceRate], key: str) -> SourceRate:
        """A session's estimate, first made from the pooled one, its weight capped so the session soon dominates."""
        rate = rates.get(key)
        if rate is None:
            pooled = self.pooled.setdefault(key, SourceRate())
            scale = min(1.0, self.prior_weight / pooled.tries) if pooled.tries > 0 else 1.0
            rate = rates[key] = SourceRate(pooled.hits * scale, pooled.tries * scale)
        return rate

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        live = self._request(rid)
        if budget <= 0:
            live.last = {}
            return Draft(source=self.name)
        drafts = self.cache.speculate_sources(
            rid,
            context,
            max_tokens=budget,
            max_spec_factor=self.max_spec_factor,
            max_spec_offset=self.max_spec_offset,
            min_token_prob=self.min_token_prob,
            tree=True,
            alternatives=self.alternatives,
        )
        live.last = {self.rate_key(src, drafts[src].match_len): drafts[src] for src in self.sources}
        weighted = [(draft, self._rate(live.rates, key).rate) for key, draft in live.last.items()]
        return merge_drafts(weighted, budget, min_score=self.min_score, source=self.name)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        live = self._request(rid)
        self.cache.extend(rid, accepted)
        for key, draft in live.last.items():
            hits, missed = followed(draft, accepted)
            if hits or missed:
                self._rate(live.rates, key).update(hits, missed, self.decay)
                self.pooled.setdefault(key, SourceRate()).update(hits, missed, self.decay)
        live.last = {}

    def finish(self, rid: Hashable) -> None:
        live = self._live.pop(rid, None)
        if live is not None and live.key[0] == "request":
            self._rates.pop(live.key, None)  # a lone request's rates die with it; a session's are kept
        self.cache.stop_request(rid)

    def rates(self, rid: Hashable) -> dict[str, float]:
        """The acceptance estimates of a live request (its session's), by rate key."""
        return {key: r.rate for key, r in sorted(self._request(rid).rates.items())}

    def _request(self, rid: Hashable) -> _CombinedRequest:
        live = self._live.get(rid)
        if live is None:
            raise ValueError(f"request {rid!r} was not started")
        return live


def followed(draft: Draft, actual: Sequence[int]) -> tuple[int, int]:
    """(tokens of `actual` the draft tree predicted in a row, 1 if it then guessed wrong else 0)."""
    if not draft.token_ids:
        return 0, 0
    children = children_of(draft.parents)
    tokens = draft.token_ids
    node, n = -1, 0
    while n < len(actual):
        kids = children.get(node)
        if not kids:
            return n, 0  # the draft ended: no guess to judge
        want = actual[n]
        nxt = next((c for c in kids if tokens[c] == want), None)
        if nxt is None:
            return n, 1
        node, n = nxt, n + 1
    return n, 0  # the committed tokens ended first


def merge_drafts(
    weighted: Sequence[tuple[Draft, float]], budget: int, min_score: float = 0.0, source: str = "combined"
) -> Draft:
    """Merge drafts into one tree of at most `budget` nodes, the most valuable first.

    `weighted` pairs each draft with its source's per-token acceptance rate r. A
    node at depth d (1 = next token) whose draft probability is p is worth
    r^d * p; a node that several drafts share (same token after the same path)
    is worth 1 - prod(1 - value), a noisy-or; a node is never worth more than its
    parent. The nodes are returned in decreasing value (parents before children,
    so `Draft.truncated` keeps the best subtree), their values as `probs`.
    """
    if budget <= 0:
        return Draft(source=source)
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    miss: list[float] = []  # product of (1 - value) over the drafts proposing the node
    match_len = 0
    for draft, rate in weighted:
        if not draft.token_ids or rate <= 0.0:
            continue
        match_len = max(match_len, draft.match_len)
        mapped: list[int] = []
        for i, (token, parent) in enumerate(zip(draft.token_ids, draft.parents)):
            up = -1 if parent < 0 else mapped[parent]
            d = 1 if up < 0 else depth[up] + 1
            value = rate ** d * (draft.probs[i] if i < len(draft.probs) else 1.0)
            node = index.get((up, token))
            if node is None:
                node = index[(up, token)] = len(tokens)
                tokens.append(token)
                parents.append(up)
                depth.append(d)
                miss.append(1.0)
            miss[node] *= 1.0 - min(value, 1.0)
            mapped.append(node)
    values = [1.0 - m for m in miss]
    for node, up in enumerate(parents):  # nodes are created after their parents
        if up >= 0 and values[node] > values[up]:
            values[node] = values[up]
    order = sorted(range(len(tokens)), key=lambda k: (-values[k], depth[k], k))
    chosen = [k for k in order[:budget] if values[k] > min_score]
    position = {k: i for i, k in enumerate(chosen)}
    probs = [values[k] for k in chosen]
    return Draft(
        token_ids=[tokens[k] for k in chosen],
        parents=[-1 if parents[k] < 0 else position[parents[k]] for k in chosen],
        probs=probs,
        score=float(sum(probs)),
        match_len=match_len,
        source=source,
    )
