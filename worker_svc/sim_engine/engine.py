"""A simulated engine: the worker's engine surface with latency from a GPU roofline, no model.

It lets one machine run a fleet of workers of mixed GPU kinds (16-64 processes or servers),
so routing can be tested and benchmarked on hardware that is not there. Time follows the
roofline (roofline.py) of a profile in gpu_profiles.toml for a configured model (its sizes, or a
config.json, bundled or a checkpoint's), on the fewest GPUs that hold its weights in the
precision it runs and a KV budget (sizing.py; [engine] gpu_count overrides).

Continuous batching as in a real engine: up to max_parallel sequences run, each step decodes one
token for the prefilled ones and prefills the others in chunks as the torch engine's scheduler
does (``[parallel] prefill_chunk_size`` prompt tokens a step in all while a sequence decodes,
``idle_prefill_chunk_size`` while none does, oldest first; a prompt's first token comes with its
last chunk, and each chunk's attention reads the prompt's tokens before it); a sequence needs its
whole KV budget (prompt + max_tokens) free to start; past max_parallel + max_waiting requests
generate()
raises EngineOverloadedError (the request front every engine shares, request_front.RequestFront).
Tokens are words from a fixed list, deterministic per seed. A prompt's tokens are
infermesh.sim_tokens's (4 bytes of its text each); its prefix cache keeps whole blocks of them by
their infermesh.prefix_hash names, least recently used first, and publishes what it stores and
evicts (cache_events). Imports no torch: a simulated worker process stays small.

KV blocks with peers (engine_api.KVBlockPeer, served by Worker.KVBlocks and taken by
kv_transfer.KVPuller as the torch engine's are): its prefix cache's blocks are sent to a peer, after
the step under way (a real engine copies them out between two steps), in the time their bytes take
over ``[engine] link_gbps``::

    tokens x kv_transfer_bytes_per_token x 8 / (link_gbps x 1e9)   (infermesh.kv_link)

kv_transfer_bytes_per_token being the model's KV cache per token in the precision it runs
(DeepSeek-V3: 61 layers x 576 latent values x 2 bytes). A simulated block carries no tensors, or
with ``[engine] kv_block_bytes`` one of its bytes (zeros, so that a real network's speed counts); a
peer's blocks named as the prompt's are put in the prefix cache, a prefix hit like any other
(prefill on P, decode on D: P's prefill, then the transfer, then D's step). ``[engine]
time_scale`` stretches every step and transfer, and the speeds it reports, by one factor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import random
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from infermesh.config import ConfigError
from infermesh.kv_link import kv_transfer_s
from infermesh.prefix_hash import BLOCK_TOKENS, chain
from infermesh.sim_tokens import SIM_TOKENIZER, prompt_text, sim_token_ids
from infermesh.text.text_files import TextFiles
from telemetry import metrics
from worker_svc.config import WorkerConfig
from worker_svc.engine.api import (
    DeviceCapabilities,
    EngineClosedError,
    EngineLoad,
    GenerationChunk,
    GenerationRequest,
    InvalidArgumentError,
    PeerBlock,
    PeerPrefix,
    RawTensor,
    drain_chunks,
)
from worker_svc.engine.cache_events import CacheEvents
from worker_svc.engine.meters import DecodeRateMeter, PrefillSpeedMeter
from worker_svc.engine.request_front import RequestFront
from worker_svc.hardware.gpu_profiles import gpu_profiles
from worker_svc.hardware.sizing import fewest_gpus, serving_profile
from worker_svc.sim_engine.roofline import Roofline

logger = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 32768
# the dtype a simulated block's bytes travel as ([engine] kv_block_bytes)
_BLOCK_DTYPE = "uint8"
_WORDS = (
    "the",
    "mesh",
    "routes",
    "each",
    "request",
    "to",
    "a",
    "worker",
    "that",
    "serves",
    "it",
    "well",
    "and",
    "streams",
    "tokens",
    "back",
    "fast",
    "on",
    "every",
    "GPU",
    "with",
    "low",
    "latency",
    "high",
    "throughput",
    "cache",
    "prefix",
    "batch",
    "model",
    "of",
    "in",
    "now",
)


@dataclass(eq=False)
class _Sequence:
    prompt_tokens: int
    cached_prompt_tokens: int
    budget: int  # most completion tokens
    prefix_blocks: list[int]
    params_stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    rng: random.Random
    chunks: asyncio.Queue[GenerationChunk | BaseException] = field(default_factory=asyncio.Queue)
    generated: int = 0
    computed: int = 0  # prompt tokens past the cached ones prefilled so far
    prefilled: bool = False
    text: str = ""
    arrived_at: float = field(default_factory=time.monotonic)
    queue_s: float = 0.0  # from arrival to joining the batch

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.budget

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated


class SimEngine:
    """The worker's engine surface (engine_api.InferenceEngine) on a simulated GPU."""

    def __init__(
        self,
        roofline: Roofline,
        *,
        max_parallel: int,
        max_waiting: int,
        max_model_len: int = _DEFAULT_MAX_MODEL_LEN,
        prefix_caching: bool = True,
        zero_latency: bool = False,
        cache_events: CacheEvents | None = None,
        link_gbps: float = 0.0,
        time_scale: float = 1.0,
        prefill_chunk_tokens: int = 0,
        idle_prefill_chunk_tokens: int = 0,
        kv_block_bytes: bool = False,
    ) -> None:
        """``prefill_chunk_tokens``: prompt tokens prefilled a step while a sequence decodes,
        ``idle_prefill_chunk_tokens`` while none does (0: whole prompts in one step);
        ``kv_block_bytes``: the blocks sent to peers carry their size in bytes (else none)."""
        if roofline.kv_capacity_tokens < 1:
            raise ConfigError(
                f"[engine] gpu_count: the model's {roofline.weight_bytes / 1e9:.0f} GB of weights "
                "leave no KV cache in "
                f"{roofline.gpu_count} x {roofline.profile.name} "
                f"({roofline.memory_bytes / 1e9:.0f} GB)"
            )
        self.roofline = roofline
        self.time_scale = time_scale
        self._link_gbps = link_gbps
        self._chunk_tokens = prefill_chunk_tokens
        self._idle_chunk_tokens = idle_prefill_chunk_tokens
        profile = roofline.profile
        kv_bytes_per_token = roofline.kv_bytes_per_token + roofline.index_bytes_per_token
        self.capabilities = DeviceCapabilities(
            device=profile.device,
            device_name=profile.device_name,
            compute_capability=profile.compute_capability,
            precision=profile.precision,
            memory_total_bytes=roofline.memory_bytes,
            weight_bytes=roofline.weight_bytes,
            decode_tokens_per_second=1 / (roofline.decode_step_s(1, 0) * time_scale),
            prefill_tokens_per_second=1 / (roofline.prefill_s(1) * time_scale),
            gpu_count=roofline.gpu_count,
            kv_cache_bytes=roofline.kv_capacity_tokens * kv_bytes_per_token,
            model_type=roofline.size.model_type,
            index_topk=roofline.index_topk,
            # its blocks are what it caches: without a prefix cache it has none to send or take
            kv_transfer_bytes_per_token=kv_bytes_per_token if prefix_caching else 0,
            prefill_chunk_tokens=prefill_chunk_tokens,
        )
        # what each block carries to a peer: none, or its bytes (one object for all of them)
        self._block_tensors: tuple[RawTensor, ...] = ()
        if kv_block_bytes and prefix_caching:
            size = BLOCK_TOKENS * kv_bytes_per_token
            self._block_tensors = (RawTensor(bytes(size), _BLOCK_DTYPE, (size,)),)
        # byte-counted prompts: no tokenizer files a caller could render with
        self.text_files = TextFiles(SIM_TOKENIZER, {})
        self.max_model_len = max_model_len
        self.max_parallel = max_parallel
        self._front = RequestFront(
            vocab_size=len(_WORDS),
            max_model_len=max_model_len,
            max_parallel=max_parallel,
            max_waiting=max_waiting,
        )
        self._zero_latency = zero_latency
        self._running: list[_Sequence] = []
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._kv_used = 0
        # blocks of BLOCK_TOKENS simulated tokens by their prefix_hash names, least recent first
        self._prefix_cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._prefix_caching = prefix_caching
        self._prefix_cache_blocks = roofline.kv_capacity_tokens // BLOCK_TOKENS
        self.cache_events = cache_events or CacheEvents()
        self._decode_rate = DecodeRateMeter()
        self._prefill_speed = PrefillSpeedMeter()
        self._wake = asyncio.Event()
        self._step_ended = asyncio.Event()  # set at the end of each step, then replaced
        self._loop_task: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: WorkerConfig) -> SimEngine:
        """The [engine] section's GPU and model; [parallel], [cache] and [attention] as for a real
        engine."""
        e, cache = config.engine, config.cache
        size = e.size()
        profile = serving_profile(gpu_profiles()[e.gpu], size)
        parallel = config.parallel.resolved(profile.device, profile.device_name)
        kv_budget = (
            parallel.max_parallel * e.kv_budget_tokens * size.kv_bytes_per_token(profile.precision)
        )
        gpu_count = e.gpu_count or fewest_gpus(
            size.weight_bytes(profile.precision),
            kv_budget,
            profile.memory_bytes,
            cache.gpu_memory_utilization,
        )
        roofline = Roofline(
            profile,
            gpu_count,
            size,
            cache.gpu_memory_utilization,
            e.attention_flops_per_key,
            e.index_flops_per_key,
        )
        return cls(
            roofline,
            max_parallel=parallel.max_parallel,
            max_waiting=parallel.max_waiting,
            max_model_len=config.attention.max_model_len or _DEFAULT_MAX_MODEL_LEN,
            prefix_caching=cache.enable_prefix_caching,
            zero_latency=e.zero_latency,
            cache_events=CacheEvents(cache.events_history, cache.events_backlog),
            link_gbps=e.link_gbps,
            time_scale=e.time_scale,
            prefill_chunk_tokens=parallel.prefill_chunk_size,
            idle_prefill_chunk_tokens=parallel.idle_prefill_chunk_size,
            kv_block_bytes=e.kv_block_bytes,
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream the completion; the last chunk carries finish_reason. Stopping iteration aborts
        it."""
        self._front.check(request)
        seq = self._new_sequence(request)
        with self._front.admitted():
            self._admit(seq)
            async with contextlib.aclosing(
                drain_chunks(seq.chunks, lambda: self._abort(seq))
            ) as chunks:
                async for chunk in chunks:
                    yield chunk

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            tokens_per_second=self._decode_rate.rate(),
            kv_cache_usage=self._kv_used / self.roofline.kv_capacity_tokens,
            prefill_tokens_per_second=self._prefill_speed.speed(),
        )

    @property
    def peak_live(self) -> int:
        """The most requests it held at once, running and waiting, counted at each admission."""
        return self._front.peak_live

    async def close(self) -> None:
        """Stop the step loop; streams still running end with EngineClosedError."""
        self._front.close()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._step_ended.set()  # a peer's export waiting for a step ends with the engine
        for seq in [*self._running, *self._waiting]:
            seq.chunks.put_nowait(EngineClosedError("the engine was closed"))
        self._running.clear()
        self._waiting.clear()

    # ------------------------------------------------------------------ admission

    def prompt_tokens(self, request: GenerationRequest) -> int:
        self._front.check(request)
        return len(self._prompt_ids(request))

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's simulated token ids, 4 bytes of its text each (checked by the front)."""
        if request.constraints.active:
            # its words come from no tokenizer a grammar could mask; an answer that ignores the
            # tools or schema would look like success to the client
            raise InvalidArgumentError(
                "tools and json_schema need a model engine; this worker is simulated"
            )
        if request.prompt_token_ids and request.tokenizer == self.text_files.digest:
            return list(request.prompt_token_ids)  # the caller's own simulated tokens
        return sim_token_ids(prompt_text(request.messages, request.prompt))

    def _new_sequence(self, request: GenerationRequest) -> _Sequence:
        ids = self._prompt_ids(request)
        prompt_tokens = len(ids)
        params = request.sampling
        budget = self._front.budget(prompt_tokens, params.max_tokens)
        if prompt_tokens + budget > self.roofline.kv_capacity_tokens:
            raise InvalidArgumentError(
                f"prompt and max_tokens need {prompt_tokens + budget} "
                f"tokens of KV cache; this worker "
                f"holds {self.roofline.kv_capacity_tokens}"
            )
        blocks = chain(ids) if self._prefix_caching else []
        if request.peer_prefix is not None:
            self._adopt(blocks, request.peer_prefix)
        seed = (
            params.seed
            if params.seed is not None
            else (0 if params.temperature == 0 else secrets.randbits(63))
        )
        return _Sequence(
            prompt_tokens=prompt_tokens,
            cached_prompt_tokens=self._cached_prompt_tokens(blocks, prompt_tokens),
            budget=budget,
            prefix_blocks=blocks,
            params_stop=params.stop,
            stop_token_ids=frozenset(params.stop_token_ids),
            rng=random.Random(seed),
        )

    def _admit(self, seq: _Sequence) -> None:
        if not self._waiting and self._fits(seq):
            self._start(seq)
        else:
            self._waiting.append(seq)
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        self._wake.set()

    def _fits(self, seq: _Sequence) -> bool:
        return (
            len(self._running) < self.max_parallel
            and self._kv_used + seq.kv_tokens <= self.roofline.kv_capacity_tokens
        )

    def _start(self, seq: _Sequence) -> None:
        seq.queue_s = time.monotonic() - seq.arrived_at
        self._running.append(seq)
        self._kv_used += seq.kv_tokens

    def _abort(self, seq: _Sequence) -> None:
        if seq in self._waiting:
            self._waiting.remove(seq)
        elif seq in self._running:
            self._finish(seq)

    def _finish(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self._kv_used -= seq.kv_tokens
        while self._waiting and self._fits(self._waiting[0]):
            self._start(self._waiting.popleft())

    # ------------------------------------------------------------------ prefix cache

    def _cached_prompt_tokens(self, blocks: list[int], prompt_tokens: int) -> int:
        hits = 0
        for block in blocks:
            if block not in self._prefix_cache:
                break
            self._prefix_cache.move_to_end(block)
            hits += 1
        return min(hits * BLOCK_TOKENS, prompt_tokens - 1)

    def _remember_prefix(self, blocks: list[int]) -> None:
        cache = self._prefix_cache
        self.cache_events.stored([block for block in blocks if block not in cache])
        for block in blocks:
            cache[block] = None
            cache.move_to_end(block)
        evicted = [
            cache.popitem(last=False)[0] for _ in range(len(cache) - self._prefix_cache_blocks)
        ]
        self.cache_events.removed(evicted)

    # ------------------------------------------------------------------ KV blocks with peers

    def blocks_to_pull(self, prefix_hashes: Sequence[int]) -> range:
        held = self.cache_events.held_prefix(prefix_hashes) if self._prefix_caching else 0
        return range(held, len(prefix_hashes) if self._prefix_caching else 0)

    async def export_blocks(self, prefix_hashes: Sequence[int]) -> list[PeerBlock]:
        """The held leading blocks of ``prefix_hashes``, after the step under way (a real engine
        copies them out between two steps) and the time their bytes take over the link; a
        simulated block carries no tensors."""
        if self._running:
            await self._step_ended.wait()
        held = list(itertools.takewhile(self._prefix_cache.__contains__, prefix_hashes))
        for block in held:
            self._prefix_cache.move_to_end(block)  # sent: used
        if self._link_gbps and not self._zero_latency:
            tokens = len(held) * BLOCK_TOKENS
            bytes_per_token = self.capabilities.kv_transfer_bytes_per_token
            await asyncio.sleep(
                kv_transfer_s(tokens, bytes_per_token, self._link_gbps) * self.time_scale
            )
        return [PeerBlock(block, self._block_tensors) for block in held]

    def _adopt(self, names: list[int], prefix: PeerPrefix) -> None:
        """Puts a peer's blocks of this prompt into the prefix cache, where a prefix hit finds
        them: each a simulated block (no tensors, or its bytes) named as the prompt's block at
        its place; from the first that is not, the prompt is computed."""
        taken: list[int] = []
        for number, block in enumerate(prefix.blocks, prefix.first):
            if (
                not self._simulated(block)
                or number >= len(names)
                or block.prefix_hash != names[number]
            ):
                refused = len(prefix.blocks) - len(taken)
                metrics.KV_PULL_REFUSED_BLOCKS.inc(refused)
                logger.warning(
                    "refused %d KV blocks from a peer from block %d on (not this prompt's, or "
                    "not a simulated block): computing them",
                    refused,
                    number,
                )
                break
            taken.append(block.prefix_hash)
        self._remember_prefix(taken)

    def _simulated(self, block: PeerBlock) -> bool:
        """Whether a peer's block is a simulated one: no tensors, or a block's bytes of zeros."""
        if not block.tensors:
            return True
        size = BLOCK_TOKENS * self.capabilities.kv_transfer_bytes_per_token
        (tensor, *others) = block.tensors
        return not others and tensor.dtype == _BLOCK_DTYPE and tensor.shape == (size,)

    # ------------------------------------------------------------------ steps

    async def _step_loop(self) -> None:
        """One iteration per engine step: sleep the step's roofline time, then emit its tokens."""
        loop = asyncio.get_running_loop()
        step_end = loop.time()
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                step_end = loop.time()
                continue
            batch = list(self._running)
            chunks = self._prefill_chunks(batch)
            step_s = 0.0 if self._zero_latency else self._step_s(batch, chunks) * self.time_scale
            step_end = max(step_end, loop.time()) + step_s
            # as the torch engine measures it: a long prompt's attention makes its tokens dearer
            # than the capabilities' one-token estimate says, and the router is told
            self._prefill_speed.add(sum(chunks.values()), step_s)
            await asyncio.sleep(step_end - loop.time())
            for seq, tokens in chunks.items():
                seq.computed += tokens
            emitted = 0
            for seq in batch:
                # not aborted during the step, and decoding or at the end of its prefill
                if (
                    seq in self._running
                    and seq.computed >= seq.prompt_tokens - seq.cached_prompt_tokens
                ):
                    self._advance(seq)
                    emitted += 1
            self._decode_rate.add(emitted)
            self.cache_events.flush()
            self._step_ended.set()
            self._step_ended = asyncio.Event()

    def _prefill_chunks(self, batch: list[_Sequence]) -> dict[_Sequence, int]:
        """The prompt tokens each sequence still prefilling computes this step: the step's chunk
        budget shared oldest first (no budget: every prompt whole)."""
        decoding = any(s.prefilled for s in batch)
        budget = self._chunk_tokens if decoding else self._idle_chunk_tokens
        chunks: dict[_Sequence, int] = {}
        spent = 0
        for seq in batch:
            left = seq.prompt_tokens - seq.cached_prompt_tokens - seq.computed
            if seq.prefilled or left <= 0:
                continue
            if budget and spent == budget:
                break
            chunks[seq] = min(left, budget - spent) if budget else left
            spent += chunks[seq]
        return chunks

    def _step_s(self, batch: list[_Sequence], chunks: dict[_Sequence, int]) -> float:
        roofline = self.roofline
        prefill = sum(
            roofline.prefill_s(tokens, s.cached_prompt_tokens + s.computed)
            for s, tokens in chunks.items()
        )
        contexts = [s.context_tokens for s in batch if s.prefilled]
        decode = roofline.decode_step_s(
            len(contexts), sum(contexts), sum(map(roofline.attended, contexts))
        )
        return prefill + (decode if contexts else 0.0)

    def _advance(self, seq: _Sequence) -> None:
        """Emits the sequence's next token; the first one ends its prefill."""
        if not seq.prefilled:
            seq.prefilled = True
            self._remember_prefix(seq.prefix_blocks)
        token = seq.rng.randrange(len(_WORDS))
        finish: Literal["stop", "length"] | None = None
        text, ids = f" {_WORDS[token]}", [token]
        if token in seq.stop_token_ids:  # a stop token is neither shown nor counted
            finish, text, ids = "stop", "", []
        else:
            seq.generated += 1
            stop_at = min(
                (i for s in seq.params_stop if (i := (seq.text + text).find(s)) >= 0), default=-1
            )
            if stop_at >= 0:
                finish, text = "stop", (seq.text + text)[len(seq.text) : stop_at]
        if finish is None and seq.generated >= seq.budget:
            finish = "length"
        seq.text += text
        seq.chunks.put_nowait(
            GenerationChunk(
                text=text,
                token_ids=ids,
                finish_reason=finish,
                prompt_tokens=seq.prompt_tokens,
                completion_tokens=seq.generated,
                cached_prompt_tokens=seq.cached_prompt_tokens,
                queue_s=seq.queue_s,
            )
        )
        if finish is not None:
            self._finish(seq)
