"""GPU profiles (gpu_profiles.toml): the figures the simulated engine's roofline uses."""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from infermesh.names import Precision
from worker_svc.engine.api import DeviceKind

_PROFILES_PATH = Path(__file__).with_name("gpu_profiles.toml")
_BYTES_PER_WEIGHT: dict[Precision, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class GpuProfile:
    name: str  # the table name: "H100"
    device: DeviceKind
    device_name: str
    compute_capability: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    flops: dict[str, float]  # dense FLOP/s per dtype the GPU runs natively

    @property
    def precision(self) -> Precision:
        """What the precision policy (precision.choose_precision) runs here: FP8 on sm90,
        else BF16 where the GPU has it, else FP16."""
        if (
            "fp8" in self.flops
            and self.device == "cuda"
            and self.compute_capability.startswith("9.")
        ):
            return "fp8"
        return "bf16" if "bf16" in self.flops else "fp16"

    def without_fp8(self) -> GpuProfile:
        """This GPU serving a checkpoint with no FP8 weights (DeepSeek-V2's BF16): the policy's next
        choice."""
        return dataclasses.replace(
            self, flops={dtype: f for dtype, f in self.flops.items() if dtype != "fp8"}
        )

    @property
    def bytes_per_weight(self) -> int:
        return _BYTES_PER_WEIGHT[self.precision]

    @property
    def peak_flops(self) -> float:
        """Dense FLOP/s in the precision that runs."""
        return self.flops[self.precision]


def gpu_kind(device: str, device_name: str) -> str:
    """The GPU kind requests pin: the profile whose name the device's name contains ("A100" for
    "NVIDIA A100-SXM4-80GB"), else the device's name; "cpu" on a CPU."""
    if device == "cpu":
        return "cpu"
    return next((name for name in gpu_profiles() if name in device_name), device_name)


@functools.cache
def gpu_profiles() -> dict[str, GpuProfile]:
    """Every profile in gpu_profiles.toml, by name."""
    with _PROFILES_PATH.open("rb") as f:
        tables = tomllib.load(f)
    return {
        name: GpuProfile(
            name=name,
            device=t["device"],
            device_name=t["device_name"],
            compute_capability=t["compute_capability"],
            memory_bytes=int(t["memory_gb"] * 1e9),
            bandwidth_bytes_per_s=t["bandwidth_gb_s"] * 1e9,
            flops={dtype: tf * 1e12 for dtype, tf in t["tflops"].items()},
        )
        for name, t in tables.items()
    }
