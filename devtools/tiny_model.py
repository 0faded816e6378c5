"""Write a tiny random DeepSeek-V3 (or V2) checkpoint in exactly the real on-disk format.

    python -m devtools.tiny_model OUT_DIR [--variant | --bench | --v2 | --v2-lite] [--v32]
        [--mla] [--bf16]

config.json with the FP8 quantization_config, model.safetensors with FP8 E4M3 block-quantized
linear weights and float32 `weight_scale_inv` (BF16 embeddings, lm_head, norms and gate, float32
e_score_correction_bias), one MTP layer past num_hidden_layers, a byte-level BPE tokenizer with
DeepSeek's special tokens (tool-call markers included) and chat template, and
generation_config.json. The V3 models have DeepSeek-V3's long context (V3_YARN, V3_CONTEXT), so a
coding agent's first prompt fits; the BPE's 16,384 tokens, trained on the pinned openai package's
sources, compress English and JSON about as DeepSeek's: bench/agent_turns.py's first prompt (an
agent's guide, the project's docs, 15 tool schemas; 55k characters) is 3.09 characters per token
(the guide alone 3.8, the schemas 3.9; the earlier 1,024-token BPE: 1.4). Writing one takes 9-14 s
on a busy two-core machine (11 s with that earlier BPE), the BPE's training about 3 s of it. The
DeepSeek-V2 ones (`--v2`, `--v2-lite`) are BF16 throughout with no quantization_config, no
routing bias and no MTP layer, as DeepSeek-V2, V2.5 and V2-Lite ship. Reproducible: the same call
writes byte-identical files. `--v32` writes a DeepSeek-V3.2 (model_type deepseek_v32) checkpoint
instead: the same model plus each layer's sparse-attention indexer (FP8 wq_b and wk, BF16 k_norm
and weights_proj), with an index_topk small enough that short prompts exercise the sparsity.
`--r1` and `--v31` write reasoning checkpoints of the same model: `<think>` and `</think>` added
to the vocabulary as in DeepSeek's (added tokens, not special: they decode as text), with
DeepSeek-R1's chat template (the generation prompt opens the thinking; earlier turns' thinking
dropped) or DeepSeek-V3.1's (its `thinking` flag opens the thinking, or closes it at once).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from worker_svc.hardware.sizing import is_fp8_linear
from worker_svc.model.kernel import weight_quant
from worker_svc.model.model import ModelArgs, Transformer
from worker_svc.model.model_config import model_args

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT, PAD = "<｜User｜>", "<｜Assistant｜>", "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT]  # ids 0..4: bos 0, eos 1 as in DeepSeek-V3
_SEED = 1234
_BPE_VOCAB_SIZE = 16384
# The BPE's training text besides CORPUS: a pinned, pure-Python package's sources (English
# docstrings about an LLM API, and code), identical on every machine with requirements.txt.
_CORPUS_DISTRIBUTION = "openai"
# DeepSeek-V3's released long context: YaRN over a 4k original context, 163840 positions
V3_CONTEXT = 163840
V3_YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
# the test variant's and DeepSeek-V2's tiny context: a YaRN factor 4 over 512 positions
_TINY_CONTEXT = 2048

# DeepSeek-V3's tool-call markers: a turn's calls are
# CALLS_BEGIN (CALL_BEGIN "function" SEP NAME "\n```json\n" ARGUMENTS "\n```" CALL_END)+ CALLS_END,
# and tool results OUTPUTS_BEGIN (OUTPUT_BEGIN RESULT OUTPUT_END)+ OUTPUTS_END.
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
TOOL_TOKENS = [
    CALLS_BEGIN,
    CALLS_END,
    CALL_BEGIN,
    CALL_END,
    SEP,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    OUTPUT_BEGIN,
    OUTPUT_END,
]
# The reasoning models' think tags: added tokens after the tool markers, as in DeepSeek's vocabulary
THINK, THINK_END = "<think>", "</think>"
# how many tokens a tiny tokenizer adds past the BPE's: the tool markers, then the think tags
_ADDED_TOKENS = (len(TOOL_TOKENS), len(TOOL_TOKENS) + 2)

# DeepSeek-V3's template in its own tool format, with the tool definitions (HF's `tools`) rendered
# into the system prompt as DeepSeek's later releases do. An assistant turn after tool results
# follows OUTPUTS_END directly, as in DeepSeek-V3's template.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% "
    "set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', is_tool=false) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{%- endif %}{%- endfor %}"
    "{%- if tools %}{% set ns.system_prompt = ns.system_prompt + "
    "'\n\n## Tools\nYou have access to the following tools:\n' %}"
    "{%- for tool in tools %}{% set ns.system_prompt = "
    "ns.system_prompt + '\n### ' + tool['function']['name'] + "
    "'\nDescription: ' + (tool['function']['description'] or '') + '\n\nParameters: ' + "
    "(tool['function']['parameters'] | tojson) + '\n' %}{%- endfor %}"
    "{% set ns.system_prompt = ns.system_prompt + '\nIMPORTANT: "
    "ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name\n```json\n"
    "tool_call_arguments\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' %}{%- endif %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.is_tool = false %}{% endif %}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.is_tool = false %}"
    "{%- else %}{{ '<｜Assistant｜>' }}{%- endif %}"
    "{{ message['content'] or '' }}"
    "{%- if message['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{%- for call in message['tool_calls'] %}{%- if not loop.first %}{{ '\n' }}{%- endif %}"
    "{%- set arguments = call['function']['arguments'] %}"
    "{{ '<｜tool▁call▁begin｜>' + (call['type'] or 'function') "
    "+ '<｜tool▁sep｜>' + call['function']['name'] + "
    "'\n```json\n' + (arguments if arguments is string else "
    "arguments | tojson) + '\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor %}{{ '<｜tool▁calls▁end｜>' }}{%- endif %}"
    "{{ '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if ns.is_tool %}{{ '\n' }}{%- else %}{{ "
    "'<｜tool▁outputs▁begin｜>' }}{% set ns.is_tool = true %}{%- endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}{%- endfor %}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{ '<｜Assistant｜>' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token.
Mixture-of-experts layers route every token to a few experts; the router scores each expert.
Multi-head latent attention caches a compressed latent vector instead of full keys and values.
FP8 weights keep one byte per parameter; a float32 scale per 128x128 block restores the range.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
def forward(self, x): return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 3.14159 -1 +1 = < > [ ] { } ( ) ; : ' " / \\ | _ ~
深度求索的模型使用混合专家架构。你好，世界！今天天气很好。我们一起学习机器学习和自然语言处理。
日本語のテキストも少し含めます。こんにちは、お元気ですか。한국어 문장도 있습니다. 안녕하세요.
Émojis and accents: café, naïve, résumé, façade, Straße, Ωμέγα, Привет мир! 🙂🚀🎉👍🏽❤️🔥
"""


