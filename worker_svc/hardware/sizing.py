"""How much memory a DeepSeek-V3/V3.2/V2-family model needs: its parameters (total, and read per
token), weights in each precision, the KV cache per token, and the fewest GPUs that hold both. One
arithmetic for ``infermesh plan`` and the simulated workers (sim_engine/), from config.json
alone: no torch, no weights. worker_svc/model/configs/ holds the public models' config.json
values (DeepSeek-V3, V3.2-Exp, V2, V2.5, V2-Lite), so a name sizes a model like its checkpoint.

The tensors are enumerated by their HF names, as the checkpoints store them. DeepSeek-V3(.2) ships
FP8 (``quantization_config``): the decoder layers' linear weights in FP8 E4M3 with one float32
``weight_scale_inv`` per 128 x 128 block, the MoE gate's bias in float32, everything else
(embeddings, lm_head, norms, the MoE gate, the indexer's weights_proj) in BF16. FP8 is served
as stored on Hopper; on every other GPU the weights are dequantized to BF16/FP16 (2 bytes each).
DeepSeek-V2 ships BF16 and is served in BF16 on Hopper too (``serving_profile``).
Multi-token-prediction layers stored past ``num_hidden_layers`` are not loaded for serving. The
KV cache holds, per layer and token, the compressed latent and the rope'd key (kv_lora_rank +
qk_rope_head_dim values) and, for V3.2, the indexer's key (index_head_dim values), in the serving
dtype, BF16 under FP8 (worker_svc/torch_engine/kv_cache.py).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from infermesh.config import ConfigError
from infermesh.names import Precision
from worker_svc.hardware.gpu_profiles import GpuProfile

_BLOCK = 128  # weight_block_size of DeepSeek's FP8 checkpoints
_VALUE_BYTES: dict[Precision, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
_KV_VALUE_BYTES: dict[Precision, int] = {"fp8": 2, "bf16": 2, "fp16": 2, "fp32": 4}
_BUNDLED = Path(__file__).parent.parent / "model" / "configs"
DEFAULT_UTILIZATION = 0.9  # of each GPU's memory for weights and the KV cache ([cache])
Stored = Literal["fp8", "bf16", "fp32"]
_FP8_LINEAR_SUFFIXES = (
    "_proj.weight",
    "_proj_with_mqa.weight",
    ".indexer.wq_b.weight",
    ".indexer.wk.weight",
)
INDEXER_HEAD_WEIGHTS = ".indexer.weights_proj."


def is_fp8_linear(name: str) -> bool:
    """Linear weights a DeepSeek-V3(.2) checkpoint stores in FP8 (not embed, lm_head, norms, gate,
    and not the indexer's per-head weights_proj, which V3.2 stores in BF16)."""
    return (
        name.startswith("model.layers.")
        and name.endswith(_FP8_LINEAR_SUFFIXES)
        and INDEXER_HEAD_WEIGHTS not in name
    )


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


class SizingError(ConfigError):
    """A model the sizing cannot read: its config.json is missing, is not JSON, or does not
    describe a DeepSeek-V3/V3.2/V2-family model."""


@dataclass(frozen=True)
class ModelSize:
    """The sizes of one model that serving depends on."""

    name: str
    model_type: str  # config.json's: deepseek_v3, deepseek_v32, deepseek_v2
    params: int  # served weights (without the MTP layers)
    active_params: int  # read per token: all but the routed experts a token does not use and
    # the embedding rows of other tokens
    stored_bytes: int  # the served weights as stored (FP8: linears with scales, BF16 the rest)
    checkpoint_params: int  # with the MTP layers, as published
    checkpoint_bytes: int
    kv_values_per_token: int  # layers x (kv_lora_rank + qk_rope_head_dim)
    index_values_per_token: int = 0  # V3.2: layers x index_head_dim (the indexer's cached key)
    index_topk: int = 0  # V3.2: the tokens each query attends to; 0: dense attention
    fp8_weights: bool = True  # stored in FP8 (DeepSeek-V3); False: BF16 (DeepSeek-V2)
    # MLA, absorbed: one query against one cached token, all layers and heads: its score over the
    # latent and rope'd key (kv_lora_rank + qk_rope_head_dim) and its value (kv_lora_rank), 2
    # FLOPs a multiply-add; 0: unknown (a model known only by its sizes)
    attention_flops_per_key: int = 0

    def weight_bytes(self, precision: Precision) -> int:
        """Weight memory when served in ``precision`` (fp8: as stored; else dequantized)."""
        return self.stored_bytes if precision == "fp8" else self.params * _VALUE_BYTES[precision]

    def kv_bytes_per_token(self, precision: Precision) -> int:
        """Every cached value of one token: the MLA latent and (V3.2) the indexer's key."""
        return self.latent_bytes_per_token(precision) + self.index_bytes_per_token(precision)

    def latent_bytes_per_token(self, precision: Precision) -> int:
        return self.kv_values_per_token * _KV_VALUE_BYTES[precision]

    def index_bytes_per_token(self, precision: Precision) -> int:
        return self.index_values_per_token * _KV_VALUE_BYTES[precision]

    @classmethod
    def of_params(
        cls,
        name: str,
        params: float,
        active_params: float,
        kv_bytes_per_token: int,
        index_bytes_per_token: int = 0,
        index_topk: int = 0,
    ) -> ModelSize:
        """A model known only by its sizes (the simulated engine's [engine] keys): dense FP8
        weights, 1 byte each, and a 2-byte KV cache of ``kv_bytes_per_token`` (+ V3.2's
        ``index_bytes_per_token`` when ``index_topk`` > 0)."""
        total, active = int(params), int(active_params)
        return cls(
            name,
            "deepseek_v32" if index_topk else "deepseek_v3",
            total,
            active,
            total,
            total,
            total,
            math.ceil(kv_bytes_per_token / 2),
            math.ceil(index_bytes_per_token / 2),
            index_topk,
        )


def serving_profile(profile: GpuProfile, size: ModelSize) -> GpuProfile:
    """``profile`` as it serves ``size``: a BF16 checkpoint (DeepSeek-V2) has no FP8 weights to
    keep."""
    return profile if size.fp8_weights else profile.without_fp8()


def bundled_models() -> list[str]:
    """The configs shipped in worker_svc/model/configs/, by name."""
    return sorted(p.stem for p in _BUNDLED.glob("*.json"))


def read_config_json(source: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, the file itself, or a bundled config by name."""
    path = _BUNDLED / f"{source}.json" if str(source) in bundled_models() else Path(source)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise SizingError(
            f"{file}: not found (need a checkpoint directory, its config.json, or one of "
            f"{', '.join(bundled_models())})"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SizingError(f"{file}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise SizingError(f"{file}: not a JSON object")
    return config


@functools.cache  # a worker's config is checked, then used
def model_size_of(source: str | Path) -> ModelSize:
    """The sizes of a checkpoint directory's, a config.json's or a bundled model's config, named
    after the directory or the bundled model (a file: after its _name_or_path)."""
    return model_size(
        read_config_json(source), name="" if Path(source).is_file() else Path(source).name
    )


def index_total_size(checkpoint: str | Path) -> int | None:
    """The ``total_size`` a checkpoint's model.safetensors.index.json states (None: no index)."""
    index = Path(checkpoint) / "model.safetensors.index.json"
    try:
        return int(json.loads(index.read_text())["metadata"]["total_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def model_size(config: dict[str, Any], name: str = "") -> ModelSize:
    """The sizes of the model ``config`` (a DeepSeek-V3/V3.2/V2 config.json) describes."""
    try:
        layers = config["num_hidden_layers"]
        mtp = config.get("num_nextn_predict_layers", 0)
        served = list(checkpoint_tensors(config, layers))
        stored = served + list(checkpoint_tensors(config, layers + mtp, first_layer=layers))
        kv_values = layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
        attention_flops = (
            layers
            * config["num_attention_heads"]
            * 2
            * (2 * config["kv_lora_rank"] + config["qk_rope_head_dim"])
        )
        index_values, index_topk = (
            (layers * config["index_head_dim"], config["index_topk"])
            if _is_sparse(config)
            else (0, 0)
        )
        unused_experts = config["n_routed_experts"] - config["num_experts_per_tok"]
        # an embedding lookup reads one row of the table
        unread = (config["vocab_size"] - 1) * config["hidden_size"]
    except (KeyError, TypeError) as e:
        raise SizingError(
            f"config.json has no usable {e.args[0]!r}: not a DeepSeek-V3/V3.2/V2 config"
        ) from None
    params = sum(t.numel for t in served)
    moe_layers = sum(1 for i in range(layers) if _is_moe(config, i))
    unread += (
        moe_layers * unused_experts * 3 * config["hidden_size"] * config["moe_intermediate_size"]
    )
    return ModelSize(
        name=name or config.get("_name_or_path", "") or config.get("model_type", "model"),
        model_type=config.get("model_type", ""),
        params=params,
        active_params=params - unread,
        stored_bytes=sum(t.stored_bytes for t in served),
        checkpoint_params=sum(t.numel for t in stored),
        checkpoint_bytes=sum(t.stored_bytes for t in stored),
        kv_values_per_token=kv_values,
        index_values_per_token=index_values,
        index_topk=index_topk,
        fp8_weights="quantization_config" in config,
        attention_flops_per_key=attention_flops,
    )


def checkpoint_tensors(
    config: dict[str, Any], end_layer: int, first_layer: int = 0
) -> Iterator[Tensor]:
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
    h, linear = config["hidden_size"], _linear_dtype(config)
    p = f"model.layers.{i}."
    yield Tensor(p + "input_layernorm.weight", (h,), "bf16")
    yield Tensor(p + "post_attention_layernorm.weight", (h,), "bf16")
    yield from _attention_tensors(config, p + "self_attn.")
    if _is_moe(config, i):
        experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
        yield Tensor(p + "mlp.gate.weight", (experts, h), "bf16")
        if _topk_method(config) == "noaux_tc":  # the routing bias of bias-corrected top-k
            yield Tensor(p + "mlp.gate.e_score_correction_bias", (experts,), "fp32")
        for e in range(experts):
            yield from _mlp_tensors(f"{p}mlp.experts.{e}.", h, inter, linear)
        if config.get("n_shared_experts"):
            yield from _mlp_tensors(
                p + "mlp.shared_experts.", h, inter * config["n_shared_experts"], linear
            )
    else:
        yield from _mlp_tensors(p + "mlp.", h, config["intermediate_size"], linear)
    if i >= config["num_hidden_layers"]:  # an MTP layer: its own embedding and head copies
        vocab = config["vocab_size"]
        yield Tensor(p + "embed_tokens.weight", (vocab, h), "bf16")
        yield Tensor(p + "enorm.weight", (h,), "bf16")
        yield Tensor(p + "hnorm.weight", (h,), "bf16")
        yield Tensor(p + "eh_proj.weight", (h, 2 * h), linear)
        yield Tensor(p + "shared_head.norm.weight", (h,), "bf16")
        yield Tensor(p + "shared_head.head.weight", (vocab, h), "bf16")


def _attention_tensors(config: dict[str, Any], p: str) -> Iterator[Tensor]:
    h, heads, linear = config["hidden_size"], config["num_attention_heads"], _linear_dtype(config)
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config.get("q_lora_rank") or 0, config["kv_lora_rank"]
    if q_rank:
        yield Tensor(p + "q_a_proj.weight", (q_rank, h), linear)
        yield Tensor(p + "q_a_layernorm.weight", (q_rank,), "bf16")
        yield Tensor(p + "q_b_proj.weight", (heads * (nope + rope), q_rank), linear)
    else:
        yield Tensor(p + "q_proj.weight", (heads * (nope + rope), h), linear)
    yield Tensor(p + "kv_a_proj_with_mqa.weight", (kv_rank + rope, h), linear)
    yield Tensor(p + "kv_a_layernorm.weight", (kv_rank,), "bf16")
    yield Tensor(p + "kv_b_proj.weight", (heads * (nope + v), kv_rank), linear)
    yield Tensor(p + "o_proj.weight", (h, heads * v), linear)
    if _is_sparse(config):
        yield from _indexer_tensors(config, p + "indexer.")


def _indexer_tensors(config: dict[str, Any], p: str) -> Iterator[Tensor]:
    """V3.2's lightning indexer (model.Indexer): its query from the query latent, one key per
    token."""
    h, heads, dim = config["hidden_size"], config["index_n_heads"], config["index_head_dim"]
    linear = _linear_dtype(config)
    yield Tensor(p + "wq_b.weight", (heads * dim, config["q_lora_rank"]), linear)
    yield Tensor(p + "wk.weight", (dim, h), linear)
    yield Tensor(p + "k_norm.weight", (dim,), "bf16")
    yield Tensor(p + "k_norm.bias", (dim,), "bf16")
    yield Tensor(p + "weights_proj.weight", (heads, h), "bf16")


def _mlp_tensors(p: str, h: int, inter: int, linear: Stored) -> Iterator[Tensor]:
    yield Tensor(p + "gate_proj.weight", (inter, h), linear)
    yield Tensor(p + "up_proj.weight", (inter, h), linear)
    yield Tensor(p + "down_proj.weight", (h, inter), linear)


def _linear_dtype(config: dict[str, Any]) -> Stored:
    return "fp8" if "quantization_config" in config else "bf16"


def _topk_method(config: dict[str, Any]) -> str:
    """The routing; absent, what transformers' config class means: V3(.2) noaux_tc, V2 greedy."""
    return config.get("topk_method") or (
        "greedy" if config.get("model_type") == "deepseek_v2" else "noaux_tc"
    )


def _is_sparse(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "deepseek_v32"


def _is_moe(config: dict[str, Any], i: int) -> bool:
    return (
        (config.get("n_routed_experts") or 0) > 0
        and i >= config.get("first_k_dense_replace", 0)
        and i % config.get("moe_layer_freq", 1) == 0
    )


def fewest_gpus(
    weight_bytes: int,
    kv_bytes: int,
    gpu_memory_bytes: int,
    utilization: float = DEFAULT_UTILIZATION,
) -> int:
    """The fewest GPUs whose usable memory holds the weights plus ``kv_bytes`` of KV cache."""
    return max(1, math.ceil((weight_bytes + kv_bytes) / (gpu_memory_bytes * utilization)))


def sequences_that_fit(
    weight_bytes: int,
    kv_bytes_per_sequence: int,
    gpus: int,
    gpu_memory_bytes: int,
    utilization: float = DEFAULT_UTILIZATION,
) -> int:
    """Concurrent sequences of ``kv_bytes_per_sequence`` whose KV cache fits on ``gpus`` GPUs
    beside the weights (0: the weights alone do not fit)."""
    free = gpus * gpu_memory_bytes * utilization - weight_bytes
    return max(0, int(free // kv_bytes_per_sequence))
