"""A KV cache that appends in place: `GrowingCache`, a `DynamicCache` whose layers keep spare room.

Why: transformers' `DynamicLayer` appends with `torch.cat`, so every decode step copies each layer's
whole K/V (28 layers x 2 on the 1.5B): at 600 cached tokens that was 3 ms of a ~80 ms step, growing
with the context. `GrowingLayer` writes new keys/values into a buffer with room to spare (1.5x when
full; a crop to under a quarter of the room gives it back) and exposes the filled part as a view, so a step copies only its own tokens.

Semantics are `DynamicLayer`'s: `keys`/`values` are `[batch, heads, tokens, dim]` tensors (views of
the buffer); `crop` shortens the view (the next append overwrites what was dropped); anything that
replaces `keys`/`values` with another tensor (an index_select, a batch select) simply makes the next
append copy into a fresh buffer. Values are copied, never recomputed, so logits are bit-identical to
`DynamicCache`'s (tests/test_kv_cache.py). A session's cache is its own: no two sessions share one.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 64  # tokens a fresh buffer holds at least


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` with an append that copies only the new tokens (room grows 1.5x when full)."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def _owns_views(self, held: int) -> bool:
        buffer = self._key_buffer
        return (buffer is not None and self._value_buffer is not None and held > 0
                and self.keys.data_ptr() == buffer.data_ptr() and self.values.data_ptr() == self._value_buffer.data_ptr()
                and self.keys.shape[:2] == buffer.shape[:2] and self.keys.shape[-1] == buffer.shape[-1]
                and self.keys.dtype == buffer.dtype
                # a buffer made under inference mode cannot be written outside it: copy to a new one
                and (torch.is_inference_mode_enabled() or not buffer.is_inference()))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        keys, values, held = self._room(key_states, value_states, new)
        keys[..., held:held + new, :] = key_states
        values[..., held:held + new, :] = value_states
        self._show(held + new)
        return self.keys, self.values

    def check_room(self, batch: int, heads: int, dim: int) -> None:
        """ValueError unless `room` can extend this layer: no tokens yet, or float32/float64 keys and values of
        `[batch, heads, tokens, dim]` (float64 K/V, from transformers' exact attention, hold float32 values
        exactly: `room` copies them back to float32)."""
        held = self.keys.shape[-2] if self.is_initialized and self.keys.dim() == 4 else 0
        if held and (tuple(self.keys.shape) != (batch, heads, held, dim) or self.values.shape != self.keys.shape
                     or self.keys.dtype not in (torch.float32, torch.float64) or self.values.dtype != self.keys.dtype):
            raise ValueError(f"the cache holds keys {tuple(self.keys.shape)} {self.keys.dtype}, not float32 "
                             f"[{batch}, {heads}, tokens, {dim}]")

    def room(self, batch: int, heads: int, dim: int, new: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for `new` more float32 tokens, shown at once (`keys`/`values` end with them; the caller writes
        them, as a native layer loop does): returns the buffers `[batch, heads, capacity, dim]` and the
        tokens held before. `check_room` first."""
        self.check_room(batch, heads, dim)
        return self._room_shown(batch, heads, dim, new)

    def _room_shown(self, batch: int, heads: int, dim: int, new: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        empty = torch.empty(batch, heads, 0, dim)
        keys, values, held = self._room(empty, empty, new)
        self._show(held + new)
        return keys, values, held

    def _room(self, key_like: torch.Tensor, value_like: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Buffers of `key_like`'s dtype, batch, heads and dim with room for `new` more tokens (grown 1.5x when
        full, what is held copied over); returns them and the tokens held. `update` writes the new tokens,
        `room`'s caller writes them itself; `_show` then extends the views over them."""
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
        held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        if not (self._owns_views(held) and held + new <= self._key_buffer.shape[-2]
                and key_like.dtype == self._key_buffer.dtype):
            self._grow(key_like, value_like, held, max(MIN_CAPACITY, (held + new) * 3 // 2))
        return self._key_buffer, self._value_buffer, held

    def _show(self, tokens: int) -> None:
        self.keys = self._key_buffer[..., :tokens, :]
        self.values = self._value_buffer[..., :tokens, :]

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, capacity: int) -> None:
        keys = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[-1]))
        if held:
            keys[..., :held, :] = self.keys
            values[..., :held, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        held = self.keys.shape[-2] if self.is_initialized and self.keys.dim() == 4 else 0
        if self._owns_views(held) and self._key_buffer.shape[-2] > 4 * max(held, MIN_CAPACITY):
            # a long sequence cut short (a pooled session reused for a shorter prompt): give the room back
            self._grow(self.keys, self.values, held, max(MIN_CAPACITY, held * 3 // 2))
            self.keys = self._key_buffer[..., :held, :]
            self.values = self._value_buffer[..., :held, :]

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


class GrowingCache(DynamicCache):
    """A config-less `DynamicCache` (every layer keeps all its tokens, croppable) of `GrowingLayer`s."""

    appends_in_place = True  # read by transformers' float64 attention, which then stores float64 K/V (exact_attention.py)

    def __init__(self) -> None:
        super().__init__()
        self.layer_class_to_replicate = GrowingLayer

    def room(self, layers: int, batch: int, heads: int, dim: int,
             new: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """`GrowingLayer.room` for layers 0 .. layers - 1 (created where missing), or ValueError, with no layer
        changed, where one is not a GrowingLayer or cannot make room (`check_room`)."""
        if not all(isinstance(layer, GrowingLayer) for layer in self.layers[:layers]):
            raise ValueError("only GrowingLayer caches make room in place")
        for layer in self.layers[:layers]:  # every layer checked before any changes
            layer.check_room(batch, heads, dim)
        while len(self.layers) < layers:
            self.layers.append(self.layer_class_to_replicate())
        return [layer._room_shown(batch, heads, dim, new) for layer in self.layers[:layers]]  # checked above
