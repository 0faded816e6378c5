"""Load a DeepSeek-V3 or DeepSeek-V2 HF-format checkpoint directory into a `Transformer`.

A directory holds config.json and model.safetensors, or shards listed by
model.safetensors.index.json. Weights are BF16/FP16/FP32 (DeepSeek-V2 ships BF16), or linear
weights are FP8 E4M3 with a float32 `<name>_scale_inv` per 128x128 block; those are dequantized at
load to the serving dtype, or kept in FP8 when the serving dtype is FP8 (sm90, see precision.py).
Everything the loader rejects raises `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from infermesh.config import ConfigError
from worker_svc.hardware.sizing import INDEXER_HEAD_WEIGHTS, is_fp8_linear
from worker_svc.model.fused_moe import grouped_moe_available
from worker_svc.model.kernel import FP8, block_scale_shape, pad_to_blocks, weight_dequant
from worker_svc.model.model import Linear, ModelArgs, Transformer
from worker_svc.model.model_config import ModelConfigError, model_args

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ConfigError):
    """A checkpoint directory the worker cannot load, as ``[model] path`` names it; the message
    names the file and tensor."""


# -------------------------------------------------------------------------------------- config


def read_config(model_dir: str | Path) -> tuple[dict[str, Any], ModelArgs]:
    """Read config.json and check that this engine can serve it -> (the parsed file, the model's
    hyper-parameters)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist")
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: config.json is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    quant = config.get("quantization_config")
    if quant is not None and (
        quant.get("quant_method") != "fp8" or quant.get("weight_block_size") != [128, 128]
    ):
        raise CheckpointError(
            f"{path}: quantization_config {quant} is not supported (fp8, 128x128 blocks)"
        )
    try:
        return config, model_args(config)
    except ModelConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name."""
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: no valid weight_map ({e})") from None
    single = model_dir / SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    with open_shard(single) as f:
        return dict.fromkeys(f.keys(), SINGLE_FILE)


def open_shard(path: Path, tensor: str | None = None) -> safe_open:
    """A memory-mapped handle on the shard at ``path``."""
    needed_for = f" (needed for tensor {tensor})" if tensor else ""
    if not path.exists():
        raise CheckpointError(f"{path}: shard missing{needed_for}")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{path}: corrupt or truncated safetensors file{needed_for}: {e}"
        ) from None


# -------------------------------------------------------------------------------------- weights


# MLA reads kv_b_proj's weight directly to absorb it into the query and output (no GEMM through
# Linear), so it is always dequantized: about 1B of DeepSeek-V3's 671B parameters.
_ABSORBED_WEIGHT = ".self_attn.kv_b_proj.weight"


class ShardReader:
    """Opens each shard once (memory-mapped) and returns checked tensors."""

    def __init__(self, model_dir: Path, weight_map: dict[str, str]):
        self.model_dir, self.weight_map = model_dir, weight_map
        self._handles: dict[str, Any] = {}

    def get(self, name: str) -> tuple[torch.Tensor, str]:
        file = self.weight_map.get(name)
        if file is None:
            listing = INDEX_FILE if (self.model_dir / INDEX_FILE).exists() else SINGLE_FILE
            raise CheckpointError(
                f"{self.model_dir / listing}: tensor {name} is missing from the checkpoint"
            )
        if file not in self._handles:
            self._handles[file] = open_shard(self.model_dir / file, name).__enter__()
        try:
            return self._handles[file].get_tensor(name), file
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(
                f"{self.model_dir / file}: cannot read tensor {name}: {e}"
            ) from None

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _read_tensor(
    reader: ShardReader, name: str, expected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The checked tensor as stored -> (tensor, its float32 block scale_inv if it is an FP8 linear
    weight)."""
    tensor, file = reader.get(name)
    where = f"{reader.model_dir / file}: tensor {name}"
    if tensor.shape != expected.shape:
        raise CheckpointError(
            f"{where} has shape {tuple(tensor.shape)}, expected {tuple(expected.shape)}"
        )
    if tensor.dtype == FP8 and is_fp8_linear(name):
        scale, scale_file = reader.get(name + "_scale_inv")
        want = block_scale_shape(tensor.shape)
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise CheckpointError(
                f"{reader.model_dir / scale_file}: tensor {name}_scale_inv has {scale.dtype} "
                f"{tuple(scale.shape)}, expected torch.float32 {want}"
            )
        return tensor, scale
    if tensor.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(
            f"{where} has dtype {tensor.dtype}, expected FP8 E4M3 (linear) or bf16/fp16/fp32"
        )
    return tensor, None


