"""Continuous batching: which sequences run in the next forward pass, and how many tokens each.

Every running sequence that is decoding gets its one token per step; prompt tokens (prefill, or
the recompute of a preempted sequence) share a budget of `prefill_chunk_size` tokens per step,
so a long prompt is computed in chunks beside the running decodes instead of stalling them; with
no sequence decoding nothing waits on the step, and the budget is `idle_prefill_chunk_size`.
New requests join at the next step while there is room (`max_parallel`, cache blocks); a
sequence that finishes or is aborted leaves at once and frees its blocks. When the cache runs
out mid-generation the newest running sequence is preempted: its blocks are freed and it is
recomputed later (with whatever of its prefix is still in the prefix cache).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from worker_svc.torch_engine.kv_cache import BlockManager, BlockTable

logger = logging.getLogger(__name__)

_WATERMARK = 0.01  # share of blocks kept free when admitting, so running sequences can grow


@dataclass
class SequenceState:
    """One request as the scheduler sees it: its tokens and how many of them the cache holds."""

    seq_id: int
    token_ids: list[int]  # the prompt, then the generated tokens
    num_prompt_tokens: int
    max_parallel: int  # run only in a batch of at most this many sequences
    batch_timeout_s: float  # may wait this long for others, to form a larger batch
    block_table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # leading tokens whose latents are in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    admit_deadline: float = 0.0  # set by add_request
    arrived_at: float = 0.0  # set by add_request
    queue_s: float = 0.0  # from arrival to first admission into the batch
    was_admitted: bool = False

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """One new token to compute, after the prompt: not charged to the prefill budget."""
        return self.num_uncomputed == 1 and len(self.token_ids) > self.num_prompt_tokens


@dataclass(frozen=True)
class ScheduledSequence:
    seq: SequenceState
    num_tokens: int  # token_ids[num_computed : num_computed + num_tokens] are computed in this step
    samples: bool  # the step computes the sequence's last token, so its logits give the next one

    @classmethod
    def of(cls, seq: SequenceState, num_tokens: int) -> ScheduledSequence:
        return cls(seq, num_tokens, seq.num_computed + num_tokens == len(seq.token_ids))


@dataclass
class SchedulerOutput:
    """One forward pass: `scheduled` in packed order (single-token sequences first, then prompt
    chunks)."""

    scheduled: list[ScheduledSequence]
    preempted: list[SequenceState]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Decides each step's batch; called by the engine's step loop only (one thread).

    Contract: each scheduling step corresponds to a single forward pass. Per step the caller
    hands over new and aborted requests (`add_request`, `abort_request`), calls `schedule()`,
    runs the forward pass it describes, then `complete_step()`, and `finish_request()` for every
    sequence that ended with the token it sampled.
    """

    def __init__(
        self,
        blocks: BlockManager,
        max_parallel: int,
        prefill_chunk_size: int,
        clock: Callable[[], float] = time.monotonic,
        idle_prefill_chunk_size: int | None = None,
    ):
        self.blocks = blocks
        self.max_parallel, self.prefill_chunk_size = max_parallel, prefill_chunk_size
        self.idle_prefill_chunk_size = idle_prefill_chunk_size or prefill_chunk_size
        self._clock = clock
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # oldest first

    def add_request(self, seq: SequenceState) -> None:
        seq.arrived_at = self._clock()
        seq.admit_deadline = seq.arrived_at + seq.batch_timeout_s
        self.waiting.append(seq)

    def abort_request(self, seq_id: int) -> SequenceState | None:
        """Drop a waiting or running sequence and free its blocks; None if it is not here (already
        finished)."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self.blocks.free(seq.block_table)
                    return seq
        return None

    def finish_request(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def seconds_until_admission(self) -> float | None:
        """With nothing running: how long the oldest waiting request may still be held (None: none
        waits)."""
        if not self.waiting:
            return None
        return max(0.0, self.waiting[0].admit_deadline - self._clock())

    def schedule(self) -> SchedulerOutput:
        decoding = any(seq.is_decoding for seq in self.running)
        budget = self.prefill_chunk_size if decoding else self.idle_prefill_chunk_size
        scheduled: list[ScheduledSequence] = []
        preempted: list[SequenceState] = []
        i = 0
        while i < len(self.running):  # oldest first; preemption pops the newest off the end
            seq = self.running[i]
            i += 1
            n = 1 if seq.is_decoding else min(seq.num_uncomputed, budget)
            if n == 0 or not self._reserve(seq, n, preempted):
                continue
            scheduled.append(ScheduledSequence.of(seq, n))
            budget -= 0 if seq.is_decoding else n
        if not preempted:
            self._admit(budget, scheduled)
        scheduled.sort(key=lambda s: s.num_tokens != 1)  # stable: the single-token group first
        return SchedulerOutput(scheduled, preempted)

    def complete_step(self, output: SchedulerOutput) -> None:
        """The forward pass of `output` ran: its tokens are in the cache (full blocks join the
        prefix cache)."""
        for s in output.scheduled:
            s.seq.num_computed += s.num_tokens
            self.blocks.cache_full_blocks(s.seq.block_table, s.seq.token_ids, s.seq.num_computed)

    def _reserve(self, seq: SequenceState, n: int, preempted: list[SequenceState]) -> bool:
        """Blocks for n more tokens of a running sequence, preempting the newest ones; False if seq
        itself was."""
        while not self.blocks.allocate(seq.block_table, seq.num_computed + n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: SequenceState) -> None:
        logger.info(
            "cache full: preempting sequence %d (%d tokens), recomputed later",
            seq.seq_id,
            seq.num_computed,
        )
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.admit_deadline = float("-inf")
        self.waiting.appendleft(seq)

    def _batch_limit(self) -> int:
        return min([self.max_parallel, *(s.max_parallel for s in self.running)])

    def _admit(self, budget: int, scheduled: list[ScheduledSequence]) -> None:
        """Move waiting sequences into the batch (FIFO) while there is room and prefill budget."""
        free_slots = self._batch_limit() - len(self.running)
        if free_slots <= 0 or not self.waiting:
            return
        if len(self.waiting) < free_slots and self._clock() < self.waiting[0].admit_deadline:
            return  # hold: more requests may come to form a larger batch
        # alone, a sequence may use every block (the engine checks that the cache holds a whole
        # context)
        watermark = int(_WATERMARK * self.blocks.num_blocks) if self.running else 0
        while self.waiting and budget > 0 and len(self.running) < self._batch_limit():
            seq = self.waiting[0]
            if len(self.running) >= seq.max_parallel:
                break
            cached = self.blocks.match_prefix(seq.block_table, seq.token_ids)
            n = min(seq.num_uncomputed - cached, budget)
            needed = self.blocks.blocks_needed(seq.block_table, cached + n)
            if needed > self.blocks.num_free_blocks - watermark:
                self.blocks.free(seq.block_table)
                break
            self.blocks.allocate(seq.block_table, cached + n)
            if not seq.was_admitted:
                seq.num_cached_prompt_tokens, seq.was_admitted = cached, True
                seq.queue_s = self._clock() - seq.arrived_at
            seq.num_computed = cached
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n
