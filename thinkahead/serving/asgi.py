"""HTTP plumbing of the server, plain ASGI: OpenAI-shaped errors, bounded request bodies, JSON that
cannot blow up the parser, responses and event streams, cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from thinkahead.errors import ThinkaheadError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

MAX_JSON_DEPTH = 64  # objects and lists nested deeper than this are refused
MAX_INT_DIGITS = 64  # integers longer than this are refused (no request field needs more)


class RequestError(ThinkaheadError):
    """A request the server refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: Headers | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type
        self.headers = list(headers or [])

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def unsupported(param: str, why: str) -> RequestError:
    """The 400 for a parameter this server (or this model) cannot honour: named, never ignored."""
    return RequestError(400, f"{param!r} is not supported {why}", param=param, code="unsupported_parameter")


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request body, or None if the client went away before sending it all."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > limit:
            raise RequestError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
        if not message.get("more_body", False):
            return bytes(body)


class _Invalid:
    """What the JSON parser's hooks put where a number or constant is refused, so that the 400 can
    name the parameter that holds it (the hooks themselves do not know where they are)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _bounded_int(text: str) -> int | _Invalid:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return _Invalid(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float | _Invalid:
    value = float(text)
    if not math.isfinite(value):
        return _Invalid(f"the number {text[:20]} is out of range")
    return value


def _no_constant(text: str) -> _Invalid:
    return _Invalid(f"{text} is not a JSON value")


def param_path(path: tuple[str | int, ...]) -> str:
    """A location in a request body as OpenAI names parameters: `messages[0].content`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = part.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate, escaped
            out += f".{name}" if out else name
    return out


def find(value: Any, test: Callable[[Any], bool], max_depth: int | None = MAX_JSON_DEPTH,
         ) -> tuple[tuple[str | int, ...], Any] | None:
    """The path and value of a value (or an object's key) in parsed JSON for which `test` holds, or
    None; a 400 where lists and objects nest deeper than `max_depth` (None: any depth; iterative, no
    recursion limit to hit, and only containers cost a path)."""
    if not isinstance(value, (dict, list)):
        return ((), value) if test(value) else None
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if max_depth is not None and len(path) >= max_depth:
            raise RequestError(400, f"the request body nests deeper than {max_depth} levels")
        pairs: Iterable[tuple[str | int, Any]] = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in pairs:
            if isinstance(key, str) and test(key):
                return path + (key,), key
            if isinstance(child, (dict, list)):
                stack.append((path + (key,), child))
            elif test(child):
                return path + (key,), child
    return None


def parse_json(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 (bad JSON, too deep, huge numbers, not an object;
    a number or constant JSON does not allow is named by its parameter)."""
    try:
        data = json.loads(body, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
    if (hit := find(data, lambda v: isinstance(v, _Invalid))) is not None:
        param = param_path(hit[0]) or None
        where = f" in {param!r}" if param else ""
        raise RequestError(400, f"the request body is not valid JSON{where}: {hit[1].reason}", param=param)
    if not isinstance(data, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return data


async def until_disconnect(receive: Receive, work: Awaitable[None]) -> None:
    """Await `work`, cancelling it (and so its run) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # the run's own cleanup (cancelling its nodes) finishes before we return
    if not task.cancelled():
        task.result()  # re-raises a RequestError for the caller to answer


class Responder:
    """Sends one response, with the headers every response of this request carries (CORS)."""

    def __init__(self, send: Send, extra_headers: Headers | None = None) -> None:
        self.send, self.extra = send, list(extra_headers or [])
        self.started = False

    async def json(self, status: int, payload: Any, headers: Headers | None = None) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode()
        await self.start(status, [(b"content-type", b"application/json"),
                                  (b"content-length", str(len(body)).encode()), *(headers or [])])
        await self.send({"type": "http.response.body", "body": body})

    async def text(self, status: int, text: str, content_type: bytes) -> None:
        body = text.encode()
        await self.start(status, [(b"content-type", content_type), (b"content-length", str(len(body)).encode())])
        await self.send({"type": "http.response.body", "body": body})

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers + self.extra})

    async def start_events(self) -> None:
        await self.start(200, [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                               (b"x-accel-buffering", b"no")])

    async def event(self, payload: Any) -> None:
        data = b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def done(self) -> None:
        await self.send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def error(self, exc: RequestError) -> None:
        """The error as a response, or as a last event if a stream has already started."""
        if self.started:
            await self.event(exc.body())
            await self.done()
        else:
            await self.json(exc.status, exc.body(), exc.headers)
