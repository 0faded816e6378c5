"""config.json -> ModelArgs: every field the forward pass depends on is read, or the load is
refused.

transformers' own config class normalises the file first (`AutoConfig.for_model`), so this engine
reads a checkpoint as transformers does: its defaults for absent keys (`save_pretrained` drops keys
equal to them), rope settings as `rope_scaling` (older files; it wins when both are present) or
`rope_parameters` (transformers >= 5), `type` or `rope_type`, `rope_theta` inside the rope dict or
beside it. Then anything the engine does not implement -- an algorithm (SUPPORTED), a rope type or
key (ROPE_KEYS), sizes that cannot work together -- raises ModelConfigError naming the field;
nothing falls back to a silent default. num_key_value_heads is not read: MLA caches one latent per
token, not per head.
"""

from __future__ import annotations

import copy
from typing import Any

from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassError
from transformers import AutoConfig, PreTrainedConfig

from infermesh.config import ConfigError
from worker_svc.model.model import ModelArgs

# Per model_type, the values implemented for each field that selects an algorithm. The first value
# is what an absent key means where transformers' config class declares no default (DeepseekV3Config
# has no topk_method, scoring_func or moe_layer_freq: its model is noaux_tc, sigmoid, every layer
# MoE). Another model family adds an entry here once model.py implements its values.
_V3_CHOICES: dict[str, tuple[Any, ...]] = {
    "topk_method": ("noaux_tc",),  # group-limited top-k on bias-corrected scores (model.Gate)
    "scoring_func": ("sigmoid",),
    "moe_layer_freq": (1,),  # every layer from first_k_dense_replace on is MoE
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "rope_interleave": (True,),  # model.apply_rotary_emb rotates interleaved pairs
    "tie_word_embeddings": (False,),  # lm_head is a weight of its own
    "rope_type": ("default", "yarn"),
}
SUPPORTED: dict[str, dict[str, tuple[Any, ...]]] = {
    "deepseek_v3": _V3_CHOICES,
    # V3.2: V3 plus DeepSeek Sparse Attention, whose indexer fields _dsa_args reads from the file
    # itself.
    "deepseek_v32": _V3_CHOICES,
    # DeepseekV2Config has no scoring_func (its model is softmax) and reads n_group/topk_group only
    # for group_limited_greedy; moe_layer_freq is any positive integer
    # (model.ModelArgs.is_moe_layer).
    "deepseek_v2": {
        "topk_method": ("greedy", "group_limited_greedy"),
        "scoring_func": ("softmax",),
        "hidden_act": ("silu",),
        "attention_bias": (False,),
        "rope_interleave": (True,),
        "tie_word_embeddings": (False,),
        "rope_type": ("default", "yarn"),
    },
}
# The rope keys model.precompute_freqs_cis implements, per rope type (transformers' names).
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset({"rope_type", "type", "rope_theta"}),
    "yarn": frozenset(
        {
            "rope_type",
            "type",
            "rope_theta",
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    ),
}
_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
)
_NON_NEGATIVE_INTS = ("first_k_dense_replace", "n_shared_experts")


class ModelConfigError(ConfigError):
    """A checkpoint's config.json field this engine cannot serve; the message starts with the
    field's name."""


