"""Typed node specs: one frozen record per node kind, checked when the node joins a graph.

`StepGraph.add_*` builds a `Node` whose `spec` is the record of its kind (`ThinkSpec`,
`GenerateSpec`, `ToolSpec`, `ForkSpec`, `JoinSpec`, `LoopSpec`); `spec.check(name)` refuses a bad
setting with a `GraphError` naming the node and the field (`node 'think': max_steps must be > 0,
got 0`), and `compile()` checks every node again. The runtime reads the records' attributes.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from thinkahead.step_spec.state import TIERS, Tier

from thinkahead.models.errors import ThinkaheadError

Prompt = str | Callable[[dict[str, Any]], str | list[dict[str, str]]]
"""A template over the state, or a function of the state returning the user text or a message list."""


class GraphError(ThinkaheadError, ValueError):
    """The graph is not valid; the message names the node or edge at fault."""


def template_fields(template: str) -> tuple[str, ...]:
    """The state keys a `str.format` template reads, e.g. "{question} {draft}" -> (question, draft)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise GraphError(f"bad prompt template {template!r}: {exc}") from exc
    keys = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        key = name.split(".")[0].split("[")[0]
        if not key:
            raise GraphError(f"prompt template {template!r} has a positional field; name every field")
        if key not in keys:
            keys.append(key)
    return tuple(keys)


# --------------------------------------------------------------------------- field checks


