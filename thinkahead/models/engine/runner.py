"""A local engine over any transformers causal LM: chain and tree forwards with exact KV rollback.

The engine keeps one `DynamicCache` per sequence (an `EngineSession`) and offers the three
operations a speculative decoder needs:

- `forward`: append tokens (a chain, or a tree of draft candidates in one pass) and get logits;
- `keep_path`: after a tree forward, keep only the accepted root-to-node path (exact, no recompute);
- `truncate`: roll the sequence back to a shorter prefix.

The cache is a config-less `DynamicCache` (a `GrowingCache`, kv_cache.py, that appends in place):
every layer keeps all its keys/values, so it can always be cropped, and sliding-window layers
(Gemma3) get their window from the attention mask.
A cache built from the model config would drop old sliding-window states and refuse to crop
once the window is full. See docs/token_spec.md for the measured pitfalls.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING

import torch

from thinkahead.models.engine.kv_cache import GrowingCache
from thinkahead.token_spec.engine import ForwardCall

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_FULL = "full_attention"
_SLIDING = "sliding_attention"


@dataclass(slots=True)
class EngineSession:
    """KV state of one sequence on one engine.

    `last_start` and `last_parents` record the most recent forward (the prefix length it began at
    and its parent list, a chain written as [-1, 0, 1, ...]) so that `keep_path` can check that it
    is asked to keep a real root-to-node path of that forward; any other operation clears them.
    """

    cache: object  # transformers DynamicCache
    length: int = 0  # number of tokens whose K/V are in the cache
    last_start: int | None = None
    last_parents: list[int] | None = None


class HFEngine:
    """Runs a loaded transformers causal LM (Llama, Qwen2, Gemma3 text, ...) over KV-cached sessions.

    All logits are returned as float32 on the model's device, one row per fed token.
    """

    def __init__(self, model: PreTrainedModel):
        """Wrap `model` (already loaded and in eval mode); reads its vocabulary and attention layout."""
        # names the model, dtype and machine for a forward-cost curve kept across processes (calibration.py);
        # None: measured in every process
        self.calibration_key: str | None = None
        config = model.config.get_text_config(decoder=True)
        layer_types = list(getattr(config, "layer_types", None) or [])
        unknown = sorted(set(layer_types) - {_FULL, _SLIDING})
        if unknown:
            raise ValueError(f"HFEngine supports full and sliding-window attention layers only, got {unknown}")
        self.model = model
        self.name: str = getattr(model.config, "name_or_path", "") or type(model).__name__
        out_emb = model.get_output_embeddings()
        # `out_features` exists on nn.Linear and on its int8 replacement (whose `weight` is a method)
        self.vocab_size: int = int(getattr(out_emb, "out_features", None) or config.vocab_size)
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.device
        self.forwarded_tokens = 0  # tokens every forward has read, over the engine's life (prefill accounting)
        # transformers >= 5.24 names the KV cache argument `cache` (`past_key_values` is deprecated there)
        self._cache_arg = _cache_arg(model)
        self._base_cache_arg = _cache_arg(model.base_model)  # `head=` forwards call the base model
        # Layer type -> index of its first layer (for cache mask sizes); empty when every layer is full
        # attention, in which case a plain 4D mask tensor is passed (Llama accepts no dict form).
        self._mask_layers: dict[str, int] = {}
        if _SLIDING in layer_types:
            self._mask_layers = {t: layer_types.index(t) for t in (_FULL, _SLIDING) if t in layer_types}
        self._window: int | None = getattr(config, "sliding_window", None) if self._mask_layers else None
        if self._mask_layers and not self._window:
            raise ValueError("the model has sliding-window layers but its config sets no sliding_window")

    def new_session(self) -> EngineSession:
        """Start an empty sequence with its own croppable cache."""
        return EngineSession(cache=GrowingCache())

    def forward(
        self,
        session: EngineSession,
        token_ids: list[int],
        parents: list[int] | None = None,
        last_only: bool = False,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_hidden: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Append `token_ids` to the session and return their float32 logits `[len(token_ids), vocab]`.

        With `parents=None` the tokens form a chain after the session's prefix. Otherwise they form a
        tree in topological order: `parents[i]` is the index of token i's parent within `token_ids`
        (`parents[i] < i`), or -1 when the node hangs directly off the prefix. A tree runs in one pass
        with each node attending to the prefix, its ancestors and itself at position prefix + depth;
        afterwards all tree nodes are in the cache (`session.length = P + T`) until `keep_path`.
        `last_only=True` returns only the last row `[1, vocab]`: a prefill then skips the vocabulary
        projection of every other position (for a 150k vocabulary that is most of a long prompt's cost).
        `head` replaces the model's output layer: it maps the last layer's hidden states `[n, hidden]` to
        the logits returned (a drafter's output layer over part of the vocabulary). `on_hidden` is given those
        hidden states of the rows returned (a draft head reads them), before the output layer reads them.
        """
        self._check_tokens(token_ids)
        start = session.length
        self._check_cache(session)
        n = len(token_ids)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        if parents is None:
            chain = list(range(-1, n - 1))
            position_ids = torch.arange(start, start + n, device=self.device).unsqueeze(0)
            mask = None  # the model builds the causal (and sliding-window) masks itself
        else:
            self._check_parents(parents, n)
            chain = [int(p) for p in parents]
            depth = _depths(chain)
            position_ids = (start + depth).unsqueeze(0).to(self.device)
            mask = self._tree_mask(session, start, chain, depth)
        with torch.inference_mode():
            if head is None and on_hidden is None:
                logits = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=position_ids,
                    use_cache=True,
                    **{self._cache_arg: session.cache},
                    logits_to_keep=1 if last_only else 0,
                ).logits[0]
            else:
                hidden = self._final_hidden(ids, mask, position_ids, session.cache)[0]
                hidden = hidden[-1:] if last_only else hidden
                if on_hidden is not None:
                    on_hidden(hidden)
                logits = (self.model.lm_head if head is None else head)(hidden)
        session.length = start + n
        session.last_start, session.last_parents = start, chain
        self.forwarded_tokens += n
        return logits.float()

    @property
    def batches_rows(self) -> bool:
        """Whether `forward_batch` runs several sequences in one forward (a fused GGUF Qwen2 on the native
        layer loop, whose rows never depend on the batch); otherwise it runs them one after another."""
        ready = getattr(self.model, "ragged_ready", None)
        return bool(ready is not None and ready())

    def forward_batch(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        """The logits of every call, as `forward` gives them call by call, the same bits; where the engine
        `batches_rows`, in one forward over every call's tokens (each sequence attends only to its own
        cache; each call's rows through its own `head`, if it has one). A session may appear in one call only."""
        if len({id(c.session) for c in calls}) != len(calls):
            raise ValueError("a batch may hold each session in one call only")
        if len(calls) < 2 or not self.batches_rows:
            return [self.forward(c.session, c.token_ids, c.parents, c.last_only, c.head, c.on_hidden) for c in calls]
        ids: list[int] = []
        positions, segments, chains = [], [], []
        for c in calls:  # everything checked before any cache changes
            self._check_tokens(c.token_ids)
            self._check_cache(c.session)
            start, n = c.session.length, len(c.token_ids)
            if c.parents is None:
                chain, mask = list(range(-1, n - 1)), None
                positions.append(torch.arange(start, start + n))
            else:
                self._check_parents(c.parents, n)
                chain = [int(p) for p in c.parents]
                depth = _depths(chain)
                positions.append(start + depth)
                mask = self._tree_mask(c.session, start, chain, depth)
            ids.extend(c.token_ids)
            segments.append((n, mask, c.session.cache))
            chains.append(chain)
        with torch.inference_mode():
            hidden = self.model.ragged_hidden(torch.tensor(ids, dtype=torch.long), torch.cat(positions), segments)
            rows, picks, first = [], [], 0
            for c in calls:
                n = len(c.token_ids)
                picks.append((len(rows), 1 if c.last_only else n))
                rows.extend([first + n - 1] if c.last_only else range(first, first + n))
                first += n
            kept = hidden[torch.tensor(rows)]
            for c, (at, count) in zip(calls, picks):
                if c.on_hidden is not None:
                    c.on_hidden(kept[at:at + count])
            if all(c.head is None for c in calls):
                logits = self.model.lm_head(kept).float()
                outs = [logits[at:at + count] for at, count in picks]
            else:  # heads differ in width (each draft request keeps its own ids): each call's rows through its own
                outs = [(self.model.lm_head if c.head is None else c.head)(kept[at:at + count]).float()
                        for c, (at, count) in zip(calls, picks)]
        for c, chain in zip(calls, chains):
            start = c.session.length
            c.session.length = start + len(c.token_ids)
            c.session.last_start, c.session.last_parents = start, chain
            self.forwarded_tokens += len(c.token_ids)
        return outs

    def keep_path(self, session: EngineSession, start: int, path: list[int]) -> None:
        """Keep only the nodes `path` (root-to-node, strictly increasing) of the forward that began at `start`.

        Their K/V slots move to the front of that forward's region in every layer and the rest is
        cropped, so `session.length` becomes `start + len(path)`. Exact: nothing is recomputed, and the
        kept nodes sit at the same positions (prefix + depth) they were computed at.
        """
        if session.last_start is None or session.last_parents is None or session.last_start != start:
            raise ValueError(
                f"keep_path(start={start}) must directly follow a forward that began at prefix length {start}"
            )
        parents = session.last_parents
        for k, node in enumerate(path):
            if not isinstance(node, Integral) or not 0 <= node < len(parents):
                raise ValueError(f"path[{k}]={node!r} is not a node index in [0, {len(parents)})")
            expected = path[k - 1] if k > 0 else -1
            if parents[node] != expected:
                raise ValueError(
                    f"path {path} is not a root-to-node path: node {node} has parent {parents[node]}, not {expected}"
                )
        self._check_cache(session)
        path = [int(node) for node in path]
        drop = len(parents) - len(path)
        if path != list(range(len(path))):  # otherwise the kept slots are already in front
            src = torch.tensor([start + p for p in path], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                for layer in session.cache.layers:
                    if not getattr(layer, "is_initialized", False):
                        continue
                    for name in ("keys", "values"):
                        kv = getattr(layer, name)
                        kv[..., start : start + len(path), :] = kv.index_select(-2, src)
        if drop:
            session.cache.crop(-drop)
        session.length = start + len(path)
        session.last_start = session.last_parents = None

    def truncate(self, session: EngineSession, length: int) -> None:
        """Roll the session back to its first `length` tokens (their K/V stay exactly as computed)."""
        if not isinstance(length, Integral) or not 0 <= length <= session.length:
            raise ValueError(f"truncate length must be an int in [0, {session.length}], got {length!r}")
        length = int(length)
        drop = session.length - length
        if drop:
            session.cache.crop(-drop)  # a negative count removes that many tokens; a positive one raises
        session.length = length
        session.last_start = session.last_parents = None

    def copy_prefix(self, session: EngineSession, length: int) -> EngineSession:
        """A new session holding a copy of `session`'s first `length` tokens' K/V (the same bits), `session`
        unchanged: a prompt that shares only part of a pooled context reuses it without cutting it short."""
        if not isinstance(length, Integral) or not 0 <= length <= session.length:
            raise ValueError(f"copy length must be an int in [0, {session.length}], got {length!r}")
        copy = self.new_session()
        if length:
            with torch.inference_mode():
                self._copy_layers(session, copy, length)
        copy.length = int(length)
        return copy

    @staticmethod
    def _copy_layers(session: EngineSession, copy: EngineSession, length: int) -> None:
        for layer in session.cache.layers:
            fresh = copy.cache.layer_class_to_replicate()
            fresh.update(layer.keys[..., :length, :], layer.values[..., :length, :])
            copy.cache.layers.append(fresh)

    def logits_for_prefix(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits `[len(token_ids), vocab]` of one fresh full forward with no cache (a reference)."""
        self._check_tokens(token_ids)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        position_ids = torch.arange(len(token_ids), device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(input_ids=ids, position_ids=position_ids, use_cache=False)
        return out.logits[0].float()

    # -- helpers ---------------------------------------------------------------------------------

    def _final_hidden(self, ids: torch.Tensor, mask, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """The last layer's normed hidden states `[1, n, hidden]`: what the output layer reads."""
        own = getattr(self.model, "final_hidden", None)  # a fused model runs its lean layers
        if own is not None:
            return own(ids, mask, position_ids, cache)
        out = self.model.base_model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                                    **{self._base_cache_arg: cache})
        return out.last_hidden_state

    def _check_tokens(self, token_ids: list[int]) -> None:
        """Reject an empty list or ids outside the vocabulary (an embedding lookup would fail obscurely)."""
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        for i, t in enumerate(token_ids):
            if not isinstance(t, Integral) or not 0 <= t < self.vocab_size:
                raise ValueError(f"token_ids[{i}]={t!r} is not a token id in [0, {self.vocab_size})")

    @staticmethod
    def _check_parents(parents: list[int], n: int) -> None:
        """A tree needs one parent per token, each -1 or an earlier index (topological order)."""
        if len(parents) != n:
            raise ValueError(f"parents has {len(parents)} entries for {n} tokens")
        for i, p in enumerate(parents):
            if not isinstance(p, Integral) or not -1 <= p < i:
                raise ValueError(f"parents[{i}]={p!r} must be -1 or an index of an earlier token (< {i})")

    @staticmethod
    def _check_cache(session: EngineSession) -> None:
        """Catch a session whose cache was changed behind the engine's back."""
        cached = session.cache.get_seq_length()
        if cached != session.length:
            raise RuntimeError(f"session cache holds {cached} tokens but session.length is {session.length}")

    def _tree_mask(
        self, session: EngineSession, start: int, parents: list[int], depth: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive float masks `[1, 1, T, P+T]` for a tree: prefix + ancestors + self (+ the window).

        Float (0 / dtype min) rather than bool, because eager attention adds the mask to the scores
        and would silently misread a bool mask; sdpa takes either. Models with sliding-window layers
        get the `{"full_attention": ..., "sliding_attention": ...}` dict, since a single 4D mask is
        used unchanged on sliding layers and would ignore the window.
        """
        n = len(parents)
        allowed = torch.zeros(n, start + n, dtype=torch.bool)
        allowed[:, :start] = True
        for i, p in enumerate(parents):
            if p >= 0:
                allowed[i, start:] = allowed[p, start:]
            allowed[i, start + i] = True
        if not self._mask_layers:
            return self._additive(allowed)
        q_pos = start + depth
        kv_pos = torch.cat([torch.arange(start), start + depth])
        in_window = (q_pos[:, None] - kv_pos[None, :]) < self._window
        masks = {}
        for layer_type, layer_idx in self._mask_layers.items():
            kv_length, kv_offset = session.cache.get_mask_sizes(n, layer_idx)
            if (kv_length, kv_offset) != (start + n, 0):
                raise RuntimeError(
                    f"cache layer {layer_idx} reports mask sizes {(kv_length, kv_offset)}, expected {(start + n, 0)}"
                )
            masks[layer_type] = self._additive(allowed & in_window if layer_type == _SLIDING else allowed)
        return masks

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """Turn a bool `[T, K]` mask into an additive `[1, 1, T, K]` mask in the model's dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None].to(self.device)


def _cache_arg(module: torch.nn.Module) -> str:
    """The name `module.forward` takes the KV cache by: transformers >= 5.24 says `cache`, earlier `past_key_values`."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _depths(parents: list[int]) -> torch.Tensor:
    """Depth of each tree node (0 for nodes hanging off the prefix), given topological parents."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long)
