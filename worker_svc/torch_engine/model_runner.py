"""One scheduling step as one forward pass: packs the scheduled tokens and says where they sit in
the cache."""

from __future__ import annotations

import torch

from worker_svc.model.model import Transformer
from worker_svc.model.paged_batch import AttentionGroup, BatchLayout, KVCache
from worker_svc.torch_engine.cuda_graphs import DecodeGraphs, DecodeInputs
from worker_svc.torch_engine.scheduler import ScheduledSequence, SchedulerOutput, SequenceState


class ModelRunner:
    """Owns the paged latent cache; `execute()` is called once per step by the engine's step
    loop."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
    ):
        """graphs: decode steps replayed from CUDA graphs (None: every step eager)."""
        self.model, self.cache, self.device, self.graphs = model, cache, device, graphs

    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits [N, vocab] (fp32, on the CPU) of the scheduled sequences that sample, in scheduled
        order."""
        decode = all(s.num_tokens == 1 and s.samples for s in output.scheduled)
        if decode and output.scheduled and self.graphs is not None:
            logits = self._replay(self.graphs, [s.seq for s in output.scheduled])
            if logits is not None:
                return logits.cpu()
        tokens, layout = self._prepare(output.scheduled)
        return self.model.forward_batch(tokens, layout, self.cache).cpu()

    def _replay(self, graphs: DecodeGraphs, seqs: list[SequenceState]) -> torch.Tensor | None:
        """The decode step of `seqs` from a captured graph, its inputs padded to the bucket; None
        where it runs eager."""
        bucket = graphs.bucket(len(seqs), max(seq.num_computed for seq in seqs) + 1)
        if bucket is None:
            return None
        size, keys = bucket
        bs, pad = self.cache.block_size, size - len(seqs)
        scratch = graphs.scratch_block
        positions = [seq.num_computed for seq in seqs]
        write_slots = [
            self._slot(seq.block_table.blocks, p) for seq, p in zip(seqs, positions, strict=True)
        ]
        inputs = DecodeInputs(
            tokens=self._tensor(
                [seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)] + [0] * pad
            ),
            positions=self._tensor(positions + [0] * pad),
            write_slots=self._tensor(write_slots + [scratch * bs] * pad),
            key_slots=self._key_slots(
                [seq.block_table.blocks for seq in seqs] + [[]] * pad, keys, pad_block=scratch
            ),
        )
        logits = graphs.run(bucket, inputs)
        return None if logits is None else logits[: len(seqs)]

    def _prepare(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, BatchLayout]:
        tokens: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        logits_index: list[int] = []
        for s in scheduled:
            start, table = s.seq.num_computed, s.seq.block_table.blocks
            tokens += s.seq.token_ids[start : start + s.num_tokens]
            positions += range(start, start + s.num_tokens)
            write_slots += [self._slot(table, p) for p in range(start, start + s.num_tokens)]
            if s.samples:
                logits_index.append(len(tokens) - 1)
        layout = BatchLayout(
            positions=self._tensor(positions),
            write_slots=self._tensor(write_slots),
            groups=self._groups(scheduled),
            logits_index=self._tensor(logits_index),
        )
        return self._tensor(tokens), layout

    def _slot(self, table: list[int], position: int) -> int:
        """The cache slot of a sequence's token at `position`, given its block table."""
        bs = self.cache.block_size
        return table[position // bs] * bs + position % bs

    def _groups(self, scheduled: list[ScheduledSequence]) -> list[AttentionGroup]:
        """All single-token sequences attend as one padded batch; each prompt chunk on its own."""
        singles = [s.seq for s in scheduled if s.num_tokens == 1]
        assert all(s.num_tokens == 1 for s in scheduled[: len(singles)]), (
            "single-token sequences must come first"
        )
        groups = []
        if singles:
            query_positions = self._tensor([[seq.num_computed] for seq in singles])  # [b, 1]
            length = max(seq.num_computed for seq in singles) + 1
            key_slots = self._key_slots([seq.block_table.blocks for seq in singles], length)
            groups.append(AttentionGroup.build(0, query_positions, key_slots))
        token_start = len(singles)
        for s in scheduled[len(singles) :]:
            start, end = s.seq.num_computed, s.seq.num_computed + s.num_tokens
            query_positions = torch.arange(start, end, device=self.device).unsqueeze(0)  # [1, s]
            key_slots = self._key_slots([s.seq.block_table.blocks], end)
            groups.append(AttentionGroup.build(token_start, query_positions, key_slots))
            token_start += s.num_tokens
        return groups

    def _key_slots(
        self, tables: list[list[int]], length: int, *, pad_block: int = 0
    ) -> torch.Tensor:
        """[b, length] cache slots of positions 0..length-1 of each sequence; past a sequence's
        blocks, those of `pad_block` (masked: after the query)."""
        bs = self.cache.block_size
        n_blocks = -(-length // bs)
        padded = [
            table[:n_blocks] + [pad_block] * (n_blocks - len(table[:n_blocks])) for table in tables
        ]
        pos = torch.arange(length, device=self.device)
        return self._tensor(padded)[:, pos // bs] * bs + pos % bs

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
