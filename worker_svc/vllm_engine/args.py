"""The worker's config as vLLM engine arguments, and the field's misconfigurations caught before
vLLM starts.

`[model]`, `[attention]`, `[cache]`, `[parallel]` and `[quantization]` map onto the engine arguments
an operator would give vLLM; `[engine.vllm]` passes any other argument through (and wins over the
mapping). Every error names the config key and the fix, so a worker that cannot serve stops with one
line instead of a traceback from a child process. Pure: the GPUs present are passed in, so the
checks are testable on any machine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infermesh.config import ConfigError
from infermesh.names import Precision
from worker_svc.config import WorkerConfig
from worker_svc.engine.api import DeviceKind

# vLLM's dtype names for the worker's precisions (FP8 is a quantization there, activations in BF16)
_DTYPES: dict[Precision, str] = {
    "fp8": "bfloat16",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}
# vLLM's CPU RoPE kernel (0.32, used in eager mode) reads q and k as [tokens, heads * head_size]
# with the token stride taken from dim -2: MLA's 3-D q and strided k_pe get rotated at wrong
# positions and k_pe's rotation overwrites the latent, so every step of 2+ tokens goes wrong.
# Switching the custom op off runs vLLM's PyTorch RoPE, which is right for every layout.
_CPU_ROPE_KERNEL_OFF = "-rotary_embedding"
# vLLM (0.32) runs MLA on its AMX kernels wherever the CPU has AMX tiles, whatever the dtype, and
# those take only BF16 weights ("expect weight to be bfloat16"): other dtypes get its reference
# CPU MLA backend, which any dtype runs.
_CPU_MLA_BACKEND = "CPU_MLA"
_AMX_MLA_BACKEND = "AMX_MLA"
# vLLM's CPU KV blocks (0.32): its reference MLA decode kernel compiles for 16-token blocks only
# (the platform forces them); other backends default to 128
_VLLM_CPU_MLA_BLOCK_TOKENS = 16
_VLLM_CPU_BLOCK_TOKENS = 128
# Where this vLLM (0.32) runs a checkpoint's block-scaled FP8 weights, read from its kernel
# choices: on CUDA its Fp8Config wants compute capability 7.5 (Marlin's weight-only FP8 up to 8.9,
# FP8 GEMMs from Ada on; V100 has neither); on ROCm its block-scaled kernels (AITER, Triton's FP8
# dot) need MI300-class FP8 units, which MI100/MI200 lack although vLLM's supports_fp8 names all of
# gfx9; on a CPU its FP8 linear and MoE kernels check for AMX tiles.
_VLLM_MIN_FP8_CC = (7, 5)
# ROCm's capability is the gfx arch's digits: gfx942 (MI300X/MI325X) 9.4, gfx950 (MI350) 9.5;
# MI100 (gfx908) and MI200 (gfx90a) are 9.0
_VLLM_FP8_ROCM_CC = ("9.4", "9.5")
VLLM_FP8_NEEDS: dict[DeviceKind, str] = {
    "cuda": "needs compute capability 7.5 or higher for vLLM's FP8 kernels",
    "rocm": "needs an MI300-class GPU (gfx942, gfx950: capability 9.4, 9.5) for vLLM's "
    "block-scaled FP8 kernels",
    "cpu": "needs a CPU with AMX tiles (Sapphire Rapids or newer) for vLLM's CPU FP8 kernels",
}
# The checkpoint sizes vLLM's FP8 loader (0.32) needs in whole weight blocks: it sizes a merged
# layer's block scales for the sum of its parts, so every part but the last must be whole blocks
# (q_a of q_a + kv_a, gate of gate_up, in the dense layers and the shared experts), and its fused
# MoE checks moe_intermediate_size itself; else the load fails deep in a child process
_VLLM_FP8_WHOLE_BLOCKS = ("q_lora_rank", "intermediate_size", "moe_intermediate_size")


@dataclass(frozen=True)
class Devices:
    """What the worker process sees: `gpu_count` GPUs of `compute_capability` ("9.0"; `rocm`: AMD
    GPUs, whose capability vLLM derives from the gfx arch), or none: a CPU, with AMX tiles or
    without."""

    gpu_count: int
    compute_capability: str = ""
    rocm: bool = False
    cpu_amx: bool = False

    @property
    def kind(self) -> DeviceKind:
        return "cpu" if not self.gpu_count else "rocm" if self.rocm else "cuda"

    @property
    def name(self) -> str:
        """The device in the policy's messages: "cuda 7.0", "rocm 9.0", "cpu"."""
        return f"{self.kind} {self.compute_capability}".strip()

    @property
    def vllm_fp8(self) -> bool:
        """vLLM runs block-scaled FP8 weights here."""
        if self.kind == "cpu":
            return self.cpu_amx
        if self.kind == "rocm":
            return self.compute_capability in _VLLM_FP8_ROCM_CC
        major, minor = (int(x) for x in self.compute_capability.split(".")[:2])
        return (major, minor) >= _VLLM_MIN_FP8_CC


