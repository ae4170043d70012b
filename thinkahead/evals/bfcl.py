"""BFCL multi-turn tool use as `react` tasks, run and graded on BFCL's own Python tool environments.

bfcl-eval ships, besides the data, the stateful tool classes its multi-turn checker executes
(`GorillaFileSystem`, `TwitterAPI`, `TravelAPI`, `TradingBot`, ... in
`bfcl_eval/eval_checker/multi_turn_eval/func_source_code/`). They import only the standard library
and mpmath, so they are imported straight from the installed package or its wheel
(`thinkahead.evals.data.import_package_module`); the rest of bfcl-eval (openai, vllm, ...) is not.

- `bfcl_tasks`: one task per BFCL record; the user turns become one numbered request list, the
  question of a `react` run. The reference is JSON: initial state, involved classes, excluded
  functions and the ground-truth calls.
- `BfclEnvironment`: fresh tool instances for one task. `tools()` gives `react` one tool per BFCL
  function (`Action: cd[folder='document']`, arguments as Python keywords or a JSON object).
- `BfclChecker` (checker "bfcl"): replays the calls of an answer (a react transcript: every
  `Action:` that got an `Observation:`; or one `name(args)` call per line) on a fresh environment,
  the ground truth on another, and accepts when the final states are equal (BFCL's state check)
  and every ground-truth call result appears among the answer's results (BFCL's response check).
  Unlike BFCL it checks once at the end, not after each user turn, since the turns are one request.

BFCL's math functions compute whatever they are asked (`power` of a 65-digit base, `square_root`
or `logarithm` to a precision of 10**8 digits: minutes to hours, mostly in C code that holds the GIL), so
`BfclEnvironment.call` bounds their sizes first with the calculator's checks
(`thinkahead.workflows.tools`); a call over a bound is an "Error during execution: ..." result. In
a react run each tool call also runs off the event loop under react's `tool_timeout_s`.

Categories: 'multi_turn_base' and 'multi_turn_long_context'. 'multi_turn_miss_func' and
'multi_turn_miss_param' are not offered: they grade whether the model declines a turn it cannot do
and asks for what is missing, which needs the real turn-by-turn conversation.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from thinkahead.evals.tasks import Task
from thinkahead.workflows.tools import check_digits_argument, check_power

__all__ = ["CATEGORIES", "CLASSES", "BfclChecker", "BfclEnvironment", "bfcl_tasks", "ground_truth_transcript",
           "parse_arguments", "parse_calls"]

CATEGORIES = ("multi_turn_base", "multi_turn_long_context")

_SOURCE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
CLASSES: dict[str, tuple[str, str]] = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
"""BFCL multi-turn class -> (module in func_source_code, function-doc file)."""
_STATELESS = {"MathAPI"}
_MATH = "MathAPI"
_MATH_LOCK = threading.Lock()
"""MathAPI sets process-wide state (mpmath's precision) before computing: its calls run one at a time."""

PROMPT = (
    "You operate tools on behalf of a user. Carry out every request below, in order, by calling the "
    "tools; a later request may rely on the results of an earlier one. Write tool arguments as Python "
    "keyword arguments, e.g. Action: tool_name[arg='text', n=2]. When all requests are done, give a "
    "one-line Final Answer.\n\n{requests}"
)


def _turn_text(turn: Sequence[dict[str, Any]]) -> str:
    return " ".join(m["content"].strip() for m in turn if m.get("role") == "user")


def bfcl_tasks(n: int | None = None, offset: int = 0, seed: int | None = None, *,
               category: str = "multi_turn_base") -> list[Task]:
    """BFCL multi-turn records as react tasks; reference: JSON for `BfclChecker`; checker "bfcl"."""
    from thinkahead.evals.data import bfcl, bfcl_answers
    from thinkahead.evals.loaders import select

    if category not in CATEGORIES:
        raise ValueError(f"BFCL category must be one of {', '.join(CATEGORIES)}, got {category!r} "
                         "(miss_func / miss_param need a turn-by-turn conversation)")
    answers = bfcl_answers(category)
    tasks = []
    for i, record in select(bfcl(category), n, offset, seed):
        unknown = [c for c in record["involved_classes"] if c not in CLASSES]
        if unknown:
            raise ValueError(f"BFCL record {record['id']} uses classes thinkahead cannot run: {unknown}")
        requests = "\n".join(f"Request {k}: {_turn_text(turn)}" for k, turn in enumerate(record["question"], 1))
        reference = {
            "id": record["id"],
            "initial_config": record["initial_config"],
            "involved_classes": record["involved_classes"],
            "excluded_function": record.get("excluded_function", []),
            "long_context": category == "multi_turn_long_context",
            "ground_truth": answers[record["id"]],
        }
        tasks.append(Task(record["id"], {"question": PROMPT.format(requests=requests)},
                          json.dumps(reference, sort_keys=True), i + 1))
    return tasks


def _parse_reference(reference: str) -> dict[str, Any]:
    """The reference JSON as a dict; ValueError when it is not one with the keys the checker needs."""
    try:
        ref = json.loads(reference)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"a bfcl reference must be a JSON string ({exc})") from exc
    needed = ("initial_config", "involved_classes", "ground_truth")
    if not isinstance(ref, dict) or any(key not in ref for key in needed):
        raise ValueError(f"a bfcl reference must be a JSON object with {', '.join(needed)}")
    return ref


