"""One tokenization of a request, as the worker would make it: per served model, the tokenizer its
workers render with (Capabilities.tokenizer, learnt from the fleet's WorkerStatus), fetched once
per digest from one of them (Worker.TextFiles) and loaded here; then each request's prompt is
rendered and tokenized as that worker would (infermesh.text.prompt), and its GenerateRequest
carries the ids, the digest and the ids' prefix hashes. A simulated fleet ("bytes:4") gets its
simulated tokens (infermesh.sim_tokens), nothing fetched.

Both sides of the mesh use it: the gateway fills each request before its route ask (learning the
fleet from the router's ListWorkers), and the router fills an ask that came without block hashes
(an internal caller's text, a prompt the gateway could not render) from its own fleet view, so
that the prefill/decode split and cache-aware routing read every request's blocks.

The tokenizers are learnt as their user starts (``learn``), and looked at again every
``refresh_s``, or at once (at most once a second) for a model not seen yet: a model that appears
is learnt by its first request. A request that arrives while a load is under way waits for it,
at most ``load_wait_s``, rather than going without its ids and block hashes. This path only ever
adds fields: when the load fails or takes longer (a failed fetch, workers reporting no digest or
one that cannot be loaded here), or when a prompt does not render, the request goes without them
(the router then decides it on its text, and the worker renders it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from infermesh.fleet_view import per_model
from infermesh.pb import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from infermesh.prefix_hash import chain
from infermesh.sim_tokens import SIM_TOKENIZER, prompt_text, sim_token_ids
from infermesh.tasks import cancel_and_wait
from infermesh.text.prompt import chat_message, request_token_ids
from infermesh.text.text_files import SERVED_TEMPLATE, TextFiles, assembled

if TYPE_CHECKING:
    from infermesh.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized in a thread by default: HF tokenizers
# release the GIL, so other requests go on meanwhile; shorter ones cost less than the thread's
# hand-over.
THREAD_CHARS = 16_384
# Prompts tokenized at once in threads, at most: the others wait their turn, so tokenizing never
# takes every core
TOKENIZE_THREADS = 2
# The longest a gateway's request waits for its model's tokenizer while it is being loaded (the
# tiny model's loads in about 1.5 s), before it goes without its ids
LOAD_WAIT_S = 10.0
# A request for a model not seen yet looks at the fleet again at most this often
_UNSEEN_MODEL_LOOK_S = 1.0
# Tokenizers loaded in this process by their files' digest (which names them exactly), oldest
# first: a service created again in one process (its tests, a restart in place) loads none
# twice
_LOADED: dict[str, Tokenizer] = {}
_LOADED_MAX = 8


@dataclasses.dataclass(frozen=True)
class Renderer:
    """A tokenizer as used here: its digest and a request's prompt ids."""

    digest: str
    token_ids: Callable[[common_pb2.GenerateRequest], list[int]]


# A simulated fleet's tokens need no files: infermesh.sim_tokens is their tokenizer
SIM_RENDERER = Renderer(
    SIM_TOKENIZER,
    lambda request: sim_token_ids(
        prompt_text([chat_message(m) for m in request.messages] or None, request.prompt or None)
    ),
)


class FleetFiles(Protocol):
    """Where the tokenizers are learnt from: the fleet's workers and their tokenizers' files."""

    async def list_workers(self) -> list[router_pb2.WorkerStatus]:
        """The fleet's workers, with the tokenizer digest each reports."""
        ...

    async def text_files(self, address: str) -> dict[str, bytes]:
        """The tokenizer's files of the worker at ``address`` (Worker.TextFiles)."""
        ...


