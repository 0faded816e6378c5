"""The checkpoint's own tokenizer and chat template, a request's prompt as token ids (what every
engine serving a checkpoint takes), and streaming detokenization.

`IncrementalDetokenizer` turns generated ids into text pieces that are whole UTF-8 characters
(text ending in U+FFFD is held back until the next token completes it, with vLLM's
prefix/read offsets) and never contain a stop string (a possible partial stop string at the
end is held back until it is ruled out).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from infermesh.config import ConfigError
from worker_svc.engine_api import GenerationRequest, InvalidArgumentError, Tool
from worker_svc.text.chat_templates import ToolFormat, choose_template

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Loaded from the checkpoint directory only (never downloaded). ``chat_template``: a template
    file served instead of the checkpoint's (``[model] chat_template``); without it a checkpoint
    whose template cannot render tool definitions is served with its family's tool template
    (worker_svc.text.chat_templates)."""

    def __init__(self, model_dir: str | Path, chat_template: str | Path | None = None):
        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        if not isinstance(hf, PreTrainedTokenizerFast):  # grammars are compiled from its vocabulary
            raise ConfigError(
                f"{model_dir}: tokenizer.json is missing (a fast tokenizer is needed)"
            )
        self.hf = hf
        try:
            template = choose_template(
                hf.chat_template, _model_type(Path(model_dir)), chat_template, self._render
            )
        except ValueError as e:  # the operator's to fix: a file or the checkpoint
            raise ConfigError(f"{model_dir}: {e}") from None
        self.hf.chat_template = template.text
        # HF passes tool definitions as the template's `tools`; a template that never reads it
        # would drop them
        self.renders_tools = template.renders_tools
        self.tool_format: ToolFormat | None = template.tool_format
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.bos_token_id: int | None = self.hf.bos_token_id

    def _render(self, template: str, messages: list[dict[str, Any]]) -> str:
        return cast(
            str,
            self.hf.apply_chat_template(messages, chat_template=template, tokenize=False),
        )

    def encode(self, text: str) -> list[int]:
        """Raw text -> ids, with BOS as the tokenizer's post-processor adds it."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """`tools`: OpenAI-shaped function definitions, as HF templates take them."""
        hf_tools: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools else None
        # tokenize=False: the rendered text
        return cast(
            str,
            self.hf.apply_chat_template(
                messages, tools=hf_tools, tokenize=False, add_generation_prompt=True
            ),
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Messages rendered with the checkpoint's chat template (BOS comes from the template)."""
        return list(self.hf.encode(self.render_chat(messages, tools), add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        # one sequence of ids: one string
        return cast(
            str, self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        )


def _model_type(model_dir: Path) -> str:
    """config.json's model_type ("" without one): the family a tool template is chosen for."""
    config = model_dir / "config.json"
    return str(json.loads(config.read_text()).get("model_type", "")) if config.exists() else ""


def prompt_token_ids(tokenizer: Tokenizer, request: GenerationRequest) -> list[int]:
    """The prompt's token ids (check_request has checked its shape): chat messages rendered with
    the checkpoint's template, or raw text. Every engine serving a checkpoint takes these, so prompt
    counts and usage agree across engines."""
    if request.messages is not None:
        tools = request.constraints.tools
        if tools and not tokenizer.renders_tools:
            raise InvalidArgumentError(
                "tools: this model's chat template cannot render tool definitions"
            )
        return tokenizer.encode_chat(
            [_template_message(m) for m in request.messages], [_tool_definition(t) for t in tools]
        )
    assert request.prompt is not None, "check_request: exactly one of messages and prompt"
    return tokenizer.encode(request.prompt)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as HF chat templates take it: an assistant turn of only tool calls has no
    content."""
    if message.get("tool_calls") and not message["content"]:
        return {**message, "content": None}
    return message


def _tool_definition(tool: Tool) -> dict[str, Any]:
    """A tool as HF chat templates take it (OpenAI's shape)."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": json.loads(tool.parameters),
        },
    }


class IncrementalDetokenizer:
    """Per-sequence text stream: `add(token_id)` returns the newly safe text, possibly ""."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already in self.text
        self.read_offset = 0
        self.text = ""  # all decoded text so far
        self.emitted = 0  # chars of self.text handed out
        self.stopped = False  # a stop string was found; nothing more is emitted

    def add(self, token_id: int) -> str:
        assert not self.stopped, "add() after a stop string"
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT_CHAR):
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: text still held back for a partial stop string."""
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if self.stop:
            search_from = max(0, self.emitted - max(map(len, self.stop)) + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                end = min(hits)
            elif not final:
                end -= self._partial_stop_len()
        piece = self.text[self.emitted : max(end, self.emitted)]
        self.emitted += len(piece)
        return piece

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
