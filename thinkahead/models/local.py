"""`LocalModel`: a transformers model in this process, every generation speculative and lossless.

One `LocalModel` owns one engine, one `SuffixCache` shared by all its requests and agents (so a
pipeline's repeated sub-tasks draft from each other's outputs), and a KV prefix pool (so the step
loop and the judge, whose prompts extend earlier ones, skip re-reading the shared prefix). Every call
(generations, streams, scores) runs on the model's `BatchScheduler` (thinkahead/models/engine/scheduler.py): one
thread that owns the engine, the drafters and the pool, and advances every live generation together,
one forward per step; callers from any thread or event loop only wait for their result.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from thinkahead.models.base import (
    Completion, GenerationRequest, LanguageModel, TextDelta, TokenLogprob, TokenScore, encode_prompt, observed,
    prompt_text, render_chat,
)
from thinkahead.models.streaming import TextPiece, TextStream
from thinkahead.models.templates import repair_chat_template
from thinkahead.models.engine.config import KV_LIVE_SHARE, KV_MEMORY_SHARE, EngineConfig, scheduler_conflicts
from thinkahead.models.engine.scheduler import BatchScheduler, Lane
from thinkahead.models.engine.threads import on_own_thread
from thinkahead.token_spec.draft_head import find_head
from thinkahead.token_spec.engine import ForwardCall, Rounds
from thinkahead.token_spec.grammar import GRAMMAR_KINDS, GrammarSpec, TokenGrammar
from thinkahead.token_spec.names import (
    HEAD_KIND, MODEL_DRAFT_KINDS, SOLO_DRAFTER, common_prefix_len, packaged_head, resolve_drafter,
)
from thinkahead.token_spec.recording import TokenRecorder

# Chat-turn end markers of the supported families, used as stop tokens next to the eos token.
TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")


class LocalModel(LanguageModel):
    """A local transformers causal LM behind the `LanguageModel` API.

    Args:
        spec: a model spec (`gguf:PATH`, `hf:ID`, a directory, a registry name such as
            `qwen2.5-coder-0.5b`), resolved as everywhere else; or pass `model=` and `tokenizer=`.
        engine: how it runs (`EngineConfig`: dtype, drafter, max draft, KV memory, batching; each default
            defined there); `**settings` are the same fields as keywords, in place of `engine`'s values
            (`LocalModel(spec, dtype="gguf", drafter="suffix")`). An unknown or bad one is a ValueError naming it.
            dtype: "bfloat16", "float32", "int8" (batch-invariant int8 linears over the dequantized weights) or
            "gguf" (the GGUF file's own blocks, fastest on CPUs; GGUF models only); see models/engine/dtypes.py.
            drafter: "auto" (the default) is "head" where the model has a draft head (`head`, or the one packaged
            for `spec`), else "combined"; "hybrid" and "draft-model" need `draft`.
            kv_live_tokens: the KV tokens live generations may reserve in all (each its prompt and
            `max_new_tokens`); more wait for room.
        draft: a smaller `LocalModel` with the same tokenizer that drafts tokens for this one (`hybrid`,
            `draft-model`). The two share one scheduler thread (and the small model's weights: nothing is
            loaded twice), so its batching settings must be the draft model's; the small model's own
            requests run as before.
        thread_of: a local model whose scheduler thread runs this one's work too, where their batching settings agree:
            a second thread's OpenMP team throttles both (engine/threads.py; 4 tokens of the 0.5B on its own thread
            left the 1.5B's plain decoding 7-10% slower for the rest of the process).
        head: a draft head trained for this model (`DraftHead` or its file, token_spec/draft_head.py) for the
            "head" drafter, where none is packaged for `spec`.
    """

    def __init__(
        self,
        spec: str | None = None,
        *,
        engine: EngineConfig | None = None,
        model: Any = None,
        tokenizer: Any = None,
        draft: LocalModel | None = None,
        thread_of: LocalModel | None = None,
        cache: Any = None,
        head: Any = None,
        name: str | None = None,
        record: str | os.PathLike[str] | None = None,
        **settings: Any,
    ) -> None:
        from thinkahead.models.engine.runner import HFEngine
        from thinkahead.token_spec.prefix_pool import KVPrefixPool
        from thinkahead.token_spec.presets import build_decoder
        from thinkahead.token_spec.suffix_cache import SuffixCache

        if draft is not None and not isinstance(draft, LocalModel):
            raise ValueError(f"draft must be a LocalModel, got {type(draft).__name__}")
        if draft is not None and draft.draft is not None:
            raise ValueError(f"draft model {draft.name} drafts with a model itself; give a model that drafts alone")
        self.config = config = EngineConfig.of(engine, **settings)
        drafter = resolve_drafter(config.drafter, draft is not None,  # a model's kind without one: now
                                  has_head=head is not None or packaged_head(spec) is not None)
        if draft is not None and drafter in MODEL_DRAFT_KINDS:  # the draft model's scheduler runs both models
            unlike = scheduler_conflicts(config, draft.config)
            if unlike:
                raise ValueError(f"{name or spec or 'the model'} drafts with {draft.name} and shares its scheduler: "
                                 f"{', '.join(unlike)} cannot both hold; give both models the same")
        if (spec is None) == (model is None):
            raise ValueError("LocalModel needs either a model spec or model= (with tokenizer=)")
        if model is not None and tokenizer is None:
            raise ValueError("LocalModel(model=...) also needs tokenizer=")
        if spec is not None:
            from thinkahead.models.engine.weights.load import load_causal_lm

            model, tokenizer = load_causal_lm(spec, config.dtype)
        self.name = name or spec or getattr(model.config, "name_or_path", "") or "local"
        self.drafter = drafter  # what "auto" became
        if drafter in MODEL_DRAFT_KINDS and not same_tokenizer(tokenizer, draft.tokenizer):
            raise ValueError(f"draft model {draft.name} does not share {self.name}'s tokenizer: it cannot draft "
                             f"its tokens; use a model-free drafter ({SOLO_DRAFTER})")
        self.draft = draft if drafter in MODEL_DRAFT_KINDS else None
        self.tokenizer = repair_chat_template(tokenizer)
        self.engine = HFEngine(model)
        if spec is not None:  # a named model: its forward-cost curve is measured once per machine, not per process
            import torch

            from thinkahead.models.engine.calibration import engine_key

            self.engine.calibration_key = engine_key(spec, config.dtype, torch.get_num_threads())
        self.suffix_cache = cache if cache is not None else SuffixCache()
        kv_tokens = config.kv_tokens if config.kv_tokens is not None else kv_token_budget(model, KV_MEMORY_SHARE)
        self.prefix_pool = KVPrefixPool(self.engine, max_sessions=config.kv_sessions, max_tokens=kv_tokens)
        common = dict(tokenizer=tokenizer, cache=self.suffix_cache, max_draft=config.max_draft,
                      prefix_pool=self.prefix_pool)
        draft_engine = self.draft.engine if self.draft is not None else None
        self._speculative = on_own_thread(lambda: build_decoder(  # a head's torch work: engine/threads.py
            drafter, self.engine, draft_engine=draft_engine, **common,
            draft_head=find_head(head, spec, model.config.hidden_size, self.name) if drafter == HEAD_KIND else None))
        self._plain = build_decoder("none", self.engine, **common)
        self.stop_token_ids = self._stop_token_ids()
        self.grammars = TokenGrammar(tokenizer, _vocab_size(model, tokenizer), self.stop_token_ids)
        # the one thread that runs this model's engine, drafters, suffix cache and prefix pool (none thread-safe):
        # with a draft model, that model's thread (the drafter runs its engine); else `thread_of`'s where it can
        host = self.draft if self.draft is not None else _host(thread_of, config)
        live = config.kv_live_tokens if config.kv_live_tokens is not None else kv_token_budget(model, KV_LIVE_SHARE)
        self.scheduler: BatchScheduler | Lane = (
            BatchScheduler(self.engine, name=self.name, max_tokens=live, max_rows=config.max_batch_rows,
                           prefill_chunk=config.prefill_chunk) if host is None
            else host.scheduler.lane(self.engine, max_tokens=live))
        if spec is not None:  # measured (once per machine) while nothing else runs, or read from the store
            on_own_thread(self.scheduler.calibrate)  # its forwards: engine/threads.py
        self.recorder = TokenRecorder(record) if record is not None else None  # for `thinkahead simulate`

    # ------------------------------------------------------------------ LanguageModel
    async def generate(self, request: GenerationRequest) -> Completion:
        ids = self.encode(prompt_text(self, request))
        cancel = threading.Event()
        future = self.scheduler.submit(lambda: self._completion_rounds(ids, request, stop_if(cancel)),
                                       tokens=len(ids) + request.max_new_tokens)
        try:
            return observed(await asyncio.wrap_future(future))
        except asyncio.CancelledError:
            cancel.set()  # the generation leaves the batch before its next step
            self.scheduler.cancel(future)
            raise

    async def stream(self, request: GenerationRequest, *, top_logprobs: int | None = None
                     ) -> AsyncIterator[TextDelta | Completion]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TextDelta | Completion | BaseException] = asyncio.Queue()
        cancel = threading.Event()

        def put(item: TextDelta | Completion | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is reading any more
                cancel.set()

        def done(future: Any) -> None:
            put(GenerationStopped() if future.cancelled() else future.exception() or future.result())

        ids = self.encode(prompt_text(self, request))
        future = self.scheduler.submit(lambda: self._stream_rounds(ids, request, put, cancel, top_logprobs),
                                       tokens=len(ids) + request.max_new_tokens)
        future.add_done_callback(done)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    if isinstance(item, GenerationStopped):
                        raise asyncio.CancelledError()
                    raise item
                if isinstance(item, Completion):
                    yield observed(item)
                    return
                yield item
        finally:
            cancel.set()
            self.scheduler.cancel(future)  # a reader that left: the generation leaves the batch

    async def next_token_logprobs(self, prompt: str, top_k: int = 20) -> dict[str, float]:
        return await asyncio.to_thread(self.next_token_logprobs_sync, prompt, top_k)

    def render(self, messages: list[dict[str, str]], continue_final: bool = False) -> str:
        return render_chat(self.tokenizer, messages, continue_final)

    async def end_session(self, session_id: str) -> None:
        def end() -> None:
            self.suffix_cache.end_session(session_id)
            if self.recorder is not None:
                self.recorder.end_session(self.name, session_id)

        await asyncio.wrap_future(self.scheduler.submit(end))

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    grammar_kinds = GRAMMAR_KINDS
    grammar_guaranteed = True

    def check_grammar(self, spec: GrammarSpec) -> None:
        self.grammars.compile(spec)

    def prepare_grammars(self) -> None:
        """Build the grammar engine's view of the tokenizer on a side thread (about 1 s of CPU for a 150k
        vocabulary). Not at load: a batch job that never asks for a grammar would pay it while it loads and
        decodes (`thinkahead run`, 2 cores); the first constrained request builds it where no one asked."""
        threading.Thread(target=self.grammars.warm, name="grammar-tokenizer", daemon=True).start()

    # ------------------------------------------------------------------ sync implementations
    def generate_sync(self, request: GenerationRequest,
                      on_tokens: Callable[[list[int]], None] | None = None) -> Completion:
        """The generation; `on_tokens` sees each round's committed tokens (it may raise to stop). It runs in
        the model's batch with every other live generation."""
        ids = self.encode(prompt_text(self, request))
        return self.scheduler.run(lambda: self._completion_rounds(ids, request, on_tokens),
                                  tokens=len(ids) + request.max_new_tokens)

    def stream_sync(self, request: GenerationRequest, put: Callable[[TextDelta], None], cancel: threading.Event,
                    top_logprobs: int | None = None) -> Completion:
        """The generation, each piece of its text handed to `put` as it is decoded (see `stream`)."""
        ids = self.encode(prompt_text(self, request))
        return self.scheduler.run(lambda: self._stream_rounds(ids, request, put, cancel, top_logprobs),
                                  tokens=len(ids) + request.max_new_tokens)

    def _stream_rounds(self, prompt_ids: list[int], request: GenerationRequest, put: Callable[[TextDelta], None],
                       cancel: threading.Event, top_logprobs: int | None) -> Rounds[Completion]:
        text = TextStream(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True), request.stop,
                          frozenset(self.stop_token_ids))
        scorer = _Scorer(self, prompt_ids, text.ids, top_logprobs) if top_logprobs is not None else None

        def send(piece: TextPiece | None) -> None:
            if piece is not None:
                put(TextDelta(piece.text, piece.token_ids, None if scorer is None else scorer.score(piece.token_ids)))

        def on_tokens(ids: list[int]) -> None:
            if cancel.is_set():
                raise GenerationStopped()
            send(text.push(ids))

        try:
            completion = yield from self._completion_rounds(prompt_ids, request, on_tokens)
            send(text.finish(completion.text))
        finally:
            if scorer is not None:
                scorer.close()
        return completion

    def _completion_rounds(self, ids: list[int], request: GenerationRequest,
                           on_tokens: Callable[[list[int]], None] | None) -> Rounds[Completion]:
        """The generation as a coroutine of the scheduler (`SpeculativeDecoder.rounds`), and its `Completion`."""
        from thinkahead.token_spec.verify import SamplingParams

        decoder = self._speculative if request.speculative else self._plain
        sampling = SamplingParams(temperature=request.temperature, top_p=request.top_p)
        constraint = None if request.grammar is None else self.grammars.constraint(request.grammar)
        scheduler = self.scheduler
        result = yield from decoder.rounds(
            ids,
            request.max_new_tokens,
            sampling=sampling,
            stop_token_ids=self.stop_token_ids,
            seed=request.seed,
            request_id=request.request_id,
            stop_strings=request.stop,
            session_id=request.session_id,
            on_tokens=on_tokens,
            constraint=constraint,
            share=scheduler.share(),
            logprobs=request.logprobs,
        )
        if self.recorder is not None:
            self.recorder.record(self.name, request.session_id, ids, result.token_ids)
        stats = result.stats
        matched = result.matched_stop if isinstance(result.matched_stop, str) else None  # a stop token is no stop string
        return Completion(
            text=result.text,
            token_ids=result.token_ids,
            finish_reason=result.finish_reason,
            matched_stop=matched,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            cached_tokens=stats.cached_tokens,
            time_s=stats.total_time_s,
            first_token_s=stats.first_token_s,
            model=self.name,
            spec=stats,
            token_logprobs=result.token_logprobs,
        )

    def next_token_logprobs_sync(self, prompt: str, top_k: int = 20) -> dict[str, float]:
        import torch

        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("next_token_logprobs needs a non-empty prompt")
        _, logits = self.scheduler.run(lambda: self._scored_rows(ids, 0, last_only=True), tokens=len(ids))
        logits = logits[-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, indices = torch.topk(logprobs, min(top_k, logprobs.shape[-1]))
        out: dict[str, float] = {}
        for v, i in zip(values.tolist(), indices.tolist()):
            text = self.tokenizer.decode([i])
            if text not in out:  # two ids can decode alike; keep the likelier
                out[text] = v if math.isfinite(v) else -1e30
        return out

    async def continuation_logprobs(self, prompt: str, continuation: str) -> list[float]:
        return await asyncio.to_thread(self.continuation_logprobs_sync, prompt, continuation)

    def continuation_logprobs_sync(self, prompt: str, continuation: str) -> list[float]:
        """Log-probability of each token of `continuation` after `prompt`, in one forward pass."""
        _, chosen, _ = self._continuation_rows(prompt, continuation)
        return chosen.tolist()

    async def continuation_scores(self, prompt: str, continuation: str) -> list[TokenScore]:
        return await asyncio.to_thread(self.continuation_scores_sync, prompt, continuation)

    def continuation_scores_sync(self, prompt: str, continuation: str) -> list[TokenScore]:
        """Each token of `continuation` with its log-probability and the model's own choice there
        (an end-of-turn choice has `top_text` "": there is no text to put in its place)."""
        ids, chosen, logprobs = self._continuation_rows(prompt, continuation)
        best = logprobs.max(dim=-1)
        out = []
        for t, lp, top, top_id in zip(ids, chosen.tolist(), best.values.tolist(), best.indices.tolist()):
            own = t if lp >= top else top_id
            out.append(TokenScore(self.tokenizer.decode([t]), lp, max(lp, top),
                                  self.tokenizer.decode([own], skip_special_tokens=True)))
        return out

    async def token_logprobs(self, token_ids: list[int], start: int, top_k: int = 0) -> list[TokenLogprob]:
        return await asyncio.to_thread(self.token_logprobs_sync, token_ids, start, top_k)

    def token_logprobs_sync(self, token_ids: list[int], start: int, top_k: int = 0) -> list[TokenLogprob]:
        """`token_ids[start:]` scored after the tokens before each, in one forward (as `continuation_logprobs`)."""
        ids = [int(t) for t in token_ids]
        if not 0 < start < len(ids) or top_k < 0:
            raise ValueError(f"token_logprobs needs 0 < start < len(token_ids) and top_k >= 0, got {start}, {top_k}")
        chosen, logprobs = self._rows(ids, start)
        return self._scored(ids[start:], chosen, logprobs, top_k)

    def _scored(self, ids: list[int], chosen: Any, logprobs: Any, top_k: int) -> list[TokenLogprob]:
        import torch

        top = torch.topk(logprobs, min(top_k, logprobs.shape[-1])) if top_k else None
        out = []
        for i, (t, lp) in enumerate(zip(ids, chosen.tolist())):
            alts = [] if top is None else [(int(a), self.tokenizer.decode([int(a)]), float(v))
                                           for v, a in zip(top.values[i].tolist(), top.indices[i].tolist())]
            out.append(TokenLogprob(t, self.tokenizer.decode([t]), float(lp), alts))
        return out

    @property
    def context_length(self) -> int | None:
        return getattr(self.engine.model.config, "max_position_embeddings", None)

    def _continuation_rows(self, prompt: str, continuation: str):
        """(continuation ids, their log-probabilities, the log-softmax rows predicting them): one forward."""
        ids = self.encode(prompt + continuation)
        start = common_prefix_len(self.encode(prompt), ids)  # the boundary token may merge across the two
        if start == 0 or start >= len(ids):
            raise ValueError("scoring a continuation needs a non-empty prompt and continuation")
        chosen, logprobs = self._rows(ids, start)
        return ids[start:], chosen, logprobs

    def _rows(self, ids: list[int], start: int):
        """(log-probabilities of `ids[start:]`, the log-softmax rows predicting them): one forward."""
        import torch

        cached, logits = self.scheduler.run(lambda: self._scored_rows(ids, start), tokens=len(ids))
        # row i of `logits` predicts ids[cached + i + 1]
        logprobs = torch.log_softmax(logits[start - 1 - cached : len(ids) - 1 - cached].float(), dim=-1)
        targets = torch.tensor(ids[start:], dtype=torch.long)
        return logprobs.gather(1, targets[:, None])[:, 0], logprobs

    def _scored_rows(self, ids: list[int], start: int, last_only: bool = False) -> Rounds[Any]:
        """One forward over `ids` after the longest pooled prefix (of `ids[:start]`, or of `ids[:-1]` when `start`
        is 0), in the batch: how many tokens the pool held, and the forward's logits (`last_only`: the last row's)."""
        # acquire() keeps the last token out of the reused prefix, so there is always one to feed
        session, cached = self.prefix_pool.acquire(ids[:start] if start else ids)
        logits = yield ForwardCall(session, ids[cached:], last_only=last_only)
        self.prefix_pool.release(session, ids)
        return cached, logits

    def encode(self, text: str) -> list[int]:
        """Token ids of raw prompt text; a BOS token is added only where the tokenizer wants one."""
        return encode_prompt(self.tokenizer, text)

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([int(t)]) for t in token_ids]

    def _stop_token_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        stops = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        stops.update(vocab[t] for t in TURN_END_TOKENS if t in vocab)
        return sorted(stops)



