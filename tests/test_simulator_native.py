"""The native verify rounds (token_spec/native_rounds.py) give the Python loop's counts, turn by turn.

Twin drafters replay the same sessions: one through `simulator.verify_rounds` (propose / observe
per round, the reference), one through the extension's `replay_*` (a whole turn per call). Every
turn's (verify steps, proposed, accepted) must agree, and so must what the rounds leave behind
(the combined drafter's rate estimates, the caches' trees, the n-gram indexes' tokens). The
committed agent recordings are replayed in full, and random sessions cover the corners.
"""

from __future__ import annotations

from pathlib import Path
import random

import pytest

from thinkahead.token_spec import suffix_impl
from thinkahead.token_spec.presets import model_free_drafter
from thinkahead.token_spec.recording import read_sessions
from thinkahead.token_spec.simulator import Turn, replay_sessions, verify_rounds
from thinkahead.token_spec.suffix_cache import SuffixCache
from thinkahead.token_spec.verify import SamplingParams

pytestmark = pytest.mark.skipif(suffix_impl.native_module() is None, reason="the native extension is not built")

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
# The recordings `thinkahead simulate` replays in bench/simulate_e2e.py (one model's generations).
RECORDINGS = ("tools-bfcl-20/tokens.jsonl", "agentic-refine/tokens-speculative-run.jsonl",
              "agentic-codefix/tokens.jsonl", "react-gsm8k/tokens.jsonl")
MODEL = "qwen2.5-coder-1.5b"
KINDS = ("suffix", "suffix-tree", "prompt-lookup", "prompt-lookup-recent", "combined")


def recorded_sessions() -> list[list[Turn]]:
    sessions: list[list[Turn]] = []
    for name in RECORDINGS:
        sessions.extend(read_sessions(RESULTS / name, MODEL))
    return sessions


def drafter(kind: str, impl: str):
    return model_free_drafter(kind, SuffixCache(tree_impl=impl))


def twin_turns(kind: str, sessions: list[list[Turn]], max_tokens: int, reference_impl: str = "native"):
    """Per turn, (reference counts, native counts); then both drafters."""
    from thinkahead.token_spec.native_rounds import rounds_for

    ref, fast = drafter(kind, reference_impl), drafter(kind, "native")
    rounds = rounds_for(fast)
    assert rounds is not None, kind
    params = SamplingParams()
    out = []
    for s, session in enumerate(sessions):
        for t, turn in enumerate(session):
            rid = (s, t)
            ref.start(rid, list(turn.prompt_ids), params, session_id=s)
            fast.start(rid, list(turn.prompt_ids), params, session_id=s)
            want = verify_rounds(lambda ctx, rid=rid: ref.propose(rid, ctx, max_tokens),
                                 lambda new, d, rid=rid: ref.observe(rid, new, d),
                                 list(turn.prompt_ids), list(turn.output_ids), [], [])
            got = rounds(rid, list(turn.output_ids), max_tokens)
            out.append((want, tuple(got)))
            ref.finish(rid)
            fast.finish(rid)
    return out, ref, fast


def rate_state(d) -> tuple:
    pooled = {k: (r.hits, r.tries) for k, r in d.pooled.items()}
    sessions = {key: {k: (r.hits, r.tries) for k, r in rates.items()} for key, rates in d._rates.items()}
    return pooled, sessions


def cache_state(cache: SuffixCache) -> tuple:
    return ([cache.global_tree.tokens(seq) for seq in cache._cached.values()],
            [suffix_impl.tokens_from(s.tree, 0) for s in cache._sessions.values()])


@pytest.mark.parametrize("kind", KINDS)
def test_recorded_sessions_give_the_same_counts_every_turn(kind: str) -> None:
    turns, ref, fast = twin_turns(kind, recorded_sessions(), max_tokens=16)
    assert len(turns) == 136
    for i, (want, got) in enumerate(turns):
        assert got == want, (kind, i)
    if kind == "combined":
        assert rate_state(fast) == rate_state(ref)
    if kind.startswith("prompt-lookup"):
        assert fast._sessions.keys() == ref._sessions.keys()
        assert [t for t, _ in fast._sessions.values()] == [t for t, _ in ref._sessions.values()]
    else:
        assert cache_state(fast.cache) == cache_state(ref.cache)


