"""The draft head (token_spec/draft_head.py, head_drafter.py): its file, the hidden state the decoder hands it after
each round, when it drafts and when its inner drafter does, and exactness: greedy output with head drafts equals
plain greedy output, alone, in a batch, and through `LocalModel`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct

import pytest
import torch

pytest.importorskip("thinkahead.models.engine.kernels._layer_native")
pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.base import GenerationRequest
from thinkahead.models.engine.scheduler import BatchScheduler
from thinkahead.models.engine.weights import gguf_native
from thinkahead.models.local import LocalModel
from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.draft_head import DraftHead, find_head
from thinkahead.token_spec.head_drafter import HeadDrafter
from thinkahead.token_spec.names import HEAD_SOURCE
from thinkahead.token_spec.presets import build_decoder
from thinkahead.token_spec.verify import SamplingParams

from tests.test_gguf_native import HIDDEN, tiny_config, tiny_gguf  # noqa: F401 (fixture)
from tests.test_ragged_batch import engine  # noqa: F401 (fixture: the tiny GGUF model's engine, batching rows)
from tests.tiny_models import VOCAB, byte_tokenizer


def a_head(seed: int = 0, vocab: int = VOCAB // 2) -> DraftHead:
    """A random head over the first `vocab` ids (the rest reach it only from the context)."""
    torch.manual_seed(seed)
    head = DraftHead(HIDDEN, 16, vocab, model="tiny")
    torch.nn.init.normal_(head.up.weight, std=0.05)
    return head.eval()


def prompt(seed: int, n: int) -> list[int]:
    motif = [(seed * 11 + 5 * i) % (VOCAB - 3) + 3 for i in range(7)]
    return (motif * (n // 7 + 1))[:n]


# ------------------------------------------------------------------ the file


def test_a_head_file_round_trips_and_reading_it_leaves_it_as_it_was(tmp_path) -> None:
    head, path = a_head(), tmp_path / "head.safetensors"
    head.save(path)
    before = path.read_bytes()
    again = DraftHead.load(path, hidden_size=HIDDEN)
    assert path.read_bytes() == before
    assert (again.hidden_size, again.width, again.vocab, again.model) == (HIDDEN, 16, VOCAB // 2, "tiny")
    h, e = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    with torch.no_grad():  # saved in float16: the same layer to float16's precision
        torch.testing.assert_close(again(h, e), head(h, e), atol=2e-3, rtol=2e-3)


def _safetensors(path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=meta)


def test_files_that_are_not_a_fitting_head_are_refused_by_name(tmp_path) -> None:
    good = tmp_path / "good.safetensors"
    a_head().save(good)
    tensors = {k: v.half() for k, v in a_head().state_dict().items()}
    meta = {"format": "thinkahead-draft-head", "version": "1", "hidden_size": str(HIDDEN), "width": "16",
            "vocab": str(VOCAB // 2)}
    cases = {
        "cannot be read": lambda p: p.write_bytes(b"not a tensor file at all"),
        "not a draft head file": lambda p: _safetensors(p, {**meta, "format": "other"}, tensors),
        "version '9'": lambda p: _safetensors(p, {**meta, "version": "9"}, tensors),
        "lacks integer": lambda p: _safetensors(p, {k: v for k, v in meta.items() if k != "width"}, tensors),
        "do not fit its sizes": lambda p: _safetensors(p, {**meta, "width": "8"}, tensors),
    }
    for message, write in cases.items():
        path = tmp_path / f"bad-{len(message)}.safetensors"
        write(path)
        with pytest.raises(ValueError, match=message) as err:
            DraftHead.load(path)
        assert str(path) in str(err.value)
    with pytest.raises(ValueError, match=f"made for hidden size {HIDDEN}, the model's is 64"):
        DraftHead.load(good, hidden_size=64)
    with pytest.raises(ValueError, match="hidden size 256: m's is 64"):
        find_head(a_head(), None, 64, "m")
    with pytest.raises(ValueError, match="needs a draft head trained for m; packaged for: "):
        find_head(None, "gguf:/somewhere/else.gguf", HIDDEN, "m")
    with pytest.raises(ValueError, match="hidden_size, width and vocab must be >= 1"):
        DraftHead(HIDDEN, 0, 10)
    assert struct.unpack("<Q", good.read_bytes()[:8])[0] > 0  # the good file stayed a safetensors file


# ------------------------------------------------------------------ the hidden states and the choice of draft


class Recording(HeadDrafter):
    """A head drafter that keeps what it is told (and what it drafted)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.told: list[tuple[torch.Tensor, int]] = []
        self.drafts: list[Draft] = []

    def observe_hidden(self, rid, hidden, at) -> None:
        self.told.append((hidden, at))
        super().observe_hidden(rid, hidden, at)

    def propose_rounds(self, rid, context, budget):
        draft = yield from super().propose_rounds(rid, context, budget)
        self.drafts.append(draft)
        return draft


