"""worker_svc/hardware/sizing.py and ``python -m infermesh plan``: against the tiny checkpoints'
real tensors (V3, V2, V3.2) and the built models, hand-computed figures, and the published sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from devtools.main import main
from worker_svc.config import DEFAULT_MODEL_PATH
from worker_svc.hardware.sizing import (
    bundled_models,
    checkpoint_tensors,
    fewest_gpus,
    model_size,
    model_size_of,
    read_config_json,
    sequences_that_fit,
)
from worker_svc.model.checkpoint import load_checkpoint
from worker_svc.model.model_config import model_args
from worker_svc.torch_engine.kv_cache import bytes_per_token, index_bytes_per_token

V3_CONFIG = "worker_svc/model/configs/DeepSeek-V3.json"
_V3_INDEX_TOTAL_SIZE = 688_586_727_753  # model.safetensors.index.json "total_size", as published


@pytest.mark.parametrize("checkpoint", ["tiny_dir", "v2_lite_dir", "v32_dir"])
def test_the_tiny_checkpoints_tensors_and_bytes_are_the_arithmetics(checkpoint, request):
    # FP8 V3, BF16 V2-Lite, FP8 V3.2 with its indexer
    model_dir = request.getfixturevalue(checkpoint)
    config = read_config_json(model_dir)
    layers = config["num_hidden_layers"]
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        real = {
            k: f.get_slice(k)
            for k in f.keys()  # noqa: SIM118 # safe_open is not iterable
            if not k.startswith(f"model.layers.{layers}.")
        }  # the MTP layer is not served
        shapes = {k: tuple(s.get_shape()) for k, s in real.items() if not k.endswith("_scale_inv")}
        stored = sum(
            s.get_shape()[0]
            * (s.get_shape()[1] if len(s.get_shape()) > 1 else 1)
            * {"F8_E4M3": 1, "BF16": 2, "F32": 4}[s.get_dtype()]
            for s in real.values()
        )
    assert {t.name: t.shape for t in checkpoint_tensors(config, layers)} == shapes
    size = model_size(config)
    assert size.stored_bytes == stored


def test_v32_sizes_count_the_indexer_as_the_engine_builds_and_caches_it(v32_dir):
    model, config = load_checkpoint(v32_dir)
    size = model_size(config)
    assert (size.model_type, size.index_topk) == ("deepseek_v32", 12)
    assert size.params == sum(t.numel() for t in model.state_dict().values())
    assert (
        size.index_bytes_per_token("bf16")
        == index_bytes_per_token(model.args, torch.bfloat16)
        == 2 * 64 * 2
    )
    assert size.kv_bytes_per_token("bf16") == bytes_per_token(model.args, torch.bfloat16)


def test_the_bundled_configs_are_served_by_the_engine_and_have_the_published_sizes():
    assert set(bundled_models()) == {
        "DeepSeek-V3",
        "DeepSeek-V3.2-Exp",
        "DeepSeek-V2",
        "DeepSeek-V2.5",
        "DeepSeek-V2-Lite",
    }
    for name in bundled_models():
        # raises ModelConfigError for anything the engine does not implement
        model_args(read_config_json(name))
    v32, v2 = model_size_of("DeepSeek-V3.2-Exp"), model_size_of("DeepSeek-V2")
    assert abs(v32.checkpoint_params / 685e9 - 1) < 0.005  # "685B" with the MTP layer
    assert v32.kv_bytes_per_token("bf16") == 61 * (512 + 64 + 128) * 2
    # per layer, the indexer's FP8 wq_b (8192 x 1536) and wk (128 x 7168) with their block scales,
    # BF16 k_norm (weight and bias) and weights_proj (64 x 7168)
    indexer = 8192 * 1536 + 64 * 12 * 4 + 128 * 7168 + 56 * 4 + 2 * 128 * 2 + 64 * 7168 * 2
    assert (
        v32.weight_bytes("fp8") - model_size_of("DeepSeek-V3").weight_bytes("fp8") == 61 * indexer
    )
    assert not v2.fp8_weights and v2.weight_bytes("bf16") == v2.stored_bytes == 2 * v2.params


def test_the_tiny_models_sizes_by_hand():
    config = read_config_json(DEFAULT_MODEL_PATH)
    size, vocab = model_size(config), config["vocab_size"]  # the BPE's 16384 and the tool tokens
    embed_and_head, final_norm = 2 * vocab * 320, 320
    attention = (
        320 * 192
        + 192
        + 192 * 4 * (32 + 16)  # q_a, its norm, q_b
        # kv_a, norm, kv_b, o
        + 320 * (160 + 16)
        + 160
        + 160 * 4 * (32 + 32)
        + 4 * 32 * 320
    )
    dense_layer = 2 * 320 + attention + 3 * 320 * 704
    expert = 3 * 320 * 192
    # gate, bias, routed, shared
    moe_layer = 2 * 320 + attention + 8 * 320 + 8 + 8 * expert + expert
    assert size.params == embed_and_head + final_norm + dense_layer + moe_layer
    # and other embedding rows
    assert size.active_params == size.params - (8 - 2) * expert - (vocab - 1) * 320
    assert size.kv_bytes_per_token("fp8") == size.kv_bytes_per_token("bf16") == 2 * (160 + 16) * 2
    assert size.kv_bytes_per_token("fp32") == 2 * (160 + 16) * 4
    assert size.weight_bytes("bf16") == size.weight_bytes("fp16") == 2 * size.params
    # one byte per layer weight, BF16 embeddings and head, a few scales and BF16 norms and gates
    assert size.params + embed_and_head < size.weight_bytes("fp8")
    assert size.weight_bytes("fp8") < 1.2 * size.params + embed_and_head


def test_deepseek_v3_published_sizes():
    size = model_size(read_config_json(V3_CONFIG))
    assert round(size.params / 1e9) == 671
    assert round(size.active_params / 1e9) == 37  # "37B activated": 36.6B (one embedding row read)
    assert abs(size.checkpoint_params / 685e9 - 1) < 0.005
    assert abs(size.checkpoint_bytes / _V3_INDEX_TOTAL_SIZE - 1) < 0.001
    assert size.kv_bytes_per_token("fp8") == 61 * (512 + 64) * 2
    assert size.weight_bytes("bf16") == 2 * size.params  # dequantized off Hopper: twice the bytes
    assert 1 < size.weight_bytes("bf16") / size.weight_bytes("fp8") < 2.01


def test_deepseek_v3_needs_many_gpus():
    size = model_size(read_config_json(V3_CONFIG))
    fp8, bf16 = size.weight_bytes("fp8"), size.weight_bytes("bf16")
    assert fewest_gpus(fp8, 0, 80 * 10**9) == 10  # 673 GB / 72 GB usable per H100
    assert sequences_that_fit(bf16, 4096 * 70272, 4, 24 * 10**9) == 0  # 4 x 24 GB do not load it
    assert sequences_that_fit(fp8, 4096 * 70272, 8, 141 * 10**9) == (8 * 126.9e9 - fp8) // (
        4096 * 70272
    )


def test_plan_prints_every_kind_and_refuses_bad_input(capsys):
    assert main(["plan", "DeepSeek-V3", "--context", "4096", "--concurrency", "1"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"V100", "A100", "H100", "H200", "H800", "L40S", "MI100"}
    assert rows["H100"][:4] == ["fp8", "673.2", "70272", "10"]
    assert rows["A100"][:4] == ["bf16", "1342.1", "70272", "19"]
    assert main(["plan", "DeepSeek-V3", "--gpu", "L40S", "--count", "4"]) == 0
    assert "4 x 48 GB do not load the weights" in capsys.readouterr().out
    for bad in (["--gpu", "RTX9090"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", "DeepSeek-V3", *bad])
        assert exit_.value.code != 0 and "plan:" in str(exit_.value.code)
    with pytest.raises(SystemExit, match="not found"):
        main(["plan", "/nonexistent"])


def test_plan_serves_bf16_checkpoints_in_bf16_and_counts_the_indexers_keys(capsys):
    assert (
        main(
            [
                "plan",
                "DeepSeek-V2-Lite",
                "--gpu",
                "H100,A100",
                "--context",
                "4096",
                "--concurrency",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["H100"][:4] == rows["A100"][:4] == ["bf16", "31.4", str(27 * 576 * 2), "1"]
    assert "GB in BF16" in out and "MTP" not in out
    assert (
        main(
            [
                "plan",
                "DeepSeek-V3.2-Exp",
                "--gpu",
                "H200",
                "--context",
                "4096",
                "--concurrency",
                "1",
            ]
        )
        == 0
    )
    assert _rows(capsys.readouterr().out)["H200"][:3] == ["fp8", "674.0", str(61 * (576 + 128) * 2)]


def _rows(out: str) -> dict[str, list[str]]:
    """plan's table: GPU kind -> its cells."""
    return {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.splitlines()
        if line.startswith("| ") and "GPU" not in line
    }


def test_plan_compares_with_the_size_a_checkpoints_index_states(tmp_path, capsys):
    (tmp_path / "config.json").write_text(Path(V3_CONFIG).read_text())
    (tmp_path / "model.safetensors.index.json").write_text(
        f'{{"metadata": {{"total_size": {_V3_INDEX_TOTAL_SIZE}}}, "weight_map": {{}}}}'
    )
    assert main(["plan", str(tmp_path), "--gpu", "H200"]) == 0
    assert (
        "index states 688.6 GB; the arithmetic above counts 688.5 GB (-0.02%)"
        in capsys.readouterr().out
    )