class PromptTokens:
    """Fills GenerateRequests' prompt_token_ids, tokenizer and prefix_hashes; safe to share."""

    def __init__(
        self,
        mesh: FleetFiles,
        refresh_s: float,
        load_wait_s: float = LOAD_WAIT_S,
        thread_chars: int = THREAD_CHARS,
    ) -> None:
        """``refresh_s``: how often the fleet's digests are looked at again; ``load_wait_s``:
        the longest a request waits for a load under way; ``thread_chars``: prompts longer than
        this are tokenized in one of TOKENIZE_THREADS threads (0: every prompt)."""
        self._mesh = mesh
        self._refresh_s = refresh_s
        self._load_wait_s = load_wait_s
        self._thread_chars = thread_chars
        self._threads = concurrent.futures.ThreadPoolExecutor(
            TOKENIZE_THREADS, thread_name_prefix="tokenize"
        )
        self._digests: dict[str, str] = {}  # served model -> its fleet's tokenizer digest
        self._loaded: dict[str, Renderer] = {SIM_TOKENIZER: SIM_RENDERER}  # by digest
        self._looked_at = -float("inf")  # monotonic time of the last ListWorkers
        self._learning: asyncio.Task[None] | None = None

    def learn(self) -> None:
        """Looks at the fleet's tokenizers now (as its user starts, when a worker joins), unless
        a look is under way."""
        self._learn_soon()

    def renderer(self, model: str) -> Renderer | None:
        """The model's tokenizer when loaded; else None, and it is being learnt."""
        since = time.monotonic() - self._looked_at
        if since >= self._refresh_s or (
            model not in self._digests and since >= _UNSEEN_MODEL_LOOK_S
        ):
            self._learn_soon()
        return self._loaded_for(model)

    async def loaded_renderer(self, model: str) -> Renderer | None:
        """``renderer``, waiting up to ``load_wait_s`` for a load of the fleet's tokenizers
        under way."""
        renderer = self.renderer(model)
        learning = self._learning
        if renderer is None and learning is not None and not learning.done():
            # shielded: a request given up does not stop the load for the others
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(learning), self._load_wait_s)
            renderer = self._loaded_for(model)
        return renderer

    def _loaded_for(self, model: str) -> Renderer | None:
        digest = self._digests.get(model)
        return None if digest is None else self._loaded.get(digest)

    async def fill(self, request: common_pb2.GenerateRequest) -> None:
        """Adds the prompt's ids, their tokenizer and prefix hashes, once the model's tokenizer
        is loaded (waiting for a load under way, ``load_wait_s`` at most) and when the prompt
        renders; otherwise leaves the request as it is. A long prompt is tokenized in a thread."""
        renderer = await self.loaded_renderer(request.model)
        if renderer is None or not (request.messages or request.prompt):
            return
        if _prompt_chars(request) > self._thread_chars:
            loop = asyncio.get_running_loop()
            tokens = await loop.run_in_executor(self._threads, _hashed_ids, renderer, request)
        else:
            tokens = _hashed_ids(renderer, request)
        if tokens is not None:
            request.prompt_token_ids[:], request.prefix_hashes[:] = tokens
            request.tokenizer = renderer.digest

    async def fill_choices(
        self, requests: list[common_pb2.GenerateRequest], prompt_of: list[int]
    ) -> None:
        """``fill`` for each distinct prompt once (``prompt_of``: each request's prompt), its
        fields copied to the other choices of that prompt."""
        filled: dict[int, common_pb2.GenerateRequest] = {}
        for request, prompt in zip(requests, prompt_of, strict=True):
            first = filled.get(prompt)
            if first is None:
                await self.fill(request)
                filled[prompt] = request
            elif first.tokenizer:
                request.prompt_token_ids[:] = first.prompt_token_ids
                request.tokenizer = first.tokenizer
                request.prefix_hashes[:] = first.prefix_hashes

    async def close(self) -> None:
        if self._learning is not None:
            await cancel_and_wait(self._learning)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _learn_soon(self) -> None:
        if self._learning is None or self._learning.done():
            self._looked_at = time.monotonic()
            self._learning = asyncio.create_task(self._learn())

    async def _learn(self) -> None:
        """Looks at the fleet's digests once and loads those not loaded yet; failures wait
        for the next look."""
        try:
            workers = await self._mesh.list_workers()
        except Exception as e:
            logger.warning("could not list workers to learn their tokenizers: %s", e)
            return
        digests, addresses = _fleet_digests(workers)
        self._digests = digests
        for digest in set(digests.values()) - self._loaded.keys():
            try:
                self._loaded[digest] = await self._fetch(digest, addresses[digest])
                logger.info("loaded tokenizer %s from worker %s", digest, addresses[digest])
            except Exception as e:
                logger.warning(
                    "could not load tokenizer %s from worker %s: %s", digest, addresses[digest], e
                )
        in_use = set(digests.values())
        for digest in self._loaded.keys() - in_use - {SIM_TOKENIZER}:  # the fleet moved on
            del self._loaded[digest]

    async def _fetch(self, digest: str, address: str) -> Renderer:
        tokenizer = _LOADED.get(digest)
        if tokenizer is None:
            files = TextFiles.of(await self._mesh.text_files(address))
            if files.digest != digest:
                raise ValueError(f"its files' digest is {files.digest}")
            tokenizer = _LOADED[digest] = await asyncio.to_thread(_load, files)
            while len(_LOADED) > _LOADED_MAX:
                del _LOADED[next(iter(_LOADED))]
        return Renderer(digest, functools.partial(request_token_ids, tokenizer))


async def worker_text_files(
    stub: worker_pb2_grpc.WorkerStub, timeout_s: float | None
) -> dict[str, bytes]:
    """A worker's tokenizer files (Worker.TextFiles), whole; grpc.aio.AioRpcError or ValueError
    when they do not come."""
    call = stub.TextFiles(worker_pb2.TextFilesRequest(), timeout=timeout_s, wait_for_ready=False)
    return assembled([(chunk.name, chunk.data) async for chunk in call])


def _fleet_digests(
    workers: list[router_pb2.WorkerStatus],
) -> tuple[dict[str, str], dict[str, str]]:
    """Per served model the digest most of its workers report (of those loadable here:
    "sha256:..." and the simulated tokens), and per digest a worker's address to fetch it
    from."""
    addresses: dict[str, str] = {}
    for status in workers:
        if (digest := _loadable(status.worker)) is not None:
            addresses.setdefault(digest, status.worker.address)
    return per_model(workers, _loadable), addresses


def _loadable(info: common_pb2.WorkerInfo) -> str | None:
    digest = info.capabilities.tokenizer
    return digest if digest.startswith("sha256:") or digest == SIM_TOKENIZER else None


def _load(files: TextFiles) -> Tokenizer:
    """The tokenizer the files make, checked to be the one they name."""
    # transformers brings torch: imported once a tokenizer is loaded, not as a service starts
    from infermesh.text.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="infermesh-tokenizer-") as directory:
        path = Path(directory)
        files.write(path)
        tokenizer = Tokenizer(path, chat_template=path / SERVED_TEMPLATE)
    if tokenizer.text_files.digest != files.digest:
        raise ValueError(f"loaded as {tokenizer.text_files.digest}")
    return tokenizer


def _hashed_ids(
    renderer: Renderer, request: common_pb2.GenerateRequest
) -> tuple[list[int], list[int]] | None:
    """The prompt's ids and their block hashes; None when it does not render (the worker
    renders it and says why)."""
    try:
        ids = renderer.token_ids(request)
    except Exception as e:
        logger.debug("request %s not tokenized here: %s", request.request_id, e)
        return None
    return ids, chain(ids)


def _prompt_chars(request: common_pb2.GenerateRequest) -> int:
    return len(request.prompt) + sum(len(m.content) for m in request.messages)
