"""A file's bytes in the process's own memory, backed by transparent huge pages (2 MiB) where the
kernel offers them: weights read at every step.

Why: a decode step streams every weight once (about 1 GB on the 1.5B model). From a memory map of
the file (4 KiB pages of the page cache) the GGUF kernels read 15 GB/s; the same bytes in an anonymous
region advised into huge pages read about 14% faster (1.5B, all linears of one decode step, 2 threads,
same process: 64 -> 55 ms), the cost being one read of the file at start (about 0.3 s per GB from
the page cache) and memory that is the process's own (two processes on one model hold two copies,
where a memory map shares the page cache).

Huge pages are asked for where the kernel offers them (`/sys/kernel/mm/transparent_hugepage/enabled`
is `always` or `madvise`) unless `THINKAHEAD_GGUF_HUGEPAGES=0` (or false/no/off): then the copy keeps
4 KiB pages. The copy is writable: the GGUF loader rewrites the linears' blocks in it once, into the
kernel's layout (kquant.kernel_layout), before any layer reads them.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

ENV = "THINKAHEAD_GGUF_HUGEPAGES"  # "0" (or false/no/off): GGUF weights in 4 KiB pages
_OFF = ("0", "false", "no", "off")
HUGE_PAGE = 2 << 20
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether weights should be read into huge pages here (see the module docstring)."""
    if os.environ.get(ENV, "1").strip().lower() in _OFF or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_ENABLED.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def read(path: Path, huge: bool = True) -> np.ndarray:
    """The whole file as a uint8 array in a private anonymous region, starting on a huge-page boundary
    and advised into huge pages if `huge`. Raises ValueError if the file shrinks while it is read."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        # private and anonymous (a shared one would be shmem, which THP's `enabled` does not govern);
        # room to start on a huge-page boundary
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            region.madvise(mmap.MADV_HUGEPAGE)
        whole = np.frombuffer(region, dtype=np.uint8)
        start = -whole.ctypes.data % HUGE_PAGE
        data = whole[start:start + size]
        view, done = memoryview(data), 0
        while done < size:
            n = fh.readinto(view[done:])
            if not n:
                raise ValueError(f"{path}: the file ended after {done} of {size} bytes while it was read")
            done += n
    logger.debug("read %s (%.0f MB) into %s pages", path.name, size / 1e6, "huge" if huge else "4 KiB")
    return data
