"""The FP8 arithmetic on CPU (kernel.py's reference implementation) against the formulas it
implements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc.model.kernel import (
    FP8,
    act_quant,
    fp8_gemm,
    fp8_linear,
    native_fp8_gemm_available,
    pad_to_blocks,
    weight_dequant,
    weight_quant,
)

# E4M3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; values below
# the smallest normal (2^-6, in units of the group scale) move by at most half the subnormal step
# 2^-10.
_E4M3_REL_ERROR = 2.0**-4
_E4M3_SUBNORMAL_ABS_ERROR = 2.0**-10
# fp8_gemm sums per-block scaled products; dequantize-then-matmul scales first. Same real number,
# different FP32 rounding: observed max |diff| ~1e-6 of max |y|.
_GEMM_RTOL = 1e-5


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _dequant_activations(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x_fp8.float().unflatten(-1, (-1, 128)) * scale.unsqueeze(-1)).flatten(-2)


def test_act_quant_scale_is_amax_over_448_per_token_group():
    x = _randn(2, 3, 384) * torch.logspace(-3, 2, 384)  # groups of very different ranges
    x_fp8, scale = act_quant(x)
    assert x_fp8.dtype == FP8 and x_fp8.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 3)
    assert scale.stride(-2) == 1  # token-major, as cuBLASLt reads 1x128 scales
    torch.testing.assert_close(
        scale, x.unflatten(-1, (3, 128)).abs().amax(-1) / 448, rtol=0, atol=0
    )
    # the largest element of every group lands on E4M3's largest finite value
    assert torch.equal(
        x_fp8.float().unflatten(-1, (3, 128)).abs().amax(-1), torch.full((2, 3, 3), 448.0)
    )


def test_act_quant_round_trip_error_bound():
    x = _randn(16, 256, seed=1) ** 3  # heavy tails: normals and subnormals in every group
    x_fp8, scale = act_quant(x)
    error = (_dequant_activations(x_fp8, scale) - x).abs()
    group_scale = scale.repeat_interleave(128, -1)
    bound = _E4M3_REL_ERROR * x.abs() + _E4M3_SUBNORMAL_ABS_ERROR * group_scale
    assert (error <= bound * (1 + 1e-6)).all(), float((error / bound).max())
    assert error.max() > 0  # it really quantized


def test_act_quant_all_zero_group_stays_zero():
    x_fp8, scale = act_quant(torch.zeros(1, 128))
    assert torch.equal(x_fp8.float(), torch.zeros(1, 128)) and torch.isfinite(scale).all()


def test_weight_dequant_formula():
    w = _randn(130, 260)
    q, scale = weight_quant(w)
    assert q.dtype == FP8 and scale.shape == (2, 3)
    expected = torch.empty(130, 260)
    for i in range(130):
        for j in range(260):
            expected[i, j] = q[i, j].float() * scale[i // 128, j // 128]
    assert torch.equal(weight_dequant(q, scale), expected)
    # e4m3 keeps ~2 significant bits
    assert (weight_dequant(q, scale) - w).abs().max() < 0.1 * w.abs().max()


@pytest.mark.parametrize(("m", "n", "k"), [(1, 256, 128), (5, 320, 384), (64, 192, 640)])
def test_fp8_gemm_matches_dequantize_then_matmul(m, n, k):
    """K/128 of 1, 3 and 5 (none a multiple of 4) and a partial last N block (320)."""
    a_fp8, a_scale = act_quant(_randn(m, k, seed=2))
    b_fp8, b_scale = weight_quant(_randn(n, k, seed=3) / k**0.5)
    expected = _dequant_activations(a_fp8, a_scale) @ weight_dequant(b_fp8, b_scale).T
    got = fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, out_dtype=torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(
        got, expected, rtol=_GEMM_RTOL, atol=_GEMM_RTOL * float(expected.abs().max())
    )
    # DeepSeek's default output
    assert fp8_gemm(a_fp8, a_scale, b_fp8, b_scale).dtype == torch.bfloat16


def test_fp8_gemm_rejects_bad_inputs():
    a_fp8, a_scale = act_quant(_randn(4, 256))
    b_fp8, b_scale = weight_quant(_randn(128, 256))
    odd_b, odd_scale = weight_quant(_randn(128, 320))
    with pytest.raises(ValueError, match="K=320 is not a multiple of 128"):
        fp8_gemm(torch.zeros(4, 320, dtype=FP8), torch.ones(4, 3), odd_b, odd_scale)
    with pytest.raises(ValueError, match="a must be 2-D"):
        fp8_gemm(a_fp8.float(), a_scale, b_fp8, b_scale)
    with pytest.raises(ValueError, match="a_scale must be float32"):
        fp8_gemm(a_fp8, a_scale[:, :1], b_fp8, b_scale)
    with pytest.raises(ValueError, match="scale_inv must be float32"):
        fp8_gemm(a_fp8, a_scale, b_fp8, b_scale.double())
    with pytest.raises(ValueError, match="must be contiguous"):
        fp8_gemm(a_fp8.t().contiguous().t(), a_scale, b_fp8, b_scale)
    with pytest.raises(ValueError, match="no native block-wise FP8 GEMM on cpu"):
        fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, impl="native")


def test_act_quant_rejects_non_divisible_or_strided_input():
    with pytest.raises(ValueError, match="last dim 320 is not a multiple of 128"):
        act_quant(torch.zeros(2, 320))
    with pytest.raises(ValueError, match="contiguous"):
        act_quant(torch.zeros(256, 2).t())


def test_fp8_linear_pads_a_partial_k_block():
    """A checkpoint weight of width 320 (2.5 blocks), padded at load; the input is padded to
    match."""
    x = _randn(3, 7, 320, seed=4).to(torch.bfloat16)
    w_fp8, w_scale = weight_quant(_randn(192, 320, seed=5) / 320**0.5)
    y = fp8_linear(x, pad_to_blocks(w_fp8), w_scale)
    assert y.shape == (3, 7, 192) and y.dtype == torch.bfloat16
    x_fp8, x_scale = act_quant(F.pad(x.float(), (0, 64)))
    expected = _dequant_activations(x_fp8, x_scale)[..., :320] @ weight_dequant(w_fp8, w_scale).T
    # the bf16 output's rounding
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="input width 128 does not fit"):
        fp8_linear(x[..., :128], pad_to_blocks(w_fp8), w_scale)


def test_no_native_fp8_gemm_on_cpu():
    assert not native_fp8_gemm_available(torch.device("cpu"))


@pytest.mark.skipif(
    not torch.cuda.is_available() or not native_fp8_gemm_available(torch.device("cuda")),
    reason="needs a CUDA sm90 GPU with the native block-wise FP8 GEMM",
)
@pytest.mark.parametrize("m", [1, 3, 8, 17, 64])
def test_native_fp8_gemm_matches_the_reference_at_every_token_count(m):
    """cuBLASLt refuses M % 8 != 0 (decode batches): fp8_gemm pads those rows and drops their
    outputs."""
    device = torch.device("cuda")
    a_fp8, a_scale = act_quant(_randn(m, 384, seed=m).to(device))
    b_fp8, b_scale = weight_quant(_randn(368, 384, seed=1).to(device) / 384**0.5)
    y = fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, out_dtype=torch.float32, impl="native")
    expected = fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, out_dtype=torch.float32, impl="reference")
    assert y.shape == (m, 368)
    torch.testing.assert_close(y, expected, rtol=1e-3, atol=1e-3)  # only summation order differs
