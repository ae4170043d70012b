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

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence
import itertools
import time

import torch

from thinkahead.token_spec.acceptance import check_probes, first_chain, moved_accept_rate, moved_by_checks
from thinkahead.token_spec.controller import AdaptiveController, SpeculationController
from thinkahead.token_spec.constrained import grammar_draft, masked, row_masks, verify_greedy_constrained
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.drafters import Drafter
from thinkahead.token_spec.engine import DraftShare, ForwardCall, Rounds, run_inline
from thinkahead.token_spec.grammar import Constraint
from thinkahead.token_spec.names import ACCEPT_PRIOR, HEAD_SOURCE, MAX_DRAFT, MODEL_DRAFT_SOURCE, common_prefix_len
from thinkahead.token_spec.prefix_pool import KVPrefixPool
from thinkahead.token_spec.pricing import chain_expected
from thinkahead.token_spec.stats import SpecStats
from thinkahead.token_spec.verify import Acceptance, SamplingParams, path_logprobs, verify_greedy, verify_sampling


_GENERATIONS = itertools.count()  # numbers every generation of the process (its drafter request id)


@dataclass(slots=True)
class GenerationResult:
    """What `SpeculativeDecoder.generate` returns.

    The decoder owns the stop: `token_ids` end with the stop token or with the token that
    completed the stop string, `matched_stop` names it, and `text` ends right before a matched
    stop string (OpenAI and SGLang semantics).
    """

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token or stop string) or "length" (max_new_tokens)
    stats: SpecStats = field(default_factory=SpecStats)
    matched_stop: str | int | None = None  # the stop string or stop token that ended generation
    token_logprobs: list[float] = field(default_factory=list)  # each output token's log-probability (temperature 1),
    # where asked for (`logprobs`), else []


@dataclass(slots=True)
class _Generation:
    """The state of one `generate` call, shared by its round steps."""

    rid: Hashable
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    stop_strings: list[str]
    stats: SpecStats  # counters, filled round by round
    started: float
    session: Any = None
    constraint: Constraint | None = None  # the grammar the output must follow
    share: DraftShare | None = None  # its batch, where a scheduler runs it: caps its drafts
    accept_rate: float = ACCEPT_PRIOR  # its own drafts' acceptance (a moving average over rounds)
    context: list[int] = field(default_factory=list)  # prompt + committed output
    probes: list[tuple[list[int], int]] = field(default_factory=list)  # unverified drafts: tokens, next to check
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each output token, from the verify rows (if kept)
    keep_logprobs: bool = False  # whether to compute them (a pass over the vocabulary per kept token)
    rows: Any = None  # the last forward's normed hidden states, for a drafter that reads them (a draft head)
    finish: str = "length"
    matched: str | int | None = None
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def room(self) -> int:
        """Draft tokens this round may verify: the bonus token always comes on top."""
        return self.max_new_tokens - len(self.output) - 1

    @property
    def done(self) -> bool:
        return self.finish == "stop" or len(self.output) >= self.max_new_tokens


