"""The gateway's one tokenization of a request: per served model, the tokenizer its workers
render with (Capabilities.tokenizer, learnt from the router's ListWorkers), fetched once per
digest from one of them (Worker.TextFiles) and loaded here; then each request's prompt is
rendered and tokenized as that worker would (infermesh.text.prompt), and its GenerateRequest
carries the ids, the digest and the ids' prefix hashes before the route ask. A simulated fleet
("bytes:4") gets its simulated tokens (infermesh.sim_tokens), nothing fetched.

The gateway starts learning its fleet's tokenizers as it starts (``start``), and looks again
every ``[router] tokenizer_refresh_s``, or at once (at most once a second) for a model it has not
seen: a model that appears is learnt by its first request. A request that arrives while a load is
under way waits for it, at most LOAD_WAIT_S, rather than going without its ids and block hashes
(which the router's prefill/decode split and cache-aware routing read). This path only ever adds
fields: when the load fails or takes longer (a failed fetch, workers reporting no digest or one
the gateway cannot load), or when a prompt does not render, the request goes without them, as
before (the router then hashes its text and the worker renders it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.mesh.client import MeshClient
from gateway.mesh.fleet_view import per_model
from infermesh.pb import common_pb2, router_pb2
from infermesh.prefix_hash import chain
from infermesh.sim_tokens import SIM_TOKENIZER, prompt_text, sim_token_ids
from infermesh.tasks import cancel_and_wait
from infermesh.text.prompt import chat_message, request_token_ids
from infermesh.text.text_files import SERVED_TEMPLATE, TextFiles

if TYPE_CHECKING:
    from infermesh.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized in a thread: HF tokenizers release the
# GIL, so other requests go on meanwhile; shorter ones cost less than the thread's hand-over.
THREAD_CHARS = 16_384
# The longest a request waits for its model's tokenizer while it is being loaded (the tiny model's
# loads in about 1.5 s here), before it goes without its ids
LOAD_WAIT_S = 10.0
# A request for a model the gateway has not seen looks at the fleet again at most this often
_UNSEEN_MODEL_LOOK_S = 1.0
# Tokenizers loaded in this process by their files' digest (which names them exactly), oldest
# first: a gateway app created again in one process (its tests, a restart in place) loads none
# twice
_LOADED: dict[str, Tokenizer] = {}
_LOADED_MAX = 8


@dataclasses.dataclass(frozen=True)
class Renderer:
    """A tokenizer as the gateway uses it: its digest and a request's prompt ids."""

    digest: str
    token_ids: Callable[[common_pb2.GenerateRequest], list[int]]


# A simulated fleet's tokens need no files: infermesh.sim_tokens is their tokenizer
SIM_RENDERER = Renderer(
    SIM_TOKENIZER,
    lambda request: sim_token_ids(
        prompt_text([chat_message(m) for m in request.messages] or None, request.prompt or None)
    ),
)


class PromptTokens:
    """Fills GenerateRequests' prompt_token_ids, tokenizer and prefix_hashes; safe to share."""

    def __init__(self, mesh: MeshClient, refresh_s: float) -> None:
        self._mesh = mesh
        self._refresh_s = refresh_s
        self._digests: dict[str, str] = {}  # served model -> its fleet's tokenizer digest
        self._loaded: dict[str, Renderer] = {SIM_TOKENIZER: SIM_RENDERER}  # by digest
        self._looked_at = -float("inf")  # monotonic time of the last ListWorkers
        self._learning: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts learning the fleet's tokenizers (as the gateway starts)."""
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
        """``renderer``, waiting up to LOAD_WAIT_S for a load of the fleet's tokenizers under
        way."""
        renderer = self.renderer(model)
        learning = self._learning
        if renderer is None and learning is not None and not learning.done():
            # shielded: a request given up does not stop the load for the others
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(learning), LOAD_WAIT_S)
            renderer = self._loaded_for(model)
        return renderer

    def _loaded_for(self, model: str) -> Renderer | None:
        digest = self._digests.get(model)
        return None if digest is None else self._loaded.get(digest)

    async def fill(self, request: common_pb2.GenerateRequest) -> None:
        """Adds the prompt's ids, their tokenizer and prefix hashes, once the model's tokenizer
        is loaded (waiting for a load under way, LOAD_WAIT_S at most) and when the prompt
        renders; otherwise leaves the request as it is."""
        renderer = await self.loaded_renderer(request.model)
        if renderer is None or not (request.messages or request.prompt):
            return
        try:
            if _prompt_chars(request) > THREAD_CHARS:
                ids = await asyncio.to_thread(renderer.token_ids, request)
            else:
                ids = renderer.token_ids(request)
        except Exception as e:  # the worker renders it and says what is wrong
            logger.debug("request %s not tokenized here: %s", request.request_id, e)
            return
        request.prompt_token_ids[:] = ids
        request.tokenizer = renderer.digest
        request.prefix_hashes[:] = chain(ids)

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


def _fleet_digests(
    workers: list[router_pb2.WorkerStatus],
) -> tuple[dict[str, str], dict[str, str]]:
    """Per served model the digest most of its workers report (of those the gateway can load:
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
    # transformers brings torch: imported once a tokenizer is loaded, not as the gateway starts
    from infermesh.text.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="infermesh-tokenizer-") as directory:
        path = Path(directory)
        files.write(path)
        tokenizer = Tokenizer(path, chat_template=path / SERVED_TEMPLATE)
    if tokenizer.text_files.digest != files.digest:
        raise ValueError(f"loaded as {tokenizer.text_files.digest}")
    return tokenizer


def _prompt_chars(request: common_pb2.GenerateRequest) -> int:
    return len(request.prompt) + sum(len(m.content) for m in request.messages)
