"""Tools on DeepSeek's released checkpoints: a released template that cannot render tool definitions
is served with its family's tool template, which renders them as DeepSeek documents them and writes
calls in the syntax the parser and the grammar read; `[model] chat_template` overrides both."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from infermesh.text.tokenizer import Tokenizer
from tests.helpers import deepseek_templates
from tests.helpers.checkpoints import variant_of
from tests.helpers.tools import WEATHER
from worker_svc.decoding.tool_parser import ToolCallParser, ToolMarkers
from worker_svc.engine.api import (
    Constraints,
    GenerationRequest,
    SamplingParams,
    Tool,
    merge_chunks,
)
from worker_svc.torch_engine.engine import Engine

_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    }
]
_ARGUMENTS = '{"city":"Paris","unit":"c"}'
_CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": _ARGUMENTS},
}
_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "Looking.", "tool_calls": [_CALL, {**_CALL, "id": "c2"}]},
    {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    {"role": "tool", "tool_call_id": "c2", "content": "21C"},
    {"role": "assistant", "content": "Mild."},
    {"role": "user", "content": "and tomorrow?"},
]
_V3_DEFINITION = (
    "Be brief.\n\n## Tools\nYou have access to the following tools:\n\n### get_weather\n"
    f"Description: Weather in a city\n\nParameters: {json.dumps(WEATHER)}\n"
)
_V25_DEFINITION = (
    "Be brief.\n\n## Tools\n\n### Function\n\nYou have the following functions available:\n\n"
    "- `get_weather`:\n```json\n"
    + json.dumps(_TOOLS[0]["function"], indent=4, ensure_ascii=False)
    + "\n```\n"
)
_FAMILIES = [
    # released template, model_type, the tool template served, call syntax, definitions rendered
    (deepseek_templates.V3, "deepseek_v3", "deepseek_v3_tools.jinja", "v3", _V3_DEFINITION),
    (deepseek_templates.V2_5, "deepseek_v2", "deepseek_v25_tools.jinja", "v3", _V25_DEFINITION),
    (deepseek_templates.V3_1, "deepseek_v3", "deepseek_v31_tools.jinja", "v31", _V3_DEFINITION),
    (deepseek_templates.V3_1, "deepseek_v32", "deepseek_v31_tools.jinja", "v31", _V3_DEFINITION),
]


@pytest.mark.parametrize("released, model_type, served, syntax, definition", _FAMILIES)
def test_released_templates_are_served_with_their_family_tool_template(
    tiny_dir: Path, tmp_path: Path, caplog, released, model_type, served, syntax, definition
):
    checkpoint = variant_of(tiny_dir, tmp_path, released, model_type=model_type)
    with caplog.at_level(logging.INFO, logger="infermesh.text.chat_templates"):
        tokenizer = Tokenizer(checkpoint)
    assert f"cannot render tool definitions; serving with {served}" in caplog.text
    assert tokenizer.renders_tools and tokenizer.tool_format == syntax
    rendered = tokenizer.render_chat(_HISTORY, _TOOLS)
    assert rendered.startswith("<｜begin▁of▁sentence｜>" + definition)
    assert rendered.count("Be brief.") == 1 and "20C" in rendered and "21C" in rendered
    # the template writes the history's calls as the parser reads a model's
    turn = rendered[rendered.index("Looking.") : rendered.index("<｜end▁of▁sentence｜>")]
    assert _parsed(tokenizer, turn) == [("get_weather", _ARGUMENTS)] * 2


def test_a_template_that_renders_tools_is_kept(tiny_dir: Path, caplog):
    with caplog.at_level(logging.INFO, logger="infermesh.text.chat_templates"):
        tokenizer = Tokenizer(tiny_dir)
    own = json.loads((tiny_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert tokenizer.hf.chat_template == own and not caplog.records


def test_chat_template_file_overrides_the_checkpoints(tiny_dir: Path, tmp_path: Path):
    override = tmp_path / "served.jinja"
    override.write_text("{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tokenizer = Tokenizer(tiny_dir, override)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]).endswith("[hi]")
    assert not tokenizer.renders_tools and tokenizer.tool_format is None
    with pytest.raises(ValueError, match=r"\[model\] chat_template: cannot read .*missing\.jinja"):
        Tokenizer(tiny_dir, tmp_path / "missing.jinja")
    override.write_text("{% if %}")
    with pytest.raises(ValueError, match=r"served\.jinja: the chat template is not valid Jinja"):
        Tokenizer(tiny_dir, override)


@pytest.mark.parametrize("released", [deepseek_templates.V3, deepseek_templates.V3_1])
async def test_a_released_checkpoint_serves_tools(tiny_dir: Path, tmp_path: Path, released):
    engine = Engine.from_checkpoint(variant_of(tiny_dir, tmp_path, released), dtype="float32")
    tools = (Tool("get_weather", "Weather in a city", json.dumps(WEATHER)),)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    request = GenerationRequest(
        "r",
        messages,
        None,
        SamplingParams(max_tokens=120, seed=1),
        constraints=Constraints(tools, "required", parallel_tool_calls=False),
    )
    try:
        assert "### get_weather" in engine.tokenizer.render_chat(messages, _TOOLS)
        chunks = [c async for c in engine.generate(request)]
    finally:
        await engine.close()
    assert chunks[-1].finish_reason == "tool_calls"
    calls = merge_chunks(chunks).tool_calls or []
    assert [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def _parsed(tokenizer: Tokenizer, output: str) -> list[tuple[str, str]]:
    """The calls ``output`` (a model's turn) holds, as the worker's parser reads them."""
    markers = ToolMarkers.of(tokenizer)
    assert markers is not None
    parser = ToolCallParser(tokenizer, markers, frozenset({"get_weather"}))
    deltas = []
    for token in tokenizer.hf.encode(output, add_special_tokens=False):
        deltas += parser.add(token) or []
    calls: dict[int, list[str]] = {}
    for d in deltas:
        calls.setdefault(d.index, [d.name, ""])[1] += d.arguments
    return [(name, arguments) for name, arguments in calls.values()]
