"""A cache of converted model weights: convert a model once, memory-map the result on every later load.

Why: loading a packaged GGUF means dequantising it in Python (transformers), converting the linears
to int8 (thinkahead/models/engine/kernels/quantize.py) and converting the tokenizer: minutes on a CPU for the two
default models. The result is the same every time, so the first load stores it and later loads
map it from disk in seconds.

Layout, under the folder of prepared models (`registry.default_cache_dir()`, `$THINKAHEAD_HOME`):
``weight-cache/<label>-<dtype>-<key digest>/`` holds

- ``model.safetensors``: every tensor of the converted model (parameters and buffers, persistent or
  not) by its module path; an int8 linear (`RowwiseInt8Linear`) as ``PATH.qweight`` (int8, per
  output channel) and ``PATH.scales`` (float64) next to its ``PATH.bias`` buffer; fused Qwen2
  linears under their fused names (``...self_attn.qkv_proj``, ``...mlp.gate_up_proj``). The header's
  metadata lists the int8 linears, whether q/k/v and gate/up are fused, which names are parameters
  and tied aliases.
- ``config.json``, ``generation_config.json`` and the tokenizer's files (``save_pretrained``).
- ``manifest.json``, written last: the key and every file's size and sha256.

An entry of dtype "gguf" has no ``model.safetensors``: its weights are the GGUF file, memory-mapped
(thinkahead/models/engine/weights/gguf_native.py); the entry saves converting the config and the tokenizer from
the GGUF's metadata (about 17 s for the 1.5B here).

The key (`CacheKey`) is the source's sha256 (the registry's checksum of a packaged GGUF; else a
hash of the GGUF file, or of every file of a model directory, computed once and remembered by
path, size and mtime in ``weight-cache/sources.json``), the dtype, the transformers and torch
versions, a digest of quantize.py and fused_qwen2.py (int8 only: changed conversion code gives new weights) and
`FORMAT_VERSION`. Its digest names the entry's folder.

Safety: an entry is written in a temporary folder (files fsynced, manifest last) and renamed into
place in one step, so a reader sees a whole entry or none, and two processes converting at once
each write their own folder (the first rename wins). A load checks the manifest's key and every
file's size; the first load of an entry also hashes every file against the manifest (the model
file in a thread while the model is being built; the model is returned only if the hashes match)
and records each file's identity (size, mtime, ctime, inode) in ``verified.json``; later loads
hash again only if that identity changed. Any write, truncation or replacement changes the ctime,
which cannot be set back, so a truncated, bit-flipped or stale entry is never used: it is deleted
with a warning and the model is converted again. (Hashing costs about 1.3 s per GB here, so the
2.5 GB of the 1.5B int8 model would add about 3 s of CPU to every start; a flip by the disk itself,
which changes no metadata, is caught only on an entry's first load.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from thinkahead.models.engine.dtypes import GGUF, INT8
from thinkahead.models.registry import default_cache_dir

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3  # bump when the layout or the rebuild code changes (3: fused q/k/v and gate/up)
ENV_SWITCH = "THINKAHEAD_WEIGHT_CACHE"  # "0" / "false" / "off" / "no" disables the cache
CACHE_DIRNAME = "weight-cache"
MODEL_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
VERIFIED_FILE = "verified.json"  # identities of files a load hashed: later loads only stat them
SOURCES_FILE = "sources.json"
HASH_NAME = "sha256"
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_STALE_TMP_S = 24 * 3600.0  # an unfinished entry this old belongs to a process that died
_META_KEY = "thinkahead"
_FALSE, _TRUE = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


class CacheInvalid(Exception):
    """An entry that must not be used (corrupt, stale, incomplete); it is deleted and rebuilt."""


class Uncacheable(Exception):
    """A model the cache cannot rebuild from its config (an unusual module layout); it is not stored."""


def cache_enabled(setting: bool | None = None) -> bool:
    """`setting` when given, else `$THINKAHEAD_WEIGHT_CACHE` (unset or empty: on)."""
    if setting is not None:
        return bool(setting)
    raw = os.environ.get(ENV_SWITCH, "").strip().lower()
    if raw in _FALSE:
        return False
    if raw == "" or raw in _TRUE:
        return True
    raise ValueError(f"{ENV_SWITCH} must be one of {', '.join(_TRUE + _FALSE)}, got {raw!r}")


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The weight cache folder under `cache_dir` (default: the prepared models' folder)."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / CACHE_DIRNAME


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True, slots=True)
class CacheKey:
    """What a converted model depends on; equal keys give bit-identical models."""

    label: str  # a readable name for the folder (registry name, file or directory name)
    source: str  # sha256 of the source weights
    dtype: str
    transformers: str
    torch: str
    code: str  # digest of the conversion code ("" when nothing beyond transformers converts)
    format: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()

    @property
    def dirname(self) -> str:
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in self.label)[:64] or "model"
        return f"{safe}-{self.dtype}-{self.digest[:16]}"


def _code_digest(dtype: str) -> str:
    """For int8, a digest of quantize.py and fused_qwen2.py: new rounding or a new module layout means
    new weights."""
    if dtype != INT8:
        return ""
    from thinkahead.models.engine.qwen2 import fused_qwen2
    from thinkahead.models.engine.kernels import quantize

    digest = hashlib.sha256()
    for module in (quantize, fused_qwen2):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def make_key(label: str, source: str, dtype: str) -> CacheKey:
    """The key of `source` (a sha256) converted to `dtype` by this code and these library versions."""
    import torch
    import transformers

    return CacheKey(label, source, dtype, transformers.__version__, torch.__version__, _code_digest(dtype),
                    FORMAT_VERSION)


def hash_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, HASH_NAME).hexdigest()


def file_digest(path: Path, root: Path, compute: bool = True) -> str | None:
    """sha256 of `path`, remembered in `root/sources.json` by (path, size, mtime): hashed once.

    With `compute=False`, only a remembered hash is returned (None if there is none)."""
    path = path.resolve()
    st = path.stat()
    memo_path = root / SOURCES_FILE
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    record = memo.get(str(path)) if isinstance(memo, dict) else None
    if isinstance(record, dict) and record.get("size") == st.st_size and record.get("mtime_ns") == st.st_mtime_ns:
        return str(record.get("sha256"))
    if not compute:
        return None
    digest = hash_file(path)
    memo = {name: record for name, record in memo.items() if Path(name).exists()} if isinstance(memo, dict) else {}
    memo[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    try:
        write_json_atomic(memo_path, memo)
    except OSError as exc:  # a read-only cache still works, it just hashes again next time
        logger.debug("could not remember the hash of %s: %s", path, exc)
    return digest


def directory_digest(directory: Path, root: Path, compute: bool = True) -> str | None:
    """One sha256 over every (non-hidden) file of a model directory: names, sizes and contents."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts):
            continue
        one = file_digest(path, root, compute)
        if one is None:
            return None
        digest.update(f"{relative.as_posix()}\0{path.stat().st_size}\0{one}\n".encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _chmod_default(path: Path, directory: bool = False) -> None:
    """Give a mkstemp/mkdtemp path (mode 0600/0700) the mode a plain new one would get under the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        _chmod_default(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _remove(path: Path) -> None:
    """Delete an entry folder: rename it aside first (atomic), so no reader sees half of it."""
    trash = path.parent / f"{_TRASH_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(path, trash)
    except OSError:
        return  # already gone (another process removed or replaced it)
    shutil.rmtree(trash, ignore_errors=True)


def _clean_leftovers(root: Path) -> None:
    """Delete unfinished entries of processes that died long ago, and trash nobody finished deleting."""
    now = time.time()
    for path in root.glob(".*-*"):
        try:
            old = now - path.stat().st_mtime > _STALE_TMP_S
        except OSError:
            continue
        if path.name.startswith(_TRASH_PREFIX) or (path.name.startswith(_TMP_PREFIX) and old):
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- reading


def entry_path(root: Path, key: CacheKey) -> Path:
    return root / key.dirname


def _read_manifest(entry: Path, key: CacheKey) -> dict[str, Any]:
    try:
        manifest = json.loads((entry / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise CacheInvalid(f"unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("key") != key.as_dict():
        raise CacheInvalid("its key does not match (another format, library version or source)")
    files = manifest.get("files")
    if not isinstance(files, dict) or (MODEL_FILE not in files and key.dtype != GGUF):
        raise CacheInvalid("its manifest lists no model file")
    return manifest


def _check_sizes(entry: Path, files: dict[str, Any]) -> None:
    for name, record in files.items():
        try:
            size = (entry / name).stat().st_size
        except OSError:
            raise CacheInvalid(f"{name} is missing") from None
        if not isinstance(record, dict) or size != record.get("size"):
            raise CacheInvalid(f"{name} has {size} bytes, the manifest says {record.get('size')}")


def _check_hash(entry: Path, name: str, record: dict[str, Any]) -> None:
    if hash_file(entry / name) != record.get(HASH_NAME):
        raise CacheInvalid(f"{name} does not match its {HASH_NAME} (corrupt)")


def _identity(path: Path) -> dict[str, int]:
    """What any write, truncation or replacement of a file changes (ctime cannot be set back)."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


def _verified_before(entry: Path, files: dict[str, Any]) -> bool:
    """Whether every file was hashed by an earlier load and has not changed since (a stat each)."""
    try:
        marker = json.loads((entry / VERIFIED_FILE).read_text())
        return all(marker[name] == {**_identity(entry / name), HASH_NAME: record[HASH_NAME]}
                   for name, record in files.items())
    except (OSError, ValueError, TypeError, KeyError):
        return False


def _check_all(entry: Path, files: dict[str, Any]) -> None:
    """Hash every file against the manifest, then record their identities for `_verified_before`."""
    before = {name: _identity(entry / name) for name in files}
    for name, record in files.items():
        _check_hash(entry, name, record)
    if {name: _identity(entry / name) for name in files} != before:
        raise CacheInvalid("it changed while it was being checked")
    try:
        write_json_atomic(entry / VERIFIED_FILE,
                           {name: {**before[name], HASH_NAME: record[HASH_NAME]} for name, record in files.items()})
    except OSError as exc:  # read-only: the next load hashes again
        logger.debug("could not record the check of %s: %s", entry, exc)


def is_complete(entry: Path) -> bool:
    """Whether `entry` holds a complete entry for the key its manifest names (sizes; no hashing)."""
    try:
        manifest = json.loads((entry / MANIFEST_FILE).read_text())
        key = CacheKey(**manifest["key"])
        _check_sizes(entry, _read_manifest(entry, key)["files"])
    except (OSError, ValueError, TypeError, KeyError, CacheInvalid):
        return False
    return entry.name == key.dirname


def load_entry(root: Path, key: CacheKey, name_or_path: str, source_file: Path | None = None) -> tuple[Any, Any] | None:
    """(model, tokenizer) from the entry for `key`, verified; None when there is none. An entry of dtype
    "gguf" holds no weights: its model is built over `source_file`, the GGUF itself.

    A corrupt, incomplete or stale entry is deleted with a warning and None is returned."""
    entry = entry_path(root, key)
    started = time.perf_counter()
    try:
        manifest = _read_manifest(entry, key)
    except FileNotFoundError:
        if entry.exists():  # entries are renamed into place whole: this one was damaged later
            _invalid(entry, CacheInvalid("it has no manifest"))
        return None
    except CacheInvalid as exc:
        _invalid(entry, exc)
        return None
    files: dict[str, Any] = manifest["files"]
    with ThreadPoolExecutor(1, thread_name_prefix="weight-cache-verify") as pool:
        check: Future[None] | None = None
        try:
            _check_sizes(entry, files)
            if not _verified_before(entry, files):  # hashed while the model is built; returned only if it matches
                check = pool.submit(_check_all, entry, files)
            if key.dtype == GGUF:
                from thinkahead.models.engine.weights.gguf_native import rebuild_entry

                if source_file is None:
                    raise ValueError("an entry of dtype 'gguf' needs its GGUF file")
                model, tokenizer = rebuild_entry(entry, source_file, name_or_path)
            else:
                from thinkahead.models.engine.weights.rebuild import rebuild

                model, tokenizer = rebuild(entry, entry / MODEL_FILE, key.dtype, name_or_path)
            if check is not None:
                check.result()
        except CacheInvalid as exc:
            _invalid(entry, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a damaged file can fail anywhere in safetensors or transformers
            if check is not None:
                try:
                    check.result()
                except CacheInvalid as corrupt:
                    _invalid(entry, corrupt)
                    return None
            _invalid(entry, exc)
            return None
    logger.info("loaded %s (%s) from the weight cache %s in %.1fs", key.label, key.dtype, entry,
                time.perf_counter() - started)
    return model, tokenizer


def _invalid(entry: Path, why: Exception) -> None:
    """Delete an unusable entry, saying why; the caller then converts the model again."""
    logger.warning("weight cache entry %s is not usable (%s); deleting it and converting the model again",
                   entry, why)
    _remove(entry)


# --------------------------------------------------------------------------- writing


def store_entry(root: Path, key: CacheKey, model: Any, tokenizer: Any, convert_s: float | None = None) -> Path | None:
    """Write the entry for `key` (atomically: temp folder, manifest last, rename); its path, or None
    when the model cannot be cached or the disk refuses (logged: loading goes on without a cache)."""
    from thinkahead.models.engine.weights.rebuild import collect, write_safetensors

    final = entry_path(root, key)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(root)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=root))
    except OSError as exc:
        logger.warning("could not create the weight cache in %s (%s); later loads will convert again", root, exc)
        return None
    started = time.perf_counter()
    try:
        files: dict[str, Any] = {}
        if key.dtype != GGUF:  # a gguf model's weights are the GGUF file itself
            tensors, metadata = collect(model)
            files[MODEL_FILE] = {"size": 0, HASH_NAME: write_safetensors(tmp / MODEL_FILE, tensors, metadata)}
            del tensors
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for path in sorted(tmp.iterdir()):
            if path.name != MODEL_FILE:
                with open(path, "rb+") as fh:
                    os.fsync(fh.fileno())
                files[path.name] = {HASH_NAME: hash_file(path)}
            files[path.name]["size"] = path.stat().st_size
        manifest = {"key": key.as_dict(), "files": files, "created": time.time(), "convert_s": convert_s}
        write_json_atomic(tmp / MANIFEST_FILE, manifest)
        _chmod_default(tmp, directory=True)
        _fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if is_complete(final):  # another process stored the same entry first: keep that one
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            _remove(final)  # a damaged leftover in the way
            os.rename(tmp, final)
        _fsync_dir(root)
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written must not fail the load
        shutil.rmtree(tmp, ignore_errors=True)
        logger.warning("not caching %s (%s: %s): later loads will convert it again", key.label,
                       type(exc).__name__, exc)
        return None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _prune_stale(root, key)
    except OSError as exc:
        logger.debug("could not prune stale entries in %s: %s", root, exc)
    logger.info("stored %s (%s) in the weight cache %s in %.1fs", key.label, key.dtype, final,
                time.perf_counter() - started)
    return final


def _entries(root: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in root.iterdir():
        if path.name.startswith("."):
            continue
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
            yield path, manifest.get("key", {})
        except (OSError, ValueError, AttributeError):
            continue


def _prune_stale(root: Path, key: CacheKey) -> None:
    """Delete entries of the same source and dtype made by another code or library version."""
    for path, other in _entries(root):
        if path.name != key.dirname and other.get("source") == key.source and other.get("dtype") == key.dtype:
            logger.info("deleting the stale weight cache entry %s", path)
            _remove(path)
