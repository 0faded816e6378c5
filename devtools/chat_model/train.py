"""Train the default chat model and write it as a DeepSeek-V3 FP8 checkpoint.

    .venv/bin/python -m devtools.chat_model.train [--out devtools/chat_model/checkpoint]

trains it from scratch (fixed seeds; its defaults are the stored checkpoint's recipe: 6,585 steps
of at most 16,384 tokens over 250,000 dialogues), on a CUDA device when there is one, else on the
CPU: 6.5 minutes on an H200 (docs/benchmarks/chat-model-training.md), about six hours on two
quiet cores. The model
is transformers' DeepseekV3ForCausalLM on devtools.tiny_model's config (multi-head latent
attention, a noaux_tc-routed MoE, DeepSeek-V3's YaRN long context) at the sizes of CHAT_SIZES, with
its trained byte-level BPE and DeepSeek's chat and tool templates. It learns from
devtools.chat_model.corpus's dialogues, each rendered by the chat template the mesh serves the
checkpoint with (infermesh.text.tokenizer, the workers' and gateway's renderer), with the loss on
the assistant's tokens only (the tool-call markers and the end of the turn included). The linear
weights the checkpoint stores in FP8 are trained through their FP8 block rounding
(straight-through), so that the stored model is the trained one; the routing bias is balanced as
DeepSeek-V3 does, without an auxiliary loss. Checkpoints are written every --save-every steps, so a
usable model exists early.

Its thinking variant (devtools/chat_model/thinking/, THINKING_CHECKPOINT) thinks briefly when
asked: with --thinking SHARE > 0 the template (CHAT_THINKING_TEMPLATE) opens the thinking with
`<think>` when the request's thinking flag is set (DeepSeek-V3.1's flag; the mesh reads the format
as "deepseek_v3"), the tokenizer adds `<think>` and `</think>` after the tool markers, and that
share of the dialogues end on a turn that writes one sentence of thought, closes it with
`</think>` and answers as the turn does without thinking. --init DIR fine-tunes a stored
checkpoint instead of starting from random weights (the think tags' rows added). The stored
variant is the default checkpoint fine-tuned so (12 minutes on two CPU cores):

    .venv/bin/python -m devtools.chat_model.train --init devtools/chat_model/checkpoint \
        --out devtools/chat_model/thinking --dialogues 20000 --steps 600 --batch-tokens 8192 \
        --lr 6e-4 --thinking 0.5 --render-processes 2 --save-every 100
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import random
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.nn.utils import parametrize
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from devtools.chat_model import CHECKPOINT
from devtools.chat_model.corpus import Dialogue, dialogues
from devtools.tiny_model import (
    CHAT_TEMPLATE,
    THINK,
    THINK_END,
    mtp_state,
    tiny_config,
    train_tokenizer,
    write_checkpoint,
)
from infermesh.text.tokenizer import Tokenizer
from worker_svc.hardware.sizing import is_fp8_linear
from worker_svc.model.kernel import BLOCK_SIZE, FP8, weight_dequant
from worker_svc.model.model_config import model_args

# 256 wide (whole FP8 blocks), two layers (one dense, one MoE of 8 + 1 experts) as the random
# tiny model: the BF16 embeddings and head are 16.8 MB of the 18.6 MB of weights
CHAT_SIZES: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
_SEED = 36
_BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma) for the routing balance
# the tiny model's template, and the thinking opened after the generation prompt when the request's
# `thinking` flag is set (as V3.1's); without it, the same prompts byte for byte
CHAT_THINKING_TEMPLATE = (
    CHAT_TEMPLATE
    + "{% if add_generation_prompt and thinking is defined and thinking %}{{ '"
    + THINK
    + "\n' }}{% endif %}"
)


def chat_config(vocab_size: int) -> dict[str, Any]:
    """config.json of the chat model: the tiny model's, at CHAT_SIZES."""
    return tiny_config(vocab_size) | CHAT_SIZES


# ------------------------------------------------------------------------------- rendering