class GenerationStopped(Exception):
    """Raised inside a decoder's round callback to stop a generation nobody waits for any more."""


def stop_if(cancel: threading.Event) -> Callable[[list[int]], None]:
    """A round callback that stops the decoder once `cancel` is set."""
    def check(_ids: list[int]) -> None:
        if cancel.is_set():
            raise GenerationStopped()
    return check


class _Scorer:
    """Scores a streamed generation's tokens as they come, on a KV session of its own (the numbers
    `token_logprobs` gives for the same ids, one forward over each piece's tokens). Runs inside the
    generation, on the model's scheduler thread (which owns the engine and the prefix pool)."""

    def __init__(self, model: LocalModel, prompt_ids: list[int], output: list[int], top_k: int) -> None:
        self.model, self.prompt, self.output, self.top_k = model, prompt_ids, output, top_k
        self.session: Any = None
        self.end = len(prompt_ids)  # tokens scored so far, the prompt counted as scored

    def score(self, ids: list[int]) -> list[TokenLogprob]:
        import torch

        if not ids:
            return []
        model, seq = self.model, self.prompt + self.output
        start, end = self.end, self.end + len(ids)
        if seq[start:end] != ids:
            raise ValueError("the scored tokens must follow the ones scored before")
        if self.session is None:
            self.session, _ = model.prefix_pool.acquire(seq[:start])
        feed = seq[self.session.length : end - 1]
        logits = model.engine.forward(self.session, feed)[len(feed) - len(ids):]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(ids, dtype=torch.long)[:, None])[:, 0]
        self.end = end
        return model._scored(ids, chosen, logprobs, self.top_k)

    def close(self) -> None:
        if self.session is not None:
            seq = (self.prompt + self.output)[: self.session.length]
            self.model.prefix_pool.release(self.session, seq)
            self.session = None


