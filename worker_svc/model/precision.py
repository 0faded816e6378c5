"""Device detection and the precision policy: the dtype a worker serves in, per device.

- CUDA sm90 (H100/H200/H800) with torch's block-wise scaled matmul: FP8 weights, 1x128 activation
  quantization, block-scaled FP8 GEMMs with FP32 accumulation (kernel.py).
- sm89 (L40S) and sm100: BF16 -- their FP8 needs a kernel tested here, and cuBLASLt's DeepSeek-style
  block scaling is sm90-only. sm80 and ROCm: BF16. sm70 (V100, no BF16): FP16.
- A checkpoint without FP8 weights (DeepSeek-V2's BF16 ones): the dtype above without FP8, BF16 on
  sm90.
- CPU: BF16 with AVX512-BF16 or AMX-BF16, else FP32. Measured with bench/cpu_dtype.py
  (docs/BENCHMARKS.md, "Engine precision"): on an AVX2 EPYC BF16 GEMMs were 1.5-7x slower than FP32
  at 16 and 64 tokens (oneDNN converts); on an AVX512-BF16 EPYC a serving mix of decode batches
  1..64 and prefill chunks ran 1.48x faster in BF16, BF16 winning at every batch size.
`[model] dtype` and `[quantization] use_native_fp8` override the choice. `choose_precision` is pure
so the policy is testable without a GPU; `detect_capabilities` feeds it with what this machine has.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from infermesh.names import Precision
from worker_svc.engine_api import DeviceCapabilities, DeviceKind
from worker_svc.model.kernel import FP8, native_fp8_gemm_available

logger = logging.getLogger(__name__)

_DTYPE_ALIASES: dict[str, Precision] = {
    "fp8": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}
TORCH_DTYPES: dict[Precision, torch.dtype] = {
    "fp8": FP8,  # load_checkpoint keeps FP8 linear weights and serves the rest in bfloat16
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def _major(compute_capability: str) -> int:
    return int(compute_capability.split(".")[0]) if compute_capability else 0


def choose_precision(
    device: DeviceKind,
    compute_capability: str = "",
    *,
    fp8_gemm: bool = False,
    cpu_has_bf16: bool = False,
    dtype: str = "auto",
    use_native_fp8: bool | None = None,
    fp8_weights: bool = True,
) -> Precision:
    """The policy: what this hardware should run, given the operator's overrides.

    fp8_gemm: a tested block-scaled FP8 GEMM runs on this device (kernel.native_fp8_gemm_available);
    dtype: "auto" or a forced precision (fp8/bf16/fp16/fp32 or torch spellings);
    use_native_fp8: None = FP8 where the device runs it, False = never, True = required;
    fp8_weights: the checkpoint stores FP8 weights with block scales (its quantization_config says
    fp8). Raises ValueError for an override the hardware or the checkpoint cannot honour.
    """
    where = f"{device} {compute_capability}".strip()
    if not (device == "cuda" and fp8_gemm):
        no_fp8 = f"needs an sm90 GPU with torch's block-wise FP8 GEMM, this is {where}"
    elif not fp8_weights:
        no_fp8 = "needs a checkpoint with FP8 weights (quantization_config fp8), this one has none"
    else:
        no_fp8 = ""
    fp8_capable = not no_fp8
    if use_native_fp8 and not fp8_capable:
        raise ValueError(f"use_native_fp8=true {no_fp8}")
    if dtype != "auto":
        if dtype.lower() not in _DTYPE_ALIASES:
            raise ValueError(
                f"dtype={dtype!r}: expected auto, {', '.join(sorted(set(_DTYPE_ALIASES.values())))}"
            )
        forced = _DTYPE_ALIASES[dtype.lower()]
        if forced == "fp8" and not fp8_capable:
            raise ValueError(f"dtype=fp8 {no_fp8}")
        if use_native_fp8 and forced != "fp8":
            raise ValueError(f"use_native_fp8=true contradicts dtype={dtype!r}")
        return forced
    if fp8_capable and use_native_fp8 is not False:
        return "fp8"
    if device == "cuda":
        return "bf16" if _major(compute_capability) >= 8 else "fp16"
    if device == "rocm":
        return "bf16"
    return "bf16" if cpu_has_bf16 else "fp32"


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
    device: torch.device,
    *,
    dtype: str = "auto",
    use_native_fp8: bool | None = None,
    fp8_weights: bool = True,
) -> DeviceCapabilities:
    """Probe the device and apply the policy to it and the checkpoint (fp8_weights); weight_bytes is
    filled in after the load."""
    fp8_gemm = native_fp8_gemm_available(device)  # False off CUDA sm90
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind: DeviceKind = "rocm" if torch.version.hip else "cuda"
        cc = f"{props.major}.{props.minor}" if kind == "cuda" else getattr(props, "gcnArchName", "")
        name, memory = props.name, props.total_memory
        precision = choose_precision(
            kind,
            cc,
            fp8_gemm=fp8_gemm,
            dtype=dtype,
            use_native_fp8=use_native_fp8,
            fp8_weights=fp8_weights,
        )
    else:
        kind, cc, name = "cpu", "", _cpu_name()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        precision = choose_precision(
            "cpu",
            cpu_has_bf16=cpu_has_native_bf16(),
            dtype=dtype,
            use_native_fp8=use_native_fp8,
            fp8_weights=fp8_weights,
        )
    logger.info(
        "device %s (%s, cc %s, block-wise FP8 GEMM %s): running %s (dtype=%s, use_native_fp8=%s)",
        kind,
        name,
        cc or "-",
        "yes" if fp8_gemm else "no",
        precision,
        dtype,
        use_native_fp8,
    )
    return DeviceCapabilities(kind, name, cc, precision, memory, 0)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
