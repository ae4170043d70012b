"""The sessions of bench/agent_sessions.py: tokenizers and synthetic coding and ReAct agent sessions
built from GSM8K and HumanEval text (see that script's docstring for their shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import array
import os
import random
import re
import sys
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_data import gsm8k, humaneval  # noqa: E402

from thinkahead.token_spec.simulator import Turn  # noqa: E402


CACHE = Path(os.environ.get("THINKAHEAD_HOME") or Path.home() / ".cache" / "thinkahead")
QWEN_GGUF = CACHE / "models" / "qwen2.5-coder-0.5b" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_DIR = CACHE / "tokenizers" / "qwen2.5-coder"


# ------------------------------------------------------------------ tokenizers
class WordTokenizer:
    """Deterministic fallback: words, single punctuation marks and whitespace runs, ids in first-seen order."""

    name = "words"
    _pattern = re.compile(r"<\|[a-z_]+\|>|\w+|[^\w\s]|\s+")

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        vocab = self.vocab
        return [vocab.setdefault(piece, len(vocab)) for piece in self._pattern.findall(text)]


class QwenTokenizer:
    name = "qwen2.5"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def load_tokenizer(kind: str) -> WordTokenizer | QwenTokenizer:
    """The Qwen2.5 tokenizer from the local cache (never downloaded), else the word tokenizer."""
    if kind == "words":
        return WordTokenizer()
    try:
        from transformers import AutoTokenizer

        if (QWEN_DIR / "tokenizer.json").exists():
            return QwenTokenizer(AutoTokenizer.from_pretrained(QWEN_DIR))
        if QWEN_GGUF.exists():
            tok = AutoTokenizer.from_pretrained(QWEN_GGUF.parent, gguf_file=QWEN_GGUF.name)
            QWEN_DIR.mkdir(parents=True, exist_ok=True)
            tok.save_pretrained(QWEN_DIR)  # converting the GGUF vocabulary takes ~25 s: do it once
            return QwenTokenizer(tok)
    except Exception as exc:  # an unreadable file must not stop the benchmark
        print(f"Qwen tokenizer unavailable ({exc}); using the word tokenizer", file=sys.stderr)
    if kind == "qwen":
        raise SystemExit("the Qwen tokenizer was asked for but is not in the local cache")
    return WordTokenizer()


# -------------------------------------------------------------------- sessions
@dataclass(slots=True)
class RecordedSession:
    """A session stored compactly: its final token sequence and where each turn's prompt and output end.

    Iterating yields the turns with fresh int objects for every prompt, as a
    server that re-tokenizes the conversation each turn would see them.
    """

    workload: str
    tokens: array.array = field(default_factory=lambda: array.array("i"))
    turns: list[tuple[int, int]] = field(default_factory=list)  # (prompt end, output end)

    def __iter__(self) -> Iterator[Turn]:
        for prompt_end, output_end in self.turns:
            yield Turn(self.tokens[:prompt_end].tolist(), self.tokens[prompt_end:output_end].tolist())

    def __len__(self) -> int:
        return len(self.turns)


class Conversation:
    """Builds a session message by message in Qwen's chat format."""

    def __init__(self, tok, workload: str, system: str) -> None:
        self.tok = tok
        self.session = RecordedSession(workload)
        self._after_output = False
        self.message("system", system)

    def message(self, role: str, content: str) -> None:
        """A message the agent receives (system, user or tool): new prompt tokens."""
        text = f"<|im_start|>{role}\n{content}<|im_end|>\n"
        if self._after_output:
            text = "\n" + text
            self._after_output = False
        self.session.tokens.extend(self.tok.encode(text))

    def reply(self, content: str) -> None:
        """One request: the prompt so far + the assistant header, and `content` as its output."""
        if self._after_output:
            self.session.tokens.extend(self.tok.encode("\n"))
        self.session.tokens.extend(self.tok.encode("<|im_start|>assistant\n"))
        prompt_end = len(self.session.tokens)
        self.session.tokens.extend(self.tok.encode(content) + self.tok.encode("<|im_end|>"))
        self.session.turns.append((prompt_end, len(self.session.tokens)))
        self._after_output = True


CODE_SYSTEM = """You are a coding agent working in a Python repository. You complete programming tasks by calling \
tools, one tool call per message, and you keep going until the tests pass.

Tools:
- read_file: show a file. Arguments: path.
- write_file: replace a function in a file, or add it if it is missing. Arguments: path, content (the complete \
function, with its imports, signature and docstring).
- run_tests: run the tests of one task and show pytest's report. Arguments: path.

Call a tool like this, and write nothing after the call:
<tool>write_file</tool>
<path>solution.py</path>
<content>
def example(x: int) -> int:
    return x + 1
</content>

Rules:
1. Keep the signature and the docstring of every function exactly as the task gives them.
2. Write plain Python 3 with the standard library only.
3. After writing a function, always run its tests. If a test fails, read the report, explain the cause in one or \
two sentences, and write the corrected function in full.
4. Do not change functions that belong to other tasks.
5. When the tests pass, say that the task is done in one sentence and wait for the next task.
"""

REACT_SYSTEM = """You are a careful math assistant that solves word problems step by step. You can use one tool:
- calculator: evaluates an arithmetic expression with + - * / ( ) and returns the number.

Use this format:
Thought: what you know and what to compute next
Action: calculator
Action Input: the expression
Then wait for the Observation. Repeat Thought/Action/Action Input as needed. When you know the answer, write:
Thought: the final reasoning step
Final Answer: the number

Example:
Question: Tom has 3 boxes with 12 pencils each. He gives away 10 pencils. How many are left?
Thought: Tom has 3 boxes of 12 pencils, so he has 3*12 pencils.
Action: calculator
Action Input: 3*12
Observation: 36
Thought: He gives away 10 of the 36 pencils, so 36-10 are left.
Action: calculator
Action Input: 36-10
Observation: 26
Thought: 26 pencils are left.
Final Answer: 26
"""

