"""What one gRPC call costs in grpc.aio on this machine, before any of our code runs.

    .venv/bin/python bench/grpc_floor.py [--duration 3] [--concurrency 1 64]

A server process on core 0 answers infermesh.v1.Worker with no work at all (Complete: a
unary reply of 16 tokens; Generate: the same as one streamed message);
a client process on core 1 calls it closed-loop. Prints calls/s and the CPU microseconds
per call of each side, on asyncio's default loop and on uvloop. These are floors for the
mesh: a request through the gateway makes two such calls (Router.Route, then
Worker.Complete or Worker.Generate) and the router serves one.
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

import grpc
import psutil
import uvloop

from infermesh.pb import common_pb2, worker_pb2_grpc
from infermesh.ports import free_port

_SERVER_CORE, _CLIENT_CORE = 0, 1


class _Idle(worker_pb2_grpc.WorkerServicer):
    async def Generate(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.GenerateResponse],
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        yield common_pb2.GenerateResponse(
            text="x" * 64, token_ids=range(16), finish_reason=common_pb2.FINISH_REASON_LENGTH
        )

    async def Complete(
        self,
        request: common_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[common_pb2.GenerateRequest, common_pb2.GenerateResponse],
    ) -> common_pb2.GenerateResponse:
        return common_pb2.GenerateResponse(
            text="x" * 64, token_ids=range(16), finish_reason=common_pb2.FINISH_REASON_LENGTH
        )


async def _serve(port: int) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(_Idle(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _call(
    address: str, rpc: str, concurrency: int, duration_s: float, server: psutil.Process
) -> tuple[float, float, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = common_pb2.GenerateRequest(model="m", prompt="hello")
        calls = 0

        async def client(until: float) -> None:
            nonlocal calls
            while time.perf_counter() < until:
                if rpc == "unary":
                    await stub.Complete(request)
                else:
                    async for _ in stub.Generate(request):
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
