"""Constrained decoding with llguidance: a request's tools and JSON schema become one grammar, and
its matcher a token mask per step.

The grammar follows the checkpoint's tool-call syntax (worker_svc.decoding.tool_parser): with
tool_choice ``required`` the output must be calls whose arguments match their tool's schema, with a
named tool exactly one call of it; with ``auto`` it is text (no special tokens) optionally followed
by such calls; with ``none`` text only. A ``json_schema`` makes the text a JSON value of that
schema. JSON is spaced as Python's json.dumps spaces it (", " and ": ", no other whitespace): no
tokens spent on blanks, and the spacing models learn from (DeepSeek's templates write a call's
arguments as given, mostly json.dumps's), which a compact grammar forces them off; a tool's
schema is enforced leniently (keywords llguidance cannot enforce are left out). Objects are
closed as OpenAI's strict structured outputs and xgrammar's strict mode close them: an object
schema that lists ``properties`` and says nothing of ``additionalProperties`` allows no other
key (JSON Schema's default would let a model invent keys until ``max_tokens``); bounds
(``minimum``, ``maximum``, ``minLength``, ``maxLength``, ``minItems``, ``maxItems``, ...) are
llguidance's to enforce. Compiled grammars are cached by their text; each sequence gets a copy of
the compiled matcher.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from infermesh.text.tokenizer import Tokenizer
from worker_svc.decoding.tool_parser import ToolMarkers
from worker_svc.engine.api import Constraints, InvalidArgumentError

logger = logging.getLogger(__name__)

_JSON_SPACING = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
# byte value of a bitmask -> what it adds to its 8 tokens' logits: 0 where the bit is set, else -inf
# (llguidance sets bit t % 32 of int32 word t // 32 for an allowed token t, so byte b of the
# little-endian words holds tokens 8b..8b+7, lowest bit first)
_BYTE_BITS = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
_BYTE_BIAS = torch.zeros(256, 8).masked_fill_(_BYTE_BITS == 0, float("-inf"))


class GrammarCompiler:
    """Grammars for one checkpoint's tokenizer; `matcher()` is safe to call from the event loop."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 256,
    ):
        self.markers = ToolMarkers.of(tokenizer)
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer.hf, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._compiled = functools.lru_cache(cache_size)(self._compile)

    def matcher(self, constraints: Constraints) -> llguidance.LLMatcher | None:
        """A fresh matcher for `constraints`, or None when they constrain nothing."""
        if not constraints.active:
            return None
        return self._compiled(lark_grammar(constraints, self.markers)).deep_copy()

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(
            self._tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
        )
        if matcher.is_error():
            raise InvalidArgumentError(
                f"the tools or json_schema cannot be enforced: {matcher.get_error()}"
            )
        return matcher


def lark_grammar(c: Constraints, markers: ToolMarkers | None) -> str:
    """The llguidance Lark grammar of `c` (which constrains something)."""
    json_answer = f"%json {_spaced_schema(c.json_schema)}" if c.json_schema is not None else None
    if c.tools and markers is None:
        raise InvalidArgumentError(
            "this model cannot call tools: its tokenizer has no tool-call tokens, or its chat "
            "template writes no calls in DeepSeek's syntax"
        )
    if not c.tools or c.tool_choice == "none":
        return f"start: {json_answer}\n" if json_answer else "start: TEXT?\nTEXT: /(?s:.+)/\n"
    assert markers is not None
    if c.tool_choice == "auto":
        start = f"{json_answer} | calls" if json_answer else "TEXT? calls?"
    else:
        start = "calls"
    tools = [t for t in c.tools if c.tool_choice != "named" or t.name == c.tool_name]
    # a named tool is one call, as the client asked for that call (not a loop of it)
    parallel = c.parallel_tool_calls and c.tool_choice != "named"
    separator = '"\\n"? ' if markers.format == "v3" else ""
    more = f" ({separator}call)*" if parallel else ""
    head = f'"function" <[{markers.sep}]> ' if markers.format == "v3" else ""
    lines = [
        f"start: {start}",
        f"calls: <[{markers.calls_begin}]> call{more} <[{markers.calls_end}]>",
        f"call: <[{markers.call_begin}]> {head}"
        f"({' | '.join(f'fn_{i}' for i in range(len(tools)))}) <[{markers.call_end}]>",
    ]
    for i, tool in enumerate(tools):
        schema = f"%json {_spaced_schema(tool.parameters, lenient=True)}"
        if markers.format == "v3":
            header = json.dumps(tool.name + "\n```json\n")
            lines.append(f'fn_{i}: {header} {schema} "\\n```"')
        else:
            lines.append(f"fn_{i}: {json.dumps(tool.name)} <[{markers.sep}]> {schema}")
    lines.append("TEXT: /(?s:.+)/")
    return "\n".join(lines) + "\n"


def _spaced_schema(schema: str, lenient: bool = False) -> str:
    """The schema, its objects closed (``closed``), with llguidance's options for _JSON_SPACING
    (checked to be an object by check_constraints); ``lenient``: keywords llguidance cannot
    enforce are left out (a tool's arguments: one such keyword in an agent's tools must not
    refuse its every request), where an answer's json_schema is refused for them."""
    value = closed(json.loads(schema))
    options = {
        **value.get("x-guidance", {}),
        **_JSON_SPACING,
        **({"lenient": True} if lenient else {}),
    }
    return json.dumps({**value, "x-guidance": options})


def closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` in each object schema, at any depth, that
    lists ``properties`` and says nothing of other keys (nor of ``patternProperties``); schemas
    that allow other keys, or list none (a free-form object), are kept as they are, and so are
    values (``enum``, ``const``, ``default``, ...)."""
    if not isinstance(schema, dict):
        return schema
    inner = dict(schema)
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            inner[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            inner[key] = [closed(sub) for sub in value]
        elif key in _SUBSCHEMAS:
            inner[key] = closed(value)
    if isinstance(schema.get("properties"), dict) and not (
        {"additionalProperties", "patternProperties", "unevaluatedProperties"} & schema.keys()
    ):
        inner["additionalProperties"] = False
    return inner


# the JSON Schema keywords whose values are schemas: by name, in a list, or one
_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems", "items"}
_SUBSCHEMAS = {"items", "additionalProperties", "not", "if", "then", "else", "contains"}


def apply_masks(
    logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]
) -> torch.Tensor:
    """The logits with those of the tokens each row's matcher forbids at -inf (rows without a
    matcher unchanged; no copy when no row has one).

    logits: [N, vocab] on the CPU, row i of matchers[i].
    """
    if all(m is None for m in matchers):
        return logits
    n, vocab = logits.shape
    # rows without a matcher keep all bits set: all allowed
    bitmask = torch.full((n, (vocab + 31) // 32), -1, dtype=torch.int32)
    rows = [(matcher, i) for i, matcher in enumerate(matchers) if matcher is not None]
    row_bytes = bitmask.stride(0) * bitmask.element_size()
    _executor().unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), row_bytes, n)
    # an additive bias looked up per byte: branch-free, where a masked_fill over the unpacked bits
    # costs several times more on a CPU (each element's branch follows the grammar's data)
    bytes_ = bitmask.view(torch.uint8).long()
    bias = torch.nn.functional.embedding(bytes_, _BYTE_BIAS.to(logits.dtype)).view(n, -1)
    return logits + bias[:, :vocab]


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """Computes a batch's masks in one call, on llguidance's own threads (80 % of the cores)."""
    return llguidance.LLExecutor()
