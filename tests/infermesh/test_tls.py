"""Mutual TLS and caller identities on the gRPC hops, against real servers on loopback with
certificates written by ``python -m infermesh certs``'s code: who is refused, who is let
through, rotation without a restart, and the config errors."""

from __future__ import annotations

import asyncio
import datetime
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client import REGISTRY

from devtools.certs import role_tls, write_certs
from gateway.accounts.keys import create_key
from gateway.accounts.limits import read_usage
from infermesh import probe
from infermesh.authz import ALLOWED, ROLES, role_uri
from infermesh.config import ConfigError
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from infermesh.ports import free_port
from infermesh.probe import grpc_serving
from infermesh.tls import TlsSection, check_loaded, open_channel
from infermesh.usage import identity_owner
from router_svc.config import FairQueueSection, RouterConfig, RouterServerSection, Standing
from router_svc.config import load as load_router_config
from router_svc.server import create_server as create_router
from tests.helpers import MODEL
from tests.helpers.gateway import make_config, sdk, start_gateway
from tests.helpers.inprocess import (
    RunningRouter,
    RunningWorker,
    running_router,
    running_worker,
    sim_engine,
    wait_for_workers,
)
from tests.helpers.worker_client import worker_client


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    write_certs(directory, workers={"gpu-0": [], "gpu-1": []})
    return directory


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Path:
    """A second CA's set, same roles: none of it is trusted by the mesh above."""
    directory = tmp_path_factory.mktemp("other-ca")
    write_certs(directory)
    return directory


@pytest.fixture
async def router(certs, redis_server) -> AsyncIterator[RunningRouter]:
    async with running_router(redis_url=redis_server.url, certs=certs) as router:
        yield router


@pytest.fixture
async def worker(certs, router) -> AsyncIterator[RunningWorker]:
    async with running_worker(sim_engine(), router, certs=certs) as worker:
        yield worker


def _request() -> common_pb2.GenerateRequest:
    return common_pb2.GenerateRequest(
        request_id="r",
        model=MODEL,
        prompt="hello",
        sampling=common_pb2.SamplingParams(max_tokens=3),
    )


async def _generate(address: str, tls: TlsSection) -> list[common_pb2.GenerateResponse]:
    async with worker_client(tls) as client:
        return [chunk async for chunk in client.generate(address, _request(), timeout_s=10)]


async def _list_workers(address: str, tls: TlsSection) -> router_pb2.ListWorkersResponse:
    async with open_channel(address, tls) as channel:
        reply: router_pb2.ListWorkersResponse = await router_pb2_grpc.RouterStub(
            channel
        ).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
        return reply


def _refused(method: str, reason: str) -> float:
    labels = {"service": "router", "method": method, "reason": reason}
    return REGISTRY.get_sample_value("infermesh_grpc_refused_total", labels) or 0.0


def _worker_info(address: str, worker_id: str = "rogue") -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=worker_id,
        address=address,
        models=[MODEL],
        capabilities=common_pb2.Capabilities(max_parallel=1, device_name="NVIDIA H200"),
    )


async def _register(router: RunningRouter, tls: TlsSection, address: str) -> None:
    """Registers the worker "rogue" at ``address``."""
    async with open_channel(router.address, tls) as channel:
        await router_pb2_grpc.RouterStub(channel).Register(
            router_pb2.RegisterRequest(worker=_worker_info(address)), timeout=5
        )


def test_certs_name_each_role_and_keep_a_valid_set(tmp_path):
    written = write_certs(tmp_path, {"worker": ["10.0.0.5", "gpu-7.internal"]})
    assert {"ca.crt", "ca.key"} | {f"{r}.{e}" for r in ROLES for e in ("crt", "key")} == set(
        written
    )
    worker = x509.load_pem_x509_certificate((tmp_path / "worker.crt").read_bytes())
    names = worker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://infermesh/worker"
    ]
    assert {"localhost", "worker", "gpu-7.internal"} <= set(names.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "::1", "10.0.0.5"} <= {
        str(ip) for ip in names.get_values_for_type(x509.IPAddress)
    }
    for key in [tmp_path / "ca.key", *(tmp_path / f"{r}.key" for r in ROLES)]:
        assert stat.S_IMODE(key.stat().st_mode) & 0o077 == 0, key
    assert write_certs(tmp_path, {"worker": ["10.0.0.5"]}) == []  # still valid: kept
    assert write_certs(tmp_path, {"worker": ["10.0.0.6"]}) == ["worker.crt", "worker.key"]
    named = write_certs(tmp_path, client_name="batch-jobs")
    assert named == ["client.crt", "client.key"]
    client = x509.load_pem_x509_certificate((tmp_path / "client.crt").read_bytes())
    uris = client.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "spiffe://infermesh/client/batch-jobs" in uris.get_values_for_type(
        x509.UniformResourceIdentifier
    )


