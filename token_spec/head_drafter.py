"""`HeadDrafter`: the target's draft head (draft_head.py) after each verify, a model-free drafter beside it.

After every verify forward the decoder hands the drafter the hidden state of the row that chose the last token
it kept (`observe_hidden`, where the engine gives hidden states: `ForwardCall.on_hidden`). The next draft is then:

- the inner (model-free) drafter's alone, where it copies a long match (`long_match` tokens or more: copied text,
  which it drafts far deeper than the head; the head is not asked);
- the inner draft alone too where it expects as many accepted tokens as the head's chain (its `score`: a copy);
- else one tree of the head's chain (its guess after the bonus token, then its guesses after its own guesses while
  each is at least `min_prob` likely) and the inner draft, the nodes likeliest to be accepted first within the
  budget (`merge_drafts`: a head node is worth the product of the head's probabilities along its chain, an inner
  node its own value, a node both propose their noisy-or). Where the inner draft copies code or a template the
  head's guesses lose to it; in a chain of thought they win.

Every node's worth is calibrated (`ValueCalibration`, by kind of estimate and depth: what the nodes given such an
estimate came to, counted in `observe` over the nodes the target verified), so a draft's probs are the chances its
rows hold (`priced_drafts`): the decoder and the scheduler keep the rows that pay for their place in the forward.

Without a hidden state for this context (the first round after a prompt read from the prefix pool, tokens a grammar
forced, an engine without hidden states) the inner drafter drafts alone. Drafts never change what is generated:
the target verifies every token.

Each head guess is a one-token forward of `HeadEngine` (`propose_rounds` yields them as `ForwardCall`s naming it),
so a scheduler runs the guesses of every sequence in a batch together: one pass over the output rows for all of
them (1.5B: 1.3 ms a pass; guessed one sequence at a time, 3 chains of thought spent 1.6 s of a 14 s job on it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from thinkahead.token_spec.combined_drafter import merge_drafts
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.engine import ForwardCall, Rounds, run_inline
from thinkahead.token_spec.draft_head import DraftHead
from thinkahead.token_spec.draft_vocab import DraftVocab, RequestVocab
from thinkahead.token_spec.names import HEAD_SOURCE
from thinkahead.token_spec.value_calibration import COPY_MATCH, Pending, ValueCalibration
from thinkahead.token_spec.verify import SamplingParams

HEAD_DEPTH = 4  # head tokens per draft at most
HEAD_MIN_PROB = 0.5  # a head token after the first is drafted only this likely (its own estimate)
# The head's guesses read this many of the target's first output rows (plus the context's ids): every guess is a pass
# over them. Of the 1.5B's tokens in its answers to 200 GSM8K train problems, 2.2% are neither among the first 16384
# ids nor in the context, against 1.2% for 32768 (the head's own vocabulary) and 4.8% for 8192; half the rows made the
# README job's 3 chains of thought 1.4% faster.
HEAD_OUTPUT_IDS = 16384


@dataclass(slots=True)
class HeadSession:
    """One sequence's place in the head's chain: the feature the next guess reads, and the ids it picks among."""

    vocab: RequestVocab
    feature: torch.Tensor | None = None  # [hidden]: the target's hidden state, then the head's features
    at: int = -1  # the context length the target's hidden state belongs to
    pending: list[Pending] = field(default_factory=list)  # each node of its last draft, for `observe`


class HeadEngine:
    """The draft head as an engine of one-token forwards: `forward_batch` moves each call's session feature by the
    head (with its token's embedding) and returns the logits over the session's kept ids, every call's in one pass
    over the shared output rows (the context's own ids apart, per session)."""

    batches_rows = False  # a scheduler sends it every waiting call at once; it never prefills

    def __init__(self, head: DraftHead, embed: Callable[[torch.Tensor], torch.Tensor], vocab: DraftVocab) -> None:
        self.head, self.embed, self.vocab = head, embed, vocab
        self.vocab_size = vocab.vocab_size

    def forward(self, session: HeadSession, token_ids: list[int], parents: list[int] | None = None,
                last_only: bool = False) -> torch.Tensor:
        return self.forward_batch([ForwardCall(session, token_ids, parents, last_only)])[0]

    def forward_batch(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        for c in calls:
            if len(c.token_ids) != 1 or c.parents is not None or c.session.feature is None:
                raise ValueError("a draft head forward is one token after a session's feature")
        with torch.inference_mode():
            features = torch.stack([c.session.feature for c in calls]).float()
            tokens = torch.tensor([c.token_ids[0] for c in calls], dtype=torch.long)
            features = self.head(features, self.embed(tokens).float())
            base = self.vocab.base(features).float()
            out = []
            for i, c in enumerate(calls):
                c.session.feature = features[i]
                extra = c.session.vocab.extra_logits(features[i:i + 1])
                out.append(base[i:i + 1] if extra is None else torch.cat([base[i:i + 1], extra.float()], dim=-1))
        return out


class HeadDrafter:
    """Drafts with a trained draft head over the target's hidden states, or with `inner` (see the module doc)."""

    model_free = True  # a head token costs a small layer and a pass over the frequent ids' output rows
    wants_hidden = True
    priced_drafts = True  # a draft's probs are calibrated worths: a scheduler keeps the rows that pay
    name = "head"

    def __init__(self, head: DraftHead, embed: Callable[[torch.Tensor], torch.Tensor], output: torch.nn.Module,
                 vocab_size: int, inner: Any, *, depth: int = HEAD_DEPTH, min_prob: float = HEAD_MIN_PROB,
                 long_match: int = COPY_MATCH, output_ids: int = HEAD_OUTPUT_IDS) -> None:
        if depth < 1 or not 0.0 <= min_prob <= 1.0 or long_match < 1:
            raise ValueError(f"depth >= 1, min_prob in [0, 1] and long_match >= 1, got {depth}, {min_prob}, "
                             f"{long_match}")
        self.head, self.embed, self.inner = head, embed, inner
        self.vocab = DraftVocab(output, vocab_size, min(head.vocab, output_ids))
        self.engine = HeadEngine(head, embed, self.vocab)
        self.depth, self.min_prob, self.long_match = depth, min_prob, long_match
        self._requests: dict[Hashable, HeadSession] = {}
        self.calibration = ValueCalibration()  # what its drafts' estimates came to, over every request

    def start(self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams,
              session_id: Hashable | None = None) -> None:
        self.inner.start(rid, prompt_ids, params, session_id=session_id)
        request = HeadSession(self.vocab.for_request())
        request.vocab.add(prompt_ids)
        self._requests[rid] = request

    def observe_hidden(self, rid: Hashable, hidden: torch.Tensor, at: int) -> None:
        """The hidden state `[hidden]` of the row that chose the last token of a context of `at` tokens."""
        request = self._requests.get(rid)
        if request is not None:
            request.feature, request.at = hidden, at

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        return run_inline(self.engine, self.propose_rounds(rid, context, budget))

    def propose_rounds(self, rid: Hashable, context: Sequence[int], budget: int) -> Rounds[Draft]:
        """`propose` as a coroutine that yields each head guess as a forward of `engine` (a scheduler batches
        them across sequences)."""
        request = self._requests.get(rid)
        inner = self.inner.propose(rid, context, budget)
        if budget <= 0 or request is None:
            return inner
        request.pending = []
        inner = self.calibration.worths(inner, "copy" if inner.match_len >= self.long_match else "inner",
                                        request.pending)
        if request.feature is None or request.at != len(context) or inner.match_len >= self.long_match:
            return inner
        guess = HeadSession(request.vocab, request.feature)  # the guesses move its feature, not the request's
        tokens: list[int] = []
        path: list[float] = []  # the chance the head's chain holds up to each token, by its own estimates
        token = int(context[-1])
        for _ in range(min(budget, self.depth)):
            logits = yield ForwardCall(guess, [token], engine=self.engine)
            prob, j = torch.softmax(logits[-1], dim=-1).max(dim=-1)
            if tokens and float(prob) < self.min_prob:
                break
            token = int(request.vocab.ids[int(j)])
            tokens.append(token)
            path.append(float(prob) * (path[-1] if path else 1.0))
        chain = self.calibration.worths(Draft.chain(tokens, path), "head", request.pending)
        if inner.score >= chain.score:  # it expects as many accepted tokens as the head's chain: a copy, keep it whole
            return inner
        merged = merge_drafts([(chain, 1.0), (inner, 1.0)], budget, source=HEAD_SOURCE)
        if all(merged.token_ids[i] != tokens[0] for i, p in enumerate(merged.parents) if p < 0):
            merged.source = inner.source  # the inner draft won every place: the round is its
        return merged

    def probe(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        """A draft the decoder checks without verifying it (a round with no room): the inner drafter's, free to
        ask, where a head guess costs a pass over the output rows outside any batch."""
        return self.inner.propose(rid, context, budget)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        self.inner.observe(rid, accepted, proposed)
        request = self._requests.get(rid)
        if request is None:
            return
        request.vocab.add(accepted)
        self.calibration.count(request.pending, accepted, proposed)
        request.pending = []

    def finish(self, rid: Hashable) -> None:
        self.inner.finish(rid)
        self._requests.pop(rid, None)
