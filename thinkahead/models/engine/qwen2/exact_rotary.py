"""Rotary position encodings whose values depend only on the position: a table computed once.

Why: transformers computes a forward's cos/sin with `torch.cos`/`torch.sin`, which on this build run
MKL's vector math in chunks split over torch's threads (from 2,048 values on: a 41-token prompt at a
head width of 64 is split at position 20.5). The first such call in a process sometimes computes the
second thread's chunk in a low-accuracy mode: errors up to 1.5e-4 where every later call is within an
ulp (measured: 4 pytest processes in 20, 715 positions, the second half off; never on 1 thread). A
prompt prefilled whole then differs from the same prompt fed in pieces, speculative greedy can leave
plain greedy, and a model's first prompt is computed with slightly wrong positions, in some processes
and not others.

The fix: a position's cos and sin come from one table, filled in blocks of `BLOCK` positions, each
block computed by the same single-threaded float64 call (numpy); a forward only gathers rows. So a
row's values never depend on the forward's shape, its thread split, or the process (on the same
machine). The angle is transformers' (float32 position times float32 inverse frequency); its cosine is
the float64 one rounded to float32 (half an ulp from exact, where MKL's float32 cosine is within one
ulp), then times `attention_scaling` in float32 as transformers does (a second rounding where it is
not 1: yarn). The table copies the frequencies when it is made: a model cast to another dtype later
keeps float32 frequencies (transformers' would read the cast buffer).

Which modules: transformers' rotary embeddings of the usual layout (`inv_freq`, `attention_scaling`,
cos/sin of the angles concatenated twice; or one such set per layer type, as Gemma3's) whose
frequencies never change (every rope type but the dynamic ones, which rescale with the sequence
length); a module whose output the tables do not reproduce on a probe is left as it was.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

BLOCK = 256  # positions computed per call, the same call shape for every block
LIMIT = 1 << 20  # positions a table holds at most (head width 128: 1 GiB of cos/sin)
_DYNAMIC = ("dynamic", "longrope")  # rope types whose frequencies follow the sequence length


class RotaryTable:
    """`table(x, position_ids) -> (cos, sin)` as transformers' rotary embedding returns them,
    `[batch, tokens, 2 * len(inv_freq)]` in `x`'s dtype, gathered from a table grown on demand."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        if inv_freq.dim() != 1 or inv_freq.numel() == 0 or inv_freq.is_meta:
            raise ValueError(f"rotary table: inv_freq must be a filled 1-D tensor, got {tuple(inv_freq.shape)}")
        self._inv_freq = inv_freq.detach().to("cpu", torch.float32).numpy().copy()
        self._scaling = np.float32(attention_scaling)
        self._table = self._empty()

    def _empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        # (cos, sin) as one tuple, replaced whole when it grows: a reader never sees one without the other
        return torch.empty(0, 2 * self._inv_freq.size), torch.empty(0, 2 * self._inv_freq.size)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() != 2 or position_ids.is_floating_point():
            raise ValueError(f"rotary table: position ids must be integers [batch, tokens], got "
                             f"{tuple(position_ids.shape)} {position_ids.dtype}")
        ids = position_ids.to("cpu", torch.long)
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"rotary table: position ids must be >= 0, got {int(ids.min())}")
        top = int(ids.max()) if ids.numel() else -1
        if top >= LIMIT:
            raise ValueError(f"rotary table: position {top} is past the table's {LIMIT} positions")
        cos, sin = self.rows(top + 1)
        return cos[ids].to(x.device, x.dtype), sin[ids].to(x.device, x.dtype)

    def rows(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's cos and sin `[n, dim]` float32 for at least `positions` positions."""
        table = self._table
        have = table[0].shape[0]
        if positions <= have:
            return table
        if positions > LIMIT:
            raise ValueError(f"rotary table: {positions} positions are more than its {LIMIT}")
        want = min(LIMIT, max(2 * have, -(-positions // BLOCK) * BLOCK))
        blocks = [self._block(start) for start in range(have, want, BLOCK)]
        grown = (torch.cat([table[0]] + [torch.from_numpy(c) for c, _ in blocks]),
                 torch.cat([table[1]] + [torch.from_numpy(s) for _, s in blocks]))
        # Threads growing at once compute the same values for the same positions; the largest table stays,
        # and each call answers from the table it built (never from one another thread stored meanwhile).
        if grown[0].shape[0] > self._table[0].shape[0]:
            self._table = grown
        return grown

    def _block(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        positions = np.arange(start, start + BLOCK, dtype=np.float32)
        angles = (positions[:, None] * self._inv_freq[None, :]).astype(np.float64)  # float32 products, as torch's
        cos = (np.cos(angles).astype(np.float32) * self._scaling).astype(np.float32)
        sin = (np.sin(angles).astype(np.float32) * self._scaling).astype(np.float32)
        return np.concatenate([cos, cos], axis=1), np.concatenate([sin, sin], axis=1)

    def __getstate__(self) -> dict[str, Any]:  # a saved or copied model carries the frequencies, not the table
        return {"_inv_freq": self._inv_freq, "_scaling": self._scaling}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._inv_freq, self._scaling = state["_inv_freq"], state["_scaling"]
        self._table = self._empty()

    def __repr__(self) -> str:
        return f"RotaryTable(dim={2 * self._inv_freq.size}, scaling={float(self._scaling)}, positions={self._table[0].shape[0]})"


class RotaryTables:
    """Per-layer-type tables for a rotary embedding called as `(x, position_ids, layer_type)` (Gemma3)."""

    def __init__(self, tables: dict[str, RotaryTable]):
        self._tables = dict(tables)

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(layer_type)  # type: ignore[arg-type]
        if table is None:
            raise ValueError(f"rotary tables: no layer type {layer_type!r} (have {sorted(self._tables)})")
        return table(x, position_ids)

    def __repr__(self) -> str:
        return f"RotaryTables({self._tables})"


def _static_table(inv_freq: Any, scaling: Any, rope_type: Any) -> RotaryTable | None:
    """A table for these frequencies, or None where they are missing or change with the sequence length."""
    if not isinstance(inv_freq, torch.Tensor) or not isinstance(scaling, (int, float)) or any(
            kind in str(rope_type) for kind in _DYNAMIC):
        return None
    try:
        return RotaryTable(inv_freq, float(scaling))
    except ValueError:  # not a filled 1-D tensor
        return None


def _same(theirs: Any, ours: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return isinstance(theirs, tuple) and len(theirs) == 2 and all(
        isinstance(t, torch.Tensor) and t.shape == o.shape and torch.allclose(t.float().cpu(), o, rtol=1e-5, atol=1e-6)
        for t, o in zip(theirs, ours))


def _table_for(module: Any) -> RotaryTable | RotaryTables | None:
    """What reproduces `module`'s forward (within float32 rounding), checked on a probe; None where nothing does."""
    layer_types = getattr(module, "layer_types", None)
    rope_types = getattr(module, "rope_type", "default")
    if isinstance(layer_types, (list, tuple)) and isinstance(rope_types, dict):  # one table per layer type
        tables = {kind: _static_table(getattr(module, f"{kind}_inv_freq", None),
                                      getattr(module, f"{kind}_attention_scaling", None), rope_types.get(kind))
                  for kind in layer_types if kind in rope_types}
        if not tables or any(t is None for t in tables.values()):
            return None
        calls = [(tables[kind], (kind,)) for kind in tables]
        result: RotaryTable | RotaryTables = RotaryTables(tables)  # type: ignore[arg-type]
    else:
        table = _static_table(getattr(module, "inv_freq", None), getattr(module, "attention_scaling", None), rope_types)
        if table is None:
            return None
        calls, result = [(table, ())], table
    probe_x = torch.zeros(1, 1, dtype=torch.float32, device=module.inv_freq.device if hasattr(module, "inv_freq") else "cpu")
    probe_ids = torch.tensor([[0, 1, 7, 100, 1023]], device=probe_x.device)
    for table, extra in calls:
        try:
            with torch.inference_mode():
                theirs = module(probe_x, probe_ids, *extra)
        except (TypeError, ValueError, RuntimeError):  # another signature (3-D positions, ...)
            return None
        if not _same(theirs, table(probe_x, probe_ids)):
            return None
        if _reads_3d_positions(module, table, probe_x, probe_ids, extra):
            return None
    return result


def _reads_3d_positions(module: Any, table: RotaryTable, x: torch.Tensor, probe: torch.Tensor, extra: tuple) -> bool:
    """Whether `module` gives 3-D position ids a meaning of their own (multimodal rope: one row per axis),
    where the usual layout broadcasts them (each row its own positions). `probe`: `[1, n]` position ids."""
    rows = torch.cat([probe, probe.flip(1), probe // 2])  # three different rows of positions
    try:
        with torch.inference_mode():
            theirs = module(x, rows[:, None], *extra)
    except (TypeError, ValueError, RuntimeError):
        return False
    return not _same(theirs, tuple(t[:, None] for t in table(x, rows)))


def use_exact_rotary(model: torch.nn.Module) -> int:
    """Give every rotary embedding of `model` that a `RotaryTable` reproduces the table as its forward,
    in place; returns how many did (the others keep transformers' computation, logged). The modules stay
    (their type, name and buffers are what the weight cache records); only their forward changes."""
    replaced = 0
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("RotaryEmbedding") or isinstance(module.__dict__.get("forward"), (RotaryTable, RotaryTables)):
            continue
        table = _table_for(module)
        if table is None:
            logger.info("%s (%s) keeps transformers' rotary computation: its cos/sin may depend on the forward's "
                        "thread split", name, type(module).__name__)
            continue
        module.forward = table  # an instance attribute: Module.__call__ runs it (hooks and all) instead of the class's
        replaced += 1
    return replaced
