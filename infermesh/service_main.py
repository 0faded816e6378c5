"""The entry point every service's ``__main__`` shares: arguments, logging,
config, tracing, the event loop and a clean stop on SIGINT/SIGTERM.

Services run on uvloop: aiohttp and grpc.aio both spend less CPU per request on it
(bench/gateway_mesh.py: the gateway and router ~25 % less,
docs/benchmarks/gateway-throughput.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import uvloop

import telemetry
from infermesh.config import ConfigError
from infermesh.tls import TlsSection, check_loaded
from telemetry.logs import setup_logging


class ServiceFailedError(RuntimeError):
    """The service cannot go on (a part it runs on died): ``service_main`` prints the reason and
    exits with code 1, for the service's supervisor to restart it."""


class _ServiceConfig(Protocol):
    @property
    def tls(self) -> TlsSection: ...


C = TypeVar("C", bound=_ServiceConfig)


def service_main(
    name: str,
    load: Callable[[str | None], C],
    serve: Callable[[C], Awaitable[None]],
    argv: list[str],
) -> int:
    """Runs ``serve(config)`` until a signal; returns the process exit code.

    The config file comes from ``--config`` or ``INFERMESH_<NAME>_CONFIG``. A config error
    (any ConfigError: the service's file and environment, or what they point at and the service
    reads while starting, such as a checkpoint) is printed, naming file and key, with exit
    code 2; so is a ``[tls]`` without its files and without ``plaintext = true``. A
    ServiceFailedError is printed with exit code 1."""
    parser = argparse.ArgumentParser(prog=f"python -m {name}")
    parser.add_argument(
        "--config",
        default=os.environ.get(f"INFERMESH_{name.upper()}_CONFIG"),
        help="TOML config file (defaults are built in)",
    )
    args = parser.parse_args(argv)
    setup_logging(name)
    try:
        config = load(args.config)
        check_loaded(config.tls, args.config, f"infermesh_{name}")
    except ConfigError as e:
        return _config_error(name, e)
    telemetry.setup_tracing(f"infermesh-{name}")
    try:
        uvloop.run(_until_signal(serve(config)))
    except ConfigError as e:
        return _config_error(name, e)
    except ServiceFailedError as e:
        print(f"{name}: failed: {e}", file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown_tracing()
    return 0


def _config_error(name: str, error: ConfigError) -> int:
    print(f"{name}: config error: {error}", file=sys.stderr)
    return 2


async def _until_signal(main: Awaitable[None]) -> None:
    task = asyncio.ensure_future(main)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
