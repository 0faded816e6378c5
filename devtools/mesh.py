"""Starts the services of a mesh as child processes on loopback ports: the
router, the workers and the gateway. ``make run`` uses it in the
foreground; the end-to-end tests use it to test the real processes. With a certificate
directory (``MeshSpec.certs``) every gRPC hop is mutual TLS, the certificates written there on
first start (``devtools.certs``); without one, plaintext."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import grpc

from devtools.certs import role_tls, write_certs
from devtools.processes import stop_with_parent
from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key_at
from infermesh.pb import router_pb2, router_pb2_grpc
from infermesh.ports import free_port
from infermesh.probe import grpc_serving, http_ok
from infermesh.tls import TlsSection, open_blocking_channel

logger = logging.getLogger(__name__)

_POLL_S = 0.1
_STOP_TIMEOUT_S = 10.0
_START_TIMEOUT_S = 120.0
_RESERVED_CORES_VAR = "INFERMESH_WORKER_ENGINE_RESERVED_CORES"


def dev_worker_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The dev mesh's worker settings (`make run`, bench/thread_policy.py): torch computes on the
    cores left after two for the gateway, the router and Redis, and a load generator on the same
    machine (docs/benchmarks/thread-policy.md); a value in ``environ`` wins."""
    return {_RESERVED_CORES_VAR: environ.get(_RESERVED_CORES_VAR, "2")}


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    redis_url: str
    model_path: str
    gateway_port: int
    router_port: int
    worker_ports: tuple[int, ...]  # one worker per port; empty: no worker
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # extra, for every child
    # extra for worker i only (e.g. a simulated GPU kind); fewer than the workers: none
    worker_env: tuple[Mapping[str, str], ...] = ()
    log_dir: Path | None = None  # None: children write to this process's output
    # where the CA and the roles' certificates are (written on start if not valid); None:
    # the services run without TLS, trusting every caller
    certs: Path | None = None
    # more routers, active-active on the same registry; every worker and gateway dials them all
    extra_router_ports: tuple[int, ...] = ()
    # extra for router i only (e.g. its metrics port); fewer than the routers: none
    router_env: tuple[Mapping[str, str], ...] = ()

    def tls(self, role: str) -> TlsSection:
        """The [tls] of a service or caller in ``role`` (gateway, router, worker, client,
        admin) of this mesh."""
        return TlsSection(plaintext=True) if self.certs is None else role_tls(self.certs, role)

    def tls_env(self, service: str, role: str) -> dict[str, str]:
        """The variables giving ``service`` (gateway, router, worker) ``role``'s [tls]."""
        tls = self.tls(role)
        prefix = f"INFERMESH_{service.upper()}_TLS"
        if tls.plaintext:
            return {f"{prefix}_PLAINTEXT": "true"}
        return {
            f"{prefix}_CERT_FILE": tls.cert_file,
            f"{prefix}_KEY_FILE": tls.key_file,
            f"{prefix}_CA_FILE": tls.ca_file,
        }

    @property
    def router_address(self) -> str:
        """The first router's."""
        return f"127.0.0.1:{self.router_port}"

    @property
    def router_ports(self) -> tuple[int, ...]:
        return (self.router_port, *self.extra_router_ports)

    @property
    def router_names(self) -> list[str]:
        """The routers' service names: "router", then "router2", ..."""
        return ["router", *(f"router{i}" for i in range(2, len(self.extra_router_ports) + 2))]

    def router_target(self, first: int = 0) -> str:
        """What the workers and gateways dial: the router, or every router (a gRPC list, whose
        calls go round robin to the routers that say SERVING: infermesh.channels), router
        ``first`` listed first."""
        if not self.extra_router_ports:
            return self.router_address
        ports = self.router_ports[first:] + self.router_ports[:first]
        return "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}/v1"


class ServiceExited(RuntimeError):
    """A child process ended while the mesh was expected to run."""


