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

from devtools.tiny_model import write_tiny_checkpoint, write_v2_checkpoint
from worker_svc.model.checkpoint import CheckpointError, load_checkpoint
from worker_svc.model.kernel import FP8
from worker_svc.model.model_config import model_args

_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]
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
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    assert config["torch_dtype"] == "bfloat16" and config["topk_method"] == "noaux_tc"
    for key in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "num_experts_per_tok",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "n_shared_experts",
        "moe_intermediate_size",
        "rope_scaling",
        "num_nextn_predict_layers",
    ):
        assert key in config, key
    assert config["hidden_size"] % 128 != 0  # partial FP8 blocks occur


def test_safetensors_dtypes_shapes_and_names(tiny_dir: Path):
    config = json.loads((tiny_dir / "config.json").read_text())
    with safe_open(tiny_dir / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 # safe_open is not iterable
        dtypes = {name: s.get_dtype() for name, s in tensors.items()}
        shapes = {name: tuple(s.get_shape()) for name, s in tensors.items()}
    assert dtypes["model.embed_tokens.weight"] == dtypes["lm_head.weight"] == "BF16"
    assert dtypes[_NORM] == dtypes["model.norm.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.weight"] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "F32"
    projections = [
        n
        for n in dtypes
        if n.startswith("model.layers.") and "_proj" in n and n.endswith(".weight")
    ]
    assert _FP8_WEIGHT in projections
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in projections
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in projections
    for name in projections:
        assert dtypes[name] == "F8_E4M3", name
        assert dtypes[name + "_scale_inv"] == "F32"
        rows, cols = shapes[name]
        assert shapes[name + "_scale_inv"] == (-(-rows // 128), -(-cols // 128)), name
    assert shapes["model.layers.0.self_attn.q_a_proj.weight"] == (
        config["q_lora_rank"],
        config["hidden_size"],
    )
    # MTP layer, skipped at load
    assert f"model.layers.{config['num_hidden_layers']}.eh_proj.weight" in dtypes


def test_sharded_checkpoint_loads_like_single_file(tiny_dir: Path, tmp_path: Path):
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / file)
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _ = load_checkpoint(tmp_path)
    single, _ = load_checkpoint(tiny_dir)
    for key, value in single.state_dict().items():
        assert torch.equal(sharded.state_dict()[key], value), key

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"model-00002-of-00002\.safetensors: shard missing \(needed for tensor",
    ):
        load_checkpoint(tmp_path)


def test_mtp_layer_is_skipped_at_load(tiny_dir: Path, caplog: pytest.LogCaptureFixture):
    config = json.loads((tiny_dir / "config.json").read_text())
    with caplog.at_level(logging.INFO, logger="worker_svc.model.checkpoint"):
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
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
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
    with pytest.raises(
        CheckpointError, match=rf"model\.safetensors: tensor {_NORM} has dtype torch\.int32"
    ):
        load_checkpoint(ckpt_copy)


def test_wrong_scale_dtype_is_named(ckpt_copy: Path):
    name = _FP8_WEIGHT + "_scale_inv"
    _rewrite(ckpt_copy, lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=rf"tensor {name} has torch\.bfloat16"):
        load_checkpoint(ckpt_copy)


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_scales_off_the_weights_block_layout_are_refused_by_name(ckpt_copy: Path, dtype):
    """kv_a_proj [176, 320] has 2 x 3 blocks of 128 x 128: a scale per 128 x 64 block (2 x 5), as
    a checkpoint quantized with other blocks would store it, is refused whether the weights are
    dequantized at load or kept in FP8."""
    name = _FP8_WEIGHT + "_scale_inv"

    def per_64_columns(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].repeat_interleave(2, dim=1)[:, :5].contiguous()

    _rewrite(ckpt_copy, per_64_columns)
    match = rf"model\.safetensors: tensor {name} has torch\.float32 \(2, 5\), expected "
    with pytest.raises(CheckpointError, match=match + r"torch\.float32 \(2, 3\)"):
        load_checkpoint(ckpt_copy, dtype)


# ------------------------------------------------------------------------------------ DeepSeek-V2


def test_v2_checkpoints_are_bf16_without_scales_bias_or_mtp(
    v2_dir: Path, v2_lite_dir: Path, tmp_path: Path
):
    for model_dir, lite in ((v2_dir, False), (v2_lite_dir, True)):
        config = json.loads((model_dir / "config.json").read_text())
        assert config["model_type"] == "deepseek_v2" and config["architectures"] == [
            "DeepseekV2ForCausalLM"
        ]
        assert "quantization_config" not in config and config["scoring_func"] == "softmax"
        assert config["topk_method"] == ("greedy" if lite else "group_limited_greedy")
        assert (config["q_lora_rank"] is None) == lite
        with safe_open(model_dir / "model.safetensors", framework="pt") as f:
            dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 # safe_open is not iterable
        assert set(dtypes.values()) == {"BF16"}
        assert not [n for n in dtypes if n.endswith(("_scale_inv", "e_score_correction_bias"))]
        # no MTP layer
        assert max(int(n.split(".")[2]) for n in dtypes if n.startswith("model.layers.")) == 2
        assert ("model.layers.0.self_attn.q_proj.weight" in dtypes) == lite
    again = write_v2_checkpoint(tmp_path, lite=True)
    for name in _FILES:
        assert (again / name).read_bytes() == (v2_lite_dir / name).read_bytes(), name


def test_v2_loads_its_router_from_config(v2_dir: Path, v2_lite_dir: Path):
    model, _ = load_checkpoint(v2_dir)
    gate = model.layers[1].mlp.gate
    assert (gate.args.scoring_func, gate.args.topk_method) == ("softmax", "group_limited_greedy")
    assert (gate.args.n_expert_groups, gate.args.n_limited_groups, gate.args.route_scale) == (
        4,
        2,
        16.0,
    )
    assert gate.e_score_correction_bias is None and not gate.args.norm_topk_prob
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32
    lite, _ = load_checkpoint(v2_lite_dir)
    assert lite.layers[1].mlp.gate.args.topk_method == "greedy" and not lite.args.q_lora_rank


@pytest.fixture
def v2_copy(v2_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(v2_dir, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize(
    "field, value", [("topk_method", "noaux_tc_v9"), ("scoring_func", "sqrtsoftplus")]
)
def test_unknown_router_is_refused_naming_file_and_field(v2_copy: Path, field: str, value: str):
    config = json.loads((v2_copy / "config.json").read_text())
    (v2_copy / "config.json").write_text(json.dumps(config | {field: value}))
    with pytest.raises(
        CheckpointError,
        match=rf"config\.json: {field}: '{value}' is not implemented by this engine \(supported: ",
    ):
        load_checkpoint(v2_copy)


def test_more_experts_than_the_kept_groups_hold_is_refused(v2_copy: Path):
    config = json.loads((v2_copy / "config.json").read_text())
    (v2_copy / "config.json").write_text(
        json.dumps(config | {"topk_group": 1, "num_experts_per_tok": 3})
    )
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: num_experts_per_tok: 3 exceeds the 2 experts "
        r"in the topk_group groups",
    ):
        load_checkpoint(v2_copy)


@pytest.mark.parametrize(
    "copy, tensor",
    [
        ("v2_copy", "model.layers.2.mlp.gate.weight"),
        ("ckpt_copy", "model.layers.1.mlp.gate.e_score_correction_bias"),
    ],
)
def test_a_missing_gate_tensor_names_file_and_tensor(
    request: pytest.FixtureRequest, copy: str, tensor: str
):
    model_dir = request.getfixturevalue(copy)
    _rewrite(model_dir, lambda t: t.pop(tensor))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {tensor} is missing"):
        load_checkpoint(model_dir)


def test_moe_layer_freq_interleaves_dense_layers(v2_copy: Path):
    """DeepSeek's reference code: past first_k_dense_replace, layer i is MoE when i % moe_layer_freq
    == 0."""
    config = json.loads((v2_copy / "config.json").read_text())
    args = model_args(config | {"num_hidden_layers": 6, "moe_layer_freq": 2})
    assert [args.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    (v2_copy / "config.json").write_text(json.dumps(config | {"moe_layer_freq": 0}))
    with pytest.raises(
        CheckpointError, match=r"config\.json: moe_layer_freq: 0 is not a positive integer"
    ):
        load_checkpoint(v2_copy)
