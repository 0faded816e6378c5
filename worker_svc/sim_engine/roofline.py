"""The simulated engine's cost model: step times of a model on a GPU from the roofline of its
profile (gpu_profiles.toml) and the model's sizes (worker_svc/hardware/sizing.py).

- prefill: (uncached prompt tokens x 2 x active params + attention FLOPs) / FLOP/s (prefix-cache
  hits are free);
- each decode step: (active weight bytes + KV bytes of every running sequence) / bandwidth,
  plus (batch x 2 x active params + attention FLOPs) / FLOP/s.

Attention FLOPs count each query's attended tokens (`attention_flops_per_key` each). A DeepSeek-V3.2
model (`index_topk` > 0, sparse attention) attends to at most index_topk tokens and reads only their
KV bytes; its indexer still scores the whole context (`index_flops_per_key`,
`index_bytes_per_token`), so past index_topk a step costs the indexer's linear term, not full
attention's.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker_svc.hardware.gpu_profiles import GpuProfile
from worker_svc.hardware.sizing import DEFAULT_UTILIZATION, ModelSize


@dataclass(frozen=True)
class Roofline:
    """Step times of a model of ``size`` on ``gpu_count`` GPUs of ``profile``, in the precision
    the profile runs (weights and KV cache as worker_svc/hardware/sizing.py counts them)."""

    profile: GpuProfile
    gpu_count: int
    size: ModelSize
    memory_utilization: float = DEFAULT_UTILIZATION  # of device memory for weights and the KV cache
    attention_flops_per_key: float = 0.0  # one query attending to one cached token, all layers
    index_flops_per_key: float = 0.0  # V3.2: the indexer scoring one cached token for one query

    @property
    def active_params(self) -> int:
        return self.size.active_params

    @property
    def index_topk(self) -> int:
        """Sparse attention (V3.2): tokens each query attends to; 0: dense."""
        return self.size.index_topk

    @property
    def weight_bytes(self) -> int:
        return self.size.weight_bytes(self.profile.precision)

    @property
    def kv_bytes_per_token(self) -> int:
        """The MLA latent's bytes per token (V3.2's indexer keys are index_bytes_per_token)."""
        return self.size.latent_bytes_per_token(self.profile.precision)

    @property
    def index_bytes_per_token(self) -> int:
        """V3.2: the indexer's cached key per token, all layers."""
        return self.size.index_bytes_per_token(self.profile.precision)

    @property
    def memory_bytes(self) -> int:
        return self.profile.memory_bytes * self.gpu_count

    @property
    def kv_capacity_tokens(self) -> int:
        return int(
            (self.memory_bytes * self.memory_utilization - self.weight_bytes)
            // (self.kv_bytes_per_token + self.index_bytes_per_token)
        )

    def attended(self, context_tokens: int) -> int:
        """Cached tokens one query attends to: all, or with sparse attention at most index_topk."""
        return min(context_tokens, self.index_topk) if self.index_topk else context_tokens

    def prefill_s(self, tokens: int, start: int = 0) -> float:
        """`tokens` prompt tokens at positions start.. (the ones before are cached), each attending
        to its context."""
        flops = tokens * 2 * self.active_params + self.attention_flops_per_key * _keys_attended(
            start, tokens, self.index_topk
        )
        if self.index_topk:
            flops += self.index_flops_per_key * _keys_attended(start, tokens, 0)
        return flops / (self.profile.peak_flops * self.gpu_count)

    def decode_step_s(
        self, batch: int, context_tokens: int, attended_tokens: int | None = None
    ) -> float:
        """One token for each of `batch` sequences holding `context_tokens` in all;
        `attended_tokens`: the sum of their `attended(context)` (the default, all of the context, is
        right for dense attention)."""
        attended = context_tokens if attended_tokens is None else attended_tokens
        read = (
            self.active_params * self.profile.bytes_per_weight + attended * self.kv_bytes_per_token
        )
        flops = batch * 2 * self.active_params + attended * self.attention_flops_per_key
        if self.index_topk:
            read += context_tokens * self.index_bytes_per_token
            flops += context_tokens * self.index_flops_per_key
        return read / (self.profile.bandwidth_bytes_per_s * self.gpu_count) + flops / (
            self.profile.peak_flops * self.gpu_count
        )


def _keys_attended(start: int, tokens: int, cap: int) -> int:
    """Sum over positions p = start..start+tokens-1 of the keys p attends to: p + 1, at most `cap`
    (0: no cap)."""
    end = start + tokens

    def triangle(n: int) -> int:
        return n * (n + 1) // 2

    if not cap or end <= cap:
        return triangle(end) - triangle(start)
    if start >= cap:
        return tokens * cap
    return triangle(cap) - triangle(start) + (end - cap) * cap
