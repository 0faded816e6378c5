"""``python -m infermesh bench``: a whole ``--sim`` study on a small fleet, checked on its
files; and every bad input a clear one-line error before anything is written."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import sys
from pathlib import Path

import matplotlib.image
import pytest

from devtools.hwbench import report
from devtools.hwbench.load import Sample
from devtools.hwbench.plots import SIZE_PX
from devtools.hwbench.results import Point, dominates
from devtools.main import main
from gateway.accounts.keys import create_key_at
from infermesh.ports import free_port
from tests.helpers import MODEL
from tests.helpers.gateway import ADMIN_TOKEN, make_config, start_gateway
from tests.helpers.inprocess import running_router, running_worker, sim_engine

KINDS = ["H100", "A100", "V100"]  # fastest first, by their profiles' bandwidth
_SMALL = [
    "--concurrency",
    "1,4",
    "--requests",
    "4",
    "--prompt-tokens",
    "50",
    "--max-tokens",
    "24",
    "--warmup",
    "1",
    "--repeat",
    "1",
]


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("study")
    assert main(["bench", "--sim", "--gpus", ",".join(KINDS), *_SMALL, "--out", str(out)]) == 0
    return out


def test_one_row_per_kind_and_concurrency_faster_kinds_faster(study):
    points = json.loads((study / "results.json").read_text())["points"]
    assert [(p["gpu"], p["concurrency"]) for p in points] == [(k, c) for k in KINDS for c in (1, 4)]
    assert all(p["errors"] == 0 and p["requests"] == 4 for p in points)
    for concurrency in (1, 4):
        at = {p["gpu"]: p for p in points if p["concurrency"] == concurrency}
        speeds = [at[k]["output_tokens_per_s"] for k in KINDS]
        assert speeds == sorted(speeds, reverse=True), speeds
        per_token = [at[k]["time_per_output_token_s"] for k in KINDS]
        assert per_token == sorted(per_token), per_token
    by_kind = {p["gpu"]: p for p in points}
    assert (
        by_kind["H100"]["precision"],
        by_kind["A100"]["precision"],
        by_kind["V100"]["precision"],
    ) == ("fp8", "bf16", "fp16")
    assert by_kind["V100"]["memory_used_gb"] >= 16.0  # 8B weights in FP16, as the worker reported
    assert all(p["gpus_per_worker"] == 1 for p in points)


def test_the_frontier_is_exactly_the_non_dominated_points(study):
    points = [Point(**p) for p in json.loads((study / "results.json").read_text())["points"]]
    assert any(p.on_frontier for p in points)
    for p in points:
        dominated = any(dominates(q, p) for q in points)
        assert p.on_frontier == (not dominated), p
        expected = (
            {"H100": 2.90, "A100": 1.80, "V100": 0.90}[p.gpu] / 3600 / p.output_tokens_per_s * 1e6
        )
        assert p.usd_per_mtok == pytest.approx(expected)


def test_pngs_decode_at_the_stated_size(study):
    for name in ("throughput.png", "latency_p99.png", "cost_frontier.png"):
        image = matplotlib.image.imread(study / name)
        assert image.shape[:2] == (SIZE_PX[1], SIZE_PX[0])
        assert image.std() > 0  # something is drawn


def test_csv_and_json_agree_and_the_report_has_every_point(study):
    data = json.loads((study / "results.json").read_text())
    with (study / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(data["points"])
    for row, point in zip(rows, data["points"], strict=True):
        assert row.keys() == point.keys()
        for key, value in point.items():
            assert row[key] == ("" if value is None else str(value)), key
    with (study / "requests.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(data["requests"]) == 3 * (1 + 4 + 4)
    report = (study / "report.md").read_text()
    assert data["meta"]["complete"] and "INTERRUPTED" not in report
    assert sum(line.startswith(f"| {k} |") for k in KINDS for line in report.splitlines()) == 6
    assert "**Latency-first: H100.**" in report and "**Cost-first:" in report
    assert not [p for p in study.iterdir() if p.name.startswith(".partial")]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sim", "--gpus", "B200"], "unknown GPU kind 'B200'"),
        (
            ["--sim", "--gpus", "H100", "--prices", "{prices_missing}"],
            "no price for GPU kind 'H100'",
        ),
        (
            ["--sim", "--gpus", "V100", "--prices", "{prices_negative}"],
            "V100 = -1.0: a price must be a non-negative",
        ),
        (["--sim", "--sim-model", "/nonexistent"], "--sim-model: /nonexistent: not found"),
        (
            ["--sim", "--gpus", "H100,A100", "--sim-roles", "H100=prefill,A100=decode"],
            "--sim-roles: the bf16 decode kinds have no bf16 prefill kind",
        ),
        (["--sim", "--gpus", "H100", "--sim-roles", "H200=decode"], "H200 is not in the fleet"),
        (
            ["--sim", "--gpus", "H100,H200", "--sim-roles", "H100=prefill,H200=prefill"],
            "every kind prefills",
        ),
        (["--sim", "--sim-link-gbps", "-1"], "--sim-link-gbps: must be >= 0"),
        (
            ["--base-url", "http://127.0.0.1:{port}/v1", "--api-key", "sk-x", "--admin-token", "t"],
            "cannot reach",
        ),
        (
            ["--base-url", "http://127.0.0.1:{port}/v1", "--api-key", "sk-x"],
            "INFERMESH_ADMIN_TOKEN",
        ),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(argv, message, tmp_path, capsys):
    (tmp_path / "missing.toml").write_text("A100 = 1.5\n")
    (tmp_path / "negative.toml").write_text("V100 = -1.0\n")
    argv = [
        a.format(
            prices_missing=tmp_path / "missing.toml",
            prices_negative=tmp_path / "negative.toml",
            port=free_port(),
        )
        for a in argv
    ]
    out = tmp_path / "out"
    assert main(["bench", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench: ") and message in err and "\n" not in err
    assert not out.exists()


def test_a_disaggregated_fleet_is_studied_on_its_decode_kinds(tmp_path):
    """H100 prefills for H200 (both FP8): the study measures H200 alone, its prompts prefilled on
    the H100 worker, and says the fleet was disaggregated."""
    out = tmp_path / "pd"
    roles = ["--sim-roles", "H100=prefill,H200=decode", "--sim-link-gbps", "100"]
    assert main(["bench", "--sim", "--gpus", "H100,H200", *roles, *_SMALL, "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert {p["gpu"] for p in data["points"]} == {"H200"}
    assert all(p["errors"] == 0 for p in data["points"])
    assert "disaggregated: H100 prefill, H200 decode; link 100 Gb/s" in data["meta"]["fleet"]


def test_a_role_that_is_not_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--sim", "--sim-roles", "H100=prefil"])
    assert exit_.value.code == 2 and "KIND=prefill|decode|both" in capsys.readouterr().err


@pytest.mark.parametrize("level", ["0", "-4", "1,x"])
def test_a_concurrency_that_is_not_positive_is_refused(level, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--sim", "--concurrency", level])
    assert exit_.value.code == 2 and "--concurrency" in capsys.readouterr().err


async def test_a_wrong_key_and_an_unknown_kind_against_a_running_gateway(redis_server, tmp_path):
    api_key = await create_key_at(redis_server.url, "bench")
    async with (
        running_router() as router,
        running_worker(sim_engine("A100", zero_latency=True), router, "a100-0"),
    ):
        gateway = await start_gateway(make_config(redis_server.url, router.address))
        try:
            base = str(gateway.make_url("/v1"))
            wrong_key = await _bench(
                "--base-url",
                base,
                "--api-key",
                "sk-wrong",
                "--admin-token",
                ADMIN_TOKEN,
                "--out",
                str(tmp_path / "a"),
            )
            unknown_kind = await _bench(
                "--base-url",
                base,
                "--api-key",
                api_key,
                "--admin-token",
                ADMIN_TOKEN,
                "--gpus",
                "V100",
                "--out",
                str(tmp_path / "b"),
            )
        finally:
            await gateway.close()
    assert wrong_key[0] == 2
    assert wrong_key[1].startswith("bench: the gateway refused the API key (401): ")
    assert "sk-wrong" not in wrong_key[1]
    assert unknown_kind == (2, f"bench: unknown GPU kind 'V100': kinds serving {MODEL}: A100")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


async def _bench(*argv: str) -> tuple[int, str]:
    """The CLI in a child process (the gateway it calls runs in this event loop)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "infermesh",
        "bench",
        *argv,
        env={**os.environ},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await child.communicate()
    assert child.returncode is not None  # communicate() waited for the exit
    return child.returncode, err.decode().strip()


def test_an_interrupted_study_says_so_in_every_file(study, tmp_path):
    data = json.loads((study / "results.json").read_text())
    points = [Point(**p) for p in data["points"][:2]]
    samples = [Sample(**s) for s in data["requests"][:3]]
    report.write(tmp_path, {**data["meta"], "complete": False}, points, samples)
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["complete"] is False
    assert "**INTERRUPTED: partial results**" in (tmp_path / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cost_frontier.png",
        "latency_p99.png",
        "report.md",
        "requests.csv",
        "results.csv",
        "results.json",
        "throughput.png",
    ]
