"""Arbitrage step router: decide, before anything is drafted, who should write the next step.

In the step loop (`step_spec`) a small model writes each reasoning step by default. Arbitrage
(Arbitrage, docs/step_spec.md) routes instead of judging: a router predicts *before drafting* whether the large model
would write a meaningfully better step, and only then asks the large model; otherwise the small
model writes the step and nobody regenerates it. That saves the large model's tokens on the steps
where it would gain nothing (about 40% of regenerations at a 70% deferral rate, per the paper).

The paper's router is a fine-tuned 1.5B PRM that is not released. This module is the cheap,
dependency-light substitute (numpy only), built on features the step loop already has
(`RouterFeatures`, `thinkahead.verifiers.router_features`):

- `StepRouter` protocol: `route(features) -> ("small" | "large", p)`, `p` = estimated probability
  that the large model's step is meaningfully better.
- `HeuristicRouter`: works with no training (entropy / previous score / reflection rules).
- `LogisticRouter`: standardised features, logistic regression fitted with plain numpy batch
  gradient descent on class-balanced data (Arbitrage found balancing helped); JSON save/load.
- `load_router(spec)`: "heuristic", a shipped router's name ("trained", `SHIPPED_ROUTERS`), or the
  path of a saved logistic router.

Training data and training (`PairedStep`, `write_pairs` / `read_pairs`, `label`, `train_router`)
are in `thinkahead.verifiers.router_pairs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
import json
import math
import os

import numpy as np

from thinkahead.models.base import Tier
from thinkahead.verifiers.router_features import FEATURE_NAMES, RouterFeatures, is_number

__all__ = [
    "HeuristicRouter",
    "LogisticRouter",
    "StepRouter",
    "Tier",
    "load_router",
]


ROUTER_FILE_KIND = "logistic-router"
ROUTER_FILE_VERSION = 1


# --------------------------------------------------------------------------- routers


@runtime_checkable
class StepRouter(Protocol):
    """Decides, before drafting, who writes the next step."""

    name: str

    def route(self, features: RouterFeatures) -> tuple[str, float]:
        """("small" | "large", p); p = estimated P(large model's step is meaningfully better)."""
        ...


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """Numerically stable logistic function."""
    out = np.empty_like(z, dtype=np.float64)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    ez = np.exp(z[~pos])
    out[~pos] = ez / (1.0 + ez)
    return out


def _sigmoid_scalar(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    ez = math.exp(z)
    return ez / (1.0 + ez)


@dataclass(slots=True)
class HeuristicRouter:
    """A router that needs no training.

    Decision: "large" when `step_index < first_steps_large`, or `small_entropy > entropy_threshold`,
    or `prev_score < low_score` (a known score only), or `prev_had_reflection`; else "small".

    Probability: `p = sigmoid(z)` with
    `z = W_ENTROPY*(small_entropy - entropy_threshold) + W_SCORE*(low_score - prev_score)
         + W_REFLECTION*prev_had_reflection + W_FORCED*(step_index < first_steps_large)`,
    where the score term is 0 when `prev_score` is unknown. So p is strictly increasing in the
    entropy, strictly decreasing in a known previous score, and exactly 0.5 when the entropy sits
    at its threshold, the previous score at `low_score`, and no other rule fires. p is a soft
    score (for logs and ranking); the decision is the rule above, so a step with one rule firing
    strongly against a very confident other signal may have p < 0.5 and still go "large".
    """

    entropy_threshold: float = 2.0
    low_score: float = 5.0
    first_steps_large: int = 0
    name: str = field(default="heuristic")

    W_ENTROPY = 2.0
    """Weight per nat of entropy above the threshold."""
    W_SCORE = 0.75
    """Weight per judge-score point below `low_score`."""
    W_REFLECTION = 2.0
    """Weight when the previous step opened with a reflection cue."""
    W_FORCED = 4.0
    """Weight for the forced-large opening steps."""

    def __post_init__(self) -> None:
        if not is_number(self.entropy_threshold) or not math.isfinite(self.entropy_threshold):
            raise ValueError(
                f"entropy_threshold must be a finite number, got {self.entropy_threshold!r}"
            )
        if not is_number(self.low_score) or not math.isfinite(self.low_score):
            raise ValueError(f"low_score must be a finite number, got {self.low_score!r}")
        if (
            not isinstance(self.first_steps_large, int)
            or isinstance(self.first_steps_large, bool)
            or self.first_steps_large < 0
        ):
            raise ValueError(
                f"first_steps_large must be a non-negative int, got {self.first_steps_large!r}"
            )

    def probability(self, features: RouterFeatures) -> float:
        """The documented squashed score p (see the class docstring)."""
        forced = features.step_index < self.first_steps_large
        z = self.W_ENTROPY * (features.small_entropy - self.entropy_threshold)
        if features.prev_score is not None:
            z += self.W_SCORE * (self.low_score - features.prev_score)
        if features.prev_had_reflection:
            z += self.W_REFLECTION
        if forced:
            z += self.W_FORCED
        return _sigmoid_scalar(z)

    def decide(self, features: RouterFeatures) -> Tier:
        """The rule-based decision alone."""
        if features.step_index < self.first_steps_large:
            return "large"
        if features.small_entropy > self.entropy_threshold:
            return "large"
        if features.prev_score is not None and features.prev_score < self.low_score:
            return "large"
        if features.prev_had_reflection:
            return "large"
        return "small"

    def route(self, features: RouterFeatures) -> tuple[str, float]:
        """(decision, p); see the class docstring."""
        if not isinstance(features, RouterFeatures):
            raise ValueError(f"features must be RouterFeatures, got {type(features).__name__}")
        return self.decide(features), self.probability(features)


def _as_float_vector(value: Any, what: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a list of numbers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} must be finite")
    return arr


class LogisticRouter:
    """Logistic regression over standardised `RouterFeatures` vectors.

    `p = sigmoid(weights . ((x - mean) / std) + bias)`; `route` -> "large" when p >= threshold.
    Build one with `fit` (numpy batch gradient descent, class-balanced) or `load`.
    """

    name: str

    def __init__(
        self,
        weights: Sequence[float] | np.ndarray,
        bias: float,
        mean: Sequence[float] | np.ndarray,
        std: Sequence[float] | np.ndarray,
        threshold: float = 0.5,
        feature_names: Sequence[str] = FEATURE_NAMES,
        provenance: Mapping[str, Any] | None = None,
    ) -> None:
        self.weights = _as_float_vector(weights, "weights")
        self.mean = _as_float_vector(mean, "mean")
        self.std = _as_float_vector(std, "std")
        names = tuple(feature_names)
        if not all(isinstance(n, str) for n in names):
            raise ValueError("feature_names must be strings")
        d = len(names)
        for what, arr in (("weights", self.weights), ("mean", self.mean), ("std", self.std)):
            if arr.shape != (d,):
                raise ValueError(
                    f"{what} has {arr.shape[0]} entries, expected {d} (one per feature)"
                )
        if d == 0:
            raise ValueError("a LogisticRouter needs at least one feature")
        if (self.std <= 0).any():
            raise ValueError("std entries must be > 0")
        if not is_number(bias) or not math.isfinite(bias):
            raise ValueError(f"bias must be a finite number, got {bias!r}")
        if not is_number(threshold) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
        self.bias = float(bias)
        self.threshold = float(threshold)
        self.feature_names = names
        self.name = "logistic"
        # how it was made (data, label rule, features, held-out metrics): written to and read from its file
        self.provenance: dict[str, Any] = dict(provenance or {})

    def __repr__(self) -> str:
        return (
            f"LogisticRouter(features={len(self.feature_names)}, bias={self.bias:.4g}, "
            f"threshold={self.threshold})"
        )

    # ---- prediction

    def predict_proba(self, X: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
        """P(large is meaningfully better) for each row of `X` (shape (n, n_features))."""
        arr = np.asarray(X, dtype=np.float64)
        if arr.ndim == 1:
            arr = arr[None, :]
        if arr.ndim != 2 or arr.shape[1] != len(self.feature_names):
            raise ValueError(
                f"X must have shape (n, {len(self.feature_names)}), got {np.asarray(X).shape}"
            )
        z = ((arr - self.mean) / self.std) @ self.weights + self.bias
        return _sigmoid(z)

    def probability(self, features: RouterFeatures) -> float:
        """P(large is meaningfully better) for one step."""
        if not isinstance(features, RouterFeatures):
            raise ValueError(f"features must be RouterFeatures, got {type(features).__name__}")
        try:
            vector = features.to_vector(self.feature_names)
        except ValueError as exc:
            raise ValueError(f"this router was trained on features {list(self.feature_names)}: {exc}") from None
        return float(self.predict_proba([vector])[0])

    def route(self, features: RouterFeatures) -> tuple[str, float]:
        """("large", p) when p >= threshold, else ("small", p)."""
        p = self.probability(features)
        return ("large" if p >= self.threshold else "small"), p

    # ---- training

    @classmethod
    def fit(
        cls,
        X: Sequence[Sequence[float]] | np.ndarray,
        y: Sequence[int] | np.ndarray,
        l2: float = 1e-2,
        epochs: int = 500,
        lr: float = 0.1,
        *,
        threshold: float = 0.5,
        feature_names: Sequence[str] | None = None,
    ) -> LogisticRouter:
        """Fit on rows `X` (n, d) and labels `y` in {0, 1} by full-batch gradient descent.

        Features are standardised with the training mean/std (constant columns get std 1).
        Each class gets half of the total sample weight (balancing, as Arbitrage found helpful),
        so the loss is the class-balanced mean cross-entropy plus `l2/2 * |weights|^2` (the bias is
        not penalised). `feature_names` defaults to `FEATURE_NAMES` when d matches, else x0..x{d-1}.
        """
        try:
            Xa = np.asarray(X, dtype=np.float64)
            ya = np.asarray(y, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"X and y must be numeric arrays: {exc}") from None
        if Xa.ndim != 2 or Xa.shape[0] == 0 or Xa.shape[1] == 0:
            raise ValueError(f"X must be a non-empty 2-D array (n, d), got shape {Xa.shape}")
        if ya.ndim != 1 or ya.shape[0] != Xa.shape[0]:
            raise ValueError(f"y must be 1-D with {Xa.shape[0]} labels, got shape {ya.shape}")
        if not np.isfinite(Xa).all():
            raise ValueError("X must be finite")
        if not np.isin(ya, (0.0, 1.0)).all():
            raise ValueError("y must contain only 0 and 1")
        n_pos = int(ya.sum())
        n = ya.shape[0]
        if n_pos == 0 or n_pos == n:
            raise ValueError(f"y has one class only ({n_pos} positives of {n}); need both")
        if not is_number(l2) or l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {l2!r}")
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        if not is_number(lr) or lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        d = Xa.shape[1]
        if feature_names is None:
            names = FEATURE_NAMES if d == len(FEATURE_NAMES) else tuple(f"x{i}" for i in range(d))
        else:
            names = tuple(feature_names)
            if len(names) != d:
                raise ValueError(f"feature_names has {len(names)} names, X has {d} columns")

        mean = Xa.mean(axis=0)
        std = Xa.std(axis=0)
        std = np.where(std > 1e-12, std, 1.0)
        Z = (Xa - mean) / std
        # Class-balanced sample weights, normalised to sum 1.
        sw = np.where(ya == 1.0, 0.5 / n_pos, 0.5 / (n - n_pos))
        w = np.zeros(d)
        b = 0.0
        for _ in range(epochs):
            p = _sigmoid(Z @ w + b)
            r = sw * (p - ya)
            w -= lr * (Z.T @ r + l2 * w)
            b -= lr * float(r.sum())
        return cls(w, b, mean, std, threshold=threshold, feature_names=names)

    # ---- persistence

    def to_dict(self) -> dict[str, Any]:
        """The JSON document `save` writes."""
        return {
            "kind": ROUTER_FILE_KIND,
            "version": ROUTER_FILE_VERSION,
            "feature_names": list(self.feature_names),
            "weights": [float(v) for v in self.weights],
            "bias": self.bias,
            "mean": [float(v) for v in self.mean],
            "std": [float(v) for v in self.std],
            "threshold": self.threshold,
            **({"provenance": self.provenance} if self.provenance else {}),
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the router as JSON (atomically: temp file then rename); returns the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, target)
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LogisticRouter:
        """Read a router written by `save`; ValueError naming the file if it is not one."""
        source = Path(path)
        try:
            data = json.loads(source.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{source}: not a JSON router file ({exc})") from None
        if not isinstance(data, dict) or data.get("kind") != ROUTER_FILE_KIND:
            raise ValueError(f"{source}: not a {ROUTER_FILE_KIND} file (missing or wrong 'kind')")
        if data.get("version") != ROUTER_FILE_VERSION:
            raise ValueError(
                f"{source}: unsupported {ROUTER_FILE_KIND} version {data.get('version')!r} "
                f"(expected {ROUTER_FILE_VERSION})"
            )
        keys = ("feature_names", "weights", "bias", "mean", "std", "threshold")
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(f"{source}: {ROUTER_FILE_KIND} file lacks {missing}")
        if not isinstance(data["feature_names"], list):
            raise ValueError(f"{source}: 'feature_names' must be a list of strings")
        try:
            return cls(
                data["weights"],
                data["bias"],
                data["mean"],
                data["std"],
                threshold=data["threshold"],
                feature_names=data["feature_names"],
                provenance=data.get("provenance") if isinstance(data.get("provenance"), dict) else None,
            )
        except ValueError as exc:
            raise ValueError(f"{source}: corrupt {ROUTER_FILE_KIND} file: {exc}") from None

SHIPPED_ROUTERS: dict[str, Path] = {
    # trained on step pairs of the packaged Qwen2.5-Coder 0.5B / 1.5B (int8) on GSM8K train problems;
    # its file's "provenance" says how (data, label rule, features, held-out metrics)
    "trained": Path(__file__).resolve().parent / "routers" / "qwen2.5-coder-0.5b-1.5b.json",
}
"""Routers that ship inside the package, by name."""


def load_router(spec: str | os.PathLike[str]) -> StepRouter:
    """"heuristic" -> `HeuristicRouter()`; a shipped router's name (`SHIPPED_ROUTERS`) or the path of
    a saved logistic router -> `LogisticRouter`."""
    text = os.fspath(spec)
    if text.strip().lower() == "heuristic":
        return HeuristicRouter()
    if text in SHIPPED_ROUTERS:
        return LogisticRouter.load(SHIPPED_ROUTERS[text])
    if text and Path(text).is_file():
        return LogisticRouter.load(text)
    raise ValueError(
        f"unknown router {text!r}; choices: 'heuristic', {', '.join(map(repr, SHIPPED_ROUTERS))}, or the path of "
        "a JSON file written by LogisticRouter.save / train_router"
    )
