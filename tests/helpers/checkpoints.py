"""Tiny checkpoints for the tests: one written once per run, and one like another with some of its
settings changed (files linked, the two JSON configs rewritten)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock


def written_once(factory: pytest.TempPathFactory, name: str, write: Callable[[Path], Path]) -> Path:
    """The checkpoint ``write`` makes, written by the first pytest-xdist worker that asks for it
    and read by the others (each takes 5-15 s to write)."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    out = root / f"checkpoint-{name}"
    with FileLock(f"{out}.lock"):
        if not (out / "config.json").exists():
            write(out)
    return out


def variant_of(
    checkpoint: str | Path, out: Path, chat_template: str | None = None, **config: Any
) -> Path:
    """``out``: ``checkpoint`` with ``chat_template`` (when given) as its tokenizer_config.json's
    template and ``config`` over its config.json's keys (``model_type``,
    ``max_position_embeddings``, ...)."""
    source = Path(checkpoint)
    rewritten = {"tokenizer_config.json", "config.json"}
    for path in source.iterdir():
        if path.name not in rewritten:
            (out / path.name).symlink_to(path.resolve())
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    model_config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**model_config, **config}))
    return out
