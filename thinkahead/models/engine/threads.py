"""`on_own_thread`: torch work done at load on a thread that ends with it, so the caller's thread keeps no OpenMP team.

Why: torch's parallel ops and the native kernels (kernels/native/parallel.hpp) run on libgomp teams, one per thread
that starts a parallel region; a team's workers stay parked while their thread lives. libgomp counts every such
worker, and once they outnumber the cores it stops letting idle workers spin before they sleep. The kernels need that
spin: the scheduler's thread starts a parallel region for every layer's linears, microseconds apart, and its worker
then waits on a futex and is woken for each. Measured on the 1.5B, 3 plain decoding streams, 2 cores: after one
64x64 matmul or one 4.8 MB torch.zeros on the thread that built the model, 34.2 tok/s against 37.3 without; the
same op on a thread that had ended: 37.6. A draft head's loading and the forward-cost calibration are such work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(work: Callable[[], T], name: str = "load") -> T:
    """`work()` run on a new thread, waited for; its result returned, or its exception raised here."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["result"]  # type: ignore[return-value]
