"""A draft head: the target model's own next-next token guess, from its last hidden state (EAGLE's idea, one
small layer).

Each verify forward computes, at the row of the last token it keeps, the hidden state `h` its output layer turns
into the bonus token `b`. A draft head maps `h` and `b`'s embedding to a feature that the target's own output
layer (over its frequent ids, `draft_vocab.py`) reads as the token after `b`; fed its own feature and guess, it
guesses the one after that. It costs a matrix of width `width` and one pass over the frequent ids' output rows per
draft token, against a whole forward of a draft model: on the 1.5B's chains of thought it guesses the token after
the bonus right about two times in three (docs/token_spec.md#draft-head), where suffix drafts are right about one
time in three.

`DraftHead` is the layer and its file: safetensors, with the model it was trained on, its sizes and the ids it
reads in the metadata (`save` / `load`; a file that does not fit is refused with what does not). Training:
`bench/draft_head_train.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from thinkahead.token_spec.names import packaged_head, packaged_heads

HEAD_FORMAT = "thinkahead-draft-head"
HEAD_VERSION = 1
HEAD_WIDTH = 512  # the head's inner width (bench/draft_head_train.py's default)
HEAD_VOCAB = 32768  # the ids its feature is trained to pick among: byte-level BPE's frequent ones (draft_vocab.py)

def find_head(head: DraftHead | str | os.PathLike[str] | None, spec: str | None, hidden_size: int,
              owner: str) -> DraftHead:
    """The draft head for model `owner` (spec `spec`, hidden size `hidden_size`): `head` (a `DraftHead` or its
    file), else the one packaged for `spec`; a ValueError where there is none or it does not fit."""
    if isinstance(head, DraftHead):
        if head.hidden_size != hidden_size:
            raise ValueError(f"draft head for hidden size {head.hidden_size}: {owner}'s is {hidden_size}")
        return head
    path = head if head is not None else packaged_head(spec)
    if path is None:
        raise ValueError(f"drafter 'head' needs a draft head trained for {owner}; packaged for: "
                         f"{', '.join(packaged_heads()) or 'none'}")
    return DraftHead.load(path, hidden_size=hidden_size)


class DraftHead(torch.nn.Module):
    """feature(h, e) = h + up(silu(down([h; e]))): `h` a normed last hidden state [n, hidden], `e` the embedding
    of the token it chose [n, hidden]. The output layer's rows over ids below `vocab` read the feature."""

    def __init__(self, hidden_size: int, width: int, vocab: int, model: str = "") -> None:
        super().__init__()
        if hidden_size < 1 or width < 1 or vocab < 1:
            raise ValueError(f"hidden_size, width and vocab must be >= 1, got {hidden_size}, {width}, {vocab}")
        self.hidden_size, self.width, self.vocab, self.model = hidden_size, width, vocab, model
        self.down = torch.nn.Linear(2 * hidden_size, width)
        self.up = torch.nn.Linear(width, hidden_size)
        torch.nn.init.zeros_(self.up.weight)  # starts as the identity: h itself, the bonus token's own feature
        torch.nn.init.zeros_(self.up.bias)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)
        return hidden + self.up(torch.nn.functional.silu(self.down(x)))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the head to `path` (safetensors, float16 weights), atomically."""
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in self.state_dict().items()}
        meta = {"format": HEAD_FORMAT, "version": str(HEAD_VERSION), "model": self.model,
                "hidden_size": str(self.hidden_size), "width": str(self.width), "vocab": str(self.vocab)}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], hidden_size: int | None = None) -> DraftHead:
        """The head in `path`; a ValueError naming the file and what is wrong with it (not a head, another
        version, sizes that disagree with its weights or with the model's `hidden_size`)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta: dict[str, Any] = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"draft head {path}: cannot be read as safetensors ({exc})") from None
        if meta.get("format") != HEAD_FORMAT:
            raise ValueError(f"draft head {path}: not a draft head file (format {meta.get('format')!r})")
        if meta.get("version") != str(HEAD_VERSION):
            raise ValueError(f"draft head {path}: version {meta.get('version')!r}, this thinkahead reads {HEAD_VERSION}")
        try:
            sizes = {k: int(meta[k]) for k in ("hidden_size", "width", "vocab")}
        except (KeyError, ValueError):
            raise ValueError(f"draft head {path}: its metadata lacks integer hidden_size, width and vocab") from None
        if hidden_size is not None and sizes["hidden_size"] != hidden_size:
            raise ValueError(f"draft head {path}: made for hidden size {sizes['hidden_size']}, the model's is "
                             f"{hidden_size}")
        head = cls(**sizes, model=meta.get("model", ""))
        expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
        found = {k: tuple(v.shape) for k, v in tensors.items()}
        if found != expected:
            raise ValueError(f"draft head {path}: weights {found} do not fit its sizes {sizes} (expected {expected})")
        head.load_state_dict({k: v.float() for k, v in tensors.items()})
        return head.eval()