WRITE_CALL = "<tool>write_file</tool>\n<path>solution.py</path>\n<content>\n"

_BUGS = [
    ("<=", "<"), (" < ", " <= "), (">=", ">"), (" > ", " >= "), ("+ 1", "- 1"), ("== ", "!= "),
    ("True", "False"), ("[1:]", "[2:]"), ("0", "1"),
]


def plant_bug(code: str) -> tuple[str, str] | None:
    """A plausible one-character-class bug in `code`, and the operator it broke; None if none applies."""
    for old, new in _BUGS:
        if old in code:
            return code.replace(old, new, 1), old.strip()
    return None


def coding_session(tok, tasks: list[dict], rng: random.Random, read_every: int = 3) -> RecordedSession:
    conv = Conversation(tok, "code", CODE_SYSTEM)
    written: list[str] = []
    for k, task in enumerate(tasks):
        entry, spec = task["entry_point"], task["prompt"]
        code = spec + task["canonical_solution"].rstrip() + "\n"
        conv.message("user", f"Task {k + 1}: add the function `{entry}` to solution.py.\n```python\n{spec}```")
        bug = plant_bug(task["canonical_solution"]) if rng.random() < 0.5 else None
        first = spec + bug[0].rstrip() + "\n" if bug else code
        intro = rng.choice(["I'll implement", "Let me write", "Implementing"])
        conv.reply(f"{intro} `{entry}`.\n{WRITE_CALL}{first}</content>")
        conv.message("tool", f"Wrote {first.count(chr(10))} lines to solution.py.")
        conv.reply(f"<tool>run_tests</tool>\n<path>tests/test_{entry}.py</path>")
        test_src = task["test"].strip()
        if bug:
            failing = next((line for line in test_src.splitlines() if "assert" in line), "assert False")
            report = (
                f"============================= test session starts ==============================\n"
                f"collected 1 item\n\ntests/test_{entry}.py F\n\n{'=' * 35} FAILURES {'=' * 35}\n"
                f"____________________________________ test_{entry} ____________________________________\n\n"
                f"{test_src}\n\n>   {failing.strip()}\nE   AssertionError\n\n"
                f"tests/test_{entry}.py:{rng.randint(8, 40)}: AssertionError\n"
                f"=========================== short test summary info ============================\n"
                f"FAILED tests/test_{entry}.py::test_{entry} - AssertionError\n"
                f"{'=' * 30} 1 failed in 0.0{rng.randint(1, 9)}s {'=' * 30}"
            )
            conv.message("tool", report)
            conv.reply(
                f"The test fails because the `{bug[1]}` in `{entry}` is wrong. Here is the corrected function.\n"
                f"{WRITE_CALL}{code}</content>"
            )
            conv.message("tool", f"Wrote {code.count(chr(10))} lines to solution.py.")
            conv.reply(f"<tool>run_tests</tool>\n<path>tests/test_{entry}.py</path>")
        conv.message(
            "tool",
            f"============================= test session starts ==============================\ncollected 1 item\n\n"
            f"tests/test_{entry}.py .\n\n{'=' * 30} 1 passed in 0.0{rng.randint(1, 9)}s {'=' * 30}",
        )
        conv.reply(f"The tests pass: `{entry}` is done.")
        written.append(code)
        if (k + 1) % read_every == 0:
            conv.message("user", "Show me the current solution.py.")
            conv.reply("<tool>read_file</tool>\n<path>solution.py</path>")
            conv.message("tool", "\n\n".join(written))
            conv.reply(f"solution.py now holds {len(written)} functions, all with passing tests.")
    return conv.session


def react_session(tok, problems: list[dict]) -> RecordedSession:
    conv = Conversation(tok, "react", REACT_SYSTEM)
    for problem in problems:
        conv.message("user", f"Question: {problem['question']}")
        lines = [line.strip() for line in problem["answer"].split("\n") if line.strip()]
        final = lines[-1].replace("####", "").strip()
        pending: list[str] = []
        for line in lines[:-1]:
            calc = re.search(r"<<([^=<>]+)=([^<>]+)>>", line)
            if calc is None:
                pending.append(line)
                continue
            thought = " ".join(pending + [re.sub(r"<<[^<>]*>>[^\s]*", "", line).strip()])
            pending = []
            conv.reply(f"Thought: {thought}\nAction: calculator\nAction Input: {calc.group(1)}")
            conv.message("tool", f"Observation: {calc.group(2)}")
        thought = " ".join(pending) or f"The answer is {final}."
        conv.reply(f"Thought: {thought}\nFinal Answer: {final}")
    return conv.session


def build_sessions(
    tok, n_code: int, tasks_per_session: int, n_react: int, problems_per_session: int
) -> list[RecordedSession]:
    rng = random.Random(0)
    tasks, problems = humaneval(), gsm8k()
    sessions = []
    for s in range(n_code):
        picked = [tasks[(s * 37 + k) % len(tasks)] for k in range(tasks_per_session)]
        sessions.append(coding_session(tok, picked, rng))
    for s in range(n_react):
        sessions.append(react_session(tok, problems[s * problems_per_session:(s + 1) * problems_per_session]))
    order = list(range(len(sessions)))
    random.Random(1).shuffle(order)  # the agents' sessions arrive mixed, as at a server
    return [sessions[i] for i in order]

