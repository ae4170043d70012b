"""Who may call the server and how much: settings, API key, Host and Origin checks, CORS, a bounded
waiting line, and the context-length check that runs before any work."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from collections.abc import AsyncIterator

from pydantic import BaseModel, Field

from thinkahead.serving.asgi import Headers, RequestError, Scope, header

API_KEY_ENV = "THINKAHEAD_API_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
OPEN_PATHS = ("/health",)  # answered without an API key (liveness probes)


class ServerSettings(BaseModel, extra="forbid"):
    """The server's own settings (the orchestrator's are in `OrchestratorConfig`)."""

    api_key: str | None = Field(default=None, description=f"Bearer key every request must carry (env {API_KEY_ENV})")
    allow_origins: list[str] = Field(default_factory=list, description="browser origins allowed by CORS ('*': any)")
    allowed_hosts: list[str] | None = Field(default=None, description="Host header names accepted (None: any)")
    max_queue: int = Field(default=64, ge=0, description="requests that may wait for a slot; more get 429")
    retry_after_s: int = Field(default=2, ge=1, description="the Retry-After of a 429")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    default_max_tokens: int = Field(default=1024, ge=1, description="a chat or text completion without max_tokens")
    repair_attempts: int = Field(default=2, ge=0, description="retries of a reply that breaks its tool or JSON format")

    @classmethod
    def with_env(cls, **values: object) -> ServerSettings:
        """Settings with the API key read from the environment when none is given."""
        if values.get("api_key") is None and os.environ.get(API_KEY_ENV):
            values["api_key"] = os.environ[API_KEY_ENV]
        return cls.model_validate(values)


def host_name(value: str) -> str:
    """The name of a Host header without its port (`[::1]:8000` -> `::1`)."""
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def check_access(scope: Scope, settings: ServerSettings) -> None:
    """Host (DNS rebinding), Origin (CORS) and API key of a request; a 4xx naming what is wrong."""
    if settings.allowed_hosts is not None:
        host = host_name(header(scope, b"host") or "")
        if host.lower() not in {h.lower() for h in settings.allowed_hosts}:
            raise RequestError(403, f"the Host {host!r} is not served here (allowed: {', '.join(settings.allowed_hosts)})",
                               code="host_not_allowed")
    origin = header(scope, b"origin")
    if origin is not None and not origin_allowed(origin, settings):
        raise RequestError(403, f"the origin {origin!r} is not allowed (see --allow-origin)", code="origin_not_allowed")
    if settings.api_key and scope["method"] != "OPTIONS" and scope["path"].rstrip("/") not in OPEN_PATHS:
        # (a CORS preflight never carries credentials; the request it announces does)
        given = header(scope, b"authorization") or ""
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise RequestError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])


def check_json_content(scope: Scope) -> None:
    """POST bodies must be declared JSON: a plain form or text post from a web page starts nothing."""
    kind = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise RequestError(415, f"the request body must be application/json, got {kind or 'no content type'!r}",
                           code="unsupported_media_type")


def origin_allowed(origin: str, settings: ServerSettings) -> bool:
    return "*" in settings.allow_origins or origin in settings.allow_origins


def cors_headers(scope: Scope, settings: ServerSettings) -> Headers:
    """The CORS headers of a response to an allowed origin (none without an Origin header)."""
    origin = header(scope, b"origin")
    if origin is None or not origin_allowed(origin, settings):
        return []
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


def preflight_headers() -> Headers:
    """A CORS preflight's answer (beside `cors_headers`, which every response of an allowed origin has)."""
    return [
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", b"authorization, content-type"),
        (b"access-control-max-age", b"600"),
    ]


def check_context(prompt_tokens: int, max_new: int | None, context: int | None, *, param: str = "messages",
                  max_param: str = "max_tokens") -> int | None:
    """A 400 when the prompt (with the requested output) does not fit the model's context, before any
    work; else the room left for output (None: unknown)."""
    if context is None:
        return None
    if prompt_tokens >= context:
        raise RequestError(400, f"This model's maximum context length is {context} tokens. However, your prompt has "
                                f"{prompt_tokens} tokens.", param=param, code="context_length_exceeded")
    if max_new is not None and prompt_tokens + max_new > context:
        raise RequestError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                                f"{prompt_tokens + max_new} tokens ({prompt_tokens} in the prompt, {max_new} for the "
                                f"completion).", param=max_param, code="context_length_exceeded")
    return context - prompt_tokens


class Admission:
    """At most `concurrency` requests at work, at most `max_queue` waiting; the rest get 429."""

    def __init__(self, concurrency: int, max_queue: int, retry_after_s: int) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.concurrency, self.max_queue, self.retry_after_s = concurrency, max_queue, retry_after_s
        self.gate = asyncio.Semaphore(concurrency)
        self.waiting = 0
        self.running = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self.running + self.waiting >= self.concurrency + self.max_queue:
            raise RequestError(429, f"the server is busy: {self.running} requests at work and {self.waiting} waiting; "
                                    f"retry in {self.retry_after_s} s", type="rate_limit_error", code="queue_full",
                               headers=[(b"retry-after", str(self.retry_after_s).encode())])
        self.waiting += 1
        try:
            await self.gate.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self.gate.release()
