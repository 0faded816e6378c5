"""The sm90 FP8 path against the BF16 path, on a Hopper GPU (H100/H200/H800): error and GEMM time.

    .venv/bin/python bench/fp8_hopper.py            # on the GPU machine
    .venv/bin/python bench/fp8_hopper.py --dry-run  # on a CPU: the reference GEMM, small M, \
        meaningless times

1. Correctness, printed as relative errors ||y - y_ref|| / ||y_ref||:
   - random FP8 weights of DeepSeek-V3 shapes (N x K: 7168x2048 expert down, 2048x7168 expert
     gate/up, 7168x18432 dense down; plus 2048x1408, whose K/128 = 11 needs the scale padding):
     native fp8_gemm vs kernel.py's reference on the same quantized inputs (must agree: exit 1 if
     not), and the FP8 linear (act_quant -> fp8_gemm) vs BF16 F.linear with the dequantized weight;
   - the tiny checkpoint: last-token logits of the FP8 model on the GPU vs the dequantized BF16
     model on the GPU, and vs the FP8 model on the CPU (reference GEMM).
2. Time, with CUDA events around --iters replays of a CUDA graph of one call, at M = 1, 64, 512,
   4096: BF16 F.linear vs fp8_gemm on pre-quantized activations, and vs the whole FP8 linear
   including act_quant. Target: FP8 >= 1.5x BF16 at M >= 64.
Without a CUDA sm90 device that runs torch's block-wise scaled_mm it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from devtools.tiny_model import write_tiny_checkpoint
from worker_svc.model.checkpoint import load_checkpoint
from worker_svc.model.kernel import (
    FP8,
    GemmImpl,
    act_quant,
    fp8_gemm,
    fp8_linear,
    native_fp8_gemm_available,
    weight_dequant,
    weight_quant,
)

SHAPES = [(7168, 2048), (2048, 7168), (7168, 18432), (2048, 1408)]  # (N, K) = (out, in)
TOKENS = (1, 64, 512, 4096)
# same quantized inputs, FP32 accumulation on both: only summation order differs
_NATIVE_VS_REFERENCE_MAX = 1e-3
_TARGET_SPEEDUP = 1.5
_TINY_DIR = Path(__file__).resolve().parents[1] / "models" / "tiny-deepseek-v3"


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def random_fp8_weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device).manual_seed(n * 31 + k)
    return weight_quant(torch.randn(n, k, device=device, generator=generator) / k**0.5)


def check_shapes(device: torch.device, impl: GemmImpl) -> bool:
    """Prints the error table for random weights; False if native and reference GEMMs disagree."""
    print(f"\n## Relative error, random FP8 weights, M = 64 tokens ({impl} GEMM)")
    print(f"{'N x K':<14}{'native vs reference':>22}{'FP8 vs BF16 linear':>22}")
    ok = True
    for n, k in SHAPES:
        w_fp8, w_scale = random_fp8_weight(n, k, device)
        x = torch.randn(64, k, device=device, dtype=torch.bfloat16)
        x_fp8, x_scale = act_quant(x)
        try:
            native = fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, out_dtype=torch.float32, impl=impl)
            reference = fp8_gemm(
                x_fp8, x_scale, w_fp8, w_scale, out_dtype=torch.float32, impl="reference"
            )
            kernel_error = rel_error(native, reference)
            linear_error = rel_error(
                fp8_linear(x, w_fp8, w_scale),
                F.linear(x, weight_dequant(w_fp8, w_scale).bfloat16()),
            )
        except Exception as e:  # one failing shape must not hide the others' figures
            print(f"{f'{n}x{k}':<14}  FAILED: {type(e).__name__}: {e}")
            ok = False
            continue
        ok &= kernel_error <= _NATIVE_VS_REFERENCE_MAX
        print(f"{f'{n}x{k}':<14}{kernel_error:>22.2e}{linear_error:>22.2e}")
    return ok


def check_tiny_checkpoint(device: torch.device) -> None:
    model_dir = (
        _TINY_DIR
        if (_TINY_DIR / "config.json").exists()
        else write_tiny_checkpoint(tempfile.mkdtemp())
    )
    fp8, config = load_checkpoint(model_dir, FP8, device)
    bf16, _ = load_checkpoint(model_dir, torch.bfloat16, device)
    fp8_cpu, _ = load_checkpoint(model_dir, FP8, "cpu")
    print(f"\n## Tiny checkpoint ({model_dir}): last-token logits, relative error")
    print(f"{'prompt tokens':<15}{'FP8 vs BF16':>14}{f'FP8 {device.type} vs FP8 cpu':>24}")
    for length in (1, 17, 64):
        tokens = torch.randint(
            5, config["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length)
        )
        logits = {
            name: m(tokens.to(m.lm_head.weight.device), 0, m.setup_cache(1, length)).cpu()
            for name, m in (("fp8", fp8), ("bf16", bf16), ("fp8_cpu", fp8_cpu))
        }
        print(
            f"{length:<15}{rel_error(logits['fp8'], logits['bf16']):>14.2e}"
            f"{rel_error(logits['fp8'], logits['fp8_cpu']):>24.2e}"
        )


def time_s(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds per call: on CUDA, one call captured in a CUDA graph and replayed `iters` times
    between CUDA events, so Python and launch overhead do not mask small GEMMs; wall clock on a
    CPU."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up on a side stream, as graph capture requires
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3 / iters


def time_shapes(device: torch.device, impl: GemmImpl, tokens: tuple[int, ...], iters: int) -> None:
    print(
        f"\n## GEMM time, microseconds (speedup = BF16 time "
        f"/ FP8 time; target >= {_TARGET_SPEEDUP} at M >= 64)"
    )
    print(
        f"{'N x K':<14}{'M':>6}{'BF16':>10}{'FP8 gemm':>10}{'speedup':>9}"
        f"{'FP8+quant':>11}{'speedup':>9}  target"
    )
    for n, k in SHAPES:
        w_fp8, w_scale = random_fp8_weight(n, k, device)
        w_bf16 = weight_dequant(w_fp8, w_scale).bfloat16()
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            x_fp8, x_scale = act_quant(x)
            try:
                t_bf16 = time_s(partial(F.linear, x, w_bf16), device, iters)
                gemm = partial(fp8_gemm, x_fp8, x_scale, w_fp8, w_scale, impl=impl)
                t_gemm = time_s(gemm, device, iters)
                t_linear = time_s(partial(fp8_linear, x, w_fp8, w_scale), device, iters)
            except Exception as e:
                print(f"{f'{n}x{k}':<14}{m:>6}  FAILED: {type(e).__name__}: {e}")
                continue
            verdict = "" if m < 64 else "met" if t_bf16 / t_gemm >= _TARGET_SPEEDUP else "MISSED"
            print(
                f"{f'{n}x{k}':<14}{m:>6}{t_bf16 * 1e6:>10.1f}"
                f"{t_gemm * 1e6:>10.1f}{t_bf16 / t_gemm:>9.2f}"
                f"{t_linear * 1e6:>11.1f}{t_bf16 / t_linear:>9.2f}  {verdict}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--dry-run", action="store_true", help="check this script on a CPU: reference GEMM, M <= 64"
    )
    ns = parser.parse_args()
    torch.manual_seed(0)
    impl: GemmImpl
    tokens: tuple[int, ...]
    if ns.dry_run:
        device, impl, tokens, iters = torch.device("cpu"), "reference", (1, 64), 2
        print("DRY RUN on the CPU with the reference GEMM: the figures say nothing about Hopper")
    else:
        device, impl, tokens, iters = torch.device("cuda"), "native", TOKENS, ns.iters
        if not torch.cuda.is_available() or not native_fp8_gemm_available(device):
            found = (
                torch.cuda.get_device_name()
                + f" (sm{''.join(map(str, torch.cuda.get_device_capability()))})"
                if torch.cuda.is_available()
                else "no CUDA device"
            )
            print(
                f"No CUDA sm90 device with torch's block-wise FP8 "
                f"GEMM here ({found}; torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}). This check needs an H100/H200/H800; nothing measured."
            )
            return 0
        print(
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    ok = check_shapes(device, impl)
    check_tiny_checkpoint(device)
    time_shapes(device, impl, tokens, iters)
    if not ok:
        print(
            f"\nFAIL: the native GEMM disagrees with the reference "
            f"beyond {_NATIVE_VS_REFERENCE_MAX:g} (or failed)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
