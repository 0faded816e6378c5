"""Constrained decoding with llguidance: a request's tools and JSON schema become one grammar, and
its matcher a token mask per step.

The grammar follows the checkpoint's tool-call format (worker_svc.tool_parser): with tool_choice
``required`` or a named tool the output must be calls whose arguments match their tool's schema;
with ``auto`` it is text (no special tokens) optionally followed by such calls; with ``none`` text
only. A ``json_schema`` makes the text a JSON value of that schema. JSON is compact (no free
whitespace), so a model cannot spend its tokens on blanks. Compiled grammars are cached by their
text; each sequence gets a copy of the compiled matcher.
"""
from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch

from worker_svc.engine_api import Constraints, InvalidRequestError
from worker_svc.tokenizer import Tokenizer
from worker_svc.tool_parser import ToolMarkers

logger = logging.getLogger(__name__)

_COMPACT = {"whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarCompiler:
    """Grammars for one checkpoint's tokenizer; `matcher()` is safe to call from the event loop."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256):
        self.markers = ToolMarkers.of(tokenizer)
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled = functools.lru_cache(cache_size)(self._compile)

    def matcher(self, constraints: Constraints) -> llguidance.LLMatcher | None:
        """A fresh matcher for `constraints`, or None when they constrain nothing."""
        if not constraints.active:
            return None
        return self._compiled(lark_grammar(constraints, self.markers)).deep_copy()

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the tools or json_schema cannot be enforced: {matcher.get_error()}")
        return matcher


def lark_grammar(c: Constraints, markers: ToolMarkers | None) -> str:
    """The llguidance Lark grammar of `c` (which constrains something)."""
    json_answer = f"%json {_compact_schema(c.json_schema)}" if c.json_schema is not None else None
    if c.tools and markers is None:
        raise InvalidRequestError("this model's tokenizer has no tool-call tokens: it cannot call tools")
    if not c.tools or c.tool_choice == "none":
        return f"start: {json_answer}\n" if json_answer else "start: TEXT?\nTEXT: /(?s:.+)/\n"
    assert markers is not None
    if c.tool_choice == "auto":
        start = f"{json_answer} | calls" if json_answer else "TEXT? calls?"
    else:
        start = "calls"
    tools = [t for t in c.tools if c.tool_choice != "named" or t.name == c.tool_name]
    more = ' ("\\n"? call)*' if c.parallel_tool_calls else ""
    lines = [f"start: {start}",
             f"calls: <[{markers.calls_begin}]> call{more} <[{markers.calls_end}]>",
             f'call: <[{markers.call_begin}]> "function" <[{markers.sep}]> '
             f'({" | ".join(f"fn_{i}" for i in range(len(tools)))})']
    for i, tool in enumerate(tools):
        header = json.dumps(f"{tool.name}\n```json\n")
        lines.append(f'fn_{i}: {header} %json {_compact_schema(tool.parameters)} '
                     f'"\\n```" <[{markers.call_end}]>')
    lines.append("TEXT: /(?s:.+)/")
    return "\n".join(lines) + "\n"


def _compact_schema(schema: str) -> str:
    """The schema with llguidance's compact JSON option (checked to be an object by
    check_constraints)."""
    value = json.loads(schema)
    return json.dumps({**value, "x-guidance": {**value.get("x-guidance", {}), **_COMPACT}})


def apply_masks(logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> torch.Tensor:
    """The logits with those of the tokens each row's matcher forbids at -inf (rows without a
    matcher unchanged; no copy when no row has one).

    logits: [N, vocab], row i of matchers[i].
    """
    if all(m is None for m in matchers):
        return logits
    vocab = logits.size(-1)
    # every row gets a mask (all ones without a matcher): one masked_fill over the batch, where
    # writing only some rows back (index_put) costs far more on a CPU
    bitmask = torch.full((len(matchers), (vocab + 31) // 32), -1, dtype=torch.int32)
    for row, matcher in zip(bitmask, matchers, strict=True):
        if matcher is not None:
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(len(matchers), -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
