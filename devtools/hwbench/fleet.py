"""The fleet as the gateway's admin API lists it (``GET /admin/fleet``), summed up per GPU kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from infermesh.redact import redact_url

_TIMEOUT_S = 10.0


class FleetError(RuntimeError):
    """The admin API could not be read."""


@dataclass(frozen=True)
class Kind:
    """The workers of one GPU kind serving the model."""

    name: str
    workers: int
    gpus_per_worker: int
    precision: str
    memory_total_bytes: int  # per worker
    memory_used_bytes: int  # the most any of its workers reported


class AdminClient:
    def __init__(self, admin_url: str, token: str) -> None:
        self._url = admin_url.rstrip("/") + "/admin/fleet"
        self._headers = {"Authorization": f"Bearer {token}"}
        self._session: aiohttp.ClientSession | None = None

    async def workers(self) -> list[dict[str, Any]]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S))
        try:
            async with self._session.get(self._url, headers=self._headers) as response:
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise FleetError(
                f"cannot read the fleet from {redact_url(self._url)}: {type(e).__name__} {e}"
            ) from None
        if response.status != 200:
            message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
            where = redact_url(self._url)
            raise FleetError(f"the admin API at {where} answered {response.status}: {message}")
        data: list[dict[str, Any]] = body["data"]
        return data

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def kinds_serving(workers: list[dict[str, Any]], model: str) -> dict[str, Kind]:
    """Per GPU kind, the workers serving ``model``."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        if model in w["models"]:
            by_kind.setdefault(w["gpu_kind"], []).append(w)
    return {
        kind: Kind(
            kind,
            len(ws),
            max(w["gpu_count"] for w in ws),
            "/".join(sorted({w["precision"] for w in ws})),
            max(w["memory_total_bytes"] for w in ws),
            max(w["memory_used_bytes"] for w in ws),
        )
        for kind, ws in sorted(by_kind.items())
    }
