"""Which chat template a checkpoint is served with, and the tool-call syntax it speaks.

DeepSeek's released templates render an assistant's tool calls and the tool results, but never the
tool definitions (HF's ``tools``): a request with tools would reach the model without them. For
each family this package ships a template that renders the definitions as DeepSeek documents them
(``templates/``), used in place of a checkpoint's own when that one cannot render tools; an
operator's ``[model] chat_template`` file overrides both.

The families differ in how a call is written, which decides the template, the parser and the
grammar alike:

- ``v3`` (V2.5, V3, V3-0324, R1): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
  ARGUMENTS\\n```<｜tool▁call▁end｜>``, calls separated by a newline;
- ``v31`` (V3.1, V3.1-Terminus, V3.2-Exp):
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>``, calls chained.

A template's syntax is read from what it renders for a probe call, not from its text.

The reasoning families think between ``<think>`` and ``</think>`` before they answer, and their
templates say how (``ReasoningFormat``):

- ``deepseek_r1`` (R1): the generation prompt opens the thinking, always;
- ``deepseek_v3`` (V3.1, V3.2): the template's ``thinking`` flag opens it, or closes it at once;
- ``""``: the model does not reason.

The family tool templates keep the checkpoint's reasoning: R1's opens the thinking, V3.1's reads
the flag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.meta

logger = logging.getLogger(__name__)

ToolFormat = Literal["v3", "v31"]
ReasoningFormat = Literal["", "deepseek_r1", "deepseek_v3"]
REASONING_FORMATS: tuple[ReasoningFormat, ...] = ("", "deepseek_r1", "deepseek_v3")
THINK, THINK_END = "<think>", "</think>"
# (template, messages, add_generation_prompt) -> the rendered text
Render = Callable[[str, list[dict[str, Any]], bool], str]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

_TEMPLATES = Path(__file__).parent / "templates"
_PROBE_NAME = "probe_function"
_PROBE: list[dict[str, Any]] = [
    {"role": "user", "content": "probe"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "probe",
                "type": "function",
                "function": {"name": _PROBE_NAME, "arguments": "{}"},
            }
        ],
    },
]


@dataclass(frozen=True)
class ChatTemplate:
    """The template a checkpoint is served with and what it can do."""

    text: str
    source: str  # where it came from, for the load log
    tool_format: ToolFormat | None  # None: it renders no tool calls DeepSeek's ways
    renders_tools: bool  # it reads the tool definitions
    reasoning_format: ReasoningFormat


def read_template_file(path: str | Path) -> str:
    """An operator's template file; ValueError naming the file when it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"[model] chat_template: cannot read {path}: {e}") from None


def choose_template(
    own: str | None,
    model_type: str,
    override: str | Path | None,
    render: Render,
) -> ChatTemplate:
    """The template to serve with: ``override`` (a file) when given, else the checkpoint's ``own``
    when it renders tool definitions, else the family's tool template for its call syntax, else
    ``own`` as it is (tools are then refused). ``render(template, messages)`` renders a template.
    ValueError when there is none at all."""
    if override is not None:
        text = read_template_file(override)
        return _described(text, str(override), render)
    if own is None:
        raise ValueError(
            "tokenizer_config.json has no chat_template (set [model] chat_template to a file)"
        )
    served = _described(own, "the checkpoint's tokenizer_config.json", render)
    if served.renders_tools or served.tool_format is None:
        return served
    family = _family_template(served.tool_format, model_type, served.reasoning_format)
    logger.info(
        "the checkpoint's chat template cannot render tool definitions; serving with %s "
        "(DeepSeek's %s tool syntax)",
        family.name,
        served.tool_format,
    )
    return _described(family.read_text(encoding="utf-8"), str(family), render)


def _family_template(
    tool_format: ToolFormat, model_type: str, reasoning_format: ReasoningFormat
) -> Path:
    if tool_format == "v31":
        return _TEMPLATES / "deepseek_v31_tools.jinja"
    if reasoning_format == "deepseek_r1":
        return _TEMPLATES / "deepseek_r1_tools.jinja"
    if model_type == "deepseek_v2":
        return _TEMPLATES / "deepseek_v25_tools.jinja"
    return _TEMPLATES / "deepseek_v3_tools.jinja"


def _described(text: str, source: str, render: Render) -> ChatTemplate:
    try:
        parsed = jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{source}: the chat template is not valid Jinja: {e}") from None
    variables = jinja2.meta.find_undeclared_variables(parsed)
    return ChatTemplate(
        text=text,
        source=source,
        tool_format=_tool_format(text, render),
        renders_tools="tools" in variables,
        reasoning_format=_reasoning_format(text, variables, render),
    )


def _reasoning_format(text: str, variables: set[str], render: Render) -> ReasoningFormat:
    """V3.1's and V3.2's templates read a ``thinking`` flag; R1's generation prompt opens the
    thinking."""
    if "thinking" in variables:
        return "deepseek_v3"
    try:
        prompt = render(text, [{"role": "user", "content": "probe"}], True)
    except Exception:  # a template that cannot render a user's turn: no reasoning read from it
        return ""
    return "deepseek_r1" if prompt.rstrip().endswith(THINK) else ""


def _tool_format(text: str, render: Render) -> ToolFormat | None:
    """The call syntax the template writes a probe call in; None for neither of DeepSeek's."""
    try:
        rendered = render(text, _PROBE, False)
    except Exception:
        # HF drops a None content, which DeepSeek's V2.5 and V3 templates test for a call-only
        # turn (`message['content'] is none`) and then fail on: their source names the syntax
        return _written_format(text)
    if f"{SEP}{_PROBE_NAME}\n```json\n" in rendered:
        return "v3"
    if f"{CALL_BEGIN}{_PROBE_NAME}{SEP}" in rendered:
        return "v31"
    return None


def _written_format(text: str) -> ToolFormat | None:
    """The call syntax a template's source spells out: V3's fences the arguments."""
    if CALL_BEGIN not in text or SEP not in text:
        return None
    return "v3" if "```json" in text else "v31"
