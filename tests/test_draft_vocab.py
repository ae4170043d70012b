"""A draft model's output layer over part of the vocabulary (token_spec/draft_vocab.py) and the draft-model
drafter around it (token_spec/model_drafter.py).

An output layer restricted to some rows gives those columns of the full output, bit for bit (GGUF blocks,
`nn.Linear`, any other head); an engine forward through a given head gives the model's own logits; a
request's kept ids are the frequent ones and its context's; speculative greedy with a restricted draft
vocabulary, a confidence stop and a session's kept KV still equals plain greedy, and every drafted token
is a kept id.
"""

from __future__ import annotations

import pytest
import torch

from thinkahead.models.engine.weights import gguf_native
from thinkahead.models.engine.kernels import kquant
from thinkahead.models.engine.qwen2.exact_attention import IMPLEMENTATION as EXACT_ATTENTION
from thinkahead.models.engine.runner import HFEngine
from thinkahead.token_spec.controller import CostCurve, FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.draft_vocab import DraftVocab, output_rows
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.drafters import CombinedDrafter, DraftModelDrafter, HybridDrafter
from thinkahead.token_spec.model_drafter import RoundRate
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.verify import SamplingParams

from tests.test_gguf_native import tiny_config, write_tiny_gguf
from tests.test_kquant import T, quant_tensor
from tests.test_speculative_decoding import Recording, repetitive_prompt
from tests.tiny_models import ARCHS, VOCAB

needs_gguf = pytest.mark.skipif(kquant.unavailable_reason() is not None, reason=str(kquant.unavailable_reason()))


@needs_gguf
def test_gguf_output_rows_are_those_columns_of_the_full_output() -> None:
    parts = [quant_tensor("a", T.Q8_0, 40, 256, 1)[0], quant_tensor("b", T.Q6_K, 24, 256, 2)[0]]
    bias = torch.randn(64)
    full_linear = kquant.GGUFLinear(parts, bias)
    x = torch.randn(3, 256)
    full = full_linear(x)
    for ids in (torch.arange(0, 16), torch.arange(45, 60), torch.tensor([5, 41, 3, 63, 39, 40])):
        rows = full_linear.output_rows(ids)
        assert rows.out_features == ids.numel()
        assert torch.equal(rows(x), full[:, ids]), ids
    assert full_linear.output_rows(torch.arange(0, 16)).blocks0.data_ptr() == full_linear.blocks0.data_ptr()  # a view
    for bad in (torch.tensor([], dtype=torch.long), torch.tensor([64]), torch.tensor([-1])):
        with pytest.raises(ValueError, match=r"ids in \[0, 64\)"):
            full_linear.output_rows(bad)


def test_output_rows_of_a_linear_or_any_other_head() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 30)
    other = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Tanh())
    x = torch.randn(4, 16)
    ids = torch.tensor([29, 0, 7, 8, 9])
    # torch's GEMM over 5 rows need not give the bits of its GEMM over 30 (seen on an AMD EPYC): close, not equal
    torch.testing.assert_close(output_rows(linear, ids)(x), linear(x)[:, ids], rtol=1e-6, atol=1e-6)
    assert torch.equal(output_rows(other, ids)(x), other(x)[:, ids])  # the full output, then its columns
    assert output_rows(linear, torch.arange(3, 9)).weight.data_ptr() == linear.weight[3].data_ptr()  # a view


def _head_matches(engine: HFEngine) -> None:
    head = engine.model.get_output_embeddings()
    prompt = [(7 * i + 3) % VOCAB for i in range(23)]
    own, given = engine.new_session(), engine.new_session()
    assert torch.equal(engine.forward(given, prompt, head=head), engine.forward(own, prompt))
    assert torch.equal(engine.forward(given, [4, 5], head=head, last_only=True), engine.forward(own, [4, 5], last_only=True))
    tree = ([9, 10, 11], [-1, 0, 0])
    assert torch.equal(engine.forward(given, *tree, head=head), engine.forward(own, *tree))
    assert given.length == own.length == len(prompt) + 5


@pytest.mark.parametrize("arch", ARCHS)
def test_an_engine_forward_through_the_models_own_head_gives_its_logits(arch, tiny_engine_factory) -> None:
    _head_matches(tiny_engine_factory(arch))


