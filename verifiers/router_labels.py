"""Stronger labels for router training, and what a drafting model thought of its own step.

The Arbitrage paper labels a step pair by the judge's score difference. On the packaged pair the LLM
judge scores both models' steps within about a point of each other (bench/results/router), so that
rule finds almost no step worth routing. `label_small_step` labels a small-model step instead by the
large model's token agreement (`AgreementVerifier`): does the large model, re-reading the step from
the same prefix, find a token with digits whose drafted choice trails its own by more than `margin`
nats? That is the error the step loop has to catch on GSM8K.

`DraftConfidence` summarises the drafting model's own log-probabilities over the step it wrote
(greedy decoding writes each position's likeliest token, so these are top-1 probabilities): the
signals a gate can read without calling the large model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from thinkahead.models.base import Completion, LanguageModel, TokenScore
from thinkahead.verifiers.base import step_prompt
from thinkahead.verifiers.judge import Verdict

__all__ = ["CONFIDENCE_NAMES", "DraftConfidence", "agreement_label", "draft_confidence", "label_small_step",
           "own_confidence"]

LOW_PROB = math.log(0.5)  # a token the drafting model gave under even odds


@dataclass(slots=True, frozen=True)
class DraftConfidence:
    """The drafting model's view of its own step: log-probabilities of the tokens it wrote."""

    tokens: int
    digit_tokens: int
    min_logprob: float  # the least likely token of the step (0.0 for an empty step)
    min_digit_logprob: float  # the least likely token with a digit (0.0 when there is none)
    mean_logprob: float
    low_tokens: int  # tokens below even odds
    low_digit_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CONFIDENCE_NAMES: tuple[str, ...] = tuple(DraftConfidence.__dataclass_fields__)


def draft_confidence(scores: Sequence[TokenScore]) -> DraftConfidence:
    """`DraftConfidence` from the drafting model's scores of its own step."""
    lps = [s.logprob for s in scores]
    digits = [s.logprob for s in scores if any(c.isdigit() for c in s.text)]
    return DraftConfidence(
        tokens=len(lps),
        digit_tokens=len(digits),
        min_logprob=min(lps, default=0.0),
        min_digit_logprob=min(digits, default=0.0),
        mean_logprob=sum(lps) / len(lps) if lps else 0.0,
        low_tokens=sum(lp < LOW_PROB for lp in lps),
        low_digit_tokens=sum(lp < LOW_PROB for lp in digits),
    )


async def own_confidence(model: LanguageModel, messages: list[dict[str, str]], completion: Completion,
                         step: str) -> DraftConfidence:
    """`model`'s confidence in the step it wrote: read off the generation's own token log-probabilities
    (free: the decoder keeps them), or, where the backend returns none, from one scoring pass."""
    ids, logprobs = completion.token_ids, completion.token_logprobs
    if ids and len(logprobs) == len(ids):
        try:
            texts = model.decode_tokens(list(ids))
        except NotImplementedError:
            texts = None
        if texts is not None:
            return draft_confidence([TokenScore(t, lp, lp) for t, lp in zip(texts, logprobs)])
    try:
        own = await model.continuation_scores(step_prompt(model, messages), step) if step.strip() else []
    except NotImplementedError:
        raise ValueError(f"gate_logprob needs the small model's token log-probabilities: {model.name} returns none "
                         "with its generations and cannot score a continuation") from None
    return draft_confidence(own)


async def agreement_label(large: LanguageModel, messages: list[dict[str, str]], step: str,
                          margin: float = 1.0) -> tuple[dict[str, Any], Verdict] | None:
    """The "agreement" label of a small-model step: the large model's agreement check of it, as the
    pair fields `small_fails` and `small_gap` (worst checked gap, nats), and the verdict; None where
    the large model's backend cannot score a continuation."""
    from thinkahead.verifiers.agreement import AgreementVerifier

    try:
        verdict = await AgreementVerifier(large, margin).judge(messages, step)
    except NotImplementedError:
        return None
    return {"small_fails": not verdict.accept, "small_gap": float(verdict.details.get("worst_gap", 0.0))}, verdict


async def label_small_step(small: LanguageModel, large: LanguageModel, messages: list[dict[str, str]], step: str,
                           margin: float = 1.0) -> dict[str, Any]:
    """The large model's agreement with `step` (written by `small` continuing `messages`) and the
    small model's confidence in it: `agreement_label`'s fields, `keep_chars`, and the
    `DraftConfidence` fields prefixed `conf_`."""
    labelled = await agreement_label(large, messages, step, margin)
    if labelled is None:
        raise ValueError(f"{large.name} cannot score a continuation: no agreement label")
    fields, verdict = labelled
    row: dict[str, Any] = {**fields, "keep_chars": int(verdict.details.get("keep_chars", 0))}
    own = await small.continuation_scores(step_prompt(small, messages), step) if step.strip() else []
    row.update({f"conf_{k}": v for k, v in draft_confidence(own).to_dict().items()})
    return row
