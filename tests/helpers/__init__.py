"""Helpers the tests share (fixtures live in the conftest files): the served model's name,
in-process services, the gateway under test, the end-to-end mesh and the tool schemas."""

from __future__ import annotations

from pathlib import Path

from worker_svc.config import DEFAULT_MODEL_PATH

# The name the tiny default checkpoint is served under: its directory's name.
MODEL = Path(DEFAULT_MODEL_PATH).name
