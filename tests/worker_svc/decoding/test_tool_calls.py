"""Tool calls on the tiny checkpoint: its template renders DeepSeek-V3's tool format, the parser
turns that format back into calls, and the engine decodes under grammars inside continuous
batching."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from devtools.tiny_model import CALL_BEGIN, CALLS_BEGIN, OUTPUTS_BEGIN, OUTPUTS_END
from infermesh.text.tokenizer import Tokenizer
from worker_svc.decoding.grammar import GrammarCompiler, apply_masks, closed, lark_grammar
from worker_svc.decoding.tool_parser import ToolCallParser, ToolMarkers
from worker_svc.engine.api import (
    Constraints,
    GenerationChunk,
    GenerationRequest,
    InvalidArgumentError,
    SamplingParams,
    Tool,
    ToolCallDelta,
    merge_chunks,
)
from worker_svc.torch_engine.engine import Engine

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
_TOOLS = (Tool("get_weather", "Weather in a city", json.dumps(WEATHER)),)
_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    {"role": "tool", "tool_call_id": "c2", "content": "25C"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_dir)


def test_template_renders_tools_calls_and_results(tokenizer: Tokenizer):
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
        }
    ]
    rendered = tokenizer.render_chat(_HISTORY, tools)
    assert tokenizer.renders_tools
    assert "### get_weather" in rendered and json.dumps(WEATHER) in rendered
    assert (
        f"Let me look.{CALLS_BEGIN}{CALL_BEGIN}function<｜tool▁sep｜>get_weather\n```json\n"
        in rendered
    )
    assert rendered.endswith(
        f"{OUTPUTS_BEGIN}<｜tool▁output▁begin｜>20C<｜tool▁output▁end｜>\n"
        f"<｜tool▁output▁begin｜>25C<｜tool▁output▁end｜>{OUTPUTS_END}"
    )
    ids = tokenizer.encode_chat(_HISTORY, tools)
    # two calls and the format line
    call_begin = tokenizer.hf.convert_tokens_to_ids(CALL_BEGIN)
    assert isinstance(call_begin, int) and ids.count(call_begin) == 3


def test_parser_streams_calls_from_the_template_format(tokenizer: Tokenizer):
    markers = ToolMarkers.of(tokenizer)
    assert markers is not None
    rendered = tokenizer.render_chat(_HISTORY[:2])
    output = rendered[rendered.index("Let me look.") :].removesuffix("<｜end▁of▁sentence｜>")
    parser = ToolCallParser(tokenizer, markers, frozenset({"get_weather"}))
    text, deltas = [], []
    for token in tokenizer.hf.encode(output, add_special_tokens=False):
        piece = parser.add(token)
        if piece is None:
            text.append(tokenizer.decode([token]))
        else:
            deltas.extend(piece)
    assert "".join(text) == "Let me look."
    assert [d.name for d in deltas if d.id] == ["get_weather", "get_weather"]
    merged = merge_chunks([_chunk([d]) for d in deltas]).tool_calls or []
    assert [(d.index, d.arguments) for d in merged] == [
        (0, '{"city":"Paris"}'),
        (1, '{"city":"Rome"}'),
    ]
    assert len(deltas) > len(merged)  # arguments came in pieces, as they were decoded


def _chunk(deltas: list[ToolCallDelta]) -> GenerationChunk:
    return GenerationChunk("", [], None, 0, 0, tool_calls=deltas)


@pytest.mark.parametrize(
    "constraints, message",
    [
        (Constraints((Tool("a b", "", "{}"),)), r"tools\[0\]\.name must be"),
        (Constraints((Tool("f", "", "{}"), Tool("f", "", "{}"))), "duplicate names: f"),
        (Constraints((Tool("f", "", "{}"),), "named", "g"), "tool_choice names 'g'"),
        (Constraints((Tool("f", "", "[1]"),)), r"tools\[0\]\.parameters must be a JSON object"),
        (
            Constraints(json_schema='{"type": "object", "dependentSchemas": {"a": {}}}'),
            "cannot be enforced",
        ),
    ],
)
async def test_constraints_no_engine_can_enforce_are_refused(
    tiny_engine: Engine, constraints, message
):
    request = GenerationRequest(
        "r", [{"role": "user", "content": "hi"}], None, SamplingParams(), constraints=constraints
    )
    with pytest.raises(InvalidArgumentError, match=message):
        async for _ in tiny_engine.generate(request):
            pass


def test_grammar_text_per_tool_choice(tokenizer: Tokenizer):
    markers = ToolMarkers.of(tokenizer)
    required = lark_grammar(Constraints(_TOOLS, "required", parallel_tool_calls=False), markers)
    assert required.startswith("start: calls\n") and "call)*" not in required
    assert "start: TEXT? calls?" in lark_grammar(Constraints(_TOOLS), markers)
    assert "calls" not in lark_grammar(Constraints(_TOOLS, "none"), markers)
    assert lark_grammar(Constraints(json_schema=json.dumps(WEATHER)), markers).startswith(
        "start: %json {"
    )
    assert tokenizer.eos_token_id is not None
    compiler = GrammarCompiler(tokenizer, len(tokenizer.hf), [tokenizer.eos_token_id])
    assert compiler.matcher(Constraints()) is None
    assert compiler.matcher(Constraints(_TOOLS, "required")) is not compiler.matcher(
        Constraints(_TOOLS, "required")
    )


def test_masks_keep_exactly_what_each_grammar_allows(tokenizer: Tokenizer):
    vocab = len(tokenizer.hf) + 7  # padded past the tokenizer, not a multiple of 32
    assert tokenizer.eos_token_id is not None
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    in_string = compiler.matcher(Constraints(json_schema=json.dumps(WEATHER)))
    forced = compiler.matcher(Constraints(_TOOLS, "named", "get_weather"))
    assert in_string is not None and forced is not None
    assert in_string.consume_tokens(tokenizer.hf.encode('{"city": "', add_special_tokens=False))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    masked = apply_masks(logits, [in_string, None, forced])
    assert torch.equal(masked[1], logits[1])
    allowed_counts = []
    for row, matcher in ((0, in_string), (2, forced)):
        bits = int.from_bytes(matcher.compute_bitmask(), "little")
        allowed = [t for t in range(vocab) if bits >> t & 1]
        expected = torch.full((vocab,), float("-inf"))
        expected[allowed] = logits[row, allowed]
        assert torch.equal(masked[row], expected)
        allowed_counts.append(len(allowed))
    assert allowed_counts[0] > 100 and allowed_counts[1] == 1  # many in a string; one forced


async def test_constrained_and_free_sequences_share_a_batch(tiny_engine: Engine):
    def request(i: int, constraints: Constraints) -> GenerationRequest:
        return GenerationRequest(
            f"r{i}",
            [{"role": "user", "content": "weather in Paris?"}],
            None,
            SamplingParams(max_tokens=200, seed=i),
            constraints=constraints,
        )

    async def run(r: GenerationRequest):
        return [c async for c in tiny_engine.generate(r)]

    free, schema, call = await asyncio.gather(
        run(request(0, Constraints())),
        run(request(1, Constraints(json_schema=json.dumps(WEATHER)))),
        run(request(2, Constraints(_TOOLS, "required", parallel_tool_calls=False))),
    )
    assert free[-1].finish_reason in ("stop", "length")
    assert schema[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.text for c in schema)), WEATHER)
    assert call[-1].finish_reason == "tool_calls" and not "".join(c.text for c in call)
    merged = merge_chunks(call).tool_calls or []
    assert len(merged) == 1 and merged[0].name == "get_weather" and merged[0].id.startswith("call_")
    jsonschema.validate(json.loads(merged[0].arguments), WEATHER)


# DeepSeek-V3's own template renders the calls and results of the history but never reads `tools`:
# the definitions would be dropped, so the engine refuses them
_CALLS_ONLY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜>' }}"
    "{% else %}{{ '<｜Assistant｜>' + (m['content'] or '') }}"
    "{% for c in m['tool_calls'] or [] %}"
    "{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + c['function']['name'] }}"
    "{{ '<｜tool▁call▁end｜>' }}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


async def test_tools_for_a_template_that_cannot_render_them_are_refused(
    tiny_dir: Path, tmp_path: Path
):
    for path in tiny_dir.iterdir():
        (tmp_path / path.name).symlink_to(path)
    (tmp_path / "tokenizer_config.json").unlink()
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = _CALLS_ONLY_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine.from_checkpoint(tmp_path, dtype="float32")
    try:
        assert not engine.tokenizer.renders_tools
        assert "<｜tool▁sep｜>get_weather" in engine.tokenizer.render_chat(_HISTORY)
        sampling = SamplingParams(max_tokens=2)
        request = GenerationRequest("r", _HISTORY, None, sampling, constraints=Constraints(_TOOLS))
        with pytest.raises(
            InvalidArgumentError, match=r"^tools: this model's chat template cannot"
        ):
            async for _ in engine.generate(request):
                pass
        history_only = GenerationRequest("r", _HISTORY, None, sampling)
        assert len([c async for c in engine.generate(history_only)]) == 2
    finally:
        await engine.close()


@pytest.mark.parametrize(
    "output",
    [
        f"{CALLS_BEGIN}{CALL_BEGIN}function<｜tool▁sep｜>get_we",  # cut inside the name
        f"{CALLS_BEGIN}{CALL_BEGIN}function<｜tool▁sep｜>get_weather",  # its newline never came
        f"{CALLS_BEGIN}{CALL_BEGIN}function<｜tool▁sep｜>get_wind\n```json\n{{}}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",  # no such tool
    ],
)
def test_a_call_without_a_whole_declared_name_is_never_emitted(tokenizer: Tokenizer, output):
    markers = ToolMarkers.of(tokenizer)
    assert markers is not None
    parser = ToolCallParser(tokenizer, markers, frozenset({"get_weather"}))
    deltas = []
    for token in tokenizer.hf.encode(output, add_special_tokens=False):
        deltas += parser.add(token) or []
    deltas += parser.finish()
    assert deltas == [] and parser.calls == 0


def test_a_declared_call_after_an_undeclared_one_is_the_first(tokenizer: Tokenizer):
    markers = ToolMarkers.of(tokenizer)
    assert markers is not None
    parser = ToolCallParser(tokenizer, markers, frozenset({"get_weather"}))
    output = (
        f"{CALLS_BEGIN}{CALL_BEGIN}function<｜tool▁sep｜>get_wind\n```json\n{{}}\n```"
        f"<｜tool▁call▁end｜>\n{CALL_BEGIN}function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city":"Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    deltas = []
    for token in tokenizer.hf.encode(output, add_special_tokens=False):
        deltas += parser.add(token) or []
    merged = merge_chunks([_chunk([d]) for d in deltas]).tool_calls or []
    assert [(d.index, d.name, d.arguments) for d in merged] == [
        (0, "get_weather", '{"city":"Rome"}')
    ]


def _forced_call(tokenizer: Tokenizer) -> list[int]:
    """The tokens a grammar forces for a call of get_weather up to its arguments' first
    character."""
    return tokenizer.hf.encode(
        f"{CALLS_BEGIN}{CALL_BEGIN}function<｜tool▁sep｜>get_weather\n```json\n{{",
        add_special_tokens=False,
    )


@pytest.mark.parametrize("cut", ["name", "arguments"])
async def test_a_call_cut_by_max_tokens(tiny_engine: Engine, tokenizer: Tokenizer, cut):
    """Cut inside its name the call is dropped; cut inside its arguments it stays, as OpenAI
    sends it, and either way the finish reason is length."""
    forced = _forced_call(tokenizer)
    name_end = len(forced) - len(tokenizer.hf.encode("\n```json\n{", add_special_tokens=False))
    max_tokens = name_end - 1 if cut == "name" else len(forced) + 1
    request = GenerationRequest(
        "r",
        [{"role": "user", "content": "weather?"}],
        None,
        SamplingParams(max_tokens=max_tokens, seed=0),
        constraints=Constraints(_TOOLS, "named", "get_weather"),
    )
    chunks = [c async for c in tiny_engine.generate(request)]
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == max_tokens
    calls = merge_chunks(chunks).tool_calls or []
    if cut == "name":
        assert calls == []
    else:
        assert [c.name for c in calls] == ["get_weather"]
        assert calls[0].arguments.startswith("{") and calls[0].arguments != "{}"


async def test_a_named_tool_choice_is_one_call(tiny_engine: Engine, tokenizer: Tokenizer):
    markers = ToolMarkers.of(tokenizer)
    assert "call)*" not in lark_grammar(Constraints(_TOOLS, "named", "get_weather"), markers)
    request = GenerationRequest(
        "r",
        [{"role": "user", "content": "weather?"}],
        None,
        SamplingParams(max_tokens=400, seed=2),
        constraints=Constraints(_TOOLS, "named", "get_weather"),  # parallel calls allowed
    )
    chunks = [c async for c in tiny_engine.generate(request)]
    assert chunks[-1].finish_reason == "tool_calls"
    assert len(merge_chunks(chunks).tool_calls or []) == 1


# instructor's extraction model (pydantic's schema): two properties, nothing said of others
TRIP = {
    "properties": {
        "city": {"title": "City", "type": "string"},
        "days": {"title": "Days", "type": "integer", "minimum": 1, "maximum": 30},
        "stops": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["city", "days"],
    "title": "Trip",
    "type": "object",
}


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    """One compiler (and cache of compiled grammars) for the module's cases."""
    assert tokenizer.eos_token_id is not None
    return GrammarCompiler(tokenizer, len(tokenizer.hf), [tokenizer.eos_token_id])


