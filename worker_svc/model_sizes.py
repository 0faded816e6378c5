"""A DeepSeek-V3 / V2 model's size from its config.json fields, without building it (no torch).

What the simulated engine's roofline needs (sim_engine.Roofline): weights held, weights read per
token, KV cache bytes per token. model_profiles.toml holds the public models' shapes, so
`[engine] model = "DeepSeek-V2-Lite"` sizes a simulated worker like the real checkpoint.
"""
from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PROFILES_PATH = Path(__file__).with_name("model_profiles.toml")
# The latent cache is held in the compute dtype: BF16/FP16 on every GPU profile (FP8 serving computes in BF16).
KV_DTYPE_BYTES = 2


@dataclass(frozen=True)
class ModelSizes:
    total_params: float  # weights held in memory
    active_params: float  # weights read per token: the chosen experts only, one embedding row
    kv_bytes_per_token: int  # every layer's MLA latent and rope'd key, KV_DTYPE_BYTES each
    fp8_weights: bool = True  # stored in FP8 with block scales (DeepSeek-V3); False: BF16 (DeepSeek-V2)


def _attention_params(c: dict[str, Any]) -> int:
    dim, heads, kv_rank = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    q_rank = c.get("q_lora_rank") or 0
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    query = dim * q_rank + q_rank + q_rank * heads * qk_head if q_rank else dim * heads * qk_head
    latent = dim * (kv_rank + c["qk_rope_head_dim"]) + kv_rank  # kv_a_proj_with_mqa, kv_a_layernorm
    expand = kv_rank * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * dim
    return query + latent + expand + 2 * dim  # + the layer's two RMSNorms


def _is_moe_layer(c: dict[str, Any], layer: int) -> bool:
    return layer >= c.get("first_k_dense_replace", 0) and layer % c.get("moe_layer_freq", 1) == 0


def model_sizes(config: dict[str, Any]) -> ModelSizes:
    """Sizes of the model `config` (config.json's keys) describes, as worker_svc.model builds it."""
    c, dim, layers = config, config["hidden_size"], config["num_hidden_layers"]
    expert = 3 * dim * c["moe_intermediate_size"]
    bias = c.get("topk_method", "noaux_tc") == "noaux_tc"  # e_score_correction_bias: one per expert
    router = c["n_routed_experts"] * (dim + bias)
    moe_total = (c["n_routed_experts"] + c.get("n_shared_experts", 0)) * expert + router
    moe_active = (c["num_experts_per_tok"] + c.get("n_shared_experts", 0)) * expert + router
    n_moe = sum(_is_moe_layer(c, i) for i in range(layers))
    dense = (layers - n_moe) * 3 * dim * c["intermediate_size"]
    shared = layers * _attention_params(c) + dense + dim + c["vocab_size"] * dim  # + final norm, lm_head
    return ModelSizes(
        total_params=shared + n_moe * moe_total + c["vocab_size"] * dim,
        active_params=shared + n_moe * moe_active + dim,
        kv_bytes_per_token=layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * KV_DTYPE_BYTES,
        fp8_weights="quantization_config" in c,
    )


@functools.cache
def model_profiles() -> dict[str, ModelSizes]:
    """The sizes of every model in model_profiles.toml, by name."""
    with _PROFILES_PATH.open("rb") as f:
        return {name: model_sizes(config) for name, config in tomllib.load(f).items()}
