"""Reasoning models on the worker: the tiny DeepSeek-R1 and V3.1 checkpoints' templates turn the
thinking on and off, the parser keeps the thinking apart from the answer while it streams, a
thinking budget closes it, and grammars and tool calls apply to the answer after it."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from devtools.tiny_model import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, THINK_END
from infermesh.config import ConfigError
from infermesh.pb import common_pb2
from infermesh.text.tokenizer import Tokenizer
from worker_svc.config import DEFAULT_MODEL_PATH, ModelSection, WorkerConfig
from worker_svc.config import load as load_worker_config
from worker_svc.decoding.completion_decoder import CompletionDecoder
from worker_svc.decoding.reasoning_parser import ReasoningParser, Thinking, thinking_of
from worker_svc.decoding.tool_parser import ToolMarkers
from worker_svc.engine.api import (
    Constraints,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
    Tool,
    ToolCallDelta,
    merge_chunks,
)
from worker_svc.engine.prompt_ids import prompt_token_ids
from worker_svc.service.registration import worker_info
from worker_svc.service.wire import to_engine, to_proto
from worker_svc.torch_engine.engine import Engine

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
_TOOLS = (Tool("get_weather", "Weather in a city", json.dumps(WEATHER)),)
_CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


def _feed(parser: ReasoningParser, pieces: list[str]) -> list[tuple[str, str]]:
    """The parser's (reasoning, answer) after each piece of streamed text, the last one final."""
    text, out = "", []
    for i, piece in enumerate(pieces):
        text += piece
        out.append(parser.feed(text, len(text), final=i == len(pieces) - 1))
    return out


def test_a_closing_tag_cut_across_pieces_is_held_back_and_never_emitted():
    parser = ReasoningParser(thinking=True)
    out = _feed(parser, ["Two and ", "two.</thi", "nk>\n\nFour", "."])
    assert out == [("Two and ", ""), ("two.", ""), ("", "\n\nFour"), ("", ".")]
    assert not parser.thinking


def test_text_that_only_looked_like_a_tag_is_reasoning_after_all():
    parser = ReasoningParser(thinking=True)
    assert _feed(parser, ["a </th", "ird thing", " </"]) == [
        ("a ", ""),
        ("</third thing", ""),
        (" </", ""),  # the end of the output: a partial tag is text
    ]
    assert parser.thinking


def test_an_opening_tag_the_model_writes_itself_is_dropped():
    parser = ReasoningParser(thinking=True)
    assert _feed(parser, ["\n<th", "ink>\nhm", "</think>ok"]) == [
        ("", ""),
        ("\nhm", ""),
        ("", "ok"),
    ]


def test_output_outside_the_thinking_is_all_answer():
    parser = ReasoningParser(thinking=False)
    assert _feed(parser, ["<think>", "no</think>"]) == [("", "<think>"), ("", "no</think>")]


def test_released_text_bounds_what_is_handed_out():
    """Text the detokenizer holds back (a possible stop string) is not handed out yet."""
    parser = ReasoningParser(thinking=True)
    assert parser.feed("abc</think>de", 2) == ("ab", "")
    assert parser.feed("abc</think>def", 14) == ("c", "def")


def _think_end_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.hf.convert_tokens_to_ids(THINK_END)
    assert isinstance(token_id, int)
    return token_id


@pytest.fixture(scope="module")
def r1_tokenizer(r1_dir: Path) -> Tokenizer:
    return Tokenizer(r1_dir)


def _decode_all(decoder: CompletionDecoder, ids: list[int]) -> list[tuple[str, str]]:
    """(reasoning, text) per token, the last one ending at a stop token."""
    out = []
    for i, token in enumerate(ids):
        decoded = decoder.add(token, "stop_token" if i == len(ids) - 1 else None)
        out.append((decoded.reasoning_text, decoded.text))
    return out


def test_a_tool_call_after_the_thinking_parses(r1_tokenizer: Tokenizer):
    thought = "Weather: call the tool."
    call = f'{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city":"Paris"}}\n```{CALL_END}'
    ids = r1_tokenizer.encode_rendered(f"{thought}{THINK_END}Let me look.{CALLS_BEGIN}{call}")
    ids += [*r1_tokenizer.encode_rendered(CALLS_END), r1_tokenizer.eos_token_id or 0]
    thinking = thinking_of(
        r1_tokenizer, "deepseek_r1", GenerationRequest("r", _CHAT, None, SamplingParams())
    )
    decoder = CompletionDecoder(
        r1_tokenizer, (), Constraints(_TOOLS), ToolMarkers.of(r1_tokenizer), thinking
    )
    calls: list[ToolCallDelta] = []
    finish, pieces = None, []
    for i, token in enumerate(ids):
        decoded = decoder.add(token, "stop_token" if i == len(ids) - 1 else None)
        pieces.append((decoded.reasoning_text, decoded.text))
        calls += decoded.tool_calls or ()
        finish = decoded.finish
    assert "".join(r for r, _ in pieces) == thought
    assert "".join(t for _, t in pieces) == "Let me look."
    assert finish == "tool_calls"
    assert [c.name for c in calls if c.name] == ["get_weather"]
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Paris"}
    close = ids.index(_think_end_id(r1_tokenizer))
    assert decoder.reasoning_tokens == close + 1