@needs_gguf
def test_the_fused_gguf_model_runs_its_lean_layers_for_a_given_head(tmp_path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    model = gguf_native.build_model(path, tiny_config())
    model.set_attn_implementation(EXACT_ATTENTION)
    assert model._lean(torch.tensor([[1]]), None)
    _head_matches(HFEngine(model))


def test_a_requests_kept_ids_are_the_frequent_ones_and_its_contexts() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    vocab = DraftVocab(head, 50, 20)
    request = vocab.for_request()
    request.add([3, 41, 7, 25, 41])
    assert request.ids.tolist() == [*range(20), 41, 25]
    request.add([30, 2, 41])  # what the context adds: new ids join, known ones stay where they are
    assert request.ids.tolist() == [*range(20), 41, 25, 30]
    request.add([49])  # ids are only ever added
    assert request.ids.tolist() == [*range(20), 41, 25, 30, 49]
    for bad in (50, -1):
        with pytest.raises(ValueError, match=r"token id .* not in the draft model's vocabulary \[0, 50\)"):
            request.add([3, bad])
    assert request.ids.tolist() == [*range(20), 41, 25, 30, 49]  # a refused context changes nothing
    x = torch.randn(2, 8)
    # torch's GEMMs over 20 + 4 weight rows need not give the bits of its GEMM over all 50 (as above): close, not equal
    torch.testing.assert_close(request.logits(x), head(x)[:, request.ids], rtol=1e-6, atol=1e-6)
    dist = torch.softmax(request.logits(x)[0], -1)
    full = request.full(dist)
    assert full.shape == (50,) and torch.equal(full[request.ids], dist) and float(full.sum()) == pytest.approx(1.0)
    assert float(full[[20, 21, 40, 48]].abs().sum()) == 0.0
    assert DraftVocab(head, 50, 80).first == 50
    with pytest.raises(ValueError, match="at least one id"):
        DraftVocab(head, 50, 0)


class CountingEngine:
    """An engine that counts the tokens each forward reads."""

    def __init__(self, engine: HFEngine) -> None:
        self.inner, self.fed = engine, []
        self.model, self.vocab_size = engine.model, engine.vocab_size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, session, token_ids, parents=None, last_only=False, head=None):
        self.fed.append(len(token_ids))
        return self.inner.forward(session, token_ids, parents, last_only=last_only, head=head)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_restricted_confident_drafts_with_kept_sessions_still_give_plain_greedy(arch, tiny_engine_factory) -> None:
    engine = tiny_engine_factory(arch)
    small = CountingEngine(tiny_engine_factory(arch, seed=1))
    first = VOCAB // 2
    drafter = Recording(DraftModelDrafter(small, vocab=first, min_prob=0.3))
    decoder = SpeculativeDecoder(engine, drafter, FixedController(6))
    prompt = repetitive_prompt(0)
    reference = plain_greedy(engine, prompt, 40)
    result = decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[], session_id="s")
    assert result.token_ids == reference
    kept = set(range(first)) | set(prompt) | set(reference)
    drafted = [t for d in drafter.drafts for t in d.token_ids]
    assert drafted and set(drafted) <= kept
    for d in drafter.drafts:  # a draft ends at the first token below min_prob, or at the budget
        assert all(p >= 0.3 for p in d.probs[:-1]) and (len(d) == 6 or d.probs[-1] < 0.3)
    # the session's next turn extends the last prompt + answer: the small model reads only what is new
    turn = prompt + reference + [5, 6, 7]
    small.fed.clear()
    again = decoder.generate(turn, max_new_tokens=20, stop_token_ids=[], session_id="s")
    assert again.token_ids == plain_greedy(engine, turn, 20)
    # what the last round committed past the small model's KV (a draft of 6 + the bonus token at most),
    # then [5, 6, 7]: not the whole prompt
    assert small.fed[0] <= 7 + 3 < len(turn), small.fed
    small.fed.clear()
    decoder.generate(turn, max_new_tokens=5, stop_token_ids=[])  # no session: the whole prompt
    assert small.fed[0] == len(turn)


