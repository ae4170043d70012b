"""Which suffix tree the suffix cache uses: the native (C++) core or the pure-Python reference.

`THINKAHEAD_SUFFIX_IMPL=native|python` (`ENV_VAR`) picks one; unset, the native tree
is used when its extension (`thinkahead.token_spec._suffix_native`, built from
token_spec/native/ by the package's own build) loads, and otherwise
the Python tree with one logged warning. `native` when the extension is missing is
an error naming the problem. Both trees have the same public API and give the
same drafts bit for bit (tests/test_suffix_native.py); the native one keeps no
Python object per node.

Everything here is read through `tree_impl()` / `new_tree()`, so the choice is
made in one place: a `SuffixCache` resolves it once, when it is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence
import importlib
import os
import sys

from thinkahead.token_spec.draft import Draft

if TYPE_CHECKING:
    from thinkahead.token_spec.suffix_tree import SuffixTree

# The Python tree's module, imported when a Python tree is first asked for: a run on the native tree
# (`thinkahead simulate`, a server) never needs it, and compiling it is a few ms of every start-up.
PYTHON_MODULE = "thinkahead.token_spec.suffix_tree"

ENV_VAR = "THINKAHEAD_SUFFIX_IMPL"  # not _TREE: the SGLang plugin reads THINKAHEAD_SUFFIX_TREE (tree drafts, 0|1)
IMPLEMENTATIONS = ("native", "python")
NATIVE_MODULE = "thinkahead.token_spec._suffix_native"

_native_module: Any = None
_native_error: str | None = None
_warned = False


def native_module() -> Any:
    """The loaded extension module, or None when it cannot be imported (the reason: `native_error()`)."""
    global _native_module, _native_error
    if _native_module is None and _native_error is None:
        try:
            _native_module = importlib.import_module(NATIVE_MODULE)
        except ImportError as exc:  # not built, or built for another interpreter
            _native_error = f"{type(exc).__name__}: {exc}"
    return _native_module


def native_error() -> str | None:
    """Why the extension did not load, or None when it did (or was not tried yet)."""
    native_module()
    return _native_error


def _reset() -> None:
    """Forget the loaded module and the warning (tests)."""
    global _native_module, _native_error, _warned
    _native_module, _native_error, _warned = None, None, False


def tree_impl(impl: str | None = None) -> str:
    """The implementation to use: `impl`, else `$THINKAHEAD_SUFFIX_IMPL` (`ENV_VAR`), else native when it loads."""
    global _warned
    choice = impl if impl is not None else os.environ.get(ENV_VAR, "").strip().lower() or None
    if choice is not None and choice not in IMPLEMENTATIONS:
        raise ValueError(f"{ENV_VAR} must be one of {IMPLEMENTATIONS}, got {choice!r}")
    if choice == "python":
        return "python"
    if native_module() is not None:
        return "native"
    if choice == "native":
        raise ValueError(
            f"{ENV_VAR}=native but the native suffix tree ({NATIVE_MODULE}) cannot be loaded: {_native_error}. "
            f"Reinstall the package with a C++ compiler present (pip install -e .), or set {ENV_VAR}=python"
        )
    if not _warned:
        _warned = True
        import logging  # here: only the fallback logs, and `thinkahead simulate` starts faster without it

        logging.getLogger(__name__).warning(
            "the native suffix tree (%s) is not available (%s): using the pure-Python tree, several times slower; "
            "reinstall with a C++ compiler present, or set %s=python to silence this",
            NATIVE_MODULE, _native_error, ENV_VAR,
        )
    return "python"


def tree_class(impl: str | None = None) -> type:
    """The suffix tree class of an implementation (see `tree_impl`)."""
    if tree_impl(impl) == "native":
        return native_module().SuffixTree
    from thinkahead.token_spec.suffix_tree import SuffixTree

    return SuffixTree


def new_tree(max_depth: int, impl: str | None = None) -> Any:
    """An empty suffix tree of the chosen implementation."""
    return tree_class(impl)(max_depth)


def is_native(tree: Any) -> bool:
    python = sys.modules.get(PYTHON_MODULE)  # not imported yet: no Python tree exists
    return python is None or not isinstance(tree, python.SuffixTree)


def empty_positions(tree: Any) -> Any:
    """No match yet, in the tree's own position type."""
    return native_module().Positions() if is_native(tree) else []


def speculate_many(
    trees: Sequence[Any],
    positions: Sequence[Any],
    max_tokens: int,
    max_spec_factor: float,
    max_spec_offset: float,
    min_token_prob: float,
    tree: bool,
) -> list[Draft]:
    """`trees[i].speculate(positions[i], ...)` for every i; native trees in one call that releases the GIL."""
    out: list[Draft | None] = [None] * len(trees)
    native = [i for i, t in enumerate(trees) if is_native(t)]
    if native:
        drafts = native_module().speculate_many(
            [trees[i] for i in native], [positions[i] for i in native],
            max_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree,
        )
        for i, draft in zip(native, drafts):
            out[i] = draft
    params = (max_tokens, max_spec_factor, max_spec_offset, min_token_prob, tree)
    for i, t in enumerate(trees):
        if out[i] is None:
            out[i] = t.speculate(positions[i], *params)
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------------
# A request's or session's tree holds one sequence (id 0). These read it without copying it into Python
# where the tree is native (a 130k-token prompt would cost a millisecond per copy).


def seq_len(tree: Any) -> int:
    """Tokens in sequence 0 of a request tree."""
    return tree.length(0) if is_native(tree) else len(tree.tokens(0))


def tokens_from(tree: Any, start: int) -> list[int]:
    """Sequence 0 of a request tree from `start` on (a new list)."""
    return tree.tokens_from(0, start) if is_native(tree) else tree.tokens(0)[start:]


def is_own_context(tree: Any, context: Sequence[int], window: int) -> bool:
    """Whether `context` has sequence 0's length and its last `window` tokens."""
    if is_native(tree):
        return tree.tail_equals(0, context, window)
    own = tree.tokens(0)
    return len(context) == len(own) and list(context[-window:]) == own[-window:]


def extension_of(tree: Any, prompt_ids: Sequence[int]) -> Sequence[int] | None:
    """What `prompt_ids` adds after sequence 0 (unchecked), or None when it does not start with it."""
    if is_native(tree):
        return tree.extension_of(0, prompt_ids)
    old = tree.tokens(0)
    n = len(old)
    if len(prompt_ids) < n or list(prompt_ids[:n]) != old:
        return None
    return prompt_ids[n:]


def advance_many(tree: Any, positions: Any, token_ids: Sequence[int]) -> Any:
    """`positions` advanced over every token of `token_ids` in turn."""
    if is_native(tree):
        return tree.advance_positions_many(positions, token_ids)
    advance = tree.advance_positions
    for token in token_ids:
        positions = advance(positions, token)
    return positions
