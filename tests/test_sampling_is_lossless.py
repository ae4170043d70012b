"""Rejection sampling keeps the target distribution exactly (chi-square tests)."""

from __future__ import annotations

import itertools
import zlib

import pytest

import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from thinkahead.models.engine.runner import HFEngine
from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.drafters import DraftModelDrafter
from thinkahead.token_spec.verify import SamplingParams, draw, nucleus, target_probs, verify_sampling

V = 6  # vocabulary of the synthetic target
P_MIN = 1e-3  # significance level: a correct sampler fails about once in a thousand runs


def chi2_pvalue(counts: dict, expected_probs: dict, n: int) -> float:
    """Chi-square p-value, pooling cells with small expected counts."""
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for key, p in expected_probs.items():
        if p * n < 5:
            pool_o += counts.get(key, 0)
            pool_e += p * n
        else:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    assert sum(counts.values()) == n
    assert set(counts) <= set(expected_probs), "sampled a token the target gives probability 0"
    scale = sum(obs) / sum(exp)  # float rounding: the two totals must agree exactly
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def synthetic_target(seed: int):
    """Row 0: first-token logits; second-token logits depend on the first token."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(V, generator=g) * 1.5
    second = torch.randn(V, V, generator=g) * 1.5  # second[x1] = logits after x1
    return first, second


def emitted_pair(first, second, draft: Draft, params, gen) -> tuple[int, int]:
    """First two tokens a decoder would emit: this round's acceptance, then plain sampling if needed."""
    rows = [first] + [second[draft.token_ids[i]] if _depth(draft, i) == 0 else second[0] for i in range(len(draft))]
    # rows for depth>=1 nodes are never used to pick the first two tokens except below
    logits = torch.stack(rows)
    # depth-1 nodes need the logits after (x1, x2); only the second token matters here, so give them
    # the row of their parent token (the distribution of token 2 given token 1)
    acceptance = verify_sampling(logits, draft, params, gen)
    out = [draft.token_ids[i] for i in acceptance.accepted] + [acceptance.bonus]
    if len(out) == 1:
        p2 = target_probs(second, params)[out[0]]
        out.append(int(torch.multinomial(p2, 1, generator=gen)))
    return out[0], out[1]


def _depth(draft: Draft, i: int) -> int:
    d = 0
    while draft.parents[i] >= 0:
        i = draft.parents[i]
        d += 1
    return d


def exact_pair_probs(first, second, params) -> dict:
    p1 = target_probs(first[None], params)[0]
    out = {}
    for a in range(V):
        p2 = target_probs(second[a][None], params)[0]
        for b in range(V):
            if p1[a] * p2[b] > 0:
                out[(a, b)] = float(p1[a] * p2[b])
    return out


DRAFTS = {
    # a point-mass chain two deep: tokens 1 then 2
    "chain": lambda first, second: Draft.chain([1, 2]),
    # a point-mass tree: three first-token candidates, one with children
    "tree": lambda first, second: Draft(token_ids=[1, 3, 0, 4, 5], parents=[-1, -1, -1, 0, 0], probs=[1.0] * 5),
}


