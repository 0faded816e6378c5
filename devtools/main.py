"""Developer CLI (``python -m infermesh``).

``python -m infermesh run``        the whole mesh in the foreground (``make run``)
``python -m infermesh keys ...``   manage API keys over the gateway's admin API
                                   (create, list, get, update, disable, revoke, rotate, usage)
``python -m infermesh plan MODEL``  memory and GPUs a checkpoint needs, per GPU kind
``python -m infermesh bench``       measure every GPU kind of a fleet (or, --sim, a simulated one)
``python -m infermesh certs DIR``   a development CA and a certificate + key per mesh role
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from devtools import admin_cli, certs, plan
from devtools.chat_model import SERVED_PATH
from devtools.hwbench import cli as bench_cli
from devtools.mesh import Mesh, MeshSpec, ServiceExited, dev_worker_env
from devtools.redis_server import RedisServer, redis_reachable
from gateway.accounts.keys import create_key_at
from infermesh.ports import port_in_use
from infermesh.redact import redact_url

logger = logging.getLogger("infermesh")

_DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# the development CA and certificates of `make run` (written on its first start, then kept)
_CERTS = Path(".certs")
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m infermesh")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="start Redis (if needed), router, worker and gateway")
    run.add_argument(
        "--model",
        default=SERVED_PATH,
        help="checkpoint directory (default: the trained chat model)",
    )
    run.add_argument("--gateway-port", type=int, default=8000)
    run.add_argument("--router-port", type=int, default=50051)
    run.add_argument("--worker-port", type=int, default=50061)
    admin_cli.add_parser(commands)
    plan.add_parser(commands)
    bench_cli.add_parser(commands)
    certs.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "certs":
        return certs.run(args)
    if args.command == "keys":
        return admin_cli.run(args)
    if args.command == "plan":
        return plan.run(args)
    if args.command == "bench":
        return bench_cli.run(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s infermesh %(levelname)s %(message)s"
    )
    return run_mesh(args, os.environ.get("REDIS_URL", _DEFAULT_REDIS_URL))


def run_mesh(args: argparse.Namespace, redis_url: str) -> int:
    for port in (args.gateway_port, args.router_port, args.worker_port):
        holder = port_in_use(port)
        if holder is not None:
            print(
                f"port {port} is in use by {holder}; stop it or choose other ports with "
                f"`python -m infermesh run --gateway-port/--router-port/--worker-port`",
                file=sys.stderr,
            )
            return 1
    # SIGTERM (a supervisor, `timeout`) stops the mesh as Ctrl-C does; SIGINT
    # is set explicitly since a shell may start background jobs ignoring it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    redis_server = None
    if not redis_reachable(redis_url):
        redis_server = _start_redis(redis_url)
        redis_url = redis_server.url
    admin_token = secrets.token_urlsafe(32)
    model = Path(args.model).resolve().name
    spec = MeshSpec(
        redis_url=redis_url,
        model_path=args.model,
        gateway_port=args.gateway_port,
        router_port=args.router_port,
        worker_ports=(args.worker_port,),
        certs=_CERTS.resolve(),
        worker_env=(dev_worker_env(),),
        env={
            "INFERMESH_LOG_FORMAT": os.environ.get("INFERMESH_LOG_FORMAT", "text"),
            **dev_gateway_env(model, admin_token),
        },
    )
    try:
        with Mesh(spec) as mesh:
            key = asyncio.run(create_key_at(redis_url, "make-run development key"))
            print(
                f"\nOPENAI_BASE_URL={spec.base_url}\nOPENAI_API_KEY={key}\n"
                f"(model: {model}, also as claude-* and gpt-*; Ctrl-C stops everything)\n"
                f"For Claude Code:\n"
                f"ANTHROPIC_BASE_URL=http://127.0.0.1:{spec.gateway_port}\n"
                f"ANTHROPIC_AUTH_TOKEN={key}\n"
                f"For `python -m infermesh keys ...`:\n"
                f"INFERMESH_ADMIN_URL=http://127.0.0.1:{spec.gateway_port}\n"
                f"INFERMESH_ADMIN_TOKEN={admin_token}\n"
                f"The operator's console: http://127.0.0.1:{spec.gateway_port}/console "
                f"(sign in with that token)\n"
                f"gRPC (mutual TLS): router at {spec.router_address}, as an internal client with "
                f"{_CERTS}/client.crt, {_CERTS}/client.key and {_CERTS}/ca.crt\n",
                flush=True,
            )
            while True:
                mesh.check_alive()
                time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    except (ServiceExited, TimeoutError) as e:
        print(f"mesh stopped: {e}", file=sys.stderr)
        return 1
    finally:
        if redis_server is not None:
            redis_server.stop()


def dev_gateway_env(model: str, admin_token: str) -> dict[str, str]:
    """The dev mesh's gateway settings (`make run`; tests/e2e/test_readme.py runs the README's
    commands against a gateway set up the same way)."""
    return {
        # the admin API's token for this run, printed once the mesh answers
        "INFERMESH_GATEWAY_ADMIN_TOKEN": admin_token,
        # agents' default model names (Claude Code's claude-..., Codex's gpt-...) are served by
        # the model without configuring the agent
        "INFERMESH_GATEWAY_MODELS_ALIASES": json.dumps({"claude-*": model, "gpt-*": model}),
    }


def _start_redis(url: str) -> RedisServer:
    parsed = urlparse(url)
    port = parsed.port or 6379
    if parsed.hostname not in _LOOPBACK or port_in_use(port) is not None:
        port = 0
    server = RedisServer(port=port or None, workdir=Path(".run").resolve())
    Path(".run").mkdir(exist_ok=True)
    logger.info("no Redis reachable at %s; starting one on port %d", redact_url(url), server.port)
    return server.start()
