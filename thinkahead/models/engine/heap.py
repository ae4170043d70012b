"""Python's cyclic garbage collector around a model load.

Why: loading a model allocates hundreds of thousands of Python objects (transformers' modules, the
tokenizer, the engine's records) that live as long as the process. With the collector on, the load
triggers full collections that walk every one of them again (measured: 9 full collections, the
last ones 0.1-0.25 s each), and every later full collection, even mid-decode, walks them once more
(0.22 s at 415k objects: a stall of every stream). Loading the 1.5B and the 0.5B took 5.6-7.3 s with
the collector on and 3.5-3.7 s with it paused (same process, 2 cores, AMD Zen 5).

`loading()` pauses automatic collection while the outermost load runs (loads on other threads
share the pause), then collects once and moves what survived to the permanent generation
(`gc.freeze`), where later collections no longer walk it. Cycles made after that are collected as
usual. The price: an object alive at the end of a load (the caller's too) that later becomes part of an
unreachable cycle is never collected; reference counting still frees everything else. A process that had
turned the collector off keeps it off.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # loads in progress, every thread together
_was_enabled = False  # the collector's state when the outermost load began


@contextmanager
def loading() -> Iterator[None]:
    """Automatic collection paused for the duration; then one collection and a freeze."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.collect()
                gc.freeze()
                if _was_enabled:
                    gc.enable()
