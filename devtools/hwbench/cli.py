"""``python -m infermesh bench``: the arguments, and the study from the first check to the
last file. Every bad input is one line and a non-zero exit, before anything is written."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import openai
from tqdm import tqdm

from devtools.hwbench import report
from devtools.hwbench.fleet import AdminClient, FleetError, Kind, kinds_serving
from devtools.hwbench.load import LoadRunner, Sample, Workload
from devtools.hwbench.prices import EXAMPLE_PRICES, PriceError, load_prices
from devtools.hwbench.results import Point, Run, point, with_frontier
from devtools.hwbench.simfleet import simulated_fleet
from devtools.mesh import ServiceExited
from devtools.pd_split import decode_without_prefill
from worker_svc.config import EngineSection
from worker_svc.hardware.gpu_profiles import gpu_profiles
from worker_svc.hardware.sizing import (
    SizingError,
    bundled_models,
    model_size_of,
    serving_profile,
)

_MEMORY_POLL_S = 0.5


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = commands.add_parser(
        "bench", help="measure every GPU kind of the fleet; write the table, data and plots"
    )
    bench.add_argument(
        "--base-url",
        default=os.environ.get("OPENAI_BASE_URL", ""),
        help="the gateway's /v1 URL (OPENAI_BASE_URL)",
    )
    bench.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", ""),
        help="an API key (OPENAI_API_KEY)",
    )
    bench.add_argument(
        "--admin-token",
        default=os.environ.get("INFERMESH_ADMIN_TOKEN", ""),
        help="the gateway's admin token, to read the fleet (INFERMESH_ADMIN_TOKEN)",
    )
    bench.add_argument(
        "--admin-url",
        default=os.environ.get("INFERMESH_ADMIN_URL", ""),
        help="the gateway's admin URL (INFERMESH_ADMIN_URL; default: the base URL's host)",
    )
    bench.add_argument("--model", default="", help="the model (default: the only one served)")
    bench.add_argument(
        "--gpus",
        type=_names,
        default=[],
        help="GPU kinds, comma-separated (default: every kind serving the model)",
    )
    bench.add_argument(
        "--concurrency",
        type=_positive_list,
        default=[1, 4, 16, 64],
        help="concurrency levels, comma-separated (default 1,4,16,64)",
    )
    bench.add_argument(
        "--requests",
        type=_positive,
        default=0,
        help="requests per point and repeat (default: 2 x the concurrency)",
    )
    bench.add_argument("--prompt-tokens", type=_positive, default=800)
    bench.add_argument("--max-tokens", type=_positive, default=256)
    bench.add_argument(
        "--warmup", type=_non_negative, default=1, help="requests per GPU kind first, not counted"
    )
    bench.add_argument(
        "--repeat", type=_positive, default=5, help="runs of each point, figures averaged"
    )
    bench.add_argument(
        "--prices",
        default=str(EXAMPLE_PRICES),
        help="TOML of $ per GPU-hour per kind (default: the example figures)",
    )
    bench.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    bench.add_argument(
        "--sim",
        action="store_true",
        help="start a simulated fleet of every kind of gpu_profiles.toml (or --gpus) and study it",
    )
    bench.add_argument(
        "--sim-model",
        default="",
        help="with --sim: a bundled model's name "
        f"({', '.join(bundled_models())}), a checkpoint "
        f"directory or a config.json; default 8B dense",
    )
    bench.add_argument(
        "--sim-roles",
        type=_roles,
        default={},
        help="with --sim: [worker] roles by kind, KIND=prefill|decode|both,... (default all "
        "both: aggregated); a prefill kind is not studied, it prefills for the decode kinds",
    )
    bench.add_argument(
        "--sim-link-gbps",
        type=float,
        default=0.0,
        help="with --sim: the link between the workers, Gb/s, for the router's pulls and the "
        "simulated transfers (0: instant transfers, no pulls from busy peers)",
    )


def run(args: argparse.Namespace) -> int:
    # Ctrl-C keeps what was measured; set explicitly, since a shell may start background
    # jobs ignoring SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.sim:
            unknown = [k for k in args.gpus if k not in gpu_profiles()]
            if unknown:
                raise BenchError(
                    f"unknown GPU kind {unknown[0]!r}; simulated kinds: {', '.join(gpu_profiles())}"
                )
            kinds = args.gpus or list(gpu_profiles())
            _prices(args.prices, kinds)  # before minutes of starting a fleet
            if args.sim_model:
                try:
                    model_size_of(args.sim_model)
                except SizingError as e:
                    raise BenchError(f"--sim-model: {e}") from None
            studied = _check_roles(args.sim_roles, kinds, args.sim_model)
            if args.sim_link_gbps < 0:
                raise BenchError(f"--sim-link-gbps: must be >= 0, got {args.sim_link_gbps}")
            with simulated_fleet(
                kinds, args.sim_model, args.sim_roles, args.sim_link_gbps
            ) as endpoint:
                args = argparse.Namespace(
                    **{
                        **vars(args),
                        "base_url": endpoint.base_url,
                        "api_key": endpoint.api_key,
                        "admin_url": endpoint.admin_url,
                        "admin_token": endpoint.admin_token,
                        "model": args.model or endpoint.model,
                        "gpus": studied,
                    }
                )
                roles = ", ".join(f"{k} {r}" for k, r in args.sim_roles.items())
                return _study(
                    args,
                    f"simulated: one worker per kind on {platform.node()}"
                    + (
                        f"; disaggregated: {roles}; link {args.sim_link_gbps:g} Gb/s"
                        if roles
                        else ""
                    ),
                )
        return _study(args, f"the fleet behind {args.base_url}")
    except (ServiceExited, TimeoutError) as e:
        print(f"bench: the simulated fleet did not start: {e}", file=sys.stderr)
        return 1
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2


class BenchError(Exception):
    """A bad input or an unusable fleet: one line for the user."""


@dataclass
class Study:
    """What has been measured so far (kept when Ctrl-C stops the study)."""

    points: list[Point] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    kinds: dict[str, Kind] = field(default_factory=dict)
    model: str = ""


def _study(args: argparse.Namespace, fleet_text: str) -> int:
    if not args.base_url or not args.api_key:
        raise BenchError(
            "set OPENAI_BASE_URL and OPENAI_API_KEY (or --base-url / --api-key), or use --sim"
        )
    if not args.admin_token:
        raise BenchError(
            "the fleet's GPU kinds and memory come from the gateway's admin API: "
            "set INFERMESH_ADMIN_TOKEN (or --admin-token)"
        )
    study = Study()
    started = time.time()
    complete = True
    try:
        asyncio.run(_measure(args, study))
    except KeyboardInterrupt:
        complete = False
        print("\ninterrupted: writing what was measured", file=sys.stderr)
    if not study.points:
        if not complete:
            return 130
        raise BenchError("no point was measured")
    meta = _meta(args, study, fleet_text, started, complete)
    for path in report.write(args.out, meta, with_frontier(study.points), study.samples):
        print(path)
    return 0 if complete else 130


async def _measure(args: argparse.Namespace, study: Study) -> None:
    client = openai.AsyncOpenAI(
        base_url=args.base_url,
        api_key=args.api_key,
        max_retries=0,
        timeout=max(600.0, args.max_tokens),
    )
    admin = AdminClient(args.admin_url or _origin(args.base_url), args.admin_token)
    try:
        study.model = await _check_model(client, args.model)
        try:
            study.kinds = kinds_serving(await admin.workers(), study.model)
        except FleetError as e:
            raise BenchError(str(e)) from None
        kinds = _chosen_kinds(args.gpus, study.kinds, study.model)
        prices = _prices(args.prices, kinds)
        await _run_points(args, study, client, admin, kinds, prices)
    except openai.AuthenticationError as e:  # the key was revoked while the study ran
        raise BenchError(f"the gateway refused the API key (401): {e.message}") from None
    finally:
        await admin.close()
        await client.close()


async def _check_model(client: openai.AsyncOpenAI, model: str) -> str:
    """The model to study, once the gateway answered with this key."""
    try:
        served = [m.id for m in (await client.models.list()).data]
    except openai.AuthenticationError as e:
        raise BenchError(f"the gateway refused the API key (401): {e.message}") from None
    except openai.APIConnectionError as e:
        raise BenchError(f"cannot reach {client.base_url}: {e.message}") from None
    except openai.APIStatusError as e:
        raise BenchError(f"{client.base_url}models answered {e.status_code}: {e.message}") from None
    if model and model not in served:
        raise BenchError(f"model {model!r} is not served; served: {', '.join(served) or 'none'}")
    if not model and len(served) != 1:
        raise BenchError(f"--model is needed: served models: {', '.join(served) or 'none'}")
    return model or served[0]


def _chosen_kinds(wanted: list[str], serving: dict[str, Kind], model: str) -> list[str]:
    unknown = [k for k in wanted if k not in serving]
    if unknown:
        raise BenchError(
            f"unknown GPU kind {unknown[0]!r}: kinds serving {model}: "
            f"{', '.join(serving) or 'none'}"
        )
    return wanted or list(serving)


def _prices(path: str, kinds: list[str]) -> dict[str, float]:
    try:
        return load_prices(path, kinds)
    except PriceError as e:
        raise BenchError(str(e)) from None


async def _run_points(
    args: argparse.Namespace,
    study: Study,
    client: openai.AsyncOpenAI,
    admin: AdminClient,
    kinds: list[str],
    prices: dict[str, float],
) -> None:
    per_point = {c: args.requests or 2 * c for c in args.concurrency}
    total = len(kinds) * (args.warmup + args.repeat * sum(per_point.values()))
    workload = Workload(study.model, args.prompt_tokens, args.max_tokens)
    with tqdm(total=total, unit="req", desc="bench", dynamic_ncols=True) as progress:

        def done(sample: Sample) -> None:
            study.samples.append(sample)
            progress.update()

        runner = LoadRunner(client, workload, done)
        for kind in kinds:
            progress.set_description(f"{kind} warm-up")
            if args.warmup:
                await runner.run(kind, 1, args.warmup, repeat=-1)
            for concurrency in args.concurrency:
                progress.set_description(f"{kind} c={concurrency}")
                runs, memory = await _point_runs(
                    runner, admin, kind, concurrency, per_point[concurrency], args.repeat
                )
                study.points.append(
                    point(study.kinds[kind], concurrency, runs, memory, prices[kind])
                )


async def _point_runs(
    runner: LoadRunner, admin: AdminClient, kind: str, concurrency: int, requests: int, repeat: int
) -> tuple[list[Run], int]:
    """The repeats of one point, and the most memory one worker of the kind reported meanwhile."""
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            with contextlib.suppress(FleetError):
                peak = max(
                    [peak]
                    + [
                        w["memory_used_bytes"]
                        for w in await admin.workers()
                        if w["gpu_kind"] == kind
                    ]
                )
            await asyncio.sleep(_MEMORY_POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        runs = [Run(*await runner.run(kind, concurrency, requests, r)) for r in range(repeat)]
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return runs, peak


def _meta(
    args: argparse.Namespace, study: Study, fleet_text: str, started: float, complete: bool
) -> dict[str, Any]:
    return {
        "model": study.model,
        "complete": complete,
        "fleet": fleet_text,
        "started_unix": started,
        "finished_unix": time.time(),
        "workload": {
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "temperature": 0,
        },
        "concurrency": args.concurrency,
        "requests": args.requests or "2 x concurrency",
        "warmup": args.warmup,
        "repeat": args.repeat,
        "prices": str(args.prices),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), "
        f"Python {platform.python_version()}, openai {openai.__version__}",
        "command": " ".join(sys.argv),
    }


def _origin(base_url: str) -> str:
    parsed = urlparse(base_url)
    return f"{parsed.scheme}://{parsed.netloc}"


def _check_roles(roles: dict[str, str], kinds: list[str], model: str) -> list[str]:
    """The kinds to study (those not prefilling), once ``roles`` are known to fit the fleet."""
    outside = [k for k in roles if k not in kinds]
    if outside:
        raise BenchError(f"--sim-roles: {outside[0]} is not in the fleet ({', '.join(kinds)})")
    size = model_size_of(model) if model else EngineSection(kind="sim").size()
    precisions = {k: serving_profile(gpu_profiles()[k], size).precision for k in kinds}
    missing = decode_without_prefill(roles, precisions)
    if missing:
        raise BenchError(
            f"--sim-roles: the {missing[0]} decode kinds have no {missing[0]} prefill kind"
        )
    studied = [k for k in kinds if roles.get(k) != "prefill"]
    if not studied:
        raise BenchError("--sim-roles: every kind prefills; a decode or both kind is needed")
    return studied


def _roles(text: str) -> dict[str, str]:
    roles = {}
    for item in _names(text):
        kind, _, role = item.partition("=")
        if role not in ("prefill", "decode", "both"):
            raise argparse.ArgumentTypeError(f"expected KIND=prefill|decode|both,..., got {item!r}")
        roles[kind.strip()] = role
    return roles


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _positive_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"every level must be a positive integer, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
