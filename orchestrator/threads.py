"""`call_in_thread`: a synchronous callable awaited from the event loop, in a daemon thread of its own."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any

from thinkahead.models.errors import ThinkaheadError

log = logging.getLogger(__name__)


class ToolTimeoutError(ThinkaheadError, RuntimeError):
    """A synchronous callable run by `call_in_thread` did not finish within its time limit."""


async def call_in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, name: str = "tool") -> Any:
    """`fn(*args)` in its own daemon thread, awaited without blocking the event loop.

    A thread cannot be killed: past `timeout_s` (None: no limit) the caller gets `ToolTimeoutError`
    and the thread is left to finish in the background, its result dropped. A daemon thread of its
    own, not the loop's default executor: a hung call neither starves a shared pool nor holds up
    `asyncio.run`'s shutdown or the interpreter's exit. It frees the loop only while `fn` runs
    Python code or waits; one long C operation (a huge big-int power) holds the GIL, so tools
    bound their own work (see `thinkahead.workflows.tools`).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # the caller timed out or was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        value, error = None, None
        try:
            value = context.run(fn, *args)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        except BaseException as exc:  # noqa: BLE001 - SystemExit & co. must not kill the thread silently
            error = RuntimeError(f"{name} raised {type(exc).__name__}: {exc}")
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed while the call ran
            log.debug("%s finished after its event loop closed; result dropped", name)

    threading.Thread(target=target, name=f"thinkahead-{name}", daemon=True).start()
    try:
        return await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        log.warning("%s did not finish within %g s; its thread keeps running in the background (threads cannot "
                    "be killed) and its result will be dropped", name, timeout_s)
        raise ToolTimeoutError(f"{name} did not finish within {timeout_s:g} s") from None
