"""The throwaway redis-server of tests and `make run`: a port another process took is
chosen again, a given one is not, and a start that fails says what Redis said."""

from __future__ import annotations

import socket

import pytest

from devtools.redis_server import RedisServer, redis_reachable
from infermesh.ports import free_port


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_chosen_port_taken_meanwhile_is_chosen_again(tmp_path, taken_port):
    picks = iter([taken_port, free_port()])
    with RedisServer(workdir=tmp_path, pick_port=lambda: next(picks)) as server:
        assert server.port != taken_port and redis_reachable(server.url)


def test_a_given_port_that_is_taken_fails_saying_why(tmp_path, taken_port):
    with pytest.raises(RuntimeError, match="Address already in use"):
        RedisServer(taken_port, tmp_path).start()
