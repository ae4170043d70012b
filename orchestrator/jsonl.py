"""An append-only JSONL file that knows it is ours: a header line, durable appends, safe torn tails.

The first line of a log is a header, `{"thinkahead_store": KIND, "format": 1, "config": {...}}`:
it says which kind of records follow (run results, generations) and the configuration that wrote
them, so that a resume under another configuration is refused instead of mixing two experiments.

Reading never changes a file: a reader skips an unterminated last line (a write cut short by a
kill) and reports its size in `torn_bytes`. Only a writer that has recognised the file as its own
kind of log cuts that tail, and it first copies the cut bytes to `PATH.torn` and says where in
`moved_torn_to`, so nothing is ever silently deleted (the command line reports either once; the
log has them at INFO). A file that is not a log of the right kind is never written. A writer
creates the file's own folder where it is missing, not the folders above it.

Files written before logs had headers ("legacy") are read as they are; a writer with a
configuration refuses to resume one, because its configuration is unknown.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from thinkahead.models.errors import ThinkaheadError

log = logging.getLogger(__name__)

HEADER_KEY = "thinkahead_store"
FORMAT = 1
TORN_SUFFIX = ".torn"


class LogError(ThinkaheadError, ValueError):
    """A log file that cannot be read or written as asked; the message names the file and line."""


def cannot_write(path: str | os.PathLike[str] | None, exc: OSError) -> str:
    """The one-line message for an output `path` the system refused to create or write (`exc` says why)."""
    return f"cannot write {path}: {exc.strerror or exc}"


def make_parent(path: Path) -> None:
    """Create the folder `path` goes in where it is missing, that folder only (a mistyped path does not
    grow a tree of folders up to the root); a `LogError` naming the part of the path that is wrong."""
    folder = path.parent
    try:
        if folder.is_dir():
            return
        for above in (folder, *folder.parents):
            if os.path.lexists(above) and not above.is_dir():
                raise LogError(f"cannot write {path}: {above} is not a folder")
        if not folder.parent.is_dir():
            raise LogError(f"cannot write {path}: folder {folder.parent} does not exist (only the file's own "
                           f"folder, {folder.name}, is created)")
        folder.mkdir(exist_ok=True)  # (another writer may make it meanwhile)
    except OSError as exc:
        raise LogError(f"cannot write {path}: cannot create its folder {folder}: {exc.strerror or exc}") from None


def config_differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`key: old -> new` for every leaf where two nested configurations differ."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_differences(a, b, name + ".")
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def _lock(fd: int, path: Path) -> None:
    """One writer per log: a second process (or object) writing the same file is refused, not interleaved."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LogError(f"{path} is being written by another run (another process or store object holds it); "
                       "wait for it to finish, or write to another file") from None


