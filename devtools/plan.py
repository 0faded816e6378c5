"""``python -m infermesh plan MODEL``: what a deployment of a checkpoint needs, per GPU kind,
before any GPU is rented (worker_svc/hardware/sizing.py's arithmetic on config.json alone).

MODEL is a checkpoint directory, its config.json, or a bundled config by name
(``DeepSeek-V3``, ``DeepSeek-V2-Lite``...: worker_svc/model/configs/). With ``--workers N``, the
prefill:decode split of N workers of each kind for a workload of ``--prompt-tokens`` and
``--output-tokens`` (devtools/pd_split.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from devtools.pd_split import pd_split
from worker_svc.hardware.gpu_profiles import GpuProfile, gpu_profiles
from worker_svc.hardware.sizing import (
    DEFAULT_UTILIZATION,
    ModelSize,
    SizingError,
    bundled_models,
    fewest_gpus,
    index_total_size,
    model_size_of,
    sequences_that_fit,
    serving_profile,
)
from worker_svc.sim_engine.roofline import Roofline

_GB = 1e9


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = commands.add_parser("plan", help="memory and GPUs a checkpoint needs, per GPU kind")
    plan.add_argument(
        "model",
        help="checkpoint directory, config.json, or a bundled name "
        f"({', '.join(bundled_models())})",
    )
    plan.add_argument(
        "--gpu",
        default="",
        help="GPU kinds, comma-separated (default: every kind "
        f"of gpu_profiles.toml: {', '.join(gpu_profiles())})",
    )
    plan.add_argument(
        "--context", type=int, default=8192, help="tokens per sequence (prompt + output)"
    )
    plan.add_argument("--concurrency", type=int, default=16, help="sequences served at once")
    plan.add_argument(
        "--count",
        type=int,
        default=0,
        help="GPUs per worker for the 'sequences that fit' column (default: the fewest)",
    )
    plan.add_argument(
        "--utilization",
        type=float,
        default=DEFAULT_UTILIZATION,
        help="share of GPU memory for weights and KV cache",
    )
    split = plan.add_argument_group(
        "prefill:decode split (with --workers): prefill compute against decode bandwidth"
    )
    split.add_argument(
        "--workers", type=int, default=0, help="workers of each kind to split (>= 2; 0: no split)"
    )
    split.add_argument(
        "--prompt-tokens", type=int, default=8000, help="a request's uncached prompt tokens"
    )
    split.add_argument("--output-tokens", type=int, default=500, help="a request's output tokens")
    split.add_argument(
        "--max-parallel", type=int, default=32, help="sequences a decode worker runs at once"
    )
    split.add_argument(
        "--attention-flops-per-key",
        type=float,
        default=None,
        help="FLOPs of one query attending to one cached token, all layers (default: the "
        "model config's MLA attention; 0: weights only)",
    )


@dataclass(frozen=True)
class KindPlan:
    """What one GPU kind needs for a model."""

    kind: str
    precision: str
    weight_bytes: int
    kv_bytes_per_token: int
    fewest_gpus: int
    gpus: int  # the count the next column is for
    sequences: int  # concurrent sequences of the context that fit on `gpus`


def plan_kind(
    size: ModelSize,
    profile: GpuProfile,
    context: int,
    concurrency: int,
    count: int = 0,
    utilization: float = DEFAULT_UTILIZATION,
) -> KindPlan:
    profile = serving_profile(profile, size)
    weights = size.weight_bytes(profile.precision)
    per_token = size.kv_bytes_per_token(profile.precision)
    fewest = fewest_gpus(
        weights, per_token * context * concurrency, profile.memory_bytes, utilization
    )
    gpus = count or fewest
    return KindPlan(
        profile.name,
        profile.precision,
        weights,
        per_token,
        fewest,
        gpus,
        sequences_that_fit(weights, per_token * context, gpus, profile.memory_bytes, utilization),
    )


def run(args: argparse.Namespace) -> int:
    if args.context < 1 or args.concurrency < 1 or args.count < 0 or not 0 < args.utilization <= 1:
        raise SystemExit(
            "plan: need --context >= 1, --concurrency >= 1, --count >= 0, 0 < --utilization <= 1"
        )
    if args.workers and (
        args.workers < 2
        or min(args.prompt_tokens, args.output_tokens, args.max_parallel) < 1
        or (args.attention_flops_per_key or 0) < 0
    ):
        raise SystemExit(
            "plan: a split needs --workers >= 2, --prompt-tokens, --output-tokens and "
            "--max-parallel >= 1, --attention-flops-per-key >= 0"
        )
    profiles = gpu_profiles()
    kinds = [k.strip() for k in args.gpu.split(",") if k.strip()] or list(profiles)
    unknown = [k for k in kinds if k not in profiles]
    if unknown:
        raise SystemExit(f"plan: unknown GPU kind {unknown[0]!r}; known: {', '.join(profiles)}")
    try:
        size = model_size_of(args.model)
    except SizingError as e:
        raise SystemExit(f"plan: {e}") from None
    plans = [
        plan_kind(size, profiles[k], args.context, args.concurrency, args.count, args.utilization)
        for k in kinds
    ]
    print(render(size, plans, args))
    if args.workers:
        print("\n" + render_split(size, plans, args))
    stated = index_total_size(args.model)
    if stated is not None:
        print(
            f"\nThe checkpoint's index states {_gb(stated)} GB; the arithmetic above counts "
            f"{_gb(size.checkpoint_bytes)} GB ({size.checkpoint_bytes / stated - 1:+.2%})."
        )
    return 0


def render(size: ModelSize, plans: list[KindPlan], args: argparse.Namespace) -> str:
    lines = [
        f"{size.name}: {_count(size.params)} parameters served ({_count(size.active_params)} "
        f"active per token); checkpoint {_count(size.checkpoint_params)}"
        f"{' with MTP layers' if size.checkpoint_params > size.params else ''}, "
        f"{_gb(size.checkpoint_bytes)} GB in {'FP8' if size.fp8_weights else 'BF16'}",
        f"KV budget: {args.concurrency} sequences x {args.context} tokens; "
        f"{args.utilization:.0%} of each GPU's memory usable",
        "",
        "| GPU | precision | weights GB | KV bytes/token | fewest GPUs | sequences that fit |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for p in plans:
        usable = p.gpus * gpu_profiles()[p.kind].memory_bytes * args.utilization
        fit = f"{p.sequences} on {p.gpus}"
        if p.weight_bytes > usable:
            memory_gb = gpu_profiles()[p.kind].memory_bytes / _GB
            fit = f"{p.gpus} x {memory_gb:.0f} GB do not load the weights"
        lines.append(
            f"| {p.kind} | {p.precision} | {_gb(p.weight_bytes)} | {p.kv_bytes_per_token} "
            f"| {p.fewest_gpus} | {fit} |"
        )
    return "\n".join(lines)


def render_split(size: ModelSize, plans: list[KindPlan], args: argparse.Namespace) -> str:
    """The prefill:decode split of ``args.workers`` workers of each kind that loads the model."""
    lines = [
        f"Prefill:decode split of {args.workers} workers a kind, for {args.prompt_tokens}-token "
        f"prompts and {args.output_tokens}-token outputs (prefill compute against decode "
        "bandwidth: devtools/pd_split.py)",
        "",
        "| GPU | GPUs a worker | prefill s/request | decode batch | decode s/request "
        "| prefill share | prefill:decode |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in plans:
        roofline = Roofline(
            serving_profile(gpu_profiles()[p.kind], size),
            p.gpus,
            size,
            args.utilization,
            size.attention_flops_per_key
            if args.attention_flops_per_key is None
            else args.attention_flops_per_key,
        )
        if roofline.kv_capacity_tokens < args.prompt_tokens + args.output_tokens:
            lines.append(f"| {p.kind} | {p.gpus} | the weights leave no room for one request |||||")
            continue
        split = pd_split(
            roofline, args.prompt_tokens, args.output_tokens, args.workers, args.max_parallel
        )
        lines.append(
            f"| {p.kind} | {p.gpus} | {split.prefill_s:.3f} | {split.batch} "
            f"| {split.decode_s:.3f} | {split.prefill_share:.0%} "
            f"| {split.prefill_workers}:{split.decode_workers} |"
        )
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gb(n: int) -> str:
    return f"{n / _GB:.1f}" if n >= _GB else f"{n / _GB:.4f}"
