"""The names the APIs use for the contracts' enums ("fp8", "length"), both ways,
for every service that speaks them."""

from __future__ import annotations

from typing import Literal

from infermesh.pb import common_pb2

Precision = Literal["fp8", "bf16", "fp16", "fp32"]
FinishReason = Literal["stop", "length", "tool_calls"]

PRECISIONS: dict[Precision, common_pb2.Precision] = {
    "fp8": common_pb2.PRECISION_FP8,
    "bf16": common_pb2.PRECISION_BF16,
    "fp16": common_pb2.PRECISION_FP16,
    "fp32": common_pb2.PRECISION_FP32,
}
PRECISION_NAMES: dict[int, Precision] = {int(v): k for k, v in PRECISIONS.items()}
FINISH_REASONS: dict[FinishReason, common_pb2.FinishReason] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS,
}
FINISH_REASON_NAMES: dict[int, FinishReason] = {int(v): k for k, v in FINISH_REASONS.items()}


def precision_name(precision: int) -> str:
    """ "fp8" for PRECISION_FP8; "unspecified" for the request's "any"."""
    return PRECISION_NAMES.get(precision, "unspecified")
