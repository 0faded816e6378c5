"""transformers' DeepseekV3ForCausalLM, DeepseekV32ForCausalLM or DeepseekV2ForCausalLM loaded by
transformers from a checkpoint's files: the reference the correctness tests and the throughput
benchmark compare the engine against. Nothing of our loader is used, so that a bug in how it reads
a checkpoint (a name, a layout, the FP8 dequantization) shows as a difference.

transformers maps the checkpoint's names and stacks each MoE layer's experts itself. An FP8
checkpoint is first dequantized here, by DeepSeek's block scheme as its ``quantization_config``
states it (each ``weight_block_size`` block times its ``weight_scale_inv``), into an FP32 copy
that transformers then loads: its own FP8 loading needs an accelerator."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

_SCALE = "_scale_inv"


def transformers_reference(checkpoint: Path) -> PreTrainedModel:
    """transformers' model of ``checkpoint`` in FP32, eager attention, every weight it has read
    from the checkpoint's files (raises when one is missing, left over or of another shape)."""
    config = json.loads((checkpoint / "config.json").read_text())
    if "quantization_config" not in config:
        return _load(checkpoint)
    with tempfile.TemporaryDirectory() as copy:
        _write_dequantized(checkpoint, config, Path(copy))
        return _load(Path(copy))


def _load(checkpoint: Path) -> PreTrainedModel:
    # with output_loading_info, the model and what did not load (transformers types only the model)
    model, info = cast(
        tuple[PreTrainedModel, dict[str, Any]],
        AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        ),
    )
    assert not any(info.values()), f"{checkpoint}: {info}"
    model.train(False)  # eval mode
    return model


def _write_dequantized(checkpoint: Path, config: dict[str, Any], out: Path) -> None:
    """``checkpoint`` as FP32 weights with its config less the quantization_config and its MTP
    layers (the layers past num_hidden_layers, which transformers does not model)."""
    block_rows, block_cols = config.pop("quantization_config")["weight_block_size"]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors |= load_file(file)
    dequantized = {}
    for name, tensor in tensors.items():
        if name.endswith(_SCALE) or _layer(name) >= config["num_hidden_layers"]:
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name + _SCALE]
            per_element = scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
            tensor = tensor.float() * per_element[: tensor.size(0), : tensor.size(1)]
        dequantized[name] = tensor.float().contiguous()
    save_file(dequantized, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config))


def _layer(name: str) -> int:
    """The decoder layer a weight belongs to; -1 for the embeddings, final norm and head."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1
