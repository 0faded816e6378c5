"""Triton kernels of the FP8 path: one-pass activation quantization, a block-scaled FP8 GEMM for
small M, and FP8 -> BF16/FP16/FP32 weight dequantization.

They compute kernel.py's formulas bit for bit where the formula is exact (quantization,
dequantization) and to FP32 summation order in the GEMM. kernel.py decides where they run (CUDA
devices with FP8 tensor cores for the first two, any CUDA GPU Triton supports for the third);
`interpreted()` gives the same kernels run by Triton's interpreter on a CPU, which is how the tests
check them on every machine.

Rounding is explicit: each kernel rounds to the output's precision (nearest, ties to even) in FP32
bits, so the cast that follows is exact. The GPU's casts round to nearest as torch does, but Triton
3.9's interpreter truncates float32 -> bfloat16 and drops the carry of a float32 -> E4M3 round-up
(126.3 -> 64); with the rounding done first, both give torch's bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

GROUP = 128  # the 1x128 activation groups and 128x128 weight blocks of DeepSeek-V3's FP8
# the kernels' globals are constexpr: compiled Triton (not its interpreter) reads no other globals
_E4M3_MAX = tl.constexpr(448.0)
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
# (x + c) - c rounds |x| < 2^13 to a multiple of 2^-9, E4M3's subnormal step: c's ulp is 2^-9
_E4M3_SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0**14)
_MIN_SCALE = tl.constexpr(1e-12)  # kernel.py's: an all-zero group gets a tiny scale, not 0/0
# act_quant: 1x128 groups per program (8 KiB of BF16)
_QUANT_GROUPS_PER_PROGRAM = 32


@dataclass(frozen=True)
class GemmConfig:
    """One tile shape of the FP8 GEMM: BLOCK_M x BLOCK_N outputs per program, K in 128-wide
    steps."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


# Small M first: decode batches are 1-64 tokens, where the weight's bytes bound the time; the
# larger tiles are for prefill. The autotuner picks one per (M bucket, N, K, split).
GEMM_CONFIGS = (
    GemmConfig(16, 64, 4, 4),
    GemmConfig(16, 128, 4, 4),
    GemmConfig(32, 64, 4, 4),
    GemmConfig(64, 64, 4, 3),
    GemmConfig(64, 128, 4, 3),
    GemmConfig(128, 128, 8, 3),
)
# split-K: at most this many K slices, each of at least this many 128-wide blocks
_MAX_SPLIT_K = 8
_MIN_BLOCKS_PER_SPLIT = 4


# ---------------------------------------------------------------------------------- rounding


@triton.jit
def _round_to_e4m3(x):
    """float32 x (|x| <= 448) -> the nearest E4M3 value, ties to even, still float32 (signed
    zeros kept, as torch's cast keeps them)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = bits ^ sign
    # normals: keep 3 of the 23 mantissa bits; a carry out of the mantissa bumps the exponent
    lsb = (magnitude >> 20) & 1
    normal = ((magnitude + 0x7FFFF + lsb) & 0xFFF00000).to(tl.float32, bitcast=True)
    absolute = magnitude.to(tl.float32, bitcast=True)
    subnormal = (absolute + _E4M3_SUBNORMAL_ROUNDER) - _E4M3_SUBNORMAL_ROUNDER
    rounded = tl.minimum(tl.where(absolute < _E4M3_MIN_NORMAL, subnormal, normal), _E4M3_MAX)
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16(x):
    """float32 x -> the nearest bfloat16 value, ties to even, still float32."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def quantize_groups(x):
    """x: [rows, GROUP] float32, one 1x128 group a row -> (the E4M3 values, still float32, and
    float32 scales [rows]): scale = max(amax / 448, 1e-12), each a correctly rounded division as
    kernel.e4m3_scale computes it; the one quantization of act_quant and the grouped MoE GEMM's
    prologue."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32)), _MIN_SCALE)
    return _round_to_e4m3(tl.math.div_rn(x, scale[:, None])), scale


@triton.jit
def to_output(x, out_ptr):
    """float32 x as out_ptr's element type, rounded to nearest as torch's casts do."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        x = _round_to_bf16(x)
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _e4m3_bits_to_float(q):
    """E4M3 bit patterns (uint8) -> float32 values, in integer arithmetic: GPUs without FP8 (sm80,
    sm86) cannot load the float8 type itself."""
    q = q.to(tl.uint32)
    exponent = (q >> 3) & 0xF
    mantissa = q & 0x7
    normal = (((q & 0x80) << 24) | ((exponent + 120) << 23) | (mantissa << 20)).to(
        tl.float32, bitcast=True
    )
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2^-9
    subnormal = tl.where((q & 0x80) != 0, -subnormal, subnormal)
    return tl.where(exponent == 0, subnormal, normal)


