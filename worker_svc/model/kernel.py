"""The FP8 arithmetic of DeepSeek-V3 inference: block scales, activation quantization, block-scaled
GEMM, weight dequantization.

The formulas are those of DeepSeek-V3's inference/kernel.py:
- weights are FP8 E4M3 with a float32 `scale_inv` per 128x128 block: w[i, j] = q[i, j] * s[i // 128,
  j // 128];
- activations are quantized per token in 1x128 groups with s = amax(|group|) / 448, q = x / s;
- the GEMM multiplies each 128-wide slice of K in FP8, scales the partial product by
  a_s[m, k] * b_s[n // 128, k] and accumulates in FP32.

Each public function checks its inputs (dtype, shape, contiguity, divisibility), allocates its
outputs and picks an implementation (`impl`):
- "triton": worker_svc/model/triton_kernels.py, one kernel per operation; "auto" takes it on CUDA
  GPUs with FP8 tensor cores (sm89, sm90) for quantization and GEMM, and on any CUDA GPU Triton
  supports (sm80+) for dequantization. Forced on a CPU it runs in Triton's interpreter, which must
  have been switched on (TRITON_INTERPRET=1) before triton was imported.
- "native" (GEMM only): torch's block-wise scaled matmul (cuBLASLt), where
  `native_fp8_gemm_available` says it runs (CUDA sm90, CUDA >= 12.9).
- "reference": plain torch, anywhere (CPU serving and tests).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from triton import knobs

from worker_svc.model import triton_kernels

BLOCK_SIZE = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero group gets a tiny scale instead of 0/0
_MIN_CUDA_FOR_BLOCKWISE = (12, 9)  # cuBLASLt gained 1x128 / 128x128 block scaling in CUDA 12.9
# cuBLASLt answers NOT_SUPPORTED to a block-scaled FP8 GEMM whose M is not a multiple of 8 (measured
# on an H200, CUDA 13.0: M = 1, 2, 3, 17, 65 refused; 8, 16, 64 run), so decode-sized inputs get
# zero rows.
_NATIVE_ROW_MULTIPLE = 8

# Triton's own floor (its compiler targets sm80+), and the first GPUs with FP8 tensor cores (Ada)
_MIN_CC_FOR_TRITON = (8, 0)
_MIN_CC_FOR_TRITON_FP8 = (8, 9)
# split-K is sized for this many multiprocessors where there is no GPU to ask (the interpreter):
# an H100's / H200's 132, so a CPU test runs the slices those GPUs get
_DEFAULT_MULTIPROCESSORS = 132

KernelImpl = Literal["auto", "triton", "reference"]
GemmImpl = Literal["auto", "triton", "native", "reference"]


def block_scale_shape(
    shape: torch.Size | tuple[int, ...], block_size: int = BLOCK_SIZE
) -> tuple[int, int]:
    """Shape of the per-block scales of a [rows, cols] weight: partial edge blocks get their own
    scale."""
    return (-(-shape[0] // block_size), -(-shape[1] // block_size))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_weight(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: int, what: str
) -> None:
    _check(
        weight.dim() == 2 and weight.dtype == FP8,
        f"{what}: weight must be 2-D {FP8}, got {weight.dtype} {tuple(weight.shape)}",
    )
    want = block_scale_shape(weight.shape, block_size)
    _check(
        scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == want,
        f"{what}: scale_inv must be float32 {want}, got {scale_inv.dtype} {tuple(scale_inv.shape)}",
    )
    _check(
        weight.is_contiguous() and scale_inv.is_contiguous(),
        f"{what}: weight and scale_inv must be contiguous",
    )


# ---------------------------------------------------------------------------------------- devices


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA (not ROCm) device, None for anything else."""
    if device.type != "cuda" or torch.version.hip or not torch.version.cuda:
        return None
    return torch.cuda.get_device_capability(device)


@functools.cache
def triton_fp8_available(device: torch.device) -> bool:
    """True where the Triton quantization and GEMM compile to FP8 tensor cores: CUDA sm89+."""
    cc = _cuda_capability(device)
    return cc is not None and cc >= _MIN_CC_FOR_TRITON_FP8


@functools.cache
def triton_available(device: torch.device) -> bool:
    """True where Triton compiles at all (BF16/FP16 kernels): a CUDA GPU of sm80+."""
    cc = _cuda_capability(device)
    return cc is not None and cc >= _MIN_CC_FOR_TRITON


