"""The Triton kernels (worker_svc/model/triton_kernels.py), run by Triton's interpreter on a CPU
in a process of their own, against kernel.py's reference quantization, dequantization and GEMM on
the shape families DeepSeek-V3 serves in FP8."""

from __future__ import annotations

import pytest
import torch
from triton import knobs

from tests.helpers.triton_interpreter import TritonInterpreter
from worker_svc.model import kernel, triton_kernels
from worker_svc.model.kernel import FP8, act_quant, fp8_gemm, weight_dequant, weight_quant

# Same quantized inputs, FP32 accumulation on both sides: only summation order differs (the
# reference tests' bound, tests/worker_svc/model/test_kernel.py).
_GEMM_RTOL = 1e-5
# DeepSeek-V3's FP8 projections (N x K) and the stand-ins the interpreter runs in time: each keeps
# what the kernel must get right in its original (a partial last N block, K split over several
# slices at decode sizes, an odd number of K blocks), scaled down.
FAMILIES = {
    "kv_a_proj 576x7168": (576, 896),
    "q_b_proj 24576x1536": (384, 1536),
    "o_proj 7168x16384": (256, 2048),
    "expert gate_up 2048x7168": (256, 1792),
    "expert down 7168x2048": (448, 256),
    "dense down 7168x18432": (128, 2304),
}
TOKENS = (1, 3, 8, 17, 64, 65, 512)
# prefill-sized M: K's depth checks nothing the decode sizes do not, and costs the interpreter most
_PREFILL_K = 512


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _operands(
    m: int, n: int, k: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a_fp8, a_scale = act_quant(_randn(m, k, seed=seed), impl="reference")
    b_fp8, b_scale = weight_quant(_randn(n, k, seed=seed + 1) / k**0.5)
    return a_fp8, a_scale, b_fp8, b_scale


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_the_interpreter_runs_in_its_own_process_only(interpreter: TritonInterpreter) -> None:
    assert interpreter.call(_interpreting) and not knobs.runtime.interpret


def _interpreting() -> bool:
    return bool(knobs.runtime.interpret)


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("family", FAMILIES)
def test_gemm_matches_the_reference(interpreter: TritonInterpreter, family: str, m: int) -> None:
    """The split and tile the device would get (split-K sized for an H100's 132 multiprocessors)."""
    n, k = FAMILIES[family]
    k = min(k, _PREFILL_K) if m > 65 else k
    a_fp8, a_scale, b_fp8, b_scale = _operands(m, n, k, seed=m)
    got = interpreter.call(
        fp8_gemm, a_fp8, a_scale, b_fp8, b_scale, out_dtype=torch.float32, impl="triton"
    )
    expected = fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, out_dtype=torch.float32, impl="reference")
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(
        got, expected, rtol=_GEMM_RTOL, atol=_GEMM_RTOL * float(expected.abs().max())
    )


