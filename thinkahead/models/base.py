"""The model layer's contract: what step policies, judges and workflows call.

Every backend (local transformers, SGLang, any OpenAI-compatible server, a scripted fake) answers
the same two questions, asynchronously so that many steps and requests can be in flight:
`generate(request) -> Completion` and `next_token_logprobs(prompt, top_k)` (for judges, which read
a score from the logprobs of digit tokens in one forward pass).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from thinkahead.token_spec.grammar import GrammarSpec
from thinkahead.token_spec.stats import SpecStats


@dataclass(slots=True)
class GenerationRequest:
    """One generation call. Give either `prompt` (raw text, already templated) or `messages`.

    `continue_final=True` continues the last message (a partial assistant message: the step loop
    continues the model's own thinking text) instead of opening a new assistant turn.
    """

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    continue_final: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    request_id: str | None = None
    speculative: bool = True  # token-level speculation (lossless); off gives the plain baseline
    session_id: str | None = None  # an agent session: this prompt extends the session's last one
    grammar: GrammarSpec | None = None  # the output must match it (a backend refuses a kind it cannot enforce)
    logprobs: bool = False  # keep each output token's log-probability in `Completion.token_logprobs` (where a
    # backend gives them: the local engine reads them off its verify rows, no extra forward)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("GenerationRequest needs exactly one of prompt= or messages=")
        if self.messages is not None:
            check_messages(self.messages)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):  # what a torch generator takes
            raise ValueError(f"seed must be a 64-bit integer (-2**63 to 2**64 - 1), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]


@dataclass(slots=True)
class Completion:
    """What a generation returns: text, ids, why it ended, what it cost, and speculation stats.

    Stops follow OpenAI and SGLang: `text` ends right before the stop string that ended the
    generation and `matched_stop` names it (None for a stop token or the length limit);
    `text_with_stop` is the text through it. `spec` is a typed `SpecStats` with SGLang's names
    (`spec_verify_ct`, `spec_num_proposed_drafts`, `spec_num_correct_drafts`, `spec_accept_length`)
    whatever the backend; all zero where a backend reports no speculation.
    """

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    matched_stop: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    time_s: float = 0.0
    first_token_s: float = 0.0
    model: str = ""
    spec: SpecStats = field(default_factory=SpecStats)
    token_logprobs: list[float] = field(default_factory=list)  # per token of `token_ids` where the request asked
    # for them (`logprobs`); [] otherwise, or where a backend does not say

    @property
    def text_with_stop(self) -> str:
        """The text through the stop string that ended it (the whole step, delimiter included)."""
        return self.text + (self.matched_stop or "")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spec"] = self.spec.spec_dict()
        return out


@dataclass(slots=True)
class TokenScore:
    """One token of a scored continuation: its text, its log-probability, and the log-probability
    and text of the token the model itself would have picked there (equal when the model agrees;
    `top_text` is "" where a backend does not say)."""

    text: str
    logprob: float
    top_logprob: float
    top_text: str = ""

    @property
    def gap(self) -> float:
        """How many nats likelier the model's own choice is than this token (0 when it agrees)."""
        return max(0.0, self.top_logprob - self.logprob)


@dataclass(slots=True)
class TokenLogprob:
    """One token of a scored sequence (`LanguageModel.token_logprobs`): its id, text and
    log-probability, and the `top` most likely tokens at its position as (id, text, logprob)."""

    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass(slots=True)
class TextDelta:
    """One piece of a streamed generation (`LanguageModel.stream`): new text, the content tokens it came
    from, and their scores when the stream was asked for logprobs. The pieces' texts concatenate to
    the final `Completion.text` exactly."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class CallScope:
    """One model call as the layers under its caller see it (open one with `model_call`).

    The caller sets `deadline`; a transport with its own retry policy (`HttpClient`) ends every
    request of the call by then, counts each request it tries into `attempts` (and each resend
    into `retries`), and sets `retried`: the call's failures are then final, and a caller must
    not retry them again.
    """

    deadline: float | None = None  # time.monotonic() by which the call must be over; None: no limit
    attempts: int = 0  # requests tried, refused connections included
    retries: int = 0  # of those, resends of a request whose earlier attempt failed
    retried: bool = False  # a transport applied its own retry policy to this call


_CURRENT_CALL: ContextVar[CallScope | None] = ContextVar("thinkahead_model_call", default=None)


@contextmanager
def model_call(deadline: float | None = None) -> Iterator[CallScope]:
    """Run a model call in a fresh `CallScope`; an enclosing call's deadline still applies, and the
    enclosing call's counts include this one's."""
    outer = _CURRENT_CALL.get()
    if outer is not None and outer.deadline is not None:
        deadline = outer.deadline if deadline is None else min(deadline, outer.deadline)
    scope = CallScope(deadline)
    token = _CURRENT_CALL.set(scope)
    try:
        yield scope
    finally:
        _CURRENT_CALL.reset(token)
        if outer is not None:
            outer.attempts += scope.attempts
            outer.retries += scope.retries
            outer.retried = outer.retried or scope.retried


def current_call() -> CallScope | None:
    """The innermost open `model_call` scope of this task, if any."""
    return _CURRENT_CALL.get()


@dataclass(slots=True)
class FirstCompletion:
    """The first completion a backend returned inside `observe_first_completion` (None until then)."""

    completion: Completion | None = None


_FIRST: ContextVar[FirstCompletion | None] = ContextVar("thinkahead_first_completion", default=None)


@contextmanager
def observe_first_completion() -> Iterator[FirstCompletion]:
    """Note the first completion that any backend returns to this task or a task it starts (the server
    reads how much of a workflow's prompt its first internal call found cached)."""
    holder = FirstCompletion()
    token = _FIRST.set(holder)
    try:
        yield holder
    finally:
        _FIRST.reset(token)


def observed(completion: Completion) -> Completion:
    """What a backend's `generate` returns, noted by an enclosing `observe_first_completion`."""
    holder = _FIRST.get()
    if holder is not None and holder.completion is None:
        holder.completion = completion
    return completion


Tier = Literal["small", "large"]  # a model's role in a run: the drafting model or the judging one
TIERS: tuple[Tier, ...] = get_args(Tier)


class LanguageModel(abc.ABC):
    """A model the orchestrator can call. Subclasses implement the two async methods."""

    name: str = "model"

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> Completion:
        """Generate a continuation of the request's prompt."""

    @abc.abstractmethod
    async def next_token_logprobs(self, prompt: str, top_k: int = 20) -> dict[str, float]:
        """Log-probabilities of the `top_k` most likely next tokens after `prompt` (raw text)."""

    async def stream(self, request: GenerationRequest, *, top_logprobs: int | None = None
                     ) -> AsyncIterator[TextDelta | Completion]:
        """The generation as it is produced: `TextDelta`s, then the final `Completion`.

        With `top_logprobs` (0 or more alternatives) each delta carries the scores of its tokens, as
        `token_logprobs` gives them. The default generates the whole text and yields it once; a
        backend that decodes token by token overrides it. Closing the iterator early cancels the
        generation.
        """
        completion = await self.generate(request)
        if completion.text or top_logprobs is not None:
            scores = None
            if top_logprobs is not None:
                scores = await self._completion_logprobs(request, completion, top_logprobs)
            yield TextDelta(completion.text, content_ids(self, completion), scores)
        yield completion

    async def _completion_logprobs(self, request: GenerationRequest, completion: Completion,
                                   top_k: int) -> list[TokenLogprob]:
        ids = content_ids(self, completion)
        if not ids:
            return []
        prompt_ids = self.encode(prompt_text(self, request))
        return await self.token_logprobs(prompt_ids + ids, len(prompt_ids), top_k)

    @property
    def scores_tokens(self) -> bool:
        """Whether this model scores a given continuation (`continuation_scores`): the agreement check
        and the confidence gate need it. True where the backend overrides it."""
        return type(self).continuation_scores is not LanguageModel.continuation_scores

    async def continuation_logprobs(self, prompt: str, continuation: str) -> list[float]:
        """Log-probability of each token of `continuation` after `prompt` (likelihood judges)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a given continuation")

    async def continuation_scores(self, prompt: str, continuation: str) -> list[TokenScore]:
        """Each token of `continuation` after `prompt` with the model's own top choice beside it,
        in one forward pass (agreement verifiers)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a given continuation")

    async def token_logprobs(self, token_ids: list[int], start: int, top_k: int = 0) -> list[TokenLogprob]:
        """Each token of `token_ids[start:]` scored after the ones before it (with its `top_k`
        alternatives), in one forward pass: OpenAI-style `logprobs` of a generation or an echoed prompt."""
        raise NotImplementedError(f"{type(self).__name__} cannot score token ids")

    def encode(self, text: str) -> list[int]:
        """Token ids of raw prompt text, for backends with a tokenizer."""
        raise NotImplementedError(f"{type(self).__name__} has no tokenizer")

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        """The text of each token id on its own, for backends with a tokenizer."""
        raise NotImplementedError(f"{type(self).__name__} has no tokenizer")

    @property
    def context_length(self) -> int | None:
        """The most tokens (prompt and output) the model attends to; None where the backend does not say."""
        return None

    def render(self, messages: list[dict[str, str]], continue_final: bool = False) -> str:
        """The raw prompt text for chat `messages` (the model's chat template where it has one)."""
        return render_plain(messages, continue_final)

    def count_tokens(self, text: str) -> int:
        """Tokens in `text` (an estimate where the backend has no tokenizer)."""
        return max(1, len(text) // 4) if text else 0

    #: the `GrammarSpec` kinds this backend enforces while it decodes (none by default)
    grammar_kinds: tuple[str, ...] = ()
    #: whether its outputs under a grammar need no checking (True only where our own decoder enforces
    #: it; a remote server's are checked and repaired like unconstrained ones)
    grammar_guaranteed: bool = False

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Refuse `spec` now, by its field, where this backend cannot enforce it or it does not compile."""
        if spec.kind not in self.grammar_kinds:
            from thinkahead.token_spec.grammar import GrammarError

            raise GrammarError(f"a {spec.kind} grammar cannot be enforced by {type(self).__name__} {self.name!r}",
                               spec.field)

    def prepare_grammars(self) -> None:
        """Get ready for constrained requests in the background (a server calls it at start); the default
        has nothing to prepare."""

    async def end_session(self, session_id: str) -> None:
        """Forget what the backend keeps for an agent session; the default keeps nothing."""

    async def aclose(self) -> None:
        """Release connections or memory; the default holds nothing."""


def grammar_fits(model: LanguageModel, grammar: GrammarSpec | None) -> bool:
    """Whether `model` enforces `grammar` while it decodes (a caller leaves out one it does not)."""
    return grammar is not None and grammar.kind in model.grammar_kinds


def content_ids(model: LanguageModel, completion: Completion) -> list[int]:
    """The completion's token ids less a final end-of-turn token or token that completed a stop string."""
    ids = list(completion.token_ids)
    if ids and (ids[-1] in set(getattr(model, "stop_token_ids", ())) or completion.matched_stop is not None):
        ids.pop()
    return ids


def check_messages(messages: list[dict[str, str]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")


def resolve_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object: a spec string (registry name, hub id, directory) is loaded, anything else kept."""
    if isinstance(tokenizer, str):
        from thinkahead.models.engine.weights.load import load_tokenizer

        return load_tokenizer(tokenizer)
    return tokenizer


def render_plain(messages: list[dict[str, str]], continue_final: bool = False) -> str:
    """A template-free rendering ("role: content" blocks) for backends without a chat template."""
    check_messages(messages)
    parts = [f"{m['role']}: {m['content']}" for m in messages]
    if continue_final:
        return "\n\n".join(parts)
    return "\n\n".join(parts + ["assistant: "])


def render_chat(tokenizer: Any, messages: list[dict[str, str]], continue_final: bool = False) -> str:
    """Apply the tokenizer's chat template; `continue_final` leaves the last message open.

    Reasoning-model templates drop the `<think>` block of earlier assistant turns; the final,
    continued message is left exactly as given, so a step loop sees its own thinking text.
    """
    check_messages(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        return render_plain(messages, continue_final)
    if continue_final and messages[-1]["role"] != "assistant":
        raise ValueError("continue_final=True needs the last message to be an assistant message")
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
    )


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of raw (already templated) prompt text; a BOS is added only where the tokenizer wants one."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and getattr(tokenizer, "add_bos_token", False) and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def prompt_text(model: LanguageModel, request: GenerationRequest) -> str:
    """The raw prompt of `request` for `model`."""
    if request.prompt is not None:
        return request.prompt
    return model.render(request.messages or [], request.continue_final)
