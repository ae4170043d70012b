"""`BatchScheduler`: every live generation on one engine advances together, one forward per step.

The shape of nano-vllm's engine loop on one thread: work is submitted from any thread; the scheduler's
thread owns the engine, the drafters and the prefix pool (none of them is thread-safe, and none needs
to be). A generation is a coroutine (`SpeculativeDecoder.rounds`) that yields the forward it needs;
`step()` gathers the forward of every live generation (a decode round's verify chain or tree, a prompt's
next prefill chunk), runs them as one ragged batch (`forward_batch`), and sends each its logits. Each
generation then verifies, commits, checks its own stop, length and cancel, drafts its next round and
yields again; one that ends resolves its future and leaves the batch, and new ones join at the next step.

Exactness: the engine's rows never depend on the batch (a ragged batch gives each sequence the bits it
gets alone, tests/test_ragged_batch.py), so each generation's tokens are the ones it produces alone
(tests/test_batching.py), whoever joins or leaves.

Load: a long prompt is prefilled in chunks of `prefill_chunk` tokens, so it holds decoding sequences for
one chunk per step at most; a step holds at most `max_rows` rows (decode rounds first, then prefill
chunks in arrival order, at least one call per step); each generation's draft is capped by `draft_limit`
from the number of live generations (`DraftRows`), so speculation backs off as the batch fills.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from thinkahead.token_spec.engine import ForwardCall, Rounds, TargetEngine
from thinkahead.token_spec.names import MAX_DRAFT

logger = logging.getLogger(__name__)
T = TypeVar("T")

PREFILL_CHUNK = 256  # prompt tokens per prefill forward while other sequences decode
MAX_BATCH_ROWS = 512  # rows of one step's forward at most
DRAFT_ROWS = 16  # rows a step's verify forwards aim at together: each live sequence's share, its bonus row included


@dataclass(slots=True)
class DraftRows:
    """Caps each sequence's draft so that a step's verify rows stay near `rows`: with n > 1 live sequences
    each drafts at most rows // n - 1 tokens (none from `rows` sequences on); a sequence alone is left to its
    decoder's controller. A CPU forward costs little more per row
    until its kernels turn compute-bound (docs/results/verify_curve_gguf.md: 8 rows 1.6x one row, 32 rows
    4.4x), so one stream speculates deeply and a full batch decodes plainly."""

    rows: int = DRAFT_ROWS

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"draft rows must be >= 1, got {self.rows}")

    def limit(self, live: int) -> int:
        return MAX_DRAFT if live <= 1 else max(0, self.rows // live - 1)


@dataclass(slots=True)
class _Live:
    """A submitted piece of work and, once it runs as a coroutine, the forward it waits for."""

    start: Callable[[], Any]
    future: Future
    rounds: Rounds[Any] | None = None
    call: ForwardCall | None = None
    joined: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set from any thread: the work leaves the batch before its next step


class BatchScheduler:
    """Runs the work submitted to one engine on one thread, batching every coroutine's forwards per step.

    `submit(start)`: `start()` runs on the scheduler's thread; if it returns a `Rounds` coroutine that
    coroutine joins the batch and the future gets its return value, else the future gets what `start`
    returned (work that needs the engine or its drafters to itself: nothing else runs meanwhile).
    """

    def __init__(self, engine: TargetEngine, *, prefill_chunk: int = PREFILL_CHUNK, max_rows: int = MAX_BATCH_ROWS,
                 draft_rows: DraftRows | None = None, name: str = "engine") -> None:
        if prefill_chunk < 1 or max_rows < 1:
            raise ValueError(f"prefill_chunk and max_rows must be >= 1, got {prefill_chunk} and {max_rows}")
        self.engine = engine
        self.prefill_chunk = prefill_chunk if getattr(engine, "batches_rows", False) else None  # see prefill_chunk()
        self.max_rows = max_rows
        self.draft_rows = draft_rows if draft_rows is not None else DraftRows()
        self.name = name
        self._new: deque[_Live] = deque()
        self._live: list[_Live] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0  # forwards run, over the scheduler's life
        self.peak_batch = 0  # most sequences in one forward

    # ------------------------------------------------------------------ from any thread
    def submit(self, start: Callable[[], Rounds[T] | T]) -> Future[T]:
        """Run `start()` on the scheduler's thread (see the class docstring); its outcome lands in the future.
        Cancelling the future stops the work at its next step (its coroutine is closed: its `finally` runs)."""
        future: Future[T] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"the scheduler of {self.name} is closed")
            self._new.append(_Live(start, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"scheduler-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify()
        return future

    def cancel(self, future: Future) -> None:
        """Stop the work behind `future` before its next step (a coroutine is closed, its `finally` runs); its
        future gets a CancelledError. Work already done is left as it is."""
        with self._cv:
            for item in (*self._new, *self._live):
                if item.future is future:
                    item.cancelled = True
            self._cv.notify()

    def run(self, start: Callable[[], Rounds[T] | T]) -> T:
        """`submit(start)` and wait for its result (from any thread but the scheduler's own)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("run() on the scheduler's own thread would wait for itself")
        return self.submit(start).result()

    def draft_limit(self) -> int:
        """The most draft tokens one sequence may verify this step (read by the decoders each round)."""
        return self.draft_rows.limit(len(self._live))

    @property
    def live(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Stop taking work; what is queued or running is cancelled, the thread ends."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the scheduler's thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._new and not self._live and not self._closed:
                    self._cv.wait()
                if self._closed:
                    pending, self._new = list(self._new), deque()
                    break
                new, self._new = list(self._new), deque()
            for item in new:
                self._start(item)
            self._drop_cancelled()
            if self._live:
                self.step()
        for item in pending + self._live:
            self._finish(item, error=CancelledError())
        self._live = []

    def _start(self, item: _Live) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        if item.cancelled:
            item.future.set_exception(CancelledError())
            return
        try:
            out = item.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            item.future.set_exception(exc)
            return
        if not inspect.isgenerator(out):
            item.future.set_result(out)
            return
        item.rounds = out
        self._advance(item, None)

    def _advance(self, item: _Live, logits: Any, error: BaseException | None = None) -> None:
        """Send the coroutine its logits (or throw `error` into it); keep it live while it yields a forward."""
        try:
            if error is not None:
                call = item.rounds.throw(error)
            else:
                call = next(item.rounds) if logits is None else item.rounds.send(logits)
        except StopIteration as done:
            self._finish(item, result=done.value)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            self._finish(item, error=exc)
            return
        if not isinstance(call, ForwardCall):
            self._finish(item, error=TypeError(f"a generation yielded {type(call).__name__}, not a ForwardCall"))
            return
        item.call = call
        if item not in self._live:
            self._live.append(item)

    def _finish(self, item: _Live, result: Any = None, error: BaseException | None = None) -> None:
        if item in self._live:
            self._live.remove(item)
        if item.rounds is not None and error is not None:
            item.rounds.close()  # its finally blocks run (a cancelled or failed generation releases its state)
        if item.future.done():
            return
        if error is not None:
            item.future.set_exception(error)
        else:
            item.future.set_result(result)

    def _drop_cancelled(self) -> None:
        for item in [i for i in self._live if i.cancelled or i.future.cancelled()]:
            self._finish(item, error=CancelledError())

    def _batch(self) -> list[_Live]:
        """This step's calls: every decode round, then prefill chunks in arrival order, within `max_rows`
        (at least one call)."""
        decode = [i for i in self._live if not i.call.last_only]
        prefill = sorted((i for i in self._live if i.call.last_only), key=lambda i: i.joined)
        chosen, rows = [], 0
        for item in decode + prefill:
            n = len(item.call.token_ids)
            if chosen and rows + n > self.max_rows:
                continue
            chosen.append(item)
            rows += n
        return chosen

    def step(self) -> None:
        """One forward over the chosen calls; each coroutine gets its logits and runs to its next forward."""
        batch = self._batch()
        calls = [item.call for item in batch]
        self.steps += 1
        self.peak_batch = max(self.peak_batch, len(batch))
        try:
            results = self.engine.forward_batch(calls)
        except Exception:  # noqa: BLE001 - find whose call it was: the batch checks before it changes a cache
            logger.debug("a batch of %d calls failed; running them one by one", len(calls), exc_info=True)
            results = []
            for item in batch:
                try:
                    results.append(self.engine.forward_batch([item.call]))
                except Exception as exc:  # noqa: BLE001 - thrown into its own generation
                    results.append(exc)
            results = [r if isinstance(r, Exception) else r[0] for r in results]
        for item, out in zip(batch, results):
            item.call = None
            if isinstance(out, Exception):
                self._advance(item, None, error=out)
            else:
                self._advance(item, out)


__all__ = ["BatchScheduler", "DraftRows", "DRAFT_ROWS", "MAX_BATCH_ROWS", "PREFILL_CHUNK"]