@pytest.mark.parametrize("splits", [1, 2, 4, 5])
@pytest.mark.parametrize("config", triton_kernels.GEMM_CONFIGS, ids=str)
def test_every_tile_and_split_the_autotuner_may_pick(
    interpreter: TritonInterpreter, config: triton_kernels.GemmConfig, splits: int
) -> None:
    """K = 5 blocks: 4 slices leave the last one empty (it must write zeros), 5 give one each."""
    a_fp8, a_scale, b_fp8, b_scale = _operands(17, 320, 640, seed=splits)
    got = interpreter.call(
        triton_kernels.fp8_gemm,
        a_fp8,
        a_scale,
        b_fp8,
        b_scale,
        torch.float32,
        splits=splits,
        config=config,
    )
    expected = fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, out_dtype=torch.float32, impl="reference")
    torch.testing.assert_close(
        got, expected, rtol=_GEMM_RTOL, atol=_GEMM_RTOL * float(expected.abs().max())
    )


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_gemm_rounds_its_output_once_like_torch(
    interpreter: TritonInterpreter, out_dtype: torch.dtype
) -> None:
    a_fp8, a_scale, b_fp8, b_scale = _operands(8, 384, 512, seed=3)
    got = interpreter.call(
        fp8_gemm, a_fp8, a_scale, b_fp8, b_scale, out_dtype=out_dtype, impl="triton"
    )
    expected = fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, out_dtype=torch.float32, impl="reference")
    assert got.dtype == out_dtype
    # at most the one rounding to out_dtype (half an ulp) over the FP32 sums' difference
    torch.testing.assert_close(got.float(), expected, rtol=2.0**-8, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", sorted({k for _, k in FAMILIES.values()}))
def test_act_quant_is_bit_identical(
    interpreter: TritonInterpreter, k: int, dtype: torch.dtype
) -> None:
    """Heavy tails: every group has values E4M3 rounds up across a power of two, subnormals and
    ties."""
    x = (_randn(65, k, seed=k) ** 3 * torch.logspace(-3, 3, k)).to(dtype)
    x[7, :128] = 0  # an all-zero group
    got_fp8, got_scale = interpreter.call(act_quant, x, impl="triton")
    want_fp8, want_scale = act_quant(x, impl="reference")
    assert torch.equal(_bytes(got_fp8), _bytes(want_fp8))
    assert torch.equal(got_scale, want_scale)
    assert got_scale.stride() == want_scale.stride() == (1, 65)  # token-major, as the GEMMs read


@pytest.mark.parametrize("m", TOKENS)
def test_act_quant_at_every_token_count(interpreter: TritonInterpreter, m: int) -> None:
    """V3's hidden size, unscaled, at decode sizes."""
    x = _randn(m, _PREFILL_K if m > 65 else 7168, seed=m).to(torch.bfloat16)
    got_fp8, got_scale = interpreter.call(act_quant, x, impl="triton")
    want_fp8, want_scale = act_quant(x, impl="reference")
    assert torch.equal(_bytes(got_fp8), _bytes(want_fp8)) and torch.equal(got_scale, want_scale)


def test_act_quant_rounds_to_nearest_even_and_carries(interpreter: TritonInterpreter) -> None:
    """With a 448 in the group its scale is 1: the values are rounded to E4M3 as they are."""
    values = [448.0, 126.3, 1.0625, 1.1875, 31.9, 2.0**-7 * 1.5, 2.0**-10 * 3, -(2.0**-10), 447.9]
    x = torch.zeros(2, 128)
    x[:, : len(values)] = torch.tensor(values)
    x[1] *= -1
    got_fp8, got_scale = interpreter.call(act_quant, x, impl="triton")
    assert torch.equal(got_scale, torch.ones(2, 1))
    assert torch.equal(_bytes(got_fp8), _bytes(x.to(FP8)))  # torch's cast: nearest, ties to even
    assert got_fp8[0, 1].item() == 128.0  # the carry into the exponent


def _amaxes_the_reciprocal_misrounds(count: int) -> torch.Tensor:
    """amaxes whose fl(amax * fl(1 / 448)), CUDA torch's way of dividing by a Python number,
    differs from the correctly rounded amax / 448."""
    amax = torch.linspace(1.0, 2.0, 4096)
    reciprocal = amax * (torch.ones(()) / 448)
    exact = (amax.double() / 448).float()  # double then float: a correctly rounded division
    return amax[reciprocal != exact][:count]


def test_the_scale_is_the_division_on_every_device() -> None:
    """kernel.e4m3_scale divides by a tensor, the division CUDA and the CPU both round correctly;
    these amaxes are those where the reciprocal multiply the old `amax / 448` became on a GPU gave
    another scale (the act_quant mismatch an H200 found)."""
    amax = _amaxes_the_reciprocal_misrounds(64)
    assert amax.numel() == 64
    assert torch.equal(kernel.e4m3_scale(amax), (amax.double() / 448).float())
    assert torch.equal(kernel.e4m3_scale(torch.zeros(2)), torch.full((2,), 1e-12))


def test_act_quant_is_bit_identical_on_ties_and_extremes(interpreter: TritonInterpreter) -> None:
    """Groups led by the amaxes the reciprocal misrounds, by BF16's largest and smallest normal
    values, by subnormals; values at E4M3 ties once scaled (k + 0.5 steps), signed zeros."""
    rows = []
    for amax in [*_amaxes_the_reciprocal_misrounds(8).tolist(), 3.3895e38, 1.1755e-38, 9.2e-41]:
        ties = torch.tensor([1.125, 1.375, 2.25, 0.5 * 2.0**-9, 1.5 * 2.0**-9, 2.0**-10]) / 448
        group = torch.cat([torch.tensor([amax, -amax, -0.0]), amax * ties, amax * -ties])
        rows.append(torch.cat([group, amax * torch.linspace(-1, 1, 128 - group.numel())]))
    x = torch.stack(rows).to(torch.bfloat16).float()
    for dtype in (torch.float32, torch.bfloat16):
        got_fp8, got_scale = interpreter.call(act_quant, x.to(dtype), impl="triton")
        want_fp8, want_scale = act_quant(x.to(dtype), impl="reference")
        assert torch.equal(_bytes(got_fp8), _bytes(want_fp8)), dtype
        assert torch.equal(got_scale, want_scale), dtype


def test_act_quant_keeps_the_callers_shape_and_group(interpreter: TritonInterpreter) -> None:
    """The indexer quantizes whole heads of 64: [batch, seq, heads, 64] in one group each."""
    x = _randn(2, 3, 4, 64, seed=9)
    got_fp8, got_scale = interpreter.call(act_quant, x, 64, impl="triton")
    want_fp8, want_scale = act_quant(x, 64, impl="reference")
    assert got_fp8.shape == x.shape and got_scale.shape == (2, 3, 4, 1)
    assert torch.equal(_bytes(got_fp8), _bytes(want_fp8)) and torch.equal(got_scale, want_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(130, 260), (576, 896), (2048, 128)])
