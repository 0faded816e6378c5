"""``python -m worker_svc``: what the worker finds wrong while it starts is a config error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def _start(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker_svc"],
        cwd=_REPO,
        text=True,
        env={
            **os.environ,
            "OTEL_SDK_DISABLED": "true",
            "INFERMESH_WORKER_TLS_PLAINTEXT": "true",
            **env,
        },
        capture_output=True,
        timeout=120,
    )


def test_a_checkpoint_the_worker_cannot_load_exits_2_naming_the_file(tmp_path):
    missing = tmp_path / "missing"
    done = _start({"INFERMESH_WORKER_MODEL_PATH": str(missing)})
    assert done.returncode == 2
    assert f"worker: config error: checkpoint directory {missing} does not exist" in done.stderr

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    done = _start({"INFERMESH_WORKER_MODEL_PATH": str(tmp_path)})
    assert done.returncode == 2
    assert f"{tmp_path / 'config.json'}: model_type: 'deepseek_v4' is not served" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_simulated_model_that_does_not_fit_exits_2_naming_the_key():
    done = _start(
        {
            "INFERMESH_WORKER_ENGINE_KIND": "sim",
            "INFERMESH_WORKER_ENGINE_MODEL": "DeepSeek-V3",
            "INFERMESH_WORKER_ENGINE_GPU": "V100",
            "INFERMESH_WORKER_ENGINE_GPU_COUNT": "1",
        }
    )
    assert done.returncode == 2
    assert "worker: config error: [engine] gpu_count: the model's" in done.stderr
    assert "leave no KV cache in 1 x V100" in done.stderr
