"""The routed experts' grouped GEMM in Triton: one launch computes one projection for every
expert a batch chose.

The rows (token, expert slot pairs) come sorted by expert; `offsets[e]:offsets[e + 1]` are expert
e's rows, read from device memory by the kernel itself, so the launch (grid: experts x column
tiles) has the same shape whatever the router chose and a CUDA graph can replay it. A program
whose expert got no rows returns at once. FP8 weights are block-scaled (128x128, float32
scale_inv); the activations are quantized in the GEMM's prologue, 1x128 groups per row with
triton_kernels.quantize_groups (act_quant's own code), so there is no separate quantization
launch. BF16/FP16 weights multiply the activations as they are.

Two uses (fused_moe.py): gate and up projections at once, gathering each row's token from the
hidden states, with SiLU(gate) * up in the epilogue; the down projection over those rows, each
row's routing weight applied in the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

from worker_svc.model.triton_kernels import GROUP, quantize_groups, to_output


@dataclass(frozen=True)
class GroupedConfig:
    """One tile shape: BLOCK_M rows of one expert x BLOCK_N output columns per step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


# A decode batch gives each chosen expert a row or a few (batch x top-k spread over 256 experts):
# 16-row tiles; prefill gives each many. Fixed per row count, never autotuned inside a step.
_DECODE_CONFIG = GroupedConfig(16, 64)
_PREFILL_CONFIG = GroupedConfig(64, 128, 8, 3)
_DECODE_ROWS_PER_EXPERT = 16


def grouped_config(rows: int, experts: int) -> GroupedConfig:
    """The tile for `rows` (token, slot) pairs over `experts` experts: short tiles while an expert
    averages at most 16 rows."""
    return _DECODE_CONFIG if rows <= experts * _DECODE_ROWS_PER_EXPERT else _PREFILL_CONFIG


@triton.jit
def _round_to(x, out_ptr):
    """float32 x rounded to out_ptr's element precision, as float32 (what an eager op's output in
    that dtype holds)."""
    return to_output(x, out_ptr).to(tl.float32)


@triton.jit
def _block_product(
    a,
    a_scale,
    w_ptrs,
    s_ptrs,
    kb,
    col_ok,
    k_ok,
    FP8: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """One K block's contribution: a [BLOCK_M, BLOCK_K] (quantized already when FP8) times the
    weight block at w_ptrs, scaled by the row and weight block scales in FP8."""
    if FP8:
        w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        w_scale = tl.load(s_ptrs + kb, mask=col_ok, other=0.0)
        return tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), w.to(tl.float32))
    return tl.dot(a, w)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    source_ptr,
    offsets_ptr,
    row_weight_ptr,
    w_ptr,
    w_scale_ptr,
    up_ptr,
    up_scale_ptr,
    out_ptr,
    N,
    K,
    K_A,
    stride_a,
    stride_w_expert,
    stride_s_expert,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    WEIGH: tl.constexpr,
    FP8: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r, n] for expert e's rows r in offsets[e]:offsets[e + 1] and this program's columns:
    sum over K of a[source(r), k] * w[e, n, k] (K in 128-wide FP8 blocks: quantized rows times FP8
    weights, scaled, summed in FP32, as kernel.fp8_gemm).

    a: [*, K_A] rows at stride_a (K_A <= K: the weight's K may be padded to whole blocks);
    source(r) = source_ptr[r] (GATHER) or r; w, up: [E, N, K] contiguous; scales: [E, ceil(N /
    128), K / 128]. SWIGLU: out = silu(a @ w.T) * (a @ up.T), each rounded to out's dtype first as
    the eager MLP rounds them; WEIGH: out *= row_weight[r] (after rounding, as eager). out: [R, N].
    DOT_IN_FP32: BF16/FP16 tiles multiplied as FP32 (the interpreter).
    """
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    depth = tl.arange(0, BLOCK_K)
    k_blocks = tl.cdiv(K, BLOCK_K)
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    # [BLOCK_K, BLOCK_N]: the weight transposed; int64: 256 experts of V3 pass 2^31 elements
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_w_expert + cols[None, :] * K + depth[:, None]
    up_ptrs = up_ptr + expert.to(tl.int64) * stride_w_expert + cols[None, :] * K + depth[:, None]
    s_ptrs = w_scale_ptr + expert.to(tl.int64) * stride_s_expert + (cols // BLOCK_K) * k_blocks
    up_s_ptrs = up_scale_ptr + expert.to(tl.int64) * stride_s_expert + (cols // BLOCK_K) * k_blocks
    for first in range(start, end, BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        source = rows
        if GATHER:
            source = tl.load(source_ptr + rows, mask=row_ok, other=0)
        a_ptrs = a_ptr + source.to(tl.int64)[:, None] * stride_a + depth[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, k_blocks):
            k_ok = kb * BLOCK_K + depth < K_A
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
            if FP8:
                values, a_scale = quantize_groups(a.to(tl.float32))
                a = values.to(tl.float8e4nv)
            step = kb * BLOCK_K
            acc += _block_product(
                a, a_scale, w_ptrs + step, s_ptrs, kb, col_ok, k_ok, FP8, DOT_IN_FP32
            )
            if SWIGLU:
                acc_up += _block_product(
                    a, a_scale, up_ptrs + step, up_s_ptrs, kb, col_ok, k_ok, FP8, DOT_IN_FP32
                )
        if SWIGLU:
            gate = _round_to(acc, out_ptr)
            silu = _round_to(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), out_ptr)
            acc = silu * _round_to(acc_up, out_ptr)
        if WEIGH:
            weight = tl.load(row_weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc = _round_to(acc, out_ptr) * weight[:, None]
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tl.store(out_ptrs, to_output(acc, out_ptr), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm(
    a: torch.Tensor,
    offsets: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    out: torch.Tensor,
    *,
    source: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    up_scale: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """Launches the grouped GEMM into `out` [R, N] (inputs checked by fused_moe.py) -> out.

    a: [*, K_A] rows (gathered by `source` [R] when given, else row r is a's row r); offsets: [E +
    1] each expert's first row; weight (and up): [E, N, K] with weight_scale (up_scale) [E,
    ceil(N / 128), K / 128] float32 for FP8, None for BF16/FP16; row_weight: [R] applied in the
    epilogue. config None: by grouped_config.
    """
    experts, n, k = weight.shape
    rows = out.size(0)
    config = config or grouped_config(rows, experts)
    fp8 = weight_scale is not None
    # unused pointers still need a tensor: the kernel's constexpr flags keep them unread
    scale = weight_scale if weight_scale is not None else weight
    grid = (experts, triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a,
        source if source is not None else offsets,
        offsets,
        row_weight if row_weight is not None else out,
        weight,
        scale,
        up if up is not None else weight,
        up_scale if up_scale is not None else scale,
        out,
        n,
        k,
        a.size(1),
        a.stride(0),
        weight.stride(0),
        scale.stride(0),
        GATHER=source is not None,
        SWIGLU=up is not None,
        WEIGH=row_weight is not None,
        FP8=fp8,
        # Triton 3.9's interpreter multiplies BF16 tiles wrongly (1e10 off): it gets them in FP32,
        # which holds their products exactly; the GPU multiplies BF16 on its tensor cores
        DOT_IN_FP32=bool(knobs.runtime.interpret),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=GROUP if fp8 else _BF16_BLOCK_K,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


_BF16_BLOCK_K = 64