# The reasoning checkpoints' chat templates, as DeepSeek-R1's and DeepSeek-V3.1's
# tokenizer_config.json ship them
_TEMPLATES = Path(__file__).parent / "templates"
Reasoning = Literal["r1", "v31"]
REASONING_TEMPLATES: dict[Reasoning, Path] = {
    "r1": _TEMPLATES / "deepseek_r1.jinja",
    "v31": _TEMPLATES / "deepseek_v31.jinja",
}

# DeepSeek-V3's attention head sizes: vLLM's CPU MLA attention serves only a 512 + 64 latent head
# (its nope and value widths may be narrower: 32 matches transformers as well)
MLA_HEAD = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
# vLLM's FP8 loader (0.32) sizes a merged layer's block scales for the sum of its parts, so every
# part but the last must be whole 128-blocks (gate of gate_up, q_a of q_a + kv_a), and its fused MoE
# wants whole blocks of moe_intermediate_size; as in DeepSeek's checkpoints (18432, 2048, 1536)
VLLM_FP8_BLOCKS = {"intermediate_size": 768, "moe_intermediate_size": 256, "q_lora_rank": 256}
# V3.2's indexer in the tiny model: a prompt of 40 tokens already attends to fewer than half of them
TINY_DSA = {"index_topk": 12, "index_n_heads": 8, "index_head_dim": 64}


