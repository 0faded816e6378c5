"""Our DeepSeek-V3 / V2 forward pass against transformers' DeepseekV3ForCausalLM /
DeepseekV2ForCausalLM, each loading the same checkpoint files its own way."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from devtools.chat_model import CHECKPOINT
from infermesh.text.tokenizer import Tokenizer
from tests.helpers.hf_reference import transformers_reference
from worker_svc.hardware.sizing import model_size
from worker_svc.model import model as model_module
from worker_svc.model.checkpoint import load_checkpoint
from worker_svc.model.kernel import FP8
from worker_svc.model.model import (
    MLA,
    MLP,
    Gate,
    Linear,
    MoE,
    Transformer,
    dense_linear,
    precompute_freqs_cis,
    smoke_run,
)
from worker_svc.torch_engine.kv_cache import bytes_per_token

# FP32 on both sides; observed max |diff| ~3e-6 on logits of magnitude ~3.
LOGITS_ATOL = 1e-4
GREEDY_STEPS = 32
# bf16 (what the policy serves on AVX512-BF16/AMX CPUs) against fp32 on the same weights: observed
# max |diff| 0.8-1.8% of max |logit| on the tiny checkpoints; teacher-forced greedy agreed at 28-32
# of 32 steps, every miss a near-tie in fp32 (gap 0.0001-0.021) or a step where bf16 routed a token
# to other experts (a near-tie of the gate's scores: V2-Lite's logits then differ by 7%, a greedy
# choice by up to 1.7).
BF16_LOGITS_RTOL = 0.03
BF16_GREEDY_STEPS, BF16_GREEDY_AGREEMENT = 32, 0.85
# largest fp32 logit gap between fp32's and bf16's greedy choices where they differ
BF16_NEAR_TIE = 0.05
# FP8 weights on both sides, bf16 compute on both; the FP8 path adds 1x128 activation quantization
# (~2^-4 relative rounding per element): observed max |diff| 4-6% of max |logit| on the tiny
# checkpoint.
FP8_LOGITS_RTOL = 0.1


@pytest.fixture
def models(model_dir: Path) -> tuple[Transformer, PreTrainedModel, dict[str, Any]]:
    ours, config = load_checkpoint(model_dir, torch.float32)
    return ours, transformers_reference(model_dir), config


def _prompt(config: dict[str, Any], length: int = 40, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, config["vocab_size"], (1, length), generator=generator)


def _greedy(model: Transformer, prompt: torch.Tensor, steps: int, chunks: list[int]) -> list[int]:
    """Prefill `prompt` in pieces of the given sizes (rest in one), then decode greedily."""
    cache = model.setup_cache(1, prompt.size(1) + steps)
    pos = 0
    for size in [*chunks, prompt.size(1)]:
        if pos < prompt.size(1):
            logits = model(prompt[:, pos : pos + size], pos, cache)
            pos += prompt[:, pos : pos + size].size(1)
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]]), pos, cache)
        pos += 1
    return out


def test_last_token_logits_match_transformers(models):
    ours, hf, config = models
    for length in (1, 17, 64):
        tokens = _prompt(config, length, seed=length)
        with torch.no_grad():
            expected = hf(tokens).logits[:, -1]
        got = ours(tokens, 0, ours.setup_cache(1, length))
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


def test_a_batch_of_prompts_matches_transformers(models):
    """Three sequences in one forward pass (each in its own cache block) give transformers' batched
    logits."""
    ours, hf, config = models
    tokens = torch.cat([_prompt(config, 24, seed=seed) for seed in (1, 2, 3)])
    with torch.no_grad():
        expected = hf(tokens).logits[:, -1]
    got = ours(tokens, 0, ours.setup_cache(3, 24))
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [[], [7, 13]], ids=["one-prefill", "chunked-prefill"])
def test_greedy_generation_matches_transformers(models, chunks):
    ours, hf, config = models
    prompt = _prompt(config)
    with torch.no_grad():
        expected = hf.generate(
            prompt,
            max_new_tokens=GREEDY_STEPS,
            min_new_tokens=GREEDY_STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )[0, prompt.size(1) :].tolist()
    got = _greedy(ours, prompt, GREEDY_STEPS, chunks)
    assert got == expected
    assert len(set(got)) > GREEDY_STEPS // 2, f"degenerate tiny model output {got}"


def test_the_trained_chat_model_answers_as_transformers_and_ends_its_turn():
    """The stored default chat model (FP8, as served): our greedy answer to a chat prompt rendered
    by the served template is transformers', token for token, through its end of turn."""
    ours, _ = load_checkpoint(CHECKPOINT, torch.float32)
    tokenizer = Tokenizer(CHECKPOINT)
    prompt = torch.tensor([tokenizer.encode_chat([{"role": "user", "content": "Say hello"}])])
    reference = transformers_reference(CHECKPOINT)
    with torch.no_grad():
        answer = reference.generate(
            prompt, max_new_tokens=GREEDY_STEPS, do_sample=False, eos_token_id=1, pad_token_id=2
        )
    expected = answer[0, prompt.size(1) :].tolist()
    assert expected[-1] == tokenizer.eos_token_id
    assert _greedy(ours, prompt, len(expected), []) == expected


