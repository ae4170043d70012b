"""A small async JSON-over-HTTP client shared by the server backends (OpenAI-compatible, SGLang).

Why a wrapper around `httpx.AsyncClient`: every backend that talks to a model server needs the
same few things, and getting them subtly wrong costs whole benchmark runs:

* one pooled connection set per client (many steps and judge calls are in flight at once), sized
  by `max_connections`, created lazily inside the running event loop (an `httpx.AsyncClient` is
  bound to the loop it first ran in, and callers often build models outside any loop);
* retries with exponential backoff and a little jitter on the failures that are worth retrying:
  connection errors (refused, reset, dropped without a reply), timeouts, HTTP 429 and 5xx, and a
  200 reply whose body is not JSON (a proxy or a crashing worker). Other 4xx replies are the
  caller's mistake and are raised at once;
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

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0  # cap on one backoff sleep (also on a server's Retry-After)
_ERROR_SNIPPET = 300  # characters of an unparseable body quoted in an error message


class ModelServerError(RuntimeError):
    """A model server could not be reached, failed, or answered something unusable.

    `status` is the HTTP status of the last reply (None when there was no reply: connection error
    or timeout); `url` is the URL that was requested.
    """

    def __init__(self, message: str, status: int | None = None, url: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.url = url


class _Retryable(Exception):
    """Internal: one attempt failed in a way worth retrying."""

    def __init__(self, reason: str, status: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after_s = retry_after_s


class HttpClient:
    """Async JSON client for one server: pooled connections, retries, uniform errors.

    Args:
        base_url: the server's root, e.g. "http://localhost:8000/v1".
        timeout_s: limit for each of connecting, writing, reading (between bytes) and waiting for
            a pooled connection, per attempt.
        max_retries: retries after the first attempt (0: try once).
        backoff_s: the first retry's sleep; each later retry doubles it (plus up to 10% jitter),
            capped at `MAX_BACKOFF_S`. A 429/503 reply's `Retry-After` (seconds) is honoured when
            longer.
        max_connections: size of the connection pool (concurrent requests beyond it queue).
        headers: sent with every request (e.g. `Authorization`).

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
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.max_connections = max_connections
        self.headers: dict[str, str] = dict(headers or {})
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"HttpClient({self.base_url!r}, timeout_s={self.timeout_s:g}, max_retries={self.max_retries})"

    # -- public API ------------------------------------------------------------------------------

    def url(self, path: str) -> str:
        """The full URL for `path` (absolute URLs are returned unchanged)."""
        if path.startswith(("http://", "https://")):
            return path
        return f"{self.base_url}/{path.lstrip('/')}"

    async def post_json(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """POST `payload` as JSON and return the reply's JSON object (retrying as documented)."""
        return await self._request_json("POST", path, payload)

    async def get_json(self, path: str) -> dict[str, Any]:
        """GET `path` and return the reply's JSON object (retrying as documented)."""
        return await self._request_json("GET", path, None)

    async def stream_lines(self, path: str, payload: Mapping[str, Any]) -> AsyncIterator[str]:
        """POST `payload` and yield the `data:` payload of each server-sent event, as text.

        Multi-line `data:` fields of one event are joined with "\\n"; comments and other fields
        (`event:`, `id:`) are skipped; iteration stops at `data: [DONE]` or the end of the body.
        Failures before the first event are retried like `post_json`; a failure after events were
        yielded raises `ModelServerError` (the caller has consumed part of the reply).
        """
        url = self.url(path)
        last: _Retryable | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await self._sleep_before_retry(attempt, last, "POST", url)
            yielded = 0
            try:
                async with self._get_client().stream("POST", url, json=dict(payload)) as resp:
                    if resp.status_code >= 300:
                        await resp.aread()
                        self._raise_or_retry(resp, "POST", url)
                    data: list[str] = []
                    async for line in resp.aiter_lines():
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
            except _Retryable as exc:
                last = exc
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                if yielded:
                    raise ModelServerError(
                        f"POST {url}: stream broke after {yielded} events: {self._describe(exc)}", url=url
                    ) from exc
                last = _Retryable(self._describe(exc))
        raise self._exhausted("POST", url, last)

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

    async def _request_json(self, method: str, path: str, payload: Mapping[str, Any] | None) -> dict[str, Any]:
        url = self.url(path)
        body = None if payload is None else dict(payload)
        last: _Retryable | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await self._sleep_before_retry(attempt, last, method, url)
            try:
                resp = await self._get_client().request(method, url, json=body)
                if resp.status_code >= 300:
                    self._raise_or_retry(resp, method, url)
                try:
                    data = resp.json()
                except ValueError:  # json.JSONDecodeError and UnicodeDecodeError
                    raise _Retryable(
                        f"reply was not JSON: {resp.text[:_ERROR_SNIPPET]!r}", status=resp.status_code
                    ) from None
                if not isinstance(data, dict):
                    raise _Retryable(
                        f"reply was not JSON object: {json.dumps(data)[:_ERROR_SNIPPET]}", status=resp.status_code
                    )
                return data
            except _Retryable as exc:
                last = exc
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
                last = _Retryable(self._describe(exc))
        raise self._exhausted(method, url, last)

    def _raise_or_retry(self, resp: httpx.Response, method: str, url: str) -> None:
        """For a non-2xx reply: raise `_Retryable` (429, 5xx) or `ModelServerError` (the rest)."""
        status = resp.status_code
        message = _error_message(resp)
        if status == 429 or status >= 500:
            raise _Retryable(f"HTTP {status}: {message}", status=status, retry_after_s=_retry_after(resp))
        raise ModelServerError(f"{method} {url} -> HTTP {status}: {message}", status=status, url=url)

    async def _sleep_before_retry(self, attempt: int, last: _Retryable | None, method: str, url: str) -> None:
        delay = self.backoff_s * 2 ** (attempt - 1)
        delay *= 1.0 + random.uniform(0.0, 0.1)
        if last is not None and last.retry_after_s is not None:
            delay = max(delay, last.retry_after_s)
        delay = min(delay, MAX_BACKOFF_S)
        log.warning(
            "%s %s failed (%s); retry %d/%d in %.2f s",
            method, url, last.reason if last else "?", attempt, self.max_retries, delay,
        )
        await asyncio.sleep(delay)

    def _exhausted(self, method: str, url: str, last: _Retryable | None) -> ModelServerError:
        n = self.max_retries + 1
        reason = last.reason if last is not None else "unknown failure"
        status = last.status if last is not None else None
        return ModelServerError(
            f"{method} {url} failed after {n} attempt{'s' if n > 1 else ''}: {reason}", status=status, url=url
        )

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


__all__ = ["HttpClient", "ModelServerError", "MAX_BACKOFF_S"]