def render(tok: Tokenizer, dialogue: Dialogue) -> tuple[list[int], list[bool]]:
    """The dialogue's ids as the mesh renders its prompts, and which ids are the assistant's: for
    each assistant turn, the conversation up to it rendered with the generation prompt (what a
    request ends with) is a prefix of the one through it, the rest of which the model writes. A
    dialogue with a thought: its prompt rendered thinking, then the thought, `</think>` and the
    last turn's ids as without thinking, the only ones learnt."""
    messages = [_template_message(m) for m in dialogue.messages]
    tools = dialogue.tools or None
    if dialogue.thought:
        prompt = tok.encode_chat(messages[:-1], tools, thinking=True)
        answer = _full(tok, messages, tools)[len(tok.encode_chat(messages[:-1], tools)) :]
        learnt = tok.encode_rendered(dialogue.thought + THINK_END) + answer
        return prompt + learnt, [False] * len(prompt) + [True] * len(learnt)
    ids = _full(tok, messages, tools)
    learn = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tok.encode_chat(messages[:i], tools)
        through = _full(tok, messages[: i + 1], tools)
        assert through[: len(prompt)] == prompt and ids[: len(through)] == through, dialogue
        learn[len(prompt) : len(through)] = [True] * (len(through) - len(prompt))
    return ids, learn


_renderer: Tokenizer | None = None  # each rendering process's own


def _load_renderer(files: str) -> None:
    global _renderer
    _renderer = Tokenizer(files)


def _render_one(dialogue: Dialogue) -> tuple[list[int], list[bool]]:
    assert _renderer is not None
    return render(_renderer, dialogue)


def render_all(
    files: str, corpus: list[Dialogue], processes: int
) -> list[tuple[list[int], list[bool]]]:
    """Every dialogue rendered (``render``) by the tokenizer in ``files``, in ``processes``
    processes: the chat template takes milliseconds a dialogue."""
    if processes <= 1:
        _load_renderer(files)
        return [_render_one(d) for d in corpus]
    with multiprocessing.get_context("spawn").Pool(
        processes, initializer=_load_renderer, initargs=(files,)
    ) as pool:
        return pool.map(_render_one, corpus, chunksize=256)


