"""Which dtype should a CPU worker serve in? The model's linear layers per forward pass, FP32 vs
BF16.

    .venv/bin/python bench/cpu_dtype.py [--config path/to/config.json ...] [--repeats 20] \
        [--cpu-time]

Times the engine's own GEMM (model.dense_linear: the weight-left GEMM for FP32 decode sizes,
F.linear otherwise) on every linear layer of one forward pass as the engine runs it: q_a|kv_a and
gate|up packed, the MoE experts each on their share of the tokens (tokens * experts_per_tok /
n_routed_experts rows, on as many experts as get tokens), lm_head on one row per sequence; each
layer kind times its layer count. The router and attention are left out (the router is FP32 in both;
attention is not a linear layer). Median of --repeats runs per GEMM after warm-up, in wall time;
with --cpu-time, on one thread in that thread's CPU time, which does not count the time other
processes hold the core (for a shared machine).

Forward passes: decode steps of B = 1..64 sequences (B tokens) and one prefill chunk of 256 tokens
(ParallelSection.prefill_chunk_size) of one sequence. Per model it prints each pass's FP32 and BF16
time and their ratio (> 1: BF16 faster), then the verdict on a serving mix: as many tokens generated
at each decode batch size (a worker's batch follows its load, up to max_parallel 32 on a CPU, 64
past it) and as many prompt tokens, in 256-token chunks, as generated tokens. It ends with the dtype
that serves that mix faster on every model, what the policy (precision.cpu_has_native_bf16) picks,
and whether they agree.
Models: the tiny checkpoint, the ~73M benchmark checkpoint (tiny_model.bench_config) and any
--config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import cache
from pathlib import Path

import torch

from devtools.tiny_model import bench_config, tiny_config
from worker_svc.model.model import ModelArgs, dense_linear
from worker_svc.model.model_config import model_args
from worker_svc.model.precision import cpu_has_native_bf16

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_CHUNK = 256
DTYPES = (torch.float32, torch.bfloat16)


def forward_gemms(a: ModelArgs, tokens: int, sequences: int) -> list[tuple[int, int, int, int]]:
    """(rows, out_features, in_features, calls) of every linear layer in one forward pass of
    `tokens` tokens."""
    moe_layers = a.n_layers - a.n_dense_layers
    first_q = a.q_lora_rank if a.q_lora_rank else a.n_heads * a.qk_head_dim
    routed = tokens * a.n_activated_experts
    gemms = [
        # q_a|kv_a (or q|kv_a)
        (tokens, first_q + a.kv_lora_rank + a.qk_rope_head_dim, a.dim, a.n_layers),
        (tokens, a.dim, a.n_heads * a.v_head_dim, a.n_layers),  # o_proj
        (tokens, 2 * a.inter_dim, a.dim, a.n_dense_layers),  # dense gate|up
        (tokens, a.dim, a.inter_dim, a.n_dense_layers),  # dense down
        (tokens, 2 * a.n_shared_experts * a.moe_inter_dim, a.dim, moe_layers),  # shared gate|up
        (tokens, a.dim, a.n_shared_experts * a.moe_inter_dim, moe_layers),  # shared down
        (
            -(-routed // a.n_routed_experts),
            2 * a.moe_inter_dim,
            a.dim,
            moe_layers * min(a.n_routed_experts, routed),
        ),
        (
            -(-routed // a.n_routed_experts),
            a.dim,
            a.moe_inter_dim,
            moe_layers * min(a.n_routed_experts, routed),
        ),
        (sequences, a.vocab_size, a.dim, 1),  # lm_head on each sequence's last token
    ]
    if a.q_lora_rank:
        gemms.append((tokens, a.n_heads * a.qk_head_dim, a.q_lora_rank, a.n_layers))  # q_b
    return [g for g in gemms if g[3] > 0]


_clock = time.perf_counter  # main() sets time.thread_time for --cpu-time


@cache
def time_gemm(
    rows: int, out_features: int, in_features: int, dtype: torch.dtype, repeats: int
) -> float:
    """Median seconds of the engine's dense_linear([rows, in] -> [rows, out]) in dtype."""
    x, w = (
        torch.randn(rows, in_features, dtype=dtype),
        torch.randn(out_features, in_features, dtype=dtype),
    )
    for _ in range(3):
        dense_linear(x, w)
    times = []
    for _ in range(repeats):
        start = _clock()
        dense_linear(x, w)
        times.append(_clock() - start)
    return statistics.median(times)


def forward_time(
    a: ModelArgs, tokens: int, sequences: int, dtype: torch.dtype, repeats: int
) -> float:
    gemms = forward_gemms(a, tokens, sequences)
    return sum(calls * time_gemm(rows, n, k, dtype, repeats) for rows, n, k, calls in gemms)


def bench_model(name: str, a: ModelArgs, repeats: int) -> float:
    """Prints each forward pass's times; returns the serving mix's FP32 time / BF16 time."""
    print(f"\n## {name}")
    print(f"{'forward pass':<22}{'fp32 ms':>10}{'bf16 ms':>10}{'fp32/bf16':>11}")
    per_token = dict.fromkeys(DTYPES, 0.0)  # the mix: seconds per generated token
    passes = [(f"decode B={b}", b, b) for b in DECODE_BATCHES] + [
        (f"prefill {PREFILL_CHUNK}", PREFILL_CHUNK, 1)
    ]
    for label, tokens, sequences in passes:
        t32, t16 = (forward_time(a, tokens, sequences, dtype, repeats) for dtype in DTYPES)
        print(f"{label:<22}{t32 * 1e3:>10.3f}{t16 * 1e3:>10.3f}{t32 / t16:>11.2f}")
        share = 1 / len(DECODE_BATCHES) if label.startswith("decode") else 1.0
        per_token[torch.float32] += share * t32 / tokens
        per_token[torch.bfloat16] += share * t16 / tokens
    ratio = per_token[torch.float32] / per_token[torch.bfloat16]
    print(
        f"serving mix, per generated token: fp32 {per_token[torch.float32] * 1e3:.3f} ms, "
        f"bf16 {per_token[torch.bfloat16] * 1e3:.3f} ms, fp32/bf16 {ratio:.2f}"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", action="append", default=[], type=Path, help="an extra config.json"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--cpu-time", action="store_true", help="one thread, timed in its own CPU time"
    )
    ns = parser.parse_args()
    torch.manual_seed(0)
    if ns.cpu_time:
        global _clock
        _clock = time.thread_time
        torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {_clock.__name__}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"native bf16 {cpu_has_native_bf16()}"
    )
    models = {
        "tiny checkpoint": model_args(tiny_config(1024)),
        "bench 73M": model_args(bench_config()),
    }
    models |= {str(p): model_args(json.loads(p.read_text())) for p in ns.config}
    ratios = [bench_model(name, args, ns.repeats) for name, args in models.items()]
    measured = "bf16" if min(ratios) > 1 else "fp32" if max(ratios) < 1 else "mixed"
    rule = "bf16" if cpu_has_native_bf16() else "fp32"
    print(
        f"\nserving mix faster in: {measured}; rule "
        f"(cpu_has_native_bf16): {rule}; agree: {measured == rule}"
    )


if __name__ == "__main__":
    main()
