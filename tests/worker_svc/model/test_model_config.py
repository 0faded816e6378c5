"""config.json -> ModelArgs: each field family is read as transformers reads it, or refused by
name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from devtools.tiny_model import tiny_config
from worker_svc.model.checkpoint import CheckpointError, load_checkpoint
from worker_svc.model.model_config import ModelConfigError, model_args

_YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def _config(**changes: Any) -> dict[str, Any]:
    """The tiny config with keys changed; a value of ... drops the key."""
    config = tiny_config(1024) | changes
    return {k: v for k, v in config.items() if v is not ...}


@pytest.mark.parametrize(
    ("changes", "field", "expected"),
    [
        # attention sizes
        ({"q_lora_rank": None}, "q_lora_rank", 0),
        ({"kv_lora_rank": 64, "v_head_dim": 48}, "v_head_dim", 48),
        # MoE routing; transformers' defaults where a key is absent (save_pretrained drops keys
        # equal to them)
        ({"norm_topk_prob": False}, "norm_topk_prob", False),
        ({"routed_scaling_factor": 1.5}, "route_scale", 1.5),
        ({"routed_scaling_factor": ...}, "route_scale", 2.5),
        ({"n_group": 4, "topk_group": 2}, "n_limited_groups", 2),
        ({"topk_method": ..., "scoring_func": ...}, "n_expert_groups", 2),
        # transformers' default: past 2 layers, all dense
        ({"first_k_dense_replace": ...}, "n_dense_layers", 3),
        # norms, vocabulary
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps", 1e-5),
        ({"vocab_size": 2048}, "vocab_size", 2048),
        # rope
        ({"rope_theta": 50000}, "rope_theta", 50000.0),
        (
            {
                "rope_scaling": None,
                "rope_theta": ...,
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            },
            "rope_theta",
            5e5,
        ),
        ({"rope_scaling": _YARN}, "rope_type", "yarn"),
        (
            {"rope_scaling": {**_YARN, "factor": None}, "max_position_embeddings": 4096},
            "rope_factor",
            8.0,
        ),
        (
            {"rope_scaling": {**_YARN, "attention_factor": 0.9, "truncate": False}},
            "rope_attention_factor",
            0.9,
        ),
    ],
    ids=[
        "q_lora_rank-null",
        "v_head_dim",
        "norm_topk_prob",
        "routed_scaling_factor",
        "routed_scaling_factor-absent",
        "groups",
        "topk_method-absent",
        "first_k_dense_replace-absent",
        "rms_norm_eps",
        "vocab_size",
        "rope_theta",
        "rope_parameters-theta-inside",
        "rope_scaling-yarn",
        "yarn-factor-from-lengths",
        "yarn-attention_factor",
    ],
)
def test_fields_are_read_as_transformers_reads_them(
    changes: dict[str, Any], field: str, expected: Any
):
    assert getattr(model_args(_config(**changes)), field) == expected


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        # attention sizes
        ({"hidden_size": "320"}, "field 'hidden_size'.* expected int"),
        ({"kv_lora_rank": 0}, "kv_lora_rank: 0 is not a positive integer"),
        ({"qk_rope_head_dim": 15}, "RoPE requires an even rotary dimension, but got `head_dim`=15"),
        ({"attention_bias": True}, "attention_bias: True is not implemented"),
        # MoE routing
        (
            {"topk_method": "greedy"},
            r"topk_method: 'greedy' is not implemented by this engine \(supported: 'noaux_tc'\)",
        ),
        ({"scoring_func": "softmax"}, "scoring_func: 'softmax' is not implemented"),
        ({"n_group": 3}, r"n_group: 3 does not divide n_routed_experts \(8\)"),
        ({"n_group": 8, "topk_group": 1}, "n_group: 8 leaves fewer than 2 experts per group"),
        ({"topk_group": 3}, r"topk_group: 3 exceeds n_group \(2\)"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok: 5 exceeds the 4 experts"),
        ({"n_group": None}, "n_group: None is not a positive integer"),
        ({"norm_topk_prob": None}, "norm_topk_prob: None is not true or false"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor: 0.0 is not a positive number"),
        # as transformers
        ({"routed_scaling_factor": 2}, "field 'routed_scaling_factor'.* expected float, got int"),
        ({"moe_layer_freq": 2}, "moe_layer_freq: 2 is not implemented"),
        ({"moe_layer_freq": True}, "moe_layer_freq: True is not implemented"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace: -1 is not an integer >= 0"),
        # norms, activation, vocabulary
        ({"rms_norm_eps": 0.0}, "rms_norm_eps: 0.0 is not a positive number"),
        ({"hidden_act": "gelu"}, "hidden_act: 'gelu' is not implemented"),
        ({"vocab_size": 0}, "vocab_size: 0 is not a positive integer"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings: True is not implemented"),
        # rope
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            "rope_type: 'linear' is not implemented",
        ),
        (
            {
                "rope_scaling": None,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
            },
            "rope_type: 'llama3'",
        ),
        (
            {"rope_scaling": {**_YARN, "low_freq_factor": 1.0}},
            "rope_scaling.low_freq_factor: not implemented",
        ),
        (
            {"rope_scaling": None, "rope_parameters": {**_YARN, "partial_rotary_factor": 0.5}},
            "rope_parameters.partial_rotary_factor: not implemented",
        ),
        (
            {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 512}},
            "rope_scaling: Missing required keys .*'factor'",
        ),
        (
            {"rope_scaling": {**_YARN, "beta_fast": "32"}},
            "rope_scaling.beta_fast: '32' is not a number",
        ),
        (
            {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
            "rope_parameters.rope_theta: -1.0 is not a number > 1",
        ),
        (
            {"rope_scaling": {**_YARN, "truncate": "no"}},
            "rope_scaling.truncate: 'no' is not true or false",
        ),
    ],
    ids=[
        "hidden_size-type",
        "kv_lora_rank",
        "qk_rope_head_dim-odd",
        "attention_bias",
        "topk_method",
        "scoring_func",
        "n_group-divides",
        "n_group-per-group",
        "topk_group",
        "num_experts_per_tok",
        "n_group-null",
        "norm_topk_prob-null",
        "routed_scaling_factor",
        "routed_scaling_factor-int",
        "moe_layer_freq",
        "moe_layer_freq-bool",
        "first_k_dense_replace",
        "rms_norm_eps",
        "hidden_act",
        "vocab_size",
        "tie_word_embeddings",
        "rope-linear",
        "rope-llama3",
        "yarn-unknown-key",
        "partial_rotary_factor",
        "yarn-no-factor",
        "yarn-beta-type",
        "rope_theta-negative",
        "yarn-truncate-type",
    ],
)
def test_what_the_engine_does_not_implement_is_refused_by_name(changes: dict[str, Any], match: str):
    with pytest.raises(ModelConfigError, match=match):
        model_args(_config(**changes))


def test_an_unknown_model_type_is_refused():
    with pytest.raises(
        ModelConfigError, match=r"model_type: 'deepseek_v4' is not served by this engine"
    ):
        model_args(_config(model_type="deepseek_v4"))


def test_a_load_error_names_the_file_and_the_field(tiny_dir: Path, tmp_path: Path):
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"rope_scaling": {"type": "dynamic", "factor": 2.0}})
    )
    with pytest.raises(
        CheckpointError,
        match=rf"{tmp_path / 'config.json'}: rope_type: 'dynamic' is not implemented",
    ):
        load_checkpoint(tmp_path)