def tiny_config(
    vocab_size: int,
    *,
    variant: bool = False,
    v32: bool = False,
    mla: bool = False,
    bf16: bool = False,
) -> dict[str, Any]:
    """config.json for the tiny model; `variant`: 3 layers, YaRN, n_group 4, q_lora_rank null
    (kept for `v32`, whose indexer reads the query latent); `v32`: DeepSeek-V3.2 with TINY_DSA's
    indexer; `mla`: DeepSeek's own latent sizes (MLA_HEAD), which vLLM's CPU MLA kernels require,
    and whole FP8 blocks where vLLM's FP8 loader needs them (VLLM_FP8_BLOCKS);
    `bf16`: BF16 weights, no quantization_config (vLLM's CPU FP8 linear kernels need AMX)."""
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 320,  # 2.5 blocks of 128: full and partial FP8 blocks
        "initializer_range": 0.02,
        "intermediate_size": 704,
        "kv_lora_rank": 160,
        "max_position_embeddings": V3_CONTEXT,
        "moe_intermediate_size": 192,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 192,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": dict(V3_YARN),
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 32,
        "vocab_size": vocab_size,
    }
    if variant:
        config.update(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            q_lora_rank=None,
            max_position_embeddings=_TINY_CONTEXT,
            rope_scaling={
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "original_max_position_embeddings": 512,
                "type": "yarn",
            },
        )
    if mla:
        config.update(MLA_HEAD, **VLLM_FP8_BLOCKS)
    if bf16:
        del config["quantization_config"]
    if v32:
        config.update(
            architectures=["DeepseekV32ForCausalLM"],
            model_type="deepseek_v32",
            q_lora_rank=192,
            **TINY_DSA,
        )
    return config


def tiny_v2_config(vocab_size: int, *, lite: bool = False) -> dict[str, Any]:
    """config.json of a tiny DeepSeek-V2: softmax gate, group-limited greedy over 4 groups of 2
    experts, routed_scaling_factor 16, 3 layers, YaRN with DeepSeek-V2's mscale; `lite`: V2-Lite's
    shape (q_lora_rank null, greedy top-k over all experts, routed_scaling_factor 1)."""
    config = tiny_config(vocab_size)
    for key in ("quantization_config", "num_nextn_predict_layers"):
        del config[key]
    config.update(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        num_hidden_layers=3,
        n_shared_experts=2,
        norm_topk_prob=False,
        scoring_func="softmax",
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=16.0,
        aux_loss_alpha=0.001,
        seq_aux=True,
        max_position_embeddings=_TINY_CONTEXT,
        rope_scaling={
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 4.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 512,
            "type": "yarn",
        },
    )
    if lite:
        config.update(
            q_lora_rank=None,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            num_experts_per_tok=3,
            routed_scaling_factor=1.0,
        )
    return config


# ----------------------------------------------------------------------------------- tokenizer


def _corpus_texts() -> list[str]:
    """The embedded corpus (CJK, accents, emoji), its upper/title-cased copies and number runs, then
    _CORPUS_DISTRIBUTION's .py files in their sorted order: the same text on every machine."""
    lines = CORPUS.splitlines()
    numbers = [" ".join(str(i) for i in range(j, j + 40)) for j in range(0, 1200, 40)]
    distribution = importlib.metadata.distribution(_CORPUS_DISTRIBUTION)
    sources = sorted(str(f) for f in distribution.files or [] if f.suffix == ".py")
    package = [Path(str(distribution.locate_file(f))).read_text(encoding="utf-8") for f in sources]
    return (lines + [x.upper() for x in lines] + [x.title() for x in lines]) * 4 + numbers + package