def _use_triton(impl: str, device: torch.device, available: bool, what: str) -> bool:
    """Whether `what` runs its Triton kernel: forced (then it must be able to), or auto where
    available."""
    if impl == "triton":
        _check(
            available or knobs.runtime.interpret,
            f"{what}: impl='triton' does not run on {device} here (needs {_TRITON_NEEDS[what]}, "
            "or Triton's interpreter: TRITON_INTERPRET=1 before triton is imported)",
        )
        return True
    return impl == "auto" and available


_TRITON_NEEDS = {
    "act_quant": "a CUDA GPU with FP8 tensor cores, sm89+",
    "fp8_gemm": "a CUDA GPU with FP8 tensor cores, sm89+",
    "weight_dequant": "a CUDA GPU Triton supports, sm80+",
}


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return _DEFAULT_MULTIPROCESSORS


# ---------------------------------------------------------------------------------------- weights


def weight_dequant(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: int = BLOCK_SIZE,
    *,
    dtype: torch.dtype = torch.float32,
    impl: KernelImpl = "auto",
) -> torch.Tensor:
    """w[i, j] = fp8[i, j] * scale_inv[i // block, j // block], computed in float32 and rounded
    once to `dtype`, as a new tensor on the weight's device.

    weight: [M, N] float8_e4m3fn; scale_inv: [ceil(M / block), ceil(N / block)] float32.
    """
    _check_weight(weight, scale_inv, block_size, "weight_dequant")
    available = block_size == BLOCK_SIZE and triton_available(weight.device)
    if _use_triton(impl, weight.device, available, "weight_dequant"):
        _check(block_size == BLOCK_SIZE, f"weight_dequant: Triton runs {BLOCK_SIZE}-blocks only")
        return triton_kernels.weight_dequant(weight, scale_inv, dtype)
    m, n = weight.shape
    scale = scale_inv.repeat_interleave(block_size, 0)[:m].repeat_interleave(block_size, 1)[:, :n]
    return (weight.float() * scale).to(dtype)


def weight_quant(
    weight: torch.Tensor, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of weight_dequant: per-block scale = amax / 448 -> (fp8 weight, float32
    scale_inv)."""
    _check(weight.dim() == 2, f"weight_quant: weight must be 2-D, got {tuple(weight.shape)}")
    m, n = weight.shape
    sm, sn = block_scale_shape(weight.shape, block_size)
    padded = torch.zeros(
        sm * block_size, sn * block_size, dtype=torch.float32, device=weight.device
    )
    padded[:m, :n] = weight.float()
    blocks = padded.view(sm, block_size, sn, block_size)
    scale = e4m3_scale(blocks.abs().amax(dim=(1, 3)))  # [sm, sn]
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:m, :n].to(FP8)
    return q.contiguous(), scale.contiguous()


def pad_to_blocks(weight: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """weight [N, K] -> [N, K rounded up to a whole block], zero-filled.

    The checkpoint format allows a partial last K block (its scale covers the real columns); the
    GEMM needs whole 1x128 activation groups, so such weights are padded once at load and
    `fp8_linear` pads activations to match. DeepSeek-V3's own shapes are all whole blocks.
    """
    pad = -weight.size(1) % block_size
    return F.pad(weight, (0, pad)) if pad else weight


# ------------------------------------------------------------------------------------ activations


def e4m3_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as one correctly rounded float32 division on every device (at least 1e-12), as
    the Triton kernels compute it (`tl.math.div_rn`).

    Not `amax / FP8_MAX`: torch's CUDA kernel divides by a Python number as a multiplication by its
    reciprocal, fl(amax * fl(1 / 448)), which differs from the division in the last bit for about
    half of all amaxes (the CPU divides): the reference on a GPU then quantized whole groups with
    another scale than the compiled act_quant. A divisor tensor on amax's device takes the
    division path everywhere.
    """
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=_MIN_SCALE)


