"""Removing a sequence from a `SuffixTree` at a cost that does not grow with the tree, and memory estimates.

A removal walks only the removed sequence's own suffixes (at most `max_depth`
nodes each) and undoes their counts. What used to make it grow with the tree, or
its memory drift from the tree's counters, is done here in constant time per
visited node:

- `node.best` (the child with the highest count) stays exact. A count drops by
  exactly one, so when the best child drops from c to c - 1 the new best is either
  another child that also has count c or the same child. A node with fewer than
  `WIDE_CHILDREN` children rescans them (as before); a wide node (the root, the
  first tokens of common phrases: up to the vocabulary) keeps a `CountOrder`, its
  children grouped by count, built the first time a removal needs it and kept up
  to date by every later insertion and removal; the first child to reach the tied
  count wins. A tree that never removes anything (a request's own tree) never
  builds one, so insertion there pays an empty-dict check per step.
- The tree stays path-compressed: a node left with one child of its own count
  takes the child's edge into its own, as insertion does.
- No node keeps a removed sequence alive. A node refers to its edge's tokens
  inside the list of the sequence that created it; a node that outlives that
  sequence (later responses share the text) is pointed at the same tokens in its
  best child's list (every list holds a node's tokens just before its children's),
  or, for a leaf, given a copy of its own edge.

`global_tree_bytes` and `request_tree_bytes` estimate memory from the trees'
counters; `shared_ids` makes a stored response token cost 8 bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from thinkahead.token_spec.suffix_tree import SuffixTree, _Node

WIDE_CHILDREN = 64  # a node with this many children keeps a CountOrder once a removal needs its best child
NARROW_CHILDREN = 16  # a node whose children fall below this drops its CountOrder

# Memory estimates (CPython 3.11, 64-bit): fitted to tracemalloc over caches of GSM8K answers (Qwen
# tokens) and of synthetic responses (10-800 tokens, vocabularies of 4k-30k, little to much repetition),
# depth 16-64, filling and full: within 7% of it everywhere (tests/test_suffix_memory.py checks 15%).
NODE_BYTES = 168  # a node and its share of children dicts
CHURN_NODE_BYTES = 28  # more per node once the responses have turned over: dicts never shrink
ORDER_ENTRY_BYTES = 90  # a child listed in a CountOrder
TOKEN_BYTES = 9  # a response token: its list slot (its int object is shared, see `shared_ids`)
RESPONSE_BYTES = 650  # a response's list, ids and entries in the cache's dicts
# A request's or session's tree: its ids are the caller's int objects, and each node's occurrence
# indices (`last`, `prev`) are ints of their own past 256 tokens. Within 3% of tracemalloc on the
# recorded agent sessions (bench/results/*/tokens.jsonl, 163 conversations, 140k tokens).
REQUEST_NODE_BYTES = 190
# The native tree (token_spec/native) reports its own arrays' size (`memory_bytes`); a cached response
# costs this much more in the cache's Python dicts (its id, its entry in `_cached`).
NATIVE_RESPONSE_BYTES = 250
REQUEST_TOKEN_BYTES = 40


def global_tree_bytes(tree: SuffixTree, responses: int, evicted: int) -> int:
    """Estimated memory of a cache's global tree holding `responses` responses, after `evicted` left it."""
    if hasattr(tree, "memory_bytes"):  # the native tree counts its own arrays
        return tree.memory_bytes() + responses * NATIVE_RESPONSE_BYTES
    churn = min(1.0, evicted / responses) if responses else 0.0
    return int(
        tree.num_nodes * (NODE_BYTES + CHURN_NODE_BYTES * churn)
        + tree._order_entries * ORDER_ENTRY_BYTES
        + tree.num_tokens * TOKEN_BYTES
        + responses * RESPONSE_BYTES
    )


def shared_ids(tree: SuffixTree, tokens: Sequence[int]) -> list[int]:
    """`tokens` with each id replaced by the equal int object the tree already holds.

    A tokenizer or an engine hands out a new int object (32 bytes) per token; the
    tree holds each id it contains once anyway, as a key of the root's children,
    and the root child's edge starts with that very object. Sharing it makes a
    stored token cost its 8-byte list slot, with no table of its own to keep.
    """
    children = tree.root.children or {}
    seen: dict[int, int] = {}
    out: list[int] = []
    for token in tokens:
        node = children.get(token)
        if node is not None:
            token = node.seq[node.start]
        else:
            token = seen.setdefault(token, token)
        out.append(token)
    return out


def request_tree_bytes(tree: SuffixTree) -> int:
    """Estimated memory of a request's (or an idle session's) tree."""
    if hasattr(tree, "memory_bytes"):
        return tree.memory_bytes()
    return tree.num_nodes * REQUEST_NODE_BYTES + tree.num_tokens * REQUEST_TOKEN_BYTES


class CountOrder:
    """A node's children grouped by count; each group in the order its members reached that count."""

    __slots__ = ("groups",)

    def __init__(self, children: dict[int, _Node]) -> None:
        self.groups: dict[int, dict[_Node, None]] = {}
        for child in children.values():
            self.add(child, child.count)

    def add(self, child: _Node, count: int = 1) -> None:
        group = self.groups.get(count)
        if group is None:
            self.groups[count] = {child: None}
        else:
            group[child] = None

    def discard(self, child: _Node, count: int) -> None:
        group = self.groups[count]
        del group[child]
        if not group:
            del self.groups[count]

    def bump(self, child: _Node, old: int) -> None:
        """`child`'s count went from `old` to `old + 1` (inlined: insertion calls this at wide nodes)."""
        groups = self.groups
        group = groups[old]
        del group[child]
        if not group:
            del groups[old]
        up = groups.get(old + 1)
        if up is None:
            groups[old + 1] = {child: None}
        else:
            up[child] = None

    def drop(self, child: _Node, old: int) -> None:
        """`child`'s count went from `old` to `old - 1` (0: it left the node)."""
        groups = self.groups
        group = groups[old]
        del group[child]
        if not group:
            del groups[old]
        if old > 1:
            down = groups.get(old - 1)
            if down is None:
                groups[old - 1] = {child: None}
            else:
                down[child] = None

    def replace(self, old_child: _Node, new_child: _Node, count: int) -> None:
        """`new_child` took `old_child`'s place (a split) with the same count."""
        self.discard(old_child, count)
        self.add(new_child, count)

    def first(self, count: int) -> _Node | None:
        group = self.groups.get(count)
        return next(iter(group)) if group else None

    def __len__(self) -> int:
        return sum(len(group) for group in self.groups.values())


