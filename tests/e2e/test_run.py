"""``python -m infermesh run`` (``make run``) as a user runs it: start, serve (its gRPC hops
over mutual TLS, an internal client calling with the certificates it wrote), Ctrl-C, start
again at once on the same ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import psutil

from devtools.certs import role_tls
from devtools.chat_model import SERVED_PATH
from infermesh.pb import router_pb2, router_pb2_grpc
from infermesh.ports import free_port, port_in_use
from infermesh.probe import grpc_serving
from infermesh.tls import open_blocking_channel

# `make run` serves the trained chat model, under its directory's name
MODEL = Path(SERVED_PATH).name
_START_TIMEOUT_S = 90.0
_STOP_TIMEOUT_S = 15.0


@contextmanager
def dev_mesh(
    redis_url: str, ports: tuple[int, int, int]
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The runner, and the API key it printed once the mesh answered."""
    gateway, router, worker = ports
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infermesh",
            "run",
            "--gateway-port",
            str(gateway),
            "--router-port",
            str(router),
            "--worker-port",
            str(worker),
        ],
        env={**os.environ, "REDIS_URL": redis_url, "OTEL_SDK_DISABLED": "true"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield runner, _printed_key(runner)
    finally:
        if runner.poll() is None:
            runner.send_signal(signal.SIGINT)
            runner.wait(_STOP_TIMEOUT_S)
        assert runner.stdout is not None  # stdout=PIPE
        runner.stdout.close()


def _printed_key(runner: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + _START_TIMEOUT_S
    seen = []
    assert runner.stdout is not None  # stdout=PIPE
    for line in runner.stdout:
        seen.append(line)
        if line.startswith("OPENAI_API_KEY="):
            return line.strip().split("=", 1)[1]
        assert time.monotonic() < deadline, "the mesh did not start in time"
    raise AssertionError(f"the runner exited ({runner.wait()}):\n{''.join(seen[-30:])}")


def client(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60
    )


def chat(client: openai.OpenAI) -> str:
    """A served completion's finish reason: "length", or "stop" where the sampled tokens hit EOS."""
    completion = client.chat.completions.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    return completion.choices[0].finish_reason


def test_run_again_at_once_on_the_same_ports_serves_and_a_second_ctrl_c_leaves_nothing(e2e_redis):
    ports = (free_port(), free_port(), free_port())
    with dev_mesh(e2e_redis.url, ports) as (runner, key), client(ports[0], key) as first:
        assert {chat(first) for _ in range(3)} <= {"length", "stop"}
        services = runner_children(runner)
        assert len(services) == 3
        router = f"127.0.0.1:{ports[1]}"
        assert not grpc_serving(router)  # no certificate: no connection
        with open_blocking_channel(router, role_tls(Path(".certs"), "client")) as channel:
            listed = router_pb2_grpc.RouterStub(channel).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=10
            )
        assert len(listed.workers) == 1
        # The client keeps its connection: the gateway closes it, which leaves it in
        # TIME-WAIT on the gateway's port.
        runner.send_signal(signal.SIGINT)
        assert runner.wait(_STOP_TIMEOUT_S) == 0
        assert "Traceback" not in runner.stdout.read()
    assert [p for p in ports if port_in_use(p)] == []
    assert psutil.wait_procs(services, timeout=0)[1] == []
    assert any(
        c.laddr.port == ports[0] and c.status == psutil.CONN_TIME_WAIT
        for c in psutil.net_connections(kind="tcp")
    )

    with dev_mesh(e2e_redis.url, ports) as (runner, key), client(ports[0], key) as second:
        assert chat(second) in ("length", "stop")
        services = runner_children(runner)
        runner.send_signal(signal.SIGINT)
        time.sleep(0.05)
        runner.send_signal(signal.SIGINT)  # impatient: no clean stop, but nothing left running
        assert runner.wait(_STOP_TIMEOUT_S) == 0
        assert "Traceback" not in runner.stdout.read()
    assert psutil.wait_procs(services, timeout=0)[1] == []
    assert [p for p in ports if port_in_use(p)] == []


def test_a_port_another_process_listens_on_is_refused_naming_it(e2e_redis):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "infermesh", "run", "--gateway-port", str(port)],
            env={**os.environ, "REDIS_URL": e2e_redis.url},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 1
    assert f"port {port} is in use by pid {os.getpid()} (" in run.stderr


def runner_children(runner: subprocess.Popen[str]) -> list[psutil.Process]:
    return psutil.Process(runner.pid).children(recursive=True)