def _fail(node: str, message: str) -> NoReturn:
    raise GraphError(f"node {node!r}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(node: str, field: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value):
        _fail(node, f"{field} must be an int{' or None' if optional else ''}, got {type(value).__name__}")
    if value <= 0:  # type: ignore[operator]
        _fail(node, f"{field} must be > 0, got {value!r}")


def _temperature(node: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(node, f"temperature must be a number, got {type(value).__name__}")
    if value < 0:
        _fail(node, f"temperature must be >= 0, got {value!r}")


def _text(node: str, field: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        _fail(node, f"{field} must be a string{' or None' if optional else ''}, got {type(value).__name__}")


def _template(node: str, field: str, value: object) -> tuple[str, ...]:
    _text(node, field, value)
    try:
        return template_fields(value)  # type: ignore[arg-type]
    except GraphError as exc:
        _fail(node, f"{field}: {exc}")


def _flag(node: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        _fail(node, f"{field} must be True or False, got {value!r}")


def _function(node: str, field: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not callable(value):
        _fail(node, f"{field} must be callable, got {type(value).__name__}")


# --------------------------------------------------------------------------- one record per kind


@dataclass(slots=True, frozen=True)
class _Prompted:
    """What every node that prompts a model sets: the system prompt and the sampling temperature."""

    system: str | None
    temperature: float

    def check_prompting(self, node: str) -> None:
        _text(node, "system", self.system, optional=True)
        _temperature(node, self.temperature)


@dataclass(slots=True, frozen=True)
class ThinkSpec(_Prompted):
    """A reasoning segment run by a step policy (`policy` None: the runtime's); `max_steps` and
    `max_tokens` None: the runtime's step budget."""

    kind: ClassVar[str] = "think"
    problem: str
    policy: Any
    max_steps: int | None
    max_tokens: int | None
    seed: int | None

    def check(self, node: str) -> None:
        _template(node, "problem", self.problem)
        if self.policy is not None and not (hasattr(self.policy, "start") or hasattr(self.policy, "next_step")):
            _fail(node, f"policy must be a step policy (with start(ctx)), got {type(self.policy).__name__}")
        self.check_prompting(node)
        _positive(node, "max_steps", self.max_steps, optional=True)
        _positive(node, "max_tokens", self.max_tokens, optional=True)
        if self.seed is not None and not _is_int(self.seed):
            _fail(node, f"seed must be an int or None, got {type(self.seed).__name__}")

    def reads(self) -> tuple[str, ...]:
        """The state keys the problem template reads."""
        return template_fields(self.problem)


@dataclass(slots=True, frozen=True)
class GenerateSpec(_Prompted):
    """One model call on `tier`; `session` names the agent session it writes to."""

    kind: ClassVar[str] = "generate"
    prompt: Prompt
    tier: Tier
    max_tokens: int
    stop: tuple[str, ...]
    strip: bool
    session: str
    grammar: Any = None  # a GrammarSpec, or a function of the state returning one (None: free text)

    def check(self, node: str) -> None:
        if self.grammar is not None and not (callable(self.grammar) or hasattr(self.grammar, "kind")):
            _fail(node, f"grammar must be a GrammarSpec or a function of the state, got {type(self.grammar).__name__}")
        if self.tier not in TIERS:
            _fail(node, f"tier must be one of {TIERS}, got {self.tier!r}")
        if isinstance(self.prompt, str):
            _template(node, "prompt", self.prompt)
        elif not callable(self.prompt):
            _fail(node, f"prompt must be a template string or a callable, got {type(self.prompt).__name__}")
        self.check_prompting(node)
        _positive(node, "max_tokens", self.max_tokens)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            _fail(node, f"stop must be a list of non-empty strings, got {self.stop!r}")
        _flag(node, "strip", self.strip)
        if not isinstance(self.session, str) or not self.session:
            _fail(node, f"session must be a non-empty string, got {self.session!r}")

    def reads(self) -> tuple[str, ...]:
        """The state keys a template prompt reads (a callable prompt declares its inputs instead)."""
        return template_fields(self.prompt) if isinstance(self.prompt, str) else ()


@dataclass(slots=True, frozen=True)
class ToolSpec:
    """A Python callable of the state (sync or async)."""

    kind: ClassVar[str] = "tool"
    fn: Callable[[dict[str, Any]], Any]

    def check(self, node: str) -> None:
        _function(node, "tool", self.fn)


@dataclass(slots=True, frozen=True)
class ForkSpec:
    """An explicit parallel split; it has no settings."""

    kind: ClassVar[str] = "fork"

    def check(self, node: str) -> None:
        return None


@dataclass(slots=True, frozen=True)
class JoinSpec:
    """The merge of parallel branches: all of them, with `first` the first to finish, or with `decided` as soon
    as `decided(outputs of the finished branches, branches still out)` says the rest cannot change the merge."""

    kind: ClassVar[str] = "join"
    first: bool
    merge: Callable[[list[Any]], Any] | None
    decided: Callable[[list[Any], int], bool] | None = None

    def check(self, node: str) -> None:
        _flag(node, "first", self.first)
        _function(node, "merge", self.merge, optional=True)
        _function(node, "decided", self.decided, optional=True)
        if self.first and self.decided is not None:
            _fail(node, "a first-finish join is decided by its first branch; give `first` or `decided`, not both")

    @property
    def early(self) -> bool:
        """Whether it may run before all its branches finish (and then cancels the rest)."""
        return self.first or self.decided is not None


@dataclass(slots=True, frozen=True)
class LoopSpec:
    """A bounded cycle: its body runs while `condition(state)` holds, at most `max_iters` times."""

    kind: ClassVar[str] = "loop"
    max_iters: int
    condition: Callable[[dict[str, Any]], bool] | None

    def check(self, node: str) -> None:
        _positive(node, "max_iters", self.max_iters)
        _function(node, "condition", self.condition, optional=True)


NodeSpec = ThinkSpec | GenerateSpec | ToolSpec | ForkSpec | JoinSpec | LoopSpec
NODE_SPECS: tuple[type[NodeSpec], ...] = (ThinkSpec, GenerateSpec, ToolSpec, ForkSpec, JoinSpec, LoopSpec)
NODE_KINDS: tuple[str, ...] = tuple(spec.kind for spec in NODE_SPECS)


@dataclass(slots=True, frozen=True)
class Node:
    """One node of a step graph: what it reads and writes, and its kind's typed `spec`."""

    name: str
    output: str | None
    inputs: tuple[str, ...]
    spec: NodeSpec

    @property
    def kind(self) -> str:
        return self.spec.kind

    def check(self) -> None:
        """`GraphError` naming this node and the field at fault when a setting is invalid."""
        if not isinstance(self.spec, NODE_SPECS):
            _fail(self.name, f"spec must be one of {', '.join(s.__name__ for s in NODE_SPECS)}, "
                             f"got {type(self.spec).__name__}")
        self.spec.check(self.name)
        if self.output is not None and (not isinstance(self.output, str) or not self.output):
            _fail(self.name, f"output must be a non-empty string, got {self.output!r}")
        for key in self.inputs:
            if not isinstance(key, str) or not key:
                _fail(self.name, f"inputs must be state keys (non-empty strings), got {key!r}")

    def writes(self) -> tuple[str, ...]:
        """The state keys this node writes (a think node also writes `<output>_reasoning`)."""
        if not self.output:
            return ()
        return (self.output, self.output + "_reasoning") if isinstance(self.spec, ThinkSpec) else (self.output,)
