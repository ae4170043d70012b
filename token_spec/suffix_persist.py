"""The suffix cache's file: `SuffixCache.save` / `SuffixCache.load` (format and checks).

A JSON header line (format, version, config, request and session ids and their
lengths) followed by the cached responses' and the idle sessions' tokens as
little-endian int32.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable
import array
import json
import os
import sys

if TYPE_CHECKING:  # pragma: no cover
    from thinkahead.token_spec.suffix_cache import SuffixCache

FILE_MAGIC = "thinkahead-suffix-cache"
# 2 adds idle sessions after the responses; 3: a missing memory cap (null) means "no cap" rather than
# "saved before the cap had a default", which loads with today's default. Versions 1 and 2 still load.
FILE_VERSION = 3

CONFIG_KEYS = (
    "max_depth",
    "request_depth",
    "max_cached_requests",
    "max_memory_bytes",
    "max_sessions",
    "max_session_bytes",
    "session_idle_s",
)


def write_cache(cache: SuffixCache, path: str | os.PathLike) -> None:
    """See `SuffixCache.save`."""
    path = Path(path)
    rids, lengths, tokens = [], [], array.array("i")
    for rid, seq in cache._responses():
        rids.append(rid)
        lengths.append(len(seq))
        tokens.extend(seq)
    session_ids, session_lengths = [], []
    for session_id, seq in cache._idle_session_tokens():
        session_ids.append(session_id)
        session_lengths.append(len(seq))
        tokens.extend(seq)
    header: dict[str, Any] = {"format": FILE_MAGIC, "version": FILE_VERSION}
    header.update({key: getattr(cache, key) for key in CONFIG_KEYS})
    header.update(request_ids=rids, lengths=lengths, session_ids=session_ids, session_lengths=session_lengths)
    try:
        header_line = json.dumps(header).encode() + b"\n"
    except TypeError as exc:
        raise ValueError(f"cached request and session ids must be JSON values to be saved: {exc}") from None
    if array.array("i").itemsize != 4:  # pragma: no cover - every CPython platform we run on
        raise RuntimeError("int32 arrays are required to save a suffix cache")
    if sys.byteorder != "little":  # pragma: no cover
        tokens.byteswap()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(header_line)
        fh.write(tokens.tobytes())
    os.replace(tmp, path)


def read_cache(cls: type[SuffixCache], path: str | os.PathLike, overrides: dict[str, Any]) -> SuffixCache:
    """See `SuffixCache.load`."""
    path = Path(path)
    with open(path, "rb") as fh:
        header_line = fh.readline()
        payload = fh.read()
    try:
        header = json.loads(header_line)
    except ValueError:
        raise ValueError(f"{path} is not a thinkahead suffix cache file") from None
    if not isinstance(header, dict) or header.get("format") != FILE_MAGIC:
        raise ValueError(f"{path} is not a thinkahead suffix cache file")
    version = header.get("version")
    if version not in (1, 2, FILE_VERSION):
        raise ValueError(f"{path}: unsupported suffix cache version {version!r}")
    tokens = array.array("i")
    tokens.frombytes(payload)
    if sys.byteorder != "little":  # pragma: no cover
        tokens.byteswap()
    lengths = header["lengths"]
    session_ids = header.get("session_ids", [])
    session_lengths = header.get("session_lengths", [])
    if (
        sum(lengths) + sum(session_lengths) != len(tokens)
        or len(lengths) != len(header["request_ids"])
        or len(session_lengths) != len(session_ids)
    ):
        raise ValueError(f"{path} is truncated or corrupt: lengths do not match the tokens")
    config = {k: header[k] for k in CONFIG_KEYS if k in header}
    if version < 3 and config.get("max_memory_bytes") is None:
        config.pop("max_memory_bytes", None)  # written when there was no default cap: take today's
    config.update(overrides)
    cache = cls(**config)
    offset = 0
    for rid, n in zip(header["request_ids"], lengths):
        cache._insert(_hashable(rid), tokens[offset:offset + n].tolist())
        offset += n
    if cache.max_sessions != 0:
        now = cache.clock()
        for session_id, n in zip(session_ids, session_lengths):
            cache._restore_session(_hashable(session_id), tokens[offset:offset + n].tolist(), now)
            offset += n
        cache._enforce_session_limits()
    return cache


def _hashable(value: Any) -> Hashable:
    """A JSON-decoded id with lists turned back into tuples."""
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