class Mesh:
    """The running child processes of one :class:`MeshSpec`."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._logs: list[IO[bytes]] = []
        self._commands: dict[str, tuple[str, Mapping[str, str]]] = {}  # name -> module, env

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> Mesh:
        """Starts router, workers, gateway; returns once each answers and every
        worker is registered."""
        deadline = time.monotonic() + timeout_s
        if self.spec.certs is not None:
            write_certs(self.spec.certs)
        try:
            routers = zip(self.spec.router_names, self.spec.router_ports, strict=True)
            for i, (name, port) in enumerate(routers):
                router_env = {
                    **self.spec.tls_env("router", "router"),
                    "INFERMESH_ROUTER_SERVER_PORT": str(port),
                    "INFERMESH_ROUTER_REDIS_URL": self.spec.redis_url,
                    # a registry of its own, should meshes share a Redis; one for its routers
                    "INFERMESH_ROUTER_REDIS_KEY_PREFIX": (
                        f"infermesh:router:{self.spec.router_port}:"
                    ),
                    **(self.spec.router_env[i] if i < len(self.spec.router_env) else {}),
                }
                self._spawn(name, "router_svc", router_env)
                self._wait(deadline, name, functools.partial(self._router_serving, port))
            for i, port in enumerate(self.spec.worker_ports):
                self._spawn(
                    f"worker{i}",
                    "worker_svc",
                    {
                        **self.spec.tls_env("worker", "worker"),
                        "INFERMESH_WORKER_SERVER_PORT": str(port),
                        "INFERMESH_WORKER_ROUTER_ADDRESS": self.spec.router_target(),
                        "INFERMESH_WORKER_MODEL_PATH": self.spec.model_path,
                        **(self.spec.worker_env[i] if i < len(self.spec.worker_env) else {}),
                    },
                )
            self.add_gateway("gateway", self.spec.gateway_port, deadline=deadline)
            self._wait(deadline, "workers", self._workers_registered)
        except BaseException:
            self.stop()
            raise
        return self

    def add_gateway(
        self,
        name: str,
        port: int,
        env: Mapping[str, str] | None = None,
        *,
        deadline: float | None = None,
    ) -> None:
        """Starts a gateway on ``port`` in front of this mesh's router and Redis (``env``: its
        own extra variables, e.g. another config); returns once it answers."""
        self._spawn(
            name,
            "gateway",
            {
                **self.spec.tls_env("gateway", "gateway"),
                "INFERMESH_GATEWAY_SERVER_PORT": str(port),
                "INFERMESH_GATEWAY_REDIS_URL": self.spec.redis_url,
                "INFERMESH_GATEWAY_ROUTER_ADDRESS": self.spec.router_target(),
                **(env or {}),
            },
        )
        self._wait(
            time.monotonic() + _START_TIMEOUT_S if deadline is None else deadline,
            name,
            lambda: http_ok(f"http://127.0.0.1:{port}/health"),
        )

    def pid(self, name: str) -> int:
        """The process id of a service by its name ("router", "worker0", "gateway", ...)."""
        return next(proc.pid for service, proc in self._procs if service == name)

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Sends ``sig`` to a service: SIGKILL a crash, SIGSTOP a freeze, SIGCONT its end."""
        os.kill(self.pid(name), sig)

    def kill(self, name: str) -> None:
        """Kills a service (SIGKILL, as a crash would end it) and waits for its end."""
        proc = next(proc for service, proc in self._procs if service == name)
        proc.kill()
        proc.wait()
        self._procs.remove((name, proc))

    def respawn(self, name: str) -> None:
        """Starts a killed service again as it was first started (same port and variables);
        returns without waiting for it to answer."""
        assert all(service != name for service, _ in self._procs), f"{name} still runs"
        module, env = self._commands[name]
        self._spawn(name, module, env)

    def check_alive(self) -> None:
        for name, proc in self._procs:
            if proc.poll() is not None:
                raise ServiceExited(f"{name} exited with code {proc.returncode}")

    def stop(self) -> None:
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        try:
            for name, proc in reversed(self._procs):
                try:
                    proc.wait(timeout=_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in %.0f s; killing it", name, _STOP_TIMEOUT_S)
                    proc.kill()
                    proc.wait()
        except KeyboardInterrupt:  # a second Ctrl-C: no waiting for a clean stop
            logger.warning(
                "interrupted again: killing %s",
                ", ".join(name for name, proc in self._procs if proc.poll() is None),
            )
            for _, proc in self._procs:
                proc.kill()
                proc.wait()
            raise
        finally:
            self._procs.clear()
            self._close_logs()

    def _close_logs(self) -> None:
        for log in self._logs:
            log.close()
        self._logs.clear()

    def log(self, name: str) -> str:
        """What a child wrote so far (only with a log_dir)."""
        assert self.spec.log_dir is not None, "the mesh was started without a log_dir"
        return (self.spec.log_dir / f"{name}.log").read_text(errors="replace")

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, module: str, env: Mapping[str, str]) -> None:
        self._commands[name] = (module, env)
        output: IO[bytes] | None = None
        if self.spec.log_dir is not None:
            output = (self.spec.log_dir / f"{name}.log").open("ab")
            self._logs.append(output)
        child_env = {**os.environ, **self.spec.env, **env}
        proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=child_env,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
            # Own process group: Ctrl-C reaches only this process,
            # which stops the services in order.
            process_group=0,
            preexec_fn=stop_with_parent,
        )
        self._procs.append((name, proc))

    def _wait(self, deadline: float, what: str, ready: Callable[[], bool]) -> None:
        while not ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready in time")
            time.sleep(_POLL_S)

    def _router_serving(self, port: int) -> bool:
        return grpc_serving(f"127.0.0.1:{port}", tls=self.spec.tls("admin"))

    def _workers_registered(self) -> bool:
        try:
            with open_blocking_channel(self.spec.router_address, self.spec.tls("admin")) as channel:
                reply = router_pb2_grpc.RouterStub(channel).ListWorkers(
                    router_pb2.ListWorkersRequest(), timeout=1
                )
        except grpc.RpcError:  # a router slow to answer (a loaded machine): ask again
            return False
        return len(reply.workers) >= len(self.spec.worker_ports)


@contextmanager
def one_worker_mesh(
    model_path: str, key_name: str, env: Mapping[str, str] | None = None
) -> Iterator[tuple[Mesh, str]]:
    """A bench's mesh: its own Redis, a router, one worker on ``model_path`` and a gateway as
    processes, untraced and logging warnings only unless ``env`` says otherwise; yields it, started,
    and a key named ``key_name``."""
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=Path(workdir)) as redis:
        spec = MeshSpec(
            redis_url=redis.url,
            model_path=model_path,
            gateway_port=free_port(),
            router_port=free_port(),
            worker_ports=(free_port(),),
            log_dir=Path(workdir),
            env={"OTEL_SDK_DISABLED": "true", "INFERMESH_LOG_LEVEL": "WARNING", **(env or {})},
        )
        with Mesh(spec) as mesh:
            yield mesh, asyncio.run(create_key_at(redis.url, key_name))