def test_sampled_drafts_over_kept_ids_carry_q_over_the_whole_vocabulary(tiny_engine_factory) -> None:
    small = tiny_engine_factory("qwen2", seed=1)
    drafter = DraftModelDrafter(small, seed=0, vocab=10)
    drafter.start("r", [1, 2, 150], SamplingParams(temperature=1.0))
    draft = drafter.propose("r", [1, 2, 150], 3)
    assert draft.q.shape == (len(draft), VOCAB)
    kept = list(range(10)) + [150]
    assert torch.allclose(draft.q[:, kept].sum(-1), torch.ones(len(draft)))
    assert all(t in kept for t in draft.token_ids)
    drafter.start("bad", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="not in the draft model's vocabulary"):  # refused by name, not an IndexError
        drafter.propose("bad", [1, 2, VOCAB + 5], 3)
    for bad in (dict(min_prob=1.5), dict(sessions=-1)):
        with pytest.raises(ValueError):
            DraftModelDrafter(small, **bad)


def test_hybrid_takes_the_combined_draft_when_confident_else_the_small_models(tiny_engine_factory) -> None:
    engine = tiny_engine_factory("qwen2")
    hybrid = HybridDrafter(CombinedDrafter(SuffixCache(max_depth=24)),
                           DraftModelDrafter(tiny_engine_factory("qwen2", seed=1), vocab=VOCAB // 2), model_max_tokens=4)
    decoder = SpeculativeDecoder(engine, hybrid, FixedController(8))
    prompt = repetitive_prompt(1)
    reference = plain_greedy(engine, prompt, 40)
    for _ in range(2):  # the second pass can copy the first's answer
        assert decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[]).token_ids == reference
    assert hybrid.rounds_by_source["free"] > 0 and hybrid.rounds_by_source["draft-model"] > 0


class FixedDraft:
    """A model-free drafter that always proposes one chain with the given per-token probabilities."""

    name, model_free = "fixed", True

    def __init__(self, probs: list[float]) -> None:
        self.probs = probs

    def start(self, rid, prompt, params, session_id=None):
        pass

    def propose(self, rid, context, budget):
        return Draft.chain([7] * len(self.probs), list(self.probs))

    def observe(self, rid, accepted, proposed):
        pass

    def finish(self, rid):
        pass


def test_hybrid_picks_the_source_that_promises_more_tokens_per_second(tiny_engine_factory) -> None:
    small = DraftModelDrafter(tiny_engine_factory("qwen2", seed=1))
    free = FixedDraft([0.9, 0.9, 0.6])  # score 2.4: promises 3.4 tokens
    hybrid = HybridDrafter(free, small, min_score=2.0)
    hybrid.start("r", [1, 2, 3], SamplingParams())
    assert hybrid.propose("r", [1, 2, 3], 4).source == ""  # untimed: the score rule (2.4 >= 2)
    hybrid.observe("r", [7, 7, 7], Draft())
    assert hybrid.rates["free"].rounds == 1 and hybrid.rates["free"].seconds > 0
    assert hybrid.free_cost.measured.keys() == {3}
    hybrid.free_cost = CostCurve(1.0, 0.1)
    hybrid.free_cost.update(3, 1.0)  # a 3-token model-free round takes a second: it promises 3.4 tokens/s
    hybrid.rates["draft-model"] = RoundRate(tokens=5.0, seconds=1.0, rounds=5)  # 5 tokens/s
    assert hybrid.propose("r", [1, 2, 3], 4).source == "draft-model"
    hybrid.observe("r", [4, 5], Draft())
    model = hybrid.rates["draft-model"]
    assert model.rounds == 6 and model.tokens == pytest.approx(5.0 + 0.1 * (2 - 5.0))
    hybrid.rates["free"], hybrid.free_promised = RoundRate(tokens=3.4, seconds=1.0, rounds=5), 3.4  # promises kept
    hybrid.rates["draft-model"] = RoundRate(tokens=3.0, seconds=1.0, rounds=5)  # 3 tokens/s: the free draft wins
    assert hybrid.propose("r", [1, 2, 3], 4).source == ""
    hybrid.observe("r", [7], Draft())
    hybrid.free_cost = CostCurve(1.0, 0.1)
    hybrid.free_cost.update(3, 1.0)
    # model-free rounds that kept only half their promises: 1.7 tokens/s against 3
    hybrid.rates["free"], hybrid.free_promised = RoundRate(tokens=2.0, seconds=1.0, rounds=5), 4.0
    assert hybrid.propose("r", [1, 2, 3], 4).source == "draft-model"
    hybrid.observe("r", [4], Draft())
    hybrid.rates["free"], hybrid.free_promised = RoundRate(tokens=3.4, seconds=1.0, rounds=5), 3.4
    # the cost is the draft length's: 3-token rounds cheap, 16-token rounds dear, a 3-token draft wins again
    hybrid.free_cost = CostCurve(1.0, 0.1)
    hybrid.free_cost.update(3, 0.3)
    hybrid.free_cost.update(16, 1.0)
    hybrid.rates["draft-model"] = RoundRate(tokens=5.0, seconds=1.0, rounds=5)
    assert hybrid.propose("r", [1, 2, 3], 4).source == ""
    hybrid.finish("r")
    with pytest.raises(ValueError, match="smoothing"):
        HybridDrafter(free, small, smoothing=0.0)


def test_hybrid_takes_a_plain_step_where_the_small_model_would_read_more_than_it_drafts(tiny_engine_factory) -> None:
    """An empty model-free draft is a plain step, one certain token: the small model drafts instead only
    where its rounds promise more per second, the tokens it has not read yet charged (a catch-up of a
    whole new prompt part after a run of model-free rounds)."""
    small = CountingEngine(tiny_engine_factory("qwen2", seed=1))
    hybrid = HybridDrafter(FixedDraft([]), DraftModelDrafter(small), min_score=2.0)
    hybrid.start("r", [1, 2, 3], SamplingParams())
    assert hybrid.propose("r", [1, 2, 3], 4).source == "draft-model"  # untimed: an empty draft is no draft
    hybrid.observe("r", [4, 5], Draft())
    hybrid.rates["free"] = RoundRate(tokens=3.0, seconds=1.0, rounds=5)
    hybrid.rates["draft-model"] = RoundRate(tokens=4.0, seconds=0.5, rounds=5)  # 8 tokens/s
    hybrid.free_cost = CostCurve(1.0, 0.1)
    hybrid.free_cost.update(0, 0.25)  # a plain step: 4 tokens/s
    hybrid.free_cost.update(4, 0.5)
    hybrid.read_seconds = 0.01
    context = [1, 2, 3, 4, 5]
    small.fed.clear()
    assert hybrid.propose("r", context, 4).source == "draft-model"  # nothing to read: 8 > 4 tokens/s
    hybrid.observe("r", [6], Draft())
    long = context + [6] + list(range(7, 107))  # 100 unread tokens: 4 tokens in 0.5 + 1.0 s < 4 tokens/s
    small.fed.clear()
    plain = hybrid.propose("r", long, 4)
    assert len(plain) == 0 and small.fed == []  # a plain step; the small model read nothing
    hybrid.observe("r", [9], Draft())
    assert hybrid.rates["free"].rounds == 5 and hybrid.free_cost.measured[0] < 0.25  # timed as a plain step
    hybrid.finish("r")


@pytest.mark.parametrize("kind", ["draft-model", "hybrid"])
def test_the_named_setups_build_the_small_model_drafter_with_the_preset_settings(kind, tiny_engine_factory) -> None:
    from thinkahead.token_spec import presets

    engine = tiny_engine_factory("qwen2")
    decoder = presets.build_decoder(kind, engine, draft_engine=tiny_engine_factory("qwen2", seed=1))
    small = decoder.drafter if kind == "draft-model" else decoder.drafter.model
    assert isinstance(small, DraftModelDrafter) and small.min_prob == presets.MODEL_DRAFT_MIN_PROB
    assert small.vocab is None  # the tiny vocabulary (160) is below MODEL_DRAFT_VOCAB: the whole head
    if kind == "hybrid":
        assert isinstance(decoder.drafter.free, CombinedDrafter) and decoder.drafter.min_score == presets.HYBRID_MIN_SCORE
    prompt = repetitive_prompt(2)
    assert decoder.generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids == plain_greedy(engine, prompt, 30)
    with pytest.raises(ValueError, match="needs a draft model engine"):
        presets.build_decoder(kind, engine)
