"""Redis's side of TLS in the deployments: deploy/redis-cert.sh issues Redis's server certificate
from the mesh's CA, and the project's Redis client dials a deployment's URL over TLS, checking
that certificate against the CA the URL names. (The redis-server the tests run is built without
TLS, so no handshake here.)"""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from redis.asyncio.connection import SSLConnection

from infermesh.redis_client import redis_client

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def ca_dir(tmp_path) -> Path:
    """A CA as `python -m infermesh certs` leaves one: ca.crt and ca.key."""
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-subj", "/CN=test-ca", "-days", "30",
        "-keyout", str(tmp_path / "ca.key"), "-out", str(tmp_path / "ca.crt"),
    )  # fmt: skip
    return tmp_path


def _issue(directory: Path) -> str:
    result = subprocess.run(
        ["sh", str(DEPLOY / "redis-cert.sh"), str(directory)],
        check=True,
        capture_output=True,
        text=True,
    )
    return result.stdout


def test_redis_gets_a_server_certificate_from_the_mesh_ca(ca_dir):
    assert "wrote" in _issue(ca_dir)
    cert = x509.load_pem_x509_certificate((ca_dir / "redis.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"redis", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert (ca_dir / "redis.key").stat().st_mode & 0o077 == 0
    assert sorted(p.name for p in ca_dir.iterdir()) == [
        "ca.crt", "ca.key", "redis.crt", "redis.key"
    ]  # fmt: skip


def test_a_valid_certificate_is_kept_and_one_of_another_ca_replaced(ca_dir, tmp_path_factory):
    _issue(ca_dir)
    first = (ca_dir / "redis.crt").read_bytes()
    assert "kept" in _issue(ca_dir) and (ca_dir / "redis.crt").read_bytes() == first
    for name in ("ca.crt", "ca.key"):  # a new CA (a rotation of the CA itself)
        (ca_dir / name).unlink()
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-subj", "/CN=new-ca", "-days", "30",
        "-keyout", str(ca_dir / "ca.key"), "-out", str(ca_dir / "ca.crt"),
    )  # fmt: skip
    assert "wrote" in _issue(ca_dir) and (ca_dir / "redis.crt").read_bytes() != first


async def test_the_redis_client_dials_a_deployment_url_over_verified_tls(tmp_path):
    subprocess.run(["sh", str(DEPLOY / "make-secrets.sh"), str(tmp_path)], check=True)
    client = redis_client((tmp_path / "gateway-redis-url").read_text(), timeout_s=1.0)
    try:
        pool = client.connection_pool
        connection = pool.connection_class(**pool.connection_kwargs)
        assert isinstance(connection, SSLConnection)
        assert connection.ca_certs == "/etc/infermesh-tls/ca.crt"
        assert connection.cert_reqs == ssl.CERT_REQUIRED and connection.check_hostname
        assert (connection.username, connection.host) == ("gateway", "redis")
    finally:
        await client.aclose()
