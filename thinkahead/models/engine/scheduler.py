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

Several engines: a pair of models that drafts for each other (the large model's `hybrid` drafter runs the small
model's engine) shares one scheduler, so one thread owns both engines: `lane(engine)` submits work for another
engine, and a call may name the engine it runs on (a draft model's forward). Each step runs one forward per
engine over the calls waiting for it: the small model's own generations and every sequence's draft tokens in one,
the large model's verifies in the other.

Memory: under a KV budget (`max_tokens`) a generation starts only while the live ones' reserved tokens (prompt
and longest output each) leave room for its own; the rest wait in arrival order. Nothing live is ever preempted.

Load: a long prompt is prefilled in pieces of `prefill_chunk` tokens while others decode, so it holds them
for one piece per step (a prompt of up to two pieces is read whole); a step holds at most `max_rows` rows (decode
rounds first, then prefill chunks, the shortest prompt left first, so one that joins beside a long prompt is not
held behind it; at least one call per step). Speculation is sized by goodput (SmartSpec): after each forward the
scheduler plans every sequence's next draft length from its acceptance rate and the measured cost of a forward by
its rows (`goodput.allocate`), so it speculates where drafts hit and backs off as the batch fills; a sequence
alone is left to its decoder's.
A draft whose rows carry their worths (`ForwardCall.values`: calibrated chances, every model-free drafter's and the
draft head's) is not planned: the step keeps, over all sequences, the rows that raise the forward's expected tokens
per second (`_priced`).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from thinkahead.models.engine import calibration
from thinkahead.models.engine.goodput import RowCost, Trust, allocate, measure_rows
from thinkahead.models.engine.lane import Lane
from thinkahead.token_spec.engine import ForwardCall, Rounds, TargetEngine
from thinkahead.token_spec.controller import moving_average
from thinkahead.token_spec.names import ACCEPT_PRIOR, MAX_BATCH_ROWS, MAX_DRAFT, PREFILL_CHUNK
from thinkahead.token_spec.pricing import chain_expected, price_rows

logger = logging.getLogger(__name__)
T = TypeVar("T")

PREFILL_PATIENCE = 8  # steps a prompt is passed over by shorter ones before it is read (then it takes a piece)
# A prompt of up to this many prefill chunks is read whole in one step where it comes first, not cut: cut at 64, a
# 65-token prompt waited a whole step for its last token (4 GSM8K prompts of 65-96 tokens joining 16 decoding
# streams of the 1.5B on an AMX Xeon: the last first token after 3.49 s, read whole 2.80 s, the streams' longest
# gap the same: docs/results/long_prompt_join.md); the decoders then wait for up to this many chunks' rows
WHOLE_PROMPT_CHUNKS = 2
PRIOR_SMOOTHING = 0.1  # how far one sequence's reported acceptance moves its engine's prior for new ones


class _Share:
    """One generation's view of its batch (the decoder's `DraftShare`)."""

    __slots__ = ("_scheduler", "_item")

    def __init__(self, scheduler: BatchScheduler, item: _Live) -> None:
        self._scheduler, self._item = scheduler, item

    def limit(self, accept_rate: float) -> int:
        return self._scheduler._limit(self._item, accept_rate)

    @property
    def prior(self) -> float:
        return self._item.lane.prior

    def verified(self, expected: float, accepted: int) -> None:
        self._item.lane.trust.update(expected, accepted)

    @property
    def alone(self) -> bool:
        item = self._item
        return item.batch <= 1 and self._scheduler._on_lane(item.lane) <= 1


@dataclass(slots=True, eq=False)
class _Engine:
    """An engine of the scheduler, with what its steps measured."""

    engine: TargetEngine
    prefill_chunk: int | None  # prefills are cut into pieces only where that gives the same bits (_batch)
    max_tokens: int | None = None  # KV tokens its live sequences may reserve in all (None: no limit)
    cost: RowCost = field(default_factory=RowCost)  # rows - 1 -> s
    prior: float = ACCEPT_PRIOR  # what its sequences' drafts have shown: where a new one's estimate starts
    trust: Trust = field(default_factory=Trust)  # how far the plan's expected accepted tokens came true
    calibrating: bool = True  # its cost curve is still to be measured (at load by name, else at its first batch)


@dataclass(slots=True)
class _Live:
    """A submitted piece of work and, once it runs as a coroutine, the forward it waits for."""

    start: Callable[[], Any]
    future: Future
    lane: _Engine
    rounds: Rounds[Any] | None = None
    call: ForwardCall | None = None
    joined: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set from any thread: the work leaves the batch before its next step
    accept: float = 0.0  # its drafts' acceptance rate, as its decoder last said (none asked yet: no drafts)
    batch: int = 1  # sequences in its last forward
    tokens: int = 0  # the KV tokens it may grow to (its prompt and longest output), reserved while it is live
    passed: int = 0  # steps its prompt waited while shorter ones were read first


class BatchScheduler:
    """Runs the work submitted to one engine on one thread, batching every coroutine's forwards per step.

    `submit(start)`: `start()` runs on the scheduler's thread; if it returns a `Rounds` coroutine that
    coroutine joins the batch and the future gets its return value, else the future gets what `start`
    returned (work that needs the engine or its drafters to itself: nothing else runs meanwhile).
    """

    def __init__(self, engine: TargetEngine, *, prefill_chunk: int = PREFILL_CHUNK, max_rows: int = MAX_BATCH_ROWS,
                 max_batch: int | None = None, goodput: bool = True, max_tokens: int | None = None,
                 name: str = "engine") -> None:
        if prefill_chunk < 1 or max_rows < 1 or (max_batch is not None and max_batch < 1):
            raise ValueError(f"prefill_chunk, max_rows and max_batch must be >= 1, got {prefill_chunk}, {max_rows} "
                             f"and {max_batch}")
        check_max_tokens(max_tokens)
        self.max_batch = max_batch  # sequences in one forward at most (None: all live; 1: one at a time)
        self.goodput = goodput  # plan drafts by goodput in a batch; False: each decoder's controller alone
        self.engine = engine
        self._prefill_chunk = prefill_chunk
        self._engines: dict[int, _Engine] = {}  # id of an engine -> its state
        self._main = self._engine(engine)
        self._main.max_tokens = max_tokens
        self.max_rows = max_rows
        self._plan: dict[int, int] = {}  # id of a live item -> its draft length for the next round
        self.name = name
        self._new: deque[_Live] = deque()
        self._items: dict[int, _Live] = {}  # id of an unfinished future -> its work (for cancel)
        self._live: list[_Live] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._starting: _Live | None = None
        self._closed = False
        self.steps = 0  # forwards run, over the scheduler's life
        self.peak_batch = 0  # most sequences in one forward

    @property
    def cost(self) -> RowCost:
        """The measured cost of a forward of the main engine by its rows (rows - 1 -> seconds)."""
        return self._main.cost

    @property
    def prefill_chunk(self) -> int | None:
        return self._main.prefill_chunk

    def _engine(self, engine: TargetEngine) -> _Engine:
        lane = self._engines.get(id(engine))
        if lane is None:
            chunk = self._prefill_chunk if getattr(engine, "batches_rows", False) else None
            lane = self._engines[id(engine)] = _Engine(engine, chunk)
        return lane

    def lane(self, engine: TargetEngine, max_tokens: int | None = None) -> Lane:
        """This scheduler as another engine's: what is submitted through the lane runs on `engine`, on this
        scheduler's thread (with everything else it runs), in one forward per step with that engine's work;
        `max_tokens`: that engine's KV budget for live sequences (as `BatchScheduler(max_tokens=)`)."""
        check_max_tokens(max_tokens)
        with self._cv:
            lane = self._engine(engine)
            lane.max_tokens = max_tokens
            return Lane(self, lane)

    # ------------------------------------------------------------------ from any thread
    def submit(self, start: Callable[[], Rounds[T] | T], *, tokens: int = 0,
               _lane: _Engine | None = None) -> Future[T]:
        """Run `start()` on the scheduler's thread (see the class docstring); its outcome lands in the future.
        Cancelling the future stops the work at its next step (its coroutine is closed: its `finally` runs).
        `tokens`: the KV tokens the work may grow to (prompt and longest output); under a `max_tokens` budget it
        starts once the live sequences leave room for it (in arrival order; alone, it always starts)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        future: Future[T] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"the scheduler of {self.name} is closed")
            item = _Live(start, future, _lane or self._main, tokens=tokens)
            self._new.append(item)
            self._items[id(future)] = item
            future.add_done_callback(self._forget)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"scheduler-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify()
        return future

    def cancel(self, future: Future) -> None:
        """Stop the work behind `future` before its next step (a coroutine is closed, its `finally` runs); its
        future gets a CancelledError. Work already done is left as it is."""
        with self._cv:
            item = self._items.get(id(future))
            if item is not None and item.future is future:
                item.cancelled = True
            self._cv.notify()

    def _forget(self, future: Future) -> None:
        with self._cv:
            self._items.pop(id(future), None)

    def run(self, start: Callable[[], Rounds[T] | T], *, tokens: int = 0, _lane: _Engine | None = None) -> T:
        """`submit(start)` and wait for its result (from any thread but the scheduler's own)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("run() on the scheduler's own thread would wait for itself")
        return self.submit(start, tokens=tokens, _lane=_lane).result()

    def share(self) -> _Share:
        """The `DraftShare` of the work being started: call it inside `start` (on the scheduler's thread)."""
        if self._starting is None:
            raise RuntimeError("share() is for the start function of submitted work")
        return _Share(self, self._starting)

    def _limit(self, item: _Live, accept_rate: float) -> int:
        """The most draft tokens `item` may verify next: its decoder decides alone; in a batch, the goodput plan
        made from every sequence's acceptance rate after the last forward."""
        item.accept = accept_rate
        item.lane.prior = moving_average(item.lane.prior, accept_rate, PRIOR_SMOOTHING)
        if not self.goodput or self._on_lane(item.lane) <= 1:
            return MAX_DRAFT
        return self._plan.get(id(item), 0)

    def _on_lane(self, lane: _Engine) -> int:
        """Live sequences of `lane`'s engine (their own generations, wherever their next call runs)."""
        return sum(i.lane is lane for i in self._live)

    @property
    def live(self) -> int:
        """Sequences in the batch (of every engine)."""
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
                new = self._admit()
            for item in new:
                self._start(item)
            self._drop_cancelled()
            if self._live:
                try:
                    self.step()
                except Exception as exc:  # noqa: BLE001 - a fault of the scheduler itself: fail the batch, go on
                    logger.exception("a step of %s failed; its generations fail with it", self.name)
                    for item in list(self._live):
                        self._finish(item, error=exc)
        for item in pending + self._live:
            self._finish(item, error=CancelledError())
        self._live = []

    def _admit(self) -> list[_Live]:
        """The queued work that starts now (under the lock): per engine in arrival order, while its live sequences'
        reserved KV tokens leave room (`max_tokens`); the first that does not fit holds the ones behind it."""
        used: dict[int, int] = {}
        for item in self._live:
            used[id(item.lane)] = used.get(id(item.lane), 0) + item.tokens
        admitted, waiting, held = [], deque(), set()
        for item in self._new:
            lane, taken = item.lane, used.get(id(item.lane), 0)
            fits = lane.max_tokens is None or taken == 0 or taken + item.tokens <= lane.max_tokens
            if item.cancelled or (fits and id(lane) not in held):
                admitted.append(item)
                used[id(lane)] = taken + item.tokens
            else:
                held.add(id(lane))
                waiting.append(item)
        self._new = waiting
        return admitted

    def _start(self, item: _Live) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        if item.cancelled:
            item.future.set_exception(CancelledError())
            return
        self._starting = item  # share() answers for it while it starts and runs to its first forward
        try:
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
        finally:
            self._starting = None

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
        self._plan.pop(id(item), None)
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

    def _batch(self, lane: _Engine) -> list[tuple[_Live, ForwardCall, bool]]:
        """This step's calls, each with whether it ends its item's call: every decode round (within `max_rows`),
        then prefills, the shortest left first (a short prompt joining beside a long one is not held behind it;
        one passed over `PREFILL_PATIENCE` steps goes first). Where the engine batches rows exactly a prefill is
        cut into pieces (a piece's K/V are the bits the whole prompt's are): while sequences decode, the step's
        prefill pieces hold `prefill_chunk` rows (a prompt of up to `WHOLE_PROMPT_CHUNKS` chunks that comes first
        is read whole), so a long prompt delays them one chunk per step; with none decoding, up to `max_rows`. At
        least one call per step (of `lane`'s engine)."""
        live = sorted((i for i in self._live if self._on(i) is lane), key=lambda i: i.joined)[:self.max_batch]
        if lane.prefill_chunk is None:  # the engine runs the calls one by one: rows cost what they cost
            return [(item, item.call, True) for item in live]
        decode = [i for i in live if not i.call.last_only]
        calls = self._priced(lane, decode) if self.goodput else [i.call for i in decode]
        prefill = sorted((i for i in live if i.call.last_only),
                         key=lambda i: (i.passed < PREFILL_PATIENCE, len(i.call.token_ids), i.joined))
        chosen: list[tuple[_Live, ForwardCall, bool]] = []
        rows = 0
        for item, call in zip(decode, calls):
            n = len(call.token_ids)
            if not chosen or rows + n <= self.max_rows:
                chosen.append((item, call, True))
                rows += n
        room = self.max_rows if not chosen else min(lane.prefill_chunk, self.max_rows - rows)
        whole = min(WHOLE_PROMPT_CHUNKS * lane.prefill_chunk, self.max_rows - rows)  # a short prompt, never cut
        for item in prefill:
            call, n = item.call, len(item.call.token_ids)
            if room <= 0:
                item.passed += 1
                continue
            item.passed = 0
            if n <= room or (n <= whole and room == lane.prefill_chunk):  # the step's first piece
                chosen.append((item, call, True))
                room -= n
            else:
                chosen.append((item, replace(call, token_ids=call.token_ids[:room]), False))
                room = 0
        return chosen

    def step(self) -> None:
        """One forward per engine over its chosen calls; each coroutine gets its logits and runs to its next
        forward."""
        while True:  # the draft models' forwards first, until every sequence's draft is written
            drafting = [i for i in self._live if self._on(i) is not i.lane]
            if not drafting:
                break
            self._step(self._on(min(drafting, key=lambda i: i.joined)))
        lanes = list(dict.fromkeys(self._on(item) for item in sorted(self._live, key=lambda i: i.joined)))
        for lane in lanes:
            self._step(lane)

    def calibrate(self) -> None:
        """Measure (or read) the main engine's forward cost now, before any work (`LocalModel` does at load): at
        the first batch it was timed among the run's other starting work (1.5B: 8 rows 51-57 ms against 48)."""
        if self._thread is not None:  # its thread would time its forwards among the work's
            raise RuntimeError(f"calibrate {self.name}'s scheduler before any work is submitted to it")
        self._calibrate(self._main)

    def _on(self, item: _Live) -> _Engine:
        """The engine `item`'s waiting call runs on: its own, or the one the call names (a draft model's)."""
        engine = item.call.engine
        return item.lane if engine is None or engine is item.lane.engine else self._engine(engine)

    def _calibrate(self, lane: _Engine) -> None:
        """Measure `lane`'s forward cost by rows, once (goodput.py), where its engine batches rows."""
        if not lane.calibrating:
            return
        lane.calibrating = False
        if lane.prefill_chunk is None:  # calls run one by one: the rows' cost is the calls', a line
            return
        try:
            lane.cost.calibrate(calibration.measured_curve(lane.engine, measure_rows))  # kept across processes
        except Exception:  # noqa: BLE001 - the plan then learns the curve from its steps, as before
            logger.warning("measuring the forward cost of %s failed; the goodput plan learns it online", self.name,
                           exc_info=True)
            return
        logger.info("%s: a forward's cost by rows (ms): %s", self.name, lane.cost.describe())

    def _priced(self, lane: _Engine, decode: list[_Live]) -> list[ForwardCall]:
        """The decode calls, each with the draft rows that pay for their place in this step where it gives their
        worths (`ForwardCall.values`; pricing.price_rows), the others whole (expected to add their sequence's
        acceptance rate, compounded)."""
        worths: list[list[float]] = []
        rows, expected = 0, 0.0
        for item in decode:
            call = item.call
            if call.values is None:
                drafted = len(call.token_ids) - 1
                rows, expected = rows + drafted + 1, expected + 1 + chain_expected(item.accept, drafted)
            else:
                rows, expected = rows + 1, expected + 1
            worths.append([] if call.values is None else call.values[:len(call.token_ids) - 1])
        if not any(worths):
            return [item.call for item in decode]
        kept = price_rows(worths, lane.cost, rows, expected, self.max_rows)
        return [item.call if item.call.values is None else replace(
            item.call, token_ids=item.call.token_ids[:1 + k], values=None,
            parents=None if item.call.parents is None else item.call.parents[:1 + k]) for item, k in zip(decode, kept)]

    def _step(self, lane: _Engine) -> None:
        batch = self._batch(lane)
        if not batch:
            return
        calls = [call for _, call, _ in batch]
        engine = lane.engine
        self.steps += 1
        self.peak_batch = max(self.peak_batch, len(batch))
        t0 = time.perf_counter()
        try:
            results = engine.forward_batch(calls)
            lane.cost.update(sum(len(c.token_ids) for c in calls) - 1, time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 - find whose call it was: the batch checks before it changes a cache
            logger.debug("a batch of %d calls failed; running them one by one", len(calls), exc_info=True)
            results = []
            for call in calls:
                try:
                    results.append(engine.forward_batch([call])[0])
                except Exception as exc:  # noqa: BLE001 - thrown into its own generation
                    results.append(exc)
        live = [i for i in self._live if i.lane is lane]
        if len(live) > 1 and self.goodput and any(i.accept > 0 for i in live):  # some sequence may draft
            self._calibrate(lane)
            lane.trust.step()
            self._plan.update(zip(map(id, live), allocate([i.accept for i in live], lane.cost,
                                                           max_rows=self.max_rows, trust=lane.trust.factor)))
        for (item, call, whole), out in zip(batch, results):
            if item.lane is lane:  # its own forward (a draft model's says nothing of its verify's cost)
                item.batch = len(batch)
            if isinstance(out, Exception):
                item.call = None
                self._advance(item, None, error=out)
            elif whole:
                item.call = None
                self._advance(item, out)
            else:  # a piece of a prefill: the rest waits for the next step
                item.call = replace(item.call, token_ids=item.call.token_ids[len(call.token_ids):])


def check_max_tokens(max_tokens: int | None) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")


__all__ = ["BatchScheduler", "Lane", "MAX_BATCH_ROWS", "PREFILL_CHUNK", "allocate"]
