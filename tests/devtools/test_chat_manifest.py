"""The stored chat checkpoints are tied to their recipes: each directory's manifest.json hashes
its files, the verify command (devtools.chat_model.manifest's, which the trainer's `verify`
runs) accepts them, and refuses a directory without a manifest or with a file changed, added or
removed, naming the file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.chat_model import CHECKPOINT, THINKING_CHECKPOINT, manifest


@pytest.mark.parametrize("checkpoint", [CHECKPOINT, THINKING_CHECKPOINT])
def test_the_stored_checkpoints_match_their_manifests(checkpoint):
    made = manifest.verify(checkpoint)
    assert "model.safetensors" in made["files"]
    assert made["command"].startswith("python -m devtools.chat_model.train") and made["commit"]


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the stored checkpoint, its weights file left out of the copy (and the manifest)
    to keep the test cheap."""
    directory = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    (directory / "model.safetensors").write_bytes(b"weights")
    manifest.write(directory, "python -m devtools.chat_model.train --steps 1", None)
    return directory


def _refusal(directory: Path) -> str:
    with pytest.raises(SystemExit) as refused:
        manifest.main(["verify", str(directory)])
    return str(refused.value.code)


def test_verify_accepts_a_directory_as_its_manifest_says(copy, capsys):
    manifest.main(["verify", str(copy)])
    assert (
        "5 files as made by: python -m devtools.chat_model.train --steps 1"
        in capsys.readouterr().out
    )


def test_verify_refuses_a_directory_without_a_manifest(copy):
    (copy / manifest.MANIFEST).unlink()
    missing = f"{copy / manifest.MANIFEST}: missing; a checkpoint keeps its files' hashes there"
    assert _refusal(copy) == f"refused: {missing}"


def test_verify_refuses_a_changed_file_naming_it(copy):
    (copy / "config.json").write_text("{}")
    assert _refusal(copy).startswith(f"refused: {copy / 'config.json'}: sha256 ")


def test_verify_refuses_a_file_added_or_removed(copy):
    (copy / "extra.bin").write_bytes(b"x")
    assert _refusal(copy) == f"refused: {copy / 'extra.bin'}: not in manifest.json"
    (copy / "extra.bin").unlink()
    (copy / "tokenizer.json").unlink()
    assert "tokenizer.json: listed in manifest.json but missing" in _refusal(copy)


def test_the_verify_command_exits_1_naming_the_file(copy):
    """As `make model` runs it: without torch, in a fraction of a second."""
    (copy / "model.safetensors").write_bytes(b"other weights")
    done = subprocess.run(
        [sys.executable, "-m", "devtools.chat_model.manifest", "verify", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "model.safetensors: sha256" in done.stderr
