"""Grammar constraints for decoding: a `GrammarSpec` says what an output must look like, a
`TokenGrammar` compiles it for one tokenizer (llguidance), and a `Constraint` follows one generation.

A `Constraint` answers which tokens may come next (`mask`), takes the tokens a round commits
(`advance`), checks a draft against the grammar without taking it (`valid_prefix`), rolls back
(`rollback`), and names the tokens the grammar forces from here (`forced`: `{"name": "` in a tool
call), which the decoder drafts for free. The speculative decoder applies the mask at every row of
a verify forward (token_spec/constrained.py), so speculation stays lossless under a grammar.

Kinds: a JSON schema (`json_schema`; `json_object` is any object), a regular expression (`regex`),
a Lark grammar in llguidance's dialect (`lark`: special tokens as `<tool_call>`, `%json {...}` for
an embedded schema) and GBNF/EBNF (`ebnf`, converted to Lark). JSON is written with fixed
separators (`", "`, `": "`) and no free whitespace, so a greedy model cannot loop on blanks.

A grammar that cannot be compiled, uses what llguidance does not support, or matches nothing is a
`GrammarError` naming the request field it came from; compiling is bounded by `LIMITS` (fuel and
size), and compiled grammars are cached per tokenizer by their text.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

GrammarKind = Literal["json_schema", "regex", "lark", "ebnf"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "regex", "lark", "ebnf")
MAX_SOURCE_CHARS = 256 * 1024  # a grammar's text at most: a bigger one is refused before compiling
CACHED_GRAMMARS = 128  # compiled grammars kept per tokenizer
# How JSON is written under a grammar: one way only (greedy decoding cannot loop on whitespace).
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot constrain decoding; `field` names where it came from (a request parameter).
    Raised on compiling, and while decoding where the grammar cannot be followed (a schema whose every
    output is infinite exhausts llguidance's limits; a grammar needing bytes the vocabulary lacks)."""

    def __init__(self, message: str, field: str = "grammar") -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class TokenizerUnsupported(GrammarError):
    """The model's tokenizer cannot take a grammar at all (llguidance reads fast tokenizers only): the
    model, not the request, is at fault; a caller may decode without the grammar instead."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What an output must match: a kind and its text. Hashable; equal specs share a compiled grammar."""

    kind: GrammarKind
    source: str
    field: str = field(default="grammar", compare=False)  # the request field it came from, for errors

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}",
                               self.field)
        if not isinstance(self.source, str) or not self.source.strip():
            raise GrammarError("the grammar is empty", self.field)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"the grammar is {len(self.source)} characters; at most {MAX_SOURCE_CHARS}", self.field)
        try:
            self.source.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in a request's JSON): llguidance takes UTF-8
            raise GrammarError(f"the grammar holds text that is not valid Unicode ({exc.reason}: "
                               f"{self.source[exc.start:exc.end]!a})", self.field) from None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, field: str = "json_schema") -> GrammarSpec:
        """Output: one JSON value valid against `schema` (property order as the schema gives it)."""
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}", field)
        return cls("json_schema", json.dumps(styled_schema(schema), ensure_ascii=False), field)

    @classmethod
    def json_object(cls, field: str = "response_format") -> GrammarSpec:
        """Output: any JSON object."""
        return cls.json_schema({"type": "object"}, field)

    @classmethod
    def regex(cls, pattern: str, field: str = "regex") -> GrammarSpec:
        return cls("regex", pattern, field)

    @classmethod
    def lark(cls, text: str, field: str = "grammar") -> GrammarSpec:
        return cls("lark", text, field)

    @classmethod
    def ebnf(cls, text: str, field: str = "ebnf") -> GrammarSpec:
        return cls("ebnf", text, field)


