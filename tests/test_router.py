"""Tests for the Arbitrage step router (`thinkahead.verifiers.router`, `router_features`, `router_pairs`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from thinkahead.verifiers.router import HeuristicRouter, LogisticRouter, StepRouter, load_router
from thinkahead.verifiers.router_features import (
    FEATURE_NAMES,
    REFLECTION_CUES,
    RouterFeatures,
    entropy_from_logprobs,
    opens_with_reflection,
)
from thinkahead.verifiers.router_pairs import PairedStep, label, read_pairs, train_router, write_pairs


def feats(
    step_index: int = 3,
    prev_score: float | None = 8.0,
    small_entropy: float = 0.5,
    prev_step_tokens: int = 40,
    prev_had_reflection: bool = False,
    problem_tokens: int = 100,
) -> RouterFeatures:
    return RouterFeatures(
        step_index, prev_score, small_entropy, prev_step_tokens, prev_had_reflection, problem_tokens
    )


# --------------------------------------------------------------------------- features


def test_to_vector_order_and_imputation() -> None:
    f = feats(step_index=2, prev_score=7.0, small_entropy=1.25, prev_step_tokens=30,
              prev_had_reflection=True, problem_tokens=90)
    assert len(FEATURE_NAMES) == len(f.to_vector())
    assert dict(zip(FEATURE_NAMES, f.to_vector())) == {
        "step_index": 2.0,
        "prev_score": 7.0,
        "prev_score_missing": 0.0,
        "small_entropy": 1.25,
        "prev_step_tokens": 30.0,
        "prev_had_reflection": 1.0,
        "problem_tokens": 90.0,
    }
    v = dict(zip(FEATURE_NAMES, feats(prev_score=None).to_vector()))
    assert v["prev_score"] == 5.0 and v["prev_score_missing"] == 1.0


def test_features_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="step_index"):
        feats(step_index=-1)
    with pytest.raises(ValueError, match="small_entropy"):
        feats(small_entropy=float("nan"))
    with pytest.raises(ValueError, match="prev_score"):
        feats(prev_score=float("inf"))


def test_entropy_uniform_and_peaked() -> None:
    uniform = {t: math.log(0.25) for t in "abcd"}
    assert entropy_from_logprobs(uniform) == pytest.approx(math.log(4))
    # Renormalised: the same shape at a lower total mass gives the same entropy.
    assert entropy_from_logprobs({t: math.log(0.1) for t in "abcd"}) == pytest.approx(math.log(4))
    peaked = {"a": math.log(0.97), "b": math.log(0.01), "c": math.log(0.01), "d": math.log(0.01)}
    h = entropy_from_logprobs(peaked)
    assert 0.0 < h < math.log(4) / 2
    assert entropy_from_logprobs({}) == 0.0
    assert entropy_from_logprobs({"a": -0.3}) == pytest.approx(0.0)
    assert entropy_from_logprobs({"a": 0.0, "b": float("-inf")}) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        entropy_from_logprobs({"a": float("nan")})


def test_reflection_cues() -> None:
    assert "wait" in REFLECTION_CUES and "on second thought" in REFLECTION_CUES
    for text in [
        "Wait, that is wrong.",
        "  \n\nBUT WAIT - the sign flips",
        "**Hmm**, let us see",
        "Hmmm... no",
        "## Let me verify the sum",
        "> Actually the base case",
        "- Alternatively we could",
        "1. However, x > 0",
        "On second thought, no.",
        "let me check: 2+2=4",
    ]:
        assert opens_with_reflection(text), text
    negatives = ["", "So the answer is 4.", "Waiter brings soup", "We wait for x", "Howevers",
                 "Let me compute"]
    for text in negatives:
        assert not opens_with_reflection(text), text


# --------------------------------------------------------------------------- heuristic


def test_heuristic_decisions() -> None:
    r = HeuristicRouter(entropy_threshold=2.0, low_score=5.0, first_steps_large=2)
    assert isinstance(r, StepRouter) and r.name == "heuristic"
    confident = feats()
    assert r.route(confident)[0] == "small"
    assert r.route(feats(step_index=0))[0] == "large"
    assert r.route(feats(step_index=1))[0] == "large"
    assert r.route(feats(step_index=2))[0] == "small"
    assert r.route(feats(small_entropy=2.5))[0] == "large"
    assert r.route(feats(prev_score=3.0))[0] == "large"
    assert r.route(feats(prev_had_reflection=True))[0] == "large"
    assert r.route(feats(prev_score=None))[0] == "small"  # unknown score is not low
    # Default: no forced opening steps.
    assert HeuristicRouter().route(feats(step_index=0))[0] == "small"


def test_heuristic_probability_monotone() -> None:
    r = HeuristicRouter()
    ps = [r.route(feats(small_entropy=h))[1] for h in np.linspace(0.0, 5.0, 21)]
    assert all(0.0 < p < 1.0 for p in ps)
    assert all(b > a for a, b in zip(ps, ps[1:]))
    qs = [r.route(feats(prev_score=s))[1] for s in range(10)]
    assert all(b < a for a, b in zip(qs, qs[1:]))
    # Neutral point: entropy at threshold, score at low_score -> 0.5.
    assert r.route(feats(small_entropy=2.0, prev_score=5.0))[1] == pytest.approx(0.5)
    assert r.route(feats(prev_had_reflection=True))[1] > r.route(feats())[1]
    # The rules and p agree on clear cases.
    assert r.route(feats(small_entropy=4.0, prev_score=2.0))[1] > 0.9
    assert r.route(feats(small_entropy=0.1, prev_score=9.0))[1] < 0.1


def test_heuristic_rejects_bad_config() -> None:
    with pytest.raises(ValueError):
        HeuristicRouter(first_steps_large=-1)
    with pytest.raises(ValueError):
        HeuristicRouter(entropy_threshold=float("nan"))


# --------------------------------------------------------------------------- logistic


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[RouterFeatures]]:
    """Label 1 iff entropy - 0.5 * prev_score > -1.5 (linearly separable), other features noise."""
    rng = np.random.default_rng(seed)
    fs: list[RouterFeatures] = []
    ys: list[int] = []
    while len(fs) < n:
        h = float(rng.uniform(0.0, 4.0))
        s = float(rng.uniform(0.0, 9.0))
        margin = h - 0.5 * s + 1.5
        if abs(margin) < 0.2:  # keep a gap so the data are cleanly separable
            continue
        fs.append(feats(step_index=int(rng.integers(0, 30)), prev_score=s, small_entropy=h,
                        prev_step_tokens=int(rng.integers(5, 200)),
                        prev_had_reflection=bool(rng.integers(0, 2)),
                        problem_tokens=int(rng.integers(20, 500))))
        ys.append(int(margin > 0))
    X = np.asarray([f.to_vector() for f in fs])
    return X, np.asarray(ys), fs


def test_logistic_fit_separable() -> None:
    X, y, _ = synthetic(400, seed=0)
    router = LogisticRouter.fit(X, y)
    assert router.name == "logistic" and router.feature_names == FEATURE_NAMES
    acc = float(((router.predict_proba(X) >= 0.5) == (y == 1)).mean())
    assert acc >= 0.95
    _, y_new, fs_new = synthetic(100, seed=1)
    tiers = [router.route(f)[0] for f in fs_new]
    new_acc = np.mean([(t == "large") == bool(v) for t, v in zip(tiers, y_new)])
    assert new_acc >= 0.9
    assert router.route(feats(small_entropy=3.9, prev_score=0.5))[0] == "large"
    assert router.route(feats(small_entropy=0.1, prev_score=8.5))[0] == "small"
    # The threshold moves the decision: large iff p >= threshold.
    f = feats(small_entropy=2.0, prev_score=7.0)
    p = router.route(f)[1]
    at = LogisticRouter(router.weights, router.bias, router.mean, router.std, threshold=p)
    above = LogisticRouter(router.weights, router.bias, router.mean, router.std,
                           threshold=min(1.0, p + 1e-6))
    assert at.route(f) == ("large", p)
    assert above.route(f) == ("small", p)


def test_logistic_fit_rejects_bad_data() -> None:
    X, y, _ = synthetic(20, seed=2)
    with pytest.raises(ValueError, match="non-empty"):
        LogisticRouter.fit(np.zeros((0, 7)), np.zeros(0))
    with pytest.raises(ValueError):
        LogisticRouter.fit([], [])
    with pytest.raises(ValueError, match="one class"):
        LogisticRouter.fit(X, np.ones(len(X)))
    with pytest.raises(ValueError, match="y must be 1-D"):
        LogisticRouter.fit(X, y[:-1])
    with pytest.raises(ValueError, match="only 0 and 1"):
        LogisticRouter.fit(X, y * 2)
    with pytest.raises(ValueError, match="2-D"):
        LogisticRouter.fit(X[:, 0], y)
    three = LogisticRouter(np.zeros(3), 0.0, np.zeros(3), np.ones(3), feature_names=("a", "b", "c"))
    with pytest.raises(ValueError, match="trained on features"):
        three.route(feats())
    with pytest.raises(ValueError, match="shape"):
        three.predict_proba(np.zeros((2, 7)))
    with pytest.raises(ValueError, match="weights"):
        LogisticRouter(np.zeros(3), 0.0, np.zeros(7), np.ones(7))


def test_logistic_save_load_round_trip(tmp_path: Path) -> None:
    X, y, fs = synthetic(200, seed=3)
    router = LogisticRouter.fit(X, y, threshold=0.7)
    path = router.save(tmp_path / "sub" / "router.json")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "logistic-router" and doc["version"] == 1
    loaded = LogisticRouter.load(path)
    assert loaded.threshold == 0.7 and loaded.feature_names == router.feature_names
    np.testing.assert_array_equal(loaded.predict_proba(X), router.predict_proba(X))
    assert [loaded.route(f) for f in fs[:20]] == [router.route(f) for f in fs[:20]]
    via_spec = load_router(str(path))
    assert isinstance(via_spec, LogisticRouter)
    assert via_spec.route(fs[0]) == router.route(fs[0])


def test_logistic_load_corrupt_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        LogisticRouter.load(bad)
    bad.write_text(json.dumps({"kind": "something-else", "version": 1}))
    with pytest.raises(ValueError, match="bad.json.*kind"):
        LogisticRouter.load(bad)
    bad.write_text(json.dumps({"kind": "logistic-router", "version": 99}))
    with pytest.raises(ValueError, match="version"):
        LogisticRouter.load(bad)
    X, y, _ = synthetic(50, seed=4)
    doc = LogisticRouter.fit(X, y, epochs=5).to_dict()
    doc["weights"] = doc["weights"][:-1]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="bad.json.*weights"):
        LogisticRouter.load(bad)
    del doc["std"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="lacks"):
        LogisticRouter.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="bad.json"):
        load_router(str(bad))


def test_load_router_specs(tmp_path: Path) -> None:
    assert isinstance(load_router("heuristic"), HeuristicRouter)
    with pytest.raises(ValueError, match="heuristic"):
        load_router("no-such-router")
    with pytest.raises(ValueError, match="choices"):
        load_router(str(tmp_path / "missing.json"))


# --------------------------------------------------------------------------- pairs and training


def make_pair(i: int, entropy: float, gain: float) -> PairedStep:
    return PairedStep(
        problem_id=f"p{i // 5}",
        step_index=i % 5,
        features=feats(step_index=i % 5, small_entropy=entropy,
                       prev_score=None if i % 5 == 0 else 6.0),
        small_text=f"small step {i}\nwith ünïcode",
        large_text=f"large step {i}",
        small_score=4.0,
        large_score=4.0 + gain,
    )


def test_pairs_round_trip_and_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    pairs = [make_pair(i, 0.3 * i, 2.0 if i % 2 else 0.0) for i in range(6)]
    assert write_pairs(path, pairs[:4]) == 4
    assert write_pairs(path, pairs[4:]) == 2  # appends
    assert read_pairs(path) == pairs
    assert PairedStep.from_json(json.dumps(pairs[0].to_json())) == pairs[0]
    assert [label(p) for p in pairs] == [0, 1, 0, 1, 0, 1]
    assert label(pairs[1], margin=2.0) == 0 and label(pairs[1], margin=1.9) == 1

    lines = path.read_text().splitlines()
    lines.insert(2, "")  # blank lines are skipped but still counted
    lines.insert(3, '{"problem_id": "x"}')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"pairs\.jsonl:4:.*lacks"):
        read_pairs(path)
    lines[3] = "not json"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"pairs\.jsonl:4:"):
        read_pairs(path)
    doc = pairs[0].to_json()
    doc["features"]["step_index"] = "three"
    lines[3] = json.dumps(doc)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"pairs\.jsonl:4:.*step_index"):
        read_pairs(path)


def test_train_router_end_to_end(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    pairs = []
    for i in range(200):
        entropy = float(rng.uniform(0.0, 4.0))
        # Clear signal: the large model helps when the small model is unsure.
        gain = 3.0 if entropy > 2.0 else 0.0
        pairs.append(make_pair(i, entropy, gain + float(rng.uniform(-0.5, 0.5))))
    pairs_path = tmp_path / "pairs.jsonl"
    write_pairs(pairs_path, pairs)
    out = tmp_path / "router.json"
    report = train_router(pairs_path, out, margin=1.0, threshold=0.5)
    assert report["n"] == 200
    assert report["positives"] == sum(label(p) for p in pairs)
    assert 50 < report["positives"] < 150
    assert report["train_accuracy"] >= 0.95
    assert report["threshold"] == 0.5
    router = load_router(str(out))
    assert router.route(feats(small_entropy=3.5, prev_score=6.0))[0] == "large"
    assert router.route(feats(small_entropy=0.5, prev_score=6.0))[0] == "small"

    one_class = tmp_path / "one.jsonl"
    write_pairs(one_class, [make_pair(i, 1.0, 0.0) for i in range(5)])
    with pytest.raises(ValueError, match="both classes"):
        train_router(one_class, tmp_path / "r2.json")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no paired steps"):
        train_router(empty, tmp_path / "r3.json")
