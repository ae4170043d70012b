"""Running test code on several threads at once."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_at_once(*calls: Callable[[], object]) -> None:
    """Runs each call on its own thread, all started before any is joined; raises the first error any raised."""
    errors: list[BaseException] = []

    def guarded(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(call,)) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
