"""A small async JSON-over-HTTP client shared by the server backends (OpenAI-compatible, SGLang).

Why a wrapper around `httpx.AsyncClient`: every backend that talks to a model server needs the
same few things, and getting them subtly wrong costs whole benchmark runs:

* one pooled connection set per client (many steps and judge calls are in flight at once), sized
  by `max_connections`, created lazily inside the running event loop (an `httpx.AsyncClient` is
  bound to the loop it first ran in, and callers often build models outside any loop);
* the one retry layer of a model call (the orchestrator's metering layer does not retry a call
  that went through here). A generation is not idempotent and costs server time, so a POST is
  sent again only when it cannot have reached the server, or when the server asks for it:

  - resent, any request: a connect error (refused, reset while connecting), a connect timeout,
    a pool timeout (the request never left), HTTP 429, HTTP 503 with a Retry-After;
  - resent only when idempotent (GET, `post_json(..., idempotent=True)` such as /tokenize),
    raised at once for a POST: a read or write timeout, a connection dropped after the request
    was sent, HTTP 500, 502, 504 and other 5xx, a 503 without Retry-After, a 2xx whose body is
    not a JSON object. A 500 means the server read the request and failed, perhaps after
    generating; a 502/504 comes from a proxy whose upstream may still hold the request;
  - never resent: other 4xx replies (the caller's mistake);

* bounded: at most `max_retries` resends, each after a backoff (`backoff_s` doubling, up to 10%
  jitter, at least a 429/503's Retry-After, at most `max_backoff_s`), and every request ends by
  its deadline, all attempts and sleeps included: `call_timeout_s` after it starts, or sooner
  the deadline of the enclosing `model_call` scope (the orchestrator's: the run's `max_call_s`
  and what is left of the run's and the batch's `max_wall_s`). A backoff that would end past the
  deadline is not slept: the request fails at once;
* true counts: `ModelServerError.attempts` and its message ("after N attempts") give the number
  of requests tried, and every attempt and resend is counted into the current `model_call`
  scope, from which the metering layer fills a run's cost;
* one exception type, `ModelServerError`, carrying the HTTP status (when there was one) and the
  server's own error message, so callers never have to know httpx's exception tree.

Paths are joined to `base_url` (`HttpClient("http://h:8000/v1").post_json("/completions", ...)`
posts to `http://h:8000/v1/completions`); an absolute `http(s)://` URL is used as it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from thinkahead.models.base import current_call
from thinkahead.models.errors import ThinkaheadError

log = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT_S = 300.0  # one request, all attempts and backoff sleeps (local servers answer far sooner)
MAX_BACKOFF_S = 30.0  # default cap on one backoff sleep (also on a server's Retry-After)
_ERROR_SNIPPET = 300  # characters of an unparseable body quoted in an error message
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # the request never left
_MAY_HAVE_ARRIVED = "not resent: the request may have reached the server"
_PROCESSED = "not resent: the server had the request and may have run it"


class ModelServerError(ThinkaheadError, RuntimeError):
    """A model server could not be reached, failed, or answered something unusable.

    `status` is the HTTP status of the last reply (None when there was no reply: connection error
    or timeout); `url` is the URL that was requested; `attempts` the requests tried (0 where the
    error is not about a request, e.g. a reply the backend could not use).
    """

    def __init__(self, message: str, status: int | None = None, url: str | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.url = url
        self.attempts = attempts


class _Failed(Exception):
    """Internal: one attempt failed; `resend` says whether the request may be sent again."""

    def __init__(self, reason: str, *, status: int | None = None, retry_after_s: float | None = None,
                 resend: bool = False, note: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after_s = retry_after_s
        self.resend = resend
        self.note = note  # why it is not resent


class _Tries:
    """The attempts of one request: its deadline and counts, the wait before each resend, and the
    error that ends them."""

    def __init__(self, client: HttpClient, method: str, url: str) -> None:
        self.client, self.method, self.url = client, method, url
        self.started = time.monotonic()
        self.scope = current_call()
        own = None if client.call_timeout_s is None else self.started + client.call_timeout_s
        outer = None if self.scope is None else self.scope.deadline
        self.deadline = min((d for d in (own, outer) if d is not None), default=None)
        self.attempts = 0
        self.last: _Failed | None = None
        if self.scope is not None:
            self.scope.retried = True  # this client's policy decides; the caller must not retry again

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    async def next(self) -> None:
        """Count the next attempt, after a backoff when one failed; raise the request's final
        `ModelServerError` instead when there is to be none."""
        last = self.last
        remaining = self.remaining()
        if last is not None:
            if not last.resend:
                raise self.error(last, last.note)
            if self.attempts > self.client.max_retries:
                raise self.error(last)
            delay = self.client.backoff(self.attempts, last.retry_after_s)
            if remaining is not None and delay >= remaining:
                asked = "" if last.retry_after_s is None else f", Retry-After {last.retry_after_s:g} s"
                raise self.error(last, f"not resent: waiting {delay:.2f} s{asked} would pass the call's deadline")
            log.warning("%s %s failed (%s); resend %d/%d in %.2f s",
                        self.method, self.url, last.reason, self.attempts, self.client.max_retries, delay)
            await asyncio.sleep(delay)
        elif remaining is not None and remaining <= 0:
            raise self.error(None, "the call's deadline had passed before the first attempt")
        self.attempts += 1
        if self.scope is not None:
            self.scope.attempts += 1
            self.scope.retries += self.attempts > 1

    def past_deadline(self) -> _Failed:
        span = 0.0 if self.deadline is None else self.deadline - self.started
        return _Failed(f"no reply by the call's deadline ({span:.3g} s after the request started)")

    def error(self, last: _Failed | None, note: str = "") -> ModelServerError:
        n = self.attempts
        reason = last.reason if last is not None else "no request sent"
        message = f"{self.method} {self.url} failed after {n} attempt{'' if n == 1 else 's'}: {reason}"
        return ModelServerError(message + (f" ({note})" if note else ""),
                                status=None if last is None else last.status, url=self.url, attempts=n)


class HttpClient:
    """Async JSON client for one server: pooled connections, bounded retries, uniform errors.

    Args:
        base_url: the server's root, e.g. "http://localhost:8000/v1".
        timeout_s: limit for each of connecting, writing, reading (between bytes) and waiting for
            a pooled connection, per attempt.
        max_retries: resends after the first attempt (0: try once), of failures that may be
            resent (see the module docstring).
        backoff_s: the first resend's sleep; each later one doubles it (plus up to 10% jitter),
            capped at `max_backoff_s`. A 429/503 reply's `Retry-After` (seconds) is honoured when
            longer, up to the same cap.
        max_connections: size of the connection pool (concurrent requests beyond it queue).
        headers: sent with every request (e.g. `Authorization`).
        call_timeout_s: the deadline of one request, every attempt and backoff sleep included
            (None: only the enclosing `model_call` scope's deadline, if any).
        max_backoff_s: the cap on one backoff sleep.

    Use one client for many concurrent requests; `await aclose()` it in the loop that used it.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 64,
        headers: Mapping[str, str] | None = None,
        call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        if not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0 or None, got {call_timeout_s}")
        if not max_backoff_s >= 0:
            raise ValueError(f"max_backoff_s must be >= 0, got {max_backoff_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.max_connections = max_connections
        self.headers: dict[str, str] = dict(headers or {})
        self.call_timeout_s = None if call_timeout_s is None else float(call_timeout_s)
        self.max_backoff_s = float(max_backoff_s)
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return (f"HttpClient({self.base_url!r}, timeout_s={self.timeout_s:g}, max_retries={self.max_retries},"
                f" call_timeout_s={self.call_timeout_s})")

    # -- public API ------------------------------------------------------------------------------

    def url(self, path: str) -> str:
        """The full URL for `path` (absolute URLs are returned unchanged)."""
        if path.startswith(("http://", "https://")):
            return path
        return f"{self.base_url}/{path.lstrip('/')}"

    async def post_json(self, path: str, payload: Mapping[str, Any], *, idempotent: bool = False) -> dict[str, Any]:
        """POST `payload` as JSON and return the reply's JSON object. `idempotent=True` (a request
        that changes nothing and is cheap, e.g. tokenizing) lets it be resent like a GET."""
        return await self._request_json("POST", path, payload, idempotent)

    async def get_json(self, path: str) -> dict[str, Any]:
        """GET `path` and return the reply's JSON object (resent after any transient failure)."""
        return await self._request_json("GET", path, None, True)

    async def stream_lines(self, path: str, payload: Mapping[str, Any]) -> AsyncIterator[str]:
        """POST `payload` and yield the `data:` payload of each server-sent event, as text.

        Multi-line `data:` fields of one event are joined with "\\n"; comments and other fields
        (`event:`, `id:`) are skipped; iteration stops at `data: [DONE]` or the end of the body.
        The request is resent as a POST of `post_json` is, before the first event only; a failure
        after events were yielded raises `ModelServerError` (the caller has consumed part of the
        reply). The whole stream ends by the request's deadline.
        """
        url = self.url(path)
        tries = _Tries(self, "POST", url)
        while True:
            await tries.next()
            yielded = 0
            resp: httpx.Response | None = None
            try:
                client = self._get_client()
                async with asyncio.timeout(tries.remaining()):
                    resp = await client.send(client.build_request("POST", url, json=dict(payload)), stream=True)
                    if resp.status_code >= 300:
                        await resp.aread()
                        raise self._status_failure(resp, idempotent=False)
                lines = resp.aiter_lines()
                data: list[str] = []
                while True:
                    async with asyncio.timeout(tries.remaining()):
                        line = await anext(lines, None)
                    if line is None:
                        break
                    if line == "":
                        if data:
                            event, data = "\n".join(data), []
                            if event == "[DONE]":
                                return
                            yielded += 1
                            yield event
                        continue
                    if line.startswith(":"):
                        continue
                    field_name, _, value = line.partition(":")
                    if field_name == "data":
                        data.append(value[1:] if value.startswith(" ") else value)
                if data:
                    event = "\n".join(data)
                    if event != "[DONE]":
                        yield event
                return
            except _Failed as exc:
                tries.last = exc
            except (httpx.TransportError, TimeoutError) as exc:
                failure = (tries.past_deadline() if isinstance(exc, TimeoutError)
                           else self._transport_failure(exc, idempotent=False))
                if yielded:
                    raise ModelServerError(
                        f"POST {url}: stream broke after {yielded} events: {failure.reason} (attempt"
                        f" {tries.attempts}, {_MAY_HAVE_ARRIVED})", url=url, attempts=tries.attempts,
                    ) from exc
                if isinstance(exc, TimeoutError):
                    raise tries.error(failure) from None
                tries.last = failure
            finally:
                if resp is not None:
                    await resp.aclose()

    async def wait_healthy(self, path: str = "/health", timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        """Poll GET `path` until it answers 2xx; raise `ModelServerError` after `timeout_s`.

        For a server that is still starting (loading weights): connection errors, timeouts and
        error statuses all mean "not yet". Each poll is one attempt, not retried.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        url = self.url(path)
        deadline = time.monotonic() + timeout_s
        last = "no reply"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                resp = await self._get_client().get(url, timeout=min(self.timeout_s, remaining))
                if 200 <= resp.status_code < 300:
                    return
                last = f"HTTP {resp.status_code}: {_error_message(resp)}"
            except httpx.HTTPError as exc:
                last = self._describe(exc)
            await asyncio.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
        raise ModelServerError(f"server at {url} not healthy after {timeout_s:g} s (last: {last})", url=url)

    async def aclose(self) -> None:
        """Close the pooled connections; the client reopens lazily if used again.

        A client opened in another (finished) event loop cannot be closed from this one: its
        connections died with that loop, so it is simply dropped.
        """
        client, loop, self._client, self._loop = self._client, self._loop, None, None
        if client is not None and not client.is_closed and loop is asyncio.get_running_loop():
            await client.aclose()

    def backoff(self, attempts: int, retry_after_s: float | None = None) -> float:
        """The sleep before resending a request that has failed `attempts` times."""
        delay = self.backoff_s * 2 ** (attempts - 1) * (1.0 + random.uniform(0.0, 0.1))
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return min(delay, self.max_backoff_s)

    # -- internals -------------------------------------------------------------------------------

    def _get_client(self) -> httpx.AsyncClient:
        """The pooled client for the running loop (a new one if the loop changed or it was closed)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client.is_closed or self._loop is not loop:
            # A client from an earlier (now finished) loop cannot be closed from this one; drop it.
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(
                    max_connections=self.max_connections, max_keepalive_connections=self.max_connections
                ),
                headers=self.headers,
            )
            self._loop = loop
        return self._client

    async def _request_json(
        self, method: str, path: str, payload: Mapping[str, Any] | None, idempotent: bool
    ) -> dict[str, Any]:
        url = self.url(path)
        body = None if payload is None else dict(payload)
        tries = _Tries(self, method, url)
        while True:
            await tries.next()
            try:
                async with asyncio.timeout(tries.remaining()):
                    resp = await self._get_client().request(method, url, json=body)
                return self._json_object(resp, idempotent)
            except _Failed as exc:
                tries.last = exc
            except httpx.TransportError as exc:
                tries.last = self._transport_failure(exc, idempotent)
            except TimeoutError:
                raise tries.error(tries.past_deadline()) from None

    def _json_object(self, resp: httpx.Response, idempotent: bool) -> dict[str, Any]:
        """The reply's JSON object, or `_Failed` for an error status or an unusable body."""
        if resp.status_code >= 300:
            raise self._status_failure(resp, idempotent)
        try:
            data = resp.json()
        except ValueError:  # json.JSONDecodeError and UnicodeDecodeError
            raise _Failed(f"reply was not JSON: {resp.text[:_ERROR_SNIPPET]!r}", status=resp.status_code,
                          resend=idempotent, note=_PROCESSED) from None
        if not isinstance(data, dict):
            raise _Failed(f"reply was not JSON object: {json.dumps(data)[:_ERROR_SNIPPET]}", status=resp.status_code,
                          resend=idempotent, note=_PROCESSED)
        return data

    @staticmethod
    def _status_failure(resp: httpx.Response, idempotent: bool) -> _Failed:
        """A non-2xx reply: resent when the server refused it (429, 503 with Retry-After), or for
        an idempotent request after any 5xx; never after another 4xx."""
        status = resp.status_code
        reason = f"HTTP {status}: {_error_message(resp)}"
        retry_after = _retry_after(resp) if status in (429, 503) else None
        if status == 429 or (status == 503 and retry_after is not None):
            return _Failed(reason, status=status, retry_after_s=retry_after, resend=True)
        if status >= 500:
            return _Failed(reason, status=status, resend=idempotent, note=_PROCESSED)
        return _Failed(reason, status=status)

    def _transport_failure(self, exc: httpx.TransportError, idempotent: bool) -> _Failed:
        """No reply: resent when the request cannot have left, else only when idempotent."""
        if isinstance(exc, _NOT_SENT):
            return _Failed(self._describe(exc), resend=True)
        return _Failed(self._describe(exc), resend=idempotent, note=_MAY_HAVE_ARRIVED)

    def _describe(self, exc: httpx.HTTPError) -> str:
        if isinstance(exc, httpx.TimeoutException):
            kind = {
                httpx.ConnectTimeout: "connect timeout",
                httpx.ReadTimeout: "read timeout",
                httpx.WriteTimeout: "write timeout",
                httpx.PoolTimeout: f"pool timeout (all {self.max_connections} connections busy)",
            }.get(type(exc), "timeout")
            return f"{kind} after {self.timeout_s:g} s"
        detail = str(exc) or type(exc).__name__
        return f"connection error ({type(exc).__name__}: {detail})"


def bearer_headers(api_key: str | None, env_var: str) -> dict[str, str]:
    """The Authorization header for `api_key`, else for the key in environment variable `env_var`."""
    if api_key is None:
        api_key = os.environ.get(env_var)
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_message(resp: httpx.Response) -> str:
    """The server's own error message: OpenAI `{"error": {"message"}}`, vLLM/SGLang `{"message"}`,
    FastAPI `{"detail"}`, or the start of the body."""
    try:
        data = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for key in ("message", "detail"):
            if data.get(key):
                value = data[key]
                return value if isinstance(value, str) else json.dumps(value)[:_ERROR_SNIPPET]
    text = resp.text.strip()
    return text[:_ERROR_SNIPPET] if text else resp.reason_phrase or "(empty body)"


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # the HTTP-date form is rare from model servers; fall back to backoff
    return max(0.0, seconds)


__all__ = ["DEFAULT_CALL_TIMEOUT_S", "HttpClient", "MAX_BACKOFF_S", "ModelServerError"]
