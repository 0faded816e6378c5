"""A checkpoint like another, with some of its settings changed: files linked, the two JSON
configs rewritten."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
