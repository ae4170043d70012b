"""Grammar-constrained decoding inside the speculative decoder: valid outputs, exactness, sampling,
forced drafts, pruning and bad grammars (tiny random models with a byte-level BPE tokenizer)."""

from __future__ import annotations

import json
import time
from collections import Counter

import jsonschema
import pytest
import torch

from thinkahead.token_spec.constrained import grammar_draft, prune, row_masks
from thinkahead.token_spec.controller import FixedController
from thinkahead.token_spec.decoder import SpeculativeDecoder
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.drafters import PromptLookupDrafter, SuffixDrafter
from thinkahead.token_spec.grammar import GrammarError, GrammarSpec, TokenGrammar
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.verify import SamplingParams

from tests.test_sampling_is_lossless import chi2_pvalue, P_MIN
from tests.tiny_models import ARCHS, VOCAB, byte_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "ab": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 3}},
    "required": ["name", "ab", "ok", "tags"], "additionalProperties": False}
EXAMPLE = '{"name": "ab", "ab": 12, "ok": true, "tags": ["x"]}'


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def grammars(tok):
    return TokenGrammar(tok, VOCAB, stop_ids=[tok.eos_token_id])


class Scripted:
    """A model-free drafter that proposes a fixed chain (or tree) every round."""

    name = "scripted"
    model_free = True

    def __init__(self, tokens: list[int], parents: list[int] | None = None) -> None:
        self.tokens, self.parents = tokens, parents

    def start(self, rid, prompt, params, session_id=None):
        pass

    def propose(self, rid, context, budget):
        if self.parents is None:
            return Draft.chain(self.tokens[:budget])
        return Draft(list(self.tokens), list(self.parents), [1.0] * len(self.tokens)).truncated(budget)

    def observe(self, rid, accepted, proposed):
        pass

    def finish(self, rid):
        pass


def _decode(engine, tok, drafter, spec, grammars, prompt, **kw):
    decoder = SpeculativeDecoder(engine, drafter, FixedController(8) if drafter is not None else FixedController(0),
                                 tokenizer=tok)
    return decoder.generate(prompt, kw.pop("max_new_tokens", 120), stop_token_ids=[tok.eos_token_id],
                            constraint=grammars.constraint(spec), **kw)


def _prompt(tok) -> list[int]:
    return tok.encode(f"w {EXAMPLE} {EXAMPLE} then")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["none", "prompt-lookup", "suffix", "suffix-tree", "scripted"])
def test_greedy_under_a_schema_is_valid_and_equals_plain_greedy(arch, kind, tiny_engine_factory, tok, grammars):
    engine = tiny_engine_factory(arch)
    spec = GrammarSpec.json_schema(SCHEMA)
    prompt = _prompt(tok)
    plain = _decode(engine, tok, None, spec, grammars, prompt)
    drafter = {"none": None, "prompt-lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(SuffixCache()),
               "suffix-tree": SuffixDrafter(SuffixCache(), tree=True),
               # mostly tokens the grammar forbids: pruned before the verify pass
               "scripted": Scripted(tok.encode('{"name": "zz"}}}') + [5, 6, 7])}[kind]
    out = _decode(engine, tok, drafter, spec, grammars, prompt)
    assert out.token_ids == plain.token_ids
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    jsonschema.validate(json.loads(out.text), SCHEMA)
    if kind != "none":
        assert out.stats.grammar_forced_drafts > 0  # '{"name": "' and the other keys are forced


def test_the_grammar_changes_what_an_unconstrained_model_writes(tiny_engine_factory, tok, grammars):
    engine = tiny_engine_factory("llama")
    free = SpeculativeDecoder(engine, None, FixedController(0), tokenizer=tok).generate(_prompt(tok), 40)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)
    regex = _decode(engine, tok, PromptLookupDrafter(), GrammarSpec.regex(r"(ab|ba)+ c"), grammars, _prompt(tok))
    assert regex.finish_reason == "stop"
    text = regex.text
    assert text.endswith(" c") and set(text[:-2]) <= {"a", "b"} and len(text[:-2]) % 2 == 0


