"""The trained default model (`make run`'s) through the whole mesh, as an SDK user meets it,
greedy: requests that set no output limit get a short answer that ends, through Chat Completions
(with and without tools) and Responses; held-out tool questions call the tool they need, and
held-out conversations recall a name told earlier, more often than chance. How often, and what it
cannot do yet (the right tool's arguments), is measured by bench/chat_model.py. Its thinking
variant is tested in tests/gateway/api/test_reasoning_models.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

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