# --------------------------------------------------------------------------- calls


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"arguments must be literals, got {ast.unparse(node)!r}") from exc


def parse_arguments(text: str) -> tuple[list[Any], dict[str, Any]]:
    """(args, kwargs) from a tool's argument text: Python call arguments ("a='x', n=2") or a JSON object."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            return [], obj
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"cannot parse arguments {text!r}: {exc.msg}") from exc
    if not isinstance(call, ast.Call) or any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise ValueError(f"cannot parse arguments {text!r}")
    return [_literal(a) for a in call.args], {k.arg: _literal(k.value) for k in call.keywords}


_CALL_LINE = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.DOTALL)
_OBSERVATION = re.compile(r"^Observation:", re.MULTILINE)
_THOUGHT = re.compile(r"^Thought:", re.MULTILINE)


def parse_calls(answer: str) -> list[tuple[str, str]]:
    """(function name, argument text) of every call in an answer, in order.

    A react transcript (it has `Observation:` lines): the action of each turn that got an
    observation, read with react's own `parse_turn`, so exactly the calls the loop ran (an action
    followed by a final answer never ran). Otherwise one `name(args)` call per line, as BFCL
    writes its ground truth.
    """
    if not isinstance(answer, str):
        raise TypeError(f"answer must be a str, got {type(answer).__name__}")
    if not _OBSERVATION.search(answer):
        return [(m.group(1), m.group(2)) for line in answer.splitlines() if (m := _CALL_LINE.match(line))]
    from thinkahead.workflows.react import parse_turn

    calls, pos = [], 0
    while (observed := _OBSERVATION.search(answer, pos)) is not None:
        parsed = parse_turn(answer[pos : observed.start()])
        if isinstance(parsed, tuple):
            calls.append(parsed)
        nxt = _THOUGHT.search(answer, observed.end())  # the next turn starts with "Thought:"
        if nxt is None:
            break
        pos = nxt.start()
    return calls


def _result_text(value: Any) -> str:
    """A call's result as BFCL records it: strings as is, dicts as JSON, anything else via str()."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


# --------------------------------------------------------------------------- environment


