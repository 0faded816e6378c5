"""The precision policy (worker_svc/model/precision.py), without a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from worker_svc.hardware.gpu_profiles import gpu_profiles
from worker_svc.model.kernel import FP8
from worker_svc.model.precision import (
    MEASURED_FP8_DECODE,
    TORCH_DTYPES,
    DecodeMeasurement,
    choose_precision,
    cpu_has_native_bf16,
    detect_capabilities,
)


@pytest.mark.parametrize(
    ("device", "cc", "fp8_gemm", "cpu_bf16", "expected"),
    [
        ("cuda", "9.0", True, False, "fp8"),  # H100/H200/H800 with an FP8 GEMM (Triton's)
        # Hopper, but no FP8 GEMM (no Triton, a torch/CUDA without the block-wise GEMM)
        ("cuda", "9.0", False, False, "bf16"),
        # B200: cuBLASLt's DeepSeek-style scaling is sm90-only
        ("cuda", "10.0", False, False, "bf16"),
        ("cuda", "8.9", False, False, "bf16"),  # L40S: Triton's FP8 runs, not yet measured to pay
        ("cuda", "8.0", False, False, "bf16"),  # A100
        ("cuda", "7.0", False, False, "fp16"),  # V100: no BF16
        ("rocm", "gfx908", False, False, "bf16"),  # MI100
        ("cpu", "", False, True, "bf16"),  # AVX512-BF16 / AMX
        ("cpu", "", False, False, "fp32"),  # AVX2: bf16 GEMMs measured slower (bench/cpu_dtype.py)
    ],
)
def test_auto_policy(device, cc, fp8_gemm, cpu_bf16, expected):
    assert (
        choose_precision(device, cc, fp8_gemm=fp8_gemm, cpu_has_bf16=cpu_bf16).precision == expected
    )


def test_overrides():
    assert choose_precision("cuda", "9.0", fp8_gemm=True, use_native_fp8=False).precision == "bf16"
    assert choose_precision("cuda", "9.0", fp8_gemm=True, use_native_fp8=True).precision == "fp8"
    assert choose_precision("cuda", "9.0", fp8_gemm=True, dtype="bfloat16").precision == "bf16"
    assert choose_precision("cuda", "9.0", fp8_gemm=True, dtype="float32").precision == "fp32"
    assert choose_precision("cpu", dtype="fp32", cpu_has_bf16=True).precision == "fp32"
    assert choose_precision("cpu", dtype="bfloat16").precision == "bf16"
    assert choose_precision("cuda", "8.0", dtype="float16").precision == "fp16"
    with pytest.raises(
        ValueError, match=r"use_native_fp8=true needs an sm90 GPU .* this is cuda 8\.0"
    ):
        choose_precision("cuda", "8.0", use_native_fp8=True)
    with pytest.raises(ValueError, match="use_native_fp8=true needs an sm90 GPU"):
        choose_precision("cuda", "9.0", fp8_gemm=False, use_native_fp8=True)
    with pytest.raises(ValueError, match="use_native_fp8=true contradicts dtype='bfloat16'"):
        choose_precision("cuda", "9.0", fp8_gemm=True, use_native_fp8=True, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype=fp8 needs an sm90 GPU"):
        choose_precision("cpu", dtype="fp8")
    with pytest.raises(ValueError, match="dtype='int4'"):
        choose_precision("cpu", dtype="int4")


def test_a_checkpoint_without_fp8_weights_runs_bf16_on_sm90():
    """DeepSeek-V2's BF16 checkpoints: nothing to keep in FP8, so the policy's next choice."""
    assert choose_precision("cuda", "9.0", fp8_gemm=True, fp8_weights=False).precision == "bf16"
    assert choose_precision("cuda", "8.0", fp8_weights=False).precision == "bf16"
    for override in ({"use_native_fp8": True}, {"dtype": "fp8"}):
        with pytest.raises(
            ValueError, match=r"needs a checkpoint with FP8 weights \(quantization_config fp8\)"
        ):
            choose_precision("cuda", "9.0", fp8_gemm=True, fp8_weights=False, **override)


def test_the_choice_says_why() -> None:
    """The reason is logged at start, so an operator sees why FP8 did or did not run."""
    assert choose_precision("cuda", "9.0", fp8_gemm=True).reason == (
        "FP8 checkpoint, and FP8 GEMMs run here"
    )
    cpu = choose_precision("cpu", fp8_needs="needs AMX for vLLM's FP8 kernels", cpu_has_bf16=True)
    assert cpu.precision == "bf16"
    assert cpu.reason == (
        "no FP8: it needs AMX for vLLM's FP8 kernels, this is cpu; FP8 weights dequantized; "
        "the CPU has AVX512-BF16 or AMX"
    )
    forced = choose_precision("cuda", "9.0", fp8_gemm=True, use_native_fp8=False)
    assert forced.reason == "[quantization] use_native_fp8 = false: FP8 weights dequantized"
    assert choose_precision("cuda", "7.0").reason.endswith("no BF16 before sm80")
    assert choose_precision("cpu", dtype="float32").reason == (
        "[model] dtype = 'float32'; FP8 weights dequantized"
    )
    assert choose_precision("cpu", dtype="float32", fp8_weights=False).reason == (
        "[model] dtype = 'float32'"
    )
    # vLLM runs FP8 on a CPU with AMX: the policy follows the engine's word, whatever the device
    assert choose_precision("cpu", fp8_gemm=True).precision == "fp8"


def test_fp8_loads_fp8_weights():
    assert TORCH_DTYPES["fp8"] == FP8 and TORCH_DTYPES["bf16"] == torch.bfloat16


def test_detect_cpu(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="worker_svc.model.precision"):
        caps = detect_capabilities(torch.device("cpu"))
    assert (caps.device, caps.compute_capability) == ("cpu", "")
    assert caps.precision == ("bf16" if cpu_has_native_bf16() else "fp32")
    assert f"running {caps.precision} (" in caplog.text and "FP8 GEMM no" in caplog.text
    assert caps.memory_total_bytes > 0
    assert detect_capabilities(torch.device("cpu"), dtype="bfloat16").precision == "bf16"
    with pytest.raises(ValueError, match="use_native_fp8=true needs an sm90 GPU"):
        detect_capabilities(torch.device("cpu"), use_native_fp8=True)


def test_fp8_follows_the_measured_decode_step():
    """Where FP8's step was measured slower than BF16's at any batch size, "auto" serves BF16 and
    says why; measured faster everywhere, FP8; forcing FP8 still serves it."""
    slower = DecodeMeasurement({1: 0.7, 8: 1.2}, "a run")
    faster = DecodeMeasurement({1: 0.7, 8: 0.9, 64: 1.0}, "a run")
    choice = choose_precision("cuda", "9.0", fp8_gemm=True, fp8_decode=slower)
    assert choice.precision == "bf16"
    assert choice.reason.startswith(
        "FP8's decode step measured 0.70x at batch 1, 1.20x at batch 8 BF16's (a run): serving BF16"
    )
    assert choose_precision("cuda", "9.0", fp8_gemm=True, fp8_decode=faster).precision == "fp8"
    for override in ({"dtype": "fp8"}, {"use_native_fp8": True}):
        forced = choose_precision("cuda", "9.0", fp8_gemm=True, fp8_decode=slower, **override)
        assert forced.precision == "fp8"


def test_the_measured_table_names_gpu_kinds_of_the_profiles():
    assert set(MEASURED_FP8_DECODE) <= set(gpu_profiles())
    assert not MEASURED_FP8_DECODE["H200"].fp8_pays  # 2026-12-04: 3.2-8.7x BF16's step
