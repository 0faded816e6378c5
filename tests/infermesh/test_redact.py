"""URLs in logs and errors: where they point, never the credentials they carry."""

from __future__ import annotations

import logging

import pytest

from devtools.main import _start_redis
from gateway.config import ConsoleSection
from infermesh.ports import free_port
from infermesh.redact import redact_url, redact_urls_in


@pytest.mark.parametrize(
    "url, shown",
    [
        (
            "rediss://gateway:s3cr%40t@redis:6379/0?ssl_ca_certs=/etc/infermesh-tls/ca.crt",
            "rediss://gateway:***@redis:6379/0?ssl_ca_certs=/etc/infermesh-tls/ca.crt",
        ),
        ("redis://:s3cret@127.0.0.1:6379", "redis://:***@127.0.0.1:6379"),
        ("redis+cluster://u:s3cret@a:1,b:2", "redis+cluster://u:***@a:1,b:2"),
        ("redis+sentinel://:s3cret@s:26379/mymaster", "redis+sentinel://:***@s:26379/mymaster"),
        ("https://s3cret@host/v1?token=s3cret&n=1", "https://***@host/v1?token=***&n=1"),
        ("unix:///run/redis.sock?password=s3cret&db=1", "unix:///run/redis.sock?password=***&db=1"),
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("gateway:8000", "gateway:8000"),
    ],
)
def test_a_url_is_shown_without_its_credentials(url, shown):
    assert redact_url(url) == shown


def test_make_run_logs_the_redis_url_it_starts_without_its_password(caplog):
    caplog.set_level(logging.INFO, logger="infermesh")
    server = _start_redis(f"redis://:s3cret@127.0.0.1:{free_port()}/0")
    server.stop()
    assert "no Redis reachable at redis://:***@127.0.0.1:" in caplog.text
    assert "s3cret" not in caplog.text


def test_a_console_url_config_error_names_the_url_without_its_credentials():
    with pytest.raises(ValueError) as error:
        ConsoleSection(router_metrics_url="ftp://ops:s3cret@router:9101/metrics?token=s3cret")
    assert "router_metrics_url must be an http(s) URL" in str(error.value)
    assert "ftp://ops:***@router:9101/metrics?token=***" in str(error.value)
    assert "s3cret" not in str(error.value)


def test_every_url_in_a_text_is_redacted_and_the_rest_kept():
    text = (
        "GET http://ops:hunter2@router:9101/metrics?token=abc failed; retried rediss://:pw@r:6379"
    )
    redacted = redact_urls_in(text)
    assert redacted == (
        "GET http://ops:***@router:9101/metrics?token=*** failed; retried rediss://:***@r:6379"
    )
