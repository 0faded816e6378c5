"""The trained default model (`make run`'s) through the whole mesh, as an SDK user meets it,
greedy: requests that set no output limit get a short answer that ends and answers (a greeting
greets, a count counts), through Chat Completions (with and without tools) and Responses;
held-out tool questions call the tool they need, and held-out conversations recall a name told
earlier, more often than the best guesser that does not read the question
(devtools.chat_model.baselines: the first or last tool listed, the tool needed most often, a
uniform draw; the name told most often). How often, and what it cannot do yet, is measured by
bench/chat_model.py. Its thinking variant is tested in
tests/gateway/api/test_reasoning_models.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from devtools.chat_model import SERVED_PATH
from devtools.chat_model.baselines import best, recall_baselines, tool_baselines
from devtools.chat_model.corpus import EvalCase, eval_cases, tool_definitions

MODEL = Path(SERVED_PATH).name
SHORT = 32  # tokens: a short answer; the random model's end of turn comes once in ~16k
GREETING = re.compile(r"\b(hello|hi|hey|greetings|good (morning|afternoon|evening))\b", re.I)


@pytest.fixture(scope="module")
def client(chat_mesh) -> Iterator[openai.OpenAI]:
    mesh, key = chat_mesh
    with openai.OpenAI(base_url=mesh.spec.base_url, api_key=key, max_retries=0, timeout=60) as c:
        yield c


@pytest.mark.parametrize(
    ("prompt", "answers"),
    [("Say hello", GREETING.search), ("Count from 1 to 5", re.compile(r"1, 2, 3, 4, 5").search)],
)
def test_a_chat_without_max_tokens_gets_a_short_answer_that_ends(client, prompt, answers):
    completion = client.chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": prompt}]
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= SHORT
    assert answers(completion.choices[0].message.content or ""), completion.choices[0].message


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
    assert GREETING.search(completion.choices[0].message.content or ""), completion.choices[0]


def test_a_responses_request_without_max_output_tokens_completes_short(client):
    response = client.responses.create(
        model=MODEL, temperature=0, instructions="Be brief.", input="Say hello"
    )
    assert response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens <= SHORT
    assert GREETING.search(response.output_text), response.output_text


def _ask(client: openai.OpenAI, case: EvalCase) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=64,
        messages=case.messages,  # type: ignore[arg-type]
        tools=case.tools or openai.omit,  # type: ignore[arg-type]
    )


def _first_call(completion: Any) -> tuple[str, Any] | None:
    """The first call's tool and arguments (None: no call, or arguments that are not JSON)."""
    calls = completion.choices[0].message.tool_calls or []
    if not calls:
        return None
    try:
        return calls[0].function.name, json.loads(calls[0].function.arguments)
    except json.JSONDecodeError:
        return None


def test_held_out_tool_questions_call_the_tool_they_need_more_often_than_a_guesser(client):
    """Questions the training never saw, three tools offered, the needed one at each position
    and each tool needed equally often: the first call names the needed tool, with arguments its
    schema accepts, more often than the best guesser names it. (The arguments' values, copied
    from the question, are bench/chat_model.py's figure: the stored model writes values it
    learnt by heart, and no guesser writes any.)"""
    cases = eval_cases("tool", 12, seed=7)
    calls = [_first_call(_ask(client, case)) for case in cases]
    right = 0
    for call, case in zip(calls, cases, strict=True):
        if call is not None and call[0] == case.tool:
            schema = next(t for t in case.tools if t["function"]["name"] == case.tool)
            right += jsonschema.Draft202012Validator(schema["function"]["parameters"]).is_valid(
                call[1]
            )
    guesser, share = best(tool_baselines(cases))
    assert right > share * len(cases), (guesser, share, calls)


def test_held_out_recall_questions_repeat_the_name_more_often_than_a_guesser(client):
    """A name told in a first turn and asked for one to three turns later: the answer holds it
    more often than the best guesser (the name the cases tell most often) would."""
    cases = eval_cases("recall", 12, seed=7)
    answers = [_ask(client, case).choices[0].message.content or "" for case in cases]
    recalled = sum(case.recall.lower() in a.lower() for a, case in zip(answers, cases, strict=True))
    guesser, share = best(recall_baselines(cases))
    assert recalled > share * len(cases), (guesser, share, answers)


# instructor's extraction model as pydantic writes its schema: two properties, nothing said of
# others (the grammar closes the object, as OpenAI's strict structured outputs do)
TRIP = {
    "properties": {
        "city": {"title": "City", "type": "string"},
        "days": {"title": "Days", "type": "integer"},
    },
    "required": ["city", "days"],
    "title": "Trip",
    "type": "object",
}
_TRIP_ASK = [{"role": "user", "content": "Extract: I am going to Lisbon for 5 days."}]


def test_a_structured_answer_closes_its_object(client):
    """response_format with the Trip schema (instructor's JSON mode, langchain's structured
    output): the model may not invent keys until max_tokens; the answer ends, and is a Trip."""
    completion = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=256,
        messages=_TRIP_ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "Trip", "schema": TRIP},
        },
    )
    assert completion.choices[0].finish_reason == "stop", completion.choices[0].message
    trip = json.loads(completion.choices[0].message.content or "")
    jsonschema.validate(trip, TRIP)
    assert trip.keys() == {"city", "days"}


def test_a_named_tool_call_closes_its_arguments(client):
    """tool_choice naming the Trip tool (instructor's default mode): one call whose arguments are
    a Trip and end, reported as calls (finish_reason tool_calls, not length)."""
    completion = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=256,
        messages=_TRIP_ASK,
        tools=[{"type": "function", "function": {"name": "Trip", "parameters": TRIP}}],
        tool_choice={"type": "function", "function": {"name": "Trip"}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "Trip"
    trip = json.loads(calls[0].function.arguments)
    jsonschema.validate(trip, TRIP)
    assert trip.keys() == {"city", "days"}
