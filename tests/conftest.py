"""Fixtures shared by every test package: real servers on loopback ports."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

# grpc's fork handlers kill a child forked while grpc threads run (a redis-server started by a
# fixture after earlier tests' servers) before it can exec. No test forks a process that keeps
# using grpc; set before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from infermesh.redis_server import RedisServer
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.engine import Engine


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free port; never a Redis the test did not start."""
    with RedisServer(workdir=tmp_path) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_engine() -> Iterator[Engine]:
    """The engine on the tiny default model, shared by the tests that serve it."""
    engine = Engine.from_checkpoint(DEFAULT_MODEL_PATH)
    yield engine
    asyncio.run(engine.close())