def test_a_closing_tag_of_several_tokens_parses_as_text(tiny_dir: Path):
    """A tokenizer without the think tags writes them in pieces: the text-level parser finds the
    tag across tokens, and counts the thinking up to the token that completes it."""
    tokenizer = Tokenizer(tiny_dir)
    assert tokenizer.reasoning_format == ""  # DeepSeek-V3's template: it does not reason
    end_ids = tuple(tokenizer.encode_rendered(THINK_END))
    assert len(end_ids) > 1
    thought, answer = tokenizer.encode_rendered("Hmm"), tokenizer.encode_rendered(" Four.")
    decoder = CompletionDecoder(
        tokenizer, (), Constraints(), None, Thinking(ReasoningParser(True), end_ids)
    )
    out = _decode_all(decoder, [*thought, *end_ids, *answer, tokenizer.eos_token_id or 0])
    assert "".join(r for r, _ in out) == "Hmm"
    assert "".join(t for _, t in out) == " Four."
    assert decoder.reasoning_tokens == len(thought) + len(end_ids)


def test_a_closing_tag_that_decodes_to_nothing_closes_on_its_token(r1_dir: Path, tmp_path: Path):
    """Where the tags are special tokens (decoding skips them), the tag's id closes the thinking."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(r1_dir / name, tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    for added in spec["added_tokens"]:
        added["special"] = added["special"] or added["content"] == THINK_END
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer(tmp_path)
    end_id = _think_end_id(tokenizer)
    assert tokenizer.decode([end_id]) == ""
    decoder = CompletionDecoder(
        tokenizer, (), Constraints(), None, Thinking(ReasoningParser(True), (end_id,))
    )
    ids = [*tokenizer.encode_rendered("Hmm"), end_id, *tokenizer.encode_rendered("Four")]
    out = _decode_all(decoder, [*ids, tokenizer.eos_token_id or 0])
    assert ("".join(r for r, _ in out), "".join(t for _, t in out)) == ("Hmm", "Four")
    assert decoder.reasoning_tokens == ids.index(end_id) + 1


# -------------------------------------------------------------------------------- the engine


def _request(
    max_tokens: int,
    thinking: bool | None = None,
    budget: int | None = None,
    constraints: Constraints | None = None,
) -> GenerationRequest:
    return GenerationRequest(
        "r",
        _CHAT,
        None,
        SamplingParams(temperature=0, max_tokens=max_tokens),
        constraints=constraints or Constraints(),
        thinking=thinking,
        thinking_budget_tokens=budget,
    )


async def _run(engine: Engine, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in engine.generate(request)]


def test_the_templates_turn_thinking_on_and_off(r1_engine: Engine, v31_engine: Engine):
    def prompt_tail(engine: Engine, thinking: bool | None) -> str:
        tokenizer = engine.tokenizer
        return tokenizer.decode(prompt_token_ids(tokenizer, _request(1, thinking))[-2:])

    assert v31_engine.capabilities.reasoning_format == "deepseek_v3"
    assert prompt_tail(v31_engine, None).endswith("</think>")  # V3.1: off by default
    assert prompt_tail(v31_engine, False).endswith("</think>")
    assert prompt_tail(v31_engine, True).endswith("<think>")
    assert r1_engine.capabilities.reasoning_format == "deepseek_r1"
    assert all(prompt_tail(r1_engine, t).endswith("<think>\n") for t in (None, False, True))
    # an earlier turn's thinking is dropped from the prompt, as each family's template does
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>secret</think>Hello!"},
        {"role": "user", "content": "again"},
    ]
    for engine in (r1_engine, v31_engine):
        # neither released template renders tool definitions: the family's tool template, served
        # instead, keeps its reasoning
        assert engine.tokenizer.renders_tools
        rendered = engine.tokenizer.render_chat(history)
        assert "Hello!" in rendered and "secret" not in rendered


async def test_r1_thinks_until_the_end_without_a_budget(r1_engine: Engine):
    chunks = await _run(r1_engine, _request(6))
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.reasoning_tokens == last.completion_tokens == 6
    merged = merge_chunks(chunks)
    assert merged.text == "" and merged.reasoning_text == r1_engine.tokenizer.decode(
        merged.token_ids
    )


async def test_a_budget_reached_mid_thought_closes_the_thinking(r1_engine: Engine):
    free = merge_chunks(await _run(r1_engine, _request(10)))
    chunks = await _run(r1_engine, _request(10, budget=3))
    merged = merge_chunks(chunks)
    end_id = _think_end_id(r1_engine.tokenizer)
    # the thinking before the budget is the model's own; then the closing tag is forced
    assert merged.token_ids[:3] == free.token_ids[:3] and merged.token_ids[3] == end_id
    decode = r1_engine.tokenizer.decode
    assert merged.reasoning_text == decode(merged.token_ids[:3])
    assert merged.text == decode(merged.token_ids[4:]) and merged.text
    assert chunks[-1].reasoning_tokens == 3 + 1 and chunks[-1].completion_tokens == 10
    # the answer streams as text after the thinking, never the tags
    assert all(c.reasoning_text == "" for c in chunks[4:])
    assert THINK_END not in merged.text + merged.reasoning_text


async def test_v31_thinks_only_when_asked(v31_engine: Engine):
    off = merge_chunks(await _run(v31_engine, _request(6, thinking=False)))
    assert off.reasoning_text == "" and off.reasoning_tokens == 0 and off.text
    on = merge_chunks(await _run(v31_engine, _request(6, thinking=True, budget=2)))
    assert on.reasoning_tokens == 3 and on.completion_tokens == 6
    assert on.reasoning_text and on.text
    assert on.token_ids != off.token_ids  # the prompts differ


async def test_grammars_and_tool_calls_apply_to_the_answer_after_the_thinking(r1_engine: Engine):
    schema = Constraints(json_schema=json.dumps(WEATHER))
    required = Constraints(_TOOLS, "required", parallel_tool_calls=False)
    no_call = Constraints(_TOOLS, "none")
    json_answer, call, free, free_with_tools = await asyncio.gather(
        _run(r1_engine, _request(200, budget=2, constraints=schema)),
        _run(r1_engine, _request(200, budget=2, constraints=required)),
        _run(r1_engine, _request(2)),
        _run(r1_engine, _request(2, constraints=no_call)),  # the same prompt as `call`
    )
    for chunks, unconstrained in ((json_answer, free), (call, free_with_tools)):
        merged, thought = merge_chunks(chunks), merge_chunks(unconstrained)
        # the thinking is the model's own: the grammar applies after it
        assert merged.token_ids[:2] == thought.token_ids
        assert merged.reasoning_text == thought.reasoning_text
        assert merged.reasoning_tokens == 3
    assert json_answer[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.text for c in json_answer)), WEATHER)
    calls = merge_chunks(call).tool_calls or []
    assert call[-1].finish_reason == "tool_calls" and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_raw_text_is_not_parsed_for_thinking(r1_tokenizer: Tokenizer):
    request = GenerationRequest("r", None, "<think>", SamplingParams())
    assert thinking_of(r1_tokenizer, "deepseek_r1", request) is None


def test_the_wire_carries_thinking_reasoning_and_its_usage():
    request = to_engine(
        common_pb2.GenerateRequest(prompt="x", thinking=True, thinking_budget_tokens=7)
    )
    assert (request.thinking, request.thinking_budget_tokens) == (True, 7)
    unset = to_engine(common_pb2.GenerateRequest(prompt="x"))
    assert (unset.thinking, unset.thinking_budget_tokens) == (None, None)
    chunk = GenerationChunk("ans", [5], "stop", 10, 9, reasoning_text="hm", reasoning_tokens=4)
    response = to_proto(chunk)
    assert response.reasoning_text == "hm" and response.text == "ans"
    assert response.usage.reasoning_tokens == 4 and response.usage.completion_tokens == 9


def test_reasoning_format_is_configured_or_read_from_the_template(
    r1_engine: Engine, tmp_path: Path
):
    config = WorkerConfig(model=ModelSection(path=DEFAULT_MODEL_PATH))
    info = worker_info(config, r1_engine, "127.0.0.1:1")
    assert info.capabilities.reasoning_format == "deepseek_r1"
    assert ModelSection().configured_reasoning is None  # auto: the template's
    assert ModelSection(reasoning_format="").configured_reasoning == ""
    path = tmp_path / "worker.toml"
    path.write_text('[model]\nreasoning_format = "deepseek_r2"\n')
    with pytest.raises(ConfigError, match=r"worker\.toml.*reasoning_format.*deepseek_r2"):
        load_worker_config(str(path))


def test_a_stop_string_like_the_closing_tag_neither_leaks_the_tag_nor_stops_early(
    r1_tokenizer: Tokenizer,
):
    """The detokenizer holds the tag's "k>" back for the stop string "k>!"; the answer starts past
    the tag all the same, and the stop string still ends it."""
    ids = r1_tokenizer.encode_rendered(f"hm{THINK_END}a k>!")
    request = GenerationRequest("r", _CHAT, None, SamplingParams())
    thinking = thinking_of(r1_tokenizer, "deepseek_r1", request)
    decoder = CompletionDecoder(r1_tokenizer, ("k>!",), Constraints(), None, thinking)
    out = [decoder.add(token, None) for token in ids]
    assert "".join(d.reasoning_text for d in out) == "hm"
    assert "".join(d.text for d in out) == "a " and out[-1].finish == "stop"
