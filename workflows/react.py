"""`react`: an agent loop (thought, tool call, observation) with Python tools, bounded.

The model continues a transcript in the ReAct format; generation stops before "Observation:",
the named tool runs on the argument, and its result is appended. The loop ends at
"Final Answer:" or after `max_turns` tool calls, or at a call of a client tool (one the caller runs,
e.g. a function of an OpenAI chat request): the run then ends with the call in `observe["pending"]`,
and a later run continues from the transcript (input `transcript`) with the tool's result. Each tool call runs off the event loop with a
time limit (`tool_timeout_s`, see `thinkahead.workflows.tools.call_tool`): a slow tool never stalls
the other runs, and one past the limit is an "error: ..." observation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from thinkahead.orchestrator.graph import END, START, GraphError, StepGraph
from thinkahead.token_spec.grammar import GrammarSpec, styled_schema
from thinkahead.workflows.tools import DEFAULT_TOOLS, TOOL_TIMEOUT_S, call_tool, check_timeout

INSTRUCTIONS = (
    "Answer the question. You can call tools. Use exactly this format:\n"
    "Thought: what to do next\nAction: tool_name[input]\nObservation: the tool's result\n"
    "... (Thought/Action/Observation can repeat)\nThought: I know the answer\nFinal Answer: the answer\n\n"
    "Tools:\n{tools}\n\nQuestion: {question}"
)
_ACTION = re.compile(r"Action:\s*([A-Za-z_][\w-]*)\s*\[(.*)\]", re.DOTALL)
_FINAL = re.compile(r"Final Answer:\s*(.*)", re.DOTALL)


def parse_turn(text: str) -> tuple[str, str] | str | None:
    """("tool", "argument") for an action, the answer text for a final answer, None for neither."""
    final = _FINAL.search(text)
    action = None
    for action in _ACTION.finditer(text):
        pass
    if final and (action is None or final.start() > action.start()):
        return final.group(1).strip()
    if action is not None:
        return action.group(1), action.group(2).strip()
    return None


def turn_grammar(tools: dict[str, Callable[..., object]], require_call: bool = False) -> GrammarSpec:
    """One ReAct turn after "Thought:": the thought's line, then an action naming one of `tools` or
    (unless `require_call`) a final answer. A tool with a JSON schema (its function's `parameters`, as client tools carry)
    takes a JSON object valid against it; any other takes one line without "]"."""
    calls = []
    for name, fn in tools.items():
        schema = getattr(fn, "parameters", None)
        argument = (f"%json {json.dumps(styled_schema(schema), ensure_ascii=False)}" if isinstance(schema, dict)
                    else "/[^\\]\\n]*/")
        calls.append(f'{json.dumps(name + "[")} {argument} "]"')
    turn = "action" if require_call else "(action | final)"
    return GrammarSpec.lark(f"%llguidance {{}}\nstart: /[^\\n]*/ \"\\n\" {turn}\n"
                            f'action: "Action: " ({" | ".join(calls)})\n'
                            'final: "Final Answer: " /(.|\\n)*/\n', field="tools")


def react(*, tools: dict[str, Callable[[str], str]] | None = None, max_turns: int = 6, tier: str = "large",
          max_tokens: int = 160, tool_timeout_s: float = TOOL_TIMEOUT_S,
          client_tools: dict[str, Callable[[str], str | None]] | None = None, require_call: bool = False) -> StepGraph:
    """question -> (act -> observe) until a final answer, at most `max_turns` times -> answer.

    `tool_timeout_s`: the seconds one tool call may run before its observation is a timeout error.
    `client_tools`: tools the caller runs; each function checks a call's argument and returns an
    error (the observation) or None, which ends the run with the call pending.
    Where the model enforces grammars each turn follows `turn_grammar` (an action's JSON fits its
    tool's schema); `require_call` makes every turn an action (OpenAI's tool_choice "required").
    """
    try:
        timeout_s = check_timeout(tool_timeout_s)
    except ValueError as exc:
        raise GraphError(str(exc)) from None
    client = dict(client_tools or {})
    tools = dict(DEFAULT_TOOLS if tools is None and not client else tools or {})
    if not tools and not client:
        raise GraphError("react needs at least one tool")
    for name, fn in {**tools, **client}.items():
        if not re.fullmatch(r"[A-Za-z_][\w-]*", name) or not callable(fn):
            raise GraphError(f"tool {name!r} must have a word name and be callable")
    listing = "\n".join(f"- {name}: {(fn.__doc__ or '').strip().splitlines()[0] if fn.__doc__ else name}"
                        for name, fn in {**tools, **client}.items())

    def act_prompt(state: dict) -> list[dict[str, str]]:
        user = INSTRUCTIONS.format(tools=listing, question=state["question"])
        transcript = (state.get("observe") or {}).get("transcript", state.get("transcript", ""))
        return [{"role": "user", "content": user}, {"role": "assistant", "content": transcript + "Thought:"}]

    async def observe(state: dict) -> dict:
        previous = state.get("observe") or {"transcript": state.get("transcript", ""), "final": None, "calls": 0}
        # the model's text exactly as generated, so the next prompt extends this one token for token
        act = state["act"]
        text = act.lstrip() if act.lstrip().startswith("Thought:") else "Thought:" + act
        parsed = parse_turn(text)
        transcript = previous["transcript"] + text.rstrip() + "\n"
        if isinstance(parsed, str):
            return {"transcript": transcript, "final": parsed, "calls": previous["calls"]}
        if parsed is None:
            observation = "error: no action; write Action: tool_name[input] or Final Answer: ..."
        elif parsed[0] in client:
            problem = client[parsed[0]](parsed[1])
            if problem is None:  # the caller runs it: the run ends here, the call pending
                pending = {"tool": parsed[0], "input": parsed[1]}
                return {"transcript": transcript, "final": None, "calls": previous["calls"] + 1, "pending": pending}
            observation = f"error: {problem}"
        elif parsed[0] not in tools:
            observation = f"error: unknown tool {parsed[0]!r}; tools: {', '.join([*tools, *client])}"
        else:
            observation = await call_tool(parsed[0], tools[parsed[0]], parsed[1], timeout_s=timeout_s)
        transcript += f"Observation: {observation}\n"
        return {"transcript": transcript, "final": None, "calls": previous["calls"] + 1}

    def answer(state: dict) -> str | None:
        final = (state.get("observe") or {}).get("final")
        return final if final is not None else None

    g = StepGraph("react", inputs=["question"], output="answer")
    g.add_loop("turns", max_iters=max_turns, condition=lambda s: (s.get("observe") or {}).get("final") is None
               and "pending" not in (s.get("observe") or {}))
    g.add_generate("act", act_prompt, tier=tier, inputs=["question"], max_tokens=max_tokens, stop=["Observation:"],
                   strip=False, grammar=turn_grammar({**tools, **client}, require_call))
    g.add_tool("observe", observe, inputs=["act"])
    g.add_tool("answer", answer, inputs=[])
    g.add_edge(START, "turns")
    g.add_cycle("turns", ["act", "observe"], "answer")
    g.add_edge("answer", END)
    return g
