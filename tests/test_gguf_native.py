"""A transformers model over a GGUF file's own blocks (thinkahead/models/engine/weights/gguf_native.py).

A tiny Qwen2 is written as a real GGUF file (gguf's writer, mixed block types as in Q4_K_M files);
the model built over it computes the same logits one token at a time as in one verification pass
(chain and tree), speculative greedy equals plain greedy, and it stays close to the float model of
the dequantized weights. The header reader agrees with gguf's own and refuses damaged files.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize
from transformers import Qwen2Config, Qwen2ForCausalLM

from thinkahead.models.engine.weights import gguf_native, huge_pages
from thinkahead.models.engine.kernels import kquant
from thinkahead.models.engine.runner import HFEngine
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.drafters import SuffixDrafter
from thinkahead.token_spec.suffix_cache import SuffixCache

from tests.test_kquant import random_blocks
from tests.test_speculative_decoding import assert_suffix_speculation_is_exact, repetitive_prompt
from tests.tiny_models import BYTE_MERGES, VOCAB, byte_tokenizer

pytestmark = pytest.mark.skipif(kquant.unavailable_reason() is not None, reason=str(kquant.unavailable_reason()))

HIDDEN, INTER, LAYERS = 256, 512, 2
# name -> (block type, rows, cols), as a Q4_K_M file mixes them (and Q4_0, as Q4_0 files have)
LINEARS = {"attn_q": (T.Q4_K, 256, HIDDEN), "attn_k": (T.Q5_0, 128, HIDDEN), "attn_v": (T.Q8_0, 128, HIDDEN),
           "attn_output": (T.Q4_0, HIDDEN, 256), "ffn_gate": (T.Q4_K, INTER, HIDDEN),
           "ffn_up": (T.Q4_K, INTER, HIDDEN), "ffn_down": (T.Q6_K, HIDDEN, INTER)}


def tiny_config() -> Qwen2Config:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, num_hidden_layers=LAYERS, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def add_metadata(writer: GGUFWriter) -> None:
    """What llama.cpp writes and transformers converts: the sizes of `tiny_config()` and the tiny byte-level
    tokenizer (its vocabulary, an array the header reader skips, padded to `VOCAB` with unused tokens)."""
    config = tiny_config()
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    vocab = {i: token for token, i in byte_tokenizer().get_vocab().items()}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([vocab.get(i, f"<unused{i}>") for i in range(VOCAB)])
    writer.add_token_types([1 if 3 <= i and i in vocab else 3 for i in range(VOCAB)])  # 1 normal, 3 control
    writer.add_token_merges([f"{a} {b}" for a, b in BYTE_MERGES])
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)


def write_tiny_gguf(path, arch: str = "qwen2", tied: bool = False) -> dict[str, np.ndarray]:
    """A tiny Qwen2 GGUF, metadata and tokenizer as llama.cpp writes them (`add_metadata`: it loads as
    `gguf:PATH`); the dequantized weights. `tied`: no output.weight (the lm_head is the embedding table,
    Q4_K)."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch)
    add_metadata(writer)
    floats: dict[str, np.ndarray] = {}

    def quant(name: str, kind: T, rows: int, cols: int) -> None:
        blocks = random_blocks(kind, rows, cols, seed=len(floats))
        writer.add_tensor(name, blocks, raw_dtype=kind)
        floats[name] = dequantize(blocks, kind)

    def plain(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))
        floats[name] = values.astype(np.float32)

    quant("token_embd.weight", T.Q4_K if tied else T.Q8_0, VOCAB, HIDDEN)
    for i in range(LAYERS):
        for short, (kind, rows, cols) in LINEARS.items():
            quant(f"blk.{i}.{short}.weight", kind, rows, cols)
        for short in ("attn_q", "attn_k", "attn_v"):
            plain(f"blk.{i}.{short}.bias", rng.standard_normal(LINEARS[short][1]) * 0.1)
        plain(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
        plain(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
    plain("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
    if tied:
        floats["output.weight"] = floats["token_embd.weight"]
    else:
        quant("output.weight", T.Q6_K, VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return floats


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-qwen2.gguf"
    return path, write_tiny_gguf(path)


def float_reference(floats: dict[str, np.ndarray]) -> Qwen2ForCausalLM:
    """The float32 transformers model of the same (dequantized) weights."""
    model = Qwen2ForCausalLM(tiny_config()).eval()
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    state = {"model.embed_tokens.weight": floats["token_embd.weight"], "lm_head.weight": floats["output.weight"],
             "model.norm.weight": floats["output_norm.weight"]}
    for i in range(LAYERS):
        for ours, theirs in names.items():
            part = "self_attn" if ours[0] in "qkvo" else "mlp"
            state[f"model.layers.{i}.{part}.{ours}.weight"] = floats[f"blk.{i}.{theirs}.weight"]
            if theirs in ("attn_q", "attn_k", "attn_v"):
                state[f"model.layers.{i}.{part}.{ours}.bias"] = floats[f"blk.{i}.{theirs}.bias"]
        state[f"model.layers.{i}.input_layernorm.weight"] = floats[f"blk.{i}.attn_norm.weight"]
        state[f"model.layers.{i}.post_attention_layernorm.weight"] = floats[f"blk.{i}.ffn_norm.weight"]
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    return model


def test_the_header_reader_agrees_with_gguf(tiny_gguf) -> None:
    path, _ = tiny_gguf
    index = gguf_native.read_index(path)
    reader = GGUFReader(path)
    assert index.architecture == "qwen2"
    assert set(index.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        info = index.tensors[t.name]
        assert (info.type, info.offset, info.shape) == (int(t.tensor_type), int(t.data_offset), tuple(int(d) for d in t.shape))


def test_damaged_or_foreign_files_are_refused_by_name(tiny_gguf, tmp_path) -> None:
    path, _ = tiny_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="tensor .* lies past the end of the file"):
        gguf_native.build_model(cut, tiny_config())
    cut.write_bytes(data[:200])
    with pytest.raises(ValueError, match="cannot fit in a file of 200 bytes"):
        gguf_native.read_index(cut)
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + data[4:100])
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_native.read_index(tmp_path / "bad.gguf")
    llama = tmp_path / "llama.gguf"
    write_tiny_gguf(llama, arch="llama")
    with pytest.raises(ValueError, match="runs qwen2 GGUF files; llama.gguf is 'llama'"):
        gguf_native.build_model(llama, tiny_config())


def test_the_model_is_close_to_the_float_model_of_its_weights(tiny_gguf) -> None:
    path, floats = tiny_gguf
    model = gguf_native.build_model(path, tiny_config())
    reference = float_reference(floats)
    ids = torch.tensor([repetitive_prompt(0, 24)])
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    # 8-bit activations per block: about 2% of a logit's scale on average, no row off by 10%
    assert float((ours - theirs).abs().mean() / theirs.abs().mean()) < 0.05
    assert float(((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max()) < 0.1
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


def test_logits_are_the_same_bits_decoded_or_verified_chain_and_tree(tiny_gguf) -> None:
    path, _ = tiny_gguf
    engine = HFEngine(gguf_native.build_model(path, tiny_config()))
    prompt = [(7 * i + 3) % VOCAB for i in range(37)]
    whole = engine.new_session()
    together = engine.forward(whole, prompt + [11, 12, 13])
    one_by_one = engine.new_session()
    rows = [engine.forward(one_by_one, prompt)]
    rows += [engine.forward(one_by_one, [t]) for t in (11, 12, 13)]
    assert torch.equal(torch.cat(rows), together)
    tree = engine.new_session()
    engine.forward(tree, prompt)
    branches = engine.forward(tree, [11, 12, 5, 13], [-1, 0, 0, 1])  # 11 -> 12 -> 13 and 11 -> 5
    assert torch.equal(branches[[0, 1, 3]], together[-3:])


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_greedy_equals_plain_greedy(tiny_gguf, tree) -> None:
    path, _ = tiny_gguf
    engine = HFEngine(gguf_native.build_model(path, tiny_config()))
    assert_suffix_speculation_is_exact(engine, tree)


@pytest.mark.slow
def test_the_real_05b_speculates_exactly_and_matches_its_float_model() -> None:
    """Qwen2.5-Coder-0.5B Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K blocks) as dtype "gguf": speculative
    greedy with three drafters and a shared KV prefix equals plain greedy; the next-token choice
    agrees with transformers' float32 model of the dequantized weights on a real prompt."""
    from thinkahead.token_spec.controller import MatchLengthController
    from thinkahead.token_spec.drafters import PromptLookupDrafter
    from thinkahead.token_spec.prefix_pool import KVPrefixPool
    from transformers import AutoModelForCausalLM

    from tests.test_real_model import PROMPT, _prefilled
    from thinkahead.models.engine.weights.load import load_causal_lm

    model, tokenizer = load_causal_lm("qwen2.5-coder-0.5b", "gguf", weight_cache=False)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    engine = HFEngine(model)
    reference = plain_greedy(engine, prompt, 120)
    assert "apples" in tokenizer.decode(reference)
    cache = SuffixCache()
    pool = KVPrefixPool(engine)
    pool.release(*_prefilled(engine, prompt[: len(prompt) // 2]))
    for drafter in (SuffixDrafter(cache), SuffixDrafter(cache, tree=True), PromptLookupDrafter()):
        decoder = SpeculativeDecoder(engine, drafter, MatchLengthController(16), tokenizer, prefix_pool=pool)
        result = decoder.generate(prompt, 120, stop_token_ids=[])
        assert result.token_ids == reference, drafter.name
        assert result.stats.spec_num_correct_drafts > 0, drafter.name

    location = str(model.config._name_or_path)
    gguf_file = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    floats = AutoModelForCausalLM.from_pretrained(location, gguf_file=gguf_file, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + reference])
    with torch.no_grad():
        ours, theirs = model(ids).logits[0, len(prompt) - 1:], floats(ids).logits[0, len(prompt) - 1:]
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


@pytest.mark.slow
def test_gguf_weight_cache_entries_hold_no_weights_round_trip_and_are_rebuilt(tmp_path, caplog) -> None:
    """dtype "gguf" caches only config and tokenizer: a warm load gives the fresh load's logits, and a
    damaged entry is deleted with a warning and rebuilt, never used."""
    import logging

    from thinkahead.models.engine.weights import cache as weight_cache, load as weights
    from thinkahead.models.registry import prepare

    spec = f"gguf:{prepare('qwen2.5-coder-0.5b')}"
    ids = torch.tensor([[9707, 11, 1879, 0, 3555, 374, 220, 17]])

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model(ids).logits

    fresh, _ = weights.load_causal_lm(spec, "gguf", cache_dir=tmp_path, weight_cache=False)
    weights.load_causal_lm(spec, "gguf", cache_dir=tmp_path, weight_cache=True)  # converts, stores
    entry = weights.weight_cache_entry(spec, "gguf", cache_dir=tmp_path)
    assert weights.is_weight_cached(spec, "gguf", cache_dir=tmp_path, weight_cache=True)
    assert not (entry / weight_cache.MODEL_FILE).exists() and (entry / "tokenizer.json").is_file()
    warm, tokenizer = weights.load_causal_lm(spec, "gguf", cache_dir=tmp_path, weight_cache=True)
    assert torch.equal(logits(warm), logits(fresh))
    assert tokenizer.decode(ids[0]) == "Hello, world! What is 2"
    tok = entry / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:-100])  # truncated
    with caplog.at_level(logging.WARNING, logger="thinkahead.models.engine.weights.cache"):
        again, _ = weights.load_causal_lm(spec, "gguf", cache_dir=tmp_path, weight_cache=True)
    assert any("not usable" in r.getMessage() for r in caplog.records)
    assert torch.equal(logits(again), logits(fresh))
    assert weights.is_weight_cached(spec, "gguf", cache_dir=tmp_path, weight_cache=True)


def test_auto_picks_gguf_only_where_it_runs(tiny_gguf, tmp_path, monkeypatch) -> None:
    from thinkahead.models.engine.weights.load import resolve_dtype

    path, _ = tiny_gguf
    assert resolve_dtype("auto", str(path.parent), path.name) == "gguf"
    assert resolve_dtype("auto", str(tmp_path), None) == "int8"  # not a GGUF file
    assert resolve_dtype("bfloat16", str(path.parent), path.name) == "bfloat16"
    write_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    assert resolve_dtype("auto", str(tmp_path), "llama.gguf") == "int8"  # an architecture gguf refuses
    assert gguf_native.unsupported_reason(tmp_path / "llama.gguf") == "architecture 'llama'"
    monkeypatch.setattr(kquant, "unavailable_reason", lambda: "this CPU lacks AVX2, FMA or F16C")
    assert resolve_dtype("auto", str(path.parent), path.name) == "int8"  # no kernel here
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16"):
        resolve_dtype("int4", str(path.parent), path.name)


def test_nested_arrays_are_skipped_and_a_bad_alignment_is_an_error_for_auto_too(tmp_path) -> None:
    from thinkahead.models.errors import ModelFileError
    from thinkahead.models.engine.weights.load import resolve_dtype

    for damage in ("nested array", "bad alignment"):
        path = tmp_path / f"{damage.replace(' ', '-')}.gguf"
        writer = GGUFWriter(str(path), "other")  # an architecture without a known layout: generic checks only
        if damage == "nested array":
            writer.add_array("weird", [[1, 2], [3]])
        else:
            writer.add_float32("general.alignment", 3.5)
        writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if damage == "nested array":
            assert set(gguf_native.read_index(path).tensors) == {"output_norm.weight"}
            assert resolve_dtype("auto", str(tmp_path), path.name) == "int8"  # an architecture gguf does not run
            continue
        with pytest.raises(ModelFileError, match="general.alignment 3.5 is not a power of two"):
            gguf_native.read_index(path)
        with pytest.raises(ModelFileError, match="general.alignment"):  # no fallback to int8 for a damaged file
            resolve_dtype("auto", str(tmp_path), path.name)


def test_weights_are_read_once_into_own_memory_and_rewritten_there_with_or_without_huge_pages(tiny_gguf, monkeypatch) -> None:
    path, _ = tiny_gguf
    data = huge_pages.read(path)
    assert data.ctypes.data % huge_pages.HUGE_PAGE == 0 and data.flags.writeable
    assert data.tobytes() == path.read_bytes()
    prompt = [(5 * i + 1) % VOCAB for i in range(23)]
    monkeypatch.setattr(huge_pages, "available", lambda: os.environ[huge_pages.ENV] == "1")
    reads: list[tuple[np.ndarray, bool]] = []
    real_read = huge_pages.read
    monkeypatch.setattr(huge_pages, "read", lambda p, huge=True: reads.append((real_read(p, huge), huge)) or reads[-1][0])
    logits = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(huge_pages.ENV, setting)
        model = gguf_native.build_model(path, tiny_config())
        copy, huge = reads[-1]
        assert huge == (setting == "1")
        linear = model.model.layers[0].mlp.gate_up_proj
        for blocks in (linear.blocks0, model.model.embed_tokens.blocks):  # rewritten in place, no copy
            assert copy.ctypes.data <= blocks.data_ptr() < copy.ctypes.data + copy.size
        # the embedding table keeps the file's bytes; the linears' Q4_K/Q6_K blocks were rewritten
        table = model.model.embed_tokens.blocks
        offset = table.data_ptr() - copy.ctypes.data
        assert bytes(copy[offset:offset + table.numel()]) == path.read_bytes()[offset:offset + table.numel()]
        offset = linear.blocks0.data_ptr() - copy.ctypes.data
        assert bytes(copy[offset:offset + linear.blocks0.numel()]) != path.read_bytes()[offset:offset + linear.blocks0.numel()]
        logits[setting] = HFEngine(model).logits_for_prefix(prompt)
    assert len(reads) == 2 and torch.equal(logits["1"], logits["0"])


def test_a_tied_lm_head_gets_its_own_rewritten_copy_and_the_embedding_keeps_the_files_rows(tmp_path) -> None:
    path = tmp_path / "tied.gguf"
    floats = write_tiny_gguf(path, tied=True)
    model = gguf_native.build_model(path, tiny_config())
    table, head = model.model.embed_tokens.blocks, model.lm_head.blocks0
    assert table.data_ptr() != head.data_ptr() and not torch.equal(table, head)
    ids = torch.tensor([[0, 5, VOCAB - 1]])
    assert torch.equal(model.model.embed_tokens(ids), torch.from_numpy(floats["token_embd.weight"])[ids])
    ids = torch.tensor([repetitive_prompt(0, 24)])
    with torch.no_grad():
        ours, theirs = model(ids).logits, float_reference(floats)(ids).logits
    assert float((ours - theirs).abs().mean() / theirs.abs().mean()) < 0.05  # as the untied model's test
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


def test_huge_pages_follow_the_kernels_setting_and_the_opt_out(tmp_path, monkeypatch) -> None:
    setting = tmp_path / "enabled"
    monkeypatch.setattr(huge_pages, "_THP_ENABLED", setting)
    monkeypatch.delenv(huge_pages.ENV, raising=False)
    for text, expected in (("always [madvise] never\n", True), ("[always] madvise never\n", True),
                           ("always madvise [never]\n", False)):
        setting.write_text(text)
        assert huge_pages.available() is expected
    setting.write_text("always [madvise] never\n")
    for off in ("0", "false", "No", " off "):
        monkeypatch.setenv(huge_pages.ENV, off)
        assert not huge_pages.available(), off
    monkeypatch.setenv(huge_pages.ENV, "1")
    assert huge_pages.available()
    monkeypatch.delenv(huge_pages.ENV)
    setting.unlink()  # no such kernel setting (not Linux, no THP): the memory map
    assert not huge_pages.available()