@dataclass(slots=True)
class _Round:
    """One verified round: the draft, what the target accepted, what the forward cost, what is kept."""

    draft: Draft
    probe: Draft | None  # an unverified draft when the budget is zero: the controller learns from it
    acceptance: Acceptance
    fed: int  # tokens in the verify forward
    forward_s: float
    forced: int = 0  # draft tokens the grammar forced (jump-forward)
    tokens: list[int] = field(default_factory=list)  # what this round commits
    logprobs: list[float] = field(default_factory=list)  # the model's log-probability of each token of the path


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
        on_tokens: Callable[[list[int]], None] | None = None,
        constraint: Constraint | None = None,
        logprobs: bool = False,
    ) -> GenerationResult:
        """Continue `prompt_ids` by up to `max_new_tokens` tokens.

        `session_id` names an agent session: when this prompt extends the session's previous
        prompt and output, the drafter indexes only the new tokens instead of the whole prompt.

        Generation ends at a stop token (kept in `token_ids`) or when the decoded output contains
        one of `stop_strings`; the text then ends right before the stop string (OpenAI and SGLang
        semantics) and `token_ids` end with the token that completed it.

        `constraint` (a fresh `Constraint` from a `TokenGrammar`) makes the output follow a grammar: its
        mask applies at every verified position, and the tokens it forces are drafted for free (when
        there is a drafter). Greedy output equals plain greedy decoding under the same grammar.

        `on_tokens(new_ids)` is called after each round with the tokens it committed (after the stop
        token, stop string and length cuts: what it is given is always a prefix of the final
        `token_ids`), for streaming. To stop the generation early it raises; the decoder releases its
        state and the exception propagates.

        `logprobs` keeps each output token's log-probability (temperature 1) in `token_logprobs` (else []):
        no extra forward, but a pass over the vocabulary per token (1.5B, 8 streams at once: 4% of a run).
        """
        return run_inline(self.engine, self.rounds(
            prompt_ids, max_new_tokens, sampling, stop_token_ids, seed, request_id, stop_strings, session_id,
            on_tokens, constraint, logprobs=logprobs))

    def rounds(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        request_id: Hashable | None = None,
        stop_strings: Sequence[str] = (),
        session_id: Hashable | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        constraint: Constraint | None = None,
        share: DraftShare | None = None,
        logprobs: bool = False,
    ) -> Rounds[GenerationResult]:
        """`generate` as a coroutine: it yields each target forward it needs (a `ForwardCall`) and is sent
        its logits, so a scheduler can run the forwards of many generations together (models/engine/scheduler.py).
        `share` (from a scheduler) caps each round's draft by the batch's goodput plan."""
        gen = self._new_generation(prompt_ids, max_new_tokens, sampling, stop_token_ids, seed, request_id,
                                   stop_strings)
        gen.constraint, gen.share, gen.keep_logprobs = constraint, share, logprobs
        if share is not None:
            gen.accept_rate = share.prior
        yield from self._prefill(gen, session_id)
        try:
            while not gen.done:
                draft, probe, forced = yield from self._draft(gen)
                rnd = yield from self._verify(gen, draft, probe)
                rnd.forced = forced
                self._accept(gen, rnd)
                self._learn(gen, rnd)
                self._check_stop_string(gen, rnd)
                self._commit(gen, rnd)
                if on_tokens is not None and rnd.tokens:
                    on_tokens(list(rnd.tokens))
        finally:
            self._release(gen)
        return self._result(gen)

    # ------------------------------------------------------------------ round steps
    def _new_generation(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | None,
        stop_token_ids: Sequence[int] | None,
        seed: int | None,
        request_id: Hashable | None,
        stop_strings: Sequence[str],
    ) -> _Generation:
        """Check the arguments and open the per-generation state."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        strings = [s for s in stop_strings if s]
        if strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to SpeculativeDecoder")
        return _Generation(
            # unique per process: decoders share one suffix cache, and two live requests may bring one id
            rid=f"gen-{next(_GENERATIONS)}" if request_id is None else f"{request_id}#{next(_GENERATIONS)}",
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            sampling=sampling or SamplingParams(),
            generator=torch.Generator().manual_seed(seed) if seed is not None else None,
            stop_ids=frozenset(self._default_stops() if stop_token_ids is None else stop_token_ids),
            stop_strings=strings,
            stats=SpecStats(prompt_tokens=len(prompt)),
            started=time.perf_counter(),
            context=list(prompt),
        )

    def _prefill(self, gen: _Generation, session_id: Hashable | None) -> Rounds[None]:
        """A KV session holding the prompt but its last token (which the first round feeds), and the drafter
        told. A prefill that fails or is cancelled keeps its session out of the prefix pool (its KV is partial)."""
        prompt, stats = gen.prompt, gen.stats
        if self.prefix_pool is not None:
            gen.session, stats.cached_tokens = self.prefix_pool.acquire(prompt)
        else:
            gen.session = self.engine.new_session()
        if len(prompt) - 1 > stats.cached_tokens:  # a scheduler may run it in pieces (models/engine/scheduler.py)
            yield ForwardCall(gen.session, prompt[stats.cached_tokens : -1], last_only=True,
                              on_hidden=self._keep_rows(gen))
        gen.prefill_s = time.perf_counter() - gen.started
        if self.drafter is not None:
            self.drafter.start(gen.rid, prompt, gen.sampling, session_id=session_id)
            self._tell_hidden(gen, -1)

    def _draft(self, gen: _Generation) -> Rounds[tuple[Draft, Draft | None, int]]:
        """This round's draft within the controller's budget, a free probe draft when the budget is zero,
        and how many draft tokens a grammar forced. A drafter with `propose_rounds` (a draft model) yields its
        model's forwards like the verify does, so a scheduler batches them too."""
        drafter, room = self.drafter, gen.room
        if drafter is None or room <= 0:
            return Draft(), None, 0
        # A priced draft is cut by its rows' worths (ForwardCall.values; `price` with no scheduler); asked for whole
        # only alone (in a batch whole, 3 chains of thought of the 1.5B ran 8% slower: 40 against 43 tok/s).
        priced = self._priced(gen)
        whole = priced and (gen.share is None or gen.share.alone)
        budget = min(getattr(self.controller, "max_tokens", MAX_DRAFT) if whole else self.controller.budget(), room)
        if gen.share is not None:  # told the acceptance either way
            limit = gen.share.limit(gen.accept_rate)
            budget = budget if priced else min(budget, limit)
        t0 = time.perf_counter()
        try:
            if gen.constraint is not None:
                return self._grammar_draft(gen, room, budget)
            if budget > 0:
                if gen.share is not None and not gen.share.alone and hasattr(drafter, "propose_free"):
                    draft = drafter.propose_free(gen.rid, gen.context, budget)  # a batch: no draft model
                elif hasattr(drafter, "propose_rounds"):  # a draft model: its forwards go to the scheduler
                    draft = yield from drafter.propose_rounds(gen.rid, gen.context, budget)
                else:
                    draft = drafter.propose(gen.rid, gen.context, budget)
                draft = self.controller.trim(draft).truncated(room)
                if priced and gen.share is None and hasattr(self.controller, "price"):
                    draft = self.controller.price(draft)
                return draft, None, 0
            if drafter.model_free:
                # Free to ask: see whether a draft would have hit, without verifying it (`probe` where asking
                # `propose` is not free).
                probe = getattr(drafter, "probe", drafter.propose)
                return Draft(), probe(gen.rid, gen.context, self.probe_tokens), 0
            return Draft(), None, 0
        finally:
            gen.draft_s += time.perf_counter() - t0

    def _grammar_draft(self, gen: _Generation, room: int, budget: int) -> tuple[Draft, None, int]:
        """The forced tokens, then the drafter's guess after them, pruned to the grammar. A draft model
        drafts only where nothing is forced (its own KV follows the committed context)."""
        drafter = self.drafter

        def propose(forced: list[int], n: int) -> Draft:
            if n <= 0 or (forced and not drafter.model_free):
                return Draft()
            return self.controller.trim(drafter.propose(gen.rid, gen.context + forced, n))

        draft, forced = grammar_draft(gen.constraint, room, propose, budget)
        return draft, None, forced

    def _verify(self, gen: _Generation, draft: Draft, probe: Draft | None) -> Rounds[_Round]:
        """One target forward over `[last committed token] + draft`, the acceptance, and the KV rolled back to it."""
        tokens = [gen.context[-1]] + draft.token_ids
        tree = not draft.is_chain
        parents = [-1] + [p + 1 for p in draft.parents] if tree else None
        start = gen.session.length
        t0 = time.perf_counter()
        values = list(draft.probs) if gen.share is not None and self._priced(gen) and len(draft) else None
        logits = yield ForwardCall(gen.session, tokens, parents, on_hidden=self._keep_rows(gen), values=values)
        if len(logits) < len(tokens):  # the scheduler verified the worthiest rows only (ForwardCall.values)
            draft, tokens = draft.truncated(len(logits) - 1), tokens[:len(logits)]
        if gen.constraint is not None and gen.sampling.greedy:
            acceptance = verify_greedy_constrained(logits, draft, gen.constraint)
        elif gen.constraint is not None:
            acceptance = verify_sampling(masked(logits, row_masks(gen.constraint, draft)), draft, gen.sampling,
                                         gen.generator)
        elif gen.sampling.greedy:
            acceptance = verify_greedy(logits, draft)
        else:
            acceptance = verify_sampling(logits, draft, gen.sampling, gen.generator)
        self._rollback(gen.session, start, acceptance, tree)
        forward_s = time.perf_counter() - t0
        gen.verify_s += forward_s
        return _Round(draft, probe, acceptance, fed=len(tokens), forward_s=forward_s,
                      logprobs=path_logprobs(logits, draft, acceptance) if gen.keep_logprobs else [])

    def _rollback(self, session, start: int, acceptance: Acceptance, tree: bool) -> None:
        """Keep in the KV cache only the fed token and the accepted path after `start`."""
        path = [0] + [i + 1 for i in acceptance.accepted]
        if tree:
            self.engine.keep_path(session, start, path)
        else:
            self.engine.truncate(session, start + len(path))

    def _accept(self, gen: _Generation, rnd: _Round) -> None:
        """The round's tokens: the accepted drafts and the bonus token, ending at the first stop token."""
        acceptance = rnd.acceptance
        tokens = [rnd.draft.token_ids[i] for i in acceptance.accepted] + [acceptance.bonus]
        for k, t in enumerate(tokens):
            if t in gen.stop_ids:
                tokens = tokens[: k + 1]
                gen.finish, gen.matched = "stop", t
                break
        rnd.tokens = tokens

    def _learn(self, gen: _Generation, rnd: _Round) -> None:
        """Count the round (SGLang's counters) and let the controller learn from it and from the probe."""
        accepted = len(rnd.acceptance.accepted)
        stats = gen.stats
        stats.spec_verify_ct += 1
        stats.spec_num_proposed_drafts += len(rnd.draft)
        stats.spec_num_correct_drafts += accepted
        if rnd.draft.source == MODEL_DRAFT_SOURCE:
            stats.model_drafts += len(rnd.draft)
            stats.model_correct_drafts += accepted
        elif rnd.draft.source == HEAD_SOURCE:
            stats.head_drafts += len(rnd.draft)
            stats.head_correct_drafts += accepted
        stats.grammar_forced_drafts += rnd.forced
        if gen.share is not None and len(rnd.draft) and not gen.share.alone and not self._priced(gen):
            # the plan sized it: say how it went
            gen.share.verified(chain_expected(gen.accept_rate, len(rnd.draft)), accepted)
        gen.accept_rate = moved_accept_rate(gen.accept_rate, len(rnd.draft), accepted)
        if gen.share is None or gen.share.alone:  # a shared forward's time is not this round's verify cost
            self.controller.update(len(rnd.draft), accepted, rnd.fed, rnd.forward_s)
        else:
            self.controller.update(len(rnd.draft), accepted)
        probe = rnd.probe
        if probe is not None and len(probe):
            # Only as many probe tokens as were produced can be checked.
            checked = min(len(probe), len(rnd.tokens))
            hits = common_prefix_len(probe.token_ids, rnd.tokens)
            self.controller.update(checked, hits)
            gen.probes.append((first_chain(probe), 0))
        gen.probes, hits, tries = check_probes(gen.probes, rnd.tokens)
        gen.accept_rate = moved_by_checks(gen.accept_rate, hits, tries)

    def _check_stop_string(self, gen: _Generation, rnd: _Round) -> None:
        """Cut the round's tokens after the one that completes a stop string, if any does. A stop token
        that ended the round (`_accept`) comes after every token it kept, so a stop string completed
        in the same round ends the generation first ("...STOP<end of turn>" accepted in one round)."""
        if not gen.stop_strings:
            return
        hit = self._find_stop_string(gen.output, rnd.tokens, gen.stop_strings)
        if hit is not None:
            rnd.tokens = rnd.tokens[: hit[0]]
            gen.finish, gen.matched = "stop", hit[1]

    def _commit(self, gen: _Generation, rnd: _Round) -> None:
        """Append the round's tokens to the output and tell the drafter what was kept."""
        if not gen.output:
            gen.stats.first_token_s = time.perf_counter() - gen.started
        gen.output.extend(rnd.tokens)
        gen.logprobs.extend(rnd.logprobs[: len(rnd.tokens)])  # the stop cuts shortened the tokens only
        gen.context.extend(rnd.tokens)
        if gen.constraint is not None:
            gen.constraint.advance(rnd.tokens)
        if self.drafter is not None:
            self.drafter.observe(gen.rid, rnd.tokens, rnd.draft)
            if not gen.done:  # the row that chose the bonus token: the one after the accepted path's last node
                self._tell_hidden(gen, 1 + rnd.acceptance.accepted[-1] if rnd.acceptance.accepted else 0)

    def _priced(self, gen: _Generation) -> bool:
        """Whether its drafts are cut by their rows' worths (calibrated node values: `priced_drafts`; no grammar)."""
        return gen.constraint is None and getattr(self.drafter, "priced_drafts", False)

    def _keep_rows(self, gen: _Generation) -> Callable[[torch.Tensor], None] | None:
        """Where the drafter reads the target's hidden states (`wants_hidden`): a callback that keeps a forward's."""
        if not getattr(self.drafter, "wants_hidden", False):
            return None

        def keep(rows: torch.Tensor) -> None:
            gen.rows = rows

        gen.rows = None
        return keep

    def _tell_hidden(self, gen: _Generation, row: int) -> None:
        """Give the drafter the hidden state of the last forward's `row` (the one whose logits chose the last token
        of the context), if the engine gave them."""
        if gen.rows is None:  # set only where the drafter wants hidden states (_keep_rows)
            return
        self.drafter.observe_hidden(gen.rid, gen.rows[row].clone(), len(gen.context))
        gen.rows = None

    def _release(self, gen: _Generation) -> None:
        """Close the drafter's request and give the session back to the prefix pool, its KV cropped
        to the committed tokens."""
        if self.drafter is not None:
            self.drafter.finish(gen.rid)
        if self.prefix_pool is None or gen.session is None:
            return
        n = min(gen.session.length, len(gen.context) - 1)
        self.engine.truncate(gen.session, n)
        self.prefix_pool.release(gen.session, gen.context[:n])

    def _result(self, gen: _Generation) -> GenerationResult:
        """The finished generation: its text cut before a matched stop string, and its stats."""
        stats = gen.stats
        stats.completion_tokens = len(gen.output)
        stats.total_time_s = time.perf_counter() - gen.started
        stats.draft_time_s, stats.verify_time_s, stats.prefill_time_s = gen.draft_s, gen.verify_s, gen.prefill_s
        text = self.tokenizer.decode(gen.output, skip_special_tokens=True) if self.tokenizer is not None else ""
        if isinstance(gen.matched, str) and gen.matched in text:
            text = text[: text.rfind(gen.matched)]
        return GenerationResult(text=text, token_ids=gen.output, finish_reason=gen.finish, stats=stats,
                                matched_stop=gen.matched, token_logprobs=gen.logprobs)

    # ------------------------------------------------------------------ helpers
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


__all__ = ["GenerationResult", "SpecStats", "SpeculativeDecoder", "plain_greedy"]