def engine_args(config: WorkerConfig, devices: Devices, precision: Precision) -> dict[str, Any]:
    """vLLM's AsyncEngineArgs keywords for `config`, serving in `precision` (the worker's policy);
    raises ConfigError naming the key at fault."""
    checkpoint = _read_checkpoint_config(config.model.path)
    fp8_checkpoint = "quantization_config" in checkpoint
    check_fp8(config, devices, fp8_checkpoint)
    parallel = config.parallel
    _check_layout(config, devices, checkpoint)
    if precision == "fp8":
        _check_fp8_blocks(config, checkpoint)
    args: dict[str, Any] = {
        "model": config.model.path,
        "served_model_name": config.model.served_name,
        "dtype": _DTYPES[precision],
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "enable_expert_parallel": parallel.expert_parallel_size > 1,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "max_num_seqs": parallel.resolved("cuda" if devices.gpu_count else "cpu", "").max_parallel,
    }
    if config.attention.max_model_len is not None:
        args["max_model_len"] = config.attention.max_model_len
    if devices.gpu_count:
        args["gpu_memory_utilization"] = config.cache.gpu_memory_utilization
    else:  # on a CPU: vLLM's cache budget (gpu_memory_utilization would reserve a share of RAM)
        args["compilation_config"] = {"custom_ops": [_CPU_ROPE_KERNEL_OFF]}
        mla_backend = cpu_mla_backend(config, devices, precision)
        if devices.cpu_amx and mla_backend == _CPU_MLA_BACKEND and "kv_lora_rank" in checkpoint:
            args["attention_backend"] = _CPU_MLA_BACKEND
        block = _cpu_block_tokens(config, checkpoint, mla_backend)
        args["kv_cache_memory_bytes"] = _cpu_cache_bytes(config, checkpoint, precision, block)
    args.update(config.engine.vllm)
    return args


def cpu_mla_backend(config: WorkerConfig, devices: Devices, precision: Precision) -> str:
    """The MLA attention backend vLLM's CPU platform (0.32) runs for `config` on `devices`: its
    AMX kernels wherever the CPU has AMX tiles, unless its reference backend is asked for (by
    `[engine.vllm] attention_backend`, or for a dtype the AMX kernels refuse)."""
    asked = config.engine.vllm.get("attention_backend")
    if asked is None and devices.cpu_amx and _DTYPES[precision] != "bfloat16":
        asked = _CPU_MLA_BACKEND
    return (
        _CPU_MLA_BACKEND if not devices.cpu_amx or asked == _CPU_MLA_BACKEND else _AMX_MLA_BACKEND
    )


def check_mla_head(config: WorkerConfig, backend: str, head_sizes: Collection[int]) -> None:
    """Raises ConfigError when the checkpoint's MLA latent (kv_lora_rank + qk_rope_head_dim, the
    width vLLM caches and attends over) is not one of the `head_sizes` vLLM's attention
    `backend` runs: vLLM would start, then lose its engine on the first request."""
    checkpoint = _read_checkpoint_config(config.model.path)
    if "kv_lora_rank" not in checkpoint or not head_sizes:
        return  # not MLA; or a backend of any width
    lora, rope = int(checkpoint["kv_lora_rank"]), int(checkpoint.get("qk_rope_head_dim") or 0)
    if lora + rope not in head_sizes:
        raise ConfigError(
            f"[model] path: {config.model.path}'s MLA latent is kv_lora_rank {lora} + "
            f"qk_rope_head_dim {rope} = {lora + rope} wide, which vLLM's {backend} attention "
            f"does not run (head sizes {', '.join(map(str, sorted(head_sizes)))}): serve it with "
            '[engine] kind = "checkpoint", or on hardware whose vLLM attention runs it'
        )


def check_known(args: dict[str, Any], known: set[str]) -> None:
    """Raises ConfigError for a `[engine.vllm]` key that is not one of vLLM's engine arguments."""
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(
            f"[engine.vllm] {unknown[0]}: not an engine argument of this vLLM "
            "(see `vllm serve --help`; arguments are spelled with underscores)"
        )


def fp8_checkpoint(model_path: str) -> bool:
    """The checkpoint stores FP8 weights (its config.json has a quantization_config)."""
    return "quantization_config" in _read_checkpoint_config(model_path)


