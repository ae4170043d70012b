"""Damaged GGUF files are refused by name: one line naming the file (and the tensor), exit 2, before any
conversion work (thinkahead/models/engine/weights/gguf_check.py; issue 36 item 1).

Each case damages the tiny Qwen2 GGUF that tests/test_gguf_native.py writes (metadata and tokenizer as
llama.cpp writes them, so that the undamaged file runs as `gguf:PATH`), runs `thinkahead generate
--model gguf:PATH` on it, and checks exit status 2, one line on stderr naming the file and the tensor,
a file left as it was, within 2 s. Before the checks these gave tracebacks (exit 1) or loaded and
generated from garbage (exit 0: NaN scales, overlaps, misalignment, flipped data bytes).
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from thinkahead.cli import main
from thinkahead.models.engine.weights import gguf_check
from thinkahead.models.errors import ModelFileError

from tests.test_gguf_native import write_tiny_gguf

SECONDS = 2.0  # per case, through the command line


@dataclass(frozen=True)
class Tiny:
    """The undamaged file's bytes and where its header keeps each field."""

    data: bytes
    data_offset: int  # where the tensors' data begins
    fields: dict[str, int]  # metadata key -> byte of its value
    infos: dict[str, dict[str, int]]  # tensor -> {"n_dims", "dims", "rows", "type", "offset"}: byte of each field
    spans: dict[str, tuple[int, int]]  # tensor -> (start, end) of its data in the file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-qwen2.gguf"
    write_tiny_gguf(path)
    reader = GGUFReader(path)
    fields = {name: f.offset + sum(p.nbytes for p in f.parts[:-1]) for name, f in reader.fields.items()
              if not name.startswith("GGUF.")}
    infos, spans = {}, {}
    for t in reader.tensors:
        at = np.cumsum([t.field.offset] + [p.nbytes for p in t.field.parts])
        infos[t.name] = {"n_dims": int(at[2]), "dims": int(at[3]), "rows": int(at[3]) + 8, "type": int(at[4]),
                         "offset": int(at[5])}
        spans[t.name] = (int(t.data_offset), int(t.data_offset) + int(t.n_bytes))
    return Tiny(path.read_bytes(), int(reader.data_offset), fields, infos, spans)


def _put(data: bytearray, at: int, fmt: str, value: int) -> None:
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)


def _get(data: bytes, at: int, fmt: str) -> int:
    return struct.unpack_from(fmt, data, at)[0]


def _flip(at: int) -> Callable[[Tiny], bytes]:
    def damage(t: Tiny) -> bytes:
        data = bytearray(t.data)
        data[at] ^= 0xFF
        return bytes(data)
    return damage


def _edit(tensor: str, field: str, fmt: str, value: Callable[[int], int]) -> Callable[[Tiny], bytes]:
    def damage(t: Tiny) -> bytes:
        data = bytearray(t.data)
        at = t.infos[tensor][field]
        _put(data, at, fmt, value(_get(t.data, at, fmt)))
        return bytes(data)
    return damage


def _three_dims(t: Tiny) -> bytes:
    """blk.0.attn_q.weight declared (256, 256, 1): a dimension inserted in the header, the data moved to
    the next aligned start (the file is otherwise consistent)."""
    info = t.infos["blk.0.attn_q.weight"]
    end = max(i["offset"] for i in t.infos.values()) + 8  # the header's end
    header = bytearray(t.data[:info["type"]] + struct.pack("<Q", 1) + t.data[info["type"]:end])
    _put(header, info["n_dims"], "<I", 3)
    return bytes(header) + b"\0" * (-len(header) % gguf_check.DEFAULT_ALIGNMENT) + t.data[t.data_offset:]


def _shift_offsets(t: Tiny) -> bytes:
    data = bytearray(t.data)
    for info in t.infos.values():
        _put(data, info["offset"], "<Q", _get(t.data, info["offset"], "<Q") + 1)
    return bytes(data)


def _fill(tensor: str, byte: int) -> Callable[[Tiny], bytes]:
    def damage(t: Tiny) -> bytes:
        start, end = t.spans[tensor]
        return t.data[:start] + bytes([byte]) * (end - start) + t.data[end:]
    return damage


def _nan_value(t: Tiny) -> bytes:
    data = bytearray(t.data)
    at = t.spans["blk.1.ffn_norm.weight"][0] + 4 * 7
    data[at:at + 4] = struct.pack("<f", float("nan"))
    return bytes(data)


