"""The async front of the DeepSeek-V3 engine: requests in, streamed text chunks out.

`generate()` puts a request through request_front's `RequestFront`, tokenizes it, hands it to the
engine core (worker_svc.torch_engine.step_loop, one background thread) as a `RequestState` over a
scheduler `SequenceState`, and reads its chunks from an asyncio queue that the core fills.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import secrets
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from infermesh import prefix_hash
from infermesh.config import ConfigError
from infermesh.text.chat_templates import ReasoningFormat
from infermesh.text.tokenizer import Tokenizer
from telemetry import metrics
from worker_svc.config import CacheSection, ParallelSection
from worker_svc.decoding.completion_decoder import CompletionDecoder
from worker_svc.decoding.grammar import GrammarCompiler
from worker_svc.decoding.reasoning_parser import thinking_of
from worker_svc.engine.api import (
    DeviceCapabilities,
    EngineLoad,
    GenerationChunk,
    GenerationRequest,
    PeerBlock,
    PeerPrefix,
    RawTensor,
    drain_chunks,
)
from worker_svc.engine.cache_events import CacheEvents
from worker_svc.engine.prompt_ids import prompt_token_ids
from worker_svc.engine.request_front import RequestFront, bounded_batching_hints
from worker_svc.model.checkpoint import load_checkpoint, read_config
from worker_svc.model.model import Transformer
from worker_svc.model.precision import TORCH_DTYPES, detect_capabilities, resolve_device
from worker_svc.torch_engine.cuda_graphs import DecodeGraphs
from worker_svc.torch_engine.kv_cache import (
    BlockManager,
    bytes_per_token,
    cache_budget_bytes,
    index_bytes_per_token,
    latent_bytes_per_token,
)
from worker_svc.torch_engine.model_runner import ModelRunner
from worker_svc.torch_engine.scheduler import Scheduler, SequenceState
from worker_svc.torch_engine.step_loop import RequestState, StepLoop, emitter

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- engine


class Engine:
    """Entry point of the worker: load with `from_checkpoint`, then `generate()` concurrently."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        capabilities: DeviceCapabilities,
        device: torch.device,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        parallel: ParallelSection,
        cache: CacheSection,
        cuda_graph_batch_sizes: Sequence[int] = (),
    ):
        """cuda_graph_batch_sizes: decode batch sizes replayed from CUDA graphs on a CUDA device
        (`[engine] cuda_graph_batch_sizes`; empty: every step eager)."""
        self.model, self.tokenizer, self.capabilities = model, tokenizer, capabilities
        self.text_files = tokenizer.text_files
        self.max_model_len = max_model_len
        self.parallel = parallel.resolved(capabilities.device, capabilities.device_name)
        self._eos_token_ids = eos_token_ids
        self._seq_ids = itertools.count()
        self.grammars = GrammarCompiler(tokenizer, model.args.vocab_size, sorted(eos_token_ids))
        self.cache_events = CacheEvents(cache.events_history, cache.events_backlog)
        blocks = _block_manager(model, device, max_model_len, cache, self.cache_events)
        graphs_on = device.type == "cuda" and bool(cuda_graph_batch_sizes)
        # with CUDA graphs one more block: the scratch block their padding reads and writes
        kv_cache = model.setup_cache(blocks.num_blocks + graphs_on, blocks.block_size)
        dtype = model.lm_head.weight.dtype
        self.capabilities = dataclasses.replace(
            capabilities,
            kv_cache_bytes=kv_cache.nbytes,
            kv_transfer_bytes_per_token=bytes_per_token(model.args, dtype),
            prefill_chunk_tokens=self.parallel.prefill_chunk_size,
        )
        self._blocks = blocks
        # what a token's cache is made of: the latent and rope'd key, then (V3.2) indexer keys
        self._cache_tensors = [t for t in (kv_cache.kv, kv_cache.index_k) if t is not None]
        logger.info(
            "latent cache: %d blocks of %d tokens (%.1f MB; "
            "per token %d B latent + %d B indexer keys); "
            "max_parallel %d, batch timeout %d ms",
            blocks.num_blocks,
            blocks.block_size,
            kv_cache.nbytes / 2**20,
            latent_bytes_per_token(model.args, dtype),
            index_bytes_per_token(model.args, dtype),
            self.parallel.max_parallel,
            self.parallel.dynamic_batch_timeout_ms,
        )
        self._front = RequestFront(
            vocab_size=model.args.vocab_size,
            max_model_len=max_model_len,
            max_parallel=self.parallel.max_parallel,
            max_waiting=self.parallel.max_waiting,
        )
        scheduler = Scheduler(
            blocks,
            self.parallel.max_parallel,
            self.parallel.prefill_chunk_size,
            idle_prefill_chunk_size=self.parallel.idle_prefill_chunk_size,
        )
        graphs = (
            DecodeGraphs(model, kv_cache, cuda_graph_batch_sizes, scratch_block=blocks.num_blocks)
            if graphs_on
            else None
        )
        runner = ModelRunner(model, kv_cache, device, graphs)
        self._loop = StepLoop(scheduler, runner, tokenizer)

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        use_native_fp8: bool | None = None,
        max_model_len: int | None = None,
        device: str = "auto",
        parallel: ParallelSection | None = None,
        cache: CacheSection | None = None,
        chat_template: str | None = None,
        reasoning_format: ReasoningFormat | None = None,
        cuda_graph_batch_sizes: Sequence[int] = (),
        grouped_moe: bool = True,
    ) -> Engine:
        """Load weights and tokenizer and allocate the cache (blocking: call it before serving, or
        in a thread). ``chat_template``: a template file served instead of the checkpoint's;
        ``reasoning_format``: how the model reasons (None: as its chat template says);
        ``cuda_graph_batch_sizes``: decode batch sizes replayed from CUDA graphs on a GPU;
        ``grouped_moe``: the routed experts as grouped launches where the kernel runs."""
        # OpenMP keeps a pool of worker threads for each thread that ran a parallel op; with more
        # pooled threads than cores it stops spinning between ops, and each op of the step loop then
        # waits for a futex wake-up (a CPU decode step ~30% slower). Loading and allocating in a
        # thread that ends takes its pool along: the step loop's is the process's only one.
        load = functools.partial(
            cls._load,
            model_dir,
            dtype=dtype,
            use_native_fp8=use_native_fp8,
            max_model_len=max_model_len,
            device=device,
            parallel=parallel,
            cache=cache,
            chat_template=chat_template,
            reasoning_format=reasoning_format,
            cuda_graph_batch_sizes=cuda_graph_batch_sizes,
            grouped_moe=grouped_moe,
        )
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="worker-load") as loader:
            return loader.submit(load).result()

    @classmethod
    def _load(
        cls,
        model_dir: str | Path,
        *,
        dtype: str,
        use_native_fp8: bool | None,
        max_model_len: int | None,
        device: str,
        parallel: ParallelSection | None,
        cache: CacheSection | None,
        chat_template: str | None,
        reasoning_format: ReasoningFormat | None,
        cuda_graph_batch_sizes: Sequence[int],
        grouped_moe: bool,
    ) -> Engine:
        torch_device = resolve_device(device)
        fp8_weights = "quantization_config" in read_config(model_dir)[0]  # DeepSeek-V2 ships BF16
        try:
            caps = detect_capabilities(
                torch_device, dtype=dtype, use_native_fp8=use_native_fp8, fp8_weights=fp8_weights
            )
        except ValueError as e:  # an override this machine or checkpoint cannot honour
            raise ConfigError(f"[model] dtype: {e}") from None
        model, config = load_checkpoint(
            model_dir, TORCH_DTYPES[caps.precision], torch_device, grouped_moe=grouped_moe
        )
        weight_bytes = sum(t.nbytes for t in model.state_dict().values())
        caps = dataclasses.replace(
            caps,
            weight_bytes=weight_bytes,
            model_type=config["model_type"],
            index_topk=model.args.index_topk,
        )
        context = config["max_position_embeddings"]
        if max_model_len is not None and not 0 < max_model_len <= context:
            raise ConfigError(
                f"[attention] max_model_len: {max_model_len} must be in 1..{context} "
                "(the checkpoint's max_position_embeddings)"
            )
        tokenizer = Tokenizer(model_dir, chat_template)
        caps = dataclasses.replace(
            caps,
            reasoning_format=tokenizer.reasoning_format
            if reasoning_format is None
            else reasoning_format,
        )
        eos = _eos_token_ids(Path(model_dir), config, tokenizer)
        logger.info(
            "loaded %s: %.1f MB of weights as %s", model_dir, weight_bytes / 2**20, caps.precision
        )
        return cls(
            model,
            tokenizer,
            caps,
            torch_device,
            max_model_len or context,
            eos,
            parallel or ParallelSection(),
            cache or CacheSection(),
            cuda_graph_batch_sizes,
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream the completion; the last chunk carries finish_reason. Stopping iteration aborts
        it.

        Raises EngineClosedError, InvalidArgumentError or EngineOverloadedError before any chunk.
        """
        self._front.check(request)
        state, queue = self._request_state(request)
        with self._front.admitted():
            self._loop.submit(state)
            abort = functools.partial(self._loop.abort, state.seq.seq_id)
            async with contextlib.aclosing(drain_chunks(queue, abort)) as chunks:
                async for chunk in chunks:
                    yield chunk

    def prompt_tokens(self, request: GenerationRequest) -> int:
        self._front.check(request)
        return len(prompt_token_ids(self.tokenizer, request))

    def load(self) -> EngineLoad:
        return self._loop.load()

    def blocks_to_pull(self, prefix_hashes: Sequence[int]) -> range:
        per_block = self._blocks.block_size // prefix_hash.BLOCK_TOKENS
        held = self.cache_events.held_prefix(prefix_hashes)
        return range(held // per_block * per_block, len(prefix_hashes) // per_block * per_block)

    async def export_blocks(self, prefix_hashes: Sequence[int]) -> list[PeerBlock]:
        names = list(prefix_hashes)
        # between two steps, so that no block is reclaimed while it is copied
        gathered = await asyncio.wrap_future(
            self._loop.call(functools.partial(self._gather, names))
        )
        if not gathered:
            return []
        count = gathered[0].size(1) // prefix_hash.BLOCK_TOKENS
        # [count, n_layers, BLOCK_TOKENS, width] per tensor, each block's bytes one row
        rows = [
            t.unflatten(1, (count, prefix_hash.BLOCK_TOKENS)).transpose(0, 1).contiguous().cpu()
            for t in gathered
        ]
        raw = [
            (r.view(torch.uint8).numpy(), _dtype_name(r.dtype), tuple(r.shape[1:])) for r in rows
        ]
        return [
            PeerBlock(
                name,
                tuple(RawTensor(data[i].tobytes(), dtype, shape) for data, dtype, shape in raw),
            )
            for i, name in enumerate(names[:count])
        ]

    def _gather(self, names: list[int]) -> list[torch.Tensor]:
        """A copy of each cache tensor's slots of the held blocks ``names`` starts with
        ([n_layers, blocks * BLOCK_TOKENS, width]); none when it holds the first not. On the step
        loop's thread."""
        slots = self._blocks.slots_of(names)
        if not slots:
            return []
        device = self._cache_tensors[0].device
        offsets = torch.arange(prefix_hash.BLOCK_TOKENS)
        index = (torch.tensor(slots).unsqueeze(1) + offsets).flatten().to(device)
        return [t.index_select(1, index) for t in self._cache_tensors]

    def _peer_kv(self, prompt_ids: list[int], prefix: PeerPrefix) -> Callable[[], None] | None:
        """What puts the blocks of ``prefix`` that match this prompt and this cache into the
        prefix cache (to run on the step loop's thread before the request joins); None when
        none does. A block whose name, dtype, shape or size is not what this engine would have
        computed is refused, and it and those after it are computed instead."""
        bs = self._blocks.block_size
        per_block = bs // prefix_hash.BLOCK_TOKENS
        names = prefix_hash.chain(prompt_ids)
        first = -(-prefix.first // per_block) * per_block  # at a block of this cache
        offered = prefix.blocks[first - prefix.first :]
        expected: list[tuple[str, tuple[int, ...]]] = [
            (_dtype_name(t.dtype), (t.size(0), prefix_hash.BLOCK_TOKENS, t.size(2)))
            for t in self._cache_tensors
        ]
        good = 0
        for number, block in enumerate(offered, first):
            if not _matches(block, names[number] if number < len(names) else None, expected):
                metrics.KV_PULL_REFUSED_BLOCKS.inc(len(offered) - good)
                logger.warning(
                    "refused %d KV blocks from a peer from block %d on (its name, dtype, shape "
                    "or size is not this prompt's): computing them",
                    len(offered) - good,
                    number,
                )
                break
            good += 1
        good = good // per_block * per_block
        if not good:
            return None
        decoded = [
            torch.frombuffer(
                bytearray(b"".join(block.tensors[j].data for block in offered[:good])),
                dtype=t.dtype,
            )
            .view(good, *shape)
            .transpose(0, 1)
            .flatten(1, 2)
            for j, (t, (_, shape)) in enumerate(zip(self._cache_tensors, expected, strict=True))
        ]
        start = first // per_block

        def adopt() -> None:
            for number, block in self._blocks.adopt(prompt_ids, start, start + good // per_block):
                offset = (number - start) * bs
                for cache, source in zip(self._cache_tensors, decoded, strict=True):
                    cache[:, block * bs : (block + 1) * bs].copy_(source[:, offset : offset + bs])

        return adopt

    async def close(self) -> None:
        """Stop the step loop; streams still running end with EngineClosedError."""
        self._front.close()
        await asyncio.to_thread(self._loop.close)

    def _request_state(
        self,
        request: GenerationRequest,
    ) -> tuple[RequestState, asyncio.Queue[GenerationChunk | BaseException]]:
        """The checked request, tokenized and budgeted, as the step loop takes it."""
        prompt_ids = prompt_token_ids(self.tokenizer, request)
        params = request.sampling
        matcher = self.grammars.matcher(request.constraints)
        max_len = len(prompt_ids) + self._front.budget(len(prompt_ids), params.max_tokens)
        max_parallel, timeout_ms = bounded_batching_hints(
            request, self.parallel.max_parallel, self.parallel.dynamic_batch_timeout_ms
        )
        queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = SequenceState(
            next(self._seq_ids), list(prompt_ids), len(prompt_ids), max_parallel, timeout_ms / 1000
        )
        state = RequestState(
            seq=seq,
            request_id=request.request_id,
            params=params,
            max_len=max_len,
            stop_token_ids=self._eos_token_ids | frozenset(params.stop_token_ids),
            decoder=CompletionDecoder(
                self.tokenizer,
                params.stop,
                request.constraints,
                self.grammars.markers,
                thinking_of(self.tokenizer, self.capabilities.reasoning_format, request),
            ),
            generator=torch.Generator().manual_seed(seed),
            emit=emitter(asyncio.get_running_loop(), queue),
            matcher=matcher,
            adopt_peer_kv=None
            if request.peer_prefix is None
            else self._peer_kv(prompt_ids, request.peer_prefix),
        )
        return state, queue


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _matches(
    block: PeerBlock, name: int | None, expected: list[tuple[str, tuple[int, ...]]]
) -> bool:
    """Whether a peer's block is the one named ``name``, in this cache's dtypes and shapes."""
    if block.prefix_hash != name or len(block.tensors) != len(expected):
        return False
    for tensor, (dtype, shape) in zip(block.tensors, expected, strict=True):
        size = getattr(torch, dtype).itemsize * shape[0] * shape[1] * shape[2]
        if tensor.dtype != dtype or tensor.shape != shape or len(tensor.data) != size:
            return False
    return True


def _block_manager(
    model: Transformer,
    device: torch.device,
    max_model_len: int,
    cache: CacheSection,
    events: CacheEvents,
) -> BlockManager:
    """As many blocks as the memory budget holds; at least one whole context, so any request can
    finish."""
    per_block = bytes_per_token(model.args, model.lm_head.weight.dtype) * cache.block_size
    needed = -(-max_model_len // cache.block_size)
    num_blocks = cache_budget_bytes(device, cache, needed * per_block) // per_block
    if num_blocks < needed:
        knob = "gpu_memory_utilization" if device.type == "cuda" else "cpu_cache_bytes"
        raise ConfigError(
            f"[cache] {knob}: the latent cache would hold "
            f"{max(num_blocks, 0) * cache.block_size} tokens, fewer "
            f"than one context of max_model_len={max_model_len} "
            f"({needed * per_block} bytes); raise {knob} or "
            "lower [attention] max_model_len"
        )
    return BlockManager(
        num_blocks,
        cache.block_size,
        cache.enable_prefix_caching,
        events,
    )


def _eos_token_ids(model_dir: Path, config: dict[str, Any], tokenizer: Tokenizer) -> frozenset[int]:
    """eos ids from generation_config.json (int or list), else config.json, else the tokenizer."""
    eos = config.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else eos or [])
