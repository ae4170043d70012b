"""`ScriptedModel`: a deterministic fake `LanguageModel` for tests; it records every call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from thinkahead.models.base import Completion, GenerationRequest, LanguageModel, observed, prompt_text

Responder = Callable[[str, GenerationRequest], str]
Scorer = Callable[[str], dict[str, float]]


@dataclass(slots=True)
class Call:
    kind: str  # "generate", "logprobs" or "failed" (a scripted failure was raised)
    prompt: str
    request: GenerationRequest | None = None
    output: str | dict[str, float] = ""


@dataclass
class ScriptedModel(LanguageModel):
    """Answers from a script: a list of outputs used in order (then the last forever), or a function.

    Stop strings behave as on a real server: the output ends before the first stop string, and
    `matched_stop` names it. `logprobs` scripts `next_token_logprobs` the same way (a list of dicts,
    or a function of the prompt). `delay_s` simulates latency so async overlap can be tested;
    `failures` are raised by the next generate calls, one each, to test retries.
    """

    outputs: Sequence[str] | Responder = ("",)
    logprobs: Sequence[dict[str, float]] | Scorer = ({},)
    name: str = "scripted"
    delay_s: float = 0.0
    calls: list[Call] = field(default_factory=list)
    failures: list[Exception] = field(default_factory=list)
    _gen_i: int = 0
    _lp_i: int = 0

    async def generate(self, request: GenerationRequest) -> Completion:
        prompt = prompt_text(self, request)
        if self.failures:
            self.calls.append(Call("failed", prompt, request))
            raise self.failures.pop(0)
        if callable(self.outputs):
            raw = self.outputs(prompt, request)
        else:
            raw = self.outputs[min(self._gen_i, len(self.outputs) - 1)]
        self._gen_i += 1
        text, matched = raw, None
        cut = [(raw.find(s), s) for s in request.stop if s and s in raw]
        if cut:
            pos, matched = min(cut)
            text = raw[:pos]
        words = text.split()
        finish = "stop"
        if len(words) > request.max_new_tokens:
            text, finish, matched = " ".join(words[: request.max_new_tokens]), "length", None
        self.calls.append(Call("generate", prompt, request, text))  # recorded even if cancelled below
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        n = self.count_tokens(text)
        return observed(Completion(
            text=text, finish_reason=finish, matched_stop=matched, prompt_tokens=self.count_tokens(prompt),
            completion_tokens=n, time_s=self.delay_s, model=self.name,
        ))

    async def next_token_logprobs(self, prompt: str, top_k: int = 20) -> dict[str, float]:
        if callable(self.logprobs):
            out = self.logprobs(prompt)
        else:
            out = self.logprobs[min(self._lp_i, len(self.logprobs) - 1)]
        self._lp_i += 1
        top = dict(sorted(out.items(), key=lambda kv: -kv[1])[:top_k])
        self.calls.append(Call("logprobs", prompt, None, top))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return top

    def count_tokens(self, text: str) -> int:
        """One token per whitespace-separated word: easy to reason about in tests."""
        return len(text.split())

    def generated_prompts(self) -> list[str]:
        return [c.prompt for c in self.calls if c.kind == "generate"]
