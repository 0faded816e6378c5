"""Device detection and the precision policy (SPEC.md "Precision policy").

Hopper (sm90) keeps FP8 weights; other GPUs dequantize to BF16 (FP16 where BF16 is missing);
CPUs run BF16 only with AVX512-BF16/AMX, else FP32. `choose_precision` is pure so the policy is
testable without a GPU; `detect_capabilities` feeds it with what this machine has.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

logger = logging.getLogger(__name__)

Precision = Literal["fp8", "bf16", "fp16", "fp32"]
DeviceKind = Literal["cuda", "rocm", "cpu"]

# Issue #7 brings the block-scaled FP8 GEMM; until then a chosen fp8 runs as bf16.
NATIVE_FP8_GEMM_AVAILABLE = False

_DTYPE_ALIASES: dict[str, Precision] = {
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}  # fmt: skip
TORCH_DTYPES: dict[Precision, torch.dtype] = {
    "fp8": torch.bfloat16,  # compute dtype of the non-FP8 parts
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


@dataclass(frozen=True)
class DeviceCapabilities:
    """What the worker runs on and with, as reported to the router."""

    device: DeviceKind
    device_name: str
    compute_capability: str  # "9.0"; "" on CPU
    precision: Precision  # what actually runs
    memory_total_bytes: int
    weight_bytes: int


def _major(compute_capability: str) -> int:
    return int(compute_capability.split(".")[0]) if compute_capability else 0


def choose_precision(
    device: DeviceKind,
    compute_capability: str = "",
    *,
    cpu_has_bf16: bool = False,
    dtype: str = "auto",
    use_native_fp8: bool | None = None,
) -> Precision:
    """The policy: what this hardware should run, given the operator's overrides.

    dtype: "auto" or a forced precision (fp8/bf16/fp16/fp32 or torch spellings);
    use_native_fp8: None = FP8 where the hardware has it (sm90), False = never, True = required.
    Raises ValueError for an override the hardware cannot honour.
    """
    fp8_capable = device == "cuda" and _major(compute_capability) >= 9
    if use_native_fp8 and not fp8_capable:
        raise ValueError(f"use_native_fp8=true needs an sm90 GPU, this is {device} {compute_capability or ''}".strip())
    if dtype != "auto":
        if dtype.lower() not in _DTYPE_ALIASES:
            raise ValueError(f"dtype={dtype!r}: expected auto, {', '.join(sorted(set(_DTYPE_ALIASES.values())))}")
        forced = _DTYPE_ALIASES[dtype.lower()]
        if forced == "fp8" and not fp8_capable:
            raise ValueError(f"dtype=fp8 needs an sm90 GPU, this is {device}")
        return forced
    if fp8_capable and use_native_fp8 is not False:
        return "fp8"
    if device == "cuda":
        return "bf16" if _major(compute_capability) >= 8 else "fp16"
    if device == "rocm":
        return "bf16"
    return "bf16" if cpu_has_bf16 else "fp32"


def runnable_precision(chosen: Precision) -> Precision:
    """What runs for a chosen precision: fp8 falls back to bf16 until the FP8 GEMM exists."""
    if chosen == "fp8" and not NATIVE_FP8_GEMM_AVAILABLE:
        logger.warning("FP8 chosen for this GPU but no FP8 GEMM is implemented yet (issue #7): running BF16")
        return "bf16"
    return chosen


def cpu_has_native_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX-BF16 (fast BF16 matmuls in oneDNN)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if "AMX" in capability or "BF16" in capability:
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def detect_capabilities(
    device: torch.device, *, dtype: str = "auto", use_native_fp8: bool | None = None
) -> DeviceCapabilities:
    """Probe the device and apply the policy; weight_bytes is filled in after the load."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind: DeviceKind = "rocm" if torch.version.hip else "cuda"
        cc = f"{props.major}.{props.minor}" if kind == "cuda" else getattr(props, "gcnArchName", "")
        name, memory = props.name, props.total_memory
        chosen = choose_precision(kind, cc, dtype=dtype, use_native_fp8=use_native_fp8)
    else:
        kind, cc, name = "cpu", "", _cpu_name()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        chosen = choose_precision("cpu", cpu_has_bf16=cpu_has_native_bf16(), dtype=dtype, use_native_fp8=use_native_fp8)
    precision = runnable_precision(chosen)
    logger.info("device %s (%s, cc %s): policy %s, running %s", kind, name, cc or "-", chosen, precision)
    return DeviceCapabilities(kind, name, cc, precision, memory, 0)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
