"""A draft model's output layer over part of the vocabulary: the frequent ids and the context's own.

A draft token costs one forward of the small model, and over a 150k vocabulary the output layer is a
large part of it (Qwen2.5-Coder-0.5B: 136M of its 630M weights, 7 of the 37 ms of a decode step on
2 cores). A draft only has to be right often, so the drafter's output layer keeps (as FR-Spec does
with corpus frequencies):

- the ids below `first`: byte-level BPE vocabularies number their tokens in merge order, so the low
  ids are the frequent ones (under Qwen2.5's tokenizer the first 32768 hold 96% of GSM8K's tokens);
- every id at or above `first` that occurs in the request's context: numbers, names, the chat
  template's special tokens (with them, 99.3% of GSM8K's answer tokens).

The target verifies every drafted token against its own full distribution, so this changes what is
proposed, never what is generated. A sampled draft's proposal distribution q still spans the whole
vocabulary (zero outside the kept ids), as the rejection rule needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class _Rows(torch.nn.Module):
    """`linear(x)[..., ids]` of an `nn.Linear`, reading only those weight rows."""

    def __init__(self, linear: torch.nn.Linear, ids: torch.Tensor):
        super().__init__()
        first = int(ids[0])
        contiguous = torch.equal(ids, torch.arange(first, first + ids.numel()))
        weight = linear.weight.detach()
        self.weight = weight[first:first + ids.numel()] if contiguous else weight.index_select(0, ids)
        bias = None if linear.bias is None else linear.bias.detach().index_select(0, ids)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)


class _Selected(torch.nn.Module):
    """Any other output layer: all of it computed, the columns `ids` kept (right, not faster)."""

    def __init__(self, head: torch.nn.Module, ids: torch.Tensor):
        super().__init__()
        self.head, self.ids = head, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).index_select(-1, self.ids)


def output_rows(head: torch.nn.Module, ids: torch.Tensor) -> torch.nn.Module:
    """A module whose output j is `head`'s output `ids[j]`: the head's own `output_rows` (GGUF blocks),
    the rows of an `nn.Linear`'s weight, or for any other head its full output, then those columns."""
    ids = ids.reshape(-1).long()
    if hasattr(head, "output_rows"):
        return head.output_rows(ids)
    if isinstance(head, torch.nn.Linear):
        return _Rows(head, ids)
    return _Selected(head, ids)


class DraftVocab:
    """The kept ids of one draft model (the frequent ones): shared by every request, read-only."""

    def __init__(self, head: torch.nn.Module, vocab_size: int, first: int):
        if first < 1:
            raise ValueError(f"a draft vocabulary needs at least one id, got first={first}")
        self.vocab_size = vocab_size
        self.first = min(first, vocab_size)
        self.head = head
        self.base = output_rows(head, torch.arange(self.first))

    def for_request(self) -> RequestVocab:
        return RequestVocab(self)


class RequestVocab:
    """One request's kept ids: the shared frequent ones plus the ids of its context above them."""

    def __init__(self, vocab: DraftVocab):
        self.vocab = vocab
        self.extra: list[int] = []  # context ids >= vocab.first, in the order first seen
        self._extra_set: set[int] = set()
        self._extra_head: torch.nn.Module | None = None
        self.ids = torch.arange(vocab.first)  # column j of `logits` is token ids[j]

    def add(self, tokens: Sequence[int]) -> None:
        """Keep the ids of `tokens` (context the small model is about to read) at or above the frequent ones;
        kept ids are only ever added. An id outside the vocabulary is refused by name."""
        first, size = self.vocab.first, self.vocab.vocab_size
        new = []
        for t in dict.fromkeys(tokens):
            if not 0 <= t < size:
                raise ValueError(f"token id {t!r} is not in the draft model's vocabulary [0, {size})")
            if t >= first and t not in self._extra_set:
                new.append(t)
        if not new:
            return
        self.extra.extend(new)
        self._extra_set.update(new)
        extra = torch.tensor(self.extra, dtype=torch.long)
        self._extra_head = output_rows(self.vocab.head, extra)
        self.ids = torch.cat([torch.arange(first), extra])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The kept ids' logits `[n, len(ids)]` for hidden states `[n, hidden]`."""
        base = self.vocab.base(hidden)
        extra = self.extra_logits(hidden)
        return base if extra is None else torch.cat([base, extra], dim=-1)

    def extra_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of the context's ids above the shared ones `[n, len(extra)]` (None without any): the columns
        after the shared ids' in `logits`."""
        return None if self._extra_head is None else self._extra_head(hidden)

    def full(self, dist: torch.Tensor) -> torch.Tensor:
        """A distribution over the kept ids `[len(ids)]` spread over the whole vocabulary (zero elsewhere)."""
        out = torch.zeros(self.vocab.vocab_size, dtype=dist.dtype)
        out[self.ids] = dist
        return out