def train_tokenizer(reasoning: bool = False) -> Tokenizer:
    """Byte-level BPE over the corpus: every UTF-8 string encodes; `reasoning`: with the think tags
    after the tool markers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(), trainer=trainer)
    # after the BPE merges, as in DeepSeek's vocabulary (ids 16384..16392 here)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TOOL_TOKENS])
    if reasoning:  # not special, as in DeepSeek's: they decode as text
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, THINK_END)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)]
    )
    return tok


def _tokenizer_config(chat_template: str) -> dict[str, Any]:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": V3_CONTEXT,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# -------------------------------------------------------------------------------------- weights


def _random_state(args: ModelArgs, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """HF-named float32 weights; linear std 1/sqrt(fan_in) so activations stay O(1) and outputs
    vary."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    state = {}
    for key, shape in shapes.items():
        # the added tokens' rows (tool markers, think tags) come last and apart, so every other
        # weight is drawn as before they were added
        added = shape[0] - _BPE_VOCAB_SIZE
        grown = key in ("embed_tokens.weight", "lm_head.weight") and added in _ADDED_TOKENS
        if grown:
            shape = torch.Size([_BPE_VOCAB_SIZE, *shape[1:]])
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif key.endswith("e_score_correction_bias"):
            t = 0.05 * torch.randn(shape, generator=generator)
        elif key == "embed_tokens.weight":
            t = torch.randn(shape, generator=generator)
        else:
            t = torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
        if grown:
            t = torch.cat([t, _added_token_rows(key, added, shape[-1])])
        state["lm_head.weight" if key == "lm_head.weight" else f"model.{key}"] = t
    return state


def _added_token_rows(key: str, added: int, dim: int) -> torch.Tensor:
    """Random embeddings for the added tokens; zero output rows, so their logit (0) is never a
    greedy choice over sixteen thousand random ones: unconstrained outputs are those of the model
    without them (a reasoning checkpoint never closes its thinking unprompted: a thinking budget
    or a grammar does)."""
    if key == "lm_head.weight":
        return torch.zeros(added, dim)
    return torch.randn(
        added, dim, generator=torch.Generator().manual_seed(_SEED + len(TOOL_TOKENS))
    )


