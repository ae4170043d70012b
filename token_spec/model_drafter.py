"""Drafters that run a small model: `DraftModelDrafter`, and `HybridDrafter` (a model-free draft or the small
model's, whichever promises more tokens per second).

Split from drafters.py (which re-exports these names). What makes a small-model draft pay on a CPU,
where each drafted token is a whole forward of the small model:

- the output layer over part of the vocabulary (`draft_vocab.py`): the frequent ids and the context's;
- a draft that stops where the small model stops being sure (`min_prob`), so the rounds are long where
  it writes the obvious and short where it guesses;
- the small model's KV kept between the requests of one agent session: a turn's prompt extends the
  last one, so only what is new is read again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from thinkahead.token_spec.controller import CostCurve, moving_average
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.draft_vocab import DraftVocab, RequestVocab
from thinkahead.token_spec.engine import ForwardCall, Rounds, run_inline
from thinkahead.token_spec.names import MODEL_DRAFT_SOURCE, common_prefix_len
from thinkahead.token_spec.verify import SamplingParams, draw, target_probs


@dataclass(slots=True)
class _ModelRequest:
    session: Any  # the draft engine's EngineSession
    fed: list[int]  # tokens whose K/V are in `session`
    params: SamplingParams
    vocab: RequestVocab | None
    session_id: Hashable | None
    read: tuple[int, float] = (0, 0.0)  # the last draft's tokens read before drafting, and its seconds


class DraftModelDrafter:
    """A small model with the target's tokenizer drafts a chain autoregressively.

    Greedy requests get the draft model's argmax tokens (deterministic, verified
    as point masses). Sampling requests get tokens sampled from the draft model's
    own distribution q, which travels with the draft so the verifier can accept
    with min(1, p/q).

    `vocab`: the output layer keeps the ids below it and the context's ids (None: all of them).
    `min_prob`: a draft ends after the first token the small model gives less than this probability.
    `sessions`: how many agent sessions keep their KV between requests (the least recent is dropped).
    """

    model_free = False

    def __init__(self, engine, seed: int = 0, *, vocab: int | None = None, min_prob: float = 0.0,
                 sessions: int = 4) -> None:  # engine: an Engine (e.g. HFEngine)
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        if sessions < 0:
            raise ValueError(f"sessions must be >= 0, got {sessions}")
        import torch

        self.engine = engine
        self.name = MODEL_DRAFT_SOURCE
        self.min_prob = min_prob
        self.sessions = sessions
        head = engine.model.get_output_embeddings() if vocab is not None else None
        self.vocab = None if head is None or vocab >= engine.vocab_size else DraftVocab(head, engine.vocab_size, vocab)
        self._live: dict[Hashable, _ModelRequest] = {}
        self._saved: OrderedDict[Hashable, _ModelRequest] = OrderedDict()  # session id -> its last request
        self._generator = torch.Generator().manual_seed(seed)

    def start(
        self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> None:
        saved = self._saved.pop(session_id, None) if session_id is not None else None
        if saved is not None:  # the session's KV and kept ids; `propose` keeps what the new prompt shares
            self._live[rid] = _ModelRequest(saved.session, saved.fed, params, saved.vocab, session_id)
            return
        vocab = self.vocab.for_request() if self.vocab is not None else None
        self._live[rid] = _ModelRequest(self.engine.new_session(), [], params, vocab, session_id)

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        return run_inline(self.engine, self.propose_rounds(rid, context, budget))

    def propose_rounds(self, rid: Hashable, context: Sequence[int], budget: int) -> Rounds[Draft]:
        """`propose` as a coroutine: it yields each forward of the small model (a `ForwardCall` on its engine) and
        is sent its logits, so a scheduler runs the drafts of many sequences in one forward
        (models/engine/scheduler.py)."""
        import torch

        live = self._request(rid)
        if budget <= 0 or not context:
            return Draft(source=self.name)
        fed, session, vocab = live.fed, live.session, live.vocab
        keep = common_prefix_len(fed, context, limit=len(context) - 1)
        self.engine.truncate(session, keep)
        del fed[keep:]
        head = None
        if vocab is not None:  # every context token the small model reads passes here once
            vocab.add(context[keep:])
            head = vocab.logits
        began = time.perf_counter()
        logits = yield ForwardCall(session, list(context[keep:]), last_only=True, engine=self.engine, head=head)
        live.read = (len(context) - keep, time.perf_counter() - began)
        fed.extend(context[keep:])
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        probs: list[float] = []
        for step in range(budget):
            if step:
                logits = yield ForwardCall(session, [tokens[-1]], engine=self.engine, head=head)
                fed.append(tokens[-1])
            if live.params.greedy:
                dist = torch.softmax(logits[-1].float(), dim=-1)
                pick = int(dist.argmax())
            else:
                dist = target_probs(logits[-1:], live.params)[0]
                pick = draw(dist, self._generator)
                q_rows.append(dist if vocab is None else vocab.full(dist))
            tokens.append(pick if vocab is None else int(vocab.ids[pick]))
            probs.append(float(dist[pick]))
            if probs[-1] < self.min_prob:
                break
        q = torch.stack(q_rows) if q_rows else None
        return Draft.chain(tokens, probs, source=self.name, q=q)

    def unread(self, rid: Hashable, context: Sequence[int]) -> int:
        """How many tokens of `context` a draft would read before drafting (those past the small model's KV)."""
        return len(context) - common_prefix_len(self._request(rid).fed, context, limit=len(context) - 1)

    def last_read(self, rid: Hashable) -> tuple[int, float]:
        """The tokens request `rid`'s last draft read before drafting, and the seconds that took."""
        return self._request(rid).read

    def _request(self, rid: Hashable) -> _ModelRequest:
        live = self._live.get(rid)
        if live is None:
            raise ValueError(f"request {rid!r} was not started")
        return live

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        pass  # the next propose re-syncs the KV cache to the committed context

    def finish(self, rid: Hashable) -> None:
        live = self._live.pop(rid, None)
        if live is None or live.session_id is None or not self.sessions:
            return
        self._saved[live.session_id] = live
        while len(self._saved) > self.sessions:
            self._saved.popitem(last=False)

    def end_session(self, session_id: Hashable) -> None:
        """Drop a session's kept KV (the agent session is over)."""
        self._saved.pop(session_id, None)


# From this many tokens the small model reads before drafting (a prompt, a catch-up) its reading is timed apart
# from the round, per token; fewer (the last round's bonus token and unread draft) belong to the round.
READ_TIMED_FROM = 8
FREE_COST_PRIOR_SLOPE = 0.1  # until two lengths are timed: a CPU verifies k more tokens in ~(1 + 0.1 k) the time


@dataclass(slots=True)
class RoundRate:
    """Moving averages of one draft source's rounds: tokens committed per round, and its seconds from the
    draft's start to the next round (drafting, verification and the decoder's bookkeeping)."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0

    def update(self, tokens: int, seconds: float, smoothing: float) -> None:
        first = self.rounds == 0
        self.tokens = moving_average(None if first else self.tokens, tokens, smoothing)
        self.seconds = moving_average(None if first else self.seconds, seconds, smoothing)
        self.rounds += 1


class HybridDrafter:
    """Per round: the model-free draft, or the draft model's, whichever promises more tokens per second.

    A model-free draft's score is its expected number of accepted tokens, so it promises (score + 1)
    tokens, times how far model-free rounds have kept such promises (their tokens over their promises:
    scores run high where little repeats), in the seconds model-free rounds of its length have been
    taking (a `CostCurve`: a short draft verifies in a fraction of a long one's time on a CPU). A
    draft-model round promises what its rounds have been committing, in their seconds (the small
    model's forwards included), plus the time the small model takes to read the tokens committed since
    it last drafted (after a run of model-free rounds: a rewrite that copies a whole answer leaves it
    hundreds behind). An empty model-free draft is a plain step (one certain token in a 1-token verify's
    seconds): the small model drafts only where it promises more than that, so a catch-up that costs more
    than it pays is not read. Until both kinds of round have been timed, the model-free draft is taken when
    its score reaches `min_score` (never an empty one). (Taking it earlier, from as many tokens as the small
    model's rounds commit, was measured and dropped: a chain of thought's weak model-free rounds taught the
    adaptive controller short drafts, and the next refine turn's copy then ramped up from 1-token drafts.)
    The averages are the drafter's (every request's rounds teach them), like the combined drafter's
    acceptance rates; a request's own state is only when its round began.
    """

    def __init__(
        self,
        free: Any,
        model: DraftModelDrafter,
        min_score: float = 2.0,
        model_max_tokens: int | None = None,
        smoothing: float = 0.1,
    ) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.free = free  # a model-free drafter: SuffixDrafter, CombinedDrafter, ...
        self.model = model
        self.min_score = min_score
        self.model_max_tokens = model_max_tokens  # model drafts cost per token: cap them separately
        self.smoothing = smoothing
        self.name = "hybrid"
        self.model_free = False
        self.rates = {"free": RoundRate(), "draft-model": RoundRate()}  # model rounds: without the reading
        self.free_cost = CostCurve(smoothing, FREE_COST_PRIOR_SLOPE)  # a model-free round's seconds by draft length
        self.free_promised: float | None = None  # model-free rounds' (score + 1), averaged as rates["free"].tokens
        self.read_seconds: float | None = None  # per token the small model reads before drafting (a moving average)
        self._read: dict[Hashable, float] = {}  # rid -> seconds this round's model draft spent reading
        # rid -> (this round's source, when its draft began, the model-free draft it took or None)
        self._round: dict[Hashable, tuple[str, float, Draft | None]] = {}

    @property
    def rounds_by_source(self) -> dict[str, int]:
        return {source: rate.rounds for source, rate in self.rates.items()}

    def start(
        self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams, session_id: Hashable | None = None
    ) -> None:
        self.free.start(rid, prompt_ids, params, session_id=session_id)
        self.model.start(rid, prompt_ids, params, session_id=session_id)

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        return run_inline(self.model.engine, self.propose_rounds(rid, context, budget))

    def propose_free(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        """The model-free draft alone, for a sequence that shares its verify forward with others. Measured (1.5B
        target, 0.5B draft, 2 cores, 3 chains of thought at once): the small model's drafts took 11.4 s a chain
        against the model-free drafts' 8.7 s (alone: 4.8 s against 5.1 s): a batch already spends the compute a
        draft would save. The round teaches no rate (its time is the batch's)."""
        return self.free.propose(rid, context, budget)

    def propose_rounds(self, rid: Hashable, context: Sequence[int], budget: int) -> Rounds[Draft]:
        """`propose` as a coroutine that yields the small model's forwards (see `DraftModelDrafter.propose_rounds`)."""
        began = time.perf_counter()
        draft = self.free.propose(rid, context, budget)
        if self._prefers_free(rid, context, draft, budget):
            self._round[rid] = ("free", began, draft)
            return draft
        self._round[rid] = ("draft-model", began, None)
        if self.model_max_tokens is not None:
            budget = min(budget, self.model_max_tokens)
        proposed = yield from self.model.propose_rounds(rid, context, budget)
        tokens, seconds = self.model.last_read(rid)
        if tokens >= READ_TIMED_FROM:  # a catch-up (or a prompt): timed apart from the round
            self._read[rid] = seconds
            self.read_seconds = moving_average(self.read_seconds, seconds / tokens, self.smoothing)
        return proposed

    def _prefers_free(self, rid: Hashable, context: Sequence[int], draft: Draft, budget: int) -> bool:
        free, model = self.rates["free"], self.rates["draft-model"]
        if free.rounds and model.rounds and model.seconds > 0:
            unread = self.model.unread(rid, context)
            reading = unread * self.read_seconds if unread >= READ_TIMED_FROM and self.read_seconds else 0.0
            model_seconds = model.seconds + reading
            # an empty draft is a plain step: its one token is certain
            kept = free.tokens / self.free_promised if self.free_promised and len(draft) else 1.0
            return kept * (draft.score + 1) / self.free_cost(len(draft)) >= model.tokens / model_seconds
        return len(draft) > 0 and draft.score >= min(self.min_score, budget)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        self.free.observe(rid, accepted, proposed)
        self.model.observe(rid, accepted, proposed)
        source, began, free_draft = self._round.pop(rid, (None, 0.0, None))
        if source is not None:
            reading = self._read.pop(rid, 0.0) if source == "draft-model" else 0.0
            seconds = time.perf_counter() - began - reading
            if source == "free" and free_draft is not None:
                self.free_cost.update(len(free_draft), seconds)
                if not len(free_draft):  # a plain step: what a draft of nothing costs, not a model-free round
                    return
                self.free_promised = moving_average(self.free_promised, free_draft.score + 1, self.smoothing)
            self.rates[source].update(len(accepted), seconds, self.smoothing)

    def finish(self, rid: Hashable) -> None:
        self._round.pop(rid, None)
        self._read.pop(rid, None)
        self.free.finish(rid)
        self.model.finish(rid)
