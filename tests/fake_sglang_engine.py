"""The fake SGLang server's model and generation routes: `/generate` and `/v1/completions`.

`SGLangGenerationRoutes` is mixed into `tests.fake_sglang.FakeSGLangServer`, which holds the state
these methods read (responder, top_logprobs, speculative settings, the radix list, the request and
reply logs). The "model" is a character-level tokenizer (token id = code point, EOS = 0) and a
responder that writes the raw continuation; here it is run through stop strings, `max_new_tokens`
and the prefix cache, and its reply is shaped as SGLang 0.5.23 shapes it (meta_info, logprob
entries `[logprob, token_id, text]`, spec_* statistics, SSE events, OpenAI completions). The
sources of every shape are listed in the docstring of `tests/fake_sglang.py`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from tests.fake_http import DropConnection, Reply, Stream, json_reply

EOS_TOKEN_ID = 0

# sglang/api/v1/api_types.py, SamplingParams (unknown keys are a contract error)
SAMPLING_PARAMS_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)


def encode(text: str) -> list[int]:
    """The fake's tokenizer: one token per character, id = code point."""
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != EOS_TOKEN_ID)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


Responder = Callable[[str, dict[str, Any]], str]


class SGLangGenerationRoutes:
    """`/generate` and `/v1/completions` of `FakeSGLangServer` (the state lives there)."""

    # -- /generate ---------------------------------------------------------------------------------

    async def _generate(self, body: Any, fault: str | None) -> Reply | Stream:
        if not isinstance(body, dict):
            return json_reply(400, {"error": f"invalid type: {type(body).__name__}, expected struct GenerateRequest"})
        sampling = body.get("sampling_params") or {}
        unknown = [k for k in sampling if k not in SAMPLING_PARAMS_FIELDS]
        if unknown:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_PARAMS_FIELDS)
            return json_reply(400, {"error": f"unknown field `{unknown[0]}`, expected one of {listed}"})
        if (body.get("text") is None) == (body.get("input_ids") is None):
            return json_reply(400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})
        prompt_ids = list(body["input_ids"]) if body.get("input_ids") is not None else encode(body["text"])
        return_logprob = bool(body.get("return_logprob"))
        lsl = body.get("logprob_start_len")
        lsl = -1 if lsl is None or not return_logprob else int(lsl)
        if lsl == -1 and return_logprob:
            lsl = len(prompt_ids)  # scheduler.py: output logprobs only, by default
        if lsl > len(prompt_ids):
            message = (f"req.logprob_start_len={lsl} is higher than the number of input tokens "
                       f"len(req.origin_input_ids)={len(prompt_ids)}. Please use a smaller logprob_start_len.")
            return json_reply(400, {"error": {"message": message}})
        out = self._run_model(body, sampling, prompt_ids, return_logprob, lsl)
        if fault == "abort":
            out["finish"] = {"type": "abort", "message": "Abort before prefill", "status_code": None,
                             "err_type": None}
        if body.get("stream"):
            return Stream(self._stream_events(body, out, dropped=fault == "dropstream"))
        reply = self._response(body, out, len(out["output_ids"]), final=True)
        self.replies.append(reply)
        return json_reply(200, reply)

    def _run_model(self, body: dict[str, Any], sampling: dict[str, Any], prompt_ids: list[int],
                   return_logprob: bool, lsl: int) -> dict[str, Any]:
        """Generate: text, ids, finish reason and the cached-prefix length, as the engine would."""
        t0 = time.perf_counter()
        prompt = decode(prompt_ids)
        max_new = int(sampling.get("max_new_tokens", 128))
        top_k = int(body.get("top_logprobs_num") or 0)
        dist = self._dist(prompt)
        if return_logprob and top_k > 0 and max_new == 1:
            raw = max(dist, key=dist.get)  # a one-token scoring call: the greedy token
        else:
            raw = self.responder(prompt, body)
        stops = sampling.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        hits = [(raw.find(s), s) for s in stops if s and s in raw]
        finish: dict[str, Any]
        if hits and min(hits)[0] + len(min(hits)[1]) <= max_new:
            pos, stop = min(hits)
            generated = raw[: pos + len(stop)]
            text = generated if sampling.get("no_stop_trim") else raw[:pos]
            finish = {"type": "stop", "matched": stop}
        elif len(raw) >= max_new:
            generated = text = raw[:max_new]
            finish = {"type": "length", "length": max_new}
        else:
            generated = text = raw
            finish = {"type": "stop", "matched": EOS_TOKEN_ID}
        output_ids = encode(generated) + ([EOS_TOKEN_ID] if finish.get("matched") == EOS_TOKEN_ID else [])
        # RadixAttention: reuse the longest cached prefix, at most len-1, at most logprob_start_len
        max_prefix = len(prompt_ids) - 1
        if return_logprob and lsl >= 0:
            max_prefix = min(max_prefix, lsl)
        best = max((common_prefix(prompt_ids, seq) for seq in self._radix), default=0)
        cached = max(0, min(best, max_prefix))
        self._radix.append(prompt_ids + output_ids)
        self.generations.append({"prompt_ids": prompt_ids, "logprob_start_len": lsl, "cached_tokens": cached,
                                 "return_logprob": return_logprob})
        return {"text": text, "output_ids": output_ids, "finish": finish, "prompt_ids": prompt_ids,
                "cached": cached, "lsl": lsl, "dist": dist, "top_k": top_k, "t0": t0,
                "rid": body.get("rid") or uuid.uuid4().hex}

    def _dist(self, prompt: str) -> dict[str, float]:
        dist = self.top_logprobs(prompt) if callable(self.top_logprobs) else self.top_logprobs
        return dict(sorted(dist.items(), key=lambda kv: -kv[1]))

    def _response(self, body: dict[str, Any], out: dict[str, Any], n: int, final: bool,
                  start: int = 0) -> dict[str, Any]:
        """The reply (or one stream event) after the first `n` output tokens."""
        ids = out["output_ids"][:n]

        def visible(k: int) -> str:  # the text after k tokens: a prefix of the final (stop-trimmed) text
            return out["text"][: len(decode(out["output_ids"][:k]))]

        meta: dict[str, Any] = {
            "id": out["rid"],
            "finish_reason": out["finish"] if final else None,
            "prompt_tokens": len(out["prompt_ids"]),
            "weight_version": "default",
            "num_retractions": 0,
        }
        if body.get("return_logprob"):
            meta.update(self._logprobs(body, out, n))
        meta.update({"reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": out["cached"]})
        if final:
            meta["e2e_latency"] = time.perf_counter() - out["t0"]
            # the first token comes from prefill; each verify step of decode yields accepted drafts + 1
            verify_ct = math.ceil((n - 1) / self.accept_length) if n > 1 else 0
            if self.speculative_algorithm and verify_ct > 0:
                proposed = verify_ct * (self.num_draft_tokens - 1)
                correct = (n - 1) - verify_ct
                meta.update({
                    "spec_accept_rate": correct / proposed,
                    "spec_accept_length": n / verify_ct,
                    "spec_num_correct_drafts": correct,
                    "spec_num_proposed_drafts": proposed,
                    "spec_verify_ct": verify_ct,
                    "spec_correct_drafts_histogram": _histogram(correct, verify_ct, self.num_draft_tokens),
                })
            meta["response_sent_to_client_ts"] = time.time()
        if start:  # incremental streaming: this event's share only
            return {"text": visible(n)[len(visible(start)):], "output_ids": ids[start:], "meta_info": meta}
        return {"text": visible(n), "output_ids": ids, "meta_info": meta}

    def _logprobs(self, body: dict[str, Any], out: dict[str, Any], n: int) -> dict[str, Any]:
        """input/output token logprobs and top logprobs, as `[logprob, token_id, text]` entries."""
        with_text = bool(body.get("return_text_in_logprobs"))
        prompt_ids, lsl, dist, top_k = out["prompt_ids"], out["lsl"], out["dist"], out["top_k"]

        def entry(lp: float | None, tid: int) -> list[Any]:
            return [lp, tid, chr(tid) if with_text else None]

        input_lps = [entry(None if pos == 0 else -0.5, prompt_ids[pos]) for pos in range(lsl, len(prompt_ids))]
        top_rows = [[entry(lp, ord(t[0])) for t, lp in list(dist.items())[:top_k]]]
        output_ids = out["output_ids"][:n]
        output_lps = [entry(dist.get(chr(t), -0.01) if i == 0 else -0.01, t) for i, t in enumerate(output_ids)]
        meta: dict[str, Any] = {
            "input_token_logprobs": input_lps,
            "output_token_logprobs": output_lps,
            "output_token_logprobs_length": len(output_lps),
        }
        if top_k > 0:
            # the token itself first (the toy engine's greedy choice), then less likely ones, top_k in all
            meta["input_top_logprobs"] = [None if pos == 0 else [entry(-0.5 - j, prompt_ids[pos] + j) for j in range(top_k)]
                                          for pos in range(lsl, len(prompt_ids))]
            meta["output_top_logprobs"] = [top_rows[0] if i == 0 else [entry(-0.01, t)]
                                           for i, t in enumerate(output_ids)]
        return meta

    async def _stream_events(self, body: dict[str, Any], out: dict[str, Any], dropped: bool) -> AsyncIterator[bytes]:
        total = len(out["output_ids"])
        cuts = list(range(self.stream_chunk, total, self.stream_chunk)) + [total]
        sent = 0
        for i, n in enumerate(cuts):
            final = n == total
            start = sent if self.incremental_streaming_output else 0
            event = self._response(body, out, n, final, start=start)
            yield b"data: " + json.dumps(event).encode() + b"\n\n"
            sent = n
            if dropped and i == 0:
                raise DropConnection
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"

    # -- /v1/completions ---------------------------------------------------------------------------

    async def _completions(self, body: Any, fault: str | None) -> Reply:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return json_reply(400, {"object": "error", "message": "prompt must be a string", "type": "BadRequestError",
                                    "param": None, "code": 400})
        sampling = {"max_new_tokens": body.get("max_tokens", 16), "stop": body.get("stop"),
                    "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                    "sampling_seed": body.get("seed")}
        native = {"text": prompt, "sampling_params": sampling}
        if body.get("logprobs"):
            native.update(return_logprob=True, top_logprobs_num=int(body["logprobs"]), return_text_in_logprobs=True)
        ids = encode(prompt)
        out = self._run_model(native, sampling, ids, bool(body.get("logprobs")),
                              len(ids) if body.get("logprobs") else -1)
        finish = out["finish"]
        reason = "abort" if fault == "abort" else finish["type"]
        logprobs = None
        if body.get("logprobs"):
            k = int(body["logprobs"])
            top = dict(list(out["dist"].items())[:k])
            tokens = [chr(t) for t in out["output_ids"] if t != EOS_TOKEN_ID]
            logprobs = {"text_offset": list(range(len(tokens))), "token_logprobs": [top.get(t, -0.01) for t in tokens],
                        "tokens": tokens, "top_logprobs": [top] + [{t: -0.01} for t in tokens[1:]]}
        usage: dict[str, Any] = {
            "prompt_tokens": len(ids), "total_tokens": len(ids) + len(out["output_ids"]),
            "completion_tokens": len(out["output_ids"]),
            "prompt_tokens_details": {"cached_tokens": out["cached"], "image_tokens": None, "audio_tokens": None,
                                      "video_tokens": None} if self.enable_cache_report else None,
            "reasoning_tokens": 0, "completion_tokens_details": None,
        }
        reply = {
            "id": out["rid"], "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or self.served_model_name,
            "choices": [{"index": 0, "text": out["text"], "logprobs": logprobs, "finish_reason": reason,
                         "matched_stop": finish.get("matched")}],
            "usage": usage, "metadata": None,
        }
        if body.get("stream"):
            return Stream(self._completion_events(reply))
        return json_reply(200, reply)

    async def _completion_events(self, reply: dict[str, Any]) -> AsyncIterator[bytes]:
        """/v1/completions streamed as SGLang does: text deltas of `stream_chunk` characters, each choice with
        `finish_reason` and `matched_stop` (null until the last event), then [DONE]."""
        choice = reply["choices"][0]
        text, n = choice["text"], self.stream_chunk
        cuts = list(range(0, len(text), n)) or [0]
        for k, at in enumerate(cuts):
            last = k == len(cuts) - 1
            event = {"id": reply["id"], "object": "text_completion", "created": reply["created"],
                     "model": reply["model"], "choices": [{
                         "index": 0, "text": text[at:at + n], "logprobs": None,
                         "finish_reason": choice["finish_reason"] if last else None,
                         "matched_stop": choice["matched_stop"] if last else None}]}
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _histogram(correct: int, verify_ct: int, num_draft_tokens: int) -> list[int]:
    """Verify steps by number of accepted drafts, spread as evenly as the totals allow."""
    hist = [0] * num_draft_tokens
    base, extra = divmod(correct, verify_ct)
    base = min(base, num_draft_tokens - 1)
    hist[base] += verify_ct - extra
    hist[min(base + 1, num_draft_tokens - 1)] += extra
    return hist
