"""transformers' DeepseekV3ForCausalLM, DeepseekV32ForCausalLM or DeepseekV2ForCausalLM holding our
weights: the reference the correctness tests and the throughput benchmark compare the engine
against."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    PreTrainedModel,
)

from worker_svc.model.model import MoE, Transformer

_MODELS = {
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
    "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
}


def transformers_model(ours: Transformer, config: dict[str, Any]) -> PreTrainedModel:
    """transformers' model for config's model_type from the same config, holding our dequantized
    FP32 weights."""
    config_class, model_class = _MODELS[config["model_type"]]
    hf_config = config_class(**{k: v for k, v in config.items() if k != "quantization_config"})
    hf_config._attn_implementation = "eager"
    hf: PreTrainedModel = model_class(hf_config).float().eval()
    state = ours.state_dict()
    hf_state = {
        (k if k == "lm_head.weight" else f"model.{k}"): v
        for k, v in state.items()
        if ".experts." not in k
    }
    # transformers stacks each MoE layer's experts into two tensors
    for i, layer in enumerate(ours.layers):
        if not isinstance(layer.mlp, MoE):
            continue
        p = f"layers.{i}.mlp.experts"
        experts = range(config["n_routed_experts"])
        hf_state[f"model.{p}.gate_up_proj"] = torch.stack(
            [
                torch.cat([state[f"{p}.{e}.gate_proj.weight"], state[f"{p}.{e}.up_proj.weight"]])
                for e in experts
            ]
        )
        hf_state[f"model.{p}.down_proj"] = torch.stack(
            [state[f"{p}.{e}.down_proj.weight"] for e in experts]
        )
    hf.load_state_dict(hf_state, strict=True)
    return hf
