"""A path-compressed suffix tree over token sequences, truncated at a maximum depth.

This is SuffixDecoding's data structure. Every suffix of every stored sequence is
a path from the root, cut at `max_depth` tokens; a node's `count` is the number of
suffixes that pass through it, so `child.count / node.count` estimates how often
the child's token follows the node's string. Drafting follows (or, for trees,
expands best-first) the most frequent children.

Why this shape, in pure Python:
- Edges are path-compressed: a node stands for a run of tokens
  `seq[start:start + length]` that all share one count, stored as a reference into
  the sequence's own token list, so novel text costs about one node per suffix.
- Sequences grow online. Each live sequence keeps one cursor per unfinished
  suffix (at most `max_depth`); a cursor always sits at the end of a node, and a
  split keeps the original node object as the lower half, so no cursor ever
  needs fixing after a split. Repeated text is re-merged into single edges.
- Matching a context's tail for every match length is read-only and
  incremental (`advance_positions`), so a caller that follows a growing
  sequence never re-matches from the root.
- Every node remembers where its two most recent occurrences end (`last`,
  `prev`: indices into the sequence), kept exact through splits and merges. In a
  tree over one sequence (a request's prompt + output) this turns any match into
  "copy what followed the most recent earlier occurrence" (`recent_draft`), the
  prompt-lookup draft with the longest match, at no extra search cost.
"""

from __future__ import annotations

from typing import Sequence
import heapq

from thinkahead.token_spec.names import SUFFIX_MIN_TOKEN_PROB, SUFFIX_SPEC_FACTOR, SUFFIX_SPEC_OFFSET
from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.suffix_eviction import CountOrder, remove_sequence

# A position in the tree: a node and how many tokens of its edge are consumed.
Position = tuple["_Node", int]

_EPS = 1e-6  # floor(match_len * factor + offset) tolerant to float error, as ArcticInference


class _Node:
    """One path-compressed edge and the node it leads to."""

    __slots__ = ("count", "children", "best", "seq", "start", "length", "last", "prev")

    def __init__(self, seq: list[int], start: int, length: int, count: int, last: int = -1) -> None:
        self.count = count
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None  # the child with the highest count
        self.seq = seq
        self.start = start
        self.length = length
        # Sequence index of the token at this node's end in its most recent and its
        # second most recent occurrence (-1: none). Meaningful in single-sequence trees.
        self.last = last
        self.prev = -1


class _LiveSequence:
    """A sequence still being appended to, with the cursors of its open suffixes."""

    __slots__ = ("tokens", "cursors")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # Cursors of suffixes shorter than max_depth, deepest (oldest) first;
        # cursor k sits at the end of the node reached by tokens[j:].
        self.cursors: list[_Node] = []


