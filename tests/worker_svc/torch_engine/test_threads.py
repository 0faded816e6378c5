"""The checkpoint engine's CPU thread policy: its decision, its config keys, and a real worker
process computing on the threads it chose."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from devtools.mesh import dev_worker_env
from infermesh.config import ConfigError
from worker_svc.config import load
from worker_svc.torch_engine.threads import available_cores, choose_threads

_REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("cores", "reserved", "threads"),
    [(2, 1, 1), (2, 2, 1), (1, 1, 1), (8, 1, 7), (64, 2, 62), (4, 0, 4)],
)
def test_auto_computes_on_the_cores_left_after_the_reserved_ones_at_least_one(
    cores, reserved, threads
):
    policy = choose_threads(cores, reserved_cores=reserved)
    assert policy.threads == threads
    assert policy.why == f"{cores} cores available, {reserved} reserved for the services beside it"
    assert policy.wait_policy == "passive"
    assert policy.environment() == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_thread_count_in_the_config_wins_over_the_cores_and_the_environment():
    policy = choose_threads(2, threads=6, environ={"OMP_NUM_THREADS": "1"})
    assert (policy.threads, policy.why) == (6, "[engine] threads")


def test_auto_keeps_an_operators_omp_variables():
    policy = choose_threads(16, environ={"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "Active"})
    assert (policy.threads, policy.why, policy.wait_policy) == (3, "OMP_NUM_THREADS", "active")
    # values libgomp would not take leave the policy's own choice
    policy = choose_threads(16, environ={"OMP_NUM_THREADS": "0", "OMP_WAIT_POLICY": "spin"})
    assert (policy.threads, policy.wait_policy) == (15, "passive")


@pytest.mark.parametrize(
    ("asked", "environment"),
    [
        ("passive", {"OMP_WAIT_POLICY": "PASSIVE"}),
        ("active", {"OMP_WAIT_POLICY": "ACTIVE"}),
        ("runtime", {}),
    ],
)
def test_the_configured_wait_policy_is_what_libgomp_is_given(asked, environment):
    policy = choose_threads(4, wait_policy=asked, environ={"OMP_WAIT_POLICY": "active"})
    assert policy.environment() == environment
    assert f"OpenMP wait policy {asked}" in policy.describe()


def test_the_engine_section_reads_the_policy_from_toml_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "worker.toml"
    path.write_text('[engine]\nthreads = 3\nreserved_cores = 0\nomp_wait_policy = "active"\n')
    engine = load(str(path)).engine
    assert (engine.threads, engine.reserved_cores, engine.omp_wait_policy) == (3, 0, "active")
    defaults = load(None).engine
    assert (defaults.threads, defaults.reserved_cores, defaults.omp_wait_policy) == (0, 1, "auto")
    monkeypatch.setenv("INFERMESH_WORKER_ENGINE_OMP_WAIT_POLICY", "runtime")
    assert load(str(path)).engine.omp_wait_policy == "runtime"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('threads = "auto"', "[engine] threads: expected int, got str 'auto'"),
        ("threads = -1", "[engine]: threads: must be >= 0 (0: auto), got -1"),
        ("reserved_cores = -2", "[engine]: reserved_cores: must be >= 0, got -2"),
        (
            'omp_wait_policy = "spin"',
            "[engine] omp_wait_policy: expected one of auto, passive, active, runtime, got 'spin'",
        ),
    ],
)
def test_bad_policy_values_are_config_errors_naming_file_and_key(tmp_path, line, message):
    path = tmp_path / "worker.toml"
    path.write_text(f"[engine]\n{line}\n")
    with pytest.raises(ConfigError) as raised:
        load(str(path))
    assert str(raised.value) == f"{path}: {message}"


def test_a_bad_policy_variable_is_a_config_error_naming_it(monkeypatch):
    monkeypatch.setenv("INFERMESH_WORKER_ENGINE_THREADS", "two")
    with pytest.raises(ConfigError, match="INFERMESH_WORKER_ENGINE_THREADS: expected int"):
        load(None)


def test_the_dev_mesh_leaves_two_cores_to_the_services_unless_told_otherwise():
    assert dev_worker_env({}) == {"INFERMESH_WORKER_ENGINE_RESERVED_CORES": "2"}
    told = {"INFERMESH_WORKER_ENGINE_RESERVED_CORES": "0"}
    assert dev_worker_env(told) == told


def _forward_lines(stream: IO[str], sink: queue.Queue[str]) -> None:
    """Every line of ``stream`` into ``sink``, then "" at its end."""
    for line in stream:
        sink.put(line)
    sink.put("")


def _worker_log_until(env: dict[str, str], marker: str, timeout_s: float = 100) -> str:
    """What a real worker process logs until a line holding ``marker`` (then it is stopped)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker_svc"],
        cwd=_REPO,
        env={
            **os.environ,
            "OTEL_SDK_DISABLED": "true",
            "INFERMESH_LOG_FORMAT": "text",
            "INFERMESH_WORKER_SERVER_PORT": "0",
            **env,
        },
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    received: queue.Queue[str] = queue.Queue()
    # read in a thread, so that the wait for the next line can time out
    reader = threading.Thread(target=_forward_lines, args=(proc.stderr, received), daemon=True)
    reader.start()
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not any(marker in line for line in lines):
            try:
                line = received.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {marker!r} from the worker in {timeout_s} s: {''.join(lines)}")
            assert line, f"the worker exited before {marker!r}: {''.join(lines)}"
            lines.append(line)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=30)  # the pipe's end, now that the worker is gone
        proc.stderr.close()
    return "".join(lines)


def test_a_worker_computes_on_the_thread_count_its_policy_chose():
    # more threads than torch's default (one per core), so that the default cannot pass
    threads = available_cores() + 1
    log = _worker_log_until(
        {
            "INFERMESH_WORKER_ENGINE_THREADS": str(threads),
            "INFERMESH_WORKER_ENGINE_OMP_WAIT_POLICY": "passive",
            "INFERMESH_WORKER_TLS_PLAINTEXT": "true",  # no router: nothing to authenticate
        },
        "step loop computes on",
    )
    assert (
        f"torch threads: {threads} ([engine] threads); OpenMP wait policy passive; "
        "threads not bound to cores"
    ) in log
    # logged by the step loop's own thread, where the forward passes run
    assert f"step loop computes on {threads} torch threads" in log


def test_the_log_line_says_whether_the_environment_binds_the_threads():
    assert choose_threads(2).describe().endswith("threads not bound to cores")
    bound = choose_threads(2, environ={"OMP_PROC_BIND": "close"})
    assert bound.describe().endswith("threads bound as OMP_PROC_BIND=close")
    assert choose_threads(2, environ={"OMP_PROC_BIND": "FALSE"}).binding == ""