def head_decoder(engine, head: DraftHead, recording: bool = False):
    decoder = build_decoder("head", engine, draft_head=head)
    if recording:
        old = decoder.drafter
        decoder.drafter = Recording(head, old.embed, old.vocab.head, engine.vocab_size, old.inner)
    return decoder


def test_after_each_round_the_drafter_gets_the_hidden_state_that_chose_the_last_token(engine) -> None:
    decoder = head_decoder(engine, a_head(), recording=True)
    p = prompt(3, 30)
    out = decoder.generate(p, 40, stop_token_ids=[]).token_ids
    tokens = p + out
    told = decoder.drafter.told
    assert told[0][1] == len(p)  # after the prompt: the row before its last token
    rounds = [(h, at) for h, at in told if at > len(p)]
    assert len(rounds) >= 10
    lm_head = engine.model.lm_head
    with torch.inference_mode():
        chose = [int(lm_head(h[None]).argmax()) for h, _ in rounds]
    assert chose == [tokens[at - 1] for _, at in rounds]  # greedy: the row whose logits chose token at - 1
    assert sum(d.source == HEAD_SOURCE for d in decoder.drafter.drafts) >= 5


class Fixed:
    """An inner drafter that drafts what it is given."""

    model_free = True
    name = "fixed"

    def __init__(self) -> None:
        self.draft = Draft()

    def start(self, rid, prompt_ids, params, session_id=None) -> None: ...

    def propose(self, rid, context, budget) -> Draft:
        return self.draft

    def observe(self, rid, accepted, proposed) -> None: ...

    def finish(self, rid) -> None: ...


def test_the_head_drafts_only_with_a_hidden_state_for_this_context_and_defers_to_long_or_agreeing_matches(engine):
    inner = Fixed()
    model = engine.model
    drafter = HeadDrafter(a_head(), model.get_input_embeddings(), model.lm_head, VOCAB, inner, long_match=8)
    context = prompt(1, 20)
    drafter.start("r", context, SamplingParams())
    inner.draft = Draft.chain([7, 8], match_len=3)
    assert drafter.propose("r", context, 4) == inner.draft  # no hidden state yet
    drafter.observe_hidden("r", torch.randn(HIDDEN), len(context) - 1)
    assert drafter.propose("r", context, 4) == inner.draft  # one for another context (tokens a grammar forced)
    drafter.observe_hidden("r", torch.randn(HIDDEN), len(context))
    assert drafter.propose("r", context, 0) == inner.draft  # no budget
    inner.draft = Draft()  # nothing from the inner drafter: the head's chain alone
    own = drafter.propose("r", context, 4)
    assert own.source == HEAD_SOURCE and 1 <= len(own) <= 4 and own.is_chain
    assert all(0 <= t < VOCAB for t in own.token_ids) and own.probs[0] > 0
    inner.draft = Draft.chain([(own.token_ids[0] + 1) % VOCAB, 9], match_len=8)
    assert drafter.propose("r", context, 4) == inner.draft  # a long match: copied text, the head is not asked
    assert all(1 >= a >= b > 0 for a, b in zip(own.probs, own.probs[1:]))  # the chance its chain holds that far
    inner.draft = Draft()
    torch.manual_seed(3)  # a hidden state scaled until the head is sure of its guesses
    drafter.observe_hidden("r", 60 * torch.randn(HIDDEN), len(context))
    sure = drafter.propose("r", context, 4)
    token = sure.token_ids[0]
    assert len(sure) == 4 and sure.probs[-1] > 0.9
    other = (token + 1) % VOCAB
    inner.draft = Draft.chain([other, 9], [0.6, 0.5], match_len=3)  # less sure than the head: merged after it
    both = drafter.propose("r", context, 5)
    assert both.token_ids == sure.token_ids + [other] and both.parents == sure.parents + [-1]
    assert both.source == HEAD_SOURCE
    assert all(a >= b for a, b in zip(both.probs, both.probs[1:]))  # the worthiest first: rows are cut from the end
    inner.draft = Draft.chain([token, 9], [0.5, 0.4], match_len=2)
    agreed = drafter.propose("r", context, 2)  # the same first token: one node, both chances combined
    assert agreed.token_ids[0] == token and agreed.probs[0] == pytest.approx(1 - 0.5 * (1 - sure.probs[0]))
    inner.draft = Draft.chain([other] * 6, [0.99] * 6, match_len=3)
    assert drafter.propose("r", context, 6) == inner.draft  # it expects more than the head's whole chain can give
    drafter.observe_hidden("r", torch.randn(HIDDEN), len(context))  # an unsure head again
    unsure = Draft(token_ids=[other], parents=[-1], probs=[0.99], match_len=1)
    inner.draft = unsure
    assert drafter.propose("r", context, 1).source == unsure.source  # the inner draft won the only place
    drafter.finish("r")
    assert drafter.propose("r", context, 4) == inner.draft  # a finished request is forgotten
    with pytest.raises(ValueError, match="depth >= 1"):
        HeadDrafter(a_head(), model.get_input_embeddings(), model.lm_head, VOCAB, inner, depth=0)


# ------------------------------------------------------------------ exactness