@pytest.mark.parametrize("kind", ["chain", "tree", "q-chain"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_verify_sampling_matches_target_distribution(kind, params) -> None:
    first, second = synthetic_target(seed=zlib.crc32(kind.encode()) % 1000)  # str hash() differs per process
    gen = torch.Generator().manual_seed(1234)
    n = 4000
    counts: dict = {}
    qgen = torch.Generator().manual_seed(99)
    q_first = torch.softmax(torch.randn(V, generator=qgen), dim=-1)
    q_second = torch.softmax(torch.randn(V, V, generator=qgen), dim=-1)
    for _ in range(n):
        if kind == "q-chain":
            # a draft model that samples its tokens from its own q, as DraftModelDrafter does
            x1 = int(torch.multinomial(q_first, 1, generator=gen))
            x2 = int(torch.multinomial(q_second[x1], 1, generator=gen))
            draft = Draft.chain([x1, x2], q=torch.stack([q_first, q_second[x1]]))
            logits = torch.stack([first, second[x1], second[0]])
            acceptance = verify_sampling(logits, draft, params, gen)
            out = [draft.token_ids[i] for i in acceptance.accepted] + [acceptance.bonus]
            if len(out) == 1:
                p2 = target_probs(second[out[0]][None], params)[0]
                out.append(int(torch.multinomial(p2, 1, generator=gen)))
            pair = (out[0], out[1])
        else:
            pair = emitted_pair(first, second, DRAFTS[kind](first, second), params, gen)
        counts[pair] = counts.get(pair, 0) + 1
    assert chi2_pvalue(counts, exact_pair_probs(first, second, params), n) > P_MIN


def test_chi_square_detects_a_biased_sampler() -> None:
    """The statistical test has power: greedy-accepting drafts (a lossy rule) is caught."""
    first, second = synthetic_target(seed=7)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(5)
    counts: dict = {}
    n = 4000
    p1 = target_probs(first[None], params)[0]
    for _ in range(n):
        # lossy: always keep draft token 1 when it is the argmax-free guess, regardless of p
        a = 1 if torch.rand((), generator=gen) < 0.5 else int(torch.multinomial(p1, 1, generator=gen))
        p2 = target_probs(second[a][None], params)[0]
        b = int(torch.multinomial(p2, 1, generator=gen))
        counts[(a, b)] = counts.get((a, b), 0) + 1
    assert chi2_pvalue(counts, exact_pair_probs(first, second, params), n) < P_MIN


TINY = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, initializer_range=0.3, pad_token_id=0)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def two_token_pvalue(decoder: SpeculativeDecoder, n: int = 1000) -> float:
    """How well `decoder`'s sampled two-token continuations of a fixed prompt fit its engine's own distribution."""
    engine, vocab = decoder.engine, TINY["vocab_size"]
    prompt = [1, 5, 2, 7]
    params = SamplingParams(temperature=1.0)
    exact = {}
    base = engine.logits_for_prefix(prompt)[-1]
    p1 = target_probs(base[None], params)[0]
    for a, b in itertools.product(range(vocab), repeat=2):
        p2 = target_probs(engine.logits_for_prefix(prompt + [a])[-1][None], params)[0]
        exact[(a, b)] = float(p1[a] * p2[b])
    counts: dict = {}
    for i in range(n):
        out = decoder.generate(prompt, max_new_tokens=2, sampling=params, stop_token_ids=[], seed=i)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return chi2_pvalue(counts, exact, n)


@pytest.mark.slow  # ~10 s each: keeps `-m "not slow"` under 3 minutes; CI runs it
@pytest.mark.parametrize("draft_vocab", [None, 5])
def test_decoder_sampling_end_to_end_matches_model(draft_vocab) -> None:
    """The whole loop (draft model with q, KV rollback) samples the tiny model's own distribution; also
    when the draft model's output layer keeps ids 0-4 and the prompt's (token 6 is never drafted)."""
    engine = HFEngine(tiny_llama(0))
    small = tiny_llama(1)
    decoder = SpeculativeDecoder(engine, DraftModelDrafter(HFEngine(small), seed=3, vocab=draft_vocab), FixedController(3))
    assert two_token_pvalue(decoder) > P_MIN


@pytest.mark.slow
def test_sampling_with_draft_head_guesses_matches_model() -> None:
    """A draft head's guesses (point masses from the target's own hidden states) keep sampling exact."""
    from thinkahead.token_spec.draft_head import DraftHead
    from thinkahead.token_spec.drafters import CombinedDrafter
    from thinkahead.token_spec.head_drafter import HeadDrafter

    target = tiny_llama(0)
    torch.manual_seed(2)
    head = DraftHead(TINY["hidden_size"], 8, 6).eval()  # guesses among ids 0-5 and the context's
    torch.nn.init.normal_(head.up.weight, std=0.3)
    engine = HFEngine(target)
    drafter = HeadDrafter(head, target.get_input_embeddings(), target.get_output_embeddings(), TINY["vocab_size"],
                          CombinedDrafter(), min_prob=0.0)
    passes, real = [], drafter.engine.forward_batch
    drafter.engine.forward_batch = lambda calls: passes.append(len(calls)) or real(calls)
    decoder = SpeculativeDecoder(engine, drafter, FixedController(2))
    assert two_token_pvalue(decoder) > P_MIN
    assert len(passes) > 500  # the head guessed in most of the 1000 generations


def sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p cut by ranking the whole vocabulary (what target_probs did before `nucleus`)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1, dtype=torch.float64) - sorted_p
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(before >= top_p, 0.0))
    return kept / kept.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_nucleus_keeps_what_ranking_the_whole_vocabulary_keeps(top_p) -> None:
    """Peaked rows cut inside the first candidates, flat ones (a 152k vocabulary, the cut past 256 and past
    1,024 of them) only after widening; every row keeps the same probabilities (a tie at the cut may keep
    another token of the same probability: float32 rows of 152k values hold ties)."""
    gen = torch.Generator().manual_seed(3)
    vocab = 151_936
    logits = torch.randn(4, vocab, generator=gen) * torch.tensor([[8.0], [2.0], [0.5], [0.01]])
    probs = torch.softmax(logits, dim=-1)
    got = nucleus(probs, top_p)
    want = sorted_nucleus(probs, top_p)
    assert torch.equal((got > 0).sum(dim=-1), (want > 0).sum(dim=-1))
    torch.testing.assert_close(got.sort(dim=-1).values, want.sort(dim=-1).values, rtol=1e-5, atol=0.0)
    assert (got > 0).sum(dim=-1)[3] > 1024 or top_p < 0.01  # the flat row needed widening


def test_draw_follows_the_weights_and_never_draws_a_zero() -> None:
    gen = torch.Generator().manual_seed(11)
    weights = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0, 0.0])  # unnormalised is fine too: scaled below
    n = 6000
    counts: dict = {}
    for _ in range(n):
        i = draw(weights * 3.0, gen)
        counts[i] = counts.get(i, 0) + 1
    expected = {i: float(w) for i, w in enumerate(weights) if w > 0}
    assert chi2_pvalue(counts, expected, n) > P_MIN


def test_draw_where_the_uniform_rounds_up_to_the_total_takes_the_last_weighted_index(monkeypatch) -> None:
    """u * total can round to the total itself; the draw must still land on a token with weight, not past
    the end or on the zeros that trail it."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert draw(torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0, 0.0])) == 3


def test_draw_is_reproducible_per_seed() -> None:
    weights = torch.softmax(torch.randn(151_936, generator=torch.Generator().manual_seed(2)), dim=-1)
    runs = [[draw(weights, g) for _ in range(20)] for g in (torch.Generator().manual_seed(5) for _ in range(2))]
    assert runs[0] == runs[1] and len(set(runs[0])) > 10


@pytest.mark.parametrize("weights", [[0.0, 0.0], [0.5, float("nan")], [0.5, float("inf")], [0.7, -0.2, 0.5], []])
def test_draw_refuses_weights_it_cannot_draw_from(weights) -> None:
    with pytest.raises(ValueError, match="cannot draw"):
        draw(torch.tensor(weights))
