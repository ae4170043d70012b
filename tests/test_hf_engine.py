"""HFEngine: chain/tree forwards, keep_path and truncate must equal a fresh full forward.

Every check compares KV-cached logits with `logits_for_prefix` of the same token sequence on
tiny random float32 models. Gemma3's sliding window is 16 and the sequences run past 40 tokens,
so the sliding layers are exercised beyond the window.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.tiny_models import ARCHS, GEMMA3_SLIDING_WINDOW, VOCAB, tiny_model
from thinkahead.models.engine.runner import HFEngine

ATOL = 1e-4


def _tokens(rng: random.Random, n: int) -> list[int]:
    """n random token ids."""
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _random_parents(rng: random.Random, n: int) -> list[int]:
    """Random topological parents, biased towards deep branches (parent = previous node)."""
    return [-1 if i == 0 else rng.choice([i - 1, i - 1, rng.randrange(-1, i)]) for i in range(n)]


def _path_to(parents: list[int], node: int) -> list[int]:
    """Root-to-node indices of `node` in a tree."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    """Assert equal logits, reporting the largest difference."""
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    diff = (actual - expected).abs().max().item()
    assert diff <= atol, f"max |diff| = {diff}"


@pytest.mark.parametrize("arch", ARCHS)
def test_chain_in_pieces_equals_full_forward(tiny_engine_factory, arch):
    engine = tiny_engine_factory(arch)
    rng = random.Random(1)
    seq = _tokens(rng, 48)
    session = engine.new_session()
    pieces, i = [], 0
    while i < len(seq):
        k = rng.randint(1, 9)
        pieces.append(engine.forward(session, seq[i : i + k]))
        i += k
    assert session.length == len(seq)
    _close(torch.cat(pieces), engine.logits_for_prefix(seq))


@pytest.mark.parametrize("arch", ARCHS)
def test_random_append_and_truncate(tiny_engine_factory, arch):
    engine = tiny_engine_factory(arch)
    rng = random.Random(2)
    session = engine.new_session()
    seq: list[int] = []
    for _ in range(40):
        new = _tokens(rng, rng.randint(1, 6))
        got = engine.forward(session, new)
        seq += new
        _close(got, engine.logits_for_prefix(seq)[-len(new) :])
        r = rng.randint(0, min(len(seq), 4))
        engine.truncate(session, len(seq) - r)
        seq = seq[: len(seq) - r]
        assert session.length == len(seq)
    assert len(seq) > 2 * GEMMA3_SLIDING_WINDOW
    engine.truncate(session, 0)
    seq = _tokens(rng, 5)
    _close(engine.forward(session, seq), engine.logits_for_prefix(seq))


@pytest.mark.parametrize("prefix_len", [0, 7, 37])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_nodes_equal_fresh_forward_of_their_path(tiny_engine_factory, arch, prefix_len):
    engine = tiny_engine_factory(arch)
    rng = random.Random(3 + prefix_len)
    for n_nodes in (9, 26):  # 26 nodes make branches deeper than Gemma3's window
        prefix = _tokens(rng, prefix_len)
        tree = _tokens(rng, n_nodes)
        parents = _random_parents(rng, n_nodes)
        session = engine.new_session()
        if prefix:
            engine.forward(session, prefix)
        got = engine.forward(session, tree, parents=parents)
        assert got.shape == (n_nodes, engine.vocab_size)
        assert session.length == prefix_len + n_nodes
        for node in range(n_nodes):
            path = [tree[j] for j in _path_to(parents, node)]
            _close(got[node], engine.logits_for_prefix(prefix + path)[-1])


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_path_then_chain_equals_fresh_forward(tiny_engine_factory, arch):
    """A speculative loop: tree, keep an accepted path (possibly empty), append a chain, repeat."""
    engine = tiny_engine_factory(arch)
    rng = random.Random(4)
    seq = _tokens(rng, 5)
    session = engine.new_session()
    engine.forward(session, seq)
    for round_ in range(12):
        start = session.length
        tree = _tokens(rng, rng.randint(1, 10))
        parents = _random_parents(rng, len(tree))
        engine.forward(session, tree, parents=parents)
        path = [] if round_ == 3 else _path_to(parents, rng.randrange(len(tree)))
        engine.keep_path(session, start, path)
        assert session.length == start + len(path)
        seq += [tree[j] for j in path]
        cont = _tokens(rng, rng.randint(1, 4))
        got = engine.forward(session, cont)
        seq += cont
        _close(got, engine.logits_for_prefix(seq)[-len(cont) :])
    assert len(seq) > 2 * GEMMA3_SLIDING_WINDOW


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tree_with_eager_attention(arch):
    """Eager attention adds the mask to the scores: the additive float mask must work there too."""
    model = tiny_model(arch)
    model.set_attn_implementation("eager")
    engine = HFEngine(model)
    rng = random.Random(5)
    prefix, tree = _tokens(rng, 30), _tokens(rng, 12)
    parents = _random_parents(rng, len(tree))
    session = engine.new_session()
    engine.forward(session, prefix)
    got = engine.forward(session, tree, parents=parents)
    for node in range(len(tree)):
        path = [tree[j] for j in _path_to(parents, node)]
        _close(got[node], engine.logits_for_prefix(prefix + path)[-1])
    path = _path_to(parents, len(tree) - 1)
    engine.keep_path(session, len(prefix), path)
    cont = _tokens(rng, 3)
    expected = engine.logits_for_prefix(prefix + [tree[j] for j in path] + cont)[-3:]
    _close(engine.forward(session, cont), expected)


def test_gemma3_sliding_window_is_exercised(tiny_engine_factory):
    """Guard for the tests above: the tiny Gemma3's window really changes logits past 16 tokens."""
    rng = random.Random(6)
    seq = _tokens(rng, 40)
    windowed = tiny_engine_factory("gemma3").logits_for_prefix(seq)
    wide_model = tiny_model("gemma3")
    wide_model.config.sliding_window = 1000
    wide = HFEngine(wide_model).logits_for_prefix(seq)
    w = GEMMA3_SLIDING_WINDOW
    assert torch.allclose(windowed[:w], wide[:w], atol=ATOL)
    assert (windowed[w:] - wide[w:]).abs().amax(dim=-1).min() > 0.01