def _checkpoint_with_config(model_dir: Path, out: Path, config: dict[str, Any]) -> Path:
    shutil.copytree(model_dir, out)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    "extra",
    [{}, {"attention_factor": 0.9, "truncate": False}],
    ids=["yarn", "yarn-attention_factor-untruncated"],
)
def test_yarn_reads_the_same_from_rope_scaling_and_rope_parameters(
    variant_dir: Path, tmp_path: Path, extra: dict[str, Any]
):
    """transformers >= 5 writes rope_parameters (rope_type, rope_theta inside); older files
    rope_scaling (type) with rope_theta beside it. Either way the engine serves YaRN, as
    transformers does."""
    config = json.loads((variant_dir / "config.json").read_text())
    yarn = {k: v for k, v in config.pop("rope_scaling").items() if k != "type"} | extra
    del config["rope_theta"]
    legacy = config | {"rope_scaling": {"type": "yarn", **yarn}, "rope_theta": 50000.0}
    modern = config | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, **yarn}}
    old, _ = load_checkpoint(
        _checkpoint_with_config(variant_dir, tmp_path / "legacy", legacy), torch.float32
    )
    modern_dir = _checkpoint_with_config(variant_dir, tmp_path / "modern", modern)
    new, new_config = load_checkpoint(modern_dir, torch.float32)
    tokens = _prompt(new_config, 64)
    got = new(tokens, 0, new.setup_cache(1, 64))
    assert torch.equal(got, old(tokens, 0, old.setup_cache(1, 64)))
    with torch.no_grad():
        expected = transformers_reference(modern_dir)(tokens).logits[:, -1]
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
    # without YaRN and that theta the same weights give other logits: what a misread file would
    # serve
    new.freqs_cis = precompute_freqs_cis(
        dataclasses.replace(new.args, rope_type="default", rope_theta=10000.0)
    )
    assert (new(tokens, 0, new.setup_cache(1, 64)) - expected).abs().max() > 100 * LOGITS_ATOL


def test_cache_holds_only_the_latent(tiny_dir: Path):
    model, config = load_checkpoint(tiny_dir)
    cache = model.setup_cache(1, 100)
    per_token_per_layer = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert cache.nbytes == config["num_hidden_layers"] * 100 * per_token_per_layer * 4


