"""Agent frameworks against thinkahead's OpenAI-compatible server: each framework's own tool agent on
arithmetic questions that need one multiply/add tool call (issue 33).

  langgraph    langgraph.prebuilt.create_react_agent over langchain_openai.ChatOpenAI (the `langchain`
               package, whose `langchain.agents.create_agent` supersedes it, is not a dependency)
  agents       the OpenAI Agents SDK: Agent + Runner over OpenAIChatCompletionsModel
  pydantic-ai  pydantic_ai.Agent over OpenAIChatModel
  smolagents   smolagents.ToolCallingAgent over OpenAIServerModel (answers through its final_answer tool)
  litellm      a plain tool loop of litellm.completion(model="openai/<name>", api_base=..., tools=...)

Every framework runs at temperature 0, at most MAX_TURNS model calls a question, TIMEOUT_S per request.
Per question it records: correct (the expected number appears in the final answer), the tool calls the
model made, whether every call was valid (a listed tool, arguments that reached the function), the
seconds, and the transcript (clipped to ~2 KB). An exception is that question's failure, never the bench's.

Writes bench/results/agent_frameworks.json and prints a markdown table. Needs the `frameworks` extra:
  pip install -e '.[frameworks]'
  python bench/agent_frameworks.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b \
      --frameworks langgraph,agents,pydantic-ai,smolagents,litellm [--questions N]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no model-price download at import

RESULTS = Path(__file__).resolve().parent / "results" / "agent_frameworks.json"
MAX_TURNS = 5  # model calls per question
TIMEOUT_S = 180.0  # per model request
# what every framework sends; empty with --via react (workflow models choose how their models sample)
SAMPLING: dict[str, Any] = {"temperature": 0}
CLIP = 2000  # transcript characters kept per question
API_KEY = "unused"
INSTRUCTIONS = ("You are a calculator assistant. Use the multiply and add tools to compute, "
                "then state the numeric result.")
PACKAGES = {"langgraph": ["langgraph", "langchain-openai", "langchain-core"], "agents": ["openai-agents"],
            "pydantic-ai": ["pydantic-ai-slim"], "smolagents": ["smolagents"], "litellm": ["litellm"]}


@dataclass(frozen=True)
class Question:
    text: str
    expected: int
    tool: str


QUESTIONS = [
    Question("What is 37 * 43?", 1591, "multiply"),
    Question("What is 1234 + 5678?", 6912, "add"),
    Question("Multiply 58 by 67.", 3886, "multiply"),
    Question("What is the sum of 4827 and 3956?", 8783, "add"),
    Question("What is 123 times 45?", 5535, "multiply"),
    Question("Add 9173 and 2648.", 11821, "add"),
    Question("What is the product of 89 and 76?", 6764, "multiply"),
    Question("What is 3589 plus 7464?", 11053, "add"),
    Question("Compute 214 * 19.", 4066, "multiply"),
    Question("What do you get when you add 6072 to 2939?", 9011, "add"),
]

# ---------------------------------------------------------------------------------------------- the tools

EXECUTED: list[tuple[str, float, float]] = []  # the calls that reached a tool function (one question at a time)


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    EXECUTED.append(("multiply", a, b))
    return a * b


def add(a: float, b: float) -> float:
    """Add two numbers."""
    EXECUTED.append(("add", a, b))
    return a + b


TOOLS: dict[str, Callable[[float, float], float]] = {"multiply": multiply, "add": add}
NUMBER = {"type": "number"}
TOOL_SCHEMAS = [{"type": "function", "function": {
    "name": name, "description": fn.__doc__,
    "parameters": {"type": "object", "properties": {"a": NUMBER, "b": NUMBER}, "required": ["a", "b"]}}}
    for name, fn in TOOLS.items()]


@dataclass
class Trace:
    """What one framework run produced: the final text, the tool calls the model asked for."""
    answer: str
    calls: int  # multiply/add (or unknown-name) calls the model made; smolagents' final_answer not counted
    valid: bool  # every call named a listed tool with arguments that reached it
    transcript: str


@dataclass
class Outcome:
    question: str
    expected: int
    correct: bool
    calls: int
    valid: bool
    seconds: float
    answer: str
    transcript: str
    error: str | None = None


def is_correct(answer: str, expected: int) -> bool:
    """The expected number appears in the answer: "1591", "1591.0", "1,591", "11 821" all count."""
    text = re.sub(r"(?<=\d)[,\u202f\u00a0 ](?=\d{3}\b)", "", answer)
    return any(float(n) == expected for n in re.findall(r"-?\d+(?:\.\d+)?", text))


def clip(text: str, limit: int = CLIP) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}\n...[{len(text) - limit} chars]...\n{text[-limit // 2:]}"


def valid_calls(calls: int, errors: int) -> bool:
    return errors == 0 and len(EXECUTED) == calls


# ---------------------------------------------------------------------------------------------- frameworks

def run_langgraph(url: str, model: str, question: str) -> Trace:
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    with warnings.catch_warnings():  # deprecated in favour of langchain.agents.create_agent (not installed)
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

        llm = ChatOpenAI(model=model, base_url=url, api_key=API_KEY, **SAMPLING, max_retries=0,
                         timeout=TIMEOUT_S)
        agent = create_react_agent(llm, [multiply, add], prompt=INSTRUCTIONS)
    state = agent.invoke({"messages": [("user", question)]}, {"recursion_limit": 2 * MAX_TURNS})
    messages = state["messages"]
    ai = [m for m in messages if isinstance(m, AIMessage)]
    calls = sum(len(m.tool_calls) + len(m.invalid_tool_calls) for m in ai)
    errors = sum(len(m.invalid_tool_calls) for m in ai)
    errors += sum(isinstance(m, ToolMessage) and m.status == "error" for m in messages)
    lines = [f"{m.type}: {m.content!s}" + (f" tool_calls={m.tool_calls}" if isinstance(m, AIMessage) and m.tool_calls
                                            else "") for m in messages]
    return Trace(str(messages[-1].content), calls, valid_calls(calls, errors), "\n".join(lines))


def run_agents(url: str, model: str, question: str) -> Trace:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    from agents.items import ItemHelpers, MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    async def go() -> Any:  # the client closes inside the loop that used it
        async with AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S) as client:
            agent = Agent(name="calculator", instructions=INSTRUCTIONS,
                          tools=[function_tool(multiply), function_tool(add)],
                          model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                          model_settings=ModelSettings(**SAMPLING))
            return await Runner.run(agent, question, max_turns=MAX_TURNS)

    result = asyncio.run(go())
    lines, calls, errors = [f"user: {question}"], 0, 0
    for item in result.new_items:
        if isinstance(item, ToolCallItem):
            calls += 1
            raw = item.raw_item
            lines.append(f"tool_call: {getattr(raw, 'name', '?')}({getattr(raw, 'arguments', '')})")
        elif isinstance(item, ToolCallOutputItem):
            errors += "error occurred" in str(item.output).lower()
            lines.append(f"tool: {item.output}")
        elif isinstance(item, MessageOutputItem):
            lines.append(f"assistant: {ItemHelpers.text_message_output(item)}")
        else:
            lines.append(f"{type(item).__name__}: {item.raw_item}")
    return Trace(str(result.final_output), calls, valid_calls(calls, errors), "\n".join(lines))


def run_pydantic_ai(url: str, model: str, question: str) -> Trace:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.messages import RetryPromptPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    async def go() -> Any:  # the client closes inside the loop that used it
        async with AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S) as client:
            llm = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=client))
            agent = Agent(llm, tools=[multiply, add], instructions=INSTRUCTIONS,
                          model_settings={**SAMPLING, "timeout": TIMEOUT_S})
            return await agent.run(question, usage_limits=UsageLimits(request_limit=MAX_TURNS))

    result = asyncio.run(go())
    parts = [p for m in result.all_messages() for p in m.parts]
    calls = sum(isinstance(p, ToolCallPart) for p in parts)
    errors = sum(isinstance(p, RetryPromptPart) for p in parts)
    lines = [f"{p.part_kind}: " + (f"{p.tool_name}({p.args})" if isinstance(p, ToolCallPart)
                                   else str(getattr(p, "content", ""))) for p in parts]
    return Trace(str(result.output), calls, valid_calls(calls, errors), "\n".join(lines))


def smolagents_tool(fn: Callable[[float, float], float]) -> Any:
    """A smolagents Tool around `fn` (its @tool decorator wants an Args section in the docstring)."""
    from smolagents import Tool

    class Arithmetic(Tool):
        name = fn.__name__
        description = fn.__doc__ or fn.__name__
        inputs = {"a": {"type": "number", "description": "a number"},
                  "b": {"type": "number", "description": "a number"}}
        output_type = "number"

        def forward(self, a: float, b: float) -> float:
            return fn(a, b)

    return Arithmetic()


def run_smolagents(url: str, model: str, question: str) -> Trace:
    from smolagents import OpenAIServerModel, ToolCallingAgent
    from smolagents.memory import ActionStep
    from smolagents.monitoring import LogLevel

    llm = OpenAIServerModel(model_id=model, api_base=url, api_key=API_KEY, **SAMPLING,
                            client_kwargs={"max_retries": 0, "timeout": TIMEOUT_S})
    agent = ToolCallingAgent(tools=[smolagents_tool(multiply), smolagents_tool(add)], model=llm,
                             instructions=INSTRUCTIONS, max_steps=MAX_TURNS, verbosity_level=LogLevel.OFF)
    answer = agent.run(question)
    lines, calls, errors = [f"user: {question}"], 0, 0
    for step in agent.memory.steps:
        if not isinstance(step, ActionStep):
            continue
        for call in step.tool_calls or []:
            calls += call.name != "final_answer"
            lines.append(f"tool_call: {call.name}({call.arguments})")
        if step.error is not None:
            errors += 1
            lines.append(f"error: {step.error}")
        if step.observations:
            lines.append(f"observation: {step.observations}")
        if not step.tool_calls and step.model_output:
            lines.append(f"assistant: {step.model_output}")
    return Trace(str(answer), calls, valid_calls(calls, errors), "\n".join(lines))


def run_litellm(url: str, model: str, question: str) -> Trace:
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": question}]
    calls, errors, answer = 0, 0, ""
    for _ in range(MAX_TURNS):
        response = litellm.completion(model=f"openai/{model}", api_base=url, api_key=API_KEY, messages=messages,
                                      tools=TOOL_SCHEMAS, **SAMPLING, timeout=TIMEOUT_S, num_retries=0)
        message = response.choices[0].message
        tool_calls = message.tool_calls or []
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in tool_calls]} if tool_calls else {"role": "assistant", "content": message.content})
        if not tool_calls:
            answer = message.content or ""
            break
        for call in tool_calls:
            calls += 1
            try:
                args = json.loads(call.function.arguments)
                content = str(TOOLS[call.function.name](float(args["a"]), float(args["b"])))
            except Exception as exc:  # an unknown tool or bad arguments: the model hears of it
                errors += 1
                content = f"error: {type(exc).__name__}: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    lines = [f"{m['role']}: {m.get('content')}" + (f" tool_calls={[c['function'] for c in m['tool_calls']]}"
                                                    if m.get("tool_calls") else "") for m in messages]
    return Trace(answer, calls, valid_calls(calls, errors), "\n".join(lines))


FRAMEWORKS: dict[str, Callable[[str, str, str], Trace]] = {
    "langgraph": run_langgraph, "agents": run_agents, "pydantic-ai": run_pydantic_ai,
    "smolagents": run_smolagents, "litellm": run_litellm}


def ask(framework: str, url: str, model: str, question: Question) -> Outcome:
    """One question through one framework; any exception is this question's failure."""
    EXECUTED.clear()
    start = time.perf_counter()
    try:
        trace = FRAMEWORKS[framework](url, model, question.text)
    except Exception as exc:
        return Outcome(question.text, question.expected, False, 0, False, time.perf_counter() - start, "",
                       clip(f"executed tools: {EXECUTED}"), clip(f"{type(exc).__name__}: {exc}"))
    return Outcome(question.text, question.expected, is_correct(trace.answer, question.expected), trace.calls,
                   trace.valid, time.perf_counter() - start, clip(trace.answer, 500), clip(trace.transcript))


