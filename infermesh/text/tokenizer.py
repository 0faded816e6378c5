"""A checkpoint's own tokenizer and the chat template it is served with: what renders and
tokenizes prompts, on the worker that serves them and on a gateway that loaded the worker's files
(infermesh.text.text_files)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from infermesh.config import ConfigError
from infermesh.text.chat_templates import ReasoningFormat, ToolFormat, choose_template
from infermesh.text.text_files import TextFiles, checkpoint_text_files


class Tokenizer:
    """Loaded from the checkpoint directory only (never downloaded). ``chat_template``: a template
    file served instead of the checkpoint's (``[model] chat_template``); without it a checkpoint
    whose template cannot render tool definitions is served with its family's tool template
    (infermesh.text.chat_templates)."""

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
        # how the template turns thinking on (the worker's [model] reasoning_format may override)
        self.reasoning_format: ReasoningFormat = template.reasoning_format
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.vocab_size = len(self.hf)  # with the added tokens
        self.text_files: TextFiles = checkpoint_text_files(Path(model_dir), template.text)

    def _render(
        self, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> str:
        return cast(
            str,
            self.hf.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            ),
        )

    def encode(self, text: str) -> list[int]:
        """Raw text -> ids, with BOS as the tokenizer's post-processor adds it."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        thinking: bool | None = None,
    ) -> str:
        """`tools`: OpenAI-shaped function definitions, as HF templates take them; `thinking`: the
        template's thinking flag (V3.1's, V3.2's), None: the template's default."""
        hf_tools: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools else None
        flag: dict[str, Any] = {} if thinking is None else {"thinking": thinking}
        # tokenize=False: the rendered text
        return cast(
            str,
            self.hf.apply_chat_template(
                messages, tools=hf_tools, tokenize=False, add_generation_prompt=True, **flag
            ),
        )

    def encode_rendered(self, rendered: str) -> list[int]:
        """A rendered chat's ids (BOS comes from the template)."""
        return list(self.hf.encode(rendered, add_special_tokens=False))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        thinking: bool | None = None,
    ) -> list[int]:
        """Messages rendered with the served chat template, then tokenized."""
        return self.encode_rendered(self.render_chat(messages, tools, thinking))

    def decode(self, ids: list[int]) -> str:
        # one sequence of ids: one string
        return cast(
            str, self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        )


def _model_type(model_dir: Path) -> str:
    """config.json's model_type ("" without one): the family a tool template is chosen for."""
    config = model_dir / "config.json"
    return str(json.loads(config.read_text()).get("model_type", "")) if config.exists() else ""
