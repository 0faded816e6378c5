"""The worker's config as vLLM engine arguments, and the field's misconfigurations named before vLLM
starts: pure functions, checked here for GPU layouts this machine does not have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infermesh.config import ConfigError
from worker_svc import config as worker_config
from worker_svc.vllm_engine.args import (
    Devices,
    check_known,
    check_mla_head,
    cpu_mla_backend,
    engine_args,
)

H200 = Devices(8, "9.0")
_MLA_MODEL = "models/tiny-deepseek-v3-mla"


def _checkpoint(tmp_path: Path, **overrides: object) -> Path:
    config = {
        "model_type": "deepseek_v3",
        "n_routed_experts": 256,
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "max_position_embeddings": 163840,
        "quantization_config": {"quant_method": "fp8"},
        **overrides,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _config(tmp_path: Path, toml: str, **checkpoint: object) -> worker_config.WorkerConfig:
    path = tmp_path / "worker.toml"
    model = _checkpoint(tmp_path, **checkpoint)
    path.write_text(
        f'[model]\npath = "{model}"\nname = "deepseek-v3"\n[engine]\nkind = "vllm"\n{toml}'
    )
    return worker_config.load(str(path))


def _mla_worker(tmp_path: Path, toml: str) -> worker_config.WorkerConfig:
    """A vLLM worker of the tiny MLA checkpoint, which vLLM's CPU attention runs."""
    path = tmp_path / "worker.toml"
    path.write_text(f'[model]\npath = "{_MLA_MODEL}"\n[engine]\nkind = "vllm"\n{toml}')
    return worker_config.load(str(path))


def test_the_field_s_sections_map_onto_engine_arguments(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "[parallel]\ntensor_parallel_size = 8\nexpert_parallel_size = 8\n"
        "[attention]\nmax_model_len = 32768\n[cache]\ngpu_memory_utilization = 0.85\n"
        '[engine.vllm]\nmax_num_batched_tokens = 8192\nkv_cache_dtype = "fp8"\n',
    )
    args = engine_args(config, H200, "fp8")
    assert args == {
        "model": str(tmp_path),
        "served_model_name": "deepseek-v3",
        "dtype": "bfloat16",
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 1,
        "enable_expert_parallel": True,
        "enable_prefix_caching": True,
        "max_num_seqs": 8,
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.85,
        "max_num_batched_tokens": 8192,
        "kv_cache_dtype": "fp8",
    }


def test_two_nodes_of_eight_gpus(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "[parallel]\ntensor_parallel_size = 8\npipeline_parallel_size = 2\n"
        '[engine.vllm]\nnnodes = 2\nnode_rank = 0\nmaster_addr = "10.0.0.1"\n',
    )
    args = engine_args(config, Devices(8, "9.0"), "fp8")
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"], args["nnodes"]) == (
        8,
        2,
        2,
    )


@pytest.mark.parametrize(
    "toml, devices, message",
    [
        (
            "[quantization]\nuse_native_fp8 = true\n",
            Devices(8, "7.0"),
            "[quantization] use_native_fp8 = true, but this worker runs on cuda 7.0: FP8 needs "
            "compute capability 7.5 or higher for vLLM's FP8 kernels. Unset use_native_fp8",
        ),
        (
            "[quantization]\nuse_native_fp8 = true\n",
            Devices(0),
            "[quantization] use_native_fp8 = true, but this worker runs on cpu: FP8 needs a CPU "
            "with AMX tiles",
        ),
        (
            "[quantization]\nuse_native_fp8 = true\n",
            Devices(8, "9.0", rocm=True),  # MI100 and MI200 are ROCm capability 9.0
            "[quantization] use_native_fp8 = true, but this worker runs on rocm 9.0: FP8 needs an "
            "MI300-class GPU",
        ),
        (
            "[parallel]\ntensor_parallel_size = 6\nexpert_parallel_size = 6\n",
            Devices(8, "9.0"),
            "[parallel] expert_parallel_size (6) does not divide the checkpoint's 256",
        ),
        (
            "[parallel]\ntensor_parallel_size = 8\nexpert_parallel_size = 4\n",
            H200,
            "[parallel] expert_parallel_size (4) must equal tensor_parallel_size (8)",
        ),
        (
            "[parallel]\ntensor_parallel_size = 16\n",
            H200,
            (
                "[parallel] tensor_parallel_size (16) x pipeline_parallel_size (1) = 16 GPUs, but "
                "8 GPU(s) x 1 node(s)"
            ),
        ),
    ],
)
def test_the_field_s_failures_name_the_key_and_the_fix(
    tmp_path: Path, toml: str, devices: Devices, message: str
) -> None:
    config = _config(tmp_path, toml)
    with pytest.raises(ConfigError) as error:
        engine_args(config, devices, "fp8")
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    ("devices", "runs_fp8"),
    [
        (Devices(8, "9.0"), True),  # H100/H200: FP8 GEMMs
        (Devices(8, "8.9"), True),  # L40S
        (Devices(8, "8.0"), True),  # A100: Marlin's weight-only FP8
        (Devices(8, "7.5"), True),  # T4: Marlin too
        (Devices(8, "7.0"), False),  # V100
        (Devices(8, "9.4", rocm=True), True),  # MI300X
        (Devices(8, "9.5", rocm=True), True),  # MI350
        (Devices(8, "9.0", rocm=True), False),  # MI100, MI200
        (Devices(0, cpu_amx=True), True),  # Sapphire Rapids and later
        (Devices(0), False),  # AVX2 or AVX-512 without AMX
    ],
)
def test_where_vllm_runs_fp8(devices: Devices, runs_fp8: bool) -> None:
    assert devices.vllm_fp8 == runs_fp8