def act_quant(
    x: torch.Tensor, block_size: int = BLOCK_SIZE, *, impl: KernelImpl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 quantization: x [..., K] -> (fp8 [..., K], float32 scale [..., K / 128]),
    scale = amax / 448.

    The scale is laid out group-major (stride 1 along the tokens), the layout cuBLASLt and the
    Triton GEMM read 1x128 scales in, so fp8_gemm needs no transposing copy. Triton takes
    power-of-two groups of at least 16 (the indexer quantizes whole 128-wide heads).
    """
    _check(x.is_contiguous(), "act_quant: input must be contiguous")
    _check(
        x.size(-1) % block_size == 0,
        f"act_quant: last dim {x.size(-1)} is not a multiple of {block_size}",
    )
    pow2 = block_size >= 16 and block_size & (block_size - 1) == 0
    if _use_triton(impl, x.device, pow2 and triton_fp8_available(x.device), "act_quant"):
        _check(pow2, f"act_quant: Triton takes power-of-two groups >= 16, got {block_size}")
        batch, groups = x.shape[:-1], x.size(-1) // block_size
        x_fp8, scale = triton_kernels.act_quant(x.view(-1, x.size(-1)), block_size)
        # [T, K / 128] stride (1, T) -> [..., K / 128], group-major like the reference's
        return x_fp8.view(x.shape), scale.t().view(groups, *batch).movedim(0, -1)
    grouped = x.float().unflatten(-1, (-1, block_size))  # [..., K / 128, 128]
    # [..., K / 128], group-major in memory
    amax = grouped.movedim(-2, 0).abs().amax(dim=-1).movedim(0, -1)
    scale = e4m3_scale(amax)
    return (grouped / scale.unsqueeze(-1)).flatten(-2).to(FP8), scale


# ------------------------------------------------------------------------------------------- gemm


@functools.cache
def native_fp8_gemm_available(device: torch.device) -> bool:
    """True where torch's block-wise scaled matmul runs: CUDA (not ROCm) sm90, CUDA >= 12.9, torch
    with `scaled_mm` and ScalingType.BlockWise1x128/128x128. cuBLASLt's DeepSeek-style scaling is
    sm90-only (sm89 and sm100 reject it)."""
    scaling = getattr(F, "ScalingType", None)
    if _cuda_capability(device) != (9, 0) or not hasattr(F, "scaled_mm"):
        return False
    assert torch.version.cuda is not None, "a CUDA capability implies a CUDA build"
    cuda_version = tuple(int(p) for p in torch.version.cuda.split(".")[:2])
    return hasattr(scaling, "BlockWise1x128") and cuda_version >= _MIN_CUDA_FOR_BLOCKWISE


def fp8_gemm_available(device: torch.device) -> bool:
    """True where the precision policy may serve FP8 on this device: sm90, with the Triton GEMM or
    cuBLASLt's. sm89 runs the Triton kernels too, but serves BF16 until a measurement there says
    FP8 pays (docs/benchmarks/engine-precision.md)."""
    return _cuda_capability(device) == (9, 0) and (
        triton_fp8_available(device) or native_fp8_gemm_available(device)
    )


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    impl: GemmImpl = "auto",
) -> torch.Tensor:
    """y = dequant(a) @ dequant(b).T with block scales and FP32 accumulation -> new [M, N] tensor of
    out_dtype.

    a: [M, K] fp8 activations, a_scale: [M, K / 128] float32, any strides (from act_quant);
    b: [N, K] fp8 weight, b_scale: [ceil(N / 128), K / 128] float32 (the checkpoint's
    weight_scale_inv). impl: "triton" = triton_kernels' GEMM (split-K sized for the device's
    multiprocessors, tiles autotuned), "native" = torch's block-wise scaled_mm (sm90 only),
    "reference" = plain torch; "auto" = Triton where the device has FP8 tensor cores, else native
    where available and N % 16 == 0 (cuBLASLt's FP8 alignment), else reference.
    """
    _check(
        a.dim() == 2 and a.dtype == FP8,
        f"fp8_gemm: a must be 2-D {FP8}, got {a.dtype} {tuple(a.shape)}",
    )
    _check_weight(b, b_scale, BLOCK_SIZE, "fp8_gemm")
    (m, k), n = a.shape, b.size(0)
    _check(k % BLOCK_SIZE == 0, f"fp8_gemm: K={k} is not a multiple of {BLOCK_SIZE}")
    _check(b.size(1) == k, f"fp8_gemm: a has K={k}, b has K={b.size(1)}")
    _check(
        a_scale.dtype == torch.float32 and tuple(a_scale.shape) == (m, k // BLOCK_SIZE),
        f"fp8_gemm: a_scale must be float32 {(m, k // BLOCK_SIZE)}, "
        f"got {a_scale.dtype} {tuple(a_scale.shape)}",
    )
    _check(a.is_contiguous(), "fp8_gemm: a must be contiguous")
    if _use_triton(impl, a.device, triton_fp8_available(a.device), "fp8_gemm"):
        splits = triton_kernels.split_k(m, n, k, _multiprocessors(a.device))
        return triton_kernels.fp8_gemm(a, a_scale, b, b_scale, out_dtype, splits=splits)
    native = native_fp8_gemm_available(a.device)
    if impl == "native":
        _check(
            native,
            f"fp8_gemm: no native block-wise FP8 GEMM on "
            f"{a.device} (needs CUDA sm90, CUDA >= 12.9)",
        )
        _check(n % 16 == 0, f"fp8_gemm: native GEMM needs N % 16 == 0, got N={n}")
    if impl == "native" or (impl == "auto" and native and n % 16 == 0):
        return _fp8_gemm_blockwise_scaled_mm(a, a_scale, b, b_scale, out_dtype)
    return _fp8_gemm_reference(a, a_scale, b, b_scale).to(out_dtype)


def _fp8_gemm_reference(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """The kernel's loop in plain torch: per 128-wide K slice, FP8 products, scaled, summed in
    FP32."""
    (m, k), n = a.shape, b.size(0)
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    # [N, K / 128]: scale of weight row n
    b_scale_rows = b_scale.repeat_interleave(BLOCK_SIZE, 0)[:n]
    for i in range(k // BLOCK_SIZE):
        cols = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
        partial = a[:, cols].float() @ b[:, cols].float().T  # exact: FP8 products fit FP32
        acc += partial * a_scale[:, i, None] * b_scale_rows[None, :, i]
    return acc


def _fp8_gemm_blockwise_scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """torch.nn.functional.scaled_mm with 1x128 activation and 128x128 weight scales (cuBLASLt,
    sm90)."""
    m, k_blocks = a_scale.shape
    rows = -(-m // _NATIVE_ROW_MULTIPLE) * _NATIVE_ROW_MULTIPLE
    # cuBLASLt's layout contract: 1x128 scales M-major ([M, K/128], stride [1, M]); 128x128 scales
    # K-major with the K-block count padded to a multiple of 4 ([L4, N/128], stride [1, L4]). Some
    # torch versions accepted unpadded scales and silently returned wrong results when (K/128) % 4
    # != 0 (pytorch#166752), so pad those (never read); DeepSeek-V3's shapes need no padding.
    if k_blocks % 4:
        b_scale = F.pad(b_scale, (0, -k_blocks % 4))
    y = F.scaled_mm(
        # [K, N] column-major view of the row-major weight, as cuBLASLt wants
        _pad_rows(a, rows),
        b.t(),
        _token_major(a_scale, rows),
        F.ScalingType.BlockWise1x128,
        b_scale.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
        # full FP32 accumulation, not Hopper's reduced-precision fast accumulation
        use_fast_accum=False,
    )
    return y[:m]


def _pad_rows(a: torch.Tensor, rows: int) -> torch.Tensor:
    """a: [M, K] fp8 -> [rows, K] with zero rows appended (their outputs are dropped); padded as
    bytes, since padding kernels need not support float8."""
    if a.size(0) == rows:
        return a
    return F.pad(a.view(torch.uint8), (0, 0, 0, rows - a.size(0))).view(a.dtype)


def _token_major(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """[M, L] scales -> [rows, L] with stride 1 along rows, as cuBLASLt reads 1x128 scales; the
    padding rows get scale 1. act_quant's output already is token-major (except M = 1, whose strides
    torch keeps row-major)."""
    m, groups = scale.shape
    if rows == m and scale.stride(0) == 1 and (groups == 1 or scale.stride(1) == m):
        return scale
    out = torch.empty_strided(
        (rows, groups), (1, rows), dtype=scale.dtype, device=scale.device
    ).fill_(1.0)
    out[:m].copy_(scale)
    return out


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, *, impl: GemmImpl = "auto"
) -> torch.Tensor:
    """y = x @ dequant(weight).T through act_quant and fp8_gemm (`impl`; the quantization runs
    its fastest kernel unless impl is "reference"); x: [..., K] in any float dtype -> [..., N] in
    x's.

    weight may be wider than K (padded to whole blocks by `pad_to_blocks`); x is zero-padded to
    match.
    """
    k, k_padded = x.size(-1), weight.size(1)
    _check(
        k <= k_padded < k + BLOCK_SIZE,
        f"fp8_linear: input width {k} does not fit weight {tuple(weight.shape)}",
    )
    x2d = x.reshape(-1, k)
    if k_padded != k:
        x2d = F.pad(x2d, (0, k_padded - k))
    x_fp8, x_scale = act_quant(
        x2d.contiguous(), impl="reference" if impl == "reference" else "auto"
    )
    y = fp8_gemm(x_fp8, x_scale, weight, scale_inv, out_dtype=x.dtype, impl=impl)
    return y.view(*x.shape[:-1], weight.size(0))
