"""DeepSeek-V3.2 sparse attention against V3's full MLA (issue #14): step time against context
length.

    .venv/bin/python bench/sparse_attention.py [--contexts 512 2048 3072 4096 8192 16384] \
        [--device cpu]

Two models of the same size, built in memory with the same random weights (the V3.2 one adds each
layer's indexer): 2 layers (one dense, one MoE), hidden 512, 16 MLA heads over a latent of 512 + 64
(DeepSeek-V3's widths), V3.2's indexer with 8 heads of 128 and index_topk 2048 (DeepSeek-V3.2's
topk and head width). 16 MLA heads x (2 x 512 + 64) against 8 x 128 indexer features per cached
token keeps DeepSeek-V3.2's ratio of full attention to indexer work per token (128 x 1088 / 64 x 128
= 17). The cache is filled with random latents and keys up to the context length, so no prefill is
needed to measure a step at 16k tokens. Float32, no autograd, on --device.

Per context length L, the fastest of --repeats (after one warm-up run). On a CPU the time is this
process's CPU time with --threads torch threads (default 1): on a shared machine, wall time mostly
measures the neighbours (a run queue of 8-17 on 2 cores gave 3x differences between identical
runs), CPU time only the work done, still inflated somewhat by the neighbours' use of caches and
memory bandwidth. On CUDA it is wall time around synchronized calls.
- decode: one forward step of --batch sequences at position L (whole model: projections, MoE,
  lm_head);
- prefill: one forward step of a --chunk-token prompt chunk ending at position L (chunked prefill);
- the attention split of one layer for the same queries: V3's full MLA over the L cached tokens,
  V3.2's indexer scoring (select_tokens: linear in L over index_n_heads x index_head_dim per token)
  and its sparse MLA over the selected index_topk tokens (flat past index_topk);
- agreement: the share of the chunk's selected tokens that DeepSeek's FP8 scoring
  (select_tokens_fp8, used where the weights are served in FP8) selects too, on the same random
  queries and keys.
Prints the V3.2 / V3 ratios and the first context lengths where V3.2's decode step and prefill chunk
take under 95% of V3's (smaller differences are within this machine's noise).
Only torch is needed (it runs with plain python3 on a GPU machine with --device cuda).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch
from torch import nn

from worker_svc.model.indexer import (
    hadamard_rotate,
    select_tokens,
    select_tokens_fp8,
    sparse_attend,
)
from worker_svc.model.model import MLA, ModelArgs, Transformer
from worker_svc.model.paged_batch import AttentionGroup, KVCache

V3_ARGS = ModelArgs(
    vocab_size=1024,
    dim=512,
    inter_dim=1536,
    n_layers=2,
    n_heads=16,
    max_seq_len=32768,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    moe_inter_dim=256,
    n_dense_layers=1,
    n_routed_experts=8,
    n_activated_experts=2,
    n_expert_groups=1,
    n_limited_groups=1,
)
V32_ARGS = dataclasses.replace(V3_ARGS, index_topk=2048, index_n_heads=8, index_head_dim=128)
_CHEAPER = 0.95  # V3.2 / V3 time ratio that counts as cheaper


def build(device: torch.device) -> tuple[Transformer, Transformer]:
    """(V3, V3.2) with the same random weights for everything but the indexers."""
    torch.manual_seed(0)
    v32 = Transformer(V32_ARGS)
    for name, p in v32.named_parameters():
        nn.init.normal_(
            p, mean=1.0 if name.endswith("norm.weight") else 0.0, std=p.size(-1) ** -0.5
        )
    v3 = Transformer(V3_ARGS)
    v3.load_state_dict({k: v for k, v in v32.state_dict().items() if ".indexer." not in k})
    return v3.to(device).eval(), v32.to(device).eval()


def filled_cache(model: Transformer, batch: int, length: int) -> KVCache:
    """A cache of `batch` sequences of `length` slots, filled with random latents and indexer
    keys."""
    cache = model.setup_cache(batch, length)
    cache.kv.normal_()
    if cache.index_k is not None:
        cache.index_k.normal_()
    return cache


def fastest_s(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock() - start)
    return min(times[1:])


def step_s(
    model: Transformer,
    cache: KVCache,
    batch: int,
    seqlen: int,
    start: int,
    repeats: int,
    device: torch.device,
) -> float:
    tokens = torch.randint(5, V3_ARGS.vocab_size, (batch, seqlen), device=device)
    return fastest_s(lambda: model(tokens, start, cache), repeats, device)


@torch.inference_mode()
def attention_split_s(
    v32: Transformer,
    cache: KVCache,
    batch: int,
    seqlen: int,
    length: int,
    repeats: int,
    device: torch.device,
) -> tuple[float, float, float, float]:
    """One layer, `batch` x `seqlen` queries ending at position length-1: (full MLA, indexer
    scoring, sparse MLA, FP8 scoring's agreement); all but the first nan where no query sees more
    than index_topk tokens (the model attends densely then)."""
    a, mla = v32.args, v32.layers[0].self_attn
    assert isinstance(mla, MLA) and mla.indexer is not None and cache.index_k is not None
    indexer = mla.indexer
    positions = torch.arange(length - seqlen, length, device=device).expand(batch, seqlen)
    key_slots = torch.arange(batch, device=device).unsqueeze(1) * cache.block_size + torch.arange(
        length, device=device
    )
    group = AttentionGroup.build(0, positions, key_slots)
    query = torch.randn(
        batch * seqlen, a.n_heads, a.kv_lora_rank + a.qk_rope_head_dim, device=device
    )
    q_index = torch.randn(batch, seqlen, a.index_n_heads, a.index_head_dim, device=device)
    weights = torch.randn(batch, seqlen, a.index_n_heads, device=device)
    layer_cache, index_keys = cache.kv[0], cache.index_k[0][key_slots]

    def select() -> torch.Tensor:
        return select_tokens(
            q_index, weights, index_keys, group.mask, a.index_topk, indexer.softmax_scale
        )

    q = query.unflatten(0, (batch, seqlen))
    full = fastest_s(lambda: mla._attend_latent(q, group, layer_cache, None), repeats, device)
    if length <= a.index_topk:
        return full, float("nan"), float("nan"), float("nan")
    selected = select()
    fp8 = select_tokens_fp8(
        hadamard_rotate(q_index),
        weights,
        hadamard_rotate(index_keys),
        group.mask,
        a.index_topk,
        indexer.softmax_scale,
    )
    agreement = (selected.unsqueeze(-1) == fp8.unsqueeze(-2)).any(-1).float().mean().item()
    scoring = fastest_s(select, repeats, device)
    sparse = fastest_s(
        lambda: sparse_attend(
            q, layer_cache, key_slots, group.mask, selected, mla.softmax_scale, a.kv_lora_rank
        ),
        repeats,
        device,
    )
    return full, scoring, sparse, agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument("--batch", type=int, default=1, help="decode batch")
    parser.add_argument(
        "--chunk", type=int, default=64, help="prefill chunk (the engine's default is 256)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    ns = parser.parse_args()
    device = torch.device(ns.device)
    if device.type == "cpu":
        torch.set_num_threads(ns.threads)
    v3, v32 = build(device)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{torch.get_num_threads()} threads"
    )
    print(
        f"torch {torch.__version__}, {device} ({name}), float32; "
        f"index_topk {V32_ARGS.index_topk}, decode batch {ns.batch}, prefill chunk {ns.chunk}"
    )
    print(
        f"{'context':>8} | {'decode ms: V3':>13} {'V3.2':>7} "
        f"{'ratio':>6} | {'prefill chunk ms: V3':>20} "
        f"{'V3.2':>7} {'ratio':>6} | {'1 layer decode ms: full':>23} "
        f"{'indexer':>7} {'sparse':>7} | "
        f"{'1 layer chunk ms: full':>22} {'indexer':>7} {'sparse':>7} | {'FP8 agreement':>13}"
    )
    crossover: dict[str, int] = {}
    for length in ns.contexts:
        row = []
        for model in (v3, v32):
            cache = filled_cache(model, max(ns.batch, 1), length + 1)
            decode = step_s(model, cache, ns.batch, 1, length, ns.repeats, device)
            chunk = step_s(model, cache, 1, ns.chunk, length - ns.chunk, ns.repeats, device)
            row.append((decode, chunk))
        cache = filled_cache(v32, max(ns.batch, 1), length + 1)
        split_decode = attention_split_s(v32, cache, ns.batch, 1, length + 1, ns.repeats, device)
        split_chunk = attention_split_s(v32, cache, 1, ns.chunk, length, ns.repeats, device)
        del cache
        (d3, c3), (d32, c32) = row
        for what, ratio in (("decode step", d32 / d3), ("prefill chunk", c32 / c3)):
            if ratio < _CHEAPER and what not in crossover:
                crossover[what] = length
        ms = [1e3 * t for t in (*split_decode[:3], *split_chunk[:3])]
        print(
            f"{length:>8} | {1e3 * d3:>13.2f} {1e3 * d32:>7.2f} "
            f"{d32 / d3:>6.2f} | {1e3 * c3:>20.1f} "
            f"{1e3 * c32:>7.1f} {c32 / c3:>6.2f} | {ms[0]:>23.3f} {ms[1]:>7.3f} {ms[2]:>7.3f} | "
            f"{ms[3]:>22.1f} {ms[4]:>7.1f} {ms[5]:>7.1f} | {split_chunk[3]:>13.4f}"
        )
    for what in ("decode step", "prefill chunk"):
        at = crossover.get(what)
        print(
            f"V3.2's {what} is cheaper than V3's from context {at} on"
            if at
            else f"V3.2's {what} was not cheaper at any context measured"
        )


if __name__ == "__main__":
    main()
