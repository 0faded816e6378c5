"""The continuous-batching scheduler on its own: budgets, admission, holding, preemption, aborts."""

from __future__ import annotations

import itertools

import pytest

from worker_svc.torch_engine.kv_cache import BlockManager
from worker_svc.torch_engine.scheduler import Scheduler, SchedulerOutput, SequenceState

_ids = itertools.count()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_parallel: int = 8,
    chunk: int = 16,
    clock: _Clock | None = None,
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_parallel, chunk, clock or _Clock())


def _seq(
    prompt_len: int, *, max_parallel: int = 8, timeout_s: float = 0.0, first: int = 0
) -> SequenceState:
    return SequenceState(
        next(_ids), list(range(first, first + prompt_len)), prompt_len, max_parallel, timeout_s
    )


def _run_step(s: Scheduler) -> SchedulerOutput:
    """schedule(), then what the engine does after the forward pass: a token for each sequence that
    samples."""
    out = s.schedule()
    sampled = [x.seq for x in out.scheduled if x.samples]
    s.complete_step(out)
    for seq in sampled:
        seq.token_ids.append(7)
    return out


def _tokens(out: SchedulerOutput) -> dict[int, int]:
    return {x.seq.seq_id: x.num_tokens for x in out.scheduled}


def test_decodes_run_beside_a_chunked_prefill_within_the_budget():
    s = _scheduler(chunk=16)
    decoders = [_seq(3) for _ in range(3)]
    for seq in decoders:
        s.add_request(seq)
    _run_step(s)  # the three prompts in one step (9 tokens)
    long = _seq(40)
    s.add_request(long)
    steps = []
    while long.num_computed < 40:
        out = _run_step(s)
        steps.append(out)
        # no decode waits for the long prompt
        assert all(_tokens(out)[d.seq_id] == 1 for d in decoders)
        assert [x.num_tokens for x in out.scheduled][:3] == [1, 1, 1]  # single-token group first
        assert _tokens(out)[long.seq_id] <= 16
    assert [_tokens(o)[long.seq_id] for o in steps] == [16, 16, 8]
    assert steps[-1].scheduled[-1].samples and not steps[0].scheduled[-1].samples


def test_prefill_budget_is_shared_by_new_prompts():
    s = _scheduler(chunk=10)
    a, b = _seq(6), _seq(6)
    s.add_request(a)
    s.add_request(b)
    out = _run_step(s)
    assert _tokens(out) == {a.seq_id: 6, b.seq_id: 4} and out.num_tokens == 10
    out = _run_step(s)
    assert _tokens(out) == {a.seq_id: 1, b.seq_id: 2}  # a decodes, b finishes its prompt


def test_new_requests_join_at_the_next_step_and_finished_ones_leave_at_once():
    s = _scheduler()
    a = _seq(4)
    s.add_request(a)
    _run_step(s)
    b = _seq(4)
    s.add_request(b)
    assert set(_tokens(_run_step(s))) == {a.seq_id, b.seq_id}
    s.finish_request(a)
    assert set(_tokens(_run_step(s))) == {b.seq_id}


def test_max_parallel_and_the_per_request_hint():
    s = _scheduler(max_parallel=2)
    seqs = [_seq(2) for _ in range(3)]
    for seq in seqs:
        s.add_request(seq)
    assert set(_tokens(_run_step(s))) == {seqs[0].seq_id, seqs[1].seq_id} and len(s.waiting) == 1
    s.finish_request(seqs[0])
    assert seqs[2].seq_id in _tokens(_run_step(s))

    s = _scheduler(max_parallel=8)
    alone, other = _seq(2, max_parallel=1), _seq(2)
    s.add_request(alone)
    s.add_request(other)
    assert set(_tokens(_run_step(s))) == {alone.seq_id}  # runs in a batch of one
    assert set(_tokens(_run_step(s))) == {alone.seq_id}
    s.finish_request(alone)
    assert set(_tokens(_run_step(s))) == {other.seq_id}


def test_a_request_is_held_for_the_batch_timeout_unless_the_batch_fills():
    clock = _Clock()
    s = _scheduler(max_parallel=2, clock=clock)
    first = _seq(2, timeout_s=0.2)
    s.add_request(first)
    assert _run_step(s).scheduled == [] and s.seconds_until_admission() == pytest.approx(0.2)
    clock.now += 0.2
    assert set(_tokens(_run_step(s))) == {first.seq_id}

    s = _scheduler(max_parallel=2, clock=clock)
    pair = [_seq(2, timeout_s=5.0), _seq(2, timeout_s=5.0)]
    s.add_request(pair[0])
    assert _run_step(s).scheduled == []
    s.add_request(pair[1])
    # the batch is full: no more waiting
    assert set(_tokens(_run_step(s))) == {p.seq_id for p in pair}


def test_cache_exhaustion_preempts_the_newest_and_recomputes_it():
    s = _scheduler(num_blocks=4, block_size=4, chunk=64)
    old, new = _seq(6), _seq(5, first=50)
    s.add_request(old)
    s.add_request(new)
    _run_step(s)  # 2 blocks each: the cache is full
    for _ in range(2):
        _run_step(s)  # old computes slots 6 and 7, new 5 and 6: both still in 2 blocks
    out = _run_step(s)  # old's slot 8 needs a third block: new is preempted
    assert out.preempted == [new] and _tokens(out) == {old.seq_id: 1}
    assert new.num_computed == 0 and s.waiting[0] is new and len(new.token_ids) == 8
    s.finish_request(old)
    out = _run_step(s)
    # recomputed in one chunk, but for its first block, still in the prefix cache
    assert _tokens(out) == {new.seq_id: 4} and new.num_computed == 8
    # usage counts the first admission
    assert out.scheduled[0].samples and new.num_cached_prompt_tokens == 0


def test_abort_frees_the_blocks_of_running_and_waiting_sequences():
    s = _scheduler(max_parallel=1)
    running, waiting = _seq(9), _seq(9)
    s.add_request(running)
    s.add_request(waiting)
    _run_step(s)
    assert s.blocks.usage > 0
    assert s.abort_request(running.seq_id) is running
    assert s.blocks.usage == 0 and s.running == []
    assert s.abort_request(waiting.seq_id) is waiting and not s.has_unfinished()
    assert s.abort_request(12345) is None


def test_a_repeated_prefix_is_not_recomputed():
    s = _scheduler(block_size=4, chunk=64)
    system = list(range(200, 213))  # 13 tokens: 3 full blocks
    first = SequenceState(next(_ids), [*system, 1, 2], 15, 8, 0.0)
    s.add_request(first)
    _run_step(s)
    s.finish_request(first)
    second = SequenceState(next(_ids), [*system, 3, 4, 5], 16, 8, 0.0)
    s.add_request(second)
    out = _run_step(s)
    assert second.num_cached_prompt_tokens == 12 and _tokens(out) == {second.seq_id: 4}


def test_with_nothing_decoding_prompts_share_the_idle_budget():
    s = Scheduler(BlockManager(128, 4), 8, 16, _Clock(), idle_prefill_chunk_size=48)
    short, long = _seq(3), _seq(200)
    s.add_request(short)
    s.add_request(long)
    assert _tokens(_run_step(s)) == {short.seq_id: 3, long.seq_id: 45}  # nothing decodes yet
    # short decodes now: the long prompt's chunks shrink so that it never waits long
    assert _tokens(_run_step(s)) == {short.seq_id: 1, long.seq_id: 16}
