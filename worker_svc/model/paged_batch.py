"""The paged batch's metadata, apart from the model as DeepSeek's inference code keeps it and as
vLLM keeps it in its attention backends: the paged MLA cache (`KVCache`) and where one forward
pass's packed tokens sit in it (`BatchLayout`, of `AttentionGroup`s). The model runner builds a
layout each step; the model's forward pass only reads and writes the slots it names."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


class KVCache:
    """The paged MLA cache: per layer and token slot, only the compressed latent and the rope'd key.

    kv: [n_layers, num_blocks * block_size, latent_width (kv_lora_rank + qk_rope_head_dim)], the
    latent (after kv_a_layernorm) then k_pe (after RoPE); token slot = block * block_size + offset
    in the block.
    index_k (V3.2 only, index_width > 0): [n_layers, same slots, index_width (index_head_dim)],
    the indexer's key of each token slot (Hadamard-rotated where the indexer scores in FP8), so it
    is allocated, freed, preempted and prefix-cached with the latent.
    Allocated by `Transformer.setup_cache`; which blocks a sequence holds is the caller's business
    (worker_svc.torch_engine.kv_cache), the forward pass only reads and writes the slots a
    `BatchLayout` names.
    """

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        *,
        latent_width: int,
        index_width: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.kv = torch.zeros(
            n_layers, num_blocks * block_size, latent_width, dtype=dtype, device=device
        )
        self.index_k: torch.Tensor | None = None
        if index_width:
            shape = (n_layers, num_blocks * block_size, index_width)
            self.index_k = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (0 if self.index_k is None else self.index_k.nbytes)


@dataclass
class AttentionGroup:
    """`batch` sequences with `seqlen` new tokens each, packed consecutively from `token_start`.

    query_positions: [batch, seqlen] positions of the new tokens; key_slots: [batch, L] cache slots
    of each sequence's keys in position order (padded with slot 0).
    """

    token_start: int
    batch: int
    seqlen: int
    query_positions: torch.Tensor
    key_slots: torch.Tensor

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[batch, seqlen, L] additive, -inf where a key lies after the query (future or padding);
        made when first read (the expanded prefill masks each chunk of queries on its own)."""
        key_positions = torch.arange(self.key_slots.size(1), device=self.key_slots.device)
        future = key_positions > self.query_positions.unsqueeze(-1)  # [b, s, L]
        return torch.zeros(future.shape, device=self.key_slots.device).masked_fill_(
            future, float("-inf")
        )

    @classmethod
    def build(
        cls, token_start: int, query_positions: torch.Tensor, key_slots: torch.Tensor
    ) -> AttentionGroup:
        """query_positions: [b, s] positions of the new tokens; key_slots: [b, L] slots of positions
        0..L-1."""
        batch, seqlen = query_positions.shape
        return cls(token_start, batch, seqlen, query_positions, key_slots)


@dataclass
class BatchLayout:
    """Where the T packed tokens of one forward pass sit (built each step by the model runner).

    positions: [T] position of each token in its sequence; write_slots: [T] cache slot its latent
    goes to; groups: cover the T tokens in order; logits_index: [N] packed indices whose logits are
    returned.
    """

    positions: torch.Tensor
    write_slots: torch.Tensor
    groups: list[AttentionGroup]
    logits_index: torch.Tensor

    @classmethod
    def contiguous(
        cls, batch: int, seqlen: int, start_pos: int, block_size: int, device: torch.device
    ) -> BatchLayout:
        """`batch` sequences at the same positions, sequence i in block i; logits of each last
        token."""
        # [B, S]
        positions = torch.arange(start_pos, start_pos + seqlen, device=device).expand(batch, seqlen)
        base = torch.arange(batch, device=device).unsqueeze(1) * block_size  # [B, 1]
        key_slots = base + torch.arange(start_pos + seqlen, device=device)  # [B, L]
        return cls(
            positions=positions.flatten(),
            write_slots=(base + positions).flatten(),
            groups=[AttentionGroup.build(0, positions, key_slots)],
            logits_index=torch.arange(1, batch + 1, device=device) * seqlen - 1,
        )
