"""Redis's side of TLS in the deployments: deploy/server-cert.sh issues Redis's server
certificate from the mesh's CA, and the project's Redis client dials a deployment's URL over TLS,
checking that certificate against the CA the URL names: against a TLS-only redis-server started
as the deployments start it (the system's redis-server, built with TLS; the one the other tests
run is built without)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from redis.asyncio.connection import SSLConnection

from infermesh.ports import free_port
from infermesh.redis_client import REDIS_ERRORS, redis_client
from tests.helpers.redis_cluster import cluster_port

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
        ["sh", str(DEPLOY / "server-cert.sh"), str(directory), "redis"],
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


@pytest.fixture
def tls_only_redis(ca_dir) -> Iterator[int]:
    """A redis-server with Redis's certificate from ``ca_dir``, on TLS only (as deploy/ runs
    it: no plaintext port, clients not asked for a certificate) and one ACL user, gateway;
    its TLS port."""
    with _tls_only_server(ca_dir, free_port()) as port:
        yield port


@pytest.fixture
def tls_only_cluster(ca_dir) -> Iterator[int]:
    """As ``tls_only_redis``, a Redis Cluster of that one node (its bus over TLS too), which
    serves every slot; its TLS port."""
    port = cluster_port()
    cluster = ["--cluster-enabled", "yes", "--tls-cluster", "yes"]
    with _tls_only_server(ca_dir, port, cluster) as started:
        with redis.Redis(
            port=started, username="gateway", password="s3cret", ssl=True,
            ssl_ca_certs=str(ca_dir / "ca.crt"),
        ) as node:  # fmt: skip
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 10
            while node.cluster("INFO")["cluster_state"] != "ok":
                assert time.monotonic() < deadline, "the cluster never served its slots"
                time.sleep(0.05)
        yield started


@pytest.fixture
def tls_only_sentinel(ca_dir, tls_only_redis) -> Iterator[int]:
    """A Sentinel on TLS only, watching ``tls_only_redis`` as master ``svc`` over TLS (with the
    gateway user's login); its TLS port."""
    port = free_port()
    config = ca_dir / "sentinel.conf"
    config.write_text(
        f"port 0\ntls-port {port}\nbind 127.0.0.1\ndir {ca_dir}\n"
        f"tls-cert-file {ca_dir / 'redis.crt'}\ntls-key-file {ca_dir / 'redis.key'}\n"
        f"tls-ca-cert-file {ca_dir / 'ca.crt'}\ntls-auth-clients no\ntls-replication yes\n"
        f"sentinel monitor svc 127.0.0.1 {tls_only_redis} 1\n"
        "sentinel auth-user svc gateway\nsentinel auth-pass svc s3cret\n"
    )
    binary = shutil.which("redis-server")
    assert binary
    sentinel = subprocess.Popen([binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _listening(port):
            assert sentinel.poll() is None and time.monotonic() < deadline, "no sentinel"
            time.sleep(0.05)
        yield port
    finally:
        sentinel.terminate()
        sentinel.wait(5)


@contextlib.contextmanager
def _tls_only_server(ca_dir: Path, port: int, more: Sequence[str] = ()) -> Iterator[int]:
    binary = shutil.which("redis-server")
    assert binary, "these tests need a redis-server built with TLS on the PATH"
    _issue(ca_dir)
    server = subprocess.Popen(
        [
            binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(ca_dir / "redis.crt"),
            "--tls-key-file", str(ca_dir / "redis.key"),
            "--tls-ca-cert-file", str(ca_dir / "ca.crt"),
            "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
            "--dir", str(ca_dir), "--user", "default", "off",
            "--user", "gateway", "on", ">s3cret", "~*", "+@all", *more,
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not _listening(port):
            assert server.poll() is None and time.monotonic() < deadline, "redis never listened"
            time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(5)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


async def _ping(url: str) -> bool:
    client = redis_client(url, timeout_s=2.0, retries=False)
    try:
        return bool(await client.ping())
    finally:
        await client.aclose()


async def test_a_deployment_url_completes_a_verified_tls_handshake_with_redis(
    ca_dir, tls_only_redis, tmp_path_factory
):
    """The URL make-secrets.sh writes, pointed here: a TLS handshake that checks Redis's
    certificate against the mesh's CA, then the ACL user's login. Plaintext gets no answer,
    and a client trusting another CA refuses the server."""
    where = f"localhost:{tls_only_redis}/0"
    assert await _ping(f"rediss://gateway:s3cret@{where}?ssl_ca_certs={ca_dir / 'ca.crt'}")
    with pytest.raises(REDIS_ERRORS):
        await _ping(f"redis://gateway:s3cret@{where}")
    other = tmp_path_factory.mktemp("other-ca")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-subj", "/CN=other-ca", "-days", "30",
        "-keyout", str(other / "ca.key"), "-out", str(other / "ca.crt"),
    )  # fmt: skip
    with pytest.raises(REDIS_ERRORS) as refused:
        await _ping(f"rediss://gateway:s3cret@{where}?ssl_ca_certs={other / 'ca.crt'}")
    assert "certificate verify failed" in str(refused.value)


async def test_a_cluster_url_completes_a_verified_tls_handshake_with_every_node(
    ca_dir, tls_only_cluster
):
    """rediss+cluster://: the cluster client's discovery and its commands go over TLS, checking
    each node's certificate against the mesh's CA; a script runs (as an admission does)."""
    where = f"gateway:s3cret@localhost:{tls_only_cluster}"
    client = redis_client(
        f"rediss+cluster://{where}?ssl_ca_certs={ca_dir / 'ca.crt'}", timeout_s=2.0
    )
    try:
        await client.set("{k}:tls", "yes")
        assert await client.eval("return redis.call('GET', KEYS[1])", 1, "{k}:tls") == b"yes"
    finally:
        await client.aclose()
    plaintext = redis_client(f"redis+cluster://{where}", timeout_s=1.0)
    with pytest.raises(REDIS_ERRORS):
        await plaintext.ping()
    await plaintext.aclose()


async def test_a_sentinel_url_completes_verified_tls_handshakes_with_sentinel_and_master(
    ca_dir, tls_only_sentinel
):
    """rediss+sentinel://: the Sentinel is asked over TLS, then the master it names is dialed
    over TLS, each certificate checked against the mesh's CA."""
    url = f"rediss+sentinel://gateway:s3cret@localhost:{tls_only_sentinel}/svc"
    client = redis_client(f"{url}?ssl_ca_certs={ca_dir / 'ca.crt'}", timeout_s=2.0)
    try:
        await client.set("tls", "yes")
        assert await client.get("tls") == b"yes"
    finally:
        await client.aclose()
    plaintext = redis_client(url.replace("rediss", "redis", 1), timeout_s=1.0, retries=False)
    with pytest.raises(REDIS_ERRORS):
        await plaintext.ping()
    await plaintext.aclose()