def _serving_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    # the router and the indexer's head weights stay in float32 (as HF keeps them): expert and token
    # choice must not flip with the serving dtype
    return torch.float32 if ".mlp.gate." in name or INDEXER_HEAD_WEIGHTS in name else dtype


# A tensor source for build_model: (checkpoint name, the model's meta tensor for it) -> the tensor
# as stored, and its float32 128x128 block scales if it is an FP8 linear weight
TensorSource = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def load_checkpoint(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    grouped_moe: bool = True,
) -> tuple[Transformer, dict[str, Any]]:
    """Build the model on the meta device and fill it from the checkpoint -> (model in eval mode,
    config).

    dtype: the serving dtype. torch.float8_e4m3fn keeps the checkpoint's FP8 linear weights with
    their block scales (run by kernel.fp8_linear) and serves everything else in bfloat16; any
    other dtype dequantizes FP8 weights at load. grouped_moe: the routed experts run as grouped
    launches where the kernel runs (build_model).
    """
    model_dir = Path(model_dir)
    config, args = read_config(model_dir)
    if dtype == FP8 and args.sparse and args.index_head_dim & (args.index_head_dim - 1):
        raise CheckpointError(
            f"{model_dir / 'config.json'}: index_head_dim {args.index_head_dim} is not a power "
            "of two, which the FP8 indexer's Hadamard rotation needs; serve in bf16"
        )
    reader = ShardReader(model_dir, weight_map(model_dir))
    try:
        model = build_model(
            args,
            functools.partial(_read_tensor, reader),
            dtype,
            device,
            progress=True,
            grouped_moe=grouped_moe,
        )
    finally:
        reader.close()
    used = {"lm_head.weight"} | {_checkpoint_name(k) for k in model.state_dict()}
    skipped = [n for n in reader.weight_map if n not in used and not n.endswith("_scale_inv")]
    if skipped:  # the MTP layers past num_hidden_layers
        logger.info(
            "skipped %d checkpoint tensors not used for decoding, e.g. %s", len(skipped), skipped[0]
        )
    _log_weight_memory(model)
    return model, config


def build_model(
    args: ModelArgs,
    source: TensorSource,
    dtype: torch.dtype,
    device: str | torch.device,
    *,
    progress: bool = False,
    grouped_moe: bool = True,
) -> Transformer:
    """The model of `args` with every tensor from `source`, on `device`, in eval mode: FP8 linear
    weights kept with their scales where dtype is FP8, else dequantized there (see
    load_checkpoint); with grouped_moe, each MoE layer's experts stacked for fused_moe's grouped
    kernel where it runs on `device`."""
    keep_fp8 = dtype == FP8
    compute_dtype = torch.bfloat16 if keep_fp8 else dtype
    with torch.device("meta"):
        model = Transformer(args)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    keys = tqdm(expected, desc="Loading weights", unit="tensor", disable=None if progress else True)
    for key in keys:
        name = _checkpoint_name(key)
        tensor, scale_inv = source(name, expected[key])
        if scale_inv is not None and keep_fp8 and not key.endswith(_ABSORBED_WEIGHT):
            cast(Linear, model.get_submodule(key.removesuffix(".weight"))).hold_fp8()
            state[key], state[key + "_scale_inv"] = (
                pad_to_blocks(tensor).to(device),
                scale_inv.to(device),
            )
            continue
        serving = _serving_dtype(name, compute_dtype)
        if scale_inv is not None:  # on the device: a GPU dequantizes with a Triton kernel
            state[key] = weight_dequant(tensor.to(device), scale_inv.to(device), dtype=serving)
        else:
            state[key] = tensor.to(serving).to(device)
    model.load_state_dict(state, assign=True, strict=True)
    del state  # pack_weights replaces some of these tensors: let each go as it does
    model.reset_buffers(device)
    grouped = grouped_moe and grouped_moe_available(torch.device(device), keep_fp8)
    model.pack_weights(grouped_moe=grouped)
    return model.eval()


def _checkpoint_name(key: str) -> str:
    """A model state key's name in the checkpoint."""
    return key if key == "lm_head.weight" else f"model.{key}"


def _log_weight_memory(model: Transformer) -> None:
    fp8 = [
        (m.weight, m.weight_scale_inv)
        for m in model.modules()
        if isinstance(m, Linear) and m.weight_scale_inv is not None
    ]
    fp8_bytes = sum(weight.nbytes + scale_inv.nbytes for weight, scale_inv in fp8)
    total = sum(t.nbytes for t in model.state_dict().values())
    logger.info(
        "weights: %.1f MiB, of which %d FP8 linear weights with block scales %.1f MiB",
        total / 2**20,
        len(fp8),
        fp8_bytes / 2**20,
    )
