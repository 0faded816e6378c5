"""The gateway calling its own API from inside its process: the batch runner's lines
(``gateway.batches.runner``) are requests to this process's own routes, so that they cross the
same validation, limits, router path and settlement as live traffic.

Each gateway process serves its app on one more site: a Unix socket in a directory only its user
may enter, which this process alone knows. A request over it that carries ``LOOPBACK_HEADER``
with this process's random token is the runner's (``Loopback.admits``); the API key it acts for
is named by its id, never by a plaintext the gateway does not keep.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
import shutil
import tempfile
from pathlib import Path

from aiohttp import web

LOOPBACK_HEADER = "x-infermesh-loopback"
BATCH_KEY_HEADER = "x-infermesh-batch-key"  # the id of the key a batch line acts for
_SOCKET_NAME = "gateway.sock"


@dataclasses.dataclass
class Loopback:
    """This process's own socket and token; ``path`` is empty until the socket is served."""

    token: str = dataclasses.field(default_factory=lambda: secrets.token_urlsafe(32))
    path: str = ""

    def admits(self, request: web.BaseRequest) -> bool:
        """Whether ``request`` came over this process's socket with its token."""
        presented = request.headers.get(LOOPBACK_HEADER, "")
        over_socket = request.transport is not None and isinstance(
            request.transport.get_extra_info("sockname"), str
        )
        return over_socket and hmac.compare_digest(presented.encode(), self.token.encode())

    async def serve(self, runner: web.BaseRunner) -> None:
        """Serves ``runner``'s app on a new Unix socket (a fresh directory, mode 0700)."""
        directory = tempfile.mkdtemp(prefix="infermesh-gateway-")
        path = str(Path(directory) / _SOCKET_NAME)
        await web.UnixSite(runner, path).start()
        self.path = path

    def close(self) -> None:
        if self.path:
            shutil.rmtree(Path(self.path).parent, ignore_errors=True)
            self.path = ""
