"""Tool calling through the server with the real `openai` client: scripted models write the calls, the
client runs the tools, the model finishes; tool_choice, repairs, streaming deltas, and the react
workflow taking a request's tools."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.llm_judge import LLM_SPECREASON
from tests.server_fixtures import JUDGE_YES, serve  # noqa: F401 (fixture)
from thinkahead.models import ScriptedModel
from thinkahead.serving.openai_server import create_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                          "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# A Qwen2.5-style template (tools in the system prompt, calls and results as tagged text), small enough to read.
TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|user|>\n<tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{% elif m.tool_calls %}<|assistant|>\n{% for c in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>\n{% endfor %}"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}\n{% endif %}{% endfor %}<|assistant|>\n"
)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def server(serve, outputs, tokenizer=None):
    model = TemplatedModel(outputs=outputs, name="agent-model", tokenizer=tokenizer)
    return model, serve(create_app({"policy": LLM_SPECREASON}, small=model, large=model))


@dataclass
class TemplatedModel(ScriptedModel):
    tokenizer: Any = None


def run_tools(calls) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"city": json.loads(c.function.arguments)["city"],
                                                                         "temp_c": 18})} for c in calls]


def test_a_full_tool_calling_loop_with_a_scripted_model(serve):
    model, url = server(serve, [f"Let me look.\n{CALL}", "It is 18 C in Paris."])
    c = client(url)
    first = c.chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER, CLOCK])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather",
                                                                                   {"city": "Paris"})
    history = [*ASK, choice.message.model_dump(exclude_none=True), *run_tools(choice.message.tool_calls)]
    final = c.chat.completions.create(model="agent-model", messages=history, tools=[WEATHER, CLOCK])
    assert (final.choices[0].message.content, final.choices[0].finish_reason) == ("It is 18 C in Paris.", "stop")
    assert final.choices[0].message.tool_calls is None
    first_prompt, second_prompt = model.generated_prompts()
    assert '"name": "get_weather"' in first_prompt and "<tool_call>" in first_prompt  # tools listed, format taught
    assert CALL in second_prompt  # the call, as the model writes calls
    assert '<tool_response>\n{"city": "Paris", "temp_c": 18}\n</tool_response>' in second_prompt


def test_tools_are_rendered_by_the_models_own_chat_template(serve, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = TEMPLATE
    model, url = server(serve, [CALL, "Done."], tokenizer)
    first = client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER])
    message = first.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True), *run_tools(message.tool_calls)]
    client(url).chat.completions.create(model="agent-model", messages=history, tools=[WEATHER])
    first_prompt, second_prompt = model.generated_prompts()
    assert first_prompt == tokenizer.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert first_prompt.startswith("<|system|>\n# Tools\n<tools>\n{") and first_prompt.endswith("<|assistant|>")
    # the earlier call is rendered by the template with its arguments as an object, then the tool's result,
    # then the instruction to answer from it
    from thinkahead.serving.chat import TOOL_RESULT_INSTRUCTION

    assert '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<|user|>\n<tool_response>\n{"city": "Paris", "temp_c": 18}\n</tool_response>\n' \
           f'<|system|>\n{TOOL_RESULT_INSTRUCTION}\n<|assistant|>' in second_prompt


def test_tool_choice_none_required_and_named(serve):
    model, url = server(serve, ["No tools needed."])
    reply = client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("No tools needed.", "stop")
    assert "get_weather" not in model.generated_prompts()[0]
    # required: the assistant turn opens with <tool_call>, so the model can only go on with a call
    model, url = server(serve, ['{"name": "get_time", "arguments": {}}\n</tool_call>'])
    reply = client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER, CLOCK],
                                                tool_choice="required")
    assert model.generated_prompts()[0].endswith("<tool_call>\n")
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_time"]
    # named: the name is written for the model, which writes the arguments
    model, url = server(serve, ['{"city": "Oslo"}}\n</tool_call>'])
    reply = client(url).chat.completions.create(
        model="agent-model", messages=ASK, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert model.generated_prompts()[0].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    with pytest.raises(openai.BadRequestError) as err:
        client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER],
                                            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.body["param"] == "tool_choice"


def test_an_invalid_tool_call_is_repaired_or_fails_loudly_never_a_silent_text_reply(serve):
    model, url = server(serve, ['<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', CALL])
    reply = client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER])
    assert reply.choices[0].finish_reason == "tool_calls"
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert "is not valid JSON" in model.generated_prompts()[1]
    for bad, why in [('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>',
                      "'city' is a required property"),
                     ('<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>', "names 'delete_all'"),
                     ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "is not valid JSON")]:
        _, url = server(serve, [bad])
        with pytest.raises(openai.InternalServerError) as err:
            client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER])
        assert err.value.body["code"] == "invalid_model_output" and why in err.value.body["message"]


def test_streamed_tool_calls_are_assembled_by_the_client(serve):
    two = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    _, url = server(serve, [two])
    stream = client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER, CLOCK], stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += d.id or ""
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_the_react_workflow_takes_the_requests_tools_and_continues_after_the_result(serve):
    small = ScriptedModel(name="small")
    large = ScriptedModel(outputs=[' I need the weather.\nAction: get_weather[{"city": "Paris"}]\n',
                                   " I know it now.\nFinal Answer: It is 18 C in Paris."], logprobs=JUDGE_YES,
                          name="large")
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    c = client(url)
    first = c.chat.completions.create(model="thinkahead/react", messages=ASK, tools=[WEATHER])
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content == "I need the weather."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert "get_weather: The weather in a city." in large.generated_prompts()[0]
    assert "calculator" not in large.generated_prompts()[0]  # the request's tools replace the built-in ones
    history = [*ASK, message.model_dump(exclude_none=True), *run_tools(message.tool_calls)]
    final = c.chat.completions.create(model="thinkahead/react", messages=history, tools=[WEATHER])
    assert (final.choices[0].message.content, final.choices[0].finish_reason) == ("It is 18 C in Paris.", "stop")
    resumed = large.generated_prompts()[1]
    assert ('Thought: I need the weather.\nAction: get_weather[{"city": "Paris"}]\n'
            'Observation: {"city": "Paris", "temp_c": 18}\nThought:') in resumed
    reasoning = final.choices[0].message.model_extra["reasoning_content"]
    assert reasoning.endswith("Final Answer: It is 18 C in Paris.\n")


def test_a_call_written_without_its_tags_is_still_a_call(serve):
    """Some models (or servers that drop special tokens) give the bare JSON of the call."""
    _, url = server(serve, ['{"name": "get_weather", "arguments": {"city": "Paris"}}'])
    reply = client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER])
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    _, url = server(serve, ['{"name": "Paris", "arguments": 1}'])  # not one of the tools: plain text
    reply = client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content.startswith('{"name"')


def test_the_reply_object_itself_goes_back_into_the_history(serve):
    """As OpenAI's docs do it: `messages.append(reply.choices[0].message)`, null fields and all."""
    model, url = server(serve, [CALL, "It is 18 C in Paris."])
    c = client(url)
    messages: list[Any] = list(ASK)
    reply = c.chat.completions.create(model="agent-model", messages=messages, tools=[WEATHER])
    call = reply.choices[0].message.tool_calls[0]
    messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    final = c.chat.completions.create(model="agent-model", messages=messages, tools=[WEATHER])
    assert final.choices[0].message.content == "It is 18 C in Paris."


def test_a_call_block_that_runs_on_keeps_its_calls_only(serve):
    """A small model may go on after its call without closing the block: the call stands, the rest is no call."""
    run_on = ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '{"name": "get_time", "arguments": {}}\n{"name": "get_weather_args", "type": "object"}')
    _, url = server(serve, [run_on])
    reply = client(url).chat.completions.create(model="agent-model", messages=ASK, tools=[WEATHER, CLOCK],
                                                tool_choice="required")
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather", "get_time"]