@pytest.mark.parametrize("kind", ("suffix", "suffix-tree", "combined"))
def test_native_rounds_match_the_python_tree(kind: str) -> None:
    """Against the pure-Python tree and the Python loop: the reference the printed numbers come from."""
    sessions = recorded_sessions()[-12:]  # the python tree is slow: the last recordings' sessions
    turns, ref, fast = twin_turns(kind, sessions, max_tokens=16, reference_impl="python")
    assert [got for _, got in turns] == [want for want, _ in turns]
    if kind == "combined":
        assert rate_state(fast) == rate_state(ref)


def random_sessions(rng: random.Random, vocab: int) -> list[list[Turn]]:
    """Sessions whose turns mostly extend the conversation, with repeats to draft from (and some edits)."""
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    sessions = []
    for _ in range(rng.randint(2, 5)):
        history: list[int] = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        turns = []
        for _ in range(rng.randint(1, 4)):
            output: list[int] = []
            while len(output) < rng.randint(0, 40):
                output += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(vocab)]
            turns.append(Turn(list(history), output))
            if rng.random() < 0.15:
                history = history[: rng.randint(1, len(history))]  # an edited history: a rebuild
            else:
                history = history + output + [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        sessions.append(turns)
    return sessions


@pytest.mark.parametrize("kind", KINDS)
def test_random_sessions_give_the_same_counts(kind: str) -> None:
    rng = random.Random(hash(kind) % 1000)
    for trial in range(25):
        sessions = random_sessions(rng, vocab=rng.choice((3, 20, 1000)))
        max_tokens = rng.choice((0, 1, 2, 5, 16, 32))
        turns, ref, fast = twin_turns(kind, sessions, max_tokens)
        assert [got for _, got in turns] == [want for want, _ in turns], (kind, trial, max_tokens)
        if kind == "combined":
            assert rate_state(fast) == rate_state(ref)


def test_replay_sessions_with_native_rounds_prints_the_same_numbers() -> None:
    """What `thinkahead simulate` prints comes out the same with and without the native rounds."""
    sessions = recorded_sessions()
    for kind in KINDS:
        loop = replay_sessions(drafter(kind, "native"), sessions, max_tokens=16)
        fast = replay_sessions(drafter(kind, "native"), sessions, max_tokens=16, native_rounds=True)
        same = ("turns", "output_tokens", "verify_steps", "proposed_tokens", "accepted_tokens",
                "tokens_per_step_per_turn", "update_prompt_tokens", "update_new_tokens")
        assert {k: getattr(fast, k) for k in same} == {k: getattr(loop, k) for k in same}, kind
        assert fast.propose_s == [] and len(loop.propose_s) == loop.verify_steps


def test_drafters_the_extension_does_not_cover_run_the_python_loop() -> None:
    from thinkahead.token_spec.drafters import SuffixDrafter
    from thinkahead.token_spec.native_rounds import rounds_for

    class Custom(SuffixDrafter):
        pass

    assert rounds_for(Custom(SuffixCache(tree_impl="native"))) is None
    assert rounds_for(drafter("suffix", "python")) is None
    assert rounds_for(drafter("combined", "python")) is None
    sessions = random_sessions(random.Random(5), vocab=20)
    loop = replay_sessions(drafter("suffix", "python"), sessions, max_tokens=8)
    asked = replay_sessions(drafter("suffix", "python"), sessions, max_tokens=8, native_rounds=True)
    assert asked.verify_steps == loop.verify_steps and len(asked.propose_s) == asked.verify_steps


def test_bad_outputs_are_refused() -> None:
    native = suffix_impl.native_module()
    tree = native.SuffixTree(8)
    tree.extend(0, [1, 2, 3])
    with pytest.raises(ValueError):
        native.replay_suffix(tree, None, [1, -2], 4, 1.0, 0.0, 0.1, False)
    with pytest.raises(ValueError):
        native.replay_suffix(tree, None, [1, 2], -1, 1.0, 0.0, 0.1, False)
    with pytest.raises(ValueError):
        native.replay_suffix(tree, None, (1, 2), 4, 1.0, 0.0, 0.1, False)


@pytest.mark.parametrize("config", [
    {"sources": ("local", "recent"), "match_bands": ()},
    {"sources": ("global", "alt", "recent"), "decay": 0.8, "min_score": 0.05, "prior_weight": 1.0},
    {"max_spec_factor": 1.0, "max_spec_offset": 0.0, "alternatives": 0, "match_bands": (2, 8)},
])
def test_combined_drafters_of_other_configurations(config: dict) -> None:
    from thinkahead.token_spec.combined_drafter import CombinedDrafter
    from thinkahead.token_spec.native_rounds import rounds_for

    rng = random.Random(len(str(config)))
    params = SamplingParams()
    for trial in range(10):
        sessions = random_sessions(rng, vocab=rng.choice((3, 20)))
        ref = CombinedDrafter(SuffixCache(tree_impl="native"), **config)
        fast = CombinedDrafter(SuffixCache(tree_impl="native"), **config)
        rounds = rounds_for(fast)
        for s, session in enumerate(sessions):
            for t, turn in enumerate(session):
                rid = (s, t)
                ref.start(rid, list(turn.prompt_ids), params, session_id=s)
                fast.start(rid, list(turn.prompt_ids), params, session_id=s)
                want = verify_rounds(lambda ctx, rid=rid: ref.propose(rid, ctx, 12),
                                     lambda new, d, rid=rid: ref.observe(rid, new, d),
                                     list(turn.prompt_ids), list(turn.output_ids), [], [])
                assert tuple(rounds(rid, list(turn.output_ids), 12)) == want, (config, trial)
                ref.finish(rid)
                fast.finish(rid)
        assert rate_state(fast) == rate_state(ref)


class _Index:
    """An integer-like object that is not an int (as numpy's integers): converted through __index__."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_checked_tokens_fast_path_matches_the_loop() -> None:
    """Token checks take one C-level pass for integer lists; results and errors stay the loop's."""
    from thinkahead.token_spec.suffix_drafts import _checked_tokens

    assert _checked_tokens([3, _Index(7)], "ids") == [3, 7]
    with pytest.raises(ValueError, match="integer token ids, found a bool"):  # (array "q" takes True as 1)
        _checked_tokens([3, True, _Index(7)], "ids")
    assert all(type(t) is int for t in _checked_tokens((_Index(2), 5), "ids"))
    assert _checked_tokens([], "ids") == []
    assert _checked_tokens(iter([1, 2]), "ids") == [1, 2]  # an iterator is read once, by the loop
    with pytest.raises(ValueError, match="token ids below 2\\*\\*63, found 1180591620717411303424"):
        _checked_tokens([2**70], "ids")  # beyond 64 bits: refused (the native tree raised an OverflowError)
    with pytest.raises(ValueError, match="non-negative token ids, found -4"):
        _checked_tokens([1, -4, -2 + 1], "ids")
    with pytest.raises(ValueError, match="integer token ids, found 1.5"):
        _checked_tokens([0, 1.5], "ids")
    with pytest.raises(ValueError, match="not str"):
        _checked_tokens("12", "ids")


def test_prompt_lookup_appends_converted_ints() -> None:
    """PromptLookupDrafter keeps plain ints whatever the list holds (floats truncated by `int`, as before)."""
    from thinkahead.token_spec.drafters import PromptLookupDrafter
    from thinkahead.token_spec.verify import SamplingParams

    d = PromptLookupDrafter()
    d.start("r", [1, _Index(2), 3.0, True], SamplingParams())
    assert d._tokens["r"] == [1, 2, 3, 1] and all(type(t) is int for t in d._tokens["r"])


def test_native_run_does_not_import_the_python_tree() -> None:
    """The native tree's path (simulate, a server) never loads the Python tree's module (start-up time)."""
    import subprocess
    import sys

    code = ("import sys\nfrom thinkahead.token_spec.presets import model_free_drafter\n"
            "from thinkahead.token_spec.simulator import replay_sessions\n"
            "d = model_free_drafter('combined')\n"
            "replay_sessions(d, [[([1, 2, 3, 1, 2], [3, 1, 2])]], native_rounds=True)\n"
            "assert d.cache.tree_impl == 'native', d.cache.tree_impl\n"
            "print('thinkahead.token_spec.suffix_tree' in sys.modules, 'thinkahead.token_spec.suffix_persist' in sys.modules)")
    env = {**__import__("os").environ, "THINKAHEAD_SUFFIX_IMPL": "native"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


COUNTS = ("sessions", "turns", "extending_turns", "prompt_tokens", "new_prompt_tokens", "output_tokens",
          "verify_steps", "proposed_tokens", "accepted_tokens", "tokens_per_step_per_turn", "update_prompt_tokens",
          "update_new_tokens")


def shared_against_alone(kinds: tuple[str, ...], sessions: list[list[Turn]], max_tokens: int, **cache_args) -> None:
    """Replayed together over one cache, each drafter counts what it counts replayed alone over its own."""
    from thinkahead.token_spec.simulator import replay_sessions_shared

    cache = SuffixCache(tree_impl="native", **cache_args)
    together = [model_free_drafter(k, cache) for k in kinds]
    shared = replay_sessions_shared(together, sessions, max_tokens=max_tokens)
    assert shared is not None
    for kind, d, got in zip(kinds, together, shared):
        alone = model_free_drafter(kind, SuffixCache(tree_impl="native", **cache_args))
        want = replay_sessions(alone, sessions, max_tokens=max_tokens, native_rounds=True)
        assert {k: getattr(got, k) for k in COUNTS} == {k: getattr(want, k) for k in COUNTS}, (kind, max_tokens)
        if kind.startswith("prompt-lookup"):  # the first one's sessions serve all
            assert [t for t, _ in together[0]._sessions.values()] == [t for t, _ in alone._sessions.values()]
            continue
        assert cache_state(alone.cache) == cache_state(cache)
        if kind == "combined":  # (session ids differ from replay to replay: the rates compared in order)
            (pooled, by_session), (want_pooled, want_by_session) = rate_state(d), rate_state(alone)
            assert pooled == want_pooled and list(by_session.values()) == list(want_by_session.values())


def test_shared_replay_of_the_recordings_counts_as_one_replay_each() -> None:
    shared_against_alone(("suffix", "suffix-tree", "combined"), recorded_sessions(), max_tokens=16)
    shared_against_alone(("prompt-lookup", "prompt-lookup-recent"), recorded_sessions(), max_tokens=16)


@pytest.mark.parametrize("kinds", [("suffix", "suffix-tree", "combined"), ("combined", "suffix"),
                                   ("suffix-tree", "suffix"), ("suffix",),
                                   ("prompt-lookup-recent", "prompt-lookup"), ("prompt-lookup",)])
def test_shared_replay_of_random_sessions_counts_as_one_replay_each(kinds: tuple[str, ...]) -> None:
    rng = random.Random(len(kinds))
    for trial in range(15):
        sessions = random_sessions(rng, vocab=rng.choice((3, 20, 1000)))
        cache_args = rng.choice(({}, {"max_cached_requests": 2}, {"max_sessions": 1}, {"max_depth": 4}))
        shared_against_alone(kinds, sessions, rng.choice((0, 1, 2, 5, 16)), **cache_args)


def test_shared_replay_covers_one_native_cache_only() -> None:
    from thinkahead.token_spec.native_rounds import shared_rounds
    from thinkahead.token_spec.simulator import replay_sessions_shared

    native = SuffixCache(tree_impl="native")
    assert shared_rounds([model_free_drafter("suffix", native), model_free_drafter("combined", native)]) is not None
    assert shared_rounds([model_free_drafter("suffix", native), model_free_drafter("prompt-lookup")]) is None
    assert shared_rounds([model_free_drafter("combined", native), model_free_drafter("combined", native)]) is None
    assert shared_rounds([model_free_drafter("suffix", native), drafter("suffix", "native")]) is None  # two caches
    from thinkahead.token_spec.drafters import PromptLookupDrafter

    assert shared_rounds([PromptLookupDrafter(), PromptLookupDrafter(prefer="last")]) is not None
    assert shared_rounds([PromptLookupDrafter(), PromptLookupDrafter(max_ngram=2)]) is None
    assert shared_rounds([PromptLookupDrafter(), PromptLookupDrafter(max_sessions=3)]) is None
    assert shared_rounds([PromptLookupDrafter(max_ngram=9)]) is None  # beyond the native index
    python = SuffixCache(tree_impl="python")
    assert replay_sessions_shared([model_free_drafter("suffix", python)], [[Turn([1, 2], [1, 2])]]) is None
    with pytest.raises(ValueError):
        replay_sessions_shared([model_free_drafter("suffix", native)], [[Turn([1, 2], [1])]], max_tokens=-1)


def test_simulate_leaves_the_collector_as_it_found_it(tmp_path: Path) -> None:
    """`simulate` turns the collector off while it imports and reads, and freezes it for the replays: both undone."""
    import gc

    from click.testing import CliRunner

    from thinkahead.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    gc.unfreeze()  # what earlier tests' model loads froze (heap.py): simulate starts from nothing frozen
    runner = CliRunner()
    for args in ([str(bad)], [str(RESULTS / RECORDINGS[-1]), "--model", MODEL, "--drafters", "suffix,combined"]):
        result = runner.invoke(main, ["simulate", *args])
        assert (result.exit_code == 0) == (args[0] != str(bad)), result.output
        assert gc.isenabled() and gc.get_freeze_count() == 0
