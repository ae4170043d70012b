"""Training data for an Arbitrage router, and the training itself (Arbitrage's recipe, scaled down).

Both models write a step from the same prefix, both are scored, and the pair is stored as a
`PairedStep` (JSONL, `write_pairs` / `read_pairs`); `label` = 1[large_score - small_score > margin];
`train_router` fits a `LogisticRouter` on the pairs and saves it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import json
import math
import os

import numpy as np

from thinkahead.verifiers.router import LogisticRouter
from thinkahead.verifiers.router_features import RouterFeatures, is_number

__all__ = ["PairedStep", "label", "read_pairs", "train_router", "write_pairs"]


@dataclass
class PairedStep:
    """Both models' step from the same prefix, with their scores: one training example."""

    problem_id: str
    step_index: int
    features: RouterFeatures
    small_text: str
    large_text: str
    small_score: float
    large_score: float

    def __post_init__(self) -> None:
        if not isinstance(self.problem_id, str):
            raise ValueError(f"problem_id must be a str, got {type(self.problem_id).__name__}")
        if (
            not isinstance(self.step_index, int)
            or isinstance(self.step_index, bool)
            or self.step_index < 0
        ):
            raise ValueError(f"step_index must be a non-negative int, got {self.step_index!r}")
        if not isinstance(self.features, RouterFeatures):
            raise ValueError(f"features must be RouterFeatures, got {type(self.features).__name__}")
        for name in ("small_text", "large_text"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str")
        for name in ("small_score", "large_score"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (one JSONL line of `write_pairs`)."""
        return {
            "problem_id": self.problem_id,
            "step_index": self.step_index,
            "features": self.features.to_dict(),
            "small_text": self.small_text,
            "large_text": self.large_text,
            "small_score": self.small_score,
            "large_score": self.large_score,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str) -> PairedStep:
        """Inverse of `to_json`; accepts the dict or its JSON text. ValueError for bad input."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"a paired step must be a JSON object, got {type(data).__name__}")
        keys = (
            "problem_id",
            "step_index",
            "features",
            "small_text",
            "large_text",
            "small_score",
            "large_score",
        )
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(f"paired step lacks {missing}")
        try:
            features = RouterFeatures.from_dict(data["features"])
        except TypeError as exc:
            raise ValueError(f"bad features: {exc}") from None
        return cls(
            problem_id=data["problem_id"],
            step_index=data["step_index"],
            features=features,
            small_text=data["small_text"],
            large_text=data["large_text"],
            small_score=data["small_score"],
            large_score=data["large_score"],
        )


def write_pairs(path: str | os.PathLike[str], pairs: Iterable[PairedStep]) -> int:
    """Append pairs to a JSONL file (one per line, flushed per line); returns how many."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with target.open("a", encoding="utf-8") as fh:
        for pair in pairs:
            if not isinstance(pair, PairedStep):
                raise ValueError(f"expected PairedStep, got {type(pair).__name__}")
            fh.write(json.dumps(pair.to_json(), ensure_ascii=False) + "\n")
            fh.flush()
            count += 1
    return count


def read_pairs(path: str | os.PathLike[str]) -> list[PairedStep]:
    """All pairs of a JSONL file (blank lines skipped); ValueError `path:line: reason` otherwise."""
    source = Path(path)
    pairs: list[PairedStep] = []
    with source.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                pairs.append(PairedStep.from_json(line))
            except ValueError as exc:
                raise ValueError(f"{source}:{lineno}: bad paired step: {exc}") from None
    return pairs


def label(pair: PairedStep, margin: float = 1.0) -> int:
    """1 when the large model's step beats the small one's by more than `margin`, else 0."""
    return int(pair.large_score - pair.small_score > margin)


def train_router(
    pairs_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    margin: float = 1.0,
    threshold: float = 0.5,
) -> dict[str, Any]:
    """Fit a `LogisticRouter` on the pairs in `pairs_path`, save it to `out_path`, report on it.

    Report: n, positives, train_accuracy (at `threshold`), threshold, margin, path.
    """
    pairs = read_pairs(pairs_path)
    if not pairs:
        raise ValueError(f"{pairs_path}: no paired steps to train on")
    X = np.asarray([p.features.to_vector() for p in pairs], dtype=np.float64)
    y = np.asarray([label(p, margin) for p in pairs], dtype=np.float64)
    positives = int(y.sum())
    if positives in (0, len(pairs)):
        raise ValueError(
            f"{pairs_path}: all {len(pairs)} pairs have label {1 if positives else 0} at margin "
            f"{margin}; need both classes"
        )
    router = LogisticRouter.fit(X, y, threshold=threshold)
    saved = router.save(out_path)
    predicted = router.predict_proba(X) >= threshold
    accuracy = float((predicted == (y == 1.0)).mean())
    return {
        "n": len(pairs),
        "positives": positives,
        "train_accuracy": accuracy,
        "threshold": threshold,
        "margin": margin,
        "path": str(saved),
    }
