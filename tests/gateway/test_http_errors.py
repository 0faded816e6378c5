"""Malformed HTTP sent with raw sockets to a real gateway: OpenAI-shaped JSON errors with
the status naming the problem, and no credential in any log line or error body."""
from __future__ import annotations

import logging

import pytest

from infermesh import rawhttp
from infermesh.rawhttp import RawResponse
from tests.gateway.conftest import ADMIN_TOKEN, CHAT

BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'


def _port(gateway) -> int:
    return gateway.server.port


def assert_openai_error(response: RawResponse, status: int) -> dict:
    assert response.status == status, response.body
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _credential_requests(credential: str) -> list[bytes]:
    """What aiohttp's parser refuses, each with the credential in the offending header."""
    bearer = f"Bearer {credential}"
    return [
        rawhttp.request("POST", "/v1/chat/completions",
                        [("Authorization", bearer + "A" * 9000)], BODY),
        rawhttp.request("POST", "/v1/chat/completions",
                        [("Authorization", bearer + "\x00x")], BODY),
        rawhttp.request("POST", "/admin/keys", [("Authorization", bearer + "\x00")], b"{}"),
        rawhttp.request("GET", "/v1/models", [("Authorization", bearer),
                                              ("X-Pad", credential + "B" * 9000)]),
    ]


async def test_a_refused_header_line_never_logs_the_key(gateway, api_key, caplog):
    caplog.set_level(logging.DEBUG)
    for credential in (api_key, ADMIN_TOKEN):
        for data in _credential_requests(credential):
            response = await rawhttp.exchange(_port(gateway), data)
            assert_openai_error(response, 431 if len(data) > 9000 else 400)
            assert credential.encode() not in response.body
    assert caplog.records, "the refusals are logged"
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records)
    assert api_key not in logged and ADMIN_TOKEN not in logged
    assert api_key[:12] not in logged
