"""What one gRPC call costs in grpc.aio on this machine, before any of our code runs.

    .venv/bin/python bench/grpc_floor.py [--duration 3] [--concurrency 1 64]

A server process on core 0 answers a bench service's two methods with no work at all (Unary:
a reply of 16 tokens, the mesh's GenerateResponse; Stream: the same as one streamed message);
a client process on core 1 calls it closed-loop. Prints calls/s and the CPU microseconds
per call of each side, on asyncio's default loop and on uvloop: the floor of a call, the
cost the mesh's long-lived streams (RouteStream, Worker.Serve) spread over many requests.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import psutil
import uvloop

from infermesh.pb import common_pb2
from infermesh.ports import free_port

_SERVER_CORE, _CLIENT_CORE = 0, 1
_SERVICE = "infermesh.bench.Floor"
_REPLY = common_pb2.GenerateResponse(
    text="x" * 64, token_ids=range(16), finish_reason=common_pb2.FINISH_REASON_LENGTH
)


async def _unary(
    request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
) -> common_pb2.GenerateResponse:
    return _REPLY


async def _stream(
    request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[common_pb2.GenerateResponse]:
    yield _REPLY


async def _serve(port: int) -> None:
    server = grpc.aio.server()
    coding: dict[str, Any] = {
        "request_deserializer": common_pb2.GenerateRequest.FromString,
        "response_serializer": common_pb2.GenerateResponse.SerializeToString,
    }
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, **coding),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, **coding),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _call(
    address: str, rpc: str, concurrency: int, duration_s: float, server: psutil.Process
) -> tuple[float, float, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        coding: dict[str, Any] = {
            "request_serializer": common_pb2.GenerateRequest.SerializeToString,
            "response_deserializer": common_pb2.GenerateResponse.FromString,
        }
        unary = channel.unary_unary(f"/{_SERVICE}/Unary", **coding)
        stream = channel.unary_stream(f"/{_SERVICE}/Stream", **coding)
        request = common_pb2.GenerateRequest(model="m", prompt="hello")
        calls = 0

        async def client(until: float) -> None:
            nonlocal calls
            while time.perf_counter() < until:
                if rpc == "unary":
                    await unary(request)
                else:
                    async for _ in stream(request):
                        pass
                calls += 1

        warm_until = time.perf_counter() + 1.0
        await asyncio.gather(*(client(warm_until) for _ in range(concurrency)))
        calls = 0
        server_before, client_before = sum(server.cpu_times()[:2]), time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*(client(started + duration_s) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        return (
            calls / elapsed,
            (time.process_time() - client_before) / calls * 1e6,
            (sum(server.cpu_times()[:2]) - server_before) / calls * 1e6,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server child's port
    parser.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="asyncio", help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    run = uvloop.run if args.loop == "uvloop" else asyncio.run
    if args.serve:
        os.sched_setaffinity(0, {_SERVER_CORE})
        run(_serve(args.serve))
        return 0
    os.sched_setaffinity(0, {_CLIENT_CORE})
    print(
        f"python {sys.version.split()[0]}, grpcio {grpc.__version__}, "
        f"uvloop {importlib.metadata.version('uvloop')}; "
        f"server on core {_SERVER_CORE}, client on core "
        f"{_CLIENT_CORE}, {args.duration:.0f} s per point"
    )
    print(
        f"{'loop':<8} {'rpc':<7} {'c':>3} {'calls/s':>8} "
        f"{'client us/call':>15} {'server us/call':>15}"
    )
    for loop in ("asyncio", "uvloop"):
        port = free_port()
        child = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--loop", loop])
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                grpc.channel_ready_future(channel).result(timeout=30)
            server = psutil.Process(child.pid)
            for rpc in ("unary", "stream"):
                for concurrency in args.concurrency:
                    rate, client_us, server_us = (uvloop.run if loop == "uvloop" else asyncio.run)(
                        _call(f"127.0.0.1:{port}", rpc, concurrency, args.duration, server)
                    )
                    print(
                        f"{loop:<8} {rpc:<7} {concurrency:>3} {rate:>8.0f} {client_us:>15.0f} "
                        f"{server_us:>15.0f}",
                        flush=True,
                    )
        finally:
            child.terminate()
            child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
