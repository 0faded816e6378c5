"""free_port's range: ports drawn in turn, never one a server holds."""

from __future__ import annotations

import socket

import pytest

from infermesh.ports import PORT_RANGE_ENV, free_port


def test_a_range_hands_out_each_port_once_in_turn_skipping_held_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
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