# ---------------------------------------------------------------------------------------------- serving

@contextmanager
def serve(model: Any) -> Iterator[str]:
    """`model` behind thinkahead's OpenAI-compatible server on a loopback port; yields the /v1 base URL."""
    import uvicorn

    from thinkahead.serving.openai_server import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(small=model, large=model), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    try:
        warm_up(url, model.name)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def warm_up(url: str, model: str) -> None:
    """One tool call before the timed runs: the first compiles the tool grammar (seconds)."""
    import httpx

    httpx.post(f"{url}/chat/completions", timeout=TIMEOUT_S, json={
        "model": model, "messages": [{"role": "user", "content": "What is 2 * 3?"}], "tools": TOOL_SCHEMAS,
        "temperature": 0, "max_tokens": 48}).raise_for_status()


# ---------------------------------------------------------------------------------------------- report

def cpu_flags() -> list[str]:
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return sorted(f for f in words if f in {"avx2", "avx512f", "avx512_vnni"} or f.startswith("amx"))


def versions(frameworks: list[str]) -> dict[str, str]:
    found = {}
    for name in ["openai", "thinkahead", *(p for f in frameworks for p in PACKAGES[f])]:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


@dataclass
class Run:
    model: str
    framework: str
    outcomes: list[Outcome] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        n = len(self.outcomes)
        return {"correct": sum(o.correct for o in self.outcomes), "n": n,
                "tool_calls": sum(o.calls for o in self.outcomes),
                "all_valid": sum(o.valid for o in self.outcomes),
                "errors": sum(o.error is not None for o in self.outcomes),
                "seconds_per_question": round(sum(o.seconds for o in self.outcomes) / max(n, 1), 2)}