def _random_bytes(count: int, seed: int) -> Callable[[Tiny], bytes]:
    """`count` bytes of the data set to random values (most of such damage is found only where it makes a
    scale or a float value NaN or infinite: see gguf_check's docstring)."""
    def damage(t: Tiny) -> bytes:
        rng = np.random.default_rng(seed)
        data = np.frombuffer(t.data, dtype=np.uint8).copy()
        where = rng.choice(np.arange(t.data_offset, len(data)), size=count, replace=False)
        data[where] = rng.integers(0, 256, size=count, dtype=np.uint8)
        return data.tobytes()
    return damage


def _cut(at: Callable[[Tiny], int]) -> Callable[[Tiny], bytes]:
    return lambda t: t.data[:at(t)]


HUGE = 1 << 40
# name -> (damage, the tensor the line must name or None, what the line says)
CASES: dict[str, tuple[Callable[[Tiny], bytes], str | None, str]] = {
    "truncated at 100 B": (_cut(lambda t: 100), None, "cannot fit in a file of 100 bytes"),
    "truncated before the data": (_cut(lambda t: t.data_offset), "token_embd.weight", "lies past the end"),
    "truncated at half": (_cut(lambda t: len(t.data) // 2), "blk.0.ffn_down.weight", "lies past the end"),
    "truncated 1000 B before the end": (_cut(lambda t: len(t.data) - 1000), "output.weight", "lies past the end"),
    "magic flipped": (_flip(0), None, "not a GGUF file"),
    "version flipped": (_flip(4), None, "GGUF version"),
    "a key's length flipped": (_flip(24 + 7), None, "a key of .* bytes"),  # the first key's length's high byte
    "the hidden size flipped": (lambda t: _flip(t.fields["qwen2.embedding_length"])(t), None,
                                "qwen2.embedding_length 511 is not a multiple of head_count 4"),
    "a tensor's dimension count flipped": (lambda t: _flip(t.infos["blk.0.attn_k.weight"]["n_dims"])(t),
                                           "blk.0.attn_k.weight", "253 dimensions"),
    "a tensor's type flipped": (lambda t: _flip(t.infos["blk.0.attn_v.weight"]["type"])(t), "blk.0.attn_v.weight",
                                "unknown ggml type 247"),
    "a tensor's offset flipped": (lambda t: _flip(t.infos["blk.1.ffn_up.weight"]["offset"])(t),
                                  "blk.1.ffn_up.weight", "misaligned"),
    "a huge tensor count": (lambda t: t.data[:8] + struct.pack("<Q", HUGE) + t.data[16:], None,
                            f"{HUGE} tensors cannot fit"),
    "a huge key count": (lambda t: t.data[:16] + struct.pack("<Q", HUGE) + t.data[24:], None, f"{HUGE} keys"),
    "a changed shape": (_edit("blk.0.ffn_gate.weight", "rows", "<Q", lambda rows: rows // 2), "blk.0.ffn_gate.weight",
                        r"shape \(256, 256\), where the file's metadata .* gives \(256, 512\)"),
    "tensor type 99": (_edit("blk.0.ffn_down.weight", "type", "<I", lambda _: 99), "blk.0.ffn_down.weight",
                       "unknown ggml type 99"),
    "an F16 norm": (_edit("blk.1.attn_norm.weight", "type", "<I", lambda _: int(T.F16)), "blk.1.attn_norm.weight",
                    "is F16; a qwen2 file's norms and biases are F32"),
    "3 declared dimensions": (_three_dims, "blk.0.attn_q.weight", r"shape \(256, 256, 1\)"),
    "an embedding with too few rows": (_edit("token_embd.weight", "rows", "<Q", lambda _: 100), "token_embd.weight",
                                       r"shape \(256, 100\), where the file's metadata \(qwen2: 256 wide, "
                                       r"vocabulary 160\)"),
    "a retyped tensor overlapping the next": (_edit("blk.0.attn_output.weight", "type", "<I", lambda _: int(T.Q8_0)),
                                              "blk.0.attn_output.weight", "overlap"),
    "offsets shifted by one": (_shift_offsets, "token_embd.weight", "misaligned"),
    "an attention tensor full of 0xFF": (_fill("blk.0.attn_q.weight", 0xFF), "blk.0.attn_q.weight",
                                         "Q4_K block 0 has a NaN or infinite scale"),
    "a NaN in a norm": (_nan_value, "blk.1.ffn_norm.weight", "value 7 is NaN or infinite"),
    "5000 random bytes in the data": (_random_bytes(5000, seed=5), None, "NaN or infinite"),
}


def _generate(path: Path) -> tuple[int, list[str], float]:
    started = time.perf_counter()
    r = CliRunner().invoke(main, ["generate", "--model", f"gguf:{path}", "--max-new-tokens", "2", "hello"])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    return r.exit_code, lines, time.perf_counter() - started


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_file_is_one_line_and_exit_2(case, tiny, tmp_path) -> None:
    damage, tensor, why = CASES[case]
    path = tmp_path / "damaged.gguf"
    damaged = damage(tiny)
    assert damaged != tiny.data
    path.write_bytes(damaged)
    code, lines, seconds = _generate(path)
    assert code == 2, (case, code, lines)
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path}"), lines
    if tensor is not None:
        assert f"tensor {tensor}" in lines[0], lines
    assert re.search(why, lines[0]), lines
    assert seconds < SECONDS, seconds
    assert path.read_bytes() == damaged  # reading a file never changes it


def test_the_undamaged_file_generates(tiny, tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny.data)
    code, lines, _ = _generate(path)
    assert code == 0, lines


@pytest.mark.parametrize("case", ["truncated 1000 B before the end", "an attention tensor full of 0xFF"])
def test_run_refuses_a_damaged_file_with_one_line_and_exit_2(case, tiny, tmp_path) -> None:
    damage, tensor, why = CASES[case]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(damage(tiny))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "1", "question": "1 + 1?"}\n')
    started = time.perf_counter()
    r = CliRunner().invoke(main, ["run", str(tasks), "-o", str(tmp_path / "out.jsonl"), "--small", f"gguf:{path}",
                                  "--large", f"gguf:{path}"])
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error")]
    assert r.exit_code == 2, r.stderr
    assert len(errors) == 1 and r.stderr.rstrip().splitlines()[-1] == errors[0], r.stderr
    assert f"{path}: tensor {tensor}: " in errors[0] and re.search(why, errors[0]), errors
    assert time.perf_counter() - started < SECONDS


@pytest.mark.parametrize("kind", sorted(gguf_check._SCALES, key=int))
def test_the_scales_scanned_are_the_ones_that_dequantize(kind) -> None:
    """For every block type the scan knows, a block whose listed scale is set to NaN or infinity dequantizes
    to non-finite values, and one whose scales are finite (1.0) is finite and scans clean."""
    kind = T(kind)
    values, nbytes = gguf_check.TYPE_SIZES[int(kind)]
    encoding, offsets = gguf_check._SCALES[int(kind)]
    block = np.random.default_rng(int(kind)).integers(0, 256, size=(1, nbytes), dtype=np.uint8)
    one = {"f16": np.float16(1).tobytes(), "f32": np.float32(1).tobytes(), "e8m0": bytes([127])}[encoding]
    for at in offsets:
        block[0, at:at + len(one)] = np.frombuffer(one, dtype=np.uint8)
    info = gguf_check.TensorInfo(int(kind), (values, 1), 0)
    assert gguf_check._bad_scale(info, block.ravel()) is None
    checkable = kind != T.Q8_K  # gguf cannot dequantize Q8_K (llama.cpp's activations' type): its f32 d at 0
    assert not checkable or np.isfinite(dequantize(block, kind)).all()
    for at in offsets:
        bad = block.copy()
        bad[0, at:at + len(one)] = 0xFF
        assert gguf_check._bad_scale(info, bad.ravel()) == 0
        with np.errstate(all="ignore"):  # inf times the codes
            assert not checkable or not np.isfinite(dequantize(bad, kind)).all(), (kind.name, at)


def test_the_packaged_files_pass(tmp_path) -> None:
    """The real GGUFs the registry knows (where they are prepared here) pass the header checks."""
    from thinkahead.models.registry import REGISTRY, prepared_path

    found = [p for p in (prepared_path(name) for name in REGISTRY) if p is not None]
    if not found:
        pytest.skip("no packaged model is prepared here")
    for path in found:
        assert gguf_check.read_index(path).tensors


def test_a_damaged_file_is_a_model_file_error_for_every_dtype(tiny, tmp_path) -> None:
    """The library refuses it too, whatever the dtype (auto used to fall back to int8 on it), before any
    conversion."""
    from thinkahead.models.engine.weights.load import load_causal_lm

    path = tmp_path / "damaged.gguf"
    path.write_bytes(CASES["truncated at half"][0](tiny))
    for dtype in ("auto", "gguf", "int8", "bfloat16"):
        with pytest.raises(ModelFileError, match="tensor blk.0.ffn_down.weight: lies past the end"):
            load_causal_lm(f"gguf:{path}", dtype, weight_cache=False)
    path.write_bytes(CASES["an attention tensor full of 0xFF"][0](tiny))
    for dtype in ("gguf", "int8"):
        with pytest.raises(ModelFileError, match="tensor blk.0.attn_q.weight: Q4_K block 0 has a NaN"):
            load_causal_lm(f"gguf:{path}", dtype, weight_cache=False)