def model_args(config: dict[str, Any]) -> ModelArgs:
    """The forward pass's hyper-parameters from a parsed config.json; raises ModelConfigError."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ModelConfigError(
            f"model_type: {model_type!r} is not served by "
            f"this engine (need one of {list(SUPPORTED)})"
        )
    hf = _normalised(config)
    chosen = _check_choices(hf, SUPPORTED[model_type])
    _check_sizes(hf, chosen["topk_method"])
    n_groups, n_limited_groups = _groups(hf, chosen["topk_method"])
    return ModelArgs(
        vocab_size=hf.vocab_size,
        dim=hf.hidden_size,
        inter_dim=hf.intermediate_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        max_seq_len=hf.max_position_embeddings,
        rms_norm_eps=hf.rms_norm_eps,
        q_lora_rank=hf.q_lora_rank or 0,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        moe_inter_dim=hf.moe_intermediate_size,
        n_dense_layers=hf.first_k_dense_replace,
        n_routed_experts=hf.n_routed_experts,
        n_shared_experts=hf.n_shared_experts,
        n_activated_experts=hf.num_experts_per_tok,
        n_expert_groups=n_groups,
        n_limited_groups=n_limited_groups,
        norm_topk_prob=hf.norm_topk_prob,
        route_scale=float(hf.routed_scaling_factor),
        scoring_func=chosen["scoring_func"],
        topk_method=chosen["topk_method"],
        moe_layer_freq=getattr(hf, "moe_layer_freq", 1),
        **_rope_args(hf, _rope_spelling(config)),
        **_dsa_args(config),
    )


_DSA_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")


def _dsa_args(config: dict[str, Any]) -> dict[str, Any]:
    """The indexer's fields of a deepseek_v32 config.json, read from the file itself: transformers'
    defaults would hide a missing one, and a V3.2 checkpoint without its indexer sizes cannot be
    served."""
    if config.get("model_type") != "deepseek_v32":
        return {}
    for field in _DSA_FIELDS:
        if config.get(field) is None:
            raise ModelConfigError(
                f"{field}: missing (deepseek_v32 needs {', '.join(_DSA_FIELDS)})"
            )
        if not (_is_int(config[field]) and config[field] > 0):
            raise ModelConfigError(f"{field}: must be a positive integer, got {config[field]!r}")
    if not config.get("q_lora_rank"):
        raise ModelConfigError(
            "q_lora_rank: deepseek_v32's indexer reads the query latent, so it must be set"
        )
    if config["index_head_dim"] < config["qk_rope_head_dim"]:
        raise ModelConfigError(
            f"index_head_dim: {config['index_head_dim']} is smaller than qk_rope_head_dim "
            f"{config['qk_rope_head_dim']}, the indexer's rope part"
        )
    return {field: config[field] for field in _DSA_FIELDS}


def _normalised(config: dict[str, Any]) -> PreTrainedConfig:
    spelling = _rope_spelling(config)
    # transformers' own checks would crash on a str
    _check_rope_numbers(config.get(spelling) or {}, spelling)
    try:  # a copy: transformers fills the rope dict in place
        return AutoConfig.for_model(**copy.deepcopy(config))
    # validate_rope: a missing key, an odd rotary dimension
    except StrictDataclassClassValidationError as e:
        raise ModelConfigError(f"{spelling}: {' '.join(str(e).split())}") from None
    except StrictDataclassError as e:  # names the field and the type it expected
        raise ModelConfigError(" ".join(str(e).split())) from None
    except KeyError as e:  # a rope type's required key is missing
        raise ModelConfigError(f"{spelling}: {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"not a config transformers can read: {e}") from None


def _rope_spelling(config: dict[str, Any]) -> str:
    """The key the file holds its rope settings under, for error messages (transformers prefers
    rope_scaling)."""
    return "rope_scaling" if config.get("rope_scaling") else "rope_parameters"


def _check_choices(hf: PreTrainedConfig, supported: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """field -> the value in effect (an absent key means the first supported value); refuses the
    rest."""
    chosen = {}
    for field, values in supported.items():
        value = (
            hf.rope_parameters.get("rope_type")
            if field == "rope_type"
            else getattr(hf, field, values[0])
        )
        # type-strict: True == 1 and 0 == False must not pass for each other
        if not any(type(value) is type(v) and value == v for v in values):
            raise ModelConfigError(
                f"{field}: {value!r} is not implemented by this engine (supported: "
                f"{', '.join(repr(v) for v in values)})"
            )
        chosen[field] = value
    return chosen


def _check_sizes(hf: PreTrainedConfig, topk_method: str) -> None:
    for field in _POSITIVE_INTS:
        _require(
            hf,
            _is_int(getattr(hf, field)) and getattr(hf, field) > 0,
            field,
            "is not a positive integer",
        )
    for field in _NON_NEGATIVE_INTS:
        _require(
            hf,
            _is_int(getattr(hf, field)) and getattr(hf, field) >= 0,
            field,
            "is not an integer >= 0",
        )
    _require(
        hf,
        hf.q_lora_rank is None or (_is_int(hf.q_lora_rank) and hf.q_lora_rank >= 0),
        "q_lora_rank",
        "is neither null (a plain q_proj) nor an integer >= 0",
    )
    _require(
        hf,
        _is_number(hf.rms_norm_eps) and hf.rms_norm_eps > 0,
        "rms_norm_eps",
        "is not a positive number",
    )
    _require(hf, type(hf.norm_topk_prob) is bool, "norm_topk_prob", "is not true or false")
    _require(
        hf,
        _is_int(getattr(hf, "moe_layer_freq", 1)) and getattr(hf, "moe_layer_freq", 1) > 0,
        "moe_layer_freq",
        "is not a positive integer",
    )
    _require(
        hf,
        _is_number(hf.routed_scaling_factor) and hf.routed_scaling_factor > 0,
        "routed_scaling_factor",
        "is not a positive number",
    )
    _check_routing(hf, topk_method)


def _groups(hf: PreTrainedConfig, topk_method: str) -> tuple[int, int]:
    """(n_group, topk_group); greedy top-k (V2) chooses over all experts, whatever the file says of
    groups."""
    if topk_method == "greedy":
        return 1, 1
    return hf.n_group, hf.topk_group


def _check_routing(hf: PreTrainedConfig, topk_method: str) -> None:
    """Group-limited top-k: experts split evenly into n_group groups, the token's experts from
    topk_group of them."""
    if topk_method == "greedy":
        return
    for field in ("n_group", "topk_group"):
        _require(
            hf,
            _is_int(getattr(hf, field)) and getattr(hf, field) > 0,
            field,
            "is not a positive integer",
        )
    experts, groups = hf.n_routed_experts, hf.n_group
    _require(hf, experts % groups == 0, "n_group", f"does not divide n_routed_experts ({experts})")
    per_group = experts // groups
    _require(hf, groups == 1 or per_group >= 2, "n_group", "leaves fewer than 2 experts per group")
    _require(hf, hf.topk_group <= groups, "topk_group", f"exceeds n_group ({groups})")
    _require(
        hf,
        hf.num_experts_per_tok <= hf.topk_group * per_group,
        "num_experts_per_tok",
        f"exceeds the {hf.topk_group * per_group} experts in the topk_group groups a token may use",
    )


def _require(hf: PreTrainedConfig, ok: bool, field: str, what: str) -> None:
    if not ok:
        raise ModelConfigError(f"{field}: {getattr(hf, field)!r} {what}")


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _check_rope_numbers(rope: dict[str, Any], spelling: str) -> None:
    theta = rope.get("rope_theta")
    if theta is not None and not (_is_number(theta) and theta > 1):  # the base of a logarithm
        raise ModelConfigError(f"{spelling}.rope_theta: {theta!r} is not a number > 1")
    for key in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        if rope.get(key) is not None and not (_is_number(rope[key]) and rope[key] >= 0):
            raise ModelConfigError(f"{spelling}.{key}: {rope[key]!r} is not a number >= 0")
    if type(rope.get("truncate", True)) is not bool:
        raise ModelConfigError(f"{spelling}.truncate: {rope['truncate']!r} is not true or false")


def _rope_args(hf: PreTrainedConfig, spelling: str) -> dict[str, Any]:
    """ModelArgs' rope fields from transformers' normalised rope dict; unknown keys are refused."""
    rope = hf.rope_parameters
    rope_type = rope["rope_type"]
    unknown = sorted(set(rope) - ROPE_KEYS[rope_type])
    if unknown:
        raise ModelConfigError(
            f"{spelling}.{unknown[0]}: not implemented for rope_type {rope_type!r} by this engine "
            f"(implemented: {', '.join(sorted(ROPE_KEYS[rope_type] - {'type'}))})"
        )
    _check_rope_numbers(rope, spelling)
    theta = rope["rope_theta"]
    if rope_type == "default":
        return {"rope_theta": float(theta)}
    original = rope["original_max_position_embeddings"]
    if not (_is_int(original) and original > 0):
        raise ModelConfigError(
            f"{spelling}.original_max_position_embeddings: {original!r} is not a positive integer"
        )
    factor = rope["factor"] if rope["factor"] is not None else hf.max_position_embeddings / original
    return {
        "rope_type": "yarn",
        "rope_theta": float(theta),
        "rope_factor": float(factor),
        "original_seq_len": original,
        "beta_fast": float(rope.get("beta_fast") or 32),  # transformers' defaults, `or` included
        "beta_slow": float(rope.get("beta_slow") or 1),
        "mscale": float(rope.get("mscale") or 0),
        "mscale_all_dim": float(rope.get("mscale_all_dim") or 0),
        "rope_attention_factor": rope.get("attention_factor"),
        "rope_truncate": rope.get("truncate", True),
    }