def _full(tok: Tokenizer, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    text = tok.hf.apply_chat_template(messages, tools=tools, tokenize=False)
    assert isinstance(text, str)
    return tok.encode_rendered(text)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """As infermesh.text.prompt passes messages on: a turn of only tool calls has no content."""
    if message.get("tool_calls") and not message["content"]:
        return {**message, "content": None}
    return message


# ------------------------------------------------------------------------- FP8 rounding


class FP8Rounded(nn.Module):
    """A weight as the checkpoint stores it: each 128x128 block in FP8 E4M3 times its scale (as
    worker_svc.model.kernel.weight_quant), with the gradient passed straight through. 3-D expert
    stacks round each expert's blocks (their rows are whole blocks)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        cols = weight.shape[-1]
        flat = weight.reshape(-1, cols)
        pad_r, pad_c = -flat.size(0) % BLOCK_SIZE, -cols % BLOCK_SIZE
        padded = nn.functional.pad(flat, (0, pad_c, 0, pad_r))
        sm, sn = padded.size(0) // BLOCK_SIZE, padded.size(1) // BLOCK_SIZE
        blocks = padded.view(sm, BLOCK_SIZE, sn, BLOCK_SIZE)
        scale = (blocks.detach().abs().amax(dim=(1, 3), keepdim=True) / 448.0).clamp(min=1e-12)
        rounded = ((blocks / scale).to(FP8).float() * scale).view_as(padded)
        rounded = rounded[: flat.size(0), :cols].reshape(weight.shape)
        return weight + (rounded - weight).detach()


def round_fp8_weights(model: DeepseekV3ForCausalLM) -> None:
    for name, module in list(model.named_modules()):
        for param in ("weight", "gate_up_proj", "down_proj"):
            value = getattr(module, param, None)
            if not isinstance(value, nn.Parameter):
                continue
            stored = _stored_name(f"{name}.{param}") if param != "weight" else f"{name}.weight"
            if is_fp8_linear(stored):
                parametrize.register_parametrization(module, param, FP8Rounded())


def _stored_name(name: str) -> str:
    """A stacked expert tensor's name as one expert's checkpoint weight (for is_fp8_linear)."""
    return name.replace("experts.gate_up_proj", "experts.0.gate_proj.weight").replace(
        "experts.down_proj", "experts.0.down_proj.weight"
    )


# ------------------------------------------------------------------------------ checkpoint


def checkpoint_state(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's float weights under the checkpoint's names: each MoE layer's stacked experts
    split into experts.{e}.gate_proj / up_proj / down_proj."""
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        key = key.replace(".parametrizations.", ".").replace(".original", "")
        value = value.detach().float().cpu()
        if key.endswith("experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e, stacked in enumerate(value):
                gate, up = stacked.chunk(2, dim=0)
                state[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                state[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif key.endswith("experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            for e, expert in enumerate(value):
                state[f"{prefix}{e}.down_proj.weight"] = expert.contiguous()
        else:
            state[key] = value.contiguous()
    return state


def save(
    model: DeepseekV3ForCausalLM, out: Path, tok: Any, config: dict[str, Any], thinking: bool
) -> None:
    """The checkpoint in out, with the random MTP layer the tiny checkpoints carry (the engine
    and transformers skip it); ``thinking``: with the template that opens the thinking."""
    state = checkpoint_state(model)
    state |= mtp_state(model_args(config), torch.Generator().manual_seed(_SEED))
    write_checkpoint(out, tok, config, state, CHAT_THINKING_TEMPLATE if thinking else CHAT_TEMPLATE)


def load(model: DeepseekV3ForCausalLM, checkpoint: Path) -> None:
    """The weights of a checkpoint ``save`` wrote into the model (``checkpoint_state``'s
    inverse): its FP8 weights dequantized, each MoE layer's experts stacked, its MTP layer left
    out; vocabulary rows the model has past the checkpoint's (new tokens) embed as the mean row
    and score zero in the head."""
    with safe_open(checkpoint / "model.safetensors", "pt") as stored:
        names = set(stored.keys())

        def weight(name: str) -> torch.Tensor:
            value: torch.Tensor = stored.get_tensor(name)
            if f"{name}_scale_inv" in names:
                value = weight_dequant(value, stored.get_tensor(f"{name}_scale_inv"))
            return value.float()

        state: dict[str, torch.Tensor] = {}
        for key, param in model.state_dict().items():
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                prefix, _, stacked = key.rpartition(".")
                parts = ("gate_proj", "up_proj") if stacked == "gate_up_proj" else ("down_proj",)
                value = torch.stack(
                    [
                        torch.cat([weight(f"{prefix}.{e}.{part}.weight") for part in parts])
                        for e in range(len(param))
                    ]
                )
            else:
                value = weight(key)
            added = len(param) - len(value)
            if key == "model.embed_tokens.weight":
                value = torch.cat([value, value.mean(0).expand(added, -1)])
            elif key == "lm_head.weight":
                value = nn.functional.pad(value, (0, 0, 0, added))
            state[key] = value
    model.load_state_dict(state)


# ----------------------------------------------------------------------------------- batches


def batches(
    examples: list[tuple[list[int], list[bool]]], batch_tokens: int, rng: random.Random
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless batches of similar lengths, padded to at most batch_tokens: (ids, labels with
    -100 off the assistant's ids, attention mask)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    groups: list[list[int]] = []
    group: list[int] = []
    for i in order:
        longest = len(examples[i][0])
        if group and longest * (len(group) + 1) > batch_tokens:
            groups.append(group)
            group = []
        group.append(i)
    groups.append(group)
    while True:
        rng.shuffle(groups)
        for g in groups:
            width = max(len(examples[i][0]) for i in g)
            ids = torch.zeros(len(g), width, dtype=torch.long)
            labels = torch.full((len(g), width), -100, dtype=torch.long)
            mask = torch.zeros(len(g), width, dtype=torch.long)
            for row, i in enumerate(g):
                seq, learn = examples[i]
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
                labels[row, : len(seq)] = torch.tensor(
                    [t if on else -100 for t, on in zip(seq, learn, strict=True)]
                )
            yield ids, labels, mask


def assistant_loss(
    model: DeepseekV3ForCausalLM, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of the assistant's ids, the head computed at their positions only (the
    prompts' ids, most of a batch, need none of its 16k-wide rows)."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    targets = labels[:, 1:]
    learn = targets != -100
    logits = model.lm_head(hidden[:, :-1][learn])
    return nn.functional.cross_entropy(logits.float(), targets[learn])


class RoutingBalance:
    """DeepSeek-V3's auxiliary-loss-free balance: after each step, each MoE layer's
    e_score_correction_bias moves by _BIAS_RATE towards the experts that got fewer tokens."""

    def __init__(self, model: DeepseekV3ForCausalLM) -> None:
        self.biases: list[torch.Tensor] = []
        self.loads: dict[int, torch.Tensor] = {}  # tokens per expert, by index into biases
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                self.biases.append(bias)
                layer.mlp.gate.register_forward_hook(partial(self._count, len(self.biases) - 1))

    def _count(
        self, index: int, _gate: nn.Module, _inputs: Any, output: tuple[torch.Tensor, ...]
    ) -> None:
        routed = output[2].flatten()  # the gate returns (logits, weights, expert indices)
        self.loads[index] = torch.bincount(routed, minlength=self.biases[index].numel())

    @torch.no_grad()
    def update(self) -> None:
        for index, load in self.loads.items():
            load = load.float()
            self.biases[index] += _BIAS_RATE * torch.sign(load.mean() - load)
        self.loads.clear()


# -------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CHECKPOINT)
    parser.add_argument("--dialogues", type=int, default=250_000)
    parser.add_argument("--steps", type=int, default=6585)
    parser.add_argument("--batch-tokens", type=int, default=16_384)
    parser.add_argument("--max-len", type=int, default=1280)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--thinking", type=float, default=0.0, help="share of dialogues that think first"
    )
    parser.add_argument("--init", type=Path, help="fine-tune this checkpoint (else random weights)")
    parser.add_argument("--layers", type=int, default=CHAT_SIZES["num_hidden_layers"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--render-processes", type=int, default=os.cpu_count() or 1, help="for the corpus"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument(
        "--stop-at", type=int, help="end after this many of the schedule's --steps (and save)"
    )
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)
    torch.backends.cuda.matmul.allow_tf32 = True  # float32 training; TF32 products on a GPU
    torch.manual_seed(_SEED)
    started = time.monotonic()

    thinking = ns.thinking > 0
    bpe = train_tokenizer(reasoning=thinking)
    config = chat_config(bpe.get_vocab_size()) | {"num_hidden_layers": ns.layers}
    hf_config = {k: v for k, v in config.items() if k != "quantization_config"}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**hf_config))  # float32, as built
    if ns.init:
        load(model, ns.init)
    with tempfile.TemporaryDirectory() as files:
        save(model, Path(files), bpe, config, thinking)  # the files the renderer loads
        rendered_all = render_all(
            files, dialogues(ns.dialogues, _SEED, thinking=ns.thinking), ns.render_processes
        )
    examples = [(ids, learn) for ids, learn in rendered_all if len(ids) <= ns.max_len]
    tokens = sum(len(rendered) for rendered, _ in examples)
    print(
        f"{len(examples)} dialogues, {tokens} tokens, rendered in "
        f"{time.monotonic() - started:.0f} s",
        flush=True,
    )

    model.to(ns.device)
    round_fp8_weights(model)
    balance = RoutingBalance(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "gate.weight" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
        lr=ns.lr,
        betas=(0.9, 0.95),
        fused=True,  # one pass over the 8M embedding and head rows
    )
    peak: float = ns.lr
    steps: int = ns.steps
    warmup = max(1, steps // 30)

    def lr_at(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    stream = batches(examples, ns.batch_tokens, random.Random(_SEED))
    recent: list[float] = []
    for step in range(ns.stop_at or ns.steps):
        ids, labels, mask = (t.to(ns.device) for t in next(stream))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        with parametrize.cached():  # each FP8-rounded weight once per step
            loss = assistant_loss(model, ids, labels, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balance.update()
        recent.append(loss.item())
        if (step + 1) % 10 == 0:
            print(
                f"step {step + 1}/{ns.steps} loss {sum(recent) / len(recent):.4f} "
                f"lr {lr_at(step):.2e} {time.monotonic() - started:.1f} s",
                flush=True,
            )
            recent.clear()
        if (step + 1) % ns.save_every == 0 or step + 1 in (ns.steps, ns.stop_at):
            save(model, ns.out, bpe, config, thinking)
            print(f"saved {ns.out} at step {step + 1}", flush=True)


if __name__ == "__main__":
    main()