class BfclEnvironment:
    """Fresh BFCL tool instances for one task, loaded with its initial state."""

    def __init__(self, reference: str) -> None:
        from thinkahead.evals.data import import_package_module

        ref = _parse_reference(reference)
        self.excluded = set(ref.get("excluded_function") or [])
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Callable[..., Any]] = {}
        self.docs: dict[str, str] = {}
        for class_name in ref["involved_classes"]:
            if class_name not in CLASSES:
                raise ValueError(f"unknown BFCL class {class_name!r}; known: {', '.join(CLASSES)}")
            module_name, doc_file = CLASSES[class_name]
            instance = getattr(import_package_module(f"{_SOURCE}.{module_name}"), class_name)()
            if class_name not in _STATELESS:
                config = copy.deepcopy(ref["initial_config"].get(class_name, {}))
                instance._load_scenario(config, long_context=bool(ref.get("long_context")))
            self.instances[class_name] = instance
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_") and name not in self.excluded:
                    self.methods[name] = method  # a later class wins a clash, as in BFCL
            for doc in _docs(doc_file):
                if doc["name"] in self.methods:
                    self.docs[doc["name"]] = _describe(doc)

    def call(self, name: str, arguments: str) -> str:
        """Run one call (argument text as `parse_arguments` reads it); errors come back as text, as in BFCL."""
        if name not in self.methods:
            return f"Error during execution: unknown function {name!r}"
        method = self.methods[name]
        try:
            args, kwargs = parse_arguments(arguments)
            if type(getattr(method, "__self__", None)).__name__ != _MATH:
                return _result_text(method(*args, **kwargs))
            _check_math_call(name, method, args, kwargs)
            with _MATH_LOCK:
                return _result_text(method(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - a failing call is a result the agent sees, as in BFCL
            return f"Error during execution: {exc}"

    def state(self) -> dict[str, dict[str, Any]]:
        """The public attributes of every instance (what BFCL's state check compares)."""
        return {name: {k: v for k, v in vars(obj).items() if not k.startswith("_")} for name, obj in self.instances.items()}

    def tools(self) -> dict[str, Callable[[str], str]]:
        """One react tool per available function, bound to this environment; its docstring documents it."""
        tools = {}
        for name in self.methods:
            def tool(arguments: str, _name: str = name) -> str:
                return self.call(_name, arguments)
            tool.__name__ = name
            tool.__doc__ = self.docs.get(name, name)
            tools[name] = tool
        return tools


def _check_math_call(name: str, method: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> None:
    """ValueError when a MathAPI call would compute an oversized result (checked before it runs)."""
    try:
        bound = inspect.signature(method).bind(*args, **kwargs).arguments
    except TypeError:
        return  # the call itself fails, with BFCL's own message
    if name == "power":
        check_power(bound.get("base"), bound.get("exponent"))
    elif name in ("square_root", "logarithm"):
        check_digits_argument(bound.get("precision"), "precision")
    elif name == "round_number":
        check_digits_argument(bound.get("decimal_places"), "decimal_places")  # round(int, -n) computes 10**n


_DOC_CACHE: dict[str, list[dict[str, Any]]] = {}


def _docs(doc_file: str) -> list[dict[str, Any]]:
    if doc_file not in _DOC_CACHE:
        from thinkahead.evals.data import bfcl_func_docs

        _DOC_CACHE[doc_file] = bfcl_func_docs(doc_file)
    return _DOC_CACHE[doc_file]


def _describe(doc: dict[str, Any]) -> str:
    """One line for react's tool list: what the function does and its arguments."""
    description = doc.get("description", "").split("Tool description:", 1)[-1].strip().replace("\n", " ")
    params = doc.get("parameters", {})
    required = set(params.get("required", []))
    args = [f"{p} ({spec.get('type', 'any')}{'' if p in required else ', optional'})"
            for p, spec in params.get("properties", {}).items()]
    return f"{description} Arguments: {', '.join(args) if args else 'none'}."


def _ground_truth_calls(ref: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(function name, argument text) of each ground-truth call of a parsed reference, turn after turn."""
    for turn in ref["ground_truth"]:
        for call in turn:
            m = _CALL_LINE.match(call)
            if not m:
                raise ValueError(f"unparsable ground-truth call {call!r}")
            yield m.group(1), m.group(2)


def ground_truth_transcript(reference: str) -> str:
    """The ground-truth calls of a task written as the react loop writes a transcript (for tests and examples)."""
    env = BfclEnvironment(reference)
    lines = []
    for name, args in _ground_truth_calls(_parse_reference(reference)):
        lines += [f"Thought: call {name}", f"Action: {name}[{args}]", f"Observation: {env.call(name, args)}"]
    return "\n".join([*lines, "Thought: all requests are done", "Final Answer: done"]) + "\n"


class BfclChecker:
    """Final-state and call-result check of an answer's tool calls against BFCL's ground truth."""

    name = "bfcl"

    def run(self, answer: str, reference: str) -> tuple[bool, str]:
        """(passed, why): replays both call lists on fresh environments and compares."""
        ref = _parse_reference(reference)
        model, truth = BfclEnvironment(reference), BfclEnvironment(reference)
        model_results = [model.call(name, args) for name, args in parse_calls(answer)]
        truth_results = [truth.call(name, args) for name, args in _ground_truth_calls(ref)]
        got, want = model.state(), truth.state()
        for class_name, attributes in want.items():
            for key, value in attributes.items():
                if got[class_name].get(key) != value:
                    return False, f"state differs: {class_name}.{key}"
        remaining = list(model_results)
        for result in truth_results:
            if result in remaining:
                remaining.remove(result)
            else:
                return False, f"missing call result {result[:120]!r}"
        return True, "ok"

    def check(self, answer: str, reference: str, /) -> bool:
        """True when the answer's calls leave the ground truth's state and produce its results."""
        return self.run(answer, reference)[0]
