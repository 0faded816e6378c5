"""Load a DeepSeek-V3 HF-format checkpoint directory into a `Transformer`.

A directory holds config.json and model.safetensors, or shards listed by
model.safetensors.index.json. Linear weights may be FP8 E4M3 with a float32
`<name>_scale_inv` per 128x128 block; they are dequantized at load to the serving dtype.
Everything the loader rejects raises `CheckpointError` naming the file and the tensor.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from worker_svc.model import ModelArgs, Transformer

logger = logging.getLogger(__name__)

BLOCK_SIZE = 128
_SUPPORTED_MODEL_TYPES = ("deepseek_v3",)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory the worker cannot load; the message names the file and tensor."""


# ------------------------------------------------------------------------------------- kernels


def weight_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """w[i, j] = fp8[i, j] * scale_inv[i // block, j // block], in float32.

    weight: [M, N] float8_e4m3fn; scale_inv: [ceil(M / block), ceil(N / block)] float32.
    """
    assert weight.dim() == 2 and scale_inv.dim() == 2, f"shapes {tuple(weight.shape)}, {tuple(scale_inv.shape)}"
    m, n = weight.shape
    assert scale_inv.shape == block_scale_shape(weight.shape, block_size), f"scale {tuple(scale_inv.shape)}"
    scale = scale_inv.repeat_interleave(block_size, 0)[:m].repeat_interleave(block_size, 1)[:, :n]
    return weight.float() * scale


def weight_quant(weight: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of weight_dequant: per-block scale = amax / 448 -> (fp8 weight, float32 scale_inv)."""
    assert weight.dim() == 2, f"weight must be 2-D, got {tuple(weight.shape)}"
    m, n = weight.shape
    sm, sn = block_scale_shape(weight.shape, block_size)
    padded = torch.zeros(sm * block_size, sn * block_size, dtype=torch.float32)
    padded[:m, :n] = weight.float()
    blocks = padded.view(sm, block_size, sn, block_size)
    scale = (blocks.abs().amax(dim=(1, 3)) / _FP8_MAX).clamp(min=1e-12)  # [sm, sn]
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:m, :n].to(_FP8)
    return q.contiguous(), scale.contiguous()


def act_quant(x: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1x128 activation quantization: x [..., K] -> (fp8 [..., K], float32 scale [..., K/128])."""
    assert x.is_contiguous() and x.size(-1) % block_size == 0, f"last dim {x.size(-1)} % {block_size}"
    groups = x.float().unflatten(-1, (-1, block_size))
    scale = (groups.abs().amax(dim=-1) / _FP8_MAX).clamp(min=1e-12)
    return (groups / scale.unsqueeze(-1)).flatten(-2).to(_FP8), scale


def fp8_gemm_reference(
    x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """Block-scaled FP8 GEMM on CPU, FP32 accumulation: y = dequant(x) @ dequant(w).T, for checking kernels."""
    xd = (x.float().unflatten(-1, (-1, block_size)) * x_scale.unsqueeze(-1)).flatten(-2)
    return xd @ weight_dequant(w, w_scale, block_size).T


def block_scale_shape(shape: torch.Size | tuple[int, ...], block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    return (-(-shape[0] // block_size), -(-shape[1] // block_size))


# -------------------------------------------------------------------------------------- config


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """Read config.json and check that this engine can serve it."""
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
    model_type = config.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{path}: model_type={model_type!r} is not served by this engine (need deepseek_v3)")
    quant = config.get("quantization_config")
    if quant is not None and (quant.get("quant_method") != "fp8" or quant.get("weight_block_size") != [128, 128]):
        raise CheckpointError(f"{path}: quantization_config {quant} is not supported (fp8, 128x128 blocks)")
    try:
        ModelArgs.from_config(config)
    except KeyError as e:
        raise CheckpointError(f"{path}: missing key {e.args[0]!r}") from None
    except (ValueError, AssertionError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return config


def _weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name -> shard file name."""
    index = model_dir / _INDEX_FILE
    if index.exists():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: no valid weight_map ({e})") from None
    single = model_dir / _SINGLE_FILE
    if not single.exists():
        raise CheckpointError(f"{model_dir}: neither {_SINGLE_FILE} nor {_INDEX_FILE} found")
    with _open(single) as f:
        return {name: _SINGLE_FILE for name in f.keys()}


def _open(path: Path, tensor: str | None = None):  # -> a memory-mapped safe_open handle
    needed_for = f" (needed for tensor {tensor})" if tensor else ""
    if not path.exists():
        raise CheckpointError(f"{path}: shard missing{needed_for}")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file{needed_for}: {e}") from None


# -------------------------------------------------------------------------------------- weights


def is_fp8_linear(name: str) -> bool:
    """Linear weights a DeepSeek-V3 checkpoint stores in FP8 (not embed, lm_head, norms, gate)."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


class _ShardReader:
    """Opens each shard once (memory-mapped) and returns checked tensors."""

    def __init__(self, model_dir: Path, weight_map: dict[str, str]):
        self.model_dir, self.weight_map = model_dir, weight_map
        self._handles: dict[str, Any] = {}

    def get(self, name: str) -> tuple[torch.Tensor, str]:
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name} is missing from the checkpoint")
        if file not in self._handles:
            self._handles[file] = _open(self.model_dir / file, name).__enter__()
        try:
            return self._handles[file].get_tensor(name), file
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{self.model_dir / file}: cannot read tensor {name}: {e}") from None

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _load_tensor(reader: _ShardReader, name: str, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor, file = reader.get(name)
    where = f"{reader.model_dir / file}: tensor {name}"
    if tensor.shape != expected.shape:
        raise CheckpointError(f"{where} has shape {tuple(tensor.shape)}, expected {tuple(expected.shape)}")
    if tensor.dtype == _FP8 and is_fp8_linear(name):
        scale, scale_file = reader.get(name + "_scale_inv")
        want = block_scale_shape(tensor.shape)
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise CheckpointError(
                f"{reader.model_dir / scale_file}: tensor {name}_scale_inv has {scale.dtype} "
                f"{tuple(scale.shape)}, expected torch.float32 {want}"
            )
        tensor = weight_dequant(tensor, scale)
    elif tensor.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"{where} has dtype {tensor.dtype}, expected FP8 E4M3 (linear) or bf16/fp16/fp32")
    # the router stays in float32 (as HF keeps it): expert choice must not flip with the serving dtype
    return tensor.to(torch.float32 if ".mlp.gate." in name else dtype)


def load_checkpoint(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Transformer, dict[str, Any]]:
    """Build the model on the meta device and fill it from the checkpoint -> (model in eval mode, config)."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    args = ModelArgs.from_config(config)
    with torch.device("meta"):
        model = Transformer(args)
    expected = model.state_dict()
    reader = _ShardReader(model_dir, _weight_map(model_dir))
    state: dict[str, torch.Tensor] = {}
    try:
        for key in tqdm(expected, desc="Loading weights", unit="tensor", disable=None):
            name = "lm_head.weight" if key == "lm_head.weight" else f"model.{key}"
            state[key] = _load_tensor(reader, name, expected[key], dtype).to(device)
    finally:
        reader.close()
    used = {"lm_head.weight"} | {f"model.{k}" for k in expected}
    skipped = [n for n in reader.weight_map if n not in used and not n.endswith("_scale_inv")]
    if skipped:  # the MTP layers past num_hidden_layers
        logger.info("skipped %d checkpoint tensors not used for decoding, e.g. %s", len(skipped), skipped[0])
    model.load_state_dict(state, assign=True, strict=True)
    model.reset_buffers(device)
    return model.eval(), config