def test_the_certs_command_gives_each_worker_named_an_identity_of_its_own(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "infermesh", "certs", str(tmp_path), "--worker", "gpu-0=10.0.0.5"],
        check=True,
        capture_output=True,
    )
    cert = x509.load_pem_x509_certificate((tmp_path / "worker-gpu-0.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://infermesh/worker/gpu-0"
    ]
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "::1",
        "10.0.0.5",
    }
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]  # not the shared "worker"


def test_every_mesh_rpc_has_a_row_in_the_table():
    methods = {
        f"/{service.full_name}/{method.name}"
        for module in (router_pb2, worker_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert methods == set(ALLOWED)


async def test_a_caller_without_a_certificate_never_connects(router, worker):
    plaintext = TlsSection(plaintext=True)
    for address in (router.address, worker.servicer.info.address):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _list_workers(address, plaintext)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not await _serving(router.address, plaintext)  # not even health


async def test_a_certificate_of_another_ca_never_connects(router, worker, other_ca):
    for address, role in ((router.address, "admin"), (worker.servicer.info.address, "gateway")):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _list_workers(address, role_tls(other_ca, role))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_health_is_open_to_every_role_of_the_mesh(router, certs):
    for role in ROLES:
        assert await _serving(router.address, role_tls(certs, role)), role


async def test_a_list_of_routers_is_dialed_over_tls_whichever_answers(router, certs):
    """A gRPC list target (several routers of one mesh): the channel checks each router's
    certificate against the list's first address, where gRPC's own authority, the whole list,
    matches no certificate."""
    dead = f"127.0.0.1:{free_port()}"
    for target in (f"ipv4:{dead},{router.address}", f"ipv4:{router.address},{dead}"):
        listed = await _list_workers(target, role_tls(certs, "admin"))
        assert listed.workers == [], target
        assert await _serving(target, role_tls(certs, "admin")), target


async def test_the_probe_command_asks_health_with_a_certificate(router, certs):
    files = [str(certs / name) for name in ("admin.crt", "admin.key", "ca.crt")]
    assert await asyncio.to_thread(probe.main, ["grpc", router.address, *files]) == 0
    assert await asyncio.to_thread(probe.main, ["grpc", router.address]) == 1  # plaintext
    missing = ["/nonexistent.crt", *files[1:]]
    assert await asyncio.to_thread(probe.main, ["grpc", router.address, *missing]) == 2


async def test_plaintext_warns_at_start_that_every_caller_is_trusted(caplog):
    async with running_router():
        pass
    assert "router: [tls] plaintext = true: gRPC without TLS, every caller is trusted" in (
        caplog.text
    )


async def test_a_worker_certificate_cannot_generate_on_a_worker(worker, certs):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _generate(worker.servicer.info.address, role_tls(certs, "worker"))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Serve refused for spiffe://infermesh/worker" in refused.value.details()
    assert "role worker may not call it" in refused.value.details()


async def test_the_gateway_and_the_router_generate_on_a_worker(worker, certs):
    for role in ("gateway", "router"):
        chunks = await _generate(worker.servicer.info.address, role_tls(certs, role))
        assert chunks and chunks[-1].finish_reason


async def test_only_the_router_reads_a_workers_cache_events(worker, certs):
    async def first_batch(role: str) -> worker_pb2.CacheEventBatch:
        async with open_channel(worker.servicer.info.address, role_tls(certs, role)) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).CacheEvents(
                worker_pb2.CacheEventsRequest(), timeout=10
            )
            batch: worker_pb2.CacheEventBatch = await call.read()
            call.cancel()
            return batch

    assert (await first_batch("router")).snapshot
    for role in ("gateway", "client", "worker", "admin"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await first_batch(role)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, role
        assert f"CacheEvents refused for spiffe://infermesh/{role}" in refused.value.details()


async def test_an_internal_callers_usage_is_counted_under_its_certificate(
    router, worker, certs, redis_server
):
    """A client certificate's Generate and Complete on the router (relayed over the router's
    own Serve streams to the worker, mutual TLS on both hops) count as its usage; the same
    calls by a gateway do not (the gateway counts its keys' own)."""
    usages = []
    for role in ("client", "gateway"):
        async with open_channel(router.address, role_tls(certs, role)) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            chunks = [c async for c in stub.Generate(_request(), timeout=10)]
            reply = await stub.Complete(_request(), timeout=10)
        usages += [chunks[-1].usage, reply.usage]
    owner = identity_owner(role_uri("client"))
    expected = sum(u.completion_tokens for u in usages[:2])
    assert expected > 0
    deadline = time.monotonic() + 5
    async with aioredis.Redis.from_url(redis_server.url) as client:
        while (counted := await read_usage(client, owner, 1))["requests"] < 2:
            assert time.monotonic() < deadline, counted
            await asyncio.sleep(0.05)
    assert counted["requests"] == 2 and counted["completion_tokens"] == expected
    assert counted["prompt_tokens"] == sum(u.prompt_tokens for u in usages[:2])


async def test_only_the_gateway_and_router_may_fetch_a_workers_text_files(worker, certs):
    """The others are refused by role; the two allowed reach the servicer, which answers a
    simulated engine's NOT_FOUND."""

    async def text_files(role: str) -> grpc.StatusCode:
        async with open_channel(worker.servicer.info.address, role_tls(certs, role)) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).TextFiles(
                worker_pb2.TextFilesRequest(), timeout=10
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [chunk async for chunk in call]
            return refused.value.code()

    for role in ("gateway", "router"):
        assert await text_files(role) == grpc.StatusCode.NOT_FOUND
    for role in ("client", "admin", "worker"):
        assert await text_files(role) == grpc.StatusCode.PERMISSION_DENIED


async def test_a_worker_certificate_cannot_list_the_fleet(router, worker, certs):
    before = _refused("ListWorkers", "role")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _list_workers(router.address, role_tls(certs, "worker"))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "ListWorkers refused for spiffe://infermesh/worker" in refused.value.details()
    assert _refused("ListWorkers", "role") == before + 1
    for role in ("gateway", "client", "admin"):
        reply = await _list_workers(router.address, role_tls(certs, role))
        assert [w.worker.worker_id for w in reply.workers] == [worker.servicer.info.worker_id]


async def test_a_gateway_certificate_cannot_register_a_worker(router, certs):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _register(router, role_tls(certs, "gateway"), "127.0.0.1:50999")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Register refused for spiffe://infermesh/gateway" in refused.value.details()
    assert (await _list_workers(router.address, role_tls(certs, "admin"))).workers == []


async def test_a_worker_registers_only_an_address_its_certificate_names(router, certs):
    before = _refused("Register", "address")
    worker = role_tls(certs, "worker")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _register(router, worker, "10.66.0.1:50061")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "does not name the host of '10.66.0.1:50061'" in refused.value.details()
    assert _refused("Register", "address") == before + 1
    await _register(router, worker, "127.0.0.1:50999")
    await _register(router, worker, "localhost:50998")
    await wait_for_workers(router, lambda ids: ids == {"rogue"})


async def test_a_worker_heartbeats_only_for_a_worker_at_a_host_it_names(router, certs, tmp_path):
    """A heartbeat for another worker's id (registered at a host this certificate does not
    name) is refused; that worker's own certificate heartbeats it."""
    other = tmp_path / "certs"
    _copy(certs, other)
    write_certs(other, {"worker": ["10.78.0.1"]})  # the same CA: a worker at another host
    await _register(router, role_tls(other, "worker"), "10.78.0.1:50061")
    await wait_for_workers(router, lambda ids: ids == {"rogue"})
    heartbeat = router_pb2.HeartbeatRequest(worker_id="rogue", load=common_pb2.Load(running=9))
    async with open_channel(router.address, role_tls(certs, "worker")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router_pb2_grpc.RouterStub(channel).Heartbeat(heartbeat, timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Heartbeat refused for spiffe://infermesh/worker" in refused.value.details()
    async with open_channel(router.address, role_tls(other, "worker")) as channel:
        reply = await router_pb2_grpc.RouterStub(channel).Heartbeat(heartbeat, timeout=5)
    assert reply.registered


async def test_a_second_worker_identity_cannot_take_over_a_registered_id(router, certs):
    """Each worker its own certificate: gpu-1 can neither register gpu-0's id at its own
    address nor heartbeat it; gpu-0 keeps it."""
    real, impostor = role_tls(certs, "worker-gpu-0"), role_tls(certs, "worker-gpu-1")
    await _register(router, real, "127.0.0.1:50999")
    before = _refused("Register", "owner")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _register(router, impostor, "127.0.0.1:50071")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (
        "Register refused for spiffe://infermesh/worker/gpu-1 at ipv4:127.0.0.1:"
        in refused.value.details()
    )
    assert "worker rogue is registered by spiffe://infermesh/worker/gpu-0" in (
        refused.value.details()
    )
    assert _refused("Register", "owner") == before + 1
    heartbeat = router_pb2.HeartbeatRequest(worker_id="rogue", load=common_pb2.Load(running=9))
    async with open_channel(router.address, impostor) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router_pb2_grpc.RouterStub(channel).Heartbeat(heartbeat, timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with open_channel(router.address, real) as channel:
        assert (
            await router_pb2_grpc.RouterStub(channel).Heartbeat(heartbeat, timeout=5)
        ).registered
    reply = await _list_workers(router.address, role_tls(certs, "admin"))
    assert [(w.worker.address, w.load.running) for w in reply.workers] == [("127.0.0.1:50999", 9)]


async def test_a_certificate_without_a_mesh_identity_is_unauthenticated(router, certs, tmp_path):
    """Same CA, no spiffe://infermesh/ URI: connected, yet no call but health."""
    anonymous = _issue_without_identity(certs, tmp_path)
    assert await _serving(router.address, anonymous)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _list_workers(router.address, anonymous)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "ListWorkers refused for no mesh identity" in refused.value.details()


async def test_the_openai_sdk_streams_tokens_through_the_gateway_over_tls(
    certs, redis_server, router, worker
):
    gateway = await start_gateway(make_config(redis_server.url, router.address, certs=certs))
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        key = await create_key(client, "tls")
        async with sdk(gateway, key) as openai_client:
            stream = await openai_client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
            )
            chunks = [chunk async for chunk in stream]
    finally:
        await client.aclose()
        await gateway.close()
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 1
    assert chunks[-1].choices[0].finish_reason is not None


async def test_a_server_uses_a_rotated_certificate_without_a_restart(certs, redis_server, tmp_path):
    """The router's new certificate names a host the old one did not; a client that checks
    the server against that name connects only once the router serves the new one."""
    rotated = tmp_path / "certs"
    _copy(certs, rotated)
    async with running_router(redis_url=redis_server.url, certs=rotated) as rotating:
        admin = role_tls(rotated, "admin")
        new_name = [("grpc.ssl_target_name_override", "router.rotated.example")]
        assert not await _healthy(rotating.address, admin, new_name)
        write_certs(rotated, {"router": ["router.rotated.example"]})
        assert await _healthy(rotating.address, admin, new_name)
        assert await _healthy(rotating.address, admin, [])  # the old name is still in it


async def test_a_client_uses_a_rotated_certificate_on_its_next_call(router, certs, tmp_path):
    """A worker's channel, open across the rotation: its next call after the change presents
    the new certificate, which names the host the old one could not register."""
    rotated = tmp_path / "certs"
    _copy(certs, rotated)
    worker = role_tls(rotated, "worker")
    async with open_channel(router.address, worker) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        register = router_pb2.RegisterRequest(worker=_worker_info("10.77.0.1:50061"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Register(register, timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        write_certs(rotated, {"worker": ["10.77.0.1"]})
        await asyncio.sleep(1.1)  # the channel looks at its files at most once a second
        await stub.Register(register, timeout=5)


@pytest.mark.parametrize(
    "tls, message",
    [
        (TlsSection(), "cfg.toml: [tls] cert_file: TLS is required but no cert_file is set"),
        (
            TlsSection(cert_file="x.crt", plaintext=True),
            "cfg.toml: [tls] plaintext: true with cert_file set",
        ),
        (
            TlsSection(cert_file="/nonexistent.crt", key_file="k", ca_file="c"),
            "cfg.toml: [tls] cert_file: /nonexistent.crt: no such file",
        ),
    ],
)
def test_tls_config_errors_name_the_file_and_key(tls, message):
    with pytest.raises(ConfigError) as error:
        check_loaded(tls, "cfg.toml", "infermesh_router")
    assert str(error.value).startswith(message)
    assert "INFERMESH_ROUTER_TLS_" in str(error.value)


def test_a_key_that_is_not_the_certificates_is_a_config_error(certs):
    mixed = TlsSection(
        cert_file=str(certs / "router.crt"),
        key_file=str(certs / "worker.key"),
        ca_file=str(certs / "ca.crt"),
    )
    with pytest.raises(ConfigError, match=r"\[tls\] key_file: not the key of cert_file"):
        check_loaded(mixed, "router.toml", "infermesh_router")


async def test_a_server_started_with_neither_files_nor_plaintext_is_a_config_error():
    with pytest.raises(ConfigError, match=r"\[tls\] cert_file: TLS is required"):
        await create_router(RouterConfig(server=RouterServerSection(port=0)))


async def _serving(address: str, tls: TlsSection) -> bool:
    """The probe's answer (a blocking call: off the loop the servers run on)."""
    return await asyncio.to_thread(grpc_serving, address, 3.0, tls)


async def _healthy(address: str, tls: TlsSection, options: list[tuple[str, str]]) -> bool:
    async with open_channel(address, tls, options) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), 3)
        except TimeoutError:
            return False
    return True


def _copy(source: Path, target: Path) -> None:
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
        os.chmod(target / path.name, stat.S_IMODE(path.stat().st_mode))
    time.sleep(0.01)  # a rotation below changes the files' modification times


def _issue_without_identity(certs: Path, tmp_path: Path) -> TlsSection:
    """A certificate from the mesh's CA that names hosts but no role."""
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "anonymous")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    (tmp_path / "anon.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "anon.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return TlsSection(
        cert_file=str(tmp_path / "anon.crt"),
        key_file=str(tmp_path / "anon.key"),
        ca_file=str(certs / "ca.crt"),
    )


async def test_a_client_certificate_cannot_grant_itself_a_weight_out_of_range(
    router, worker, certs
):
    """weight 2**32 - 1 (the most a uint32 holds) would starve every API key: refused."""
    request = _request()
    request.weight = 2**32 - 1
    async with open_channel(router.address, role_tls(certs, "client")) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Complete(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "weight 4294967295 is out of range (0..1000" in refused.value.details()
        request.weight, request.priority = 0, 11
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Complete(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_client_certificate_queues_at_its_configured_standing_not_its_requests(
    certs, redis_server
):
    """The one slot is taken; the client's request, claiming tier gold and the top weight and
    priority, waits and is served under the tier [internal_callers] gives it."""

    def waited(tier: str) -> float:
        labels = {"tier": tier}
        return REGISTRY.get_sample_value("infermesh_router_queue_wait_seconds_count", labels) or 0

    queue = FairQueueSection(enabled=True, max_wait_s=10)
    async with (
        running_router(redis_url=redis_server.url, certs=certs, fair_queue=queue) as router,
        running_worker(sim_engine(max_parallel=1), router, "w", 1, certs=certs),
        open_channel(router.address, role_tls(certs, "gateway")) as gateway,
        open_channel(router.address, role_tls(certs, "client")) as client,
    ):
        before = waited("internal"), waited("gold")
        holder = router_pb2_grpc.RouterStub(gateway).RouteStream()
        await holder.write(
            router_pb2.RouteStreamRequest(asks=[router_pb2.RouteAsk(id=1, request=_request())])
        )
        assert (await holder.read()).decisions[0].workers[0].worker_id == "w"
        claimed = _request()
        claimed.tier, claimed.weight, claimed.priority = "gold", 1000, 10
        served = router_pb2_grpc.RouterStub(client).Complete(claimed, timeout=10)
        deadline = time.monotonic() + 5
        while not REGISTRY.get_sample_value("infermesh_router_queue_depth", {"tier": "internal"}):
            assert time.monotonic() < deadline, "the client's request never waited as internal"
            await asyncio.sleep(0.01)
        await holder.write(router_pb2.RouteStreamRequest(finished=["w"]))
        assert (await served).finish_reason
        holder.cancel()
    assert (waited("internal"), waited("gold")) == (before[0] + 1, before[1])


def test_the_standing_of_internal_callers_comes_from_the_config(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(
        '[internal_callers]\nweight = 2\n[internal_callers.identities."client/batch"]\n'
        'tier = "batch"\npriority = -5\n'
    )
    callers = load_router_config(str(path)).internal_callers
    assert callers.standing("client/batch") == Standing("batch", 2, -5)
    assert callers.standing("client/other") == Standing("internal", 2, 0)
    path.write_text('[internal_callers.identities."client/batch"]\nweight = 4294967296\n')
    with pytest.raises(ConfigError, match=r"identities.client/batch.weight: must be an integer"):
        load_router_config(str(path))
