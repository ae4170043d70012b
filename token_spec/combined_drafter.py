"""`CombinedDrafter`: one draft tree from several model-free sources, split by learned acceptance.

Split from drafters.py (which re-exports these names): the sources come from
`SuffixCache.speculate_sources`, and `merge_drafts` folds them into one tree.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from thinkahead.token_spec import suffix_impl
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.suffix_drafts import _check_draft_args, check_spec_limits
from thinkahead.token_spec.verify import SamplingParams, children_of

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
    # The native path keeps the drafts in C++ (`_suffix_native.Sources`) and maps rate key -> source index.
    native: Any = None
    native_keys: dict[str, int] = field(default_factory=dict)


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
        check_spec_limits(max_spec_factor, max_spec_offset, min_token_prob)
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
        top = self.match_bands[-1] if self.match_bands else 0
        # rate_key(source, m) for m in 0..top (longer matches share top's key), by source index.
        self._keys = [[self.rate_key(src, m) for m in range(top + 1)] for src in COMBINED_SOURCES]
        self._which = [COMBINED_SOURCES.index(src) for src in self.sources]

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
        live.native = None
        if budget <= 0:
            live.last = {}
            return Draft(source=self.name)
        if self.cache.tree_impl == "native" and context:
            return self._propose_native(live, rid, context, budget)
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

    def _propose_native(self, live: _CombinedRequest, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        """`propose` with the four sources drafted and merged in C++: the same draft, bit for bit."""
        positions = self.cache.draft_positions(rid, context)
        _check_draft_args(budget, self.max_spec_factor, self.min_token_prob, self.max_spec_offset)  # as speculate_sources
        sources = suffix_impl.native_module().speculate_sources(
            *positions, budget, self.max_spec_factor, self.max_spec_offset, self.min_token_prob, True,
            self.alternatives,
        )
        lens = sources.match_lens
        keys, top = self._keys, len(self._keys[0]) - 1
        live.native, live.last = sources, {}
        live.native_keys = {keys[i][min(lens[i], top)]: i for i in self._which}
        rates = [self._rate(live.rates, key).rate for key in live.native_keys]
        return sources.merge(list(live.native_keys.values()), rates, budget, self.min_score, self.name)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        live = self._request(rid)
        self.cache.extend(rid, accepted)
        if live.native is not None:
            results = live.native.followed(accepted)
            outcomes = [(key, results[i]) for key, i in live.native_keys.items()]
            live.native = None
        else:
            outcomes = [(key, followed(draft, accepted)) for key, draft in live.last.items()]
        for key, (hits, missed) in outcomes:
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
