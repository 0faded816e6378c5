"""Spans in the OpenTelemetry GenAI semantic conventions, so trace backends
show requests as model calls. Prompts and outputs are never recorded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.util.types import AttributeValue

import telemetry

_tracer = trace.get_tracer("infermesh")
PROVIDER = "infermesh"


@contextlib.contextmanager
def model_call_span(
    operation: str,
    model: str,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
) -> Iterator[trace.Span]:
    """The ``{operation} {model}`` span around one generation (``chat``,
    ``text_completion``), with the request attributes set."""
    attributes: dict[str, AttributeValue] = {
        gen_ai.GEN_AI_OPERATION_NAME: operation,
        gen_ai.GEN_AI_REQUEST_MODEL: model,
        gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
    }
    if not telemetry.tracing_enabled():  # no span to record: skip even the no-op tracer's work
        yield trace.INVALID_SPAN
        return
    for key, value in (
        (gen_ai.GEN_AI_REQUEST_MAX_TOKENS, max_tokens),
        (gen_ai.GEN_AI_REQUEST_TEMPERATURE, temperature),
        (gen_ai.GEN_AI_REQUEST_TOP_P, top_p),
    ):
        if value is not None:
            attributes[key] = value
    with _tracer.start_as_current_span(
        f"{operation} {model}", kind=trace.SpanKind.CLIENT, attributes=attributes
    ) as span:
        yield span


def record_response(
    span: trace.Span,
    *,
    response_id: str,
    model: str,
    finish_reasons: Sequence[str],
    input_tokens: int,
    output_tokens: int,
) -> None:
    """The response attributes of a model call span."""
    span.set_attributes(
        {
            gen_ai.GEN_AI_RESPONSE_ID: response_id,
            gen_ai.GEN_AI_RESPONSE_MODEL: model,
            gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: list(finish_reasons),
            gen_ai.GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
            gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
        }
    )
