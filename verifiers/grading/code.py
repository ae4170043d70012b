"""Code answers: run a program, then its tests, in the code sandbox (`thinkahead.verifiers.sandbox`).

`CodeChecker` passes a program only when its tests ran to their end within the timeout (no
network, a read-only filesystem, resource limits, every process ended); `extract_code` takes the
program out of a markdown answer; `humaneval_tests(test, entry_point)` builds HumanEval's tests.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from thinkahead.verifiers.grading.base import require_text
from thinkahead.verifiers.sandbox import (
    DEFAULT_STDERR_CHARS,
    DEFAULT_TIMEOUT_S,
    SandboxLimits,
    run_sandboxed,
)

__all__ = ["CodeChecker", "CodeResult", "extract_code", "humaneval_tests"]


@dataclass(slots=True, frozen=True)
class CodeResult:
    """Outcome of running a program with its tests."""

    passed: bool
    returncode: int | None
    timed_out: bool
    stderr_tail: str


_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The code in a markdown answer: the (longest) ```python fence, else the longest bare fence, else `text`."""
    require_text(text, "text")
    blocks = [(m.group(1).strip().lower(), m.group(2)) for m in _FENCE.finditer(text)]
    python = [body for lang, body in blocks if lang in ("python", "python3", "py")]
    bare = [body for lang, body in blocks if not lang]
    chosen = python or bare
    return max(chosen, key=len) if chosen else text


def humaneval_tests(test: str, entry_point: str) -> str:
    """The tests string for a HumanEval task: its `check` function, then `check(entry_point)`."""
    require_text(test, "test")
    require_text(entry_point, "entry_point")
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    return f"{test}\ncheck({entry_point})\n"


class CodeChecker:
    """Runs a program, then its tests, in the code sandbox (`thinkahead.verifiers.sandbox`).

    The program may be a markdown answer: a ```python fence is extracted first. A run passes only
    when the tests ran to their end within the timeout (exiting early with status 0 fails). The
    sandbox has no network, a read-only filesystem but its temp working directory, resource
    limits (`limits`, default `SandboxLimits()`), and ends every process the program started; its
    module docstring says what it does not stop.
    """

    name = "code"

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, stderr_chars: int = DEFAULT_STDERR_CHARS,
                 limits: SandboxLimits | None = None) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number, got {type(timeout_s).__name__}")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s}")
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self.timeout_s = float(timeout_s)
        self.stderr_chars = int(stderr_chars)
        self.limits = SandboxLimits() if limits is None else limits

    def run(self, program: str, tests: str) -> CodeResult:
        """Run the program with its tests and report how it ended."""
        code = extract_code(require_text(program, "program"))
        result = run_sandboxed(code, require_text(tests, "tests"), timeout_s=self.timeout_s, limits=self.limits,
                               stderr_chars=self.stderr_chars)
        return CodeResult(passed=result.passed, returncode=result.returncode, timed_out=result.timed_out,
                          stderr_tail=result.stderr)

    def check(self, program: str, tests: str, /) -> bool:
        """True when the program passes its tests within the timeout."""
        return self.run(program, tests).passed
