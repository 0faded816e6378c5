"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against transformers' DeepseekV32ForCausalLM loading
the same checkpoint files, through the engine's paged cache, and its checkpoints' errors."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from devtools.tiny_model import TINY_DSA
from tests.helpers.hf_reference import transformers_reference
from worker_svc.config import CacheSection, ParallelSection, WorkerConfig
from worker_svc.engine.api import GenerationRequest, SamplingParams
from worker_svc.model.checkpoint import CheckpointError, load_checkpoint
from worker_svc.model.indexer import hadamard_rotate, select_tokens, select_tokens_fp8
from worker_svc.model.kernel import FP8
from worker_svc.model.model import Transformer
from worker_svc.service.registration import worker_info
from worker_svc.torch_engine.engine import Engine
from worker_svc.torch_engine.kv_cache import (
    bytes_per_token,
    index_bytes_per_token,
    latent_bytes_per_token,
)

# FP32 on both sides; observed max |diff| ~4e-6 on logits of magnitude ~3.5.
LOGITS_ATOL = 1e-4
GREEDY_STEPS = 32
TOPK = TINY_DSA["index_topk"]
_WQ_B = "model.layers.1.self_attn.indexer.wq_b.weight"


class Reference(NamedTuple):
    """Our model and transformers' on the same FP32 weights, and transformers' greedy continuation
    of `prompt`."""

    ours: Transformer
    hf: PreTrainedModel
    config: dict[str, Any]
    prompt: torch.Tensor
    greedy: list[int]


def _reference(model_dir: Path) -> Reference:
    ours, config = load_checkpoint(model_dir, torch.float32)
    hf = transformers_reference(model_dir)
    prompt = _prompt(config, 40)  # > index_topk; decoding goes well past it
    return Reference(ours, hf, config, prompt, _hf_greedy(hf, prompt))


@pytest.fixture(scope="module")
def v32_reference(v32_dir: Path) -> Reference:
    return _reference(v32_dir)


@pytest.fixture(scope="module")
def v32_variant_reference(v32_variant_dir: Path) -> Reference:
    return _reference(v32_variant_dir)


@pytest.fixture(params=["v32", "v32_variant"])
def reference(request: pytest.FixtureRequest) -> Reference:
    return request.getfixturevalue(f"{request.param}_reference")


def _prompt(config: dict[str, Any], length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, config["vocab_size"], (1, length), generator=generator)


def _hf_greedy(hf: PreTrainedModel, prompt: torch.Tensor, steps: int = GREEDY_STEPS) -> list[int]:
    with torch.no_grad():
        # the model is a *ForCausalLM typed as PreTrainedModel, which has no generate()
        out = hf.generate(  # type: ignore[operator]
            prompt,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
    return out[0, prompt.size(1) :].tolist()


def test_last_token_logits_match_transformers(reference: Reference):
    ours, hf, config = reference.ours, reference.hf, reference.config
    for length in (1, TOPK, TOPK + 1, 64):
        tokens = _prompt(config, length, seed=length)
        with torch.no_grad():
            expected = hf(tokens).logits[:, -1]
        got = ours(tokens, 0, ours.setup_cache(1, length))
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [[], [7, 13]], ids=["one-prefill", "chunked-prefill"])
def test_greedy_generation_matches_transformers(reference: Reference, chunks: list[int]):
    """A prompt of 40 tokens (> index_topk) and 32 decode steps past it, prefilled whole or in
    pieces."""
    ours, prompt = reference.ours, reference.prompt
    cache = ours.setup_cache(1, prompt.size(1) + GREEDY_STEPS)
    pos = 0
    for end in [*[sum(chunks[: i + 1]) for i in range(len(chunks))], prompt.size(1)]:
        logits = ours(prompt[:, pos:end], pos, cache)
        pos = end
    got = []
    for _ in range(GREEDY_STEPS):
        got.append(int(logits.argmax()))
        logits = ours(torch.tensor([[got[-1]]]), pos, cache)
        pos += 1
    assert got == reference.greedy
    assert len(set(got)) > GREEDY_STEPS // 2, f"degenerate tiny model output {got}"


