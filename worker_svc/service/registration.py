"""A worker's registration with its routers: what it tells them of itself (``worker_info``), and
``Registration``, which registers it, heartbeats its load and registers it again when a router
forgot it or the engine's measured prefill speed moved."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from infermesh.channels import router_channel_options, several_routers
from infermesh.names import PRECISIONS
from infermesh.pb import common_pb2, router_pb2, router_pb2_grpc
from infermesh.tls import TlsSection, open_channel
from worker_svc.config import WorkerConfig
from worker_svc.engine.api import InferenceEngine
from worker_svc.hardware.gpu_profiles import gpu_kind
from worker_svc.service.server import WorkerServicer

logger = logging.getLogger(__name__)

# How long one registration waits for the router to be reachable before trying again.
_REGISTER_WAIT_S = 5.0
_OTHER_ROUTER_PAUSE_S = 0.05  # after a router of several answered UNAVAILABLE
# A measured prefill speed is told to the router (by registering again, which regroups its fleet)
# when it moved by more than this share from the one told, at most every _PREFILL_TELL_S
_PREFILL_SLACK = 0.25
_PREFILL_TELL_S = 30.0


def worker_info(
    config: WorkerConfig, engine: InferenceEngine, address: str
) -> common_pb2.WorkerInfo:
    """What the worker at ``address`` tells routers of itself: its id, models and capabilities."""
    caps = engine.capabilities
    parallel = config.parallel.resolved(caps.device, caps.device_name)
    return common_pb2.WorkerInfo(
        worker_id=config.server.worker_id or f"worker-{address}",
        address=address,
        models=[config.model.served_name],
        capabilities=common_pb2.Capabilities(
            device=caps.device,
            device_name=caps.device_name,
            compute_capability=caps.compute_capability,
            precision=PRECISIONS[caps.precision],
            memory_total_bytes=caps.memory_total_bytes,
            weight_bytes=caps.weight_bytes,
            max_parallel=parallel.max_parallel,
            decode_tokens_per_second=caps.decode_tokens_per_second,
            prefill_tokens_per_second=caps.prefill_tokens_per_second,
            model_type=caps.model_type,
            index_topk=caps.index_topk,
            gpu_kind=gpu_kind(caps.device, caps.device_name),
            gpu_count=caps.gpu_count,
            tokenizer=engine.text_files.digest,
            engine=config.engine.kind,
            reasoning_format=caps.reasoning_format,
            kv_transfer_bytes_per_token=caps.kv_transfer_bytes_per_token,
            prefill_chunk_tokens=caps.prefill_chunk_tokens,
            role=config.worker.role,
            zone=config.worker.zone,
        ),
    )


class Registration:
    """Registers ``servicer.info`` with the router at ``router_address``, then heartbeats its load
    until cancelled (``run``). Survives a router restart (registers again) and an unreachable
    router: a registration waits for the channel to connect (``wait_for_ready``), and the channel
    retries at least every second (``CHANNEL_OPTIONS``), so the worker is back in routing about a
    second after the router is."""

    def __init__(self, router_address: str, servicer: WorkerServicer, tls: TlsSection) -> None:
        self._router_address = router_address
        self._servicer = servicer
        self._tls = tls
        self._prefill_told_at = -_PREFILL_TELL_S

    def take_prefill_speed(self) -> bool:
        """Puts the engine's measured prefill speed into the servicer's ``info`` when it has moved
        by more than _PREFILL_SLACK from the one in it (an engine's own estimate, or none), at
        most every _PREFILL_TELL_S; True when it did, and the router is to be told."""
        measured = self._servicer.engine.load().prefill_tokens_per_second
        told = self._servicer.info.capabilities.prefill_tokens_per_second
        now = time.monotonic()
        if (
            not measured
            or abs(measured - told) <= _PREFILL_SLACK * told
            or now - self._prefill_told_at < _PREFILL_TELL_S
        ):
            return False
        self._servicer.info.capabilities.prefill_tokens_per_second = measured
        self._prefill_told_at = now
        logger.info("prefill measured at %.0f tokens/s (told %.0f)", measured, told)
        return True

    async def run(self) -> None:
        info = self._servicer.info
        # Another router of a list is asked at once after one answered UNAVAILABLE (it cannot
        # reach the registry): a heartbeat that waited the whole pause would leave little of the
        # TTL (a second's interval, the failed call's Redis timeout, then the pause).
        pause_s = _OTHER_ROUTER_PAUSE_S if several_routers(self._router_address) else None
        options = router_channel_options(self._router_address)
        async with open_channel(self._router_address, self._tls, options) as channel:
            router = router_pb2_grpc.RouterStub(channel)
            registered, interval_s, reported_down = False, 0.0, False
            while True:
                if registered and self.take_prefill_speed():
                    registered = False  # a registration tells the router the new speed
                try:
                    if not registered:
                        reply = await router.Register(
                            router_pb2.RegisterRequest(worker=info, load=self._servicer.load()),
                            timeout=_REGISTER_WAIT_S,
                            wait_for_ready=True,
                        )
                        interval_s = reply.heartbeat_interval_ms / 1000
                        registered = True
                        logger.info(
                            "registered with router %s as %s", self._router_address, info.worker_id
                        )
                    else:
                        reply = await router.Heartbeat(
                            router_pb2.HeartbeatRequest(
                                worker_id=info.worker_id, load=self._servicer.load()
                            ),
                            timeout=_REGISTER_WAIT_S,
                        )
                        registered = reply.registered
                    reported_down = False
                except grpc.aio.AioRpcError as e:
                    registered = False
                    if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                        # another identity holds the id, or the certificate does not name the
                        # address: an operator must act (or the holder's entry expire)
                        logger.error(
                            "router %s refused %s: %s",
                            self._router_address,
                            info.worker_id,
                            e.details(),
                        )
                    elif not reported_down:
                        logger.warning(
                            "router %s unreachable (%s); retrying",
                            self._router_address,
                            e.code().name,
                        )
                        reported_down = True
                    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        # the router answered (e.g. UNAVAILABLE while its Redis is down): no spin
                        await asyncio.sleep(pause_s or min(interval_s or 1.0, 1.0))
                if registered:
                    await asyncio.sleep(interval_s)
