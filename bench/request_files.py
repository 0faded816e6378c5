"""The project's files one streamed chat request runs code of (docs/ARCHITECTURE.md, "The
request path"): how many places a reader follows to understand the request path.

    .venv/bin/python bench/request_files.py [--list]

Redis, the router, one simulated worker and the gateway in this process, on loopback; after a
warm-up request (what runs once per process, such as opening the streams, is not the
request's), records every Python function called while one streamed chat completion (16
tokens) is served, from the HTTP request to its ``[DONE]``, and prints:

- the project's files among them, by package (``--list``: names them). The simulated engine
  stands in for a model: the engine's own files are the model's, not the path's;
- the generators a chunk passes: the most of the project's async generators nested on the
  stack at once beneath the HTTP writer (``gateway/http/sse.py``), the chain down to where a
  chunk comes from (``--list``: names it, outermost first);
- the walk: the project's files in the order a reader meets the request's functions (each
  function at its first call), one move per change of file, and how many of those moves go
  back to a file already left.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import inspect
import itertools
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
_WRITER = "gateway/http/sse.py"  # where the chunks leave as server-sent events
_HANDLER = "create_chat_completion"  # the walk starts where the handler's task is first seen


def _project_file(filename: str) -> str | None:
    path = Path(filename)
    if not path.is_absolute() or not path.is_relative_to(_ROOT):
        return None
    relative = path.relative_to(_ROOT)
    return None if relative.parts[0] in _NOT_THE_PATH else relative.as_posix()


@dataclasses.dataclass
class _Recording:
    """What one request ran: its functions at their first call, in order, and the deepest
    chain of the project's async generators seen on the stack."""

    functions: dict[tuple[str, str], None] = dataclasses.field(default_factory=dict)
    generators: list[str] = dataclasses.field(default_factory=list)
    handler: asyncio.Task[Any] | None = None  # the task serving the HTTP request
    walked: dict[tuple[str, str], None] = dataclasses.field(default_factory=dict)

    def profile(self, frame: types.FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if (where := _project_file(code.co_filename)) is None:
            return
        function = (where, code.co_qualname)
        self.functions.setdefault(function, None)
        task = asyncio.current_task()
        if self.handler is None and code.co_qualname == _HANDLER:
            self.handler = task
        if task is not None and task is self.handler:
            self.walked.setdefault(function, None)
        if code.co_flags & inspect.CO_ASYNC_GENERATOR:
            chain = _generator_chain(frame)
            if len(chain) > len(self.generators):
                self.generators = chain

    def files(self) -> set[str]:
        return {where for where, _ in self.functions}

    def walk(self) -> list[str]:
        """The files in the order the handler's task meets its functions, a file met again in
        a row once."""
        walk: list[str] = []
        for where, _ in self.walked:
            if not walk or walk[-1] != where:
                walk.append(where)
        return walk


def _generator_chain(frame: types.FrameType | None) -> list[str]:
    """The project's async generators on the stack from ``frame`` out to the HTTP writer,
    outermost first (none when the writer is not on the stack: not the chunks' way out)."""
    chain: list[str] = []
    while frame is not None:
        code = frame.f_code
        where = _project_file(code.co_filename)
        if where == _WRITER:
            return chain[::-1]
        if where is not None and code.co_flags & inspect.CO_ASYNC_GENERATOR:
            chain.append(f"{where}:{code.co_qualname}")
        frame = frame.f_back
    return []


def back_moves(walk: list[str]) -> int:
    """The moves of ``walk`` into a file it had already left."""
    left: set[str] = set()
    back = 0
    for previous, current in itertools.pairwise(walk):
        left.add(previous)
        back += current in left
    return back


async def _one_request() -> _Recording:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Which files does this request cross?"}],
        "max_tokens": 16,
        "stream": True,
    }
    recording = _Recording()
    with tempfile.TemporaryDirectory() as workdir, RedisServer(workdir=workdir) as redis:
        async with (
            running_router(redis_url=redis.url) as router,
            running_worker(sim_engine(), router),
        ):
            gateway = await start_gateway(make_config(redis.url, router.address))
            try:
                key = await create_key_at(redis.url, "files")
                await _stream(gateway, key, body)  # the warm-up
                sys.setprofile(recording.profile)
                try:
                    await _stream(gateway, key, body)
                finally:
                    sys.setprofile(None)
            finally:
                await gateway.close()
    return recording


async def _stream(gateway: Any, key: str, body: dict[str, object]) -> None:
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    assert response.status == 200, await response.text()
    assert (await response.read()).rstrip().endswith(b"data: [DONE]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="name every file and generator")
    args = parser.parse_args()
    recording = asyncio.run(_one_request())
    files = recording.files()
    by_package = collections.Counter(f.split("/")[0] for f in files)
    print(f"{len(files)} files: " + ", ".join(f"{p} {n}" for p, n in sorted(by_package.items())))
    if args.list:
        for name in sorted(files):
            print(f"  {name}")
    print(f"{len(recording.generators)} generators a chunk passes")
    if args.list:
        for name in recording.generators:
            print(f"  {name}")
    walk = recording.walk()
    print(f"walk: {len(walk) - 1} moves between files, {back_moves(walk)} back to a file left")
    if args.list:
        for name in walk:
            print(f"  {name}")


if __name__ == "__main__":
    main()