def test_attention_is_sparse_past_index_topk(v32_dir: Path):
    """Up to index_topk tokens the indexer selects them all (dense attention); past it the output
    changes."""
    sparse, config = load_checkpoint(v32_dir, torch.float32)
    dense, _ = load_checkpoint(v32_dir, torch.float32)
    dense.args.index_topk = 10**6  # the same weights, every token selected
    for length, same in ((TOPK, True), (40, False)):
        tokens = _prompt(config, length, seed=1)
        got = [model(tokens, 0, model.setup_cache(1, length)) for model in (sparse, dense)]
        assert torch.equal(*got) == same, length


def test_cache_holds_the_latent_and_the_indexer_keys(v32_dir: Path):
    model, config = load_checkpoint(v32_dir, torch.float32)
    cache = model.setup_cache(2, 16)
    layers = config["num_hidden_layers"]
    latent, index = (
        layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4,
        layers * config["index_head_dim"] * 4,
    )
    assert latent_bytes_per_token(model.args, torch.float32) == latent
    assert index_bytes_per_token(model.args, torch.float32) == index
    assert cache.nbytes == 32 * bytes_per_token(model.args, torch.float32) == 32 * (latent + index)
    assert cache.index_k.shape == (layers, 32, config["index_head_dim"])


def test_fp8_serving_keeps_the_indexer_projections_in_fp8(v32_dir: Path):
    model, _ = load_checkpoint(v32_dir, FP8)
    indexer = model.layers[1].self_attn.indexer
    assert indexer.wq_b.weight.dtype == indexer.wk.weight.dtype == FP8
    assert indexer.wq_b.weight_scale_inv is not None
    # head weights stay fp32, as the router's
    assert indexer.weights_proj.weight.dtype == torch.float32
    assert indexer.k_norm.weight.dtype == torch.bfloat16
    logits = model(torch.arange(5, 45).unsqueeze(0), 0, model.setup_cache(1, 40))
    assert torch.isfinite(logits).all()


def test_fp8_scoring_selects_nearly_the_exact_tokens():
    """DeepSeek's FP8 indexer scoring (Hadamard, FP8 E4M3 per vector) against the exact scores: the
    same top-k but for the near ties the rounding reorders (observed 98.6% of tokens on these random
    inputs)."""
    generator = torch.Generator().manual_seed(0)
    seqlen, length, heads, dim, topk = 16, 4096, 8, 128, 2048
    q, keys = (
        torch.randn(1, seqlen, heads, dim, generator=generator),
        torch.randn(1, length, dim, generator=generator),
    )
    weights = torch.randn(1, seqlen, heads, generator=generator)
    future = torch.arange(length) > torch.arange(length - seqlen, length).unsqueeze(1)
    mask = torch.zeros(1, seqlen, length).masked_fill_(future, float("-inf"))
    exact = select_tokens(q, weights, keys, mask, topk, dim**-0.5)[0]
    fp8 = select_tokens_fp8(
        hadamard_rotate(q), weights, hadamard_rotate(keys), mask, topk, dim**-0.5
    )[0]
    shared = [
        len(set(a.tolist()) & set(b.tolist())) / topk for a, b in zip(exact, fp8, strict=True)
    ]
    assert 0.97 < sum(shared) / seqlen < 1


