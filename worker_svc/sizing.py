"""How much memory a DeepSeek-V3-family model needs: weights in each precision, the MLA KV
cache per token, and the fewest GPUs that hold both. One arithmetic for ``infermesh plan``
and the simulated workers (sim_engine.py), from config.json alone: no torch, no weights.

The checkpoint format is DeepSeek's: the decoder layers' linear weights in FP8 E4M3 with one
float32 ``weight_scale_inv`` per 128 x 128 block, the routing bias in float32, everything else
(embeddings, lm_head, norms, the router's gate) in BF16. FP8 is served as stored on Hopper; on
every other GPU the weights are dequantized to BF16/FP16 (2 bytes each). Multi-token-prediction
layers stored past ``num_hidden_layers`` are not loaded for serving. The KV cache holds, per
layer and token, the compressed latent and the rope'd key (kv_lora_rank + qk_rope_head_dim
values) in the serving dtype, BF16 under FP8 (worker_svc/kv_cache.py).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from worker_svc.engine_api import Precision

_BLOCK = 128  # weight_block_size of DeepSeek's FP8 checkpoints
_VALUE_BYTES: dict[Precision, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
_KV_VALUE_BYTES: dict[Precision, int] = {"fp8": 2, "bf16": 2, "fp16": 2, "fp32": 4}
_BUNDLED = Path(__file__).with_name("model_configs")
DEFAULT_UTILIZATION = 0.9  # of each GPU's memory for weights and the KV cache ([cache])
Stored = Literal["fp8", "bf16", "fp32"]


def is_fp8_linear(name: str) -> bool:
    """Linear weights a DeepSeek-V3 checkpoint stores in FP8 (not embed, lm_head, norms, gate)."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    stored: Stored

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored_bytes(self) -> int:
        """Bytes in the checkpoint, with the block scales of an FP8 weight."""
        if self.stored == "fp8":
            rows, cols = self.shape
            return self.numel + math.ceil(rows / _BLOCK) * math.ceil(cols / _BLOCK) * 4
        return self.numel * (4 if self.stored == "fp32" else 2)


class ConfigError(ValueError):
    """A config.json that does not describe a DeepSeek-V3-family model."""


@dataclass(frozen=True)
class ModelSize:
    """The sizes of one model that serving depends on."""

    name: str
    params: int  # served weights (without the MTP layers)
    active_params: int  # read per token: all but the routed experts a token does not use
    fp8_bytes: int  # the served weights as stored: FP8 linears with scales, BF16 the rest
    checkpoint_params: int  # with the MTP layers, as published
    checkpoint_bytes: int
    kv_values_per_token: int  # layers x (kv_lora_rank + qk_rope_head_dim)

    def weight_bytes(self, precision: Precision) -> int:
        """Weight memory when served in ``precision`` (fp8: as stored; else dequantized)."""
        return self.fp8_bytes if precision == "fp8" else self.params * _VALUE_BYTES[precision]

    def kv_bytes_per_token(self, precision: Precision) -> int:
        return self.kv_values_per_token * _KV_VALUE_BYTES[precision]

    @classmethod
    def of_params(cls, name: str, params: float, active_params: float, kv_bytes_per_token: int,
                  ) -> ModelSize:
        """A model known only by its sizes (the simulated engine's [engine] keys): dense
        weights, 1 byte each in FP8, and a BF16 KV cache of ``kv_bytes_per_token``."""
        total, active = int(params), int(active_params)
        return cls(name, total, active, total, total, total, math.ceil(kv_bytes_per_token / 2))


def bundled_models() -> list[str]:
    """The configs shipped in worker_svc/model_configs/, by name."""
    return sorted(p.stem for p in _BUNDLED.glob("*.json"))


