"""The tiny checkpoint's format and the loader's errors."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from worker_svc.checkpoint import CheckpointError, load_checkpoint
from worker_svc.tiny_model import write_tiny_checkpoint

_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
_NORM = "model.layers.0.input_layernorm.weight"
_FP8_WEIGHT = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"


def test_tiny_checkpoint_is_byte_identical_on_rerun(tiny_dir: Path, tmp_path: Path):
    again = write_tiny_checkpoint(tmp_path)
    for name in _FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_config_has_deepseek_v3_keys(tiny_dir: Path):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    }  # fmt: skip
    assert config["torch_dtype"] == "bfloat16" and config["topk_method"] == "noaux_tc"
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group",
                "topk_group", "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor",
                "n_shared_experts", "moe_intermediate_size", "rope_scaling", "num_nextn_predict_layers"):  # fmt: skip
        assert key in config, key
    assert config["hidden_size"] % 128 != 0  # partial FP8 blocks occur


def test_safetensors_dtypes_shapes_and_names(tiny_dir: Path):
    config = json.loads((tiny_dir / "config.json").read_text())
    with safe_open(tiny_dir / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_slice(name) for name in f.keys()}
        dtypes = {name: s.get_dtype() for name, s in tensors.items()}
        shapes = {name: tuple(s.get_shape()) for name, s in tensors.items()}
    assert dtypes["model.embed_tokens.weight"] == dtypes["lm_head.weight"] == "BF16"
    assert dtypes[_NORM] == dtypes["model.norm.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    projections = [n for n in dtypes if n.startswith("model.layers.") and "_proj" in n and n.endswith(".weight")]
    assert _FP8_WEIGHT in projections
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in projections
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in projections
    for name in projections:
        assert dtypes[name] == "F8_E4M3", name
        assert dtypes[name + "_scale_inv"] == "F32"
        rows, cols = shapes[name]
        assert shapes[name + "_scale_inv"] == (-(-rows // 128), -(-cols // 128)), name
    assert shapes["model.layers.0.self_attn.q_a_proj.weight"] == (config["q_lora_rank"], config["hidden_size"])
    assert f"model.layers.{config['num_hidden_layers']}.eh_proj.weight" in dtypes  # MTP layer, skipped at load


def test_sharded_checkpoint_loads_like_single_file(tiny_dir: Path, tmp_path: Path):
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / file)
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _ = load_checkpoint(tmp_path)
    single, _ = load_checkpoint(tiny_dir)
    for key, value in single.state_dict().items():
        assert torch.equal(sharded.state_dict()[key], value), key

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: shard missing \(needed for tensor"):
        load_checkpoint(tmp_path)


def test_mtp_layer_is_skipped_at_load(tiny_dir: Path, caplog: pytest.LogCaptureFixture):
    config = json.loads((tiny_dir / "config.json").read_text())
    with caplog.at_level(logging.INFO, logger="worker_svc.checkpoint"):
        model, _ = load_checkpoint(tiny_dir)
    assert len(model.layers) == config["num_hidden_layers"]
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert f"skipped 4 checkpoint tensors not used for decoding, e.g. {mtp}" in caplog.text


@pytest.fixture
def ckpt_copy(tiny_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _rewrite(model_dir: Path, change) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_missing_dir_and_config(tmp_path: Path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_checkpoint(tmp_path)


def test_a_config_that_is_not_an_object_is_refused(ckpt_copy: Path):
    (ckpt_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json: not a JSON object"):
        load_checkpoint(ckpt_copy)


def test_unsupported_model_type_names_the_key(ckpt_copy: Path):
    config = json.loads((ckpt_copy / "config.json").read_text())
    (ckpt_copy / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"config.json: model_type: 'llama' is not served"):
        load_checkpoint(ckpt_copy)


@pytest.mark.parametrize("damage", ["truncate", "garbage-header"])
def test_corrupt_file_names_the_file(ckpt_copy: Path, damage: str):
    path = ckpt_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_checkpoint(ckpt_copy)


def test_missing_tensor_is_named(ckpt_copy: Path):
    _rewrite(ckpt_copy, lambda t: t.pop(_NORM))
    with pytest.raises(CheckpointError, match=f"tensor {_NORM} is missing"):
        load_checkpoint(ckpt_copy)


def test_wrong_shape_names_file_and_tensor(ckpt_copy: Path):
    _rewrite(ckpt_copy, lambda t: t.update({_NORM: t[_NORM][:-1].clone()}))
    match = rf"model\.safetensors: tensor {_NORM} has shape \(319,\), expected \(320,\)"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ckpt_copy)


def test_wrong_dtype_names_file_and_tensor(ckpt_copy: Path):
    _rewrite(ckpt_copy, lambda t: t.update({_NORM: t[_NORM].to(torch.int32)}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {_NORM} has dtype torch\.int32"):
        load_checkpoint(ckpt_copy)


def test_wrong_scale_dtype_is_named(ckpt_copy: Path):
    name = _FP8_WEIGHT + "_scale_inv"
    _rewrite(ckpt_copy, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=rf"tensor {name} has torch\.bfloat16"):
        load_checkpoint(ckpt_copy)
