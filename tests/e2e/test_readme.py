"""Every shell command of README.md, run as written against a real mesh set up as `make run`
sets up its own (mutual TLS with the certificates in `.certs/`, the gateway's admin token and
agents' model aliases), from a directory laid out as the repository is (`.certs/`, `models/`).

The mesh is a router and a gateway only: the README's "one more worker" command is its worker,
so the test loads no model besides the one the README starts (and leaves no dead worker in the
registry of the session's shared mesh). The variables the README has the reader export with
`make run`'s addresses and credentials get this mesh's instead, each checked to be what `make run`
prints; every other line runs as written."""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from devtools.chat_model import SERVED_PATH
from devtools.main import dev_gateway_env
from devtools.mesh import Mesh, MeshSpec
from infermesh.pb import router_pb2, router_pb2_grpc
from infermesh.ports import free_port
from infermesh.tls import open_blocking_channel
from tests.helpers.e2e import new_key

_ROOT = Path(__file__).parents[2]
_README = _ROOT / "README.md"
_ADMIN_TOKEN = "readme-admin-token-0123456789abcdef"
_COMMAND_TIMEOUT_S = 60.0
_WORKER_START_TIMEOUT_S = 90.0
_WORKER_STOP_TIMEOUT_S = 15.0

# What the README shows, and why the test does not run it (each must still be in the README).
NOT_RUN = {
    "make run": "the dev mesh on fixed ports, in the foreground until Ctrl-C: it runs "
    "`python -m infermesh run`, which tests/e2e/test_run.py starts, calls, stops and restarts",
    "make test": "the whole suite, this test included: what CI (.ci/run) runs",
    "python -m infermesh run --model /data/DeepSeek-V3": "needs a real checkpoint; "
    "`python -m infermesh run` is tests/e2e/test_run.py's, a worker's `[model] path` the worker "
    "command's below",
}
# The command the README starts a server with: run in the background until it serves.
_WORKER_COMMAND = "python -m worker_svc"

_BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```", re.S | re.M)
_ERROR_KEY = re.compile(r'(?<!\\)"error"\s*:')  # a JSON error, not the word in generated text


def _blocks(language: str) -> list[str]:
    return [m.group(2) for m in _BLOCK.finditer(_README.read_text()) if m.group(1) == language]


def _commands(block: str) -> list[str]:
    """The block's commands: a line ending in a backslash or inside open quotes joins the next."""
    commands: list[str] = []
    pending = ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote
            continue
        if pending.endswith("\\"):
            continue
        if shlex.split(pending, comments=True):
            commands.append(pending)
        pending = ""
    assert not pending, f"README: an unfinished command: {pending!r}"
    return commands


def _calls_model(command: str) -> bool:
    return "_BASE_URL" in command


def _words(command: str) -> str:
    return " ".join(shlex.split(command, comments=True))


def _all_commands() -> list[list[str]]:
    return [_commands(block) for block in _blocks("sh")]


def test_the_commands_not_run_are_in_the_readme():
    shown = {_words(c) for block in _all_commands() for c in block}
    assert set(NOT_RUN) <= shown, f"NOT_RUN lists commands the README no longer has: {NOT_RUN}"


@pytest.fixture(scope="module")
def readme_mesh(e2e_redis, tmp_path_factory) -> Iterator[tuple[Mesh, Path]]:
    """A router and a gateway as `make run` starts them, no worker, and the directory to run the
    README's commands in."""
    home = tmp_path_factory.mktemp("readme")
    (home / "models").symlink_to(_ROOT / "models")
    spec = MeshSpec(
        redis_url=e2e_redis.url,
        model_path="",
        gateway_port=free_port(),
        router_port=free_port(),
        worker_ports=(),
        env={"OTEL_SDK_DISABLED": "true", **dev_gateway_env(Path(SERVED_PATH).name, _ADMIN_TOKEN)},
        log_dir=home,
        certs=home / ".certs",
    )
    with Mesh(spec) as mesh:
        yield mesh, home


def _exports(command: str, provided: dict[str, tuple[str, str]]) -> dict[str, str]:
    """The variables an `export` line sets: as written, or this mesh's value where the README
    gives `make run`'s (checked to be what `make run` prints)."""
    exported = {}
    for assignment in shlex.split(command, comments=True)[1:]:
        name, _, value = assignment.partition("=")
        if name in provided:
            shown, ours = provided[name]
            assert value == shown, f"README: export {name}={value}, `make run` gives {shown}"
            value = ours
        exported[name] = value
    return exported


def _run(command: str, env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        ["bash", "-c", command],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=_COMMAND_TIMEOUT_S,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"README: `{command}` exited {done.returncode}:\n{out[-3000:]}"
    assert done.stdout.strip(), f"README: `{command}` printed nothing:\n{out[-3000:]}"
    assert not _ERROR_KEY.search(done.stdout), f"README: `{command}` answered an error:\n{out}"
    return done.stdout


def _worker_listed(mesh: Mesh, port: int) -> bool:
    with open_blocking_channel(mesh.spec.router_address, mesh.spec.tls("admin")) as channel:
        reply = router_pb2_grpc.RouterStub(channel).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=5
        )
    return any(w.worker.address.endswith(f":{port}") for w in reply.workers)


@contextmanager
def _server(command: str, env: dict[str, str], cwd: Path) -> Iterator[subprocess.Popen[str]]:
    """A command that serves until Ctrl-C, running; Ctrl-C must stop it."""
    server = subprocess.Popen(
        ["bash", "-c", command],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,  # Ctrl-C in its terminal: SIGINT to the shell and what it runs
    )
    try:
        yield server
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(_WORKER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            raise AssertionError(f"README: `{command}` did not stop on Ctrl-C") from None
        finally:
            assert server.stdout is not None  # stdout=PIPE
            server.stdout.close()


def _wait_listed(worker: subprocess.Popen[str], command: str, mesh: Mesh, port: int) -> None:
    deadline = time.monotonic() + _WORKER_START_TIMEOUT_S
    while not _worker_listed(mesh, port):
        if worker.poll() is not None:
            assert worker.stdout is not None  # stdout=PIPE
            raise AssertionError(
                f"README: `{command}` exited {worker.returncode}:\n{worker.stdout.read()[-3000:]}"
            )
        assert time.monotonic() < deadline, f"README: `{command}` did not register in time"
        time.sleep(0.2)


def test_every_readme_command_runs_as_written(readme_mesh, e2e_redis):
    mesh, home = readme_mesh
    key = new_key(e2e_redis.url)
    gateway = f"http://127.0.0.1:{mesh.spec.gateway_port}"
    worker_port = free_port()
    # name: (what the README shows, as `make run` prints it; this mesh's)
    provided = {
        "OPENAI_BASE_URL": ("http://127.0.0.1:8000/v1", f"{gateway}/v1"),
        "OPENAI_API_KEY": ("sk-...", key),
        "ANTHROPIC_BASE_URL": ("http://127.0.0.1:8000", gateway),
        "ANTHROPIC_AUTH_TOKEN": ("sk-...", key),
        "INFERMESH_ADMIN_URL": ("http://127.0.0.1:8000", gateway),
        "INFERMESH_ADMIN_TOKEN": ("...", _ADMIN_TOKEN),
        "INFERMESH_WORKER_ROUTER_ADDRESS": ("127.0.0.1:50051", mesh.spec.router_address),
        "INFERMESH_WORKER_SERVER_PORT": ("50062", str(worker_port)),
    }
    base_env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OTEL_SDK_DISABLED": "true",
    }
    # Each block is one terminal: its exports hold for its later commands. The worker's block
    # runs first, since this mesh has no other worker, then those that need no model (the admin
    # CLI) while it loads, then those that call the model, once it is registered.
    blocks = sorted(
        _all_commands(),
        key=lambda b: (_WORKER_COMMAND not in map(_words, b), any(map(_calls_model, b))),
    )
    ran = []
    with ExitStack() as running:
        worker_ready = None
        for block in blocks:
            env = dict(base_env)
            for command in block:
                words = _words(command)
                if words in NOT_RUN:
                    continue
                if words.startswith("export "):
                    env.update(_exports(command, provided))
                elif words == _WORKER_COMMAND:
                    worker = running.enter_context(_server(command, env, home))
                    worker_ready = functools.partial(
                        _wait_listed, worker, command, mesh, worker_port
                    )
                else:
                    if _calls_model(command):
                        assert worker_ready is not None, f"README: no `{_WORKER_COMMAND}`"
                        worker_ready()
                    _run(command, env, home)
                ran.append(words)
        assert _WORKER_COMMAND in ran, f"README: no `{_WORKER_COMMAND}`"
        assert any(words.startswith("curl") for words in ran)
        # the Python examples (the client, a batch), with the variables the README exported above
        env = {**base_env, **{name: ours for name, (_, ours) in provided.items()}}
        examples = _blocks("python")
        assert len(examples) == 2, "README: the client's and the batch's Python examples"
        for example in examples:
            _run(f"python - <<'EOF'\n{example}EOF", env, home)
