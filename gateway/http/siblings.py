"""``[server] processes = N``: the first gateway process starts N - 1 more like itself (same
arguments and environment, one process each) that listen on the same port with SO_REUSEPORT,
and stops them when it stops."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

# Set in a sibling's environment: it starts none of its own.
_SIBLING_ENV = "INFERMESH_GATEWAY_SIBLING"


def start_siblings(count: int) -> list[subprocess.Popen[bytes]]:
    """Starts ``count`` more gateway processes with this one's arguments (none from a
    sibling)."""
    if os.environ.get(_SIBLING_ENV):
        return []
    env = {**os.environ, _SIBLING_ENV: "1"}
    return [
        subprocess.Popen([sys.executable, "-m", "gateway", *sys.argv[1:]], env=env)
        for _ in range(count)
    ]


async def stop_siblings(siblings: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM (each drains as this one does), then SIGKILL what still runs after
    ``timeout_s``."""
    for sibling in siblings:
        if sibling.poll() is None:
            sibling.send_signal(signal.SIGTERM)
    deadline = asyncio.get_running_loop().time() + timeout_s
    for sibling in siblings:
        while sibling.poll() is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if sibling.poll() is None:
            sibling.kill()
            sibling.wait()
