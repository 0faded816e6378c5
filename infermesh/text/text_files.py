"""The text files a prompt is rendered and tokenized with, and their digest: the name under which
a worker reports its tokenizer (Capabilities.tokenizer) and a caller that fetched the files
(Worker.TextFiles) renders prompts exactly as that worker would."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

# What a checkpoint's tokenizer is loaded from (those it has), config.json for the model family
# that chooses a tool template
CHECKPOINT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
# The chat template the worker serves with (the checkpoint's own, the family's tool template or
# the operator's file), under a name no tokenizer loader reads on its own
SERVED_TEMPLATE = "served_chat_template.jinja"

CHUNK_BYTES = 1 << 20  # a TextFileChunk's data at most


@dataclass(frozen=True)
class TextFiles:
    """Files by name and their digest; no files: the digest names no tokenizer to fetch (a
    simulated engine's "bytes:N")."""

    digest: str
    files: Mapping[str, bytes]

    @classmethod
    def of(cls, files: Mapping[str, bytes]) -> TextFiles:
        return cls(files_digest(files), dict(files))

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[str, bytes]]:
        """(name, data) pieces in order, each file's first named, the others not."""
        for name, data in sorted(self.files.items()):
            for begin in range(0, max(len(data), 1), chunk_bytes):
                yield (name if begin == 0 else ""), data[begin : begin + chunk_bytes]

    def write(self, directory: Path) -> None:
        for name, data in self.files.items():
            (directory / name).write_bytes(data)


def files_digest(files: Mapping[str, bytes]) -> str:
    """ "sha256:<hex>" over the names and contents, in name order (each length-prefixed, so no two
    sets of files read the same)."""
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        encoded = name.encode()
        h.update(len(encoded).to_bytes(8, "little") + encoded)
        h.update(len(data).to_bytes(8, "little") + data)
    return f"sha256:{h.hexdigest()}"


def checkpoint_text_files(model_dir: Path, served_template: str) -> TextFiles:
    """The files a tokenizer loaded from ``model_dir`` renders with, its served template as
    SERVED_TEMPLATE."""
    files = {
        name: (model_dir / name).read_bytes()
        for name in CHECKPOINT_FILES
        if (model_dir / name).is_file()
    }
    files[SERVED_TEMPLATE] = served_template.encode()
    return TextFiles.of(files)


def assembled(chunks: Iterable[tuple[str, bytes]]) -> dict[str, bytes]:
    """Files from their pieces (as TextFiles.chunks makes them); ValueError for a piece before
    any name or a name that is not a plain file name."""
    files: dict[str, bytearray] = {}
    current: bytearray | None = None
    for name, data in chunks:
        if name:
            if Path(name).name != name or name in (".", ".."):
                raise ValueError(f"text file name {name!r} is not a plain file name")
            current = files.setdefault(name, bytearray())
        elif current is None:
            raise ValueError("a text file piece came before any file's name")
        current.extend(data)
    return {name: bytes(data) for name, data in files.items()}
