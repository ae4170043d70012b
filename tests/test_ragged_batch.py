"""A ragged batch (`HFEngine.forward_batch`): several sequences, each with its own cache, prefix length, chain or
tree, in one forward of the native layer loop; each row gets the bits it gets alone, and a failed batch leaves
every cache as it was."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("thinkahead.models.engine.kernels._layer_native")
pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.engine.weights import gguf_native
from thinkahead.models.engine.kernels import layer_ops
from thinkahead.models.engine.runner import HFEngine
from thinkahead.token_spec.engine import ForwardCall

from tests.test_gguf_native import tiny_config, tiny_gguf  # noqa: F401 (fixture)
from tests.tiny_models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    engine = HFEngine(gguf_native.build_model(tiny_gguf[0], tiny_config()))
    assert engine.batches_rows
    return engine


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7 + 3 * i) % VOCAB for i in range(n)]


def test_each_sequence_of_a_batch_gets_the_bits_it_gets_alone(engine, monkeypatch) -> None:
    # four sequences at different prefix lengths; a chain, a decode step, a tree and a prefill in one forward
    plans = [(prompt(1, 30), [5, 6, 7], None, False), (prompt(2, 9), [8], None, False),
             (prompt(3, 17), [11, 12, 4, 13], [-1, 0, 0, 1], False), ([2], prompt(4, 40), None, True)]
    solo, batch = [], []
    for head, tokens, parents, last in plans:
        s = engine.new_session()
        engine.forward(s, head)
        solo.append((s, engine.forward(s, tokens, parents, last_only=last)))
        b = engine.new_session()
        engine.forward(b, head)
        batch.append(ForwardCall(b, tokens, parents, last))
    runs = []
    real = layer_ops.run_ragged
    monkeypatch.setattr(layer_ops, "run_ragged", lambda *a: runs.append(1) or real(*a))
    together = engine.forward_batch(batch)
    assert runs == [1]  # one forward for all four
    for (s, alone), call, got in zip(solo, batch, together):
        assert torch.equal(got, alone)
        assert call.session.length == s.length == s.cache.get_seq_length() == call.session.cache.get_seq_length()
    # the tree's path can be kept afterwards, and the next step is again the same bits
    tree_solo, tree_batch = solo[2][0], batch[2].session
    start = tree_solo.length - 4
    engine.keep_path(tree_solo, start, [0, 1, 3])
    engine.keep_path(tree_batch, start, [0, 1, 3])
    next_solo = engine.forward(tree_solo, [9])
    (next_batch, _) = engine.forward_batch([ForwardCall(tree_batch, [9]), ForwardCall(batch[0].session, [3])])
    assert torch.equal(next_batch, next_solo)


def test_a_batch_that_fails_leaves_every_cache_as_it_was(engine) -> None:
    sessions = [engine.new_session() for _ in range(3)]
    for s, n in zip(sessions, (5, 8, 3)):
        engine.forward(s, prompt(n, n))
    lengths = [s.cache.get_seq_length() for s in sessions]
    bad_mask_tree = [-1, 0, 5]  # a parent after its child
    with pytest.raises(ValueError, match="parents"):
        engine.forward_batch([ForwardCall(sessions[0], [1, 2]), ForwardCall(sessions[1], [1, 2, 3], bad_mask_tree)])
    with pytest.raises(ValueError, match="token id"):
        engine.forward_batch([ForwardCall(sessions[0], [1]), ForwardCall(sessions[2], [VOCAB + 3])])
    with pytest.raises(ValueError, match="one call only"):
        engine.forward_batch([ForwardCall(sessions[0], [1]), ForwardCall(sessions[0], [2])])
    assert [s.cache.get_seq_length() for s in sessions] == [s.length for s in sessions] == lengths


def test_an_engine_that_cannot_batch_rows_runs_the_calls_one_by_one() -> None:
    engine = HFEngine(tiny_model("llama"))
    assert not engine.batches_rows
    a, b = engine.new_session(), engine.new_session()
    out = engine.forward_batch([ForwardCall(a, prompt(1, 6)), ForwardCall(b, prompt(2, 4), last_only=True)])
    ref_a, ref_b = engine.new_session(), engine.new_session()
    assert torch.equal(out[0], engine.forward(ref_a, prompt(1, 6)))
    assert torch.equal(out[1], engine.forward(ref_b, prompt(2, 4), last_only=True))
    assert (a.length, b.length) == (6, 4)
