"""What the decoder asks of a target engine: `TargetEngine`, and `ForwardCall`, one sequence's forward.

A decoder (decoder.py) never calls the engine itself while it runs under a scheduler: each round it
yields a `ForwardCall` (the tokens to append to its session, a chain or a tree) and is sent back their
logits. `run_inline` answers each call at once (one generation alone); `batching.BatchScheduler`
gathers the calls of every live generation and answers them with one `forward_batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")


@dataclass(slots=True)
class ForwardCall:
    """Append `token_ids` to `session` (a chain, or a tree by `parents` as `TargetEngine.forward` takes it)
    and return their logits; `last_only` asks for the last row only (a prefill). `engine`: the engine that holds
    `session` where it is not the generation's own (a draft model's forward); `head`: an output layer in place of
    the engine's (a draft model's over part of the vocabulary); `on_hidden`: given the returned rows' normed last
    hidden states `[rows, hidden]` before they are sent back, where the engine has them (a draft head reads them:
    draft_head.py). An engine without them never calls it. `values`: the worth of each draft row (rows 1 on: the
    tokens each is expected to add, non-increasing) where a scheduler may verify only the first rows, those that
    pay for their place in its forward (pricing.price_rows); the generation then gets fewer rows of logits than it
    sent tokens, and keeps that many."""

    session: Any
    token_ids: list[int]
    parents: list[int] | None = None
    last_only: bool = False
    engine: Any = None
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    on_hidden: Callable[[torch.Tensor], None] | None = None
    values: list[float] | None = None


@runtime_checkable
class TargetEngine(Protocol):
    """A model over KV-cached sessions (thinkahead/models/engine/runner.py's `HFEngine` is the local one). An engine
    may also have `copy_prefix(session, length)`: a new session with a copy of the first `length` tokens' K/V
    (the prefix pool then shares part of a cached context without cutting it)."""

    vocab_size: int

    def new_session(self) -> Any:
        """An empty sequence with its own KV cache."""

    def forward(self, session: Any, token_ids: list[int], parents: list[int] | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Append tokens (a chain, or a tree in topological order) and return their float32 logits."""

    def forward_batch(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """Every call's logits, as `forward` gives them one by one (the same bits where the engine batches
        rows exactly), each session in at most one call."""

    def keep_path(self, session: Any, start: int, path: list[int]) -> None:
        """After a tree forward that began at `start`, keep only the root-to-node `path`."""

    def truncate(self, session: Any, length: int) -> None:
        """Roll the session back to its first `length` tokens."""


class DraftShare(Protocol):
    """A generation's view of the batch it runs in (given by the scheduler)."""

    @property
    def prior(self) -> float:
        """The acceptance rate a new sequence's estimate starts from: what its engine's sequences have shown."""

    def limit(self, accept_rate: float) -> int:
        """The most draft tokens this sequence may verify next round, given its drafts' acceptance rate."""

    def verified(self, expected: float, accepted: int) -> None:
        """A draft it was given room for was verified: `expected` draft tokens accepted by its estimate (before the
        round), `accepted` in fact."""

    @property
    def alone(self) -> bool:
        """Whether its last forward ran it alone (that forward's time is then its own verify cost) and no other
        sequence waits for its engine now."""


# A generation run as a coroutine: it yields the forwards it needs and is sent their logits.
Rounds = Generator[ForwardCall, torch.Tensor, T]


def forward_one(engine: TargetEngine, call: ForwardCall) -> torch.Tensor:
    """`call` run alone, on its own engine if it names one, else on `engine`."""
    target = call.engine if call.engine is not None else engine
    if call.head is not None or call.on_hidden is not None:  # only engines that take them are given them
        extra = {k: v for k, v in (("head", call.head), ("on_hidden", call.on_hidden)) if v is not None}
        return target.forward(call.session, call.token_ids, call.parents, last_only=call.last_only, **extra)
    return target.forward(call.session, call.token_ids, call.parents, last_only=call.last_only)


def run_inline(engine: TargetEngine, rounds: Rounds[T]) -> T:
    """Drive `rounds` alone: each call it yields is run at once (on `engine` unless it names its own); returns
    what it returns."""
    try:
        call = next(rounds)
        while True:
            call = rounds.send(forward_one(engine, call))
    except StopIteration as done:
        return done.value


__all__ = ["DraftShare", "ForwardCall", "Rounds", "TargetEngine", "forward_one", "run_inline"]