def test_use_native_fp8_false_serves_an_fp8_checkpoint_dequantized(tmp_path: Path) -> None:
    """The switch that forces the BF16 branch: no longer a contradiction with an FP8 checkpoint."""
    config = _config(tmp_path, "[quantization]\nuse_native_fp8 = false\n")
    assert engine_args(config, H200, "bf16")["dtype"] == "bfloat16"


@pytest.mark.parametrize("key", ["q_lora_rank", "intermediate_size", "moe_intermediate_size"])
def test_fp8_sizes_vllm_cannot_load_in_blocks_are_named(tmp_path: Path, key: str) -> None:
    """In FP8 a size of part blocks is named before vLLM's child process fails on it; the same
    checkpoint dequantized has no blocks, and DeepSeek-V3's own sizes are whole blocks."""
    block = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    v3 = {"q_lora_rank": 1536, "intermediate_size": 18432, "moe_intermediate_size": 2048}
    config = _config(tmp_path, "", **block, **(v3 | {key: 704}))
    with pytest.raises(ConfigError) as error:
        engine_args(config, H200, "fp8")
    assert str(error.value) == (
        f"[model] path: {tmp_path}'s {key} (704) is not a multiple of its FP8 weight block (128), "
        "which vLLM's FP8 loader needs: serve a dequantized copy ([quantization] "
        "use_native_fp8 = false)"
    )
    assert engine_args(config, H200, "bf16")["dtype"] == "bfloat16"
    assert engine_args(_config(tmp_path, "", **block, **v3), H200, "fp8")["dtype"] == "bfloat16"


def test_a_cpu_cache_without_room_for_one_context(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "[cache]\ncpu_cache_bytes = 1048576\n",
        max_position_embeddings=2048,
        num_hidden_layers=2,
    )
    with pytest.raises(
        ConfigError,
        match=r"\[cache\] cpu_cache_bytes .* raise cpu_cache_bytes or lower "
        r"\[attention\] max_model_len",
    ):
        engine_args(config, Devices(0), "bf16")
    fits = _config(
        tmp_path,
        "[attention]\nmax_model_len = 256\n[cache]\ncpu_cache_bytes = 1048576\n",
        max_position_embeddings=2048,
        num_hidden_layers=2,
    )
    assert engine_args(fits, Devices(0), "bf16")["kv_cache_memory_bytes"] == 1048576