def test_prune_keeps_the_grammatical_part_of_chains_and_trees(tok, grammars):
    c = grammars.constraint(GrammarSpec.json_schema(SCHEMA))
    good = tok.encode('{"name": "a"')
    chain = Draft.chain(good + tok.encode("}") + good)  # "ab", "ok" and "tags" are required before the "}"
    assert prune(c, chain).token_ids == good
    # a tree: root '{"' with children 'name' (good) and 'x' (bad); below 'name' one good and one bad node
    brace, name, colon = tok.encode('{"')[0], tok.encode("name")[0], tok.encode('":')[0]
    x = tok.encode("x")[0]
    tree = Draft([brace, name, x, colon, x], [-1, 0, 0, 1, 1], [1.0] * 5)
    kept = prune(c, tree)
    assert kept.token_ids == [brace, name, colon] and kept.parents == [-1, 0, 1]
    assert c.consumed == 0  # pruning takes nothing


def test_row_masks_follow_each_path_and_roll_back(tok, grammars):
    c = grammars.constraint(GrammarSpec.json_schema(SCHEMA))
    before = c.mask()
    draft = Draft.chain(tok.encode('{"name": "'))
    masks = row_masks(c, draft)
    assert masks.shape == (len(draft) + 1, VOCAB)
    assert torch.equal(masks[0], before) and torch.equal(c.mask(), before) and c.consumed == 0
    for i, t in enumerate(draft.token_ids):
        assert masks[i, t]  # each draft token is allowed where it stands
    assert not masks[0, tok.eos_token_id]  # an empty output cannot end
    c.advance(tok.encode(EXAMPLE))
    assert c.accepting and c.mask()[tok.eos_token_id] and int(c.mask().sum()) == 1


def test_forced_tokens_go_first_and_the_drafter_follows(tok, grammars):
    c = grammars.constraint(GrammarSpec.json_schema(SCHEMA))
    c.advance(tok.encode('{"name": "ab", "ab": 12'))
    seen = {}

    def propose(forced, n):
        seen["forced"] = forced
        return Draft.chain(tok.encode("true, false"))  # the grammar takes "true, ", then refuses "false"

    draft, forced = grammar_draft(c, 30, propose, 8)
    assert tok.decode(seen["forced"]) == ', "ok": '
    assert forced == len(seen["forced"]) and tok.decode(draft.token_ids) == ', "ok": true, '
    assert c.consumed == len(tok.encode('{"name": "ab", "ab": 12'))


def test_sampling_follows_the_masked_distribution(tiny_engine_factory, tok, grammars):
    """Two tokens from [abc][abc] (chars that never merge): their sampled frequencies with a drafter
    proposing a mix of allowed and forbidden tokens match the masked target distribution."""
    engine = tiny_engine_factory("qwen2")
    spec = GrammarSpec.regex("[cde][cde]")
    prompt = tok.encode("w c d e")
    ids = {ch: tok.encode(ch)[0] for ch in "cde"}
    allowed = torch.tensor(list(ids.values()))

    def probs_after(context):
        session = engine.new_session()
        logits = engine.forward(session, context, last_only=True)[-1].float()
        p = torch.zeros_like(logits)
        p[allowed] = torch.softmax(logits[allowed], dim=-1)
        return p

    p1 = probs_after(prompt)
    expected = {}
    for a in "cde":
        p2 = probs_after(prompt + [ids[a]])
        for b in "cde":
            expected[a + b] = float(p1[ids[a]] * p2[ids[b]])
    drafter = Scripted([ids["d"], ids["d"], 7, ids["c"]], [-1, 0, 0, -1])  # a tree: forbidden token 7 is pruned
    decoder = SpeculativeDecoder(engine, drafter, FixedController(4), tokenizer=tok)
    n, counts = 600, Counter()
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        out = decoder.generate(prompt, 5, sampling=SamplingParams(temperature=1.0), stop_token_ids=[tok.eos_token_id],
                               seed=int(torch.randint(0, 2**31, (1,), generator=gen)),
                               constraint=grammars.constraint(spec))
        counts[out.text] += 1
    assert chi2_pvalue(counts, expected, n) > P_MIN


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec.regex("(a|b", field="regex"), "unclosed group"),
    (GrammarSpec.regex("a^b"), "lookaround"),
    (GrammarSpec.regex(r"[^\s\S]x"), "matches no output"),
    (GrammarSpec.json_schema({"type": "object", "if": {"type": "object"}}, field="response_format.json_schema"),
     "Unimplemented"),
    (GrammarSpec.json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
     "matches no output"),
    (GrammarSpec.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable"),
    (GrammarSpec.json_schema({"properties": {"a": {"$ref": "#/nope"}}, "type": "object"}), "does not exist"),
    (GrammarSpec.lark("start: foo"), "foo"),
])
def test_bad_grammars_are_refused_by_field(spec, words, grammars):
    with pytest.raises(GrammarError, match=words) as info:
        grammars.compile(spec)
    assert str(info.value).startswith(f"{spec.field}: ")


