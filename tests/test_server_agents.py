"""A real agent framework that speaks OpenAI (the OpenAI Agents SDK, `openai-agents`) runs a tool-using
agent against the server: the model asks for the tool, the framework runs it and sends the result
back, the model answers. Scripted model here; a real packaged model in tests/test_server_real.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.llm_judge import LLM_SPECREASON
from tests.server_fixtures import JUDGE_YES, serve  # noqa: F401 (fixture)
from thinkahead.models import ScriptedModel
from thinkahead.serving.openai_server import create_app

agents = pytest.importorskip("agents")  # the `openai-agents` test dependency

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run_agent(url: str, model: str, question: str, *, stream: bool = False,
              tool_choice: str | None = None) -> tuple[str, list[str]]:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return json.dumps({"city": city, "temp_c": 18})

    async def go() -> str:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather],
                      model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                      model_settings=ModelSettings(temperature=0, tool_choice=tool_choice))
        if stream:
            result = Runner.run_streamed(agent, question, max_turns=4)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, question, max_turns=4)
        return result.final_output

    return asyncio.run(go()), asked


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_agents_sdk_runs_a_tool_using_agent(serve, stream):
    model = ScriptedModel(outputs=[CALL, "It is 18 C in Paris."], name="agent-model")
    url = serve(create_app({"policy": LLM_SPECREASON}, small=model, large=model))
    answer, asked = run_agent(url, "agent-model", "What is the weather in Paris?", stream=stream)
    assert (answer, asked) == ("It is 18 C in Paris.", ["Paris"])
    first, second = model.generated_prompts()
    assert "Answer with the tools." in first and '"name": "get_weather"' in first
    assert '<tool_response>\n{"city": "Paris", "temp_c": 18}\n</tool_response>' in second


def test_the_agents_sdk_drives_the_react_workflow_with_its_tools(serve):
    small = ScriptedModel(name="small")
    large = ScriptedModel(outputs=[' I need the weather.\nAction: get_weather[{"city": "Paris"}]\n',
                                   " I know it now.\nFinal Answer: It is 18 C in Paris."], logprobs=JUDGE_YES,
                          name="large")
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    # a workflow picks its own sampling: the agent sends no temperature there
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return json.dumps({"city": city, "temp_c": 18})

    async def go() -> str:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        agent = Agent(name="weather", tools=[get_weather],
                      model=OpenAIChatCompletionsModel(model="thinkahead/react", openai_client=client))
        return (await Runner.run(agent, "What is the weather in Paris?", max_turns=4)).final_output

    assert asyncio.run(go()) == "It is 18 C in Paris."
    assert 'Observation: {"city": "Paris", "temp_c": 18}' in large.generated_prompts()[1]
