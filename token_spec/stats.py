"""`SpecStats`: what token-level speculation did in one generation, typed from the decoder to the run's cost.

One record travels up unchanged: the decoder fills it (`GenerationResult.stats`), a model hands it on
(`Completion.spec`: the local decoder's, or built from an SGLang server's `meta_info`), a step keeps
it (`StepOutcome.spec`), and a run's meter sums it with `+`. It becomes a dict only at the edge
(traces, a run's `cost`, JSON), through `to_dict`, `spec_dict` or `counters`.

The counters carry SGLang's names; the acceptance length is computed here and nowhere else, as
SGLang computes it: completion tokens per verify forward. Torch-free, so remote backends can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: The counters a run's cost sums (`cost["spec"]`), named as SGLang's meta_info names them.
SPEC_COUNTERS = ("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts")
#: Of those drafts, the ones a draft model (the small one) wrote, and how many it got accepted: in the views only
#: where a draft model drafted (`hybrid`, `draft-model`); the rest were model-free.
MODEL_DRAFT_COUNTERS = ("model_drafts", "model_correct_drafts")
#: Of those drafts, the ones of rounds the target's draft head drafted (`head`: its chain, alone or beside the
#: model-free draft), and how many of them were accepted: in the views only where it drafted.
HEAD_DRAFT_COUNTERS = ("head_drafts", "head_correct_drafts")
#: Seconds a local decoder measures; None where a backend does not measure them (a server).
SPEC_TIMINGS = ("draft_time_s", "verify_time_s", "prefill_time_s")


@dataclass(slots=True)
class SpecStats:
    """Counters of one generation (or, summed with `+`, of many), named as SGLang's meta_info names them.

    An all-zero record (the default) means "no speculation reported": a backend without it adds
    nothing to a sum, so its tokens never dilute `spec_accept_length`.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a prefix cache
    spec_verify_ct: int = 0  # verify forwards (one per round)
    spec_num_proposed_drafts: int = 0  # draft tokens sent for verification
    spec_num_correct_drafts: int = 0  # draft tokens the verifier accepted (a stop may drop some of them)
    grammar_forced_drafts: int = 0  # of the proposed, tokens a grammar forced (drafted for free)
    model_drafts: int = 0  # of the proposed, tokens a draft model (the small one) wrote; the rest are model-free
    model_correct_drafts: int = 0  # of those, the ones accepted
    head_drafts: int = 0  # of the proposed, tokens of rounds the draft head drafted (token_spec/head_drafter.py)
    head_correct_drafts: int = 0  # of those, the ones accepted
    draft_time_s: float | None = None
    verify_time_s: float | None = None
    prefill_time_s: float | None = None
    first_token_s: float = 0.0  # time to the first committed token (prefill + first round)
    total_time_s: float = 0.0

    @property
    def spec_accept_length(self) -> float:
        """Tokens produced per verify forward: completion tokens / verify count (SGLang's definition).

        A round cut by a stop keeps fewer tokens than it accepted, so this is not
        `(spec_num_correct_drafts + spec_verify_ct) / spec_verify_ct`.
        """
        return self.completion_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0

    @property
    def spec_accept_rate(self) -> float:
        """Share of proposed draft tokens the verifier accepted (SGLang's definition)."""
        return self.spec_num_correct_drafts / self.spec_num_proposed_drafts if self.spec_num_proposed_drafts else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first one, over the time after the first one."""
        decode = self.total_time_s - self.first_token_s
        return (self.completion_tokens - 1) / decode if decode > 0 and self.completion_tokens > 1 else 0.0

    @property
    def speculated(self) -> bool:
        """Whether any verify forward was counted (else the record says nothing)."""
        return self.spec_verify_ct > 0

    def __add__(self, other: SpecStats) -> SpecStats:
        """Field-wise sum; a timing that only one side measured is taken as it is."""
        if not isinstance(other, SpecStats):
            return NotImplemented
        out = SpecStats()
        for name in _FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            setattr(out, name, b if a is None else a if b is None else a + b)
        return out

    def to_dict(self) -> dict[str, float]:
        """The whole record with `spec_accept_length` (the decoder's own report: CLI rows, benchmarks)."""
        out: dict[str, float] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out["spec_accept_length"] = self.spec_accept_length
        return out

    def spec_dict(self) -> dict[str, float]:
        """The speculation view a generation shows in traces: the counters, the timings that were
        measured and `spec_accept_length`; empty when nothing was verified."""
        if not self.speculated:
            return {}
        out: dict[str, float] = self.counters()
        for k in SPEC_TIMINGS:
            value = getattr(self, k)
            if value is not None:
                out[k] = value
        out["spec_accept_length"] = self.spec_accept_length
        return out

    def counters(self) -> dict[str, int]:
        """The summable counters (a run's `cost["spec"]`); empty when nothing was verified."""
        if not self.speculated:
            return {}
        names = (SPEC_COUNTERS + (MODEL_DRAFT_COUNTERS if self.model_drafts else ())
                 + (HEAD_DRAFT_COUNTERS if self.head_drafts else ()))
        return {k: getattr(self, k) for k in names}


_FIELDS = tuple(f.name for f in fields(SpecStats))

__all__ = ["HEAD_DRAFT_COUNTERS", "MODEL_DRAFT_COUNTERS", "SPEC_COUNTERS", "SPEC_TIMINGS", "SpecStats"]