async def test_a_batch_with_chunked_prefill_preemption_and_prefix_cache_matches_transformers(
    v32_dir: Path, v32_reference: Reference, caplog: pytest.LogCaptureFixture
):
    """Sequences of different lengths decode in one batch over the paged cache (latent and indexer
    keys), prompts computed 16 tokens per step, the newest preempted and recomputed: each continues
    as alone in HF."""
    per_token = bytes_per_token(v32_reference.ours.args, torch.float32)
    engine = Engine.from_checkpoint(
        v32_dir,
        dtype="float32",
        max_model_len=64,
        parallel=ParallelSection(prefill_chunk_size=16, idle_prefill_chunk_size=16),
        cache=CacheSection(block_size=16, cpu_cache_bytes=80 * per_token),
    )
    params = SamplingParams(temperature=0, max_tokens=20)  # 32 steps are checked alone, above
    prompts = [
        "Hello",
        "Multi-head latent attention caches a compressed latent vector instead of full keys and "
        "values.",
        "The quick brown fox jumps over the lazy dog. "
        "A language model predicts the next token well, one token after another.",
    ]
    try:
        with caplog.at_level(logging.INFO, logger="worker_svc.torch_engine.scheduler"):
            runs = [
                _ids(engine, GenerationRequest(str(i), None, p, params))
                for i, p in enumerate(prompts)
            ]
            results = await asyncio.gather(*runs)
        assert "preempting" in caplog.text
        again = await _ids(engine, GenerationRequest("again", None, prompts[2], params))
        caps = worker_info(WorkerConfig(), engine, "127.0.0.1:1").capabilities
        # what the router is told
        assert (caps.model_type, caps.index_topk) == ("deepseek_v32", TOPK)
    finally:
        await engine.close()
    hf = v32_reference.hf
    lengths = [len(engine.tokenizer.encode(p)) for p in prompts]
    assert lengths[0] < TOPK < lengths[1] < lengths[2]
    for prompt, (ids, _) in zip(prompts, results, strict=True):
        expected = _hf_greedy(hf, torch.tensor([engine.tokenizer.encode(prompt)]), len(ids))
        assert ids == expected and len(ids) > 10, prompt
    # the prefix's latents and indexer keys were reused
    assert again[0] == results[2][0] and again[1] > 0


async def _ids(engine: Engine, request: GenerationRequest) -> tuple[list[int], int]:
    """The generated ids and the cached prompt tokens reported."""
    chunks = [chunk async for chunk in engine.generate(request)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].cached_prompt_tokens


# ---------------------------------------------------------------------------------------- bad input


@pytest.fixture
def v32_copy(v32_dir: Path, tmp_path: Path) -> Path:
    shutil.copytree(v32_dir, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _edit_config(model_dir: Path, **changes) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"index_topk": None}, r"config\.json: index_topk: missing"),
        ({"index_n_heads": None}, r"config\.json: index_n_heads: missing"),
        ({"index_head_dim": None}, r"config\.json: index_head_dim: missing"),
        ({"index_topk": 0}, r"config\.json: index_topk: must be a positive integer, got 0"),
        ({"index_topk": -4}, r"config\.json: index_topk: must be a positive integer, got -4"),
        ({"index_n_heads": "8"}, r"config\.json: .*'index_n_heads' expected int, got str"),
        (
            {"index_head_dim": 8},
            r"config\.json: index_head_dim: 8 is smaller than qk_rope_head_dim 16",
        ),
        (
            {"q_lora_rank": 0},
            r"config\.json: q_lora_rank: deepseek_v32's indexer reads the query latent",
        ),
    ],
    ids=[
        "no-topk",
        "no-heads",
        "no-head-dim",
        "topk-0",
        "topk-negative",
        "heads-string",
        "head-dim-small",
        "no-q-lora",
    ],
)
def test_bad_indexer_config_names_the_field(v32_copy: Path, changes: dict[str, Any], match: str):
    _edit_config(v32_copy, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(v32_copy)


def test_a_v3_config_ignores_indexer_fields(tiny_dir: Path, tmp_path: Path):
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    _edit_config(tmp_path, index_topk=0)
    model, _ = load_checkpoint(tmp_path)
    assert not model.args.sparse and model.layers[0].self_attn.indexer is None


def _rewrite(model_dir: Path, change) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_missing_indexer_tensor_is_named(v32_copy: Path):
    name = "model.layers.0.self_attn.indexer.k_norm.bias"
    _rewrite(v32_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"tensor {name} is missing"):
        load_checkpoint(v32_copy)


def test_wrong_indexer_shape_names_file_and_tensor(v32_copy: Path):
    _rewrite(v32_copy, lambda t: t.update({_WQ_B: t[_WQ_B][:-1].clone()}))
    rows, cols = TINY_DSA["index_n_heads"] * TINY_DSA["index_head_dim"], 192
    match = (
        rf"model\.safetensors: tensor {_WQ_B} has shape \({rows - 1}, {cols}\), "
        rf"expected \({rows}, {cols}\)"
    )
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(v32_copy)


def test_missing_indexer_scale_is_named(v32_copy: Path):
    _rewrite(v32_copy, lambda t: t.pop(_WQ_B + "_scale_inv"))
    with pytest.raises(CheckpointError, match=f"tensor {_WQ_B}_scale_inv is missing"):
        load_checkpoint(v32_copy)