def test_greedy_output_with_head_drafts_equals_plain_greedy_alone_and_in_a_batch(engine) -> None:
    jobs = [(prompt(s, 10 + 7 * s), 24 + 5 * s) for s in range(6)]
    expected = [plain_greedy(engine, p, n) for p, n in jobs]
    decoder = head_decoder(engine, a_head(1), recording=True)
    alone = [decoder.generate(p, n, stop_token_ids=[]) for p, n in jobs]
    assert [r.token_ids for r in alone] == expected
    assert sum(d.source == HEAD_SOURCE for d in decoder.drafter.drafts) >= 10
    decoder.drafter.drafts.clear()
    guesses, real = [], decoder.drafter.engine.forward_batch
    decoder.drafter.engine.forward_batch = lambda calls: guesses.append(len(calls)) or real(calls)
    # every sequence asks the head every round (no goodput plan, no adaptive budget: a random head's drafts would
    # win them no room), so all wait for their guesses at once, whatever the machine's timing
    scheduler = BatchScheduler(engine, prefill_chunk=8, goodput=False)
    decoder.drafter.long_match = 10**9  # the prompts repeat a motif: copies of it would skip the head
    batched = SpeculativeDecoder(engine, decoder.drafter, FixedController(2))
    futures = [scheduler.submit(lambda p=p, n=n: batched.rounds(p, n, stop_token_ids=[], share=scheduler.share()))
               for p, n in jobs]
    results = [f.result(timeout=60) for f in futures]
    scheduler.close()
    assert [r.token_ids for r in results] == expected
    assert scheduler.peak_batch >= 4
    assert sum(d.source == HEAD_SOURCE for d in decoder.drafter.drafts) >= 4  # from the batch's hidden states
    assert max(guesses) >= 2, (guesses, scheduler.peak_batch)  # the sequences' head guesses ran together, one pass for all


def test_a_local_model_drafts_with_the_head_it_is_given_and_answers_as_plain_greedy(tiny_gguf, tmp_path) -> None:
    path = tmp_path / "tiny-head.safetensors"
    a_head(2).save(path)
    build = lambda drafter, **kw: LocalModel(model=gguf_native.build_model(tiny_gguf[0], tiny_config()),  # noqa: E731
                                              tokenizer=byte_tokenizer(), drafter=drafter, name="tiny", **kw)
    with_head, plain = build("head", head=path), build("none")
    assert build("auto", head=path).drafter == "head" and build("auto").drafter == "combined"  # auto: a head if any
    requests = [GenerationRequest(prompt=f"Count: {i} {i} {i} {i}", max_new_tokens=20, temperature=0, stop=[])
                for i in range(4)]

    async def together(model):
        return await asyncio.gather(*(model.generate(r) for r in requests))

    got, want = asyncio.run(together(with_head)), asyncio.run(together(plain))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert json.dumps([c.text for c in got]) == json.dumps([c.text for c in want])
    drafted = [c.spec for c in got if c.spec.head_drafts]
    assert drafted and all(0 <= s.head_correct_drafts <= s.head_drafts <= s.spec_num_proposed_drafts for s in drafted)
    assert drafted[0].counters()["head_drafts"] == drafted[0].head_drafts
    assert "head_drafts" not in want[0].spec.counters()  # only where the head drafted
    with pytest.raises(ValueError, match="needs a draft head trained for the model"):
        build("head")


@pytest.mark.slow
def test_the_packaged_head_of_the_real_15b_drafts_tokens_that_hold_and_changes_no_token() -> None:
    from thinkahead.evals.data import gsm8k

    model = LocalModel("qwen2.5-coder-1.5b", dtype="gguf", drafter="head")
    question = gsm8k("test")[400]["question"] + "\n\nPut the final answer in \\boxed{}."
    request = GenerationRequest(messages=[{"role": "user", "content": question}], max_new_tokens=96, temperature=0)
    drafted = model.generate_sync(request)
    plain = model.generate_sync(dataclasses.replace(request, speculative=False))
    assert drafted.token_ids == plain.token_ids
    spec = drafted.spec
    # a chain of thought the head was not trained on: most rounds are its, and it is right far more often than not
    assert spec.head_drafts >= spec.spec_num_proposed_drafts / 2
    assert spec.spec_accept_length >= 1.4, spec


def test_a_round_without_room_probes_with_the_free_inner_draft_not_the_head(engine) -> None:
    """A probe (a draft checked, not verified) is free to ask of `combined`; a head guess asked there ran outside any
    batch, one pass over the output rows per sequence and round (8 streams: 983 lone passes, 2.6 s of 20)."""
    drafter = head_decoder(engine, a_head(3)).drafter
    passes, real = [], drafter.engine.forward_batch
    drafter.engine.forward_batch = lambda calls: passes.append(len(calls)) or real(calls)
    decoder = SpeculativeDecoder(engine, drafter, FixedController(0))
    p = prompt(5, 30)
    result = decoder.generate(p, 30, stop_token_ids=[])
    assert result.token_ids == plain_greedy(engine, p, 30)
    assert result.stats.spec_num_proposed_drafts == 0 and passes == []