# ----------------------------------------------------------------------------------- kernels


@triton.jit
def _act_quant_kernel(
    x_ptr, y_ptr, scale_ptr, tokens, groups, ROWS: tl.constexpr, GROUP: tl.constexpr
):
    """ROWS groups of GROUP values, seen as rows of x [tokens * groups, GROUP] (x [tokens, K]
    row-major): amax, scale = amax / 448, x / scale rounded to E4M3. scale: [groups, tokens]
    (token-major, the layout the GEMMs read)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    present = row < tokens * groups
    offsets = row[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + offsets, mask=present[:, None], other=0.0).to(tl.float32)
    y, scale = quantize_groups(x)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=present[:, None])
    token, group = row // groups, row % groups
    tl.store(scale_ptr + group * tokens + token, scale, mask=present)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_a_scale_m,
    stride_a_scale_k,
    M_BUCKET,  # the autotuner's key: M rounded up to a power of two
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
):
    """c[(split,) m, n] = sum over this split's 128-wide K blocks of (a_blk @ b_blk.T) * a_s[m, kb]
    * b_s[n // 128, kb], accumulated in FP32: DeepSeek's promotion to FP32 every 128 products.

    a: [M, K] fp8 row-major; b: [N, K] fp8 row-major (the weight); a_scale: [M, K / 128] at the
    given strides; b_scale: [ceil(N / 128), K / 128] contiguous; c: [SPLIT_K, M, N] (FP32 partial
    sums) or, unsplit, [M, N] in the output dtype.
    """
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_blocks = K // GROUP
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, k_blocks)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, GROUP)
    row_ok, col_ok = rows < M, cols < N
    a_ptrs = a_ptr + rows[:, None] * K + depth[None, :]  # [BLOCK_M, 128]
    b_ptrs = b_ptr + cols[None, :] * K + depth[:, None]  # [128, BLOCK_N]: b transposed
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first, last):
        a = tl.load(a_ptrs + kb * GROUP, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptrs + kb * GROUP, mask=col_ok[None, :], other=0.0)
        a_s = tl.load(
            a_scale_ptr + rows * stride_a_scale_m + kb * stride_a_scale_k, mask=row_ok, other=0.0
        )
        b_s = tl.load(b_scale_ptr + (cols // GROUP) * k_blocks + kb, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :]
    tl.store(c_ptrs, to_output(acc, c_ptr), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _weight_dequant_kernel(q_ptr, scale_ptr, out_ptr, M, N, BLOCK: tl.constexpr):
    """out[i, j] = q[i, j] * scale[i // BLOCK, j // BLOCK] for one BLOCK x BLOCK block; q: [M, N]
    E4M3 bits as uint8, scale: [ceil(M / BLOCK), ceil(N / BLOCK)] float32."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_n * BLOCK + tl.arange(0, BLOCK)
    present = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    q = tl.load(q_ptr + offsets, mask=present, other=0)
    scale = tl.load(scale_ptr + pid_m * tl.cdiv(N, BLOCK) + pid_n)
    tl.store(out_ptr + offsets, to_output(_e4m3_bits_to_float(q) * scale, out_ptr), mask=present)


def _prune_configs(
    configs: list[triton.Config], named_args: dict[str, object], **_: object
) -> list[triton.Config]:
    """Tiles no taller than M (rounded up to a power of two, at least 16): a decode batch gains
    nothing from rows it does not have."""
    tallest = max(16, int(named_args["M_BUCKET"]))  # type: ignore[call-overload]
    return [c for c in configs if c.kwargs["BLOCK_M"] <= tallest] or configs[:1]


_fp8_gemm_autotuned = triton.autotune(
    configs=[
        triton.Config(
            {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n},
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
        for c in GEMM_CONFIGS
    ],
    key=["M_BUCKET", "N", "K", "SPLIT_K"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_fp8_gemm_kernel)


# -------------------------------------------------------------------------------- launchers


def act_quant(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K] contiguous, K % group == 0, group a power of two >= 16 -> (fp8 [T, K], float32
    scales [T, K / group] with stride 1 along T)."""
    tokens, k = x.shape
    groups = k // group
    y = torch.empty(tokens, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(groups, tokens, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(tokens * groups, _QUANT_GROUPS_PER_PROGRAM),)
    _act_quant_kernel[grid](
        x, y, scale, tokens, groups, ROWS=_QUANT_GROUPS_PER_PROGRAM, GROUP=group
    )
    return y, scale.t()


def split_k(m: int, n: int, k: int, multiprocessors: int) -> int:
    """K slices for an M x N x K GEMM: enough programs to fill the GPU when M x N alone is a few
    tiles (a decode batch against a narrow, deep weight), never slices of under 4 K blocks."""
    tiles = triton.cdiv(m, 64 if m > 32 else 16) * triton.cdiv(n, 64)
    by_occupancy = max(1, multiprocessors // tiles)
    return max(1, min(_MAX_SPLIT_K, k // GROUP // _MIN_BLOCKS_PER_SPLIT, by_occupancy))


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    splits: int = 1,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """a [M, K] fp8, a_scale [M, K / 128], b [N, K] fp8, b_scale [ceil(N / 128), K / 128] ->
    [M, N] in out_dtype (inputs checked by kernel.fp8_gemm). config None: autotuned, or under
    the interpreter (which has no clock worth tuning by) the tallest tile M fills; splits > 1:
    FP32 partial sums of K slices, added by torch."""
    (m, k), n = a.shape, b.size(0)
    if config is None and knobs.runtime.interpret:
        config = untuned_config(m)
    partial = splits > 1
    c = torch.empty(
        (splits, m, n) if partial else (m, n),
        dtype=torch.float32 if partial else out_dtype,
        device=a.device,
    )
    args = (a, a_scale, b, b_scale, c, m, n, k, a_scale.stride(0), a_scale.stride(1))
    bucket = max(16, triton.next_power_of_2(m))
    if config is None:
        cdiv = triton.cdiv
        _fp8_gemm_autotuned[
            lambda meta: (cdiv(m, meta["BLOCK_M"]), cdiv(n, meta["BLOCK_N"]), splits)
        ](*args, bucket, SPLIT_K=splits, GROUP=GROUP)
    else:
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), splits)
        _fp8_gemm_kernel[grid](
            *args,
            bucket,
            SPLIT_K=splits,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            GROUP=GROUP,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return c.sum(0).to(out_dtype) if partial else c


def untuned_config(m: int) -> GemmConfig:
    """The config the autotuner would most likely pick for M rows: the tallest tile M fills, the
    widest of those."""
    tallest = max(16, triton.next_power_of_2(m))
    fitting = [c for c in GEMM_CONFIGS if c.block_m <= tallest]
    return max(fitting, key=lambda c: (c.block_m, c.block_n))


def weight_dequant(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """weight [M, N] float8_e4m3fn, scale_inv [ceil(M / 128), ceil(N / 128)] -> [M, N] in dtype."""
    m, n = weight.shape
    out = torch.empty(m, n, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(m, GROUP), triton.cdiv(n, GROUP))
    _weight_dequant_kernel[grid](weight.view(torch.uint8), scale_inv, out, m, n, BLOCK=GROUP)
    return out