class JsonlLog:
    """Records of one `kind` in `path`, one JSON object per line, after a header line.

    `parse` turns a record's dict into the caller's type (raise ValueError/TypeError/KeyError if
    it is not one); `config` is the writer's configuration (a JSON-able mapping, or None to skip
    the check). Nothing touches the file until the first `append` or `open_for_append`.
    """

    def __init__(self, path: str | os.PathLike[str], kind: str, parse: Callable[[dict[str, Any]], Any] = dict,
                 config: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise LogError(f"{self.path} is a directory, not a .jsonl file")
        self.kind, self.parse = kind, parse
        self.noun = f"{kind.removesuffix('s')} record"  # "runs" -> "run record"
        self.config = None if config is None else json.loads(json.dumps(config, default=str))
        self.header: dict[str, Any] | None = None  # as read from the file; None for new and legacy files
        self.torn_bytes = 0  # size of an unterminated last line (skipped by readers, moved aside by writers)
        self.moved_torn_to: Path | None = None  # where a writer put that line
        self._fd: int | None = None

    # ------------------------------------------------------------------ reading

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, bytes) of every newline-terminated line; sets `torn_bytes` for the rest."""
        self.torn_bytes = 0
        if not self.path.exists():
            return
        lineno = 0
        try:
            with open(self.path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    if not raw.endswith(b"\n"):
                        self.torn_bytes = len(raw)
                        log.info("%s:%d: skipping an unterminated last line (%d bytes; a write cut short?)",
                                 self.path, lineno, len(raw))  # (callers report `torn_bytes` themselves)
                        return
                    yield lineno, raw
        except OSError as exc:  # unreadable (permissions, /proc/self/mem): the file and the line it stopped at
            raise LogError(f"cannot read {self.path}" + (f" past line {lineno}" if lineno else "")
                           + f": {exc.strerror or exc}") from None

    def _decode(self, lineno: int, raw: bytes) -> dict[str, Any]:
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LogError(f"{self.path}:{lineno}: not a {self.noun} (not UTF-8 JSON: {exc})") from None
        if not isinstance(record, dict):
            raise LogError(f"{self.path}:{lineno}: not a {self.noun} (a JSON {type(record).__name__})")
        return record

    def _check_header(self, record: dict[str, Any]) -> None:
        if record.get(HEADER_KEY) != self.kind:
            raise LogError(f"{self.path}:1: a thinkahead {record.get(HEADER_KEY)!r} log, not a {self.kind} log")
        if record.get("format") != FORMAT:
            raise LogError(f"{self.path}:1: log format {record.get('format')!r}; this thinkahead reads format {FORMAT}")

    def __iter__(self) -> Iterator[Any]:
        """Every record in file order (superseded ones included); the header is not a record."""
        self.header = None
        for lineno, raw in self._lines():
            if not raw.strip():
                continue
            record = self._decode(lineno, raw)
            if lineno == 1 and HEADER_KEY in record:
                self._check_header(record)
                self.header = record
                continue
            try:
                yield self.parse(record)
            except (ValueError, TypeError, KeyError) as exc:
                raise LogError(f"{self.path}:{lineno}: not a {self.noun} ({exc})") from None

    # ------------------------------------------------------------------ writing

    def open_for_append(self, on_record: Callable[[Any], None] | None = None) -> None:
        """Recognise the file, check the configuration, move a torn tail aside; then appends may go.

        Raises `LogError` (naming the file, and the line where it applies) for a file that is not
        this kind of log, a corrupt record, a configuration mismatch, or a file that cannot be
        written. Idempotent: a second call reads nothing. `on_record` is called with each record
        as the check reads it (in file order), so a writer that needs what is there (the ids to
        skip on resume) reads the file once.
        """
        if self._fd is not None:
            return
        make_parent(self.path)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise LogError(cannot_write(self.path, exc)) from None
        try:
            _lock(fd, self.path)
            self._check_for_append(on_record)
            if self.torn_bytes:
                self._move_torn_tail()
            self._fd = fd
            if os.fstat(fd).st_size == 0:
                header = {HEADER_KEY: self.kind, "format": FORMAT, "config": self.config}
                self._write_line(header)
                self.header = header
        except BaseException:
            self._fd = None
            os.close(fd)
            raise

    def _check_for_append(self, on_record: Callable[[Any], None] | None) -> None:
        records = 0
        for record in self:  # validates every complete line (and reads the header)
            records += 1
            if on_record is not None:
                on_record(record)
        legacy = self.header is None and records > 0
        if self.header is None and self.torn_bytes and not records:
            raise LogError(f"{self.path} holds one unterminated line and no {self.noun}s; not writing to it")
        if legacy and self.config is not None:
            raise LogError(f"{self.path} has no recorded configuration (written by an older thinkahead), so it "
                           "cannot be resumed safely; write to a new file (another -o) or delete this one")
        if self.header is not None and self.config is not None and self.header.get("config") is not None:
            diff = config_differences(self.header["config"], self.config)
            if diff:
                raise LogError(f"{self.path} was written under another configuration ({'; '.join(diff[:6])}"
                               f"{' ...' if len(diff) > 6 else ''}); resume with the same settings, or write to a "
                               "new file (another -o) to start a new store")

    def _move_torn_tail(self) -> None:
        size = self.path.stat().st_size
        keep = size - self.torn_bytes
        side = self.path.with_name(self.path.name + TORN_SUFFIX)
        with open(self.path, "rb+") as f:
            f.seek(keep)
            tail = f.read()
            with open(side, "ab") as s:
                s.write(tail + b"\n")
                s.flush()
                os.fsync(s.fileno())
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        log.info("%s: an unterminated last line (%d bytes, a write cut short) was moved to %s",
                 self.path, len(tail), side)  # (callers report `moved_torn_to` themselves)
        self.torn_bytes = 0
        self.moved_torn_to = side

    def _write_line(self, record: Mapping[str, Any]) -> None:
        data = memoryview((json.dumps(record, ensure_ascii=False, default=repr) + "\n").encode("utf-8"))
        while data:  # O_APPEND: each line lands whole at the end, after whatever is there
            data = data[os.write(self._fd, data):]
        os.fsync(self._fd)

    def append_record(self, record: Mapping[str, Any]) -> None:
        """Write one record and make it durable before returning."""
        self.open_for_append()
        try:
            self._write_line(record)
        except OSError as exc:
            raise LogError(cannot_write(self.path, exc)) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # also releases the lock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
