"""Named speculation setups: one place that says what "suffix", "hybrid", ... mean.

The CLI and the benchmarks build their decoders here, so a drafter name means the
same drafter, controller and budgets everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from thinkahead.token_spec.names import (
    DRAFTER_KINDS, HEAD_KIND, MAX_DRAFT, MODEL_DRAFT_KINDS, MODEL_FREE_KINDS, check_drafter,
)
from thinkahead.token_spec.drafters import (
    CombinedDrafter,
    DraftModelDrafter,
    HybridDrafter,
    PromptLookupDrafter,
    SuffixDrafter,
)
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.value_calibration import CalibratedDrafter

if TYPE_CHECKING:  # the decoder, its controllers and KV pool only where one is built: `simulate` needs none
    from thinkahead.token_spec.decoder import SpeculativeDecoder
    from thinkahead.token_spec.draft_head import DraftHead
    from thinkahead.token_spec.prefix_pool import KVPrefixPool

__all__ = ["DRAFTER_KINDS", "MODEL_FREE_KINDS", "build_decoder", "model_free_drafter"]

# A draft-model token costs a forward of the small model: a round drafts at most MODEL_DRAFT_TOKENS and
# ends after a token the small model gives less than MODEL_DRAFT_MIN_PROB; its output layer keeps the ids
# below MODEL_DRAFT_VOCAB and the context's (draft_vocab.py). Measured: docs/token_spec.md#draft-model.
MODEL_DRAFT_TOKENS = 8
MODEL_DRAFT_MIN_PROB = 0.8
MODEL_DRAFT_VOCAB = 32768
# hybrid, until both kinds of round are timed: the combined draft when its expected accepted tokens reach
# this, else the small model's (first turns of GSM8K chains of thought, 1.5B target, 0.5B draft: 2 -> 1.20x
# and 1.28x plain decoding, 8 -> 1.22x and 1.40x)
HYBRID_MIN_SCORE = 8.0


def model_free_drafter(kind: str, cache: SuffixCache | None = None):
    """The drafter a model-free kind names (what the decoder and the simulator both use)."""
    cache = cache if cache is not None else SuffixCache()
    if kind == "suffix":
        return SuffixDrafter(cache)
    if kind == "suffix-tree":
        return SuffixDrafter(cache, tree=True)
    if kind == "combined":
        return CombinedDrafter(cache)
    if kind == "prompt-lookup":
        return PromptLookupDrafter()
    if kind == "prompt-lookup-recent":
        return PromptLookupDrafter(prefer="last")
    raise ValueError(f"unknown model-free drafter {kind!r}; expected one of {', '.join(MODEL_FREE_KINDS)}")


def small_model_drafter(engine) -> DraftModelDrafter:
    """The draft-model drafter over `engine` (the small model's) with the settings above."""
    return DraftModelDrafter(engine, vocab=MODEL_DRAFT_VOCAB, min_prob=MODEL_DRAFT_MIN_PROB)


def build_decoder(
    kind: str,
    engine,
    *,
    tokenizer=None,
    draft_engine=None,
    cache: SuffixCache | None = None,
    max_draft: int = MAX_DRAFT,
    prefix_pool: KVPrefixPool | None = None,
    draft_head: DraftHead | None = None,
) -> SpeculativeDecoder:
    """A `SpeculativeDecoder` for drafter `kind` over `engine` (the target model).

    `draft_engine` is the small model's engine, needed by "draft-model" and "hybrid";
    `cache` is the shared suffix cache (a fresh one if None); `prefix_pool` lets prompts that
    extend an earlier one reuse its KV; `draft_head` is the target's trained head, needed by "head".
    """
    from thinkahead.token_spec.controller import AdaptiveController, FixedController, MatchLengthController
    from thinkahead.token_spec.decoder import SpeculativeDecoder

    check_drafter(kind)
    if kind in MODEL_DRAFT_KINDS and draft_engine is None:
        raise ValueError(f"drafter {kind!r} needs a draft model engine")
    if kind == HEAD_KIND and draft_head is None:
        raise ValueError(f"drafter {kind!r} needs a draft head trained for the model")
    cache = cache if cache is not None else SuffixCache()
    if kind == "suffix-tree":  # SuffixDecoding as published: the draft length follows the match length
        drafter, controller = model_free_drafter(kind, cache), MatchLengthController(max_draft)
    elif kind in MODEL_FREE_KINDS:
        # calibrated worths: the decoder and the scheduler keep the rows that pay (goodput per row; 1.5B, 1-16 copy
        # streams: 0.99-1.06x the best fixed draft length, where chains sized by an acceptance rate gave 0.92-1.00x:
        # docs/results/goodput_sweep.md)
        drafter, controller = CalibratedDrafter(model_free_drafter(kind, cache)), AdaptiveController(max_draft)
    elif kind == "draft-model":
        drafter = small_model_drafter(draft_engine)
        controller = FixedController(min(max_draft, MODEL_DRAFT_TOKENS))
    elif kind == HEAD_KIND:
        from thinkahead.token_spec.head_drafter import HeadDrafter

        model = engine.model
        drafter = HeadDrafter(draft_head, model.get_input_embeddings(), model.get_output_embeddings(),
                              engine.vocab_size, CombinedDrafter(cache))
        controller = AdaptiveController(max_draft)
    elif kind == "hybrid":
        drafter = HybridDrafter(CombinedDrafter(cache), small_model_drafter(draft_engine), min_score=HYBRID_MIN_SCORE,
                                model_max_tokens=MODEL_DRAFT_TOKENS)
        controller = AdaptiveController(max_draft)
    else:
        drafter, controller = None, FixedController(0)
    return SpeculativeDecoder(engine, drafter, controller, tokenizer=tokenizer, prefix_pool=prefix_pool)