def kv_token_budget(model: Any, share: float) -> int | None:
    """Tokens of float32 K/V that `share` of the memory free now holds for `model` (None where either is unknown)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        layers, heads = int(text.num_hidden_layers), int(getattr(text, "num_key_value_heads", None) or
                                                         text.num_attention_heads)
        dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, TypeError, ValueError, OSError):
        return None
    per_token = layers * 2 * heads * dim * 4
    return max(1, int(free * share) // per_token) if per_token > 0 and free > 0 else None


def _host(other: LocalModel | None, config: EngineConfig) -> LocalModel | None:
    """`other` where its scheduler thread can run a model of `config` too: a local model with a scheduler of its own
    and the same batching settings."""
    if other is None:
        return None
    if not isinstance(other, LocalModel):
        raise ValueError(f"thread_of must be a LocalModel, got {type(other).__name__}")
    fits = isinstance(other.scheduler, BatchScheduler) and not scheduler_conflicts(config, other.config)
    return other if fits else None


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers give every text the same ids (the same vocabulary, special tokens included)."""
    if a is b:
        return True
    try:
        return len(a) == len(b) and a.get_vocab() == b.get_vocab()
    except (AttributeError, TypeError):
        return False


def _vocab_size(model: Any, tokenizer: Any) -> int:
    """The width of the model's logits (it may exceed the tokenizer's vocabulary)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else len(tokenizer)
