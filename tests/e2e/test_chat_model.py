"""The trained default model (`make run`'s) through the whole mesh, as an SDK user meets it,
greedy: requests that set no output limit get a short answer that ends, through Chat Completions
(with and without tools) and Responses; held-out tool questions call the tool they need, and
held-out conversations recall a name told earlier, more often than chance; asked to think, it
thinks a sentence, closes the thinking by itself and answers. How often, and what it cannot do yet
(the right tool's arguments), is measured by bench/chat_model.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner
from agents.models.openai_provider import OpenAIProvider
from openai.types.shared import Reasoning

from devtools.chat_model import SERVED_PATH
from devtools.chat_model.corpus import EvalCase, eval_cases, tool_definitions

MODEL = Path(SERVED_PATH).name
SHORT = 32  # tokens: a short answer; the random model's end of turn comes once in ~16k


@pytest.fixture(scope="module")
def client(chat_mesh) -> Iterator[openai.OpenAI]:
    mesh, key = chat_mesh
    with openai.OpenAI(base_url=mesh.spec.base_url, api_key=key, max_retries=0, timeout=60) as c:
        yield c


@pytest.mark.parametrize("prompt", ["Say hello", "Count from 1 to 5"])
def test_a_chat_without_max_tokens_gets_a_short_answer_that_ends(client, prompt):
    completion = client.chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": prompt}]
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= SHORT
    assert completion.choices[0].message.content


def test_a_greeting_with_tools_offered_is_answered_and_ends(client):
    completion = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        tools=tool_definitions(["get_time", "get_weather", "get_stock_price"]),
        tool_choice="auto",
        messages=[{"role": "user", "content": "Hello"}],
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens <= SHORT


def test_a_responses_request_without_max_output_tokens_completes_short(client):
    response = client.responses.create(
        model=MODEL, temperature=0, instructions="Be brief.", input="Say hello"
    )
    assert response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens <= SHORT
    assert response.output_text


def _ask(client: openai.OpenAI, case: EvalCase) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=64,
        messages=case.messages,  # type: ignore[arg-type]
        tools=case.tools or openai.omit,  # type: ignore[arg-type]
    )


def test_held_out_tool_questions_mostly_call_the_tool_they_need(client):
    """Questions the training never saw, three tools offered each time: the model's first call
    names the one the question needs far more often than a guess (1 in 3) would."""
    cases = eval_cases("tool", 12, seed=7)
    named = [
        [c.function.name for c in _ask(client, case).choices[0].message.tool_calls or []][:1]
        == [case.tool]
        for case in cases
    ]
    assert sum(named) >= 6, named


def test_held_out_recall_questions_often_repeat_the_name_told_earlier(client):
    """A name told in a first turn and asked for one to three turns later: the answer holds it
    in a share of held-out conversations a model that does not read its history never reaches."""
    cases = eval_cases("recall", 12, seed=7)
    recalled = [
        case.recall.lower() in (_ask(client, case).choices[0].message.content or "").lower()
        for case in cases
    ]
    assert sum(recalled) >= 3, recalled


def test_asked_to_think_it_thinks_briefly_closes_the_thinking_itself_and_answers(client):
    """The thinking flag opens the thinking; the model closes it by itself (no budget) and
    answers, the two apart; without the flag there is no thinking."""
    ask: dict[str, Any] = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 96,
        "messages": [{"role": "user", "content": "Say hello"}],
    }
    thought = client.chat.completions.create(
        **ask, extra_body={"chat_template_kwargs": {"thinking": True}}
    )
    plain = client.chat.completions.create(**ask)
    [choice] = thought.choices
    assert choice.finish_reason == "stop"
    assert (choice.message.model_extra or {}).get("reasoning_content")
    assert choice.message.content and "think>" not in choice.message.content
    details = thought.usage and thought.usage.completion_tokens_details
    assert details and 0 < (details.reasoning_tokens or 0) < thought.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content
    assert not (plain.choices[0].message.model_extra or {}).get("reasoning_content")
    assert "think>" not in plain.choices[0].message.content


def test_messages_thinking_enabled_gives_a_thinking_block_then_the_answer(chat_mesh):
    mesh, key = chat_mesh
    with anthropic.Anthropic(
        base_url=mesh.spec.base_url.removesuffix("/v1"), api_key=key, max_retries=0, timeout=60
    ) as claude:
        message = claude.messages.create(
            model=MODEL,
            max_tokens=2048,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "Say hello"}],
            extra_body={"temperature": 0},
        )
    assert [block.type for block in message.content] == ["thinking", "text"]
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert text.type == "text" and text.text and "think>" not in text.text
    assert message.stop_reason == "end_turn"


def test_an_agent_on_the_responses_api_reads_the_thinking_apart_over_two_turns(chat_mesh):
    """The Agents SDK's default model (the Responses API) with reasoning asked for: the thinking
    comes back as a reasoning item apart from the answer, and the next turn sends it back (as
    the SDK does), which the mesh accepts and leaves out of the prompt."""
    mesh, key = chat_mesh
    agent = Agent(
        name="thinker",
        instructions="Be brief.",
        model=MODEL,
        model_settings=ModelSettings(
            reasoning=Reasoning(effort="low"), max_tokens=96, temperature=0
        ),
    )

    async def two_turns() -> tuple[Any, Any]:
        async with openai.AsyncOpenAI(
            base_url=mesh.spec.base_url, api_key=key, max_retries=0, timeout=60
        ) as client:
            config = RunConfig(
                model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True
            )
            first = await Runner.run(agent, "Say hello", run_config=config)
            again = [*first.to_input_list(), {"role": "user", "content": "Count from 1 to 5"}]
            return first, await Runner.run(agent, again, run_config=config)

    for result in asyncio.run(two_turns()):
        kinds = [item.type for item in result.new_items]
        assert kinds == ["reasoning_item", "message_output_item"], kinds
        assert result.new_items[0].raw_item.content or result.new_items[0].raw_item.summary
        assert result.final_output and "think>" not in result.final_output
        usage = result.context_wrapper.usage
        assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
