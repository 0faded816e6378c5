"""A MoE layer's routed experts as two grouped launches (gate/up with SwiGLU, then down), behind a
dispatch that never waits on the host.

The dispatch sorts a batch's (token, slot) pairs by expert on the device (`route`): expert counts
and offsets stay there, every buffer is sized by the batch's upper bound (tokens x top-k rows), and
nothing is copied to the host, so a decode step that runs it can be captured in a CUDA graph. The
GEMMs are triton_moe.py's kernel; model.MoE's per-expert loop in eager PyTorch stays the reference
and the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton import knobs

from worker_svc.model import triton_moe
from worker_svc.model.kernel import BLOCK_SIZE, FP8, triton_available, triton_fp8_available


def grouped_moe_available(device: torch.device, fp8: bool) -> bool:
    """Whether the grouped kernel runs the experts here: a CUDA GPU Triton compiles for (FP8
    tensor cores for FP8 weights), or Triton's interpreter."""
    if knobs.runtime.interpret:
        return True
    return triton_fp8_available(device) if fp8 else triton_available(device)


@dataclass(frozen=True)
class Routing:
    """Where a batch's (token, slot) pairs go, all on the device, R = tokens x top-k.

    source: [R] the token of each pair, sorted by expert (stable: by token within an expert);
    weights: [R] their routing weights; offsets: [E + 1] expert e's pairs are rows
    offsets[e]:offsets[e + 1]; inverse: [R] the sorted row of pair t * k + j.
    """

    source: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor
    inverse: torch.Tensor


def route(weights: torch.Tensor, indices: torch.Tensor, experts: int) -> Routing:
    """weights, indices: [T, k] from the gate -> the sorted dispatch, without a host round trip
    (no bincount, nonzero, item or tolist: an offset is a binary search in the sorted ids)."""
    flat = indices.flatten()
    order = flat.argsort(stable=True)
    rows = torch.arange(order.numel(), device=flat.device)
    ids = torch.arange(experts + 1, device=flat.device)
    return Routing(
        source=order // indices.size(1),
        weights=weights.flatten()[order].contiguous(),
        offsets=torch.searchsorted(flat[order], ids),
        inverse=torch.empty_like(order).scatter_(0, order, rows),
    )


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class GroupedExperts:
    """A layer's routed experts stacked: gate, up [E, I, K] and down [E, D, K'] (FP8 with float32
    [E, ceil(N / 128), K / 128] block scales, or BF16/FP16 without), K and K' padded to whole
    blocks in FP8. Calling it runs the routed experts of a batch: x [T, D] -> [T, D] in x's
    dtype."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        experts, inter, k = self.gate.shape
        fp8 = self.gate.dtype == FP8
        _check(
            self.up.shape == self.gate.shape and self.down.shape[0] == experts,
            f"grouped experts: gate {tuple(self.gate.shape)}, up {tuple(self.up.shape)} and "
            f"down {tuple(self.down.shape)} disagree",
        )
        _check(
            self.down.size(2) >= inter and self.gate.dtype == self.up.dtype == self.down.dtype,
            f"grouped experts: down's K {self.down.size(2)} must hold I={inter}, one dtype",
        )
        scales = (self.gate_scale, self.up_scale, self.down_scale)
        _check(
            all(s is not None for s in scales) if fp8 else all(s is None for s in scales),
            "grouped experts: FP8 weights need their block scales, others have none",
        )
        _check(
            not fp8 or (k % BLOCK_SIZE == 0 and self.down.size(2) % BLOCK_SIZE == 0),
            f"grouped experts: FP8 K ({k}, {self.down.size(2)}) must be whole 128-blocks",
        )
        tensors = (self.gate, self.up, self.down, *(s for s in scales if s is not None))
        _check(all(t.is_contiguous() for t in tensors), "grouped experts: must be contiguous")

    @property
    def experts(self) -> int:
        return self.gate.size(0)

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """x: [T, D] contiguous; weights, indices: [T, k] from the gate -> the weighted sum of each
        token's experts' outputs, [T, D]."""
        tokens, slots = indices.shape
        _check(
            x.dim() == 2 and x.size(1) <= self.gate.size(2) and x.is_contiguous(),
            f"grouped experts: x must be a contiguous [T, {self.gate.size(2)}], got "
            f"{tuple(x.shape)}",
        )
        routing = route(weights, indices, self.experts)
        rows = tokens * slots
        hidden = x.new_empty(rows, self.gate.size(1))
        triton_moe.grouped_gemm(
            x,
            routing.offsets,
            self.gate,
            self.gate_scale,
            hidden,
            source=routing.source,
            up=self.up,
            up_scale=self.up_scale,
        )
        out = x.new_empty(rows, self.down.size(1))
        triton_moe.grouped_gemm(
            hidden, routing.offsets, self.down, self.down_scale, out, row_weight=routing.weights
        )
        return combine(out, routing, slots)


def combine(out: torch.Tensor, routing: Routing, slots: int) -> torch.Tensor:
    """out: [R, D] each sorted row's weighted output -> [R / slots, D] each token's sum over its
    slots (a gather and a sum: no atomics, so the same batch always sums in the same order)."""
    return out[routing.inverse].view(-1, slots, out.size(1)).sum(1)
