"""A forward's measured cost by rows (goodput.measure_rows), kept across processes.

Why: measuring takes about 1.3 s on the 1.5B (0.8 s when it timed 7 sizes), paid by every process the first time sequences that may draft share a
forward; on the README's three-problem job that was more than speculation gained (9.0 s a run with it, 8.8
without). The curve's shape depends on the model's sizes, the kernels, the CPU and the threads, not on the
words; so a curve is stored under a key naming all of them (`engine_key`) and read back by the next process.
Only the shape is taken from it: each step's measured time still sets the curve's level (goodput.RowCost).

The store is one small JSON file beside the weight cache (`$THINKAHEAD_WEIGHT_CACHE=0` turns both off),
written whole to a temporary file and renamed, so a reader never sees half of it; reading never changes it.
A damaged file or entry is ignored (the curve is measured again, and the next save replaces it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from pathlib import Path
from typing import Any
from collections.abc import Callable

logger = logging.getLogger(__name__)

STORE_NAME = "forward-cost.json"
STORE_FORMAT = 1
MAX_CURVES = 32  # the most keys the file keeps (the newest)
MAX_STORE_BYTES = 1 << 20  # a store larger than this is not ours: ignored, not read


def store_path(cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Where curves are kept, or None where the weight cache is off."""
    from thinkahead.models.engine.weights.cache import cache_enabled, cache_root

    return cache_root(cache_dir) / STORE_NAME if cache_enabled() else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _native_digest() -> str:
    """The compiled kernels' bytes: new kernels, a new shape."""
    from thinkahead.models.engine.kernels import kquant, layer_ops

    digest = hashlib.sha256()
    for extension in (kquant.EXTENSION, layer_ops.EXTENSION):
        try:
            digest.update(Path(extension.load().__file__).read_bytes())
        except Exception:  # noqa: BLE001 - a kernel that is not built: its absence is part of the key
            digest.update(b"-")
    return digest.hexdigest()[:16]


def engine_key(model: str, dtype: str, threads: int) -> str:
    """The key of a curve: the model (name or file), dtype, threads, the CPU, the kernels' ISA and build, and
    the sizes measured."""
    from thinkahead.models.engine.goodput import CALIBRATION_ROWS
    from thinkahead.models.engine.kernels import kquant

    isa = kquant.kernel().isa() if kquant.unavailable_reason() is None else "-"
    sizes = "rows " + ",".join(map(str, CALIBRATION_ROWS))
    return "|".join((model, dtype, f"{threads} threads", _cpu_name(), isa, _native_digest(), sizes))


def measured_curve(engine: Any, measure: Callable[[Any], dict[int, float]]) -> dict[int, float]:
    """`engine`'s curve (rows - 1 -> seconds): the one stored under its `calibration_key`, else `measure(engine)`
    (then stored). An engine without a key (built from a model object, not a named model) is measured."""
    key = getattr(engine, "calibration_key", None)
    path = store_path() if key else None
    curve = load(key, path) if key else None
    if curve is None:
        curve = measure(engine)
        if key and plausible(curve):
            save(key, curve, path)
        elif key:
            logger.warning("not keeping a forward-cost curve measured under other load (more rows cost less): %s",
                           {k: round(s * 1000) for k, s in sorted(curve.items())})
    return curve


def plausible(curve: dict[int, float]) -> bool:
    """Whether a measured curve looks like one forward's cost and not the machine's other load: more rows never
    cost much less (a fifth) than fewer. A curve measured while something else ran (seen: 1.1 s for 2 rows, 0.27
    s for 16) would otherwise be kept for every later process; it still serves the process that measured it."""
    times = [s for _, s in sorted(curve.items())]
    return all(b >= 0.8 * a for a, b in zip(times, times[1:]))


def _read(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_STORE_BYTES:
            raise ValueError(f"larger than {MAX_STORE_BYTES} bytes")
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the forward-cost store %s: %s", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("format") != STORE_FORMAT or not isinstance(data.get("curves"), dict):
        logger.warning("ignoring the forward-cost store %s: not a format-%d store", path, STORE_FORMAT)
        return {}
    return data["curves"]


def _curve(entry: Any) -> dict[int, float] | None:
    """A stored entry as rows - 1 -> seconds, or None where it is not a sound curve."""
    rows = entry.get("rows") if isinstance(entry, dict) else None
    if not isinstance(rows, dict) or not rows:
        return None
    curve: dict[int, float] = {}
    for k, s in rows.items():
        if not (isinstance(k, str) and k.isdigit() and isinstance(s, (int, float)) and not isinstance(s, bool)):
            return None
        if not (math.isfinite(s) and s > 0):
            return None
        curve[int(k)] = float(s)
    return curve


def load(key: str, path: Path | None) -> dict[int, float] | None:
    """The curve stored under `key` (rows - 1 -> seconds), or None."""
    if path is None:
        return None
    curves = _read(path)
    curve = _curve(curves.get(key))
    if curve is None and key in curves:
        logger.warning("ignoring a damaged forward-cost entry in %s", path)
    return curve


def save(key: str, curve: dict[int, float], path: Path | None) -> None:
    """Store `curve` under `key` (the other keys kept, the oldest dropped past MAX_CURVES); a failure to
    write is logged, never raised: the curve is only a saving of time."""
    if path is None:
        return
    from thinkahead.models.engine.weights.cache import write_json_atomic

    curves = {k: v for k, v in _read(path).items() if k != key and _curve(v) is not None}
    curves[key] = {"rows": {str(k): s for k, s in sorted(curve.items())}}
    curves = dict(list(curves.items())[-MAX_CURVES:])
    try:
        write_json_atomic(path, {"format": STORE_FORMAT, "curves": curves})
    except OSError as exc:
        logger.warning("could not keep the forward-cost curve in %s: %s", path, exc)
