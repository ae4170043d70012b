"""`Lane`: a `BatchScheduler` seen as another engine's (`BatchScheduler.lane`): the same thread and steps, its
work submitted for that engine."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from thinkahead.token_spec.engine import Rounds, TargetEngine

if TYPE_CHECKING:
    from thinkahead.models.engine.scheduler import BatchScheduler

T = TypeVar("T")


class Lane:
    """A `BatchScheduler` seen as another engine's (`BatchScheduler.lane`): the same thread and steps."""

    __slots__ = ("scheduler", "_lane")

    def __init__(self, scheduler: BatchScheduler, lane: Any) -> None:
        self.scheduler, self._lane = scheduler, lane

    @property
    def engine(self) -> TargetEngine:
        return self._lane.engine

    def submit(self, start: Callable[[], Rounds[T] | T], *, tokens: int = 0) -> Future[T]:
        return self.scheduler.submit(start, tokens=tokens, _lane=self._lane)

    def run(self, start: Callable[[], Rounds[T] | T], *, tokens: int = 0) -> T:
        return self.scheduler.run(start, tokens=tokens, _lane=self._lane)

    def cancel(self, future: Future) -> None:
        self.scheduler.cancel(future)

    def share(self) -> Any:
        return self.scheduler.share()

    def calibrate(self) -> None:  # BatchScheduler.calibrate for this lane's engine (the thread may run others')
        self.scheduler._calibrate(self._lane)

    @property
    def live(self) -> int:
        return self.scheduler.live

    def close(self) -> None:
        """Nothing: the scheduler belongs to the model that made it."""


__all__ = ["Lane"]
