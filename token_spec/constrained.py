"""Speculation under a grammar: the decoder's three steps that a `Constraint` changes.

- `grammar_draft`: the tokens the grammar forces from here go first, as free draft tokens (SGLang's
  jump-forward, inside speculation: the verify pass still checks them), then the drafter's guess
  after them; the whole draft is pruned to what the grammar takes.
- `row_masks`: the grammar's allowed tokens at every row of a verify forward: row 0 after the
  committed context, row i + 1 after draft node i (its path from the root).
- `masked`: the logits with forbidden tokens at -inf. Verification then runs as ever on them, so a
  draft token the grammar forbids is rejected, the bonus token comes from the masked distribution,
  greedy with speculation equals greedy without it under the same grammar, and sampling follows the
  masked distribution exactly.

The grammar state moves only by committed tokens (`Constraint.advance`); every walk here rolls back
what it took.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.grammar import Constraint
from thinkahead.token_spec.verify import Acceptance, children_of


@contextmanager
def _given_back(constraint: Constraint) -> Iterator[list[int]]:
    """A walk's count of tokens taken (`taken[0]`), rolled back when it ends. Where the walk failed, its
    own error is the one raised: a matcher in error cannot roll back (a GrammarError became a
    ValueError, a 500 where the request's grammar was at fault)."""
    taken = [0]
    try:
        yield taken
    except BaseException:
        try:
            constraint.rollback(taken[0])
        except ValueError:
            pass
        raise
    constraint.rollback(taken[0])


def path_of(parents: list[int], node: int) -> list[int]:
    """Node indices from the root to `node` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def prune(constraint: Constraint, draft: Draft) -> Draft:
    """The part of `draft` the grammar takes: a chain up to its first refused token, a tree less every
    node whose path the grammar refuses (and the nodes below it); nothing after a stop token."""
    if not len(draft):
        return draft
    if draft.is_chain:
        n = _chain_prefix(constraint, draft.token_ids)
        return draft.truncated(n)
    keep: list[int] = []
    new_index: dict[int, int] = {}
    for i, parent in enumerate(draft.parents):
        if parent >= 0 and (parent not in new_index or draft.token_ids[parent] in constraint.stop_ids):
            continue
        tokens = [draft.token_ids[j] for j in path_of(draft.parents, i)]
        if constraint.valid_prefix(tokens) == len(tokens):
            new_index[i] = len(keep)
            keep.append(i)
    if len(keep) == len(draft):
        return draft
    return Draft(
        token_ids=[draft.token_ids[i] for i in keep],
        parents=[-1 if draft.parents[i] < 0 else new_index[draft.parents[i]] for i in keep],
        probs=[draft.probs[i] for i in keep] if draft.probs else [],
        score=float(sum(draft.probs[i] for i in keep)) if draft.probs else 0.0,
        match_len=draft.match_len,
        source=draft.source,
        q=None if draft.q is None else draft.q[keep],
    )


def _chain_prefix(constraint: Constraint, tokens: list[int]) -> int:
    n = constraint.valid_prefix(tokens)
    for k, t in enumerate(tokens[:n]):  # nothing is drafted past a stop token
        if t in constraint.stop_ids:
            return k + 1
    return n


def grammar_draft(constraint: Constraint, room: int, propose: Callable[[list[int], int], Draft] | None,
                  budget: int) -> tuple[Draft, int]:
    """(the round's draft, how many of its tokens the grammar forced).

    `propose(forced, budget)` is the drafter's guess after the context and the forced tokens (None:
    forced tokens only). The forced tokens are a chain at the root; the drafter's draft hangs below
    its last token. At most `room` tokens in all.
    """
    forced = constraint.forced(room)
    guess = propose(forced, min(budget, room - len(forced))) if propose is not None and room > len(forced) else Draft()
    if not forced:
        return prune(constraint, guess).truncated(room), 0
    if not len(guess):
        return Draft.chain(forced, source="grammar"), len(forced)
    k = len(forced)
    tokens = forced + guess.token_ids
    parents = list(range(-1, k - 1)) + [k - 1 if p < 0 else p + k for p in guess.parents]
    probs = [1.0] * k + (list(guess.probs) if guess.probs else [1.0] * len(guess))
    joined = Draft(token_ids=tokens, parents=parents, probs=probs, score=float(sum(probs)),
                   match_len=guess.match_len, source=guess.source or "grammar")
    return prune(constraint, joined).truncated(room), k


def row_masks(constraint: Constraint, draft: Draft) -> Any:
    """Bool [1 + len(draft), vocab]: the allowed tokens after the context (row 0) and after each draft
    node's path (row i + 1). Rows after a stop token allow everything (nothing follows it)."""
    import torch

    rows = [constraint.mask()]
    if not bool(rows[0].any()):
        raise ValueError("the grammar allows no token after the output so far")
    with _given_back(constraint) as taken:
        if draft.is_chain:
            for t in draft.token_ids:
                if t in constraint.stop_ids:
                    break
                constraint.advance([t])
                taken[0] += 1
                rows.append(constraint.mask())
        else:
            for i in range(len(draft)):
                path = [draft.token_ids[j] for j in path_of(draft.parents, i)]
                if any(t in constraint.stop_ids for t in path):
                    rows.append(torch.ones_like(rows[0]))
                    continue
                constraint.advance(path)
                taken[0] += len(path)
                rows.append(constraint.mask())
                constraint.rollback(len(path))
                taken[0] -= len(path)
    while len(rows) < len(draft) + 1:
        rows.append(torch.ones_like(rows[0]))
    return torch.stack(rows)


def verify_greedy_constrained(logits: Any, draft: Draft, constraint: Constraint) -> Acceptance:
    """Greedy verification under the grammar: what `verify_greedy` accepts on `masked(logits,
    row_masks(...))`, walking the draft from the root and computing the grammar's mask only on the
    rows the walk reaches (a row's masked argmax is its plain argmax wherever the mask allows that:
    the first index of the maximum either way)."""
    children = children_of(draft.parents)
    argmax = logits.argmax(dim=-1).tolist()
    accepted: list[int] = []
    node = -1
    with _given_back(constraint) as taken:
        while True:
            want = argmax[node + 1]
            allowed = constraint.mask()
            if want >= allowed.shape[-1] or not bool(allowed[want]):
                if not bool(allowed.any()):
                    raise ValueError("the grammar allows no token after the output so far")
                want = int(masked(logits[node + 1 : node + 2], allowed[None])[0].argmax())
            nxt = next((c for c in children.get(node, ()) if draft.token_ids[c] == want), None)
            if nxt is None or want in constraint.stop_ids:  # a stop token ends the output: it is the bonus
                return Acceptance(accepted, want)
            accepted.append(nxt)
            node = nxt
            constraint.advance([want])
            taken[0] += 1


def masked(logits: Any, masks: Any) -> Any:
    """`logits` with the tokens each row's mask forbids at -inf (a new tensor)."""
    vocab = min(logits.shape[-1], masks.shape[-1])
    out = logits.clone()
    out[:, :vocab] = out[:, :vocab].masked_fill(~masks[:, :vocab], float("-inf"))
    if logits.shape[-1] > vocab:
        out[:, vocab:] = float("-inf")
    return out


__all__ = ["grammar_draft", "masked", "path_of", "prune", "row_masks", "verify_greedy_constrained"]
