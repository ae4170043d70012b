"""Arbitrage step router: decide, before anything is drafted, who should write the next step.

In the step loop (`step_spec`) a small model writes each reasoning step by default. Arbitrage
(Arbitrage, docs/step_spec.md) routes instead of judging: a router predicts *before drafting* whether the large model
would write a meaningfully better step, and only then asks the large model; otherwise the small
model writes the step and nobody regenerates it. That saves the large model's tokens on the steps
where it would gain nothing (about 40% of regenerations at a 70% deferral rate, per the paper).

The paper's router is a fine-tuned 1.5B PRM that is not released. This module is the cheap,
dependency-light substitute (numpy only), built on features the step loop already has:

- `RouterFeatures`: what is known before the step is written (step index, the judge score of the
  previous step, the small model's next-token entropy, previous step length and reflection cue,
  problem length), with `to_vector()` in the fixed order `FEATURE_NAMES`.
- `entropy_from_logprobs`, `REFLECTION_CUES`, `opens_with_reflection`: helpers to compute them.
- `StepRouter` protocol: `route(features) -> ("small" | "large", p)`, `p` = estimated probability
  that the large model's step is meaningfully better.
- `HeuristicRouter`: works with no training (entropy / previous score / reflection rules).
- `LogisticRouter`: standardised features, logistic regression fitted with plain numpy batch
  gradient descent on class-balanced data (Arbitrage found balancing helped); JSON save/load.
- Training path (Arbitrage's recipe, scaled down): both models write a step from the same prefix,
  both are scored, the pair is stored as a `PairedStep` (JSONL, `write_pairs` / `read_pairs`),
  `label` = 1[large_score - small_score > margin], `train_router` fits and saves a router.
- `load_router(spec)`: "heuristic" or the path of a saved logistic router.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable
import json
import math
import os
import re

import numpy as np

__all__ = [
    "FEATURE_NAMES",
    "REFLECTION_CUES",
    "HeuristicRouter",
    "LogisticRouter",
    "PairedStep",
    "RouterFeatures",
    "StepRouter",
    "Tier",
    "entropy_from_logprobs",
    "label",
    "load_router",
    "opens_with_reflection",
    "read_pairs",
    "train_router",
    "write_pairs",
]

Tier = Literal["small", "large"]

IMPUTED_PREV_SCORE = 5.0
"""Value used for `prev_score` when it is unknown (middle of the judge's 0-9 scale)."""

FEATURE_NAMES: tuple[str, ...] = (
    "step_index",
    "prev_score",
    "prev_score_missing",
    "small_entropy",
    "prev_step_tokens",
    "prev_had_reflection",
    "problem_tokens",
)
"""Order of `RouterFeatures.to_vector()`; a saved `LogisticRouter` records it and must match."""

ROUTER_FILE_KIND = "logistic-router"
ROUTER_FILE_VERSION = 1


# --------------------------------------------------------------------------- features


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(slots=True)
class RouterFeatures:
    """What the router sees before the next step is written.

    - `step_index`: 0-based index of the step about to be written.
    - `prev_score`: judge score (0-9) of the previous step, None if unknown (first step, or the
      previous step was not judged).
    - `small_entropy`: entropy (nats) of the small model's next-token distribution at the start of
      this step, from its top-k logprobs (`entropy_from_logprobs`).
    - `prev_step_tokens`: length of the previous step in tokens (0 for the first step).
    - `prev_had_reflection`: the previous step opened with a reflection cue ("Wait", ...).
    - `problem_tokens`: length of the problem statement in tokens.
    """

    step_index: int
    prev_score: float | None
    small_entropy: float
    prev_step_tokens: int
    prev_had_reflection: bool
    problem_tokens: int

    def __post_init__(self) -> None:
        for name in ("step_index", "prev_step_tokens", "problem_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"RouterFeatures.{name} must be a non-negative int, got {value!r}")
        if self.prev_score is not None and (
            not _is_number(self.prev_score) or not math.isfinite(self.prev_score)
        ):
            raise ValueError(
                "RouterFeatures.prev_score must be a finite number or None, "
                f"got {self.prev_score!r}"
            )
        if (
            not _is_number(self.small_entropy)
            or not math.isfinite(self.small_entropy)
            or self.small_entropy < 0
        ):
            raise ValueError(
                "RouterFeatures.small_entropy must be a finite number >= 0, "
                f"got {self.small_entropy!r}"
            )
        if not isinstance(self.prev_had_reflection, bool):
            raise ValueError(
                "RouterFeatures.prev_had_reflection must be a bool, "
                f"got {self.prev_had_reflection!r}"
            )

    def to_vector(self) -> list[float]:
        """The features as floats, in the order of `FEATURE_NAMES`:

        step_index, prev_score (None -> 5.0), prev_score_missing (1.0 if None), small_entropy,
        prev_step_tokens, prev_had_reflection (0/1), problem_tokens.
        """
        missing = self.prev_score is None
        return [
            float(self.step_index),
            IMPUTED_PREV_SCORE if missing else float(self.prev_score),  # type: ignore[arg-type]
            1.0 if missing else 0.0,
            float(self.small_entropy),
            float(self.prev_step_tokens),
            1.0 if self.prev_had_reflection else 0.0,
            float(self.problem_tokens),
        ]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the raw fields (prev_score stays None when unknown)."""
        return {
            "step_index": self.step_index,
            "prev_score": self.prev_score,
            "small_entropy": self.small_entropy,
            "prev_step_tokens": self.prev_step_tokens,
            "prev_had_reflection": self.prev_had_reflection,
            "problem_tokens": self.problem_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RouterFeatures:
        """Inverse of `to_dict`; ValueError for missing or unexpected keys and bad values."""
        if not isinstance(data, Mapping):
            raise ValueError(f"features must be a JSON object, got {type(data).__name__}")
        expected = {
            "step_index",
            "prev_score",
            "small_entropy",
            "prev_step_tokens",
            "prev_had_reflection",
            "problem_tokens",
        }
        missing = expected - set(data)
        extra = set(data) - expected
        if missing or extra:
            raise ValueError(
                f"features keys: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        return cls(**{k: data[k] for k in expected})


def entropy_from_logprobs(logprobs: Mapping[str, float]) -> float:
    """Entropy (nats) of the top-k distribution given as token -> logprob, renormalised to sum 1.

    Empty -> 0.0. Logprobs of -inf count as probability 0; NaN or +inf is a ValueError.
    """
    if not logprobs:
        return 0.0
    values = np.asarray([float(v) for v in logprobs.values()], dtype=np.float64)
    if np.isnan(values).any() or np.isposinf(values).any():
        raise ValueError("logprobs must be finite or -inf")
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0
    shifted = finite - finite.max()
    log_z = math.log(float(np.exp(shifted).sum()))
    logp = shifted - log_z
    p = np.exp(logp)
    return max(0.0, float(-(p * logp).sum()))


# --------------------------------------------------------------------------- reflection cues

REFLECTION_CUES: tuple[str, ...] = (
    "wait",
    "alternatively",
    "let me check",
    "hmm",
    "but wait",
    "on second thought",
    "let me verify",
    "however",
    "actually",
)
"""Lowercase openers that mark a reflective step (after Speculative Thinking's keyword classes)."""

_LEADING_NOISE = re.compile(r"^(?:[\s#*_>`~\-+]|\d+[.)]\s)*")
_CUE_PATTERN = re.compile(
    r"(?:"
    + "|".join(
        # "hmm" also matches "hmmm..."; every cue must end at a word boundary.
        re.escape(c) + ("+" if c == "hmm" else "")
        for c in sorted(REFLECTION_CUES, key=len, reverse=True)
    )
    + r")(?![a-z0-9])",
    re.IGNORECASE,
)


def opens_with_reflection(text: str) -> bool:
    """True when `text` opens with a reflection cue, ignoring case, leading whitespace and markdown
    (headings, emphasis, quotes, list bullets). The cue must be a whole word: "Waiting" is not
    "wait"."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    body = _LEADING_NOISE.sub("", text, count=1)
    return _CUE_PATTERN.match(body) is not None


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
        if not _is_number(self.entropy_threshold) or not math.isfinite(self.entropy_threshold):
            raise ValueError(
                f"entropy_threshold must be a finite number, got {self.entropy_threshold!r}"
            )
        if not _is_number(self.low_score) or not math.isfinite(self.low_score):
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
        if not _is_number(bias) or not math.isfinite(bias):
            raise ValueError(f"bias must be a finite number, got {bias!r}")
        if not _is_number(threshold) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
        self.bias = float(bias)
        self.threshold = float(threshold)
        self.feature_names = names
        self.name = "logistic"

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
        if self.feature_names != FEATURE_NAMES:
            raise ValueError(
                f"this router was trained on features {list(self.feature_names)}, "
                f"not RouterFeatures {list(FEATURE_NAMES)}"
            )
        return float(self.predict_proba([features.to_vector()])[0])

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
        if not _is_number(l2) or l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {l2!r}")
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        if not _is_number(lr) or lr <= 0:
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
            )
        except ValueError as exc:
            raise ValueError(f"{source}: corrupt {ROUTER_FILE_KIND} file: {exc}") from None


# --------------------------------------------------------------------------- training data


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
            if not _is_number(value) or not math.isfinite(value):
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


def load_router(spec: str | os.PathLike[str]) -> StepRouter:
    """"heuristic" -> `HeuristicRouter()`; a path to a saved logistic router -> `LogisticRouter`."""
    text = os.fspath(spec)
    if text.strip().lower() == "heuristic":
        return HeuristicRouter()
    if text and Path(text).is_file():
        return LogisticRouter.load(text)
    raise ValueError(
        f"unknown router {text!r}; choices: 'heuristic', or the path of a JSON file written by "
        "LogisticRouter.save / train_router"
    )
