"""Rotary position encodings from a table (thinkahead/models/engine/qwen2/exact_rotary.py): a position's cos/sin never
depend on the forward's shape, order, threads or the table's growth; exact models compute no torch
trigonometry in their forwards (torch's threaded cos/sin gave process-dependent bits); modules the table
cannot reproduce are left as they were."""

from __future__ import annotations

import copy
import math
import pickle
import threading

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from thinkahead.models.engine.weights import gguf_native
from thinkahead.models.engine.qwen2.exact_attention import use_exact_attention
from thinkahead.models.engine.qwen2.exact_rotary import BLOCK, LIMIT, RotaryTable, use_exact_rotary
from thinkahead.models.engine.kernels.quantize import quantize_int8
from thinkahead.models.engine.runner import HFEngine

from tests.concurrency import run_at_once
from tests.test_gguf_native import tiny_config, write_tiny_gguf
from tests.tiny_models import ARCHS, VOCAB, tiny_model


def qwen_rotary(**rope) -> Qwen2RotaryEmbedding:
    """The real Qwen2.5-0.5B's rotary geometry (head width 64, theta 1e6), or another rope type."""
    config = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6, **rope}
    return Qwen2RotaryEmbedding(config)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b (float32), a float32 or float64."""
    b32 = b.float().abs()
    return (a.double() - b.double()).abs() / (torch.nextafter(b32, torch.tensor(2.0)) - b32).double()


def on_one_thread(call):
    """transformers' values on one thread: torch's first threaded cos/sin can be off by 1e-4 (the module's why)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return call()
    finally:
        torch.set_num_threads(threads)


def test_the_table_gives_transformers_values_within_rounding():
    module = qwen_rotary()
    table = RotaryTable(module.inv_freq, module.attention_scaling)
    x = torch.zeros(1, 1)
    ids = torch.arange(0, 5000, 7).unsqueeze(0)
    angles = [float(a) for a in (ids[0].float()[:, None] * module.inv_freq[None, :]).flatten()]  # float32 products
    exact = torch.tensor([[math.cos(a) for a in angles], [math.sin(a) for a in angles]], dtype=torch.float64)
    theirs = on_one_thread(lambda: module(x, ids))
    ours = table(x, ids)
    for t, o, e in zip(theirs, ours, exact):
        assert o.shape == t.shape == (1, ids.shape[1], 64) and o.dtype == torch.float32
        assert (ulps(o, t) <= 1).all()  # MKL's float32 cos/sin are within an ulp
        half = o[0, :, :32].flatten()
        assert torch.equal(half, o[0, :, 32:].flatten())
        assert (ulps(e, half) <= 0.5 + 1e-6).all()  # ours: the exact value rounded to float32
    bf16 = table(torch.zeros(1, dtype=torch.bfloat16), ids)
    assert bf16[0].dtype == torch.bfloat16 and torch.equal(bf16[0], table(x, ids)[0].bfloat16())


def test_a_positions_row_never_depends_on_the_call():
    module = qwen_rotary()
    grown = RotaryTable(module.inv_freq)
    whole = RotaryTable(module.inv_freq)
    x = torch.zeros(1, 1)
    all_ids = torch.arange(3 * BLOCK + 41).unsqueeze(0)
    reference = whole(x, all_ids)
    for start in range(0, all_ids.shape[1], 37):  # grown piece by piece, block boundaries crossed mid-piece
        piece = grown(x, all_ids[:, start:start + 37])
        assert all(torch.equal(p, r[:, start:start + 37]) for p, r in zip(piece, reference))
    shuffled = all_ids[:, torch.randperm(all_ids.shape[1])]
    batch = torch.cat([shuffled, all_ids.flip(1)])  # two sequences, other orders
    one_thread = on_one_thread(lambda: grown(x, batch))
    for ours, ref in zip(one_thread, reference):
        assert torch.equal(ours[0], ref[0, shuffled[0]]) and torch.equal(ours[1], ref[0].flip(0))


def test_two_threads_growing_one_table_get_the_same_rows():
    module = qwen_rotary()
    table = RotaryTable(module.inv_freq)
    reference = RotaryTable(module.inv_freq)(torch.zeros(1, 1), torch.arange(6000).unsqueeze(0))
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    run_at_once(*[lambda n=n: got.append(table(torch.zeros(1, 1), torch.arange(n).unsqueeze(0)))
                  for n in (3000, 6000, 4500, 6000)])
    for cos, sin in got:
        n = cos.shape[1]
        assert torch.equal(cos, reference[0][:, :n]) and torch.equal(sin, reference[1][:, :n])


def test_a_call_answers_from_its_own_table_whatever_another_thread_stores():
    """A slow thread growing a small table stores it just after a fast one stored a big table, and before
    the fast one returns: the fast one still answers from its own, and the big table stays."""
    small_paused, big_stored, small_done = threading.Event(), threading.Event(), threading.Event()

    class Interleaved(RotaryTable):
        @property
        def _table(self):
            return self.__dict__["table"]

        @_table.setter
        def _table(self, value):
            self.__dict__["table"] = value
            if value[0].shape[0] > BLOCK and not small_done.is_set():  # the big one landed: the small one goes now
                big_stored.set()
                small_done.wait(10)

    table = Interleaved(qwen_rotary().inv_freq)

    def block(start):  # the small grower pauses after computing, until the big table is stored
        out = RotaryTable._block(table, start)
        if threading.current_thread().name == "small":
            small_paused.set()
            big_stored.wait(10)
        return out

    table._block = block
    got = {}

    def small():
        try:
            got["small"] = table(torch.zeros(1), torch.arange(10).unsqueeze(0))
        finally:
            small_done.set()

    threads = [threading.Thread(target=small, name="small")]
    threads[0].start()
    assert small_paused.wait(10)
    threads.append(threading.Thread(target=lambda: got.update(big=table(torch.zeros(1), torch.tensor([[6000]])))))
    threads[1].start()
    for t in threads:
        t.join(20)
    assert set(got) == {"small", "big"}  # the big call did not fail on the small table (IndexError before)
    assert table.rows(0)[0].shape[0] > 6000  # and the big table was not replaced by the small one
    reference = RotaryTable(qwen_rotary().inv_freq)(torch.zeros(1), torch.tensor([[6000]]))
    assert torch.equal(got["big"][0], reference[0]) and torch.equal(got["big"][1], reference[1])


def test_a_saved_or_copied_model_carries_no_table():
    model = quantize_int8(tiny_model("qwen2"))
    engine = HFEngine(model)
    before = engine.forward(engine.new_session(), list(range(1, 30)))
    rotary = model.model.rotary_emb
    size = len(pickle.dumps(model))
    rotary(torch.zeros(1), torch.tensor([[100_000]]))  # a table of megabytes
    assert len(pickle.dumps(rotary.forward.rows(0))) > 10_000_000
    assert len(pickle.dumps(model)) == size
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        table = other.model.rotary_emb.forward
        assert isinstance(table, RotaryTable) and table.rows(0)[0].shape[0] == 0
        twin = HFEngine(other)
        assert torch.equal(twin.forward(twin.new_session(), list(range(1, 30))), before)


def test_bad_position_ids_are_refused_by_name():
    table = RotaryTable(qwen_rotary().inv_freq)
    with pytest.raises(ValueError, match=">= 0"):
        table(torch.zeros(1), torch.tensor([[3, -1]]))
    with pytest.raises(ValueError, match="past the table's"):
        table(torch.zeros(1), torch.tensor([[0, LIMIT]]))
    assert table.rows(0)[0].shape[0] == 0  # nothing was computed for the refused call
    with pytest.raises(ValueError, match="integers"):
        table(torch.zeros(1), torch.tensor([[1.5]]))
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        table(torch.zeros(1), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="inv_freq"):
        RotaryTable(torch.empty(0))


def no_torch_trigonometry(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a forward computed torch cos/sin")

    for name in ("cos", "sin"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
        monkeypatch.setattr(torch, name, refuse)


def test_exact_models_compute_no_torch_trigonometry_in_a_forward(tmp_path, monkeypatch):
    """torch's cos/sin run MKL's vector math split over threads: the first call in some processes gave the
    second thread's positions other bits, and a prompt prefilled whole then differed from its pieces."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    models = [gguf_native.build_model(path, tiny_config())] + [quantize_int8(tiny_model(arch)) for arch in ARCHS]
    engines = [HFEngine(model) for model in models]
    no_torch_trigonometry(monkeypatch)
    prompt = [(7 * i + 3) % VOCAB for i in range(45)]
    for engine in engines:
        whole = engine.forward(engine.new_session(), prompt)
        session = engine.new_session()
        pieces = torch.cat([engine.forward(session, prompt[i:i + 6]) for i in range(0, len(prompt), 6)])
        assert torch.equal(whole, pieces)


def test_multimodal_rope_keeps_its_forward():
    """Qwen2-VL's rotary reads 3-D position ids (one row per axis) its own way: a table would refuse them."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    model = torch.nn.Module()
    model.rotary_emb = Qwen2VLRotaryEmbedding(Qwen2VLConfig().text_config)
    assert use_exact_rotary(model) == 0 and "forward" not in model.rotary_emb.__dict__
    ids = torch.stack([torch.arange(6), torch.tensor([0, 1, 1, 2, 2, 5]), torch.tensor([0, 1, 2, 1, 2, 5])])[:, None]
    assert model.rotary_emb(torch.zeros(1), ids)[0].shape == (1, 6, 128)


def test_scaled_rope_types_are_tabled_within_their_rounding():
    x, ids = torch.zeros(1, 1), torch.arange(0, 40_000, 97).unsqueeze(0)
    for rope in ({"rope_type": "linear", "factor": 4.0},
                 {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}):
        module = qwen_rotary(**rope)
        theirs = on_one_thread(lambda m=module: m(x, ids))
        model = torch.nn.Module()
        model.rotary_emb = module
        assert use_exact_rotary(model) == 1, rope
        for t, o in zip(theirs, module(x, ids)):
            assert (ulps(o, t) <= 2).all(), rope  # yarn's scaling rounds a second time, as theirs


def test_modules_the_table_cannot_reproduce_keep_their_forward(caplog):
    dynamic = qwen_rotary(rope_type="dynamic", factor=2.0)
    model = torch.nn.Module()
    model.rotary_emb = dynamic
    model.plain = qwen_rotary()
    with caplog.at_level("INFO", logger="thinkahead.models.engine.qwen2.exact_rotary"):
        assert use_exact_rotary(model) == 1
    assert "forward" not in dynamic.__dict__ and "rotary_emb" in caplog.text
    assert isinstance(model.plain.__dict__["forward"], RotaryTable)
    assert use_exact_rotary(model) == 0  # once is enough


def test_the_module_keeps_its_type_and_buffers():
    model = tiny_model("qwen2")
    rotary = model.model.rotary_emb
    before = {name: t.clone() for name, t in model.named_buffers()}
    use_exact_attention(model)
    assert model.model.rotary_emb is rotary and type(rotary) is Qwen2RotaryEmbedding
    after = dict(model.named_buffers())
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_models_of_every_dtype_load_with_tables(smollm2_fp32):
    model, _ = smollm2_fp32  # float32, through load_causal_lm: no exact attention, the tables all the same
    assert isinstance(model.model.rotary_emb.__dict__.get("forward"), RotaryTable)