def check_fp8(config: WorkerConfig, devices: Devices, fp8_checkpoint: bool) -> None:
    """Raises ConfigError where `[quantization] use_native_fp8 = true` cannot be honoured."""
    if not config.quantization.use_native_fp8:
        return  # unset: FP8 where vLLM runs it; false: an FP8 checkpoint is dequantized
    if not devices.vllm_fp8:
        raise ConfigError(
            f"[quantization] use_native_fp8 = true, but this worker runs on {devices.name}: FP8 "
            f"{VLLM_FP8_NEEDS[devices.kind]}. Unset use_native_fp8 (the worker then serves a "
            "dequantized copy), or run the worker on such hardware"
        )
    if not fp8_checkpoint:
        raise ConfigError(
            f"[quantization] use_native_fp8 = true, but {config.model.path} has no FP8 weights "
            "(no quantization_config): serve its FP8 release, or unset use_native_fp8"
        )


def _check_fp8_blocks(config: WorkerConfig, checkpoint: dict[str, Any]) -> None:
    block = checkpoint.get("quantization_config", {}).get("weight_block_size")
    if not block:
        return  # per-tensor scales: no blocks to align
    for key in _VLLM_FP8_WHOLE_BLOCKS:
        size = checkpoint.get(key)
        if size and size % block[0]:
            raise ConfigError(
                f"[model] path: {config.model.path}'s {key} ({size}) is not a multiple of its FP8 "
                f"weight block ({block[0]}), which vLLM's FP8 loader needs: serve a dequantized "
                "copy ([quantization] use_native_fp8 = false)"
            )


def _check_layout(config: WorkerConfig, devices: Devices, checkpoint: dict[str, Any]) -> None:
    parallel = config.parallel
    nodes = int(config.engine.vllm.get("nnodes", 1))
    tp, pp, ep = (
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        parallel.expert_parallel_size,
    )
    dp = int(config.engine.vllm.get("data_parallel_size", 1))
    if devices.gpu_count and tp * pp > devices.gpu_count * nodes:
        raise ConfigError(
            f"[parallel] tensor_parallel_size ({tp}) x pipeline_parallel_size ({pp}) = {tp * pp} "
            f"GPUs, but {devices.gpu_count} GPU(s) x {nodes} node(s) are present: lower them to "
            "fit, or add nodes "
            "([engine.vllm] nnodes, node_rank, master_addr)"
        )
    if ep > 1 and ep != tp * dp:
        raise ConfigError(
            f"[parallel] expert_parallel_size ({ep}) must equal tensor_parallel_size ({tp}) x "
            f"[engine.vllm] data_parallel_size ({dp}): vLLM spreads the experts over those ranks"
        )
    experts = int(checkpoint.get("n_routed_experts") or 0)
    if ep > 1 and experts % ep:
        raise ConfigError(
            f"[parallel] expert_parallel_size ({ep}) does not divide the checkpoint's {experts} "
            "routed experts: "
            f"use a divisor of {experts}"
        )


def _cpu_block_tokens(config: WorkerConfig, checkpoint: dict[str, Any], mla_backend: str) -> int:
    """The tokens of a KV block vLLM's CPU platform (0.32) gives the model: 16 on its reference
    MLA backend (whatever was asked: its decode kernel has no other), else the block_size asked,
    or its default."""
    if "kv_lora_rank" in checkpoint and mla_backend == _CPU_MLA_BACKEND:
        return _VLLM_CPU_MLA_BLOCK_TOKENS
    return int(config.engine.vllm.get("block_size") or _VLLM_CPU_BLOCK_TOKENS)


def _cpu_cache_bytes(
    config: WorkerConfig, checkpoint: dict[str, Any], precision: Precision, block_tokens: int
) -> int:
    """vLLM's cache budget on a CPU, which must hold one whole context of MLA latents (known up
    front there) as vLLM counts it: in whole blocks, beside the one block its pool keeps back."""
    context = config.attention.max_model_len or int(checkpoint.get("max_position_embeddings", 0))
    latent = int(checkpoint.get("kv_lora_rank") or 0) + int(checkpoint.get("qk_rope_head_dim") or 0)
    per_token = (
        latent * int(checkpoint.get("num_hidden_layers", 0)) * (4 if precision == "fp32" else 2)
    )
    blocks = -(-context // block_tokens) + 1  # the context's, and the pool's null block
    needed = blocks * block_tokens * per_token
    budget = config.cache.cpu_budget_bytes(needed)
    if needed > budget:
        raise ConfigError(
            f"[cache] cpu_cache_bytes ({budget}) holds no whole context of "
            f"max_model_len {context} ({needed} bytes of MLA latents in vLLM's "
            f"{block_tokens}-token blocks): raise cpu_cache_bytes or lower "
            "[attention] max_model_len"
        )
    return budget


def _read_checkpoint_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"[model] path: cannot read {path}: {e}") from None
    return config


def known_engine_args() -> set[str]:
    """The keyword arguments of this vLLM's AsyncEngineArgs."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}