def table(runs: list[Run], models: list[str], frameworks: list[str]) -> str:
    cell = {(r.framework, r.model): r.summary() for r in runs}
    lines = ["| framework | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for fw in frameworks:
        cells = []
        for m in models:
            s = cell.get((fw, m))
            cells.append("-" if s is None else f"{s['correct']}/{s['n']} correct, {s['tool_calls']} calls "
                         f"({s['all_valid']}/{s['n']} all valid), {s['seconds_per_question']} s/q"
                         + (f", {s['errors']} errors" if s["errors"] else ""))
        lines.append(f"| {fw} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--via", choices=("chat", "react"), default="chat",
                        help="react: the frameworks call thinkahead/react (the workflow's agent loop) with their tools")
    args = parser.parse_args(argv)
    if args.via == "react":
        SAMPLING.clear()
    out = args.out or (RESULTS if args.via == "chat" else RESULTS.with_name(RESULTS.stem + "_react.json"))
    models, frameworks = args.models.split(","), args.frameworks.split(",")
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"unknown frameworks {unknown}; choose from {list(FRAMEWORKS)}")
    questions = QUESTIONS[:args.questions]

    from thinkahead.models import LocalModel

    runs: list[Run] = []
    for spec in models:
        start = time.perf_counter()
        model = LocalModel(spec)
        print(f"# {model.name}: loaded in {time.perf_counter() - start:.1f} s", flush=True)
        with serve(model) as url:
            for fw in frameworks:
                run = Run(model.name, fw)
                runs.append(run)
                for q in questions:
                    o = ask(fw, url, model.name if args.via == "chat" else "thinkahead/react", q)
                    run.outcomes.append(o)
                    print(f"{model.name} {fw}: {'ok ' if o.correct else 'BAD'} calls={o.calls} valid={o.valid} "
                          f"{o.seconds:.1f}s {q.text!r} -> {(o.error or o.answer)[:120]!r}", flush=True)
                print(f"{model.name} {fw}: {run.summary()}", flush=True)
        close = getattr(model, "close", None)
        if callable(close):
            close()
    names = list(dict.fromkeys(r.model for r in runs))
    report = table(runs, names, frameworks)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(), "cpus": os.cpu_count(), "cpu_flags": cpu_flags(),
        "python": platform.python_version(), "versions": versions(frameworks),
        "settings": {"via": args.via, **SAMPLING, "max_turns": MAX_TURNS, "timeout_s": TIMEOUT_S, "instructions": INSTRUCTIONS},
        "questions": [asdict(q) for q in questions],
        "summary": {f"{r.framework} / {r.model}": r.summary() for r in runs},
        "runs": [{"model": r.model, "framework": r.framework, **r.summary(),
                  "outcomes": [asdict(o) for o in r.outcomes]} for r in runs],
    }, indent=1) + "\n")
    print(f"\n{report}\n\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
