"""Token scores from an OpenAI-compatible server (`OpenAIModel`): which method the server takes, probed once.

The agreement judge and token repair need each token of a given continuation scored, with the model's
own choice beside it. No portable OpenAI field does that, so the server's method is probed once, when
first needed (`RemoteScorer.probe`; `SpecReason` probes before a run's first step), in this order:

* `echo` (vLLM, SGLang's OpenAI API, thinkahead's own `serve`): `POST /v1/completions` with the token ids,
  `echo: true`, `logprobs: k`, `max_tokens: 0`: one prefill scores every token. vLLM's
  `choices[0].prompt_logprobs` (keyed by token id, with ranks) is read where the reply has it; otherwise the
  legacy `logprobs` (`tokens`, `token_logprobs`, `top_logprobs` keyed by text), whose entries align with the ids
  sent (the first token has no score).
* `llama` (llama.cpp's `llama-server`, whose `/v1/completions` ignores `echo`): the native `POST /completion`
  scores only generated tokens, so each continuation token costs one request: the ids before it as the prompt,
  `n_predict: 1`, `n_probs: k`, greedy, and `logit_bias` forcing that token to be the one sampled. The server
  reports the sampled token's probability from a softmax over all raw logits (`post_sampling_probs: false`:
  the bias and the samplers are not in it), so its log-probability is exact wherever it ranks, and the top `k`
  beside it. The cost is one decode step and one round trip per token, not one prefill for them all; the
  server's prompt cache keeps each request to the one new token while a slot holds the prefix. (Tried and
  dropped: one request generating the whole continuation under a grammar of its text. On an idle llama-server
  with the 1.5B, a 44-token step took 2.5-2.8 s that way against 1.34 s a token per request: the grammar
  sampler is slow over a 151k vocabulary, and the server's own tokens of the text parted from ours after 10.)

Token ids: with a local `tokenizer` (`OpenAIModel(tokenizer=...)`), the ids are ours and are sent as the prompt,
so the scores are of exactly the tokens a local model would score; without one, the server's `POST /tokenize`
gives them (vLLM and SGLang: `{"prompt"}`, llama-server: `{"content"}`; both answer `{"tokens": [...]}`).
Legacy `top_logprobs` name alternatives by text only: they are mapped back to an id with the local tokenizer
where the text is one token, else get id -1. A server that takes neither method is refused by name
(`ScoresUnavailable`: the model, the URL and what each probe answered).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from thinkahead.models.base import TokenLogprob, TokenScore, encode_prompt
from thinkahead.models.errors import ThinkaheadError
from thinkahead.models.http import ModelServerError

if TYPE_CHECKING:
    from thinkahead.models.openai import OpenAIModel

log = logging.getLogger(__name__)

ECHO, LLAMA = "echo", "llama"  # the scoring methods, in probing order
SCORE_METHODS = (ECHO, LLAMA)
FORCE_BIAS = 1.0e4  # llama.cpp logit_bias that makes the scored token the sampled one (raw logits are ~1e1)
PROBE_TEXT = "One, two, three"  # a few tokens in any vocabulary


class ScoresUnavailable(ThinkaheadError, ValueError):
    """A server that scores no tokens by any method probed: the message names the model, the URL and each probe."""


class UnusableScores(ModelServerError):
    """A reply that does not hold the scores asked for (a server that ignores `echo`, a missing field)."""


REFUSING_STATUSES = (400, 404, 405, 422, 501)  # a probe answered so: the server does not take that method


class RemoteScorer:
    """Scores token ids on `model`'s server by the method probed first (`method`: None until probed)."""

    def __init__(self, model: OpenAIModel) -> None:
        self.model = model
        self.method: str | None = None
        self.refusal: str | None = None  # why no method works, once probed

    @property
    def root(self) -> str:
        """The server's root URL (llama-server's native endpoints live there, not under /v1)."""
        base = self.model.client.base_url
        return base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def may_score(self) -> bool:
        """False once a probe found no method; True before (the probe decides) and after one found a method."""
        return self.refusal is None

    # -- probing ---------------------------------------------------------------------------------

    async def probe(self) -> str:
        """The method this server scores tokens by, probed once; `ScoresUnavailable` where none works."""
        if self.method is not None:
            return self.method
        if self.refusal is not None:
            raise ScoresUnavailable(self.refusal)
        answers = []
        for method in SCORE_METHODS:
            try:
                ids = await self.ids(PROBE_TEXT, method)
                scored = await self._score(method, ids, len(ids) - 1, 1)
                if len(scored) != 1 or not math.isfinite(scored[0].logprob) or not scored[0].top:
                    raise UnusableScores(f"scored {len(scored)} tokens without a top choice")
            except (UnusableScores, ModelServerError, ValueError) as exc:
                if isinstance(exc, ModelServerError) and not isinstance(exc, UnusableScores) \
                        and exc.status not in REFUSING_STATUSES:
                    raise  # no answer (a server down or overloaded) says nothing about what it takes
                answers.append(f"{_describe(method)}: {exc}"[:300])
                continue
            self.method = method
            log.info("%s scores tokens by %s", self.model.model, _describe(method))
            return method
        hint = ("" if self.model.tokenizer is not None else
                " (without a local tokenizer the ids come from the server's /tokenize: give the model its tokenizer)")
        self.refusal = (f"model {self.model.model!r} at {self.model.client.base_url} cannot score tokens: "
                        + "; ".join(answers) + hint)
        raise ScoresUnavailable(self.refusal)

    # -- scoring ---------------------------------------------------------------------------------

    async def ids(self, text: str, method: str | None = None) -> list[int]:
        """The token ids of raw prompt `text`: the local tokenizer's, else the server's `/tokenize`."""
        if not isinstance(text, str) or not text:
            raise ValueError("the text to score must be a non-empty string")
        tokenizer = self.model.tokenizer
        if tokenizer is not None:
            ids = encode_prompt(tokenizer, text)
        else:
            method = method or await self.probe()
            body: dict[str, Any] = ({"content": text, "add_special": True, "parse_special": True} if method == LLAMA
                                    else {"model": self.model.model, "prompt": text})
            reply = await self.model.client.post_json(f"{self.root}/tokenize", body, idempotent=True)
            ids = reply.get("tokens")
            if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
                raise UnusableScores(f"/tokenize reply has no token id list: {reply!r}"[:300])
        if not ids:
            raise ValueError(f"the text {text[:40]!r} has no tokens")
        return list(ids)

    async def score(self, token_ids: list[int], start: int, top_k: int) -> list[TokenLogprob]:
        """Each of `token_ids[start:]` scored after the ones before it, with its `top_k` (>= 1) likeliest alternatives."""
        if not 0 < start < len(token_ids) or top_k < 1:
            raise ValueError(f"scoring needs 0 < start < len(token_ids) and top_k >= 1, got {start}, {top_k}")
        return await self._score(await self.probe(), token_ids, start, top_k)

    async def continuation(self, prompt: str, continuation: str) -> list[TokenScore]:
        """`LanguageModel.continuation_scores`: each continuation token and the model's own choice there."""
        from thinkahead.token_spec.names import common_prefix_len

        if not isinstance(continuation, str) or not continuation:
            raise ValueError("scoring a continuation needs a non-empty continuation")
        await self.probe()
        prompt_ids = await self.ids(prompt)
        ids = await self.ids(prompt + continuation)
        start = common_prefix_len(prompt_ids, ids)  # the boundary token may merge across the two
        if start == 0 or start >= len(ids):
            raise ValueError("scoring a continuation needs a non-empty prompt and continuation")
        out = []
        for t in await self.score(ids, start, 1):
            best_id, best_text, best = t.top[0]
            own = t.text if t.logprob >= best else self._plain_text(best_id, best_text)
            out.append(TokenScore(t.text, t.logprob, max(t.logprob, best), own))
        return out

    async def _score(self, method: str, ids: list[int], start: int, top_k: int) -> list[TokenLogprob]:
        if method == ECHO:
            return await self._score_echo(ids, start, top_k)
        return [await self._score_llama(ids, i, top_k) for i in range(start, len(ids))]

    async def _score_echo(self, ids: list[int], start: int, top_k: int) -> list[TokenLogprob]:
        model = self.model
        payload = {**model.extra_body, "model": model.model, "prompt": ids, "echo": True, "logprobs": top_k,
                   "max_tokens": 0, "temperature": 0}
        choice = model._first_choice(await model.client.post_json("/completions", payload))
        rows = choice.get("prompt_logprobs")  # vLLM: [None, {id: {logprob, rank, decoded_token}}, ...]
        if isinstance(rows, list) and len(rows) >= len(ids):
            return [self._from_ranked(ids[i], rows[i], top_k) for i in range(start, len(ids))]
        lp = choice.get("logprobs")
        tokens = lp.get("tokens") if isinstance(lp, dict) else None
        values = lp.get("token_logprobs") if isinstance(lp, dict) else None
        tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
        if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)
                and min(len(tokens), len(values), len(tops)) >= len(ids)):
            raise UnusableScores(f"echo reply scores no prompt tokens (logprobs: {str(lp)[:120]})")
        return [self._from_legacy(ids[i], tokens[i], values[i], tops[i], top_k) for i in range(start, len(ids))]

    async def _score_llama(self, ids: list[int], i: int, top_k: int) -> TokenLogprob:
        payload = {"prompt": ids[:i], "n_predict": 1, "n_probs": top_k, "temperature": 0, "cache_prompt": True,
                   "post_sampling_probs": False, "logit_bias": [[ids[i], FORCE_BIAS]]}
        reply = await self.model.client.post_json(f"{self.root}/completion", payload)
        probs = reply.get("completion_probabilities")
        entry = probs[0] if isinstance(probs, list) and probs and isinstance(probs[0], dict) else None
        if entry is None or entry.get("id") != ids[i] or not _is_number(entry.get("logprob")):
            raise UnusableScores(f"/completion reply scores no forced token {ids[i]}: {str(probs)[:160]}")
        top = []
        for alt in entry.get("top_logprobs") or []:
            if not (isinstance(alt, dict) and _is_int(alt.get("id")) and _is_number(alt.get("logprob"))):
                raise UnusableScores(f"/completion top_logprobs entry is not {{id, token, logprob}}: {alt!r}"[:200])
            top.append((alt["id"], self._text(alt["id"], str(alt.get("token", ""))), float(alt["logprob"])))
        return TokenLogprob(ids[i], self._text(ids[i], str(entry.get("token", ""))), float(entry["logprob"]),
                            top[:top_k])

    # -- reply shapes ----------------------------------------------------------------------------

    def _from_ranked(self, token: int, row: Any, top_k: int) -> TokenLogprob:
        """One vLLM `prompt_logprobs` row: {"id": {"logprob", "rank", "decoded_token"}} for the token and the top."""
        if not isinstance(row, dict) or str(token) not in row:
            raise UnusableScores(f"prompt_logprobs row does not score token {token}: {str(row)[:160]}")
        entries = []
        for key, value in row.items():
            if not (isinstance(value, dict) and _is_number(value.get("logprob")) and str(key).lstrip("-").isdigit()):
                raise UnusableScores(f"prompt_logprobs entry is not id -> {{logprob, rank}}: {key!r}: {value!r}"[:200])
            entries.append((int(value.get("rank") or 0) or 10**9, int(key), float(value["logprob"]),
                            str(value.get("decoded_token") or "")))
        entries.sort(key=lambda e: (e[0], -e[2]))
        own = row[str(token)]
        top = [(tid, self._text(tid, text), lp) for _, tid, lp, text in entries[:top_k]]
        return TokenLogprob(token, self._text(token, str(own.get("decoded_token") or "")), float(own["logprob"]), top)

    def _from_legacy(self, token: int, text: Any, value: Any, top: Any, top_k: int) -> TokenLogprob:
        """One position of legacy `logprobs`: its token text and log-probability, and the top by text."""
        if not _is_number(value) or not isinstance(top, dict):
            raise UnusableScores(f"echo reply has no score for prompt token {token}: {value!r}, {top!r}"[:200])
        ranked = sorted(((str(t), float(lp)) for t, lp in top.items() if _is_number(lp)), key=lambda kv: -kv[1])
        if not ranked:
            raise UnusableScores(f"echo reply has no top_logprobs for prompt token {token}")
        alts = [(self._id_of(t), t, lp) for t, lp in ranked[:top_k]]
        return TokenLogprob(token, self._text(token, str(text)), float(value), alts)

    # -- token texts -----------------------------------------------------------------------------

    def _text(self, token: int, server_text: str) -> str:
        """A token's text: the local tokenizer's (as a local model gives it) where there is one, else the server's."""
        tokenizer = self.model.tokenizer
        return tokenizer.decode([token]) if tokenizer is not None and token >= 0 else server_text

    def _plain_text(self, token: int, text: str) -> str:
        """The text a local model puts for its own choice: special tokens (end of turn) are ""."""
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            return text
        if token < 0:
            return "" if text in set(getattr(tokenizer, "all_special_tokens", ())) else text
        return tokenizer.decode([token], skip_special_tokens=True)

    def _id_of(self, text: str) -> int:
        """The id of the one token whose text is `text` (legacy replies name alternatives by text), else -1."""
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            return -1
        ids = tokenizer.encode(text, add_special_tokens=False)
        return int(ids[0]) if len(ids) == 1 and tokenizer.decode(ids) == text else -1


def _describe(method: str) -> str:
    return {ECHO: "POST /v1/completions with echo + logprobs (vLLM, thinkahead serve)",
            LLAMA: "POST /completion with n_probs + logit_bias (llama-server)"}[method]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["ECHO", "LLAMA", "RemoteScorer", "SCORE_METHODS", "ScoresUnavailable", "UnusableScores"]