def test_compiling_is_bounded_and_cached(grammars):
    huge = GrammarSpec.regex("(a|aa|aaa){1,500}x{1000000}(b|bb)*" * 20)
    t0 = time.perf_counter()
    try:  # llguidance builds its lexer lazily within its fuel limits: either way, no hang
        grammars.constraint(huge).mask()
    except (GrammarError, ValueError):
        pass
    assert time.perf_counter() - t0 < 30
    with pytest.raises(GrammarError, match="characters"):
        GrammarSpec.regex("a" * 300_000)
    spec = GrammarSpec.json_schema(SCHEMA)
    first = grammars.compile(spec)
    assert grammars.compile(GrammarSpec.json_schema(dict(SCHEMA))) is first


def test_a_committed_token_the_grammar_refuses_raises(tok, grammars):
    c = grammars.constraint(GrammarSpec.json_schema(SCHEMA))
    with pytest.raises(ValueError, match="refused"):
        c.advance(tok.encode("}"))
    with pytest.raises(ValueError, match="roll back"):
        grammars.constraint(GrammarSpec.json_schema(SCHEMA)).rollback(1)


def test_lazy_greedy_verification_equals_greedy_on_fully_masked_rows(tok, grammars):
    """The decoder's greedy verification computes masks only on the rows it reaches; on random logits
    (ties included) over chains and trees it accepts what `verify_greedy` accepts on rows masked in
    full, and leaves the grammar where it was. (llguidance's mask is stricter than its token check:
    after `{"name` the mask allows `":` but not `"`, which `validate_tokens` takes; the walk follows
    the mask.)"""
    from thinkahead.token_spec.constrained import masked, verify_greedy_constrained
    from thinkahead.token_spec.verify import verify_greedy

    spec = GrammarSpec.json_schema(SCHEMA)
    g = torch.Generator().manual_seed(1)
    texts = ['{"name": "ab", "ab": 1', '{"name": "', '{"name": "ab", "ab": 12, "ok": true, "tags": []}']
    for trial in range(60):
        c = grammars.constraint(spec)
        head = tok.encode(texts[trial % len(texts)])
        c.advance(head[: trial % len(head) + 1])
        good = tok.encode(texts[trial % len(texts)])[trial % len(head) + 1:][:5] + [tok.eos_token_id]
        if trial % 2:
            draft = prune(c, Draft.chain(good))
        else:  # a tree: the good chain plus a sibling at each depth
            tokens, parents = [], []
            for i, t in enumerate(good[:4]):
                parents += [2 * i - 2 if i else -1] * 2
                tokens += [t, int(torch.randint(3, VOCAB, (1,), generator=g))]
            draft = prune(c, Draft(tokens, parents, [1.0] * len(tokens)))
        logits = torch.randn(len(draft) + 1, VOCAB, generator=g).round()  # rounding makes ties
        for r in range(len(draft)):  # most draft tokens made their row's argmax
            if int(torch.randint(0, 3, (1,), generator=g)):
                logits[draft.parents[r] + 1, draft.token_ids[r]] += 6.0
        full = verify_greedy(masked(logits, row_masks(c, draft)), draft)
        lazy = verify_greedy_constrained(logits, draft, c)
        stopped = [i for i in full.accepted if draft.token_ids[i] in c.stop_ids]
        if stopped:  # the lazy walk hands a stop token back as the bonus; the tokens are the same
            k = full.accepted.index(stopped[0])
            assert lazy.accepted == full.accepted[:k] and lazy.bonus == draft.token_ids[stopped[0]]
        else:
            assert (lazy.accepted, lazy.bonus) == (full.accepted, full.bonus)
        assert c.consumed == trial % len(head) + 1