def test_engine_attributes(tiny_engine_factory):
    engine = tiny_engine_factory("qwen2")
    assert engine.vocab_size == VOCAB
    assert engine.dtype == torch.float32
    assert engine.device == torch.device("cpu")
    assert isinstance(engine.name, str) and engine.name


def test_bad_input_raises(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    session = engine.new_session()
    engine.forward(session, [5, 6, 7])
    for parents in ([0, 0], [-1, 1], [-2, 0], [-1], [-1, 0, 1]):
        with pytest.raises(ValueError):
            engine.forward(session, [8, 9], parents=parents)
    assert session.length == 3  # nothing was appended by the rejected calls
    with pytest.raises(ValueError):
        engine.forward(session, [])
    with pytest.raises(ValueError):
        engine.forward(session, [VOCAB])
    with pytest.raises(ValueError):
        engine.truncate(session, 4)
    with pytest.raises(ValueError):
        engine.truncate(session, -1)
    with pytest.raises(ValueError):
        engine.keep_path(session, 1, [0])  # the last forward began at 0, not 1
    engine.forward(session, [8, 9, 10], parents=[-1, -1, 0])
    for path in ([1, 2], [2], [0, 0], [3], [0, 2, 1]):
        with pytest.raises(ValueError):
            engine.keep_path(session, 3, path)
    with pytest.raises(ValueError):
        engine.keep_path(session, 2, [0])  # wrong start
    engine.keep_path(session, 3, [0, 2])
    assert session.length == 5
    with pytest.raises(ValueError):
        engine.keep_path(session, 3, [0])  # no tree forward since
    _close(engine.forward(session, [11]), engine.logits_for_prefix([5, 6, 7, 8, 10, 11])[-1:])


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_chain_smoke(tiny_engine_factory, arch):
    """bf16 is not bit-exact across different batchings: only check a loose tolerance."""
    engine = tiny_engine_factory(arch, dtype=torch.bfloat16)
    assert engine.dtype == torch.bfloat16
    rng = random.Random(7)
    seq = _tokens(rng, 40)
    session = engine.new_session()
    pieces = [engine.forward(session, seq[i : i + 5]) for i in range(0, len(seq), 5)]
    _close(torch.cat(pieces), engine.logits_for_prefix(seq), atol=0.25)
