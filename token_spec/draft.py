"""The proposal every drafter returns: a chain or a tree of guessed tokens.

A draft is a tree in topological order: `parents[i]` is the index of token i's
parent in `token_ids`, or -1 when token i continues the context directly. A chain
is the special case `parents == [-1, 0, 1, ...]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Draft:
    """Guessed continuation of a context, with the drafter's own confidence.

    `probs[i]` is the drafter's estimate that token i is right given that its
    ancestors are; `score` is their sum (the expected number of accepted tokens
    for a chain, SuffixDecoding's ranking key). `q` holds, for drafts sampled
    from a draft model, the full proposal distribution that produced each token
    (a float tensor [n, vocab]); model-free drafts leave it None and are treated
    as point-mass proposals by the sampling verifier.
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""
    q: Any = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        """True when every token follows the previous one."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @classmethod
    def chain(cls, token_ids: list[int], probs: list[float] | None = None, **kw: Any) -> Draft:
        """A chain draft; probabilities default to 1.0 (no estimate)."""
        probs = [1.0] * len(token_ids) if probs is None else probs
        return cls(
            token_ids=list(token_ids),
            parents=list(range(-1, len(token_ids) - 1)),
            probs=probs,
            score=float(sum(probs)),
            **kw,
        )

    def paths(self) -> list[tuple[int, ...]]:
        """Each node's tokens, from the one after the context to the node itself."""
        out: list[tuple[int, ...]] = []
        for token, parent in zip(self.token_ids, self.parents):
            out.append((out[parent] if parent >= 0 else ()) + (token,))
        return out

    def truncated(self, n: int) -> Draft:
        """The first n nodes (valid for any tree: parents precede children)."""
        if n >= len(self.token_ids):
            return self
        probs = self.probs[:n]
        return Draft(
            token_ids=self.token_ids[:n],
            parents=self.parents[:n],
            probs=probs,
            score=float(sum(probs)),
            match_len=self.match_len,
            source=self.source,
            q=None if self.q is None else self.q[:n],
        )
