"""Fitting a logistic step router: labels, a held-out split by problem, ROC AUC and the threshold.

`fit_router` labels the pairs (`router_pairs.label`), holds out every k-th problem (sorted by id,
so the split is the same on every machine), fits on the rest, and picks the routing threshold on
the held-out problems: the one that maximises Youden's J (true-positive rate - false-positive rate)
unless a threshold is given. Its report (what `LogisticRouter.provenance` records) holds the label
rule, the features, the split and the held-out metrics, so a saved router can be checked against
the pairs it came from (`evaluate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from thinkahead.verifiers.router import LogisticRouter
from thinkahead.verifiers.router_features import FEATURE_NAMES
from thinkahead.verifiers.router_pairs import LABEL_RULES, PairedStep, label

__all__ = ["PRE_DRAFT_FEATURES", "evaluate", "fit_router", "roc_auc", "split_problems"]

PRE_DRAFT_FEATURES: tuple[str, ...] = tuple(n for n in FEATURE_NAMES if not n.startswith("prev_score"))
"""The features a router sees the same way in training and in use: a collect run's previous step
always has a judge score, a routed one never does, so `prev_score` would mean different things."""


def roc_auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (ties count half); ValueError when a class is missing."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    pos, neg = s[y == 1], s[y == 0]
    if not len(pos) or not len(neg):
        raise ValueError(f"ROC AUC needs both classes, got {len(pos)} positives and {len(neg)} negatives")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def split_problems(pairs: Sequence[PairedStep], holdout_every: int) -> tuple[list[PairedStep], list[PairedStep]]:
    """(train, held out): every `holdout_every`-th problem id in sorted order is held out (0: none)."""
    if holdout_every < 0 or holdout_every == 1:
        raise ValueError(f"holdout_every must be 0 (no split) or >= 2, got {holdout_every}")
    if holdout_every == 0:
        return list(pairs), []
    ids = sorted({p.problem_id for p in pairs})
    held = {pid for i, pid in enumerate(ids) if i % holdout_every == 0}
    return [p for p in pairs if p.problem_id not in held], [p for p in pairs if p.problem_id in held]


def _matrix(pairs: Sequence[PairedStep], names: tuple[str, ...]) -> np.ndarray:
    return np.asarray([p.features.to_vector(names) for p in pairs], dtype=np.float64)


def evaluate(router: LogisticRouter, pairs: Sequence[PairedStep], rule: str, margin: float = 1.0) -> dict[str, float]:
    """The router on `pairs`: ROC AUC, the share it routes to the large model, recall of the positives."""
    y = np.asarray([label(p, margin, rule) for p in pairs])
    p = router.predict_proba(_matrix(pairs, router.feature_names))
    routed = p >= router.threshold
    return {"auc": roc_auc(p, y), "route_share": float(routed.mean()),
            "recall": float(routed[y == 1].mean()) if (y == 1).any() else 0.0, "n": float(len(y)),
            "positives": float(y.sum())}


def _best_threshold(p: np.ndarray, y: np.ndarray) -> float:
    """The probability cut with the largest Youden's J on (p, y); ties go to the higher cut (fewer routed)."""
    best, best_j = 1.0, -1.0
    for cut in sorted(set(p.tolist()), reverse=True):
        routed = p >= cut
        j = routed[y == 1].mean() - routed[y == 0].mean()
        if j > best_j + 1e-12:
            best, best_j = float(cut), float(j)
    return best


def fit_router(pairs: Sequence[PairedStep], margin: float = 1.0, threshold: float | None = None,
               rule: str = "judge", features: Sequence[str] | None = None, holdout_every: int = 0,
               l2: float = 1e-2) -> tuple[LogisticRouter, dict[str, Any]]:
    """A `LogisticRouter` fitted on `pairs` and its report (see the module docstring)."""
    if rule not in LABEL_RULES:
        raise ValueError(f"unknown label rule {rule!r}; choose one of {', '.join(LABEL_RULES)}")
    names = tuple(features) if features is not None else (PRE_DRAFT_FEATURES if rule == "agreement" else FEATURE_NAMES)
    train, held = split_problems(pairs, holdout_every)
    y = np.asarray([label(p, margin, rule) for p in train], dtype=np.float64)
    positives = int(y.sum())
    if positives in (0, len(train)):
        raise ValueError(f"all {len(train)} training pairs have label {1 if positives else 0} "
                         f"(rule {rule!r}, margin {margin}); need both classes")
    if held and threshold is None:
        held_y = np.asarray([label(p, margin, rule) for p in held])
        if held_y.min() == held_y.max():
            raise ValueError(f"the {len(held)} held-out pairs have one class only; hold out other problems")
    router = LogisticRouter.fit(_matrix(train, names), y, l2=l2, threshold=0.5 if threshold is None else threshold,
                                feature_names=names)
    if held and threshold is None:
        router.threshold = _best_threshold(router.predict_proba(_matrix(held, names)), held_y)
    predicted = router.predict_proba(_matrix(train, names)) >= router.threshold
    report: dict[str, Any] = {
        "rule": rule, "margin": margin, "features": list(names), "n": len(train), "positives": positives,
        "train_accuracy": float((predicted == (y == 1.0)).mean()), "threshold": router.threshold,
        "holdout_every": holdout_every,
        "train_problems": sorted({p.problem_id for p in train}), "heldout_problems": sorted({p.problem_id for p in held}),
    }
    if held:
        report["heldout"] = evaluate(router, held, rule, margin)
    return router, report
