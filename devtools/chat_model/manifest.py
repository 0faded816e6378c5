"""A trained checkpoint's manifest: the command that made it, the commit it ran at, its training
log and the SHA-256 of every file in its directory, so that stored weights are tied to their
recipe. ``write`` makes it (train.py, after each save); ``verify`` refuses a directory whose
manifest is missing or whose files do not match it:

    .venv/bin/python -m devtools.chat_model.manifest verify DIR...

(also ``python -m devtools.chat_model.train verify DIR...``; `make model` runs it on the stored
checkpoints before copying them) prints each directory's recipe, or exits 1 naming the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
LOG = "train.log"
_CHUNK_BYTES = 1 << 20


class ManifestError(Exception):
    """A checkpoint directory that is not what its manifest says; the message names the file."""


def sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def source_commit() -> str | None:
    """The commit the code runs at (``-dirty`` when the tree has changes), None outside git."""
    here = Path(__file__).parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def write(directory: Path, command: str, commit: str | None, **facts: Any) -> dict[str, Any]:
    """The manifest of every file now in ``directory`` (the log included, if written there),
    written to it, and returned; ``facts``: figures of the run worth keeping beside it."""
    files = {
        f.name: sha256(f) for f in sorted(directory.iterdir()) if f.is_file() and f.name != MANIFEST
    }
    manifest = {"command": command, "commit": commit, **facts, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def verify(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory`` if every file in it is listed with its hash and every listed
    file is there; else ManifestError naming the first file that is not."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        listed: dict[str, str] = manifest["files"]
    except FileNotFoundError:
        raise ManifestError(
            f"{path}: missing; a checkpoint keeps its files' hashes there"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ManifestError(f"{path}: not a manifest ({e!r})") from None
    present = {f.name for f in directory.iterdir() if f.is_file() and f.name != MANIFEST}
    for name in sorted(present | set(listed)):
        file = directory / name
        if name not in listed:
            raise ManifestError(f"{file}: not in {MANIFEST}")
        if name not in present:
            raise ManifestError(f"{file}: listed in {MANIFEST} but missing")
        if (actual := sha256(file)) != listed[name]:
            raise ManifestError(
                f"{file}: sha256 {actual}, but {MANIFEST} says {listed[name]} (not the weights "
                "its recipe made)"
            )
    return dict(manifest)


def main(argv: list[str] | None = None) -> None:
    """``verify DIR...``: each checkpoint directory matches its manifest, else exit 1 naming the
    file that does not."""
    parser = argparse.ArgumentParser(
        prog="devtools.chat_model.manifest",
        description="Check that each checkpoint's files are the ones its manifest.json lists.",
    )
    parser.add_argument("command", choices=["verify"])
    parser.add_argument("directories", type=Path, nargs="+")
    for directory in parser.parse_args(argv).directories:
        try:
            made = verify(directory)
        except ManifestError as e:
            sys.exit(f"refused: {e}")
        print(f"{directory}: {len(made['files'])} files as made by: {made['command']}")


if __name__ == "__main__":
    main()
