"""Native memory that grpc.aio keeps per streaming call whose reader is cancelled mid-read.

    .venv/bin/python bench/grpc_cancelled_reads.py [--calls 30000] [--concurrency 64]

One process serves a stream of 16 chunks 2 ms apart and calls it; each call's reader is a
task cancelled after the first chunk, while its next read is in flight (what a client
dropping a streamed response does to the gateway's handler). Modes, each in a fresh
process: ``drained`` reads every chunk (the reference), ``abandoned`` iterates the call
itself and cancels it in a ``finally`` (the gateway before the fix), ``call_chunks`` reads
through ``call_chunks`` below (the fix, which the gateway and the router used while they read
calls of each request's own; since #34 every generation reads a shared ``Worker.Serve`` stream,
whose one reader task reads each stream to its end). Prints RSS growth per call after a warm-up;
then what ``call_chunks`` costs: time per chunk of 500 concurrent streams of 64 chunks read
raw and through it, three rounds alternating, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc
import psutil

MODES = ("drained", "abandoned", "call_chunks")
_WARMUP_CALLS = 2000

Reply = TypeVar("Reply")
T = TypeVar("T")


async def call_chunks(
    call: grpc.aio.UnaryStreamCall[Any, Reply] | grpc.aio.UnaryUnaryCall[Any, Reply], stream: bool
) -> AsyncGenerator[Reply, None]:
    """The chunks of a streaming call (``stream``) or the one reply of a unary call; closing
    the iterator cancels the call if it still runs."""
    try:
        if not stream:
            yield await _uncancelled(call, cast(grpc.aio.UnaryUnaryCall[Any, Reply], call))
            return
        reads = cast(grpc.aio.UnaryStreamCall[Any, Reply], call)
        while (chunk := await _uncancelled(call, reads.read())) is not grpc.aio.EOF:
            yield cast(Reply, chunk)  # read() is typed as a reply or EOF, which ended the loop
    finally:
        call.cancel()


async def _uncancelled(call: grpc.aio.Call, read: Awaitable[T]) -> T:
    """``read`` of ``call``, never abandoned while in flight: a caller cancelled meanwhile
    cancels the call, waits for the read to end, then goes on cancelled. grpc.aio (1.85)
    keeps a few hundred bytes of native memory for every read whose awaiting task was
    cancelled before it completed (docs/RELIABILITY.md, "Soak"), as each client dropping a
    stream did to the gateway while it read calls of each request's own."""
    pending = asyncio.ensure_future(read)
    try:
        return await asyncio.shield(pending)
    except asyncio.CancelledError:
        call.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        raise


async def _serve(
    request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
) -> AsyncIterator[bytes]:
    for _ in range(16):
        yield b"x" * 64
        await asyncio.sleep(0.002)


async def _one(rpc: grpc.aio.UnaryStreamMultiCallable[bytes, bytes], mode: str) -> None:
    call = rpc(b"")
    first = asyncio.Event()

    async def read() -> None:
        if mode == "call_chunks":
            async for _ in call_chunks(call, stream=True):
                first.set()
            return
        try:
            async for _ in call:
                first.set()
        finally:
            call.cancel()

    reader = asyncio.create_task(read())
    if mode == "drained":
        await reader
        return
    await first.wait()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)


async def _start_server(serve: Callable[..., AsyncIterator[bytes]]) -> tuple[grpc.aio.Server, int]:
    """A server streaming ``serve``'s chunks at /bench.Stream/Generate on a free loopback port."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "bench.Stream", {"Generate": grpc.unary_stream_rpc_method_handler(serve)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _measure(mode: str, calls: int, concurrency: int) -> float:
    server, port = await _start_server(_serve)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        rpc: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            "/bench.Stream/Generate"
        )

        async def clients(total: int) -> None:
            async def client(n: int) -> None:
                for _ in range(n):
                    await _one(rpc, mode)

            await asyncio.gather(*(client(total // concurrency) for _ in range(concurrency)))

        await clients(_WARMUP_CALLS)
        before = psutil.Process().memory_info().rss
        await clients(calls)
        await asyncio.sleep(1)
        grown = psutil.Process().memory_info().rss - before
    await server.stop(None)
    return grown / 1024 / calls


async def _chunk_cost(streams: int = 500, chunks: int = 64, rounds: int = 3) -> None:
    async def serve(
        request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        for _ in range(chunks):
            yield b"x" * 64

    server, port = await _start_server(serve)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        rpc: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            "/bench.Stream/Generate"
        )

        async def raw() -> None:
            async for _ in rpc(b""):
                pass

        async def wrapped() -> None:
            async for _ in call_chunks(rpc(b""), stream=True):
                pass

        for i in range(rounds):
            per_chunk = {}
            for name, read in (("raw", raw), ("call_chunks", wrapped)):
                start = time.perf_counter()
                await asyncio.gather(*(read() for _ in range(streams)))
                per_chunk[name] = (time.perf_counter() - start) / (streams * chunks) * 1e6
            print(
                f"round {i}: raw {per_chunk['raw']:.1f} us/chunk, call_chunks "
                f"{per_chunk['call_chunks']:.1f} us/chunk "
                f"(x{per_chunk['call_chunks'] / per_chunk['raw']:.2f})"
            )
    await server.stop(None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child's mode
    args = parser.parse_args()
    if args.mode:
        print(asyncio.run(_measure(args.mode, args.calls, args.concurrency)))
        return 0
    print(f"grpcio {grpc.__version__}; {args.calls} calls per mode at c={args.concurrency}")
    for mode in MODES:
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--mode",
                mode,
                "--calls",
                str(args.calls),
                "--concurrency",
                str(args.concurrency),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        print(f"{mode:>12}: RSS +{float(child.stdout):.3f} KB per call")
    asyncio.run(_chunk_cost())
    return 0


if __name__ == "__main__":
    sys.exit(main())
