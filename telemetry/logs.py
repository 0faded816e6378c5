"""Log lines as JSON objects carrying the active trace and span ids, so a line
found in the logs leads to its trace in Jaeger (and back)."""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime

from opentelemetry import trace

# LogRecord attributes that are the record's own, not extras passed by a caller.
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message,
    trace_id/span_id when a span is active, exception text, and extras."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            line["trace_id"] = format(context.trace_id, "032x")
            line["span_id"] = format(context.span_id, "016x")
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        line.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
        return json.dumps(line, default=str)


def setup_logging(service: str) -> None:
    """Root logging for a service: JSON lines on stderr, or plain text when
    ``INFERMESH_LOG_FORMAT=text`` (the dev runner's choice for a terminal).
    ``INFERMESH_LOG_LEVEL`` sets the level (default INFO)."""
    handler = logging.StreamHandler()
    if os.environ.get("INFERMESH_LOG_FORMAT", "json") == "text":
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        )
    else:
        handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("INFERMESH_LOG_LEVEL", "INFO").upper())