def test_weight_dequant_is_bit_identical(
    interpreter: TritonInterpreter, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    """Partial edge blocks (130 x 260), subnormal FP8 codes (the small values of every block)."""
    q, scale = weight_quant(_randn(*shape, seed=shape[0]) ** 3)
    got = interpreter.call(weight_dequant, q, scale, dtype=dtype, impl="triton")
    assert got.dtype == dtype and torch.equal(got, weight_dequant(q, scale, dtype=dtype))


def test_fp8_linear_through_the_triton_gemm(interpreter: TritonInterpreter) -> None:
    x = _randn(3, 7, 320, seed=4).to(torch.bfloat16)
    w_fp8, w_scale = weight_quant(_randn(192, 320, seed=5) / 320**0.5)
    padded = kernel.pad_to_blocks(w_fp8)
    got = interpreter.call(kernel.fp8_linear, x, padded, w_scale, impl="triton")
    expected = kernel.fp8_linear(x, padded, w_scale, impl="reference")
    assert got.shape == (3, 7, 192) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2.0**-8, atol=1e-6)


def test_triton_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    a_fp8, a_scale, b_fp8, b_scale = _operands(4, 128, 256)
    with pytest.raises(ValueError, match=r"impl='triton' does not run on cpu here \(needs a CUDA"):
        fp8_gemm(a_fp8, a_scale, b_fp8, b_scale, impl="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        weight_dequant(b_fp8, b_scale, impl="triton")
    assert not kernel.triton_fp8_available(torch.device("cpu"))
    assert not kernel.fp8_gemm_available(torch.device("cpu"))


def test_split_k_fills_the_gpu_only_where_m_x_n_leaves_it_idle() -> None:
    """An H200's 132 multiprocessors: V3's expert gate_up (N 2048, K 7168) at one token is 32 tiles
    of 64 columns, so 4 slices; its down projection (N 7168) is 112 tiles already."""
    assert triton_kernels.split_k(1, 2048, 7168, 132) == 4
    assert triton_kernels.split_k(1, 7168, 2048, 132) == 1
    assert triton_kernels.split_k(512, 2048, 7168, 132) == 1
    assert triton_kernels.split_k(1, 576, 7168, 132) == 8  # at most 8
    assert triton_kernels.split_k(1, 128, 512, 132) == 1  # K of 4 blocks is never split