def remove_sequence(tree: SuffixTree, seq: list[int]) -> None:
    """Undo every count `seq` (a finished sequence, already unlisted) contributed to `tree`."""
    orders = tree._orders
    depth_cap = tree.max_depth
    root = tree.root
    n = len(seq)
    stranded: list[tuple[int, _Node]] = []  # (depth, node): nodes that stay but whose tokens are in `seq`
    for j in range(n):
        root.count -= 1
        node = root
        pos = j
        end = min(n, j + depth_cap)
        while pos < end:
            token = seq[pos]
            children = node.children
            child = children[token]
            old = child.count
            child.count = old - 1
            order = orders.get(node) if orders else None
            if order is not None:
                order.drop(child, old)
            if old == 1:
                del children[token]
                tree.num_nodes -= _drop_subtree(tree, child)
                left = len(children)
                if not left:
                    node.children = None
                    node.best = None
                    if order is not None:
                        del orders[node]
                        tree._order_entries -= 1
                    break
                if order is not None:
                    tree._order_entries -= 1
                    if left < NARROW_CHILDREN:
                        del orders[node]
                        tree._order_entries -= left
                        order = None
                if node.best is child:
                    node.best = _new_best(tree, node, child, old, order)
                if len(children) == 1 and node is not root and node.best.count == node.count:
                    _merge(tree, node, node.best)  # the one child left continues every suffix: one edge
                    if node.seq is seq:
                        stranded.append((pos - j, node))
                break
            if node.best is child:
                node.best = _new_best(tree, node, child, old, order)
            pos += child.length
            if len(children) == 1 and node is not root and child.count == node.count:
                _merge(tree, node, child)  # every suffix through `node` continues into `child`: one edge again
                child = node
            if child.seq is seq:
                stranded.append((pos - j, child))
            node = child
        else:  # the suffix ended at `node`: its one child may now continue every suffix through it
            children = node.children
            if children is not None and len(children) == 1 and node is not root and node.best.count == node.count:
                _merge(tree, node, node.best)
                if node.seq is seq:
                    stranded.append((pos - j, node))
    tree.num_tokens -= n
    tree.version += 1
    # Deepest first, so a node can take its tokens from a child that was just given a living list.
    stranded.sort(key=_depth, reverse=True)
    for _, node in stranded:
        if node.seq is not seq or node.count == 0:
            continue  # seen already, or merged away
        best = node.best
        if best is not None and best.seq is not seq and best.start >= node.length:
            node.seq, node.start = best.seq, best.start - node.length  # the same tokens, on the child's path
        else:
            node.seq, node.start = seq[node.start:node.start + node.length], 0  # a copy of its own edge only


def _merge(tree: SuffixTree, node: _Node, child: _Node) -> None:
    """Fold `node`'s only child (of the same count) into its edge, as insertion does.

    A node's list (a sequence along the node's path, or a copy of an edge) holds its
    tokens just before where its children's start, so the merged edge is normally
    the child's list read from `node.length` tokens earlier; only a child whose
    list is a copy of its own edge needs a new list.
    """
    if child.seq is not node.seq or node.start + node.length != child.start:
        if child.start >= node.length:
            node.seq, node.start = child.seq, child.start - node.length
        else:
            a = node.start
            node.seq = node.seq[a:a + node.length] + child.seq[child.start:child.start + child.length]
            node.start = 0
    node.length += child.length
    node.children = child.children
    node.best = child.best
    node.last, node.prev = child.last, child.prev
    child.count = 0  # merged away
    tree.num_nodes -= 1
    if tree._live:
        tree._redirect(child, node)  # a live sequence's suffix that ended at `child` now ends at `node`
    orders = tree._orders
    if orders and child in orders:
        orders[node] = orders.pop(child)


def _new_best(tree: SuffixTree, node: _Node, child: _Node, old: int, order: CountOrder | None) -> _Node:
    """The best child of `node` after its best child `child` dropped from `old` to `old - 1`."""
    children = node.children
    if order is None:
        if len(children) < WIDE_CHILDREN:
            return max(children.values(), key=_count)
        order = tree._orders[node] = CountOrder(children)  # once; kept up to date from now on
        tree._order_entries += len(children)
    tied = order.first(old)  # another child still at the old top count (always one when `child` left)
    return tied if tied is not None else child


def _drop_subtree(tree: SuffixTree, node: _Node) -> int:
    """Nodes in a subtree that just left the tree (a count-1 node's: one path, at most max_depth)."""
    orders = tree._orders
    size = 0
    stack = [node]
    while stack:
        n = stack.pop()
        size += 1
        if n.children:
            stack.extend(n.children.values())
            if orders and orders.pop(n, None) is not None:
                tree._order_entries -= len(n.children)
    return size


def _count(node: _Node) -> int:
    return node.count


def _depth(item: tuple[int, _Node]) -> int:
    return item[0]
