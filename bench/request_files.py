"""The project's files one streamed chat request runs code of (docs/ARCHITECTURE.md, "The
request path"): how many places a reader follows to understand the request path.

    .venv/bin/python bench/request_files.py [--list]

Redis, the router, one simulated worker and the gateway in this process, on loopback; after a
warm-up request (what runs once per process, such as opening the streams, is not the
request's), records the source file of every Python function called while one streamed chat
completion (16 tokens) is served, from the HTTP request to its ``[DONE]``, and counts the
project's files among them by package (``--list``: names them). The simulated engine stands in
for a model: the engine's own files are the model's, not the path's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from devtools.redis_server import RedisServer
from gateway.accounts.keys import create_key_at
from tests.helpers import MODEL
from tests.helpers.gateway import auth, make_config, start_gateway
from tests.helpers.inprocess import running_router, running_worker, sim_engine

_ROOT = Path(__file__).resolve().parent.parent
_NOT_THE_PATH = ("tests", "bench", ".venv")


def _project_file(filename: str) -> str | None:
    path = Path(filename)
    if not path.is_absolute() or not path.is_relative_to(_ROOT):
        return None
    relative = path.relative_to(_ROOT)
    return None if relative.parts[0] in _NOT_THE_PATH else relative.as_posix()


async def _files_of_one_request() -> set[str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Which files does this request cross?"}],
        "max_tokens": 16,
        "stream": True,
    }
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis:
        async with (
            running_router(redis_url=redis.url) as router,
            running_worker(sim_engine(), router),
        ):
            gateway = await start_gateway(make_config(redis.url, router.address))
            try:
                key = await create_key_at(redis.url, "files")
                await _stream(gateway, key, body)  # the warm-up
                seen: set[str] = set()

                def profile(frame: types.FrameType, event: str, _: Any) -> None:
                    if event == "call":
                        seen.add(frame.f_code.co_filename)

                sys.setprofile(profile)
                try:
                    await _stream(gateway, key, body)
                finally:
                    sys.setprofile(None)
            finally:
                await gateway.close()
    return {f for name in seen if (f := _project_file(name)) is not None}


async def _stream(gateway: Any, key: str, body: dict[str, object]) -> None:
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    assert response.status == 200, await response.text()
    assert (await response.read()).rstrip().endswith(b"data: [DONE]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="name every file")
    args = parser.parse_args()
    files = asyncio.run(_files_of_one_request())
    by_package = collections.Counter(f.split("/")[0] for f in files)
    print(f"{len(files)} files: " + ", ".join(f"{p} {n}" for p, n in sorted(by_package.items())))
    if args.list:
        for name in sorted(files):
            print(f"  {name}")


if __name__ == "__main__":
    main()
