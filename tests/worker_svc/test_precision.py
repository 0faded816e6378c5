"""The precision policy of SPEC.md, without a GPU."""
from __future__ import annotations

import logging

import pytest
import torch

from worker_svc.precision import choose_precision, detect_capabilities, runnable_precision


@pytest.mark.parametrize(
    ("device", "cc", "cpu_bf16", "expected"),
    [
        ("cuda", "9.0", False, "fp8"),  # H100/H200/H800
        ("cuda", "8.0", False, "bf16"),  # A100
        ("cuda", "8.9", False, "bf16"),  # L40S: FP8 is Hopper-only in this policy
        ("cuda", "7.0", False, "fp16"),  # V100: no BF16
        ("rocm", "gfx908", False, "bf16"),  # MI100
        ("cpu", "", True, "bf16"),  # AVX512-BF16 / AMX
        ("cpu", "", False, "fp32"),  # AVX2
    ],
)
def test_auto_policy(device, cc, cpu_bf16, expected):
    assert choose_precision(device, cc, cpu_has_bf16=cpu_bf16) == expected


def test_overrides():
    assert choose_precision("cuda", "9.0", use_native_fp8=False) == "bf16"
    assert choose_precision("cuda", "9.0", dtype="bfloat16") == "bf16"
    assert choose_precision("cpu", dtype="fp32", cpu_has_bf16=True) == "fp32"
    assert choose_precision("cuda", "8.0", dtype="float16") == "fp16"
    with pytest.raises(ValueError, match="use_native_fp8"):
        choose_precision("cuda", "8.0", use_native_fp8=True)
    with pytest.raises(ValueError, match="dtype=fp8 needs an sm90"):
        choose_precision("cpu", dtype="fp8")
    with pytest.raises(ValueError, match="dtype='int4'"):
        choose_precision("cpu", dtype="int4")


def test_fp8_runs_as_bf16_until_the_fp8_gemm_exists(caplog):
    with caplog.at_level(logging.WARNING, logger="worker_svc.precision"):
        assert runnable_precision("fp8") == "bf16"
    assert "issue #7" in caplog.text
    assert runnable_precision("fp32") == "fp32"


def test_detect_cpu():
    caps = detect_capabilities(torch.device("cpu"), dtype="fp32")
    assert (caps.device, caps.compute_capability, caps.precision) == ("cpu", "", "fp32")
    assert caps.memory_total_bytes > 0
