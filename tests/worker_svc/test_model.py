"""Our DeepSeek-V3 forward pass against transformers' DeepseekV3ForCausalLM on the same weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from worker_svc.checkpoint import load_checkpoint
from worker_svc.model import Transformer, smoke_run

# FP32 on both sides; observed max |diff| ~3e-6 on logits of magnitude ~3.
LOGITS_ATOL = 1e-4
GREEDY_STEPS = 32


def _hf_model(ours: Transformer, config: dict) -> DeepseekV3ForCausalLM:
    """transformers' model from the same config, holding our dequantized FP32 weights."""
    hf_config = DeepseekV3Config(**{k: v for k, v in config.items() if k != "quantization_config"})
    hf_config._attn_implementation = "eager"
    hf = DeepseekV3ForCausalLM(hf_config).float().eval()
    state = ours.state_dict()
    hf_state = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in state.items() if ".experts." not in k}
    for i in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        p = f"layers.{i}.mlp.experts"
        experts = range(config["n_routed_experts"])
        hf_state[f"model.{p}.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{p}.{e}.gate_proj.weight"], state[f"{p}.{e}.up_proj.weight"]]) for e in experts]
        )
        hf_state[f"model.{p}.down_proj"] = torch.stack([state[f"{p}.{e}.down_proj.weight"] for e in experts])
    hf.load_state_dict(hf_state, strict=True)
    return hf


@pytest.fixture
def models(model_dir: Path) -> tuple[Transformer, DeepseekV3ForCausalLM, dict]:
    ours, config = load_checkpoint(model_dir, torch.float32)
    return ours, _hf_model(ours, config), config


def _prompt(config: dict, length: int = 40, seed: int = 0) -> torch.Tensor:
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


@pytest.mark.parametrize("chunks", [[], [7, 13]], ids=["one-prefill", "chunked-prefill"])
def test_greedy_generation_matches_transformers(models, chunks):
    ours, hf, config = models
    prompt = _prompt(config)
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, do_sample=False,
                               eos_token_id=None, pad_token_id=2)[0, prompt.size(1):].tolist()  # fmt: skip
    got = _greedy(ours, prompt, GREEDY_STEPS, chunks)
    assert got == expected
    assert len(set(got)) > GREEDY_STEPS // 2, f"degenerate tiny model output {got}"


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


def test_model_smoke_run():
    logits = smoke_run()
    assert logits.shape == (1, 512) and torch.isfinite(logits).all()