class SuffixTree:
    """Suffix tree over many token sequences; see the module docstring."""

    def __init__(self, max_depth: int = 64) -> None:
        if not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an integer >= 2, got {max_depth!r}")
        self.max_depth = max_depth
        self.root = _Node([], 0, 0, 0)
        self.num_nodes = 1
        self.num_tokens = 0
        self.version = 0  # bumped on every change, so callers can invalidate positions
        self._live: dict[int, _LiveSequence] = {}
        self._done: dict[int, list[int]] = {}
        # Wide nodes' children by count, kept once a removal needed them (suffix_eviction), and their size.
        self._orders: dict[_Node, CountOrder] = {}
        self._order_entries = 0

    # ----------------------------------------------------------------- building
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._live or seq_id in self._done

    def tokens(self, seq_id: int) -> list[int]:
        """The stored tokens of a sequence (live or finished)."""
        if seq_id in self._live:
            return self._live[seq_id].tokens
        if seq_id in self._done:
            return self._done[seq_id]
        raise ValueError(f"sequence {seq_id!r} is not in the tree")

    def cursors(self, seq_id: int) -> list[_Node]:
        """Nodes ending at each open suffix of a live sequence, deepest first."""
        return self._live[seq_id].cursors

    def extend(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Append tokens to a live sequence (created on first use)."""
        if seq_id in self._done:
            raise ValueError(f"sequence {seq_id!r} is finished and cannot grow")
        live = self._live.get(seq_id)
        if live is None:
            live = self._live[seq_id] = _LiveSequence()
        for token in token_ids:
            self._append(live, token)
        self.num_tokens += len(token_ids)
        self.version += 1

    def finish(self, seq_id: int) -> None:
        """Close a live sequence: it stays in the tree but can no longer grow."""
        live = self._live.pop(seq_id, None)
        if live is None:
            raise ValueError(f"sequence {seq_id!r} is not live")
        self._done[seq_id] = live.tokens

    def add(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Insert a whole finished sequence."""
        if seq_id in self:
            raise ValueError(f"sequence {seq_id!r} is already in the tree")
        self.extend(seq_id, token_ids)
        self.finish(seq_id)

    def _append(self, live: _LiveSequence, token: int) -> None:
        """Append one token: every open suffix (and a new one at the root) moves one token down.

        This is the hot loop of the cache (about max_depth steps per token), so the
        step is written out inline rather than as a method call per suffix.
        """
        seq = live.tokens
        index = len(seq)
        seq.append(token)
        root = self.root
        root.count += 1
        orders = self._orders  # empty unless sequences were removed
        advanced: list[_Node] = []
        keep = advanced.append
        live.cursors.append(root)  # the new one-token suffix starts at the root
        for node in live.cursors:
            children = node.children
            if children is None:
                if node.count == 1 and node.seq is seq and node.start + node.length == index:
                    node.length += 1  # our own leaf (unique text so far): grow it in place
                    node.last = index  # its only occurrence now ends here
                    keep(node)
                    continue
                leaf = _Node(seq, index, 1, 1, index)
                node.children = {token: leaf}
                node.best = leaf
                self.num_nodes += 1
                keep(leaf)
                continue
            child = children.get(token)
            if child is None:
                leaf = _Node(seq, index, 1, 1, index)
                children[token] = leaf
                if orders and node in orders:
                    orders[node].add(leaf)
                    self._order_entries += 1
                self.num_nodes += 1
                keep(leaf)
                continue
            if child.length > 1:
                if (
                    len(children) == 1
                    and node.count == child.count + 1
                    and child.seq is node.seq
                    and node.start + node.length == child.start
                    and node is not root
                ):
                    # The split below would be merged right back (every suffix through
                    # `node` continues into the child's first token): move that token
                    # from the child's edge to ours instead. Repeated text walks this way.
                    child.start += 1
                    child.length -= 1
                    node.length += 1
                    node.children = {child.seq[child.start]: child}
                    node.prev = child.last - child.length
                    node.last = index
                    keep(node)
                    continue
                # Split off the first token; the original object keeps the lower part
                # (and its children), so cursors at its end stay valid.
                upper = _Node(child.seq, child.start, 1, child.count)
                child.start += 1
                child.length -= 1
                # Every occurrence of `upper` continues through all of `child`.
                upper.last = child.last - child.length
                upper.prev = child.prev - child.length if child.prev >= 0 else -1
                upper.children = {child.seq[child.start]: child}
                upper.best = child
                children[token] = upper
                if orders and node in orders:
                    orders[node].replace(child, upper, upper.count)
                if node.best is child:
                    node.best = upper
                self.num_nodes += 1
                child = upper
            child.count += 1
            if orders and node in orders:
                orders[node].bump(child, child.count - 1)
            child.prev = child.last  # each landing is a new occurrence, in sequence order
            child.last = index
            best = node.best
            if best is not child and child.count > best.count:
                node.best = child
            if (
                node is not root
                and node.count == child.count
                and len(children) == 1
                and child.seq is node.seq
                and node.start + node.length == child.start
            ):
                # Every suffix through `node` continues into `child`: one edge again.
                node.length += child.length
                node.children = child.children
                node.best = child.best
                if orders and child in orders:
                    orders[node] = orders.pop(child)
                node.last, node.prev = child.last, child.prev
                self.num_nodes -= 1
                if len(self._live) > 1:
                    self._redirect(child, node)
                keep(node)
                continue
            keep(child)
        if len(advanced) >= self.max_depth:
            del advanced[0]  # that suffix just reached max_depth: it is complete
        live.cursors = advanced

    def _redirect(self, old: _Node, new: _Node) -> None:
        """Other live sequences' cursors at `old`, merged into `new` (which now ends there), move to `new`."""
        for live in self._live.values():
            cursors = live.cursors
            for k, node in enumerate(cursors):
                if node is old:
                    cursors[k] = new

    def remove(self, seq_id: int) -> None:
        """Remove a finished sequence and every count it contributed (cost: its own suffixes only)."""
        seq = self._done.pop(seq_id, None)
        if seq is None:
            if seq_id in self._live:
                raise ValueError(f"sequence {seq_id!r} is live; finish it before removing it")
            raise ValueError(f"sequence {seq_id!r} is not in the tree")
        remove_sequence(self, seq)

    # ----------------------------------------------------------------- matching
    def advance_positions(self, positions: list[Position], token: int) -> list[Position]:
        """Positions of every tail of `context + [token]`, given those of `context`.

        `positions[m - 1]` is where the last m tokens of the context end. A tail
        missing from the tree means every longer tail is missing too, so the list
        is contiguous from length 1 and is cut at the first miss (and at
        `max_depth - 1`, the longest match SuffixDecoding tries).
        """
        out: list[Position] = []
        first = _step(self.root, 0, token)
        if first is None:
            return out
        out.append(first)
        limit = self.max_depth - 1
        for node, off in positions:
            if len(out) >= limit:
                break
            nxt = _step(node, off, token)
            if nxt is None:
                break
            out.append(nxt)
        return out

    def match_positions(self, context: Sequence[int]) -> list[Position]:
        """Positions of every tail of `context` found in the tree, shortest first.

        Each tail is walked from the root edge by edge (slices compare in C), so
        this costs about (match length x edges per path) steps, not the
        (window x match length) of replaying the window token by token.
        """
        tail = list(context[-(self.max_depth - 1):])
        positions: list[Position] = []
        for m in range(1, len(tail) + 1):
            pos = self._walk(tail[-m:])
            if pos is None:
                break  # a missing tail means every longer tail is missing too
            positions.append(pos)
        return positions

    def _walk(self, tokens: list[int]) -> Position | None:
        node, off, i, n = self.root, 0, 0, len(tokens)
        while i < n:
            if off == node.length:
                children = node.children
                nxt = children.get(tokens[i]) if children is not None else None
                if nxt is None:
                    return None
                node, off = nxt, 0
            k = min(node.length - off, n - i)
            a = node.start + off
            if node.seq[a:a + k] != tokens[i:i + k]:
                return None
            off += k
            i += k
        return (node, off)

    def live_positions(self, seq_id: int) -> list[Position]:
        """Positions of the tails of a live sequence (its own open suffixes)."""
        return [(node, node.length) for node in reversed(self._live[seq_id].cursors)]

    # ----------------------------------------------------------------- drafting
    def recent_draft(self, positions: list[Position], max_tokens: int, min_match: int = 1) -> Draft:
        """Copy what followed the most recent earlier occurrence of the longest match.

        Prompt lookup with the longest context match the tree can see (up to
        `max_depth - 1` tokens) and a preference for the most recent occurrence:
        in agent loops the latest copy of a file or message is the one being
        edited. An occurrence counts when something follows it, so a context's
        own tail (always the latest occurrence of itself) is skipped. The chain
        is read from the sequence, so it can run past `max_depth`. Only defined
        for a tree holding exactly one sequence (a request's own tree).
        """
        if len(self._live) + len(self._done) != 1:
            raise ValueError("recent_draft needs a tree over exactly one sequence")
        if max_tokens <= 0:
            return Draft(source="recent")
        seq = next(iter(self._live.values())).tokens if self._live else next(iter(self._done.values()))
        n = len(seq)
        for m in range(len(positions), max(min_match, 1) - 1, -1):
            node, off = positions[m - 1]
            back = node.length - off  # tokens of the edge beyond the match
            end = node.last - back  # index of the match's last token, most recent occurrence
            if end + 1 >= n:
                if node.prev < 0:
                    continue  # the context's own tail is the only occurrence
                end = node.prev - back
            tokens = seq[end + 1:end + 1 + max_tokens]
            return Draft.chain(tokens, match_len=m, source="recent")
        return Draft(source="recent")

    def recent_alternatives(
        self, positions: list[Position], max_tokens: int, count: int
    ) -> list[tuple[int, list[int]]]:
        """Up to `count` other copies worth drafting besides `recent_draft`'s, as (match length, chain).

        Walking from the longest match down, each match length offers its two
        most recent occurrences; those with a continuation, other than the
        context's own tail and the occurrences already taken (the first one is
        `recent_draft`'s own), give a chain each. Text that was edited since its
        last copy (a changed line, a renamed variable) is then still drafted from
        the older copy or from a shorter match after the edit.
        """
        if len(self._live) + len(self._done) != 1:
            raise ValueError("recent_alternatives needs a tree over exactly one sequence")
        if max_tokens <= 0 or count <= 0:
            return []
        seq = next(iter(self._live.values())).tokens if self._live else next(iter(self._done.values()))
        n = len(seq)
        seen: set[int] = set()
        chains: list[tuple[int, list[int]]] = []
        primary = True
        for m in range(len(positions), 0, -1):
            node, off = positions[m - 1]
            back = node.length - off
            for occurrence in (node.last, node.prev):
                end = occurrence - back
                if occurrence < 0 or end + 1 >= n or end in seen:
                    continue
                seen.add(end)
                if primary:  # recent_draft's copy
                    primary = False
                    continue
                chains.append((m, seq[end + 1:end + 1 + max_tokens]))
                if len(chains) >= count:
                    return chains
        return chains

    def speculate(
        self,
        positions: list[Position],
        max_tokens: int,
        max_spec_factor: float = SUFFIX_SPEC_FACTOR,
        max_spec_offset: float = SUFFIX_SPEC_OFFSET,
        min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
        tree: bool = False,
    ) -> Draft:
        """Best draft over every match length (SuffixDecoding's rule).

        For match length m the budget is min(max_tokens, floor(m * factor +
        offset)); the draft with the highest score wins, ties going to the longer
        match. Match lengths are tried longest first and skipped when even a draft
        of probability 1 everywhere could not beat the best so far.
        """
        best: tuple[list[int], list[int], list[float], float] | None = None
        best_score, best_m = 0.0, 0
        depth_cap = self.max_depth
        for m in range(len(positions), 0, -1):
            budget = min(max_tokens, int(m * max_spec_factor + max_spec_offset + _EPS))
            if min(budget, depth_cap - m) <= best_score:
                continue
            node, off = positions[m - 1]
            if off == node.length and node.children is None:
                continue  # nothing ever followed this match
            found = (_tree_draft if tree else _chain_draft)(node, off, budget, min_token_prob)
            if found[3] > best_score:
                best, best_score, best_m = found, found[3], m
        if best is None:
            return Draft()
        tokens, parents, probs, score = best
        return Draft(token_ids=tokens, parents=parents, probs=probs, score=score, match_len=best_m)


def _step(node: _Node, off: int, token: int) -> Position | None:
    """Move one token down from a position, or None if the tree has no such path."""
    if off < node.length:
        return (node, off + 1) if node.seq[node.start + off] == token else None
    children = node.children
    if children is None:
        return None
    child = children.get(token)
    return None if child is None else (child, 1)


_Found = tuple[list[int], list[int], list[float], float]  # tokens, parents, probs, score


def _chain_draft(node: _Node, off: int, budget: int, min_prob: float) -> _Found:
    """Follow the most frequent continuation while its probability holds up."""
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(tokens) < budget:
        if off < node.length:
            n = min(budget - len(tokens), node.length - off)
            a = node.start + off
            tokens.extend(node.seq[a:a + n])
            probs.extend([prob] * n)
            off += n
            continue
        child = node.best
        if child is None:
            break
        p = prob * child.count / node.count
        if p < min_prob:
            break
        prob, node, off = p, child, 0
    return tokens, list(range(-1, len(tokens) - 1)), probs, float(sum(probs))


def _tree_draft(node: _Node, off: int, budget: int, min_prob: float) -> _Found:
    """Expand the most probable continuations first, up to `budget` tokens."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    heap: list[tuple[float, int, int, _Node, int, int]] = []
    tick = 0

    def push(node: _Node, off: int, prob: float, parent: int) -> None:
        nonlocal tick
        if off < node.length:
            heapq.heappush(heap, (-prob, tick, node.seq[node.start + off], node, off + 1, parent))
            tick += 1
            return
        if not node.children:
            return
        total = node.count
        for child in node.children.values():
            p = prob * child.count / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, tick, child.seq[child.start], child, 1, parent))
                tick += 1

    push(node, off, 1.0, -1)
    while heap and len(tokens) < budget:
        neg_p, _, token, n, o, parent = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        probs.append(-neg_p)
        push(n, o, -neg_p, len(tokens) - 1)
    return tokens, parents, probs, float(sum(probs))
