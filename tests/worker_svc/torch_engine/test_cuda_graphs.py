"""Decode steps replayed from CUDA graphs (worker_svc/torch_engine/cuda_graphs.py), on a CPU.

There is no CUDA graph here: the capture is a stand-in that speaks its protocol (warm up, then a
replay that reruns the step on whatever the static buffers hold), so what the engine adds around
a graph is checked: the buckets, the padding onto the scratch block, the static buffers, the eager
fallback with one warning. bench/hopper_suite.py checks real graphs on a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn

from worker_svc.model.model import ModelArgs, Transformer
from worker_svc.torch_engine.cuda_graphs import DecodeGraphs, batch_bucket, key_bucket
from worker_svc.torch_engine.kv_cache import BlockTable
from worker_svc.torch_engine.model_runner import ModelRunner
from worker_svc.torch_engine.scheduler import ScheduledSequence, SchedulerOutput, SequenceState

_BLOCK = 16
_BLOCKS = 12  # the sequences' blocks; one more is the scratch block
_ARGS = ModelArgs(
    vocab_size=128,
    dim=64,
    inter_dim=96,
    n_layers=2,
    n_heads=2,
    max_seq_len=512,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_inter_dim=32,
    n_dense_layers=1,
    n_routed_experts=4,
    n_activated_experts=2,
    n_expert_groups=1,
    n_limited_groups=1,
)


def test_buckets() -> None:
    sizes = [1, 2, 4, 8]
    assert [batch_bucket(b, sizes) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [key_bucket(k) for k in (1, 255, 256, 257, 4096, 4097)] == [
        256,
        256,
        256,
        512,
        4096,
        8192,
    ]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(_ARGS)
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    model.pack_weights()
    return model.eval()


def _prefilled(model: Transformer, lengths: list[int]) -> tuple[ModelRunner, list[SequenceState]]:
    """A cache (with the scratch block) holding sequences of `lengths` prompt tokens, prefilled
    eagerly, each with its next token appended."""
    cache = model.setup_cache(_BLOCKS + 1, _BLOCK)
    runner = ModelRunner(model, cache, torch.device("cpu"))
    seqs, first = [], 0
    for i, length in enumerate(lengths):
        blocks = -(-(length + 1) // _BLOCK)
        table = BlockTable(list(range(first, first + blocks)))
        first += blocks
        tokens = torch.randint(
            1, _ARGS.vocab_size, (length,), generator=torch.Generator().manual_seed(i)
        )
        seq = SequenceState(i, tokens.tolist(), length, 8, 0.0, table)
        runner.execute(SchedulerOutput([ScheduledSequence.of(seq, length)], []))
        seq.num_computed = length
        seq.token_ids.append(7 + i)
        seqs.append(seq)
    return runner, seqs


def _decode(seqs: list[SequenceState]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledSequence.of(seq, 1) for seq in seqs], [])


def _replaying_stand_in(
    calls: list[int],
) -> Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
    """A capture as CUDA's behaves: runs the step to warm up, then replays it on the static
    buffers."""

    def capture(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        calls.append(1)
        step()
        return step

    return capture


def test_a_replayed_step_gives_the_eager_steps_logits_and_writes_only_its_slots(
    model: Transformer,
) -> None:
    """Three sequences of different lengths run in the batch-4 graph: one padding row, keys
    padded to 256; the logits are the eager step's, and the cache differs only in the step's own
    slots and the scratch block."""
    runner, seqs = _prefilled(model, [5, 17, 33])
    before = runner.cache.kv.clone()
    expected = runner.execute(_decode(seqs))
    eager_cache = runner.cache.kv.clone()
    runner.cache.kv.copy_(before)
    calls: list[int] = []
    runner.graphs = DecodeGraphs(
        model, runner.cache, [1, 2, 4], scratch_block=_BLOCKS, capture=_replaying_stand_in(calls)
    )
    got = runner.execute(_decode(seqs))
    assert calls == [1] and runner.graphs.bucket(3, 34) == (4, 256)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    changed = (runner.cache.kv != before).any(dim=(0, 2)).nonzero().flatten().tolist()
    written = [
        s.block_table.blocks[s.num_computed // _BLOCK] * _BLOCK + s.num_computed % _BLOCK
        for s in seqs
    ]
    scratch = set(range(_BLOCKS * _BLOCK, (_BLOCKS + 1) * _BLOCK))
    assert set(changed) - scratch == set(written)
    real = slice(0, _BLOCKS * _BLOCK)
    torch.testing.assert_close(runner.cache.kv[:, real], eager_cache[:, real], rtol=1e-5, atol=1e-6)
    runner.execute(_decode(seqs[:2]))  # batch 2: a second bucket, captured on first use
    assert calls == [1, 1]


def test_a_failed_capture_runs_eager_with_one_warning_naming_the_batch_size(
    model: Transformer, caplog: pytest.LogCaptureFixture
) -> None:
    runner, seqs = _prefilled(model, [4, 9])
    expected = runner.execute(_decode(seqs))
    attempts: list[int] = []

    def refuse(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    runner.graphs = DecodeGraphs(model, runner.cache, [2, 8], scratch_block=_BLOCKS, capture=refuse)
    with caplog.at_level(logging.WARNING):
        first = runner.execute(_decode(seqs))
        second = runner.execute(_decode(seqs))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "batch size 2" in warnings[0].getMessage()
    assert "operation not permitted" in warnings[0].getMessage()
    assert attempts == [1]  # not retried
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert runner.graphs.bucket(2, 10) is None and runner.graphs.bucket(3, 10) == (8, 256)


def test_prefill_and_batches_past_the_largest_size_run_eager(model: Transformer) -> None:
    runner, seqs = _prefilled(model, [3, 6, 8])
    calls: list[int] = []
    runner.graphs = DecodeGraphs(
        model, runner.cache, [2], scratch_block=_BLOCKS, capture=_replaying_stand_in(calls)
    )
    runner.execute(_decode(seqs))  # 3 > 2
    assert calls == []
