"""Fixtures shared by every test package: real servers on loopback ports."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from infermesh.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free port; never a Redis the test did not start."""
    with RedisServer(workdir=tmp_path) as server:
        yield server
