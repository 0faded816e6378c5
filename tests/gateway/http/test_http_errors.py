"""Malformed HTTP sent with raw sockets to a real gateway: OpenAI-shaped JSON errors with
the status naming the problem, and no credential in any log line or error body."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.http.server import log_redacted
from tests.helpers import rawhttp
from tests.helpers.gateway import ADMIN_TOKEN
from tests.helpers.rawhttp import RawResponse

BODY = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'


def _port(gateway) -> int:
    return gateway.server.port


def assert_openai_error(response: RawResponse, status: int) -> dict[str, Any]:
    assert response.status == status, response.body
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _credential_requests(credential: str) -> list[bytes]:
    """What aiohttp's parser refuses, each with the credential in the offending header."""
    bearer = f"Bearer {credential}"
    return [
        rawhttp.request(
            "POST", "/v1/chat/completions", [("Authorization", bearer + "A" * 9000)], BODY
        ),
        rawhttp.request(
            "POST", "/v1/chat/completions", [("Authorization", bearer + "\x00x")], BODY
        ),
        rawhttp.request("POST", "/admin/keys", [("Authorization", bearer + "\x00")], b"{}"),
        rawhttp.request(
            "GET", "/v1/models", [("Authorization", bearer), ("X-Pad", credential + "B" * 9000)]
        ),
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


CHAT_PATH = "/v1/chat/completions"
TLS_CLIENT_HELLO = bytes.fromhex("1603010200010001fc0303") + b"\x00" * 40


def _head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


MALFORMED = {
    "content_length_not_a_number": (
        rawhttp.request("POST", CHAT_PATH, [("Content-Length", "abc")], BODY),
        400,
    ),
    "content_length_negative": (
        rawhttp.request("POST", CHAT_PATH, [("Content-Length", "-5")], BODY),
        400,
    ),
    "content_length_twice": (
        rawhttp.request(
            "POST",
            CHAT_PATH,
            [("Content-Length", str(len(BODY))), ("Content-Length", str(len(BODY)))],
            BODY,
        ),
        400,
    ),
    "content_length_and_chunked": (
        rawhttp.request(
            "POST",
            CHAT_PATH,
            [("Content-Length", "3"), ("Transfer-Encoding", "chunked")],
            b"3\r\nabc\r\n0\r\n\r\n",
        ),
        400,
    ),
    "header_over_8kb": (rawhttp.request("GET", "/health", [("X-Long", "a" * 9000)]), 431),
    "url_over_8kb": (rawhttp.request("GET", "/v1/models?q=" + "a" * 9000), 414),
    "nul_in_header": (rawhttp.request("GET", "/health", [("X-Nul", "a\x00b")]), 400),
    "300_headers": (rawhttp.request("GET", "/health", [(f"X-H{i}", "v") for i in range(300)]), 431),
    "tls_on_plain_port": (TLS_CLIENT_HELLO, 400),
    "bad_method": (_head("G@T /health HTTP/1.1", "Host: x"), 400),
    "bad_version": (_head("GET /health HTTP/7.x", "Host: x"), 400),
    "header_without_colon": (_head("GET /health HTTP/1.1", "Host: x", "NoColonHere"), 400),
    "space_before_colon": (_head("GET /health HTTP/1.1", "Host : x"), 400),
    "host_twice": (_head("GET /health HTTP/1.1", "Host: x", "Host: y"), 400),
}


@pytest.mark.parametrize("name", MALFORMED)
async def test_malformed_http_is_answered_in_openai_error_shape(gateway, name):
    data, status = MALFORMED[name]
    error = assert_openai_error(await rawhttp.exchange(_port(gateway), data), status)
    assert error["type"] == "invalid_request_error"


async def test_a_body_that_breaks_chunked_encoding_is_a_400(gateway, api_key):
    data = rawhttp.request(
        "POST",
        CHAT_PATH,
        [
            ("Authorization", f"Bearer {api_key}"),
            ("Content-Type", "application/json"),
            ("Transfer-Encoding", "chunked"),
        ],
        b'5\r\n{"a":\r\nzz\r\n',
    )
    error = assert_openai_error(await rawhttp.exchange(_port(gateway), data), 400)
    assert "chunk" in error["message"]


async def test_a_body_its_content_encoding_cannot_decode_is_a_400(gateway, api_key):
    data = rawhttp.request(
        "POST",
        CHAT_PATH,
        [
            ("Authorization", f"Bearer {api_key}"),
            ("Content-Type", "application/json"),
            ("Content-Encoding", "gzip"),
        ],
        b"not gzip at all",
    )
    error = assert_openai_error(await rawhttp.exchange(_port(gateway), data), 400)
    assert "body" in error["message"]


def test_aiohttps_own_error_logging_keeps_the_type_not_the_message(caplog):
    """What aiohttp's protocol logs through log_exception (an unhandled exception, say)."""
    secret = "sk-" + "s" * 20
    try:
        raise ValueError(f"Authorization: Bearer {secret}")
    except ValueError as e:
        with caplog.at_level(logging.ERROR):
            log_redacted("Unhandled exception", exc=e)
    assert "ValueError" in caplog.text and "test_http_errors.py" in caplog.text
    assert secret not in caplog.text
