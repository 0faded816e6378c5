"""The OpenAI Agents SDK, unmodified, with its default model (the Responses API) against the real
gateway, router and worker on the random-weight tiny model: decoding under the tool's schema
makes even random weights call the tool well."""

from __future__ import annotations

from typing import Annotated, Literal

from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider
from pydantic import Field

from tests.helpers import MODEL
from tests.helpers.gateway import sdk
from tests.helpers.tools import SLOW_TIMEOUT_S


async def test_an_agent_with_a_required_tool_runs_it_and_completes(served, api_key) -> None:
    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=6)], unit: Literal["c", "f"]) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return f"21 degrees {unit}"

    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=MODEL,
        model_settings=ModelSettings(
            tool_choice="required", temperature=0, max_tokens=300, parallel_tool_calls=False
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    async with sdk(served, api_key, timeout=SLOW_TIMEOUT_S) as client:
        result = await Runner.run(
            agent,
            "What is the weather in Paris?",
            run_config=RunConfig(
                model_provider=OpenAIProvider(openai_client=client, use_responses=True),
                tracing_disabled=True,
            ),
        )
    [(city, unit)] = calls
    assert len(city) <= 6 and unit in ("c", "f")
    assert result.final_output == f"21 degrees {unit}"
    [response] = result.raw_responses
    assert (response.response_id or "").startswith("resp_")
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
