"""Legacy ``/v1/completions`` through the real gateway, router and worker,
parsed by the official openai SDK's types."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import MODEL
from tests.helpers.gateway import auth, sdk

_GREEDY = {"model": MODEL, "prompt": "The mesh says", "temperature": 0, "max_tokens": 6}


async def test_completion_streamed_and_not(served, api_key):
    async with sdk(served, api_key) as client:
        completion = await client.completions.create(**_GREEDY)
        chunks = [
            c
            async for c in await client.completions.create(
                **_GREEDY, stream=True, stream_options={"include_usage": True}
            )
        ]
    choice = completion.choices[0]
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert choice.text and choice.finish_reason == "length" and choice.index == 0
    assert completion.usage.completion_tokens == 6 and completion.usage.prompt_tokens > 0
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert all(c.object == "text_completion" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == completion.usage


async def test_default_max_tokens_is_16_and_the_chat_template_is_not_applied(served, api_key):
    async with sdk(served, api_key) as client:
        raw = await client.completions.create(model=MODEL, prompt="x", temperature=0)
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    assert raw.usage.completion_tokens <= 16
    assert raw.usage.prompt_tokens < chat.usage.prompt_tokens


async def test_prompt_batch_with_n_and_echo(served, api_key):
    async with sdk(served, api_key) as client:
        single = await client.completions.create(**_GREEDY)
        batch = await client.completions.create(
            **{**_GREEDY, "prompt": ["The mesh says", "Hi"]}, n=2, echo=True
        )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == "The mesh says" + single.choices[0].text
    assert batch.choices[1].text == batch.choices[0].text
    assert batch.choices[2].text.startswith("Hi")
    assert batch.usage.completion_tokens == 4 * 6
    assert batch.usage.prompt_tokens > single.usage.prompt_tokens  # each prompt once


@pytest.mark.parametrize(
    "body, param",
    [
        ({**_GREEDY, "prompt": ""}, "prompt"),
        ({**_GREEDY, "prompt": [1, 2]}, "prompt.0"),
        ({**_GREEDY, "suffix": "end"}, "suffix"),
        ({**_GREEDY, "best_of": 3}, "best_of"),
        ({**_GREEDY, "logprobs": 6}, "logprobs"),
        ({**_GREEDY, "echo": "yes"}, "echo"),
        ({**_GREEDY, "max_parallel": [4]}, "max_parallel"),
    ],
)
async def test_invalid_completion_is_400_naming_the_param(gateway, api_key, body, param):
    response = await gateway.post("/v1/completions", json=body, headers=auth(api_key))
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param


async def test_unknown_model_is_404_through_the_sdk(served, api_key):
    async with sdk(served, api_key) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.completions.create(**{**_GREEDY, "model": "nope"})
    assert caught.value.code == "model_not_found" and MODEL in caught.value.message
