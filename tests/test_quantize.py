"""Int8 linears: batch-invariant rows, close to float32, and speculative greedy stays exact."""

from __future__ import annotations

import copy

import pytest
import torch

from thinkahead.quantize import RowwiseInt8Linear, quantize_int8
from thinkahead.token_spec.backends.hf import HFEngine
from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.drafters import SuffixDrafter
from thinkahead.token_spec.suffix_cache import SuffixCache

from tests.test_speculative_decoding import repetitive_prompt, seed_divergent_outputs


def test_rows_are_batch_invariant_and_close_to_float32() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200)
    layer = RowwiseInt8Linear(linear)
    x = torch.randn(3, 7, 96)
    x[0, 2] *= 80.0  # an outlier token must not change its neighbours' results
    together = layer(x)
    alone = torch.stack([torch.stack([layer(x[b, t][None])[0] for t in range(7)]) for b in range(3)])
    assert together.shape == (3, 7, 200)
    assert torch.equal(together, alone)
    reference = linear(x)
    assert ((together - reference).norm() / reference.norm()).item() < 0.03


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", [False, True])
def test_speculative_greedy_is_token_identical_in_int8(arch, tree, tiny_model_factory) -> None:
    model = quantize_int8(copy.deepcopy(tiny_model_factory(arch)))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    engine = HFEngine(model)
    cache = SuffixCache(max_depth=24)
    drafter = SuffixDrafter(cache, tree=tree, min_token_prob=0.05)
    decoder = SpeculativeDecoder(engine, drafter, FixedController(6))
    accepted = 0
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        reference = plain_greedy(engine, prompt, 40)
        if tree:
            seed_divergent_outputs(cache, reference, seed)
        for _ in range(2):  # the second pass drafts the whole answer from the global tree
            result = decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[])
            assert result.token_ids == reference
            accepted += result.stats.spec_num_correct_drafts
    assert accepted > 0