def load_config(source: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, the file itself, or a bundled config by name."""
    path = _BUNDLED / f"{source}.json" if str(source) in bundled_models() else Path(source)
    file = path / "config.json" if path.is_dir() else path
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{file}: not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not JSON: {e}") from None


def index_total_size(checkpoint: str | Path) -> int | None:
    """The ``total_size`` a checkpoint's model.safetensors.index.json states (None: no index)."""
    index = Path(checkpoint) / "model.safetensors.index.json"
    try:
        return int(json.loads(index.read_text())["metadata"]["total_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def model_size(config: dict[str, Any], name: str = "") -> ModelSize:
    """The sizes of the model ``config`` (a DeepSeek-V3 config.json) describes."""
    try:
        layers = config["num_hidden_layers"]
        mtp = config.get("num_nextn_predict_layers", 0)
        served = list(checkpoint_tensors(config, layers))
        stored = served + list(checkpoint_tensors(config, layers + mtp, first_layer=layers))
        kv_values = layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
        unused_experts = config["n_routed_experts"] - config["num_experts_per_tok"]
    except KeyError as e:
        raise ConfigError(f"config.json has no {e.args[0]!r}: not a DeepSeek-V3-family config") from None
    params = sum(t.numel for t in served)
    moe_layers = sum(1 for i in range(layers) if _is_moe(config, i))
    active = params - moe_layers * unused_experts * 3 * config["hidden_size"] * config["moe_intermediate_size"]
    return ModelSize(name=name or config.get("_name_or_path", "") or config.get("model_type", "model"),
                     params=params, active_params=active,
                     fp8_bytes=sum(t.stored_bytes for t in served),
                     checkpoint_params=sum(t.numel for t in stored),
                     checkpoint_bytes=sum(t.stored_bytes for t in stored),
                     kv_values_per_token=kv_values)


def checkpoint_tensors(config: dict[str, Any], end_layer: int, first_layer: int = 0) -> Iterator[Tensor]:
    """The tensors of layers [first_layer, end_layer) by their HF names (first_layer 0: with
    the embeddings, final norm and lm_head; a layer at or past num_hidden_layers: an MTP layer)."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    if first_layer == 0:
        yield Tensor("model.embed_tokens.weight", (vocab, h), "bf16")
        yield Tensor("model.norm.weight", (h,), "bf16")
        yield Tensor("lm_head.weight", (vocab, h), "bf16")
    for i in range(first_layer, end_layer):
        yield from _layer_tensors(config, i)


def _layer_tensors(config: dict[str, Any], i: int) -> Iterator[Tensor]:
    h = config["hidden_size"]
    p = f"model.layers.{i}."
    yield Tensor(p + "input_layernorm.weight", (h,), "bf16")
    yield Tensor(p + "post_attention_layernorm.weight", (h,), "bf16")
    yield from _attention_tensors(config, p + "self_attn.")
    if _is_moe(config, i):
        experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
        yield Tensor(p + "mlp.gate.weight", (experts, h), "bf16")
        yield Tensor(p + "mlp.gate.e_score_correction_bias", (experts,), "fp32")
        for e in range(experts):
            yield from _mlp_tensors(f"{p}mlp.experts.{e}.", h, inter)
        yield from _mlp_tensors(p + "mlp.shared_experts.", h, inter * config["n_shared_experts"])
    else:
        yield from _mlp_tensors(p + "mlp.", h, config["intermediate_size"])
    if i >= config["num_hidden_layers"]:  # an MTP layer: its own embedding and head copies
        vocab = config["vocab_size"]
        yield Tensor(p + "embed_tokens.weight", (vocab, h), "bf16")
        yield Tensor(p + "enorm.weight", (h,), "bf16")
        yield Tensor(p + "hnorm.weight", (h,), "bf16")
        yield Tensor(p + "eh_proj.weight", (h, 2 * h), "fp8")
        yield Tensor(p + "shared_head.norm.weight", (h,), "bf16")
        yield Tensor(p + "shared_head.head.weight", (vocab, h), "bf16")


def _attention_tensors(config: dict[str, Any], p: str) -> Iterator[Tensor]:
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config.get("q_lora_rank") or 0, config["kv_lora_rank"]
    if q_rank:
        yield Tensor(p + "q_a_proj.weight", (q_rank, h), "fp8")
        yield Tensor(p + "q_a_layernorm.weight", (q_rank,), "bf16")
        yield Tensor(p + "q_b_proj.weight", (heads * (nope + rope), q_rank), "fp8")
    else:
        yield Tensor(p + "q_proj.weight", (heads * (nope + rope), h), "fp8")
    yield Tensor(p + "kv_a_proj_with_mqa.weight", (kv_rank + rope, h), "fp8")
    yield Tensor(p + "kv_a_layernorm.weight", (kv_rank,), "bf16")
    yield Tensor(p + "kv_b_proj.weight", (heads * (nope + v), kv_rank), "fp8")
    yield Tensor(p + "o_proj.weight", (h, heads * v), "fp8")


def _mlp_tensors(p: str, h: int, inter: int) -> Iterator[Tensor]:
    yield Tensor(p + "gate_proj.weight", (inter, h), "fp8")
    yield Tensor(p + "up_proj.weight", (inter, h), "fp8")
    yield Tensor(p + "down_proj.weight", (h, inter), "fp8")


def _is_moe(config: dict[str, Any], i: int) -> bool:
    return (config.get("n_routed_experts") or 0) > 0 and i >= config.get("first_k_dense_replace", 0) \
        and i % config.get("moe_layer_freq", 1) == 0


def fewest_gpus(weight_bytes: int, kv_bytes: int, gpu_memory_bytes: int,
                utilization: float = DEFAULT_UTILIZATION) -> int:
    """The fewest GPUs whose usable memory holds the weights plus ``kv_bytes`` of KV cache."""
    return max(1, math.ceil((weight_bytes + kv_bytes) / (gpu_memory_bytes * utilization)))


def sequences_that_fit(weight_bytes: int, kv_bytes_per_sequence: int, gpus: int, gpu_memory_bytes: int,
                       utilization: float = DEFAULT_UTILIZATION) -> int:
    """Concurrent sequences of ``kv_bytes_per_sequence`` whose KV cache fits on ``gpus`` GPUs
    beside the weights (0: the weights alone do not fit)."""
    free = gpus * gpu_memory_bytes * utilization - weight_bytes
    return max(0, int(free // kv_bytes_per_sequence))
