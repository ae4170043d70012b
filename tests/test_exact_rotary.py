"""Rotary position encodings from a table (thinkahead/models/exact_rotary.py): a position's cos/sin never
depend on the forward's shape, order, threads or the table's growth; exact models compute no torch
trigonometry in their forwards (torch's threaded cos/sin gave process-dependent bits); modules the table
cannot reproduce are left as they were."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from thinkahead.models import gguf_native
from thinkahead.models.exact_attention import use_exact_attention
from thinkahead.models.exact_rotary import BLOCK, LIMIT, RotaryTable, use_exact_rotary
from thinkahead.models.quantize import quantize_int8
from thinkahead.token_spec.backends.hf import HFEngine

from tests.concurrency import run_at_once
from tests.test_gguf_native import tiny_config, write_tiny_gguf
from tests.tiny_models import ARCHS, VOCAB, tiny_model


def qwen_rotary(**rope) -> Qwen2RotaryEmbedding:
    """The real Qwen2.5-0.5B's rotary geometry (head width 64, theta 1e6), or another rope type."""
    config = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6, **rope}
    return Qwen2RotaryEmbedding(config)


def test_the_table_gives_transformers_values_within_rounding():
    module = qwen_rotary()
    table = RotaryTable(module.inv_freq, module.attention_scaling)
    x = torch.zeros(1, 1)
    ids = torch.arange(0, 5000, 7).unsqueeze(0)
    for theirs, ours in zip(module(x, ids), table(x, ids)):
        assert ours.shape == theirs.shape == (1, ids.shape[1], 64) and ours.dtype == torch.float32
        ulp = (torch.nextafter(theirs.abs(), torch.tensor(2.0)) - theirs.abs())
        assert ((ours - theirs).abs() <= ulp).all()  # MKL's float32 cos is within an ulp; ours is rounded once
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
    torch.set_num_threads(1)
    try:
        one_thread = grown(x, batch)
    finally:
        torch.set_num_threads(2)
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


def test_modules_the_table_cannot_reproduce_keep_their_forward(caplog):
    dynamic = qwen_rotary(rope_type="dynamic", factor=2.0)
    model = torch.nn.Module()
    model.rotary_emb = dynamic
    model.plain = qwen_rotary()
    with caplog.at_level("INFO", logger="thinkahead.models.exact_rotary"):
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
