"""A request's prompt as token ids, what every engine serving a checkpoint takes: the ids the
caller sent when it rendered them with this worker's tokenizer (GenerateRequest.tokenizer), else
the shared rendering (infermesh.text.prompt) of its messages or raw text, so prompt counts and
usage agree across engines and callers."""

from __future__ import annotations

from infermesh.text.prompt import UnrenderableToolsError, render_token_ids, tool_definition
from infermesh.text.tokenizer import Tokenizer
from worker_svc.engine.api import GenerationRequest, InvalidArgumentError


def prompt_token_ids(tokenizer: Tokenizer, request: GenerationRequest) -> list[int]:
    """The prompt's token ids (check_request has checked its shape)."""
    tools = request.constraints.tools
    if request.prompt_token_ids and request.tokenizer == tokenizer.text_files.digest:
        if tools and not tokenizer.renders_tools:
            raise InvalidArgumentError(str(UnrenderableToolsError()))
        if max(request.prompt_token_ids) >= tokenizer.vocab_size:
            raise InvalidArgumentError(
                f"prompt_token_ids: {max(request.prompt_token_ids)} is not a token id of "
                f"this model's tokenizer ({tokenizer.vocab_size} tokens)"
            )
        return list(request.prompt_token_ids)
    try:
        return render_token_ids(
            tokenizer,
            request.messages,
            request.prompt,
            [tool_definition(t.name, t.description, t.parameters) for t in tools],
            request.thinking,
        )
    except UnrenderableToolsError as e:
        raise InvalidArgumentError(str(e)) from None
