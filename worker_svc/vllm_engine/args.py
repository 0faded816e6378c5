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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infermesh.config import ConfigError
from infermesh.names import Precision
from worker_svc.config import WorkerConfig

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
# Hopper (sm90) and Ada (sm89) have FP8 tensor cores; vLLM's block-scaled FP8 GEMMs run there
_NATIVE_FP8_CC = (8, 9)


@dataclass(frozen=True)
class Devices:
    """What the worker process sees: `gpu_count` GPUs of `compute_capability` ("9.0"), or none
    (CPU)."""

    gpu_count: int
    compute_capability: str = ""

    @property
    def native_fp8(self) -> bool:
        if not self.compute_capability:
            return False
        major, minor = (int(x) for x in self.compute_capability.split(".")[:2])
        return (major, minor) >= _NATIVE_FP8_CC


def engine_args(config: WorkerConfig, devices: Devices, precision: Precision) -> dict[str, Any]:
    """vLLM's AsyncEngineArgs keywords for `config`, serving in `precision` (the worker's policy);
    raises ConfigError naming the key at fault."""
    checkpoint = _read_checkpoint_config(config.model.path)
    fp8_checkpoint = "quantization_config" in checkpoint
    _check_fp8(config, devices, fp8_checkpoint)
    parallel = config.parallel
    _check_layout(config, devices, checkpoint)
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
        _check_cpu_cache(config, checkpoint, precision)
        args["kv_cache_memory_bytes"] = config.cache.cpu_cache_bytes
        args["compilation_config"] = {"custom_ops": [_CPU_ROPE_KERNEL_OFF]}
    args.update(config.engine.vllm)
    return args


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


def _check_fp8(config: WorkerConfig, devices: Devices, fp8_checkpoint: bool) -> None:
    use_native_fp8 = config.quantization.use_native_fp8
    if use_native_fp8 and not devices.native_fp8:
        where = (
            f"GPUs of compute capability {devices.compute_capability}"
            if devices.gpu_count
            else "a CPU"
        )
        raise ConfigError(
            f"[quantization] use_native_fp8 = true, but this worker has {where}; FP8 GEMMs "
            "need compute capability 8.9 or higher (L40S, H100, H200): set use_native_fp8 = "
            "false with a BF16 checkpoint, or run the worker on such GPUs"
        )
    if use_native_fp8 and not fp8_checkpoint:
        raise ConfigError(
            f"[quantization] use_native_fp8 = true, but {config.model.path} has no FP8 weights "
            "(no quantization_config): serve its FP8 release, or unset use_native_fp8"
        )
    if use_native_fp8 is False and fp8_checkpoint:
        raise ConfigError(
            f"[quantization] use_native_fp8 = false, but {config.model.path} is an FP8 "
            "checkpoint and vLLM serves it in FP8: point [model] path at a BF16 copy, or "
            "unset use_native_fp8"
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


def _check_cpu_cache(
    config: WorkerConfig, checkpoint: dict[str, Any], precision: Precision
) -> None:
    """vLLM needs one whole context of MLA latents in its cache; on a CPU the budget is known up
    front."""
    context = config.attention.max_model_len or int(checkpoint.get("max_position_embeddings", 0))
    latent = int(checkpoint.get("kv_lora_rank") or 0) + int(checkpoint.get("qk_rope_head_dim") or 0)
    per_token = (
        latent * int(checkpoint.get("num_hidden_layers", 0)) * (4 if precision == "fp32" else 2)
    )
    if context * per_token > config.cache.cpu_cache_bytes:
        raise ConfigError(
            f"[cache] cpu_cache_bytes ({config.cache.cpu_cache_bytes}) holds no whole context of "
            f"max_model_len {context} ({context * per_token} bytes of MLA latents): raise "
            "cpu_cache_bytes or lower "
            "[attention] max_model_len"
        )


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