def test_bf16_load_runs(tiny_dir: Path):
    model, config = load_checkpoint(tiny_dir, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.layers[1].mlp.gate.weight.dtype == torch.float32  # routing stays fp32
    logits = model(_prompt(config, 8), 0, model.setup_cache(1, 8))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@contextlib.contextmanager
def _expert_choices(model: Transformer) -> Iterator[list[torch.Tensor]]:
    """The experts each MoE gate chose for the last token of the call, one entry per gate call
    while inside (the token whose logits are compared)."""
    calls: list[torch.Tensor] = []
    hooks = [
        gate.register_forward_hook(lambda _m, _i, out: calls.append(out[1][-1].sort()[0]))
        for gate in model.modules()
        if isinstance(gate, Gate)
    ]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def _same_routes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_bf16_logits_stay_within_a_stated_bound_of_fp32(model_dir: Path):
    """Where bf16 routed every token to the experts fp32 chose; a gate near-tie may flip one."""
    fp32, config = load_checkpoint(model_dir, torch.float32)
    bf16, _ = load_checkpoint(model_dir, torch.bfloat16)
    bounded = 0
    for length in (1, 17, 64):
        tokens = _prompt(config, length, seed=length)
        with _expert_choices(fp32) as fp32_routes, _expert_choices(bf16) as bf16_routes:
            expected = fp32(tokens, 0, fp32.setup_cache(1, length))
            got = bf16(tokens, 0, bf16.setup_cache(1, length))
        assert not torch.equal(got, expected)  # bf16 really ran
        if _same_routes(fp32_routes, bf16_routes):
            assert (got - expected).abs().max() <= BF16_LOGITS_RTOL * expected.abs().max(), length
            bounded += 1
    assert bounded >= 2


def test_bf16_greedy_agrees_with_fp32_except_at_near_ties(model_dir: Path):
    """Teacher-forced on fp32's greedy tokens, so one early flip does not decide the rest; a miss
    is a near-tie of the logits or of the gate (the step routed a token to other experts)."""
    fp32, config = load_checkpoint(model_dir, torch.float32)
    bf16, _ = load_checkpoint(model_dir, torch.bfloat16)
    prompt = _prompt(config)
    caches = [model.setup_cache(1, prompt.size(1) + BF16_GREEDY_STEPS) for model in (fp32, bf16)]
    with _expert_choices(fp32) as fp32_routes, _expert_choices(bf16) as bf16_routes:
        expected, got = fp32(prompt, 0, caches[0]), bf16(prompt, 0, caches[1])
    agreed, rerouted = 0, not _same_routes(fp32_routes, bf16_routes)
    for pos in range(prompt.size(1), prompt.size(1) + BF16_GREEDY_STEPS):
        token, bf16_token = int(expected.argmax()), int(got.argmax())
        agreed += token == bf16_token
        assert rerouted or expected[0, token] - expected[0, bf16_token] < BF16_NEAR_TIE, pos
        step = torch.tensor([[token]])
        with _expert_choices(fp32) as fp32_routes, _expert_choices(bf16) as bf16_routes:
            expected, got = fp32(step, pos, caches[0]), bf16(step, pos, caches[1])
        rerouted = not _same_routes(fp32_routes, bf16_routes)
    assert agreed >= BF16_GREEDY_AGREEMENT * BF16_GREEDY_STEPS


def test_model_smoke_run():
    logits = smoke_run()
    assert logits.shape == (1, 512) and torch.isfinite(logits).all()


def test_fp8_weights_match_the_dequantized_path(tiny_dir: Path, caplog: pytest.LogCaptureFixture):
    """The sm90 arithmetic (reference implementation on CPU): FP8 weights + act_quant ->
    fp8_gemm."""
    with caplog.at_level(logging.INFO, logger="worker_svc.model.checkpoint"):
        fp8, config = load_checkpoint(tiny_dir, FP8)
    assert "FP8 linear weights" in caplog.text
    dequantized, _ = load_checkpoint(tiny_dir, torch.bfloat16)
    linears = {name: m for name, m in fp8.named_modules() if isinstance(m, Linear)}
    held = {name for name, m in linears.items() if m.weight_scale_inv is not None}
    # every layer projection except kv_b_proj (absorbed into attention); not lm_head
    assert held == {
        name for name in linears if name.startswith("layers.") and not name.endswith("kv_b_proj")
    }
    for name in held:
        weight = linears[name].weight
        assert weight.dtype == FP8 and weight.nbytes == weight.numel(), name  # one byte per weight
    assert (
        fp8.lm_head.weight.dtype == torch.bfloat16
        and fp8.layers[1].mlp.gate.weight.dtype == torch.float32
    )
    fp8_bytes, bf16_bytes = (
        sum(t.nbytes for t in m.layers.state_dict().values()) for m in (fp8, dequantized)
    )
    assert fp8_bytes < 0.75 * bf16_bytes  # the layers' norms, gates and kv_b_proj stay bf16
    for length in (1, 17, 64):
        tokens = _prompt(config, length, seed=length)
        got = fp8(tokens, 0, fp8.setup_cache(1, length))
        expected = dequantized(tokens, 0, dequantized.setup_cache(1, length))
        assert (got - expected).abs().max() <= FP8_LOGITS_RTOL * expected.abs().max(), length
        assert not torch.equal(got, expected)  # the FP8 path really ran


def test_experts_run_once_per_forward_on_their_grouped_tokens(tiny_dir: Path):
    """Tokens are grouped per expert: one call per expert that got tokens, never one per token."""
    model, config = load_checkpoint(tiny_dir)
    rows_per_call: list[int] = []
    for expert in model.layers[config["first_k_dense_replace"]].mlp.experts:
        expert.register_forward_hook(
            lambda module, args, out: rows_per_call.append(args[0].size(0))
        )
    length = 40
    model(_prompt(config, length), 0, model.setup_cache(1, length))
    assert len(rows_per_call) <= config["n_routed_experts"]
    assert sum(rows_per_call) == length * config["num_experts_per_tok"]


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_dense_linear_matches_f_linear(rows: int):
    """Decode sizes take the weight-left GEMM on a CPU, in output chunks; prefill sizes F.linear."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(5000, 96, generator=generator)  # more output features than one chunk
    torch.testing.assert_close(dense_linear(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_projections_of_one_input_are_packed_into_one_weight(tiny_dir: Path):
    """q_a|kv_a and each MLP's gate|up are one GEMM; the Linears hold views, so the state dict is
    unchanged."""
    model, _ = load_checkpoint(tiny_dir)
    attn, moe = model.layers[0].self_attn, model.layers[1].mlp
    assert isinstance(attn, MLA) and isinstance(moe, MoE)
    mlp = moe.experts[0]
    assert isinstance(mlp, MLP) and attn.wq_kv_a is not None and mlp.gate_up is not None
    assert attn.wq_kv_a.data_ptr() == attn.q_a_proj.weight.data_ptr()
    assert torch.equal(attn.wq_kv_a[attn.q_a_proj.out_features :], attn.kv_a_proj_with_mqa.weight)
    assert torch.equal(mlp.gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up[mlp.gate_proj.out_features :].data_ptr()
    assert mlp.gate_up.grad_fn is None  # no autograd graph keeping the unpacked weights alive
    assert set(model.state_dict()) == set(Transformer(model.args).state_dict())


def test_model_sizes_count_what_the_model_holds(model_dir: Path):
    """The simulated engine's size arithmetic (no torch) against the built model and its BF16
    cache."""
    model, config = load_checkpoint(model_dir)
    sizes = model_size(config)
    assert sizes.params == sum(t.numel() for t in model.state_dict().values())
    assert sizes.kv_bytes_per_token("bf16") == bytes_per_token(model.args, torch.bfloat16)
    assert sizes.fp8_weights == (config["model_type"] == "deepseek_v3")
    dim, experts = config["hidden_size"], config["n_routed_experts"] - config["num_experts_per_tok"]
    moe_layers = sum(isinstance(layer.mlp, MoE) for layer in model.layers)
    idle = (
        moe_layers * experts * 3 * dim * config["moe_intermediate_size"]
        + (config["vocab_size"] - 1) * dim
    )
    assert sizes.active_params == sizes.params - idle  # unchosen experts and other embedding rows


@pytest.mark.parametrize("checkpoint", ["tiny_dir", "v2_lite_dir", "v32_dir"])
def test_expanded_prefill_gives_the_absorbed_logits(request, checkpoint, monkeypatch):
    """Prefill chunks attend over keys and values expanded from the cached latents by default; the
    absorbed form (decode's) gives the same logits: in chunks of 7, 13 and the rest, each reading
    the cached prefix, with queries attending in chunks of 5 (smaller than a prefill chunk). On
    V3.2 (index_topk 12) the first chunk attends densely, the later ones where the indexer selects
    (absorbed either way)."""
    monkeypatch.setattr(model_module, "_QUERY_CHUNK", 5)
    model, config = load_checkpoint(request.getfixturevalue(checkpoint), torch.float32)
    prompt = _prompt(config, 40, seed=4)
    logits = {}
    for absorbed in (False, True):
        model.absorb_prefill = absorbed
        cache = model.setup_cache(1, prompt.size(1))
        logits[absorbed] = [
            model(prompt[:, start:end], start, cache) for start, end in ((0, 7), (7, 20), (20, 40))
        ]
    for expanded, absorbed_logits in zip(logits[False], logits[True], strict=True):
        torch.testing.assert_close(expanded, absorbed_logits, atol=LOGITS_ATOL, rtol=0)