def mtp_state(args: ModelArgs, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A few tensors of the multi-token-prediction layer that real checkpoints store past the last
    layer."""
    prefix = f"model.layers.{args.n_layers}"
    return {
        f"{prefix}.enorm.weight": torch.ones(args.dim),
        f"{prefix}.hnorm.weight": torch.ones(args.dim),
        f"{prefix}.eh_proj.weight": torch.randn(args.dim, 2 * args.dim, generator=generator)
        / math.sqrt(2 * args.dim),
        f"{prefix}.shared_head.norm.weight": torch.ones(args.dim),
    }


def _to_checkpoint_format(state: dict[str, torch.Tensor], fp8: bool) -> dict[str, torch.Tensor]:
    """FP8 + scale_inv for the layers' linear weights (if `fp8`), float32 routing bias, BF16 for the
    rest."""
    out = {}
    for name, t in state.items():
        if fp8 and is_fp8_linear(name):
            out[name], out[name + "_scale_inv"] = weight_quant(t)
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    variant: bool = False,
    v32: bool = False,
    mla: bool = False,
    bf16: bool = False,
    reasoning: Reasoning | None = None,
    seed: int = _SEED,
) -> Path:
    """Write the tiny checkpoint (or the YaRN / n_group 4 / 3-layer `variant`; `v32`:
    DeepSeek-V3.2; `mla`: DeepSeek's latent sizes; `bf16`: BF16 weights; `reasoning`: the think
    tags and DeepSeek-R1's or V3.1's chat template) to out_dir."""
    tok = train_tokenizer(reasoning=reasoning is not None)
    config = tiny_config(tok.get_vocab_size(), variant=variant, v32=v32, mla=mla, bf16=bf16)
    template = CHAT_TEMPLATE if reasoning is None else REASONING_TEMPLATES[reasoning].read_text()
    return _write_checkpoint(Path(out_dir), tok, config, seed + variant, template)


def bench_config() -> dict[str, Any]:
    """config.json of the scheduler benchmark's model (issue #3): about 73M parameters, vocab 32000
    (past the tokenizer's 16393 ids, as real checkpoints pad their embeddings), the 2,048-token
    context its figures were measured with."""
    config = tiny_config(32000)
    config.update(
        max_position_embeddings=_TINY_CONTEXT,
        rope_scaling=None,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
    )
    return config


def write_bench_checkpoint(out_dir: str | Path, seed: int = _SEED) -> Path:
    """Write the benchmark checkpoint (`bench_config`) to out_dir; reproducible like the tiny
    one."""
    return _write_checkpoint(Path(out_dir), train_tokenizer(), bench_config(), seed)


def _write_checkpoint(
    out: Path,
    tok: Tokenizer,
    config: dict[str, Any],
    seed: int,
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    args = model_args(config)
    generator = torch.Generator().manual_seed(seed)
    state = _random_state(args, generator)
    if config.get("num_nextn_predict_layers"):
        state |= mtp_state(args, generator)
    return write_checkpoint(out, tok, config, state, chat_template)


def write_checkpoint(
    out: Path,
    tok: Tokenizer,
    config: dict[str, Any],
    state: dict[str, torch.Tensor],
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """The checkpoint's files in out: `state` (HF-named float weights, MTP layer included) in the
    checkpoint's dtypes (FP8 blocks when config has a quantization_config), config.json,
    generation_config.json and the tokenizer with `chat_template` (DeepSeek-V3's with tools)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = _to_checkpoint_format(state, fp8="quantization_config" in config)
    save_file(dict(sorted(tensors.items())), out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file creates it owner-only
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": 0,
            "eos_token_id": 1,
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.95,
        },
    )
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(chat_template))
    return out


def write_variant_checkpoint(out_dir: str | Path) -> Path:
    """The second test config: YaRN rope_scaling, n_group 4 / topk_group 2, 3 layers, q_lora_rank
    null."""
    return write_tiny_checkpoint(out_dir, variant=True)


def write_v2_checkpoint(out_dir: str | Path, *, lite: bool = False) -> Path:
    """A tiny DeepSeek-V2 checkpoint (`tiny_v2_config`), or the V2-Lite-shaped one; reproducible
    like the others."""
    tok = train_tokenizer()
    return _write_checkpoint(
        Path(out_dir), tok, tiny_v2_config(tok.get_vocab_size(), lite=lite), _SEED + 2 + lite
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--variant", action="store_true", help="YaRN, n_group 4, 3 layers, q_lora_rank null"
    )
    kind.add_argument(
        "--bench", action="store_true", help="the ~73M-parameter scheduler benchmark model"
    )
    kind.add_argument(
        "--v2", action="store_true", help="DeepSeek-V2: BF16, softmax gate, group-limited greedy"
    )
    kind.add_argument(
        "--v2-lite", action="store_true", help="DeepSeek-V2-Lite's shape: q_lora_rank null, greedy"
    )
    parser.add_argument(
        "--v32", action="store_true", help="DeepSeek-V3.2: add the sparse-attention indexer"
    )
    parser.add_argument(
        "--mla",
        action="store_true",
        help="DeepSeek's latent sizes (kv_lora_rank 512, qk_rope_head_dim 64), "
        "as vLLM's CPU MLA needs",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="BF16 weights without a quantization_config"
    )
    reasoning = parser.add_mutually_exclusive_group()
    reasoning.add_argument(
        "--r1", action="store_true", help="DeepSeek-R1: the think tags and R1's chat template"
    )
    reasoning.add_argument(
        "--v31",
        action="store_true",
        help="DeepSeek-V3.1: the think tags and V3.1's chat template (its thinking flag)",
    )
    ns = parser.parse_args(argv)
    extras = ns.v32 or ns.mla or ns.bf16 or ns.r1 or ns.v31
    if (ns.bench or ns.v2 or ns.v2_lite) and extras:
        parser.error("--v32, --mla, --bf16, --r1 and --v31 apply to the tiny model and --variant")
    if ns.bench:
        print(write_bench_checkpoint(ns.out_dir))
    elif ns.v2 or ns.v2_lite:
        print(write_v2_checkpoint(ns.out_dir, lite=ns.v2_lite))
    else:
        print(
            write_tiny_checkpoint(
                ns.out_dir,
                variant=ns.variant,
                v32=ns.v32,
                mla=ns.mla,
                bf16=ns.bf16,
                reasoning="r1" if ns.r1 else "v31" if ns.v31 else None,
            )
        )


if __name__ == "__main__":
    main()
