"""The transport under the fake SGLang server: a tiny threaded asyncio HTTP/1.1 server for tests.

Keep-alive connections, chunked (streamed) replies, and death and revival on one port: `die(down_s)`
closes the listener and every open connection (clients see resets and refused connections) and,
with `down_s`, listens again on the same port after that long. Subclasses implement `respond`,
returning a `Reply`, a `Stream` or None (close without a reply); raising `DropConnection` cuts the
connection. `tests/fake_sglang.py` builds SGLang's API on it, and `tests/test_openai_model.py` /
`tests/test_model_call_limits.py` build their own small servers on it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One HTTP/1.1 request off a keep-alive connection; None when the client closed it."""
    line = await reader.readline()
    if not line:
        return None
    method, target, _version = line.decode("latin-1").split()
    headers: dict[str, str] = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        key, _, value = h.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return Request(method, target.split("?")[0], headers, body)


@dataclass(slots=True)
class Reply:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Stream:
    """A chunked reply: each item of `events` is written and flushed as it comes.

    The iterator may raise `DropConnection` to cut the connection mid-stream.
    """

    events: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"


class DropConnection(Exception):
    """Raised by a handler or a stream to close the connection without (more of) a reply."""


def json_reply(status: int, obj: Any) -> Reply:
    return Reply(status, json.dumps(obj).encode())


class FakeHttpServer:
    """An asyncio HTTP/1.1 server in its own thread; subclasses implement `respond`.

    `die(down_s)` closes the listener and every open connection (clients see resets and refused
    connections) and, with `down_s`, listens again on the same port after that long.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.connections = 0
        self.alive = False
        self.deaths = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def respond(self, request: Request) -> Reply | Stream | None:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- lifecycle (called from the test's thread) -------------------------------------------------

    def start(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._listen())
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"fake-http-{id(self)}", daemon=True)
        self._thread.start()
        if not ready.wait(10) or failure:
            raise RuntimeError(f"fake server did not start: {failure[0] if failure else 'timeout'}")

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None or loop.is_closed():
            return

        async def shutdown() -> None:
            await self._close_all()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        self._thread.join(10)

    def die(self, down_s: float | None = None) -> None:
        """Kill the server now (from any thread); with `down_s`, revive it that much later."""
        self._call(self._die(down_s))

    def revive(self) -> None:
        """Listen again on the same port."""
        self._call(self._listen())

    def _call(self, coro: Any) -> Any:
        loop = self._loop
        assert loop is not None, "server not started"
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return asyncio.ensure_future(coro)
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    # -- internals (server loop) -------------------------------------------------------------------

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self.alive = True

    async def _close_all(self) -> None:
        self.alive = False
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            transport = writer.transport
            if transport is not None:
                transport.abort()
        self._writers.clear()

    async def _die(self, down_s: float | None) -> None:
        self.deaths += 1
        await self._close_all()
        if down_s is not None:
            async def later() -> None:
                await asyncio.sleep(down_s)
                await self._listen()

            asyncio.ensure_future(later())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    return
                headers = request.headers
                try:
                    reply = await self.respond(request)
                except DropConnection:
                    reply = None
                if reply is None or not self.alive:
                    return
                if isinstance(reply, Stream):
                    head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'OK')}",
                            f"Content-Type: {reply.content_type}", "Transfer-Encoding: chunked",
                            "Connection: keep-alive"]
                    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
                    try:
                        async for chunk in reply.events:
                            if not self.alive:
                                return
                            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                            await writer.drain()
                    except DropConnection:
                        return
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                else:
                    head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'OK')}",
                            f"Content-Type: {reply.content_type}", f"Content-Length: {len(reply.body)}",
                            "Connection: keep-alive", *reply.headers]
                    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + reply.body)
                    await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
