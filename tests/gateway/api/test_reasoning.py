"""Reasoning (#39) at the gateway: each API's switch for thinking becomes the GenerateRequest's
``thinking`` and budget, bad switches are refused in each API's words, a model that does not
reason is refused or ignored as each API does, and a worker's reasoning text is shaped as each
API carries it (read back by the official SDKs' own models and stream accumulators)."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseStreamEvent

from gateway.accounts.usage import TokenUsage
from gateway.anthropic import messages_protocol as messages_wire
from gateway.openai.chat_protocol import ChatCompletionRequest, chat_choice
from gateway.openai.responses_output import OutputBuilder
from gateway.openai.responses_protocol import ResponsesRequest
from infermesh.pb import common_pb2
from tests.helpers import MODEL
from tests.helpers.gateway import CHAT, auth, sdk
from tests.helpers.openresponses import validate_event

# A thinking model's chunks: the thought cut across chunks, one chunk closing it and answering
CHUNKS = [
    common_pb2.GenerateResponse(reasoning_text="Two ", token_ids=[1]),
    common_pb2.GenerateResponse(reasoning_text="and two.", token_ids=[2, 3]),
    common_pb2.GenerateResponse(reasoning_text=" Four.", text="It is ", token_ids=[4, 5, 6]),
    common_pb2.GenerateResponse(
        text="4.", token_ids=[7], finish_reason=common_pb2.FINISH_REASON_STOP
    ),
]
THOUGHT, ANSWER = "Two and two. Four.", "It is 4."


@pytest.mark.parametrize(
    "fields, thinking",
    [
        ({}, None),
        ({"chat_template_kwargs": {"thinking": True}}, True),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "minimal"}, True),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}}, False),
    ],
)
def test_chat_thinking_comes_from_the_template_kwargs_else_the_effort(fields, thinking):
    body = ChatCompletionRequest.model_validate({**CHAT, **fields})
    request = body.generate_request("r", 0)
    assert (request.thinking if request.HasField("thinking") else None) is thinking


@pytest.mark.parametrize(
    "reasoning, thinking",
    [
        (None, None),
        ({"summary": "auto"}, None),
        ({"effort": "none"}, False),
        ({"effort": "xhigh"}, True),
    ],
)
def test_responses_thinking_comes_from_the_effort(reasoning, thinking):
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "reasoning": reasoning})
    request = body.generate_request("r")
    assert (request.thinking if request.HasField("thinking") else None) is thinking


@pytest.mark.parametrize(
    "thinking, flag, budget",
    [
        (None, None, None),
        ({"type": "enabled", "budget_tokens": 1024}, True, 1024),
        ({"type": "adaptive", "display": "omitted"}, True, None),
        ({"type": "disabled"}, False, None),
    ],
)
def test_messages_thinking_and_its_budget(thinking, flag, budget):
    body = messages_wire.MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]}
        | ({"thinking": thinking} if thinking else {})
    )
    body.check_budget()
    for request in (body.generate_request("r"), body.prompt_request("r")):  # count_tokens too
        assert (request.thinking if request.HasField("thinking") else None) is flag
    generate = body.generate_request("r")
    assert (
        generate.thinking_budget_tokens if generate.HasField("thinking_budget_tokens") else None
    ) == budget


def test_earlier_turns_thinking_is_left_out_of_the_prompt():
    turn = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    body = ChatCompletionRequest.model_validate({**CHAT, "messages": [*CHAT["messages"], turn]})
    assert [m.content for m in body.router_messages()] == ["hi", ANSWER]


def test_chat_message_carries_reasoning_content_the_sdk_reads():
    choice = chat_choice(0, ANSWER, "stop", None, None, THOUGHT)
    completion = ChatCompletion.model_validate(
        {"id": "c", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [choice]}
    )
    assert completion.choices[0].message.content == ANSWER
    assert completion.choices[0].message.model_extra == {"reasoning_content": THOUGHT}
    assert "reasoning_content" not in chat_choice(0, ANSWER, "stop", None, None)["message"]


@pytest.mark.parametrize("shown", [True, False])
def test_messages_thinking_blocks_whole_and_streamed_agree(shown):
    whole = messages_wire.ThinkingBlocks(shown)
    for chunk in CHUNKS:
        whole.add(chunk.reasoning_text)
    content = messages_wire.content(ANSWER, None, whole)
    blocks = messages_wire.StreamBlocks(messages_wire.ThinkingBlocks(shown))
    events = messages_wire.stream_start("msg_1", MODEL, TokenUsage(3))
    for chunk in CHUNKS:
        events += blocks.thinking(chunk.reasoning_text) + blocks.text(chunk.text)
    events += blocks.stop() + messages_wire.stream_end("end_turn", TokenUsage(3, 7), None)
    snapshot = None
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
    for event in events:
        if event["type"] == "ping":  # the SDK's stream skips it
            continue
        snapshot = accumulate_event(
            event=adapter.validate_python(event), current_snapshot=snapshot, json_bufs={}
        )
    assert snapshot is not None
    assert [b.model_dump(exclude_none=True) for b in snapshot.content] == content
    assert [b["type"] for b in content] == ["thinking", "text"]
    assert content[0]["thinking"] == (THOUGHT if shown else "") and content[0]["signature"]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas.count("signature_delta") == 1
    assert ("thinking_delta" in deltas) is shown


def test_no_thinking_block_when_thinking_is_left_out():
    blocks = messages_wire.StreamBlocks(None)
    assert blocks.thinking("Two ") == []
    assert [e["type"] for e in blocks.text("4")] == ["content_block_start", "content_block_delta"]
    assert blocks.stop() == [{"type": "content_block_stop", "index": 0}]


@pytest.mark.parametrize("summary", [False, True])
def test_responses_reasoning_item_streamed_as_the_sdk_and_open_responses_read_it(summary):
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "hi"})
    output = OutputBuilder(body.tool_set, logprobs=False, summary=summary)
    events = [e for chunk in CHUNKS for e in output.add(chunk)] + output.finish(False)
    reasoning, message = output.output
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert reasoning["summary"] == ([{"type": "summary_text", "text": THOUGHT}] if summary else [])
    assert message["content"][0]["text"] == ANSWER
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    for n, event in enumerate(events):
        numbered = {**event, "sequence_number": n}
        parsed = adapter.validate_python(numbered)
        assert parsed.type == event["type"]  # not a union member it merely fits
        # Open Responses names OpenAI's response.reasoning_text.* events response.reasoning.*
        if not event["type"].startswith("response.reasoning_text."):
            validate_event(numbered)
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == THOUGHT
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == output.output
    response = Response.model_validate(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 0,
            "model": MODEL,
            "output": output.output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
    )
    assert response.output_text == ANSWER
    assert response.output[0].content[0].text == THOUGHT


async def test_bad_thinking_switches_are_400s_in_each_apis_words(gateway, api_key):
    chat = [
        ({"chat_template_kwargs": {"thinking": True, "foo": 1}}, "chat_template_kwargs.foo"),
        ({"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}, "disagree"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ]
    for fields, words in chat:
        response = await gateway.post(
            "/v1/chat/completions", headers=auth(api_key), json={**CHAT, **fields}
        )
        assert response.status == 400, fields
        assert words in (await response.json())["error"]["message"]
    budget = "thinking.enabled.budget_tokens"
    anthropic_errors = [
        ({"type": "enabled"}, 2048, f"{budget}: Field required"),
        (
            {"type": "enabled", "budget_tokens": 1023},
            2048,
            f"{budget}: Input should be greater than or equal to 1024",
        ),
        (
            {"type": "enabled", "budget_tokens": 2048},
            2048,
            "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
            "documentation at https://docs.claude.com/en/docs/build-with-claude/"
            "extended-thinking#max-tokens-and-context-window-size",
        ),
    ]
    for thinking, max_tokens, message in anthropic_errors:
        body = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "thinking": thinking,
            "messages": [{"role": "user", "content": "hi"}],
        }
        response = await gateway.post("/v1/messages", headers=auth(api_key), json=body)
        assert response.status == 400
        assert await response.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }


async def test_a_model_that_does_not_reason(served, api_key):
    """Chat's reasoning_effort and Messages' enabled thinking are refused naming the model (as
    OpenAI and Anthropic refuse them for such models); the template kwargs, Responses' effort
    and adaptive thinking are served without reasoning."""
    async with sdk(served, api_key) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], reasoning_effort="high"
            )
        assert f"'{MODEL}'" in refused.value.message and refused.value.param == "reasoning_effort"
        for fields in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"thinking": True}}):
            completion = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_body=fields,
            )
            assert completion.usage is not None and completion.usage.completion_tokens_details
            assert completion.usage.completion_tokens_details.reasoning_tokens == 0
            assert not (completion.choices[0].message.model_extra or {})
        response = await client.responses.create(
            model=MODEL, input="hi", max_output_tokens=4, reasoning={"effort": "high"}
        )
        assert [item.type for item in response.output] == ["message"]
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens == 0
    async with anthropic.AsyncAnthropic(
        base_url=str(served.make_url("")), api_key=api_key, max_retries=0
    ) as claude:
        with pytest.raises(anthropic.BadRequestError) as refused_thinking:
            await claude.messages.create(
                model=MODEL,
                max_tokens=2048,
                thinking={"type": "enabled", "budget_tokens": 1024},
                messages=[{"role": "user", "content": "hi"}],
            )
        assert f"'{MODEL}'" in refused_thinking.value.message
        message = await claude.messages.create(
            model=MODEL,
            max_tokens=4,
            thinking={"type": "adaptive"},
            messages=[{"role": "user", "content": "hi"}],
        )
        assert all(block.type != "thinking" for block in message.content)
