"""Whether a loopback port is free for a service to listen on, and who holds it if not;
a free one to listen on."""

from __future__ import annotations

import itertools
import os
import random
import socket

import psutil

# "LO-HI": free_port draws from these ports instead of the OS's; processes that start servers side
# by side (pytest-xdist's workers) each take a range of their own, so that none is handed a port
# another just drew (gRPC servers bind with SO_REUSEPORT: two would share it silently)
PORT_RANGE_ENV = "INFERMESH_PORT_RANGE"
_drawn = itertools.count(random.randrange(1 << 16))  # this process's turn through the range


def port_in_use(port: int, host: str = "127.0.0.1") -> str | None:
    """None when a server could listen on ``host:port`` now; else what holds it.

    Binds with SO_REUSEADDR, as aiohttp and gRPC servers do: connections of a finished run
    waiting out TIME-WAIT do not stop a new listener, so they must not make the port look
    taken. Only another socket bound to the port does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return _holder(port)
    return None


def free_port() -> int:
    """A loopback port nothing listens on now: the OS picks it, or the next of
    INFERMESH_PORT_RANGE that nothing listens on (in turn, so that a process is not handed one
    port twice before its first taker binds it)."""
    if bounds := os.environ.get(PORT_RANGE_ENV):
        low, high = (int(b) for b in bounds.split("-"))
        for _ in range(high - low + 1):
            drawn = low + next(_drawn) % (high - low + 1)
            if port_in_use(drawn) is None:
                return drawn
        raise RuntimeError(f"{PORT_RANGE_ENV}={bounds}: every port of the range is in use")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _holder(port: int) -> str:
    """ "pid 123 (python -m gateway)" of the process listening on ``port``, when this user may
    see it."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        connections = []
    pids = {
        c.pid
        for c in connections
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid
    }
    for pid in sorted(pids):
        try:
            command = " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
        except psutil.Error:
            continue
        return f"pid {pid} ({command[:120]})"
    return "a process this user cannot see"
