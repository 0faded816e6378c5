"""Which served models reason: each model's reasoning format as its workers report it
(Capabilities.reasoning_format: "" it does not reason, "deepseek_r1" it always thinks,
"deepseek_v3" it thinks when a request's ``thinking`` is set), learnt from the router's
ListWorkers. It is looked up only for a request asking to reason where its API refuses that of a
model that cannot (chat's ``reasoning_effort``, Messages' ``thinking``), at most once every
``REFRESH_S``."""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.http.errors import GatewayError
from gateway.mesh.client import MeshClient
from infermesh.fleet_view import per_model
from infermesh.pb import router_pb2

logger = logging.getLogger(__name__)

REFRESH_S = 10.0


class ReasoningFormats:
    """The fleet's reasoning formats per served model; safe to share across requests."""

    def __init__(self, mesh: MeshClient) -> None:
        self._mesh = mesh
        self._formats: dict[str, str] = {}
        self._looked_at = -float("inf")  # monotonic time of the last ListWorkers
        self._lock = asyncio.Lock()  # one look at a time, which the requests waiting share

    async def of(self, model: str) -> str | None:
        """``model``'s format; None when no worker of it is known (or the router cannot be
        asked): the request then goes on, and the mesh answers it as it can."""
        async with self._lock:
            if time.monotonic() - self._looked_at >= REFRESH_S:
                self._looked_at = time.monotonic()
                try:
                    self._formats = fleet_formats(await self._mesh.list_workers())
                except GatewayError as e:
                    logger.warning("could not list workers to learn their reasoning: %s", e)
        return self._formats.get(model)


def fleet_formats(workers: list[router_pb2.WorkerStatus]) -> dict[str, str]:
    """Per served model the format most of its workers that reason report; "" where none does."""
    every_model = {model: "" for status in workers for model in status.worker.models}
    return every_model | per_model(workers, lambda info: info.capabilities.reasoning_format or None)
