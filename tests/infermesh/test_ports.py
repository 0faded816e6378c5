"""free_port's range: ports drawn in turn, never one a server holds."""

from __future__ import annotations

import os
import socket

import pytest

from infermesh.ports import PORT_RANGE_ENV, free_port, port_in_use


def _first_of_four_free() -> int:
    """A port nothing listens on whose next three are free too, from this process's own
    INFERMESH_PORT_RANGE when it has one: around a port the OS picks, its ephemeral ports come and
    go with other processes' connections (a suite run here found two of the three taken)."""
    low, high = (int(b) for b in os.environ.get(PORT_RANGE_ENV, "20000-30000").split("-"))
    for port in range(low, high - 2):
        if all(port_in_use(p) is None for p in range(port, port + 4)):
            return port
    raise RuntimeError(f"no four free ports in {low}-{high}")


def test_a_range_hands_out_each_port_once_in_turn_skipping_held_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", _first_of_four_free()))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port + 3}")
        drawn = [free_port() for _ in range(3)]
    assert sorted(drawn) == [port + 1, port + 2, port + 3]


def test_a_range_wholly_in_use_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port}")
        with pytest.raises(RuntimeError, match=PORT_RANGE_ENV):
            free_port()
