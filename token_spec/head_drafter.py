"""`HeadDrafter`: the target's draft head (draft_head.py) after each verify, a model-free drafter beside it.

After every verify forward the decoder hands the drafter the hidden state of the row that chose the last token
it kept (`observe_hidden`, where the engine gives hidden states: `ForwardCall.on_hidden`). The next draft is then:

- the inner (model-free) drafter's alone, where it copies a long match (`long_match` tokens or more: copied text,
  which it drafts far deeper than the head) or where its first token is the head's own guess (it goes on from
  there);
- else a tree: the head's chain (its guess after the bonus token, then its guesses after its own guesses while
  each is at least `min_prob` likely; the first is always kept: the head is right about two times in three there)
  and, beside it within the budget, the inner draft (on a CPU a few more rows cost little beside a forward).

Without a hidden state for this context (the first round after a prompt read from the prefix pool, tokens a grammar
forced, an engine without hidden states) the inner drafter drafts alone. Drafts never change what is generated:
the target verifies every token.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.draft_head import DraftHead
from thinkahead.token_spec.draft_vocab import DraftVocab, RequestVocab
from thinkahead.token_spec.names import HEAD_SOURCE
from thinkahead.token_spec.verify import SamplingParams

HEAD_DEPTH = 4  # head tokens per draft at most
HEAD_MIN_PROB = 0.5  # a head token after the first is drafted only this likely (its own estimate)
HEAD_LONG_MATCH = 8  # an inner draft from a context match this long or longer is taken over the head's


@dataclass(slots=True)
class _Request:
    vocab: RequestVocab
    hidden: torch.Tensor | None = None
    at: int = -1  # the context length the hidden state belongs to


def beside(first: Draft, second: Draft) -> Draft:
    """One tree of two drafts from the same context: `first`'s nodes, then `second`'s (its roots are roots too)."""
    if not len(second):
        return first
    shift = len(first)
    return Draft(token_ids=first.token_ids + second.token_ids,
                 parents=first.parents + [p if p < 0 else p + shift for p in second.parents],
                 probs=first.probs + second.probs, score=first.score + second.score, source=first.source)


class HeadDrafter:
    """Drafts with a trained draft head over the target's hidden states, or with `inner` (see the module doc)."""

    model_free = True  # a head token costs a small layer and a pass over the frequent ids' output rows
    wants_hidden = True
    name = "head"

    def __init__(self, head: DraftHead, embed: Callable[[torch.Tensor], torch.Tensor], output: torch.nn.Module,
                 vocab_size: int, inner: Any, *, depth: int = HEAD_DEPTH, min_prob: float = HEAD_MIN_PROB,
                 long_match: int = HEAD_LONG_MATCH) -> None:
        if depth < 1 or not 0.0 <= min_prob <= 1.0 or long_match < 1:
            raise ValueError(f"depth >= 1, min_prob in [0, 1] and long_match >= 1, got {depth}, {min_prob}, "
                             f"{long_match}")
        self.head, self.embed, self.inner = head, embed, inner
        self.vocab = DraftVocab(output, vocab_size, head.vocab)
        self.depth, self.min_prob, self.long_match = depth, min_prob, long_match
        self._requests: dict[Hashable, _Request] = {}

    def start(self, rid: Hashable, prompt_ids: Sequence[int], params: SamplingParams,
              session_id: Hashable | None = None) -> None:
        self.inner.start(rid, prompt_ids, params, session_id=session_id)
        request = _Request(self.vocab.for_request())
        request.vocab.add(prompt_ids)
        self._requests[rid] = request

    def observe_hidden(self, rid: Hashable, hidden: torch.Tensor, at: int) -> None:
        """The hidden state `[hidden]` of the row that chose the last token of a context of `at` tokens."""
        request = self._requests.get(rid)
        if request is not None:
            request.hidden, request.at = hidden, at

    def propose(self, rid: Hashable, context: Sequence[int], budget: int) -> Draft:
        inner = self.inner.propose(rid, context, budget)
        request = self._requests.get(rid)
        if (budget <= 0 or request is None or request.hidden is None or request.at != len(context)
                or inner.match_len >= self.long_match):
            return inner
        guess = self._chain(request, int(context[-1]), min(budget, self.depth))
        if len(inner) and inner.token_ids[0] == guess.token_ids[0]:
            return inner
        return beside(guess, inner.truncated(budget - len(guess)))

    def _chain(self, request: _Request, token: int, n: int) -> Draft:
        tokens: list[int] = []
        probs: list[float] = []
        hidden = request.hidden[None].float()
        with torch.inference_mode():
            for _ in range(n):
                feature = self.head(hidden, self.embed(torch.tensor([token])).float())
                prob, j = torch.softmax(request.vocab.logits(feature)[0].float(), dim=-1).max(dim=-1)
                if tokens and float(prob) < self.min_prob:
                    break
                token = int(request.vocab.ids[int(j)])
                tokens.append(token)
                probs.append(float(prob))
                hidden = feature
        return Draft.chain(tokens, probs, source=HEAD_SOURCE)

    def observe(self, rid: Hashable, accepted: Sequence[int], proposed: Draft) -> None:
        self.inner.observe(rid, accepted, proposed)
        request = self._requests.get(rid)
        if request is not None:
            request.vocab.add(accepted)

    def finish(self, rid: Hashable) -> None:
        self.inner.finish(rid)
        self._requests.pop(rid, None)
