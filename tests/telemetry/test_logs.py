from __future__ import annotations

import json
import logging
import sys

from opentelemetry.sdk.trace import TracerProvider

from telemetry.logs import JsonFormatter


def _record(message: str, *args, **extra) -> logging.LogRecord:
    record = logging.LogRecord("svc.mod", logging.WARNING, __file__, 1, message, args, None)
    record.__dict__.update(extra)
    return record


def test_json_line_carries_the_active_trace():
    formatter = JsonFormatter("router")
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("op") as span:
        line = json.loads(formatter.format(_record("worker %s expired", "w1", worker_id="w1")))
    context = span.get_span_context()
    assert line["message"] == "worker w1 expired" and line["level"] == "WARNING"
    assert line["service"] == "router" and line["logger"] == "svc.mod"
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")
    assert line["worker_id"] == "w1"


def test_no_trace_ids_outside_a_span_and_exceptions_kept():
    formatter = JsonFormatter("gateway")
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    line = json.loads(formatter.format(record))
    assert "trace_id" not in line and "ValueError: boom" in line["exception"]
