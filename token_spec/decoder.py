"""The draft/verify loop: `SpeculativeDecoder` ties an engine, a drafter and a controller.

Each round the drafter guesses, the target model checks `[pending] + draft` in one
forward (a chain, or a tree under a tree mask), the verifier keeps the longest
acceptable path plus one bonus token, and the KV cache is rolled back to exactly
what was kept. Greedy output is token-identical to plain greedy decoding in
float32 (in bfloat16, batching k tokens into one forward changes logits at the
1e-3 level, as any change of batch shape does in a serving engine: equivalent,
not bit-identical); sampled output follows the target distribution.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Hashable, Sequence
import itertools
import time

import torch

from thinkahead.token_spec.controller import AdaptiveController, SpeculationController
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.drafters import Drafter, common_prefix_len
from thinkahead.token_spec.prefix_pool import KVPrefixPool
from thinkahead.token_spec.verify import SamplingParams, verify_greedy, verify_sampling


@dataclass(slots=True)
class SpecStats:
    """Per-generation counters, named as SGLang's meta_info names them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix pool
    spec_verify_ct: int = 0  # verify forwards (one per round)
    spec_num_proposed_drafts: int = 0  # draft tokens sent for verification
    spec_num_correct_drafts: int = 0  # draft tokens accepted
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    first_token_s: float = 0.0  # time to the first committed token (prefill + first round)
    total_time_s: float = 0.0

    @property
    def spec_accept_length(self) -> float:
        """Tokens produced per verify forward (SGLang: completion tokens / verify count)."""
        return self.completion_tokens / self.spec_verify_ct if self.spec_verify_ct else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first one, over the time after the first one."""
        decode = self.total_time_s - self.first_token_s
        return (self.completion_tokens - 1) / decode if decode > 0 and self.completion_tokens > 1 else 0.0

    def to_dict(self) -> dict[str, float]:
        out = asdict(self)
        out["spec_accept_length"] = self.spec_accept_length
        return out


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token or stop string) or "length" (max_new_tokens)
    stats: SpecStats = field(default_factory=SpecStats)
    matched_stop: str | int | None = None  # the stop string or stop token that ended generation


class SpeculativeDecoder:
    """Generates with speculation; `generate` is the one entry point.

    Args:
        engine: target model engine (`new_session`, `forward`, `truncate`, `keep_path`).
        drafter: any `Drafter`; None decodes plainly (one token per forward).
        controller: chooses the draft budget per round (default: adaptive).
        tokenizer: optional, to return text and default stop tokens (its eos); needed for stop strings.
        prefix_pool: optional `KVPrefixPool`; prompts that share a prefix with an earlier
            generation reuse its KV instead of prefilling it again.
    """

    def __init__(
        self,
        engine,
        drafter: Drafter | None = None,
        controller: SpeculationController | None = None,
        tokenizer=None,
        probe_tokens: int = 8,
        prefix_pool: KVPrefixPool | None = None,
    ) -> None:
        self.engine = engine
        self.drafter = drafter
        self.controller = controller if controller is not None else AdaptiveController()
        self.tokenizer = tokenizer
        self.probe_tokens = probe_tokens
        self.prefix_pool = prefix_pool
        self._ids = itertools.count()

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        request_id: Hashable | None = None,
        stop_strings: Sequence[str] = (),
        session_id: Hashable | None = None,
    ) -> GenerationResult:
        """Continue `prompt_ids` by up to `max_new_tokens` tokens.

        `session_id` names an agent session: when this prompt extends the session's previous
        prompt and output, the drafter indexes only the new tokens instead of the whole prompt.

        Generation ends at a stop token (kept in `token_ids`) or when the decoded output contains
        one of `stop_strings`; the text then ends right before the stop string (OpenAI and SGLang
        semantics) and `token_ids` end with the token that completed it.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = sampling or SamplingParams()
        stops = set(self._default_stops() if stop_token_ids is None else stop_token_ids)
        stop_strings = [s for s in stop_strings if s]
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to SpeculativeDecoder")
        matched: str | int | None = None
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        rid = request_id if request_id is not None else f"gen-{next(self._ids)}"
        stats = SpecStats(prompt_tokens=len(prompt))
        t_start = time.perf_counter()

        if self.prefix_pool is not None:
            session, stats.cached_tokens = self.prefix_pool.acquire(prompt)
        else:
            session = self.engine.new_session()
        if len(prompt) - 1 > stats.cached_tokens:
            self.engine.forward(session, prompt[stats.cached_tokens : -1], last_only=True)
        stats.prefill_time_s = time.perf_counter() - t_start
        drafter = self.drafter
        if drafter is not None:
            drafter.start(rid, prompt, sampling, session_id=session_id)

        context = list(prompt)
        output: list[int] = []
        finish = "length"
        try:
            while len(output) < max_new_tokens:
                room = max_new_tokens - len(output) - 1  # the bonus token always comes on top
                draft, probe = self._propose(rid, context, room, stats)
                tokens = [context[-1]] + draft.token_ids
                tree = not draft.is_chain
                parents = [-1] + [p + 1 for p in draft.parents] if tree else None
                start = session.length
                t0 = time.perf_counter()
                logits = self.engine.forward(session, tokens, parents)
                if sampling.greedy:
                    verdict = verify_greedy(logits, draft)
                else:
                    verdict = verify_sampling(logits, draft, sampling, generator)
                path = [0] + [i + 1 for i in verdict.accepted]
                if tree:
                    self.engine.keep_path(session, start, path)
                else:
                    self.engine.truncate(session, start + len(path))
                forward_s = time.perf_counter() - t0
                stats.verify_time_s += forward_s

                new = [draft.token_ids[i] for i in verdict.accepted] + [verdict.bonus]
                for k, t in enumerate(new):
                    if t in stops:
                        new = new[: k + 1]
                        finish, matched = "stop", t
                        break
                stats.spec_verify_ct += 1
                stats.spec_num_proposed_drafts += len(draft)
                stats.spec_num_correct_drafts += len(verdict.accepted)
                self.controller.update(len(draft), len(verdict.accepted), len(tokens), forward_s)
                if probe is not None and len(probe):
                    # Only as many probe tokens as were produced can be checked.
                    checked = min(len(probe), len(new))
                    self.controller.update(checked, common_prefix_len(probe.token_ids, new))
                if not output:
                    stats.first_token_s = time.perf_counter() - t_start
                if stop_strings and finish != "stop":
                    hit = self._find_stop_string(output, new, stop_strings)
                    if hit is not None:
                        new, matched, finish = new[: hit[0]], hit[1], "stop"
                output.extend(new)
                context.extend(new)
                if drafter is not None:
                    drafter.observe(rid, new, draft)
                if finish == "stop":
                    break
        finally:
            if drafter is not None:
                drafter.finish(rid)
            self._return_session(session, context)
        stats.completion_tokens = len(output)
        stats.total_time_s = time.perf_counter() - t_start
        text = self.tokenizer.decode(output, skip_special_tokens=True) if self.tokenizer is not None else ""
        if isinstance(matched, str):
            text = text[: text.rfind(matched)] if matched in text else text
        return GenerationResult(text=text, token_ids=output, finish_reason=finish, stats=stats, matched_stop=matched)

    def _find_stop_string(self, output: list[int], new: list[int], stop_strings: list[str]) -> tuple[int, str] | None:
        """(number of `new` tokens to keep, the stop string) for the first stop string completed by `new`."""
        window = max(len(s) for s in stop_strings) + 4  # tokens: each holds at least one character
        for k in range(1, len(new) + 1):
            tail = (output + new[:k])[-window:]
            text = self.tokenizer.decode(tail, skip_special_tokens=True)
            before = self.tokenizer.decode(tail[:-1], skip_special_tokens=True)
            for s in stop_strings:
                if s in text and text.count(s) > before.count(s):
                    return k, s
        return None

    def _return_session(self, session, context: list[int]) -> None:
        """Give the session back to the prefix pool, its KV cropped to the committed tokens."""
        if self.prefix_pool is None:
            return
        n = min(session.length, len(context) - 1)
        self.engine.truncate(session, n)
        self.prefix_pool.release(session, context[:n])

    def _propose(self, rid: Hashable, context: list[int], room: int, stats: SpecStats) -> tuple[Draft, Draft | None]:
        """This round's draft, and an unverified probe draft when the budget is zero."""
        drafter = self.drafter
        if drafter is None or room <= 0:
            return Draft(), None
        budget = min(self.controller.budget(), room)
        t0 = time.perf_counter()
        try:
            if budget > 0:
                return self.controller.trim(drafter.propose(rid, context, budget)).truncated(room), None
            if drafter.model_free:
                # Free to ask: see whether a draft would have hit, without verifying it.
                return Draft(), drafter.propose(rid, context, self.probe_tokens)
            return Draft(), None
        finally:
            stats.draft_time_s += time.perf_counter() - t0

    def _default_stops(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def plain_greedy(engine, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = ()) -> list[int]:
    """Reference: one token per forward, argmax, on the same engine (used by tests)."""
    session = engine.new_session()
    logits = engine.forward(session, list(prompt_ids), last_only=True)
    out: list[int] = []
    stops = set(stop_token_ids)
    while len(out) < max_new_tokens:
        token = int(logits[-1].argmax())
        out.append(token)
        if token in stops:
            break
        logits = engine.forward(session, [token])
    return out
