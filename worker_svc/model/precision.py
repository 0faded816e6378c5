"""Device detection and the precision policy: the dtype a worker serves in, per device and engine.

- FP8 where the engine runs the checkpoint's block-scaled FP8 weights on this device (`fp8_gemm`).
  The checkpoint engine: CUDA sm90 (H100/H200/H800) with kernel.py's Triton GEMM or torch's
  block-wise scaled matmul: FP8 weights, 1x128 activation quantization, block-scaled FP8 GEMMs with
  FP32 accumulation. sm89 (L40S) runs the Triton kernels but serves BF16 until measured to pay;
  sm100 (cuBLASLt's block scaling is sm90-only). The vLLM engine: what that vLLM build's kernels
  run (worker_svc/vllm_engine/args.py: CUDA sm75+, ROCm MI300-class, a CPU with AMX).
- Elsewhere the FP8 weights are dequantized (exactly: FP32 products rounded once): sm80 and ROCm
  BF16, sm70 (V100, no BF16) FP16.
- A checkpoint without FP8 weights (DeepSeek-V2's BF16 ones): the dtype above without FP8, BF16 on
  sm90.
- CPU: BF16 with AVX512-BF16 or AMX-BF16, else FP32. Measured with bench/cpu_dtype.py
  (docs/benchmarks/engine-precision.md): on an AVX2 EPYC BF16 GEMMs were 1.5-7x slower than FP32
  at 16 and 64 tokens (oneDNN converts); on an AVX512-BF16 EPYC a serving mix of decode batches
  1..64 and prefill chunks ran 1.48x faster in BF16, BF16 winning at every batch size.
- FP8 follows measurement: where `MEASURED_FP8_DECODE` holds the torch engine's decode step
  measured on a GPU kind (bench/hopper_suite.py) and FP8's step was slower than BF16's at any batch
  size measured, that kind serves BF16 (FP8 buys memory there, not speed), and says why.
`[model] dtype` and `[quantization] use_native_fp8` override the choice. `choose_precision` is pure
so the policy is testable without a GPU; `detect_capabilities` feeds it with what this machine has.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from infermesh.names import Precision
from worker_svc.engine.api import DeviceCapabilities, DeviceKind
from worker_svc.hardware.gpu_profiles import gpu_kind
from worker_svc.model.kernel import FP8, fp8_gemm_available

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


# What the checkpoint engine needs for FP8 (kernel.fp8_gemm_available), in the policy's messages
TORCH_FP8_NEEDS = "needs an sm90 GPU with an FP8 GEMM (Triton's or torch's block-wise scaled_mm)"


@dataclass(frozen=True)
class DecodeMeasurement:
    """The torch engine's FP8 decode step against its BF16 one on a GPU kind:
    fp8_over_bf16[batch] = FP8 step time / BF16 step time; `measured` says when, how and where
    the figures are recorded."""

    fp8_over_bf16: dict[int, float]
    measured: str

    @property
    def fp8_pays(self) -> bool:
        """FP8's step is no slower than BF16's at any batch size measured."""
        return max(self.fp8_over_bf16.values()) <= 1.0

    def __str__(self) -> str:
        ratios = ", ".join(f"{r:.2f}x at batch {b}" for b, r in sorted(self.fp8_over_bf16.items()))
        return f"FP8's decode step measured {ratios} BF16's ({self.measured})"


# Per GPU kind (gpu_profiles.toml's names): the last measurement of the engine's decode step with
# V3's widths, eager (bench/hopper_suite.py). A GPU run of the suite replaces its kind's row with
# the captured steps' figures (its summary prints the row); a kind without a row serves FP8.
MEASURED_FP8_DECODE: dict[str, DecodeMeasurement] = {
    "H200": DecodeMeasurement(
        {1: 3.20, 8: 8.71, 64: 6.72},
        "2026-12-04, eager, before the grouped MoE kernel and CUDA graphs; "
        "docs/benchmarks/fp8-hopper.md",
    ),
}


@dataclass(frozen=True)
class PrecisionChoice:
    precision: Precision
    reason: str  # why, for the worker's start-up log


def choose_precision(
    device: DeviceKind,
    compute_capability: str = "",
    *,
    fp8_gemm: bool = False,
    fp8_needs: str = TORCH_FP8_NEEDS,
    cpu_has_bf16: bool = False,
    dtype: str = "auto",
    use_native_fp8: bool | None = None,
    fp8_weights: bool = True,
    fp8_decode: DecodeMeasurement | None = None,
) -> PrecisionChoice:
    """The policy: what this hardware should run, given the operator's overrides.

    fp8_gemm: the engine runs block-scaled FP8 weights on this device (fp8_needs says what that
    takes, for the messages); dtype: "auto" or a forced precision (fp8/bf16/fp16/fp32 or torch
    spellings); use_native_fp8: None = FP8 where the device runs it, False = never, True =
    required; fp8_weights: the checkpoint stores FP8 weights with block scales (its
    quantization_config says fp8); fp8_decode: the engine's decode step measured on this GPU kind
    (None: unmeasured), which keeps "auto" off FP8 where FP8 was slower. Raises ValueError for an
    override the hardware or the checkpoint cannot honour.
    """
    where = f"{device} {compute_capability}".strip()
    if not fp8_gemm:
        no_fp8 = f"{fp8_needs}, this is {where}"
    elif not fp8_weights:
        no_fp8 = "needs a checkpoint with FP8 weights (quantization_config fp8), this one has none"
    else:
        no_fp8 = ""
    if use_native_fp8 and no_fp8:
        raise ValueError(f"use_native_fp8=true {no_fp8}")
    if dtype != "auto":
        if dtype.lower() not in _DTYPE_ALIASES:
            raise ValueError(
                f"dtype={dtype!r}: expected auto, {', '.join(sorted(set(_DTYPE_ALIASES.values())))}"
            )
        forced = _DTYPE_ALIASES[dtype.lower()]
        if forced == "fp8" and no_fp8:
            raise ValueError(f"dtype=fp8 {no_fp8}")
        if use_native_fp8 and forced != "fp8":
            raise ValueError(f"use_native_fp8=true contradicts dtype={dtype!r}")
        dequantized = "; FP8 weights dequantized" if fp8_weights and forced != "fp8" else ""
        return PrecisionChoice(forced, f"[model] dtype = {dtype!r}{dequantized}")
    if not no_fp8 and use_native_fp8 is True:
        return PrecisionChoice("fp8", "[quantization] use_native_fp8 = true")
    if not no_fp8 and use_native_fp8 is None and fp8_decode is not None and not fp8_decode.fp8_pays:
        return PrecisionChoice(
            "bf16",
            f"{fp8_decode}: serving BF16, FP8 weights dequantized "
            '([model] dtype = "fp8" serves FP8)',
        )
    if not no_fp8 and use_native_fp8 is None:
        return PrecisionChoice("fp8", "FP8 checkpoint, and FP8 GEMMs run here")
    if not fp8_weights:
        why = "the checkpoint has no FP8 weights"
    elif use_native_fp8 is False:
        why = "[quantization] use_native_fp8 = false: FP8 weights dequantized"
    else:
        why = f"no FP8: it {no_fp8}; FP8 weights dequantized"
    if device == "cuda":
        if _major(compute_capability) >= 8:
            return PrecisionChoice("bf16", why)
        return PrecisionChoice("fp16", f"{why}; no BF16 before sm80")
    if device == "rocm":
        return PrecisionChoice("bf16", why)
    if cpu_has_bf16:
        return PrecisionChoice("bf16", f"{why}; the CPU has AVX512-BF16 or AMX")
    return PrecisionChoice("fp32", f"{why}; the CPU has no native BF16 (measured slower)")


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


def probe_device(device: torch.device) -> DeviceCapabilities:
    """The device's kind, name, compute capability and memory; precision left at fp32 for the
    caller's policy to fill in."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind: DeviceKind = "rocm" if torch.version.hip else "cuda"
        cc = f"{props.major}.{props.minor}" if kind == "cuda" else getattr(props, "gcnArchName", "")
        return DeviceCapabilities(kind, props.name, cc, "fp32", props.total_memory, 0)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceCapabilities("cpu", _cpu_name(), "", "fp32", memory, 0)


def detect_capabilities(
    device: torch.device,
    *,
    dtype: str = "auto",
    use_native_fp8: bool | None = None,
    fp8_weights: bool = True,
) -> DeviceCapabilities:
    """Probe the device and apply the checkpoint engine's policy to it and the checkpoint
    (fp8_weights); weight_bytes is filled in after the load."""
    fp8_gemm = fp8_gemm_available(device)  # False off CUDA sm90
    probed = probe_device(device)
    measured = MEASURED_FP8_DECODE.get(gpu_kind(probed.device, probed.device_name))
    choice = choose_precision(
        probed.device,
        probed.compute_capability,
        fp8_gemm=fp8_gemm,
        cpu_has_bf16=probed.device == "cpu" and cpu_has_native_bf16(),
        dtype=dtype,
        use_native_fp8=use_native_fp8,
        fp8_weights=fp8_weights,
        fp8_decode=measured,
    )
    logger.info(
        "device %s (%s, cc %s, FP8 GEMM %s): running %s (%s)",
        probed.device,
        probed.device_name,
        probed.compute_capability or "-",
        "yes" if fp8_gemm else "no",
        choice.precision,
        choice.reason,
    )
    return dataclasses.replace(probed, precision=choice.precision)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
