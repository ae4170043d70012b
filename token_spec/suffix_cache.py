"""SuffixDecoding's cache: a tree per live request and one global tree of earlier outputs.

One `SuffixCache` serves every request and agent that talks to one target model.
A live request's own tree covers its prompt and its output so far; when the
request stops, its output joins the global tree, where every later request (of
any agent) can draft from it. The global tree evicts whole responses, oldest
first, by count and by an estimated memory cap. `save` / `load` keep a warm
cache between batch jobs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Sequence
import array
import json
import operator
import os
import sys

from thinkahead.token_spec.draft import Draft
from thinkahead.token_spec.suffix_tree import Position, SuffixTree

# Rough CPython sizes, measured with tracemalloc on the benchmark cache: a node
# with its slots and its share of children dicts, and a stored token.
NODE_BYTES = 190
TOKEN_BYTES = 40

_FILE_MAGIC = "thinkahead-suffix-cache"
_FILE_VERSION = 1


@dataclass(slots=True)
class _Request:
    tree: SuffixTree  # over prompt + output; its one sequence has id 0
    prompt_len: int
    global_positions: list[Position] = field(default_factory=list)
    global_version: int = -1  # the global tree version the positions belong to


class SuffixCache:
    """Per-request and global suffix trees with SuffixDecoding's semantics.

    Args:
        max_depth: longest suffix stored (and so the longest match tried, minus one).
        max_cached_requests: responses kept in the global tree; 0 disables the
            global tree, a negative value means no limit.
        max_memory_bytes: estimated memory cap of the global tree, or None.
    """

    def __init__(
        self,
        max_depth: int = 64,
        max_cached_requests: int = 10_000,
        max_memory_bytes: int | None = None,
    ) -> None:
        if not isinstance(max_cached_requests, int):
            raise ValueError(f"max_cached_requests must be an integer, got {max_cached_requests!r}")
        if max_memory_bytes is not None and max_memory_bytes <= 0:
            raise ValueError(f"max_memory_bytes must be positive or None, got {max_memory_bytes!r}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_memory_bytes = max_memory_bytes
        self.global_tree = SuffixTree(max_depth)
        self._requests: dict[Hashable, _Request] = {}
        self._cached: OrderedDict[Hashable, int] = OrderedDict()  # rid -> seq id, oldest first
        self._next_seq_id = 0

    def clear(self) -> None:
        """Forget every cached output (a cold cache), e.g. between benchmark runs that must not share."""
        if self._requests:
            raise ValueError(f"cannot clear the suffix cache while requests are live: {list(self._requests)[:5]}")
        self.global_tree = SuffixTree(self.max_depth)
        self._cached.clear()

    # --------------------------------------------------------------- lifecycle
    @property
    def active_requests(self) -> list[Hashable]:
        return list(self._requests)

    @property
    def cached_requests(self) -> list[Hashable]:
        """Requests whose outputs are in the global tree, oldest first."""
        return list(self._cached)

    def start_request(self, rid: Hashable, prompt_ids: Sequence[int]) -> None:
        """Begin a request: build its own tree over the prompt."""
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already active")
        tree = SuffixTree(self.max_depth)
        tree.extend(0, _checked_tokens(prompt_ids, "prompt_ids"))
        self._requests[rid] = _Request(tree=tree, prompt_len=len(prompt_ids))

    def extend(self, rid: Hashable, token_ids: Sequence[int]) -> None:
        """Append generated tokens to a live request."""
        req = self._request(rid)
        token_ids = _checked_tokens(token_ids, "token_ids")
        req.tree.extend(0, token_ids)
        if req.global_version == self.global_tree.version:
            advance = self.global_tree.advance_positions
            positions = req.global_positions
            for token in token_ids:
                positions = advance(positions, token)
            req.global_positions = positions

    def output(self, rid: Hashable) -> list[int]:
        """The tokens generated so far for a live request."""
        req = self._request(rid)
        return req.tree.tokens(0)[req.prompt_len:]

    def stop_request(self, rid: Hashable) -> None:
        """End a request; its output joins the global tree (evicting as needed)."""
        req = self._requests.pop(rid, None)
        if req is None:
            raise ValueError(f"request {rid!r} is not active")
        response = req.tree.tokens(0)[req.prompt_len:]
        if self.max_cached_requests == 0 or not response:
            return
        if rid in self._cached:
            self.evict(rid)
        self._insert(rid, response)

    def _insert(self, rid: Hashable, response: Sequence[int]) -> None:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.global_tree.add(seq_id, response)
        self._cached[rid] = seq_id
        self._enforce_limits(keep=rid)

    def evict(self, rid: Hashable) -> None:
        """Drop one cached response from the global tree."""
        seq_id = self._cached.pop(rid, None)
        if seq_id is None:
            raise ValueError(f"request {rid!r} has no cached response")
        self.global_tree.remove(seq_id)

    def _enforce_limits(self, keep: Hashable) -> None:
        def over() -> bool:
            if 0 < self.max_cached_requests < len(self._cached):
                return True
            return self.max_memory_bytes is not None and self.estimated_bytes > self.max_memory_bytes

        while over() and len(self._cached) > 1:
            oldest = next(iter(self._cached))
            if oldest == keep:
                break
            self.evict(oldest)

    @property
    def estimated_bytes(self) -> int:
        """Estimated memory of the global tree."""
        tree = self.global_tree
        return tree.num_nodes * NODE_BYTES + tree.num_tokens * TOKEN_BYTES

    # ----------------------------------------------------------------- drafting
    def speculate(
        self,
        rid: Hashable,
        context: Sequence[int],
        max_tokens: int = 16,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        tree: bool = False,
    ) -> Draft:
        """Draft a continuation of `context` from the request's tree and the global tree.

        Every tail of the context is matched; the budget for a match of length m
        is min(max_tokens, floor(m * max_spec_factor + max_spec_offset)); tokens
        stop below `min_token_prob`; the higher-scoring of the local and global
        draft wins (the local one on a tie). `context` is normally the request's
        prompt + output so far, which is matched incrementally; any other context
        is matched from scratch.
        """
        req = self._request(rid)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor}")
        if not context or max_tokens == 0:
            return Draft(source="suffix")
        window = self.max_depth - 1
        own = req.tree.tokens(0)
        is_own = len(context) == len(own) and list(context[-window:]) == own[-window:]
        params = (max_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree)

        local_positions = req.tree.live_positions(0) if is_own else req.tree.match_positions(context)
        best = req.tree.speculate(local_positions, *params)
        best.source = "suffix-local"

        if self._cached:
            gtree = self.global_tree
            if is_own and req.global_version == gtree.version:
                positions = req.global_positions
            else:
                positions = gtree.match_positions(context)
                if is_own:
                    req.global_positions, req.global_version = positions, gtree.version
            draft = gtree.speculate(positions, *params)
            if draft.score > best.score:
                draft.source = "suffix-global"
                best = draft
        return best

    def _request(self, rid: Hashable) -> _Request:
        req = self._requests.get(rid)
        if req is None:
            raise ValueError(f"request {rid!r} is not active (call start_request first)")
        return req

    # -------------------------------------------------------------- persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write the global cache (config and cached responses, oldest first).

        The file is a JSON header line followed by the responses' tokens as
        little-endian int32. It is written to a temporary name and renamed, so a
        crash never leaves a truncated cache behind.
        """
        path = Path(path)
        rids, lengths, tokens = [], [], array.array("i")
        for rid, seq_id in self._cached.items():
            seq = self.global_tree.tokens(seq_id)
            rids.append(rid)
            lengths.append(len(seq))
            tokens.extend(seq)
        header = {
            "format": _FILE_MAGIC,
            "version": _FILE_VERSION,
            "max_depth": self.max_depth,
            "max_cached_requests": self.max_cached_requests,
            "max_memory_bytes": self.max_memory_bytes,
            "request_ids": rids,
            "lengths": lengths,
        }
        try:
            header_line = json.dumps(header).encode() + b"\n"
        except TypeError as exc:
            raise ValueError(f"cached request ids must be JSON values to be saved: {exc}") from None
        if array.array("i").itemsize != 4:  # pragma: no cover - every CPython platform we run on
            raise RuntimeError("int32 arrays are required to save a suffix cache")
        if sys.byteorder != "little":  # pragma: no cover
            tokens.byteswap()
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(header_line)
            fh.write(tokens.tobytes())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike, **overrides: int | None) -> SuffixCache:
        """Rebuild a cache written by `save`; keyword arguments override its config."""
        path = Path(path)
        with open(path, "rb") as fh:
            header_line = fh.readline()
            payload = fh.read()
        try:
            header = json.loads(header_line)
        except ValueError:
            raise ValueError(f"{path} is not a thinkahead suffix cache file") from None
        if not isinstance(header, dict) or header.get("format") != _FILE_MAGIC:
            raise ValueError(f"{path} is not a thinkahead suffix cache file")
        if header.get("version") != _FILE_VERSION:
            raise ValueError(f"{path}: unsupported suffix cache version {header.get('version')!r}")
        tokens = array.array("i")
        tokens.frombytes(payload)
        if sys.byteorder != "little":  # pragma: no cover
            tokens.byteswap()
        lengths = header["lengths"]
        if sum(lengths) != len(tokens) or len(lengths) != len(header["request_ids"]):
            raise ValueError(f"{path} is truncated or corrupt: lengths do not match the tokens")
        config = {k: header[k] for k in ("max_depth", "max_cached_requests", "max_memory_bytes")}
        config.update(overrides)
        cache = cls(**config)
        offset = 0
        for rid, n in zip(header["request_ids"], lengths):
            cache._insert(rid, tokens[offset:offset + n].tolist())
            offset += n
        return cache


def _checked_tokens(token_ids: Sequence[int], what: str) -> list[int]:
    """Token ids as a list of non-negative ints, or a ValueError naming the problem."""
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of token ids, not {type(token_ids).__name__}")
    try:
        out = [operator.index(t) for t in token_ids]
    except TypeError:
        bad = next(t for t in token_ids if not hasattr(t, "__index__"))
        raise ValueError(f"{what} must hold integer token ids, found {bad!r}") from None
    if out and min(out) < 0:
        raise ValueError(f"{what} must hold non-negative token ids, found {min(out)}")
    return out