@pytest.mark.parametrize("as_tool", [False, True], ids=["response_format", "named tool"])
@pytest.mark.parametrize(
    ("arguments", "allowed"),
    [
        ('{"city": "Lisbon", "days": 5}', True),
        ('{"city": "Lisbon", "days": 5, "stops": ["a", "b"]}', True),
        ('{"city": "Lisbon", "days": 5, "x": 1}', False),  # a key the schema does not list
        ('{"city": "Lisbon", "days": 31}', False),  # maximum
        ('{"city": "Lisbon", "days": 0}', False),  # minimum
        ('{"city": "L", "days": 3, "stops": ["abcde"]}', False),  # maxLength
        ('{"city": "L", "days": 3, "stops": ["a", "b", "c"]}', False),  # maxItems
    ],
)
def test_a_schema_allows_only_its_properties_within_their_bounds(
    tokenizer: Tokenizer, compiler: GrammarCompiler, as_tool: bool, arguments: str, allowed: bool
):
    schema = json.dumps(TRIP)
    if as_tool:
        constraints = Constraints((Tool("Trip", "A trip", schema),), "named", "Trip")
        header = f"{CALLS_BEGIN}{CALL_BEGIN}function<｜tool▁sep｜>Trip\n```json\n"
    else:
        constraints, header = Constraints(json_schema=schema), ""
    matcher = compiler.matcher(constraints)
    assert matcher is not None
    ids = tokenizer.hf.encode(header + arguments, add_special_tokens=False)
    assert (matcher.validate_tokens(ids) == len(ids)) is allowed


def test_a_schema_that_allows_other_keys_keeps_them():
    assert closed({**TRIP, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in closed({"type": "object"})  # free-form: json_object
    nested = closed({"type": "object", "properties": {"trip": TRIP}, "$defs": {"T": TRIP}})
    assert nested["properties"]["trip"]["additionalProperties"] is False
    assert nested["$defs"]["T"]["additionalProperties"] is False
    enum = {"enum": [{"properties": {"a": 1}}]}  # a value, not a schema
    assert closed(enum) == enum
