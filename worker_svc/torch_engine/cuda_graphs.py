"""Decode steps replayed from CUDA graphs: one launch of the whole captured step instead of the
hundreds of kernel launches an eager step makes (a decode step of a few sequences is launch-bound
on a GPU).

A graph holds fixed shapes and fixed addresses, so each is captured for a bucket: a batch size of
`[engine] cuda_graph_batch_sizes` and a key length (a power of two, at least 256), over static
input buffers the model runner fills before each replay. The padding rows of a smaller batch, and
the keys past a sequence's length, point at a scratch block of the cache no sequence holds. A
bucket is captured the first time a step needs it. A capture that fails (an op of the step that
synchronises with the host, a kernel that cannot be captured) is logged once, naming the batch
size, and that size runs eager from then on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker_svc.model.model import Transformer
from worker_svc.model.paged_batch import AttentionGroup, BatchLayout, KVCache

logger = logging.getLogger(__name__)

# keys a captured step attends over: the next power of two of the batch's longest context, from
# this many (so short contexts share one graph)
_MIN_KEYS = 256
# eager runs before a capture: Triton compiles and autotunes, torch allocates, outside the graph
_WARMUP_RUNS = 2

# given the step (a function of the static buffers), what replays it
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def batch_bucket(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured batch size that holds `batch` sequences; None past the largest."""
    fitting = [size for size in sizes if size >= batch]
    return min(fitting) if fitting else None


def key_bucket(keys: int) -> int:
    """The key length a step of `keys` keys is captured for: the next power of two, at least
    256."""
    return max(_MIN_KEYS, 1 << (keys - 1).bit_length())


class CudaGraphCapture:
    """Captures steps as CUDA graphs that share one memory pool (they never run at once)."""

    def __init__(self) -> None:
        self._first: torch.cuda.CUDAGraph | None = None  # whose pool the later graphs share

    def __call__(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Runs `step` eagerly on a side stream (compiling and allocating), then captures it; ->
        replay, which reruns the captured kernels on whatever the static buffers hold and returns
        the step's output tensor (the same one each time)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_RUNS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        pool = None if self._first is None else self._first.pool()
        # thread_local: what the worker's other threads do on the GPU meanwhile does not void it
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = step()
        if self._first is None:
            self._first = graph

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


@dataclass
class DecodeInputs:
    """One decode step's inputs padded to its bucket (batch, keys), on the device: token, position
    and cache slot of each sequence's new token, its keys' cache slots [batch, keys]."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    key_slots: torch.Tensor


class _Graph:
    """A captured step's static buffers and its replay."""

    def __init__(self, inputs: DecodeInputs, replay: Callable[[], torch.Tensor]):
        self.inputs, self.replay = inputs, replay


class DecodeGraphs:
    """The captured decode steps of one model and cache, per (batch, keys) bucket."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        batch_sizes: Sequence[int],
        scratch_block: int,
        capture: Capture | None = None,
    ):
        """scratch_block: a block of `cache` no sequence holds (padding reads and writes it);
        capture: how a step becomes a replay (None: CUDA graphs; tests give a stand-in)."""
        self.model, self.cache = model, cache
        self.capture = capture or CudaGraphCapture()
        self.batch_sizes = sorted(set(batch_sizes))
        self.scratch_block = scratch_block
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._eager_sizes: set[int] = set()  # their capture failed

    def bucket(self, batch: int, keys: int) -> tuple[int, int] | None:
        """(batch size, key length) of the graph a decode step of `batch` sequences over at most
        `keys` keys replays; None when it runs eager."""
        size = batch_bucket(batch, self.batch_sizes)
        if size is None or size in self._eager_sizes:
            return None
        return size, key_bucket(keys)

    def run(self, bucket: tuple[int, int], inputs: DecodeInputs) -> torch.Tensor | None:
        """Logits [batch size, vocab] (fp32, rows past the step's sequences are padding) of the
        step whose padded inputs are `inputs`, replayed from the bucket's graph (captured now if
        this is its first step); None if its capture failed (then the step runs eager)."""
        graph = self._graphs.get(bucket) or self._capture(bucket)
        if graph is None:
            return None
        for static, value in zip(_tensors(graph.inputs), _tensors(inputs), strict=True):
            static.copy_(value)
        return graph.replay()

    def _capture(self, bucket: tuple[int, int]) -> _Graph | None:
        size, keys = bucket
        inputs = self._padding(size, keys)
        started = time.perf_counter()
        try:
            replay = self.capture(lambda: self._step(inputs))
        except Exception as e:  # never a crash: this size runs eager from now on
            self._eager_sizes.add(size)
            logger.warning(
                "capturing the decode step at batch size %d as a CUDA graph failed, so it runs "
                "eager: %s: %s",
                size,
                type(e).__name__,
                e,
            )
            return None
        logger.info(
            "captured the decode step at batch size %d over %d keys in %.2f s",
            size,
            keys,
            time.perf_counter() - started,
        )
        self._graphs[bucket] = _Graph(inputs, replay)
        return self._graphs[bucket]

    def _padding(self, size: int, keys: int) -> DecodeInputs:
        """Static buffers holding a batch of padding only: every read and write on the scratch
        block, at position 0."""
        device = self.cache.kv.device
        scratch = self.scratch_block * self.cache.block_size
        return DecodeInputs(
            tokens=torch.zeros(size, dtype=torch.long, device=device),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            write_slots=torch.full((size,), scratch, dtype=torch.long, device=device),
            key_slots=torch.full((size, keys), scratch, dtype=torch.long, device=device),
        )

    def _step(self, inputs: DecodeInputs) -> torch.Tensor:
        """The decode step over the static buffers; the layout is built anew on every call so its
        mask is computed inside the captured step, from the buffers, not cached from a warm-up."""
        size = inputs.tokens.size(0)
        group = AttentionGroup.build(0, inputs.positions.unsqueeze(1), inputs.key_slots)
        layout = BatchLayout(
            positions=inputs.positions,
            write_slots=inputs.write_slots,
            groups=[group],
            logits_index=torch.arange(size, device=inputs.tokens.device),
        )
        return self.model.forward_batch(inputs.tokens, layout, self.cache)


def _tensors(inputs: DecodeInputs) -> tuple[torch.Tensor, ...]:
    return inputs.tokens, inputs.positions, inputs.write_slots, inputs.key_slots
