"""Fixtures shared by every test package: real servers on loopback ports."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# grpc's fork handlers kill a child forked while grpc threads run (a redis-server started by a
# fixture after earlier tests' servers) before it can exec. No test forks a process that keeps
# using grpc; set before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# Each pytest-xdist worker draws its servers' ports from a range of its own, below the OS's
# ephemeral ports (32768 up), so that two workers are never handed the same port.
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    _low = 20000 + 3000 * int(worker.removeprefix("gw"))
    os.environ.setdefault("INFERMESH_PORT_RANGE", f"{_low}-{_low + 2999}")

from devtools.chat_model import THINKING_SERVED_PATH
from devtools.redis_server import RedisServer
from devtools.tiny_model import write_tiny_checkpoint
from tests.helpers.checkpoints import written_once
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.config import load as load_worker_config
from worker_svc.model.precision import detect_capabilities, resolve_device
from worker_svc.torch_engine.engine import Engine

_WORKER_TESTS = Path(__file__).resolve().parent / "worker_svc"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests whose arithmetic depends on the worker's CPU dtype: the engine's own tests
    that serve in worker_dtype and those asserting the precision served. `.ci/run` reruns them with
    `-m dtype_sensitive` and the other CPU dtype forced."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if "served_precision" in names or (
            "worker_dtype" in names and item.path.resolve().is_relative_to(_WORKER_TESTS)
        ):
            item.add_marker(pytest.mark.dtype_sensitive)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free port; never a Redis the test did not start."""
    with RedisServer(workdir=tmp_path) as server:
        yield server


@pytest.fixture(scope="session")
def worker_dtype() -> str:
    """The [model] dtype of every engine a test starts without pinning one: "auto" (what the policy
    picks for this machine) unless INFERMESH_WORKER_MODEL_DTYPE forces one (the e2e mesh hands it to
    its worker processes); .ci/run reruns the tests that use it with the CPU dtype the policy does
    not pick."""
    return load_worker_config(None).model.dtype


@pytest.fixture(scope="session")
def served_precision(worker_dtype: str) -> str:
    """The precision those engines run: the policy's decision for this machine under
    worker_dtype."""
    return detect_capabilities(resolve_device(), dtype=worker_dtype).precision


@pytest.fixture(scope="session")
def tiny_engine(worker_dtype: str) -> Iterator[Engine]:
    """The engine on the tiny default model, shared by the tests that serve it."""
    yield from _engine_on(Path(DEFAULT_MODEL_PATH), worker_dtype)


@pytest.fixture(scope="session")
def r1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint as DeepSeek-R1: the think tags and R1's chat template."""
    return written_once(
        tmp_path_factory, "r1", lambda out: write_tiny_checkpoint(out, reasoning="r1")
    )


@pytest.fixture(scope="session")
def v31_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint as DeepSeek-V3.1: the think tags and V3.1's chat template."""
    return written_once(
        tmp_path_factory, "v31", lambda out: write_tiny_checkpoint(out, reasoning="v31")
    )


def _engine_on(model_dir: Path, dtype: str) -> Iterator[Engine]:
    engine = Engine.from_checkpoint(model_dir, dtype=dtype)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def r1_engine(r1_dir: Path, worker_dtype: str) -> Iterator[Engine]:
    """The torch engine on the tiny R1, a module's own."""
    yield from _engine_on(r1_dir, worker_dtype)


@pytest.fixture(scope="module")
def v31_engine(v31_dir: Path, worker_dtype: str) -> Iterator[Engine]:
    """The torch engine on the tiny V3.1, a module's own."""
    yield from _engine_on(v31_dir, worker_dtype)


@pytest.fixture(scope="module")
def thinking_chat_engine(worker_dtype: str) -> Iterator[Engine]:
    """The torch engine on the default chat model's thinking variant (`make model` puts it
    there), a module's own."""
    yield from _engine_on(Path(THINKING_SERVED_PATH), worker_dtype)
