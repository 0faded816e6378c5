"""The router's sampling parameters from any wire format's request fields."""

from __future__ import annotations

from typing import Any

from infermesh.pb import common_pb2


def sampling_params(
    *,
    stop: list[str],
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
) -> common_pb2.SamplingParams:
    """Only the fields the client gave are set: an unset one means the worker's default."""
    given: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_tokens": max_tokens,
        "seed": seed,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
    }
    return common_pb2.SamplingParams(stop=stop, **{k: v for k, v in given.items() if v is not None})