# vLLM's cache check imports torch's inductor, which imports a deprecated torch.jit API
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_cpu_cache_holds_one_context_as_vllm_counts_it(tmp_path: Path) -> None:
    """vLLM's own check, on the config vLLM makes of our arguments: the cache holds the context
    in whole blocks beside the block its pool keeps back, and not a byte more is needed."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.core.kv_cache_utils import check_enough_kv_cache_memory
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    config = _mla_worker(tmp_path, "[attention]\nmax_model_len = 20001\n")  # not whole blocks
    args = engine_args(config, Devices(0), "fp32")
    budget = args["kv_cache_memory_bytes"]
    assert budget > worker_config.MIN_CPU_CACHE_BYTES  # not the floor's
    vllm_config = AsyncEngineArgs(**{**args, "dtype": "float32"}).create_engine_config()
    vllm_config.cache_config.kv_cache_layout = "LBNHC"  # as vLLM's CPU engine core resolves it
    cache = vllm_config.cache_config
    assert cache.block_size == 16  # vLLM's CPU MLA's, as the worker counted
    layers = {
        f"layer{i}": MLAAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=1,
            head_size=vllm_config.model_config.get_head_size(),
            dtype=torch.float32,
        )
        for i in range(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
    }
    check_enough_kv_cache_memory(vllm_config, layers, budget)
    with pytest.raises(ValueError, match="KV cache is needed, which is larger than the available"):
        check_enough_kv_cache_memory(vllm_config, layers, budget - 1)


def test_an_mla_latent_vllm_s_attention_does_not_run_is_refused(tmp_path: Path) -> None:
    narrow = _config(tmp_path, "", kv_lora_rank=160, qk_rope_head_dim=16)
    with pytest.raises(ConfigError) as refused:
        check_mla_head(narrow, "CPU_MLA", [576])
    assert str(refused.value) == (
        f"[model] path: {tmp_path}'s MLA latent is kv_lora_rank 160 + qk_rope_head_dim 16 = 176 "
        "wide, which vLLM's CPU_MLA attention does not run (head sizes 576): serve it with "
        '[engine] kind = "checkpoint", or on hardware whose vLLM attention runs it'
    )
    check_mla_head(_config(tmp_path, ""), "CPU_MLA", [576])  # DeepSeek-V3's 512 + 64


def test_vllm_s_cpu_mla_backend(tmp_path: Path) -> None:
    config = _config(tmp_path, "")
    assert cpu_mla_backend(config, Devices(0), "bf16") == "CPU_MLA"
    amx = Devices(0, cpu_amx=True)
    assert cpu_mla_backend(config, amx, "bf16") == "AMX_MLA"
    assert cpu_mla_backend(config, amx, "fp32") == "CPU_MLA"  # AMX's kernels take BF16 only
    asked = _config(tmp_path, '[engine.vllm]\nattention_backend = "CPU_MLA"\n')
    assert cpu_mla_backend(asked, amx, "bf16") == "CPU_MLA"


def test_on_a_cpu_vllm_rotates_with_its_pytorch_rope(tmp_path: Path) -> None:
    # its CPU RoPE kernel mangles MLA's 3-D q and strided k_pe (tests/e2e/test_vllm.py shows it)
    args = engine_args(_config(tmp_path, "", max_position_embeddings=256), Devices(0), "bf16")
    assert args["compilation_config"] == {"custom_ops": ["-rotary_embedding"]}
    overridden = _config(
        tmp_path,
        '[engine.vllm]\ncompilation_config = {custom_ops = ["none"]}\n',
        max_position_embeddings=256,
    )
    assert engine_args(overridden, Devices(0), "bf16")["compilation_config"] == {
        "custom_ops": ["none"]
    }


def test_on_a_cpu_with_amx_mla_outside_bf16_runs_vllm_s_reference_backend(tmp_path: Path) -> None:
    # vLLM's AMX MLA kernels, its choice wherever AMX is, refuse float32 weights
    config = _config(tmp_path, "", max_position_embeddings=256)
    amx = Devices(0, cpu_amx=True)
    assert engine_args(config, amx, "fp32")["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in engine_args(config, amx, "bf16")
    assert "attention_backend" not in engine_args(config, Devices(0), "fp32")
    chosen = _config(
        tmp_path, '[engine.vllm]\nattention_backend = "AMX_MLA"\n', max_position_embeddings=256
    )
    assert engine_args(chosen, amx, "fp32")["attention_backend"] == "AMX_MLA"


def test_an_unknown_engine_argument_is_named() -> None:
    with pytest.raises(
        ConfigError, match=r"\[engine.vllm\] tensor_paralel_size: not an engine argument"
    ):
        check_known({"tensor_paralel_size": 8}, {"tensor_parallel_size"})


def test_parallel_sizes_need_the_vllm_engine(tmp_path: Path) -> None:
    path = tmp_path / "worker.toml"
    path.write_text("[parallel]\ntensor_parallel_size = 8\n")
    with pytest.raises(
        ConfigError, match=r'\[parallel\] tensor_parallel_size: .* set \[engine\] kind = "vllm"'
    ):
        worker_config.load(str(path))


def test_engine_arguments_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERMESH_WORKER_ENGINE_VLLM", '{"enforce_eager": true}')
    assert _config(tmp_path, "").engine.vllm == {"enforce_eager": True}
    monkeypatch.setenv("INFERMESH_WORKER_ENGINE_VLLM", "enforce_eager")
    with pytest.raises(ConfigError, match="INFERMESH_WORKER_ENGINE_VLLM: expected a JSON object"):
        _config(tmp_path, "")
