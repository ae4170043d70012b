"""A progress bar per model while it converts (its first load), on stderr: stages and elapsed time.

The slow stages (transformers' GGUF dequantisation, int8 conversion) report no progress of their
own that we can follow, so the bar counts stages and a background thread keeps the elapsed time
moving; when the result is cached, the bar ends saying that later loads will be fast.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType
from typing import Any, Self

logger = logging.getLogger(__name__)

_TICK_S = 1.0
_BAR_FORMAT = "{desc}: {bar:12} {n_fmt}/{total_fmt} [{elapsed}] {postfix}"
FIRST_LOAD_NOTE = "first load: converting once, later loads read the weight cache in seconds"
CACHED_NOTE = "cached: later loads take seconds"


class ConversionProgress:
    """`with ConversionProgress(label, stages, cached, enabled) as bar: bar.stage(name) ...`.

    `enabled`: True draws, False does not, None draws only when stderr is a terminal. Disabling
    transformers' bars (`tqdm.__init__` patched with `disable=True`) does not hide this one."""

    def __init__(self, label: str, stages: tuple[str, ...], cached: bool, enabled: bool | None = None) -> None:
        if not stages:
            raise ValueError("ConversionProgress needs at least one stage")
        self.label = label
        self.stages = stages
        self.cached = cached
        self.enabled = enabled
        self._bar: Any = None
        self._started = 0.0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Self:
        import tqdm

        self._started = time.perf_counter()
        logger.info("converting %s%s", self.label, f" ({FIRST_LOAD_NOTE})" if self.cached else "")
        disable = None if self.enabled is None else not self.enabled
        desc = f"{self.label}, first load" if self.cached else self.label
        self._bar = tqdm.tqdm(total=len(self.stages), desc=desc, file=sys.stderr,
                              bar_format=_BAR_FORMAT, disable=disable, leave=True, dynamic_ncols=True)
        if not self._bar.disable:
            self._ticker = threading.Thread(target=self._tick, name="conversion-progress", daemon=True)
            self._ticker.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(_TICK_S):
            self._bar.refresh()

    def stage(self, name: str) -> None:
        """Enter stage `name` (one of `stages`): the bar counts the stages before it as done."""
        if name not in self.stages:
            raise ValueError(f"unknown stage {name!r}; expected one of {self.stages}")
        index = self.stages.index(name)
        if index > self._bar.n:
            self._bar.update(index - self._bar.n)
        self._bar.set_postfix_str(name)
        logger.debug("%s: %s", self.label, name)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        seconds = time.perf_counter() - self._started
        if exc_type is None:
            self._bar.update(len(self.stages) - self._bar.n)
            done = f"done in {seconds:.0f}s" + (f"; {CACHED_NOTE}" if self.cached else "")
            self._bar.set_postfix_str(done)
            logger.info("converted %s in %.1fs", self.label, seconds)
        else:  # the error is the one line left (a damaged file: gguf_check's message)
            self._bar.leave = False
        self._bar.close()