def styled_schema(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """`schema` with this module's JSON style (`JSON_STYLE`) set, as llguidance reads it (`x-guidance`).
    A client's own `x-guidance` is replaced: its options (`lenient` ignores the keywords llguidance lacks)
    would let through outputs the schema refuses, and a non-object there broke the merge."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return {**schema, "x-guidance": dict(JSON_STYLE)}


def plain_schema(spec: GrammarSpec) -> dict[str, Any]:
    """The JSON schema of a `json_schema` spec as a remote server takes it (without llguidance's style key)."""
    if spec.kind != "json_schema":
        raise GrammarError(f"a {spec.kind} grammar is not a JSON schema", spec.field)
    schema = json.loads(spec.source)
    schema.pop("x-guidance", None)
    return schema


def _limits() -> Any:
    """llguidance's parser limits: what bounds a grammar's compile time and memory."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=2_000_000, max_grammar_size=200_000,
                                     max_lexer_states=50_000, step_lexer_fuel=400_000, verbose_errors=False)


def _llguidance_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec` (not yet checked)."""
    from llguidance import LLMatcher

    try:
        if spec.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec.source)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "lark":
            return LLMatcher.grammar_from_lark(spec.source)
    except (ValueError, TypeError) as exc:  # UnicodeError is a ValueError
        what = "not a JSON schema" if spec.kind == "json_schema" else f"not a {spec.kind} grammar"
        raise GrammarError(f"{what}: {_clean(str(exc))}", spec.field) from None
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return LLMatcher.grammar_from_lark(any_to_lark(spec.source))
    except Exception as exc:  # noqa: BLE001 - the converter raises anything on bad input
        raise GrammarError(f"not a GBNF/EBNF grammar: {exc}", spec.field) from None


class TokenGrammar:
    """Grammars compiled for one tokenizer (one per model, shared by its requests; thread-safe).

    `stop_ids` are the model's end-of-turn tokens: where the grammar may end, each of them may come
    next, and one of them ends the generation.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self._lock = threading.Lock()
        self._llt: Any = None
        self._llt_error: TokenizerUnsupported | None = None  # kept: a tokenizer that failed is not tried again
        self._compiled: OrderedDict[GrammarSpec, str] = OrderedDict()

    @property
    def llg_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built once, about a second for a 150k vocabulary)."""
        with self._lock:
            if self._llt_error is not None:
                raise self._llt_error
            if self._llt is None:
                import llguidance.hf

                eos = getattr(self.tokenizer, "eos_token_id", None)
                ends = sorted(self.stop_ids) or ([eos] if isinstance(eos, int) else [])
                try:
                    self._llt = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=ends or None)
                except Exception as exc:  # noqa: BLE001 - ValueError for a slow tokenizer, others from its JSON
                    self._llt_error = TokenizerUnsupported(
                        f"this model's tokenizer cannot take a grammar: {_clean(str(exc))}", "model")
                    raise self._llt_error from None
            return self._llt

    def warm(self) -> None:
        """Build llguidance's view of the tokenizer now (a model load calls it on a side thread, so
        that the first constrained request does not wait for it); a tokenizer it cannot read is
        remembered, and refused when a grammar is asked for."""
        try:
            self.llg_tokenizer
        except TokenizerUnsupported:
            pass

    def compile(self, spec: GrammarSpec) -> str:
        """The checked llguidance grammar of `spec` (cached): a `GrammarError` names what is wrong."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        from llguidance import LLMatcher

        text = _llguidance_text(spec)
        llt = self.llg_tokenizer
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, llt, limits=_limits())
        if is_error:
            raise GrammarError(_clean(messages[0] if messages else "invalid grammar"), spec.field)
        probe = LLMatcher(llt, text, log_level=0, limits=_limits())
        if probe.is_error():
            raise GrammarError(_clean(probe.get_error()), spec.field)
        nothing = not _any_allowed(probe) and not probe.is_accepting()
        if nothing or probe.is_error():  # a first mask that cannot go on puts the matcher in error
            raise GrammarError("the grammar matches no output", spec.field)
        with self._lock:
            self._compiled[spec] = text
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return text

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A fresh `Constraint` of `spec` for one generation."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.llg_tokenizer, self.compile(spec), log_level=0, limits=_limits())
        return Constraint(matcher, self.vocab_size, self.stop_ids, self.tokenizer, self.llg_tokenizer.vocab_size,
                          field=spec.field)


def _clean(message: str) -> str:
    return " ".join(message.split())[:500]


def _any_allowed(matcher: Any) -> bool:
    import numpy as np

    return bool(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8).any())


class Constraint:
    """One generation's place in its grammar. Not thread-safe: one generation owns it.

    The model's stop tokens are the grammar's end tokens: allowed exactly where the output may end.
    """

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: frozenset[int], tokenizer: Any, n_tokens: int,
                 field: str = "grammar") -> None:
        self._m = matcher
        self.field = field  # the request field of its grammar: a grammar that cannot be followed names it
        self.vocab_size = vocab_size  # the model's logits
        self.n_tokens = n_tokens  # the tokenizer's ids (llguidance's vocabulary)
        self.stop_ids = stop_ids
        self.tokenizer = tokenizer
        self.consumed = 0  # tokens taken (and not rolled back)

    # ---------------------------------------------------------------- reading
    @property
    def accepting(self) -> bool:
        """Whether the output so far is complete (a stop token may come next)."""
        return self._m.is_accepting()

    def mask(self) -> Any:
        """The tokens allowed next, as a bool tensor over the model's vocabulary."""
        import numpy as np
        import torch

        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if self._m.is_error():
            raise GrammarError(f"the grammar cannot go on from here: {_clean(self._m.get_error())}", self.field)
        n = min(self.vocab_size, bits.size)
        if n == self.vocab_size:
            return torch.from_numpy(bits[:n].view(np.bool_).copy())
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[:n] = torch.from_numpy(bits[:n].view(np.bool_).copy())
        return allowed

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar takes from here (a stop token where the output may end).
        An id past the tokenizer's vocabulary (a model's logits may be wider) is never taken."""
        ids = []
        for t in tokens:
            if not 0 <= t < self.n_tokens:
                break
            ids.append(int(t))
        return self._m.validate_tokens(ids) if ids else 0

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar forces from here (at most `limit`): its forced bytes as the tokenizer
        writes them, cut where the grammar would not take them. Drafts, not commitments: the verify
        pass may still prefer another split of the same bytes."""
        if limit <= 0 or self._m.is_stopped():
            return []
        ids = list(self._m.compute_ff_tokens())
        raw = self._m.compute_ff_bytes()
        if raw and not raw.startswith(b"\xff"):  # b"\xff[id]" marks a forced special token (in ids)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = ""
            if text:
                encoded = list(self.tokenizer.encode(text, add_special_tokens=False))
                if len(encoded) > len(ids):
                    ids = encoded
        ids = ids[:limit]
        return ids[: self._m.validate_tokens(ids)] if ids else []

    # ---------------------------------------------------------------- moving
    def advance(self, tokens: Sequence[int]) -> None:
        """Take committed tokens; a stop token ends them (the output is over: it is not taken)."""
        body = []
        for t in tokens:
            if t in self.stop_ids:
                break
            body.append(int(t))
        if body and not self._m.consume_tokens(body):
            raise GrammarError(f"the grammar refused tokens {body!r}: {_clean(self._m.get_error())}", self.field)
        self.consumed += len(body)

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens taken."""
        if n < 0 or n > self.consumed:
            raise ValueError(f"cannot roll back {n} tokens; {self.consumed} were taken")
        if n and not self._m.rollback(n):
            raise ValueError(f"the grammar could not roll back {n} tokens: {self._m.get_error()}")
        self.consumed -= n


__all__ = ["CACHED_GRAMMARS", "Constraint", "GRAMMAR_KINDS", "GrammarError", "GrammarSpec", "JSON_STYLE",
           "TokenGrammar", "TokenizerUnsupported", "plain_schema", "styled_schema"]
