"""Which dtype should a CPU worker serve in? BF16 vs FP32 GEMM throughput at the model's real shapes.

    .venv/bin/python bench/cpu_dtype.py [--config path/to/config.json ...] [--repeats 20]

For every distinct linear shape of the model (q_a/q_b/kv_a/kv_b/o projections, dense MLP, expert
and shared-expert MLPs, lm_head) and M = 1, 16, 64 tokens, times F.linear in FP32 and in BF16
(median of --repeats runs after warm-up) and prints the per-shape times, and per model and M the
ratio FP32 time / BF16 time over all shapes (> 1: BF16 is faster). It ends with the dtype faster
at M >= 16 for every model (batched decode and prefill chunks; M = 1 can favour BF16 on AVX2 only
through a memory-bound lm_head), what precision.cpu_has_native_bf16() picks, and whether they agree.
Shapes: the tiny checkpoint (models/tiny-deepseek-v3, or its config written on the fly), a
73M-parameter DeepSeek-V3-shaped bench config, and any --config given.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_svc.model import ModelArgs  # noqa: E402
from worker_svc.model_config import model_args  # noqa: E402
from worker_svc.precision import cpu_has_native_bf16  # noqa: E402
from worker_svc.tiny_model import write_tiny_checkpoint  # noqa: E402

TOKENS = (1, 16, 64)
_TINY_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-deepseek-v3"
# 73.8M parameters: 6 layers (1 dense), 16 routed experts (4 active, 4 groups), MLA with q_lora_rank.
BENCH_73M = ModelArgs(vocab_size=32000, dim=512, inter_dim=1024, n_layers=6, n_heads=8, max_seq_len=4096,
                      q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                      moe_inter_dim=256, n_dense_layers=1, n_routed_experts=16, n_shared_experts=1,
                      n_activated_experts=4, n_expert_groups=4, n_limited_groups=2)  # fmt: skip


def linear_shapes(a: ModelArgs) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of each distinct linear layer."""
    shapes = {
        "q_a_proj": (a.q_lora_rank, a.dim),
        "q_b_proj": (a.n_heads * a.qk_head_dim, a.q_lora_rank),
        "kv_a_proj_with_mqa": (a.kv_lora_rank + a.qk_rope_head_dim, a.dim),
        "kv_b_proj": (a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        "o_proj": (a.dim, a.n_heads * a.v_head_dim),
        "dense gate/up": (a.inter_dim, a.dim),
        "dense down": (a.dim, a.inter_dim),
        "expert gate/up": (a.moe_inter_dim, a.dim),
        "expert down": (a.dim, a.moe_inter_dim),
        "shared gate/up": (a.n_shared_experts * a.moe_inter_dim, a.dim),
        "shared down": (a.dim, a.n_shared_experts * a.moe_inter_dim),
        "lm_head": (a.vocab_size, a.dim),
    }
    if not a.q_lora_rank:
        del shapes["q_a_proj"]
        shapes["q_b_proj"] = (a.n_heads * a.qk_head_dim, a.dim)
    return shapes


def time_linear(m: int, n: int, k: int, dtype: torch.dtype, repeats: int) -> float:
    """Median seconds of F.linear([m, k] @ [n, k].T) in dtype."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    for _ in range(3):
        F.linear(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        F.linear(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_model(name: str, args: ModelArgs, repeats: int) -> dict[int, float]:
    """Prints per-shape times; returns M -> FP32 time / BF16 time summed over the shapes."""
    print(f"\n## {name}")
    print(f"{'shape (N x K)':<34}" + "".join(f"{f'M={m} fp32 / bf16 us':>26}" for m in TOKENS))
    totals = {m: [0.0, 0.0] for m in TOKENS}
    for layer, (n, k) in linear_shapes(args).items():
        cells = []
        for m in TOKENS:
            t32, t16 = time_linear(m, n, k, torch.float32, repeats), time_linear(m, n, k, torch.bfloat16, repeats)
            totals[m][0] += t32
            totals[m][1] += t16
            cells.append(f"{t32 * 1e6:9.1f} / {t16 * 1e6:9.1f}")
        print(f"{f'{layer} {n}x{k}':<34}" + "".join(f"{c:>26}" for c in cells))
    ratios = {m: t32 / t16 for m, (t32, t16) in totals.items()}
    print("all shapes, fp32 time / bf16 time: " + ", ".join(f"M={m}: {r:.2f}" for m, r in ratios.items()))
    return ratios


def tiny_args() -> ModelArgs:
    config = _TINY_DIR / "config.json"
    if not config.exists():
        config = write_tiny_checkpoint(tempfile.mkdtemp()) / "config.json"
    return model_args(json.loads(config.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], type=Path, help="an extra config.json")
    parser.add_argument("--repeats", type=int, default=20)
    ns = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    models = {"tiny checkpoint": tiny_args(), "bench 73M": BENCH_73M}
    models |= {str(p): model_args(json.loads(p.read_text())) for p in ns.config}
    ratios = [r for name, args in models.items() for m, r in bench_model(name, args, ns.repeats).items() if m >= 16]
    # M >= 16 decides: batched decode and prefill chunks, where a busy worker spends its GEMM time
    measured = "bf16" if min(ratios) > 1 else "fp32" if max(ratios) < 1 else "mixed"
    rule = "bf16" if cpu_has_native_bf16() else "fp32"
    print(f"\nfaster at M >= 16: {measured}; rule (cpu_has_native_bf16): {rule}; agree: {measured == rule}")


if __name__ == "__main__":
    main()
