"""Training data for an Arbitrage router, and the training itself (Arbitrage's recipe, scaled down).

Both models write a step from the same prefix, both are scored, and the pair is stored as a
`PairedStep` (JSONL, `write_pairs` / `read_pairs`); `label` = 1[large_score - small_score > margin];
`train_router` fits a `LogisticRouter` on the pairs and saves it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import json
import math
import os


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
    small_fails: bool | None = None  # the large model's agreement check failed the small step (None: not checked)
    small_gap: float | None = None  # the worst gap (nats) of that check

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
        if self.small_fails is not None and not isinstance(self.small_fails, bool):
            raise ValueError(f"small_fails must be a bool or null, got {self.small_fails!r}")
        if self.small_gap is not None and (not is_number(self.small_gap) or not math.isfinite(self.small_gap)):
            raise ValueError(f"small_gap must be a finite number or null, got {self.small_gap!r}")

    @property
    def small_kept(self) -> bool:
        """Whether a collect run kept the small model's step: the better-judged one, the small one on ties."""
        return self.small_score >= self.large_score

    @property
    def kept_text(self) -> str:
        return self.small_text if self.small_kept else self.large_text

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
            **({} if self.small_fails is None else {"small_fails": self.small_fails, "small_gap": self.small_gap}),
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
            small_fails=data.get("small_fails"),
            small_gap=data.get("small_gap"),
        )


@contextmanager
def pairs_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the exclusive lock of a pairs file (a `PATH.lock` beside it, so that a writer that replaces
    the file by a rename excludes appenders too): appends and rewrites never interleave."""
    import fcntl

    lock = Path(f"{os.fspath(path)}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_pairs(path: str | os.PathLike[str], pairs: Iterable[PairedStep]) -> int:
    """Append pairs to a JSONL file (one per line, flushed per line, under `pairs_lock`); returns how many."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with pairs_lock(target), target.open("a", encoding="utf-8") as fh:
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


LABEL_RULES: tuple[str, ...] = ("judge", "agreement")
"""How a pair is labelled: "judge", the paper's rule (large judge score - small judge score > margin),
or "agreement" (the large model's agreement check failed the small step; see `router_labels`)."""


def label(pair: PairedStep, margin: float = 1.0, rule: str = "judge") -> int:
    """1 when the step should have gone to the large model under `rule` (see `LABEL_RULES`), else 0."""
    if rule == "judge":
        return int(pair.large_score - pair.small_score > margin)
    if rule == "agreement":
        if pair.small_fails is None:
            raise ValueError(f"pair {pair.problem_id}#{pair.step_index} has no agreement label (small_fails); "
                             "label the pairs first (bench/label_pairs.py) or use rule 'judge'")
        return int(pair.small_fails)
    raise ValueError(f"unknown label rule {rule!r}; choose one of {', '.join(LABEL_RULES)}")


def train_router(pairs_path: str | os.PathLike[str], out_path: str | os.PathLike[str], margin: float = 1.0,
                 threshold: float | None = 0.5, **options: Any) -> dict[str, Any]:
    """Fit a `LogisticRouter` on the pairs in `pairs_path`, save it to `out_path`, report on it.

    `options` go to `router_training.fit_router` (label rule, features, held-out split); the report
    holds n, positives, train_accuracy and, with a held-out split, its AUC and route share.
    """
    from thinkahead.verifiers.router_training import fit_router

    pairs = read_pairs(pairs_path)
    if not pairs:
        raise ValueError(f"{pairs_path}: no paired steps to train on")
    try:
        router, report = fit_router(pairs, margin=margin, threshold=threshold, **options)
    except ValueError as exc:
        raise ValueError(f"{pairs_path}: {exc}") from None
    router.provenance = {"data": str(pairs_path), **report}
    report["path"] = str(router.save(out_path))
    return report
