"""The dequantized copy of an FP8 checkpoint (worker_svc/model/dequant_cache.py): exact, written
once, reused, never taken whole when half-written."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker_svc.model import dequant_cache
from worker_svc.model.checkpoint import CheckpointError, load_checkpoint
from worker_svc.model.dequant_cache import dequantized_checkpoint
from worker_svc.model.kernel import FP8, weight_dequant


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_the_copy_is_the_loader_s_own_dequantization(tiny_dir: Path, tmp_path: Path) -> None:
    copy = dequantized_checkpoint(tiny_dir, tmp_path, torch.bfloat16)
    config = json.loads((copy / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    original, copied = _tensors(tiny_dir), _tensors(copy)
    fp8 = [n for n, t in original.items() if t.dtype == FP8]
    assert fp8 and set(copied) == {n for n in original if not n.endswith("_scale_inv")}
    for name, tensor in original.items():
        if name in fp8:
            scale = original[name + "_scale_inv"]
            assert torch.equal(copied[name], weight_dequant(tensor, scale, dtype=torch.bfloat16))
        elif not name.endswith("_scale_inv"):
            assert torch.equal(copied[name], tensor)  # stored as it was (norms, bias, embeddings)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (copy / name).read_bytes() == (tiny_dir / name).read_bytes()
    # the model served from either is the same, weight for weight
    served_fp8, _ = load_checkpoint(tiny_dir, torch.bfloat16)
    served_copy, _ = load_checkpoint(copy, torch.bfloat16)
    for (name, a), (_, b) in zip(
        served_fp8.state_dict().items(), served_copy.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_second_start_reuses_the_copy(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = dequantized_checkpoint(tiny_dir, tmp_path, torch.float16)
    written = (first / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger=dequant_cache.__name__):
        again = dequantized_checkpoint(tiny_dir, tmp_path, torch.float16)
    assert again == first and (first / "model.safetensors").stat().st_mtime_ns == written
    assert "reusing its torch.float16 copy" in caplog.text
    # another precision is another copy
    assert dequantized_checkpoint(tiny_dir, tmp_path, torch.bfloat16) != first


def test_a_changed_checkpoint_gets_a_new_copy(tiny_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    first = dequantized_checkpoint(model, tmp_path / "cache", torch.bfloat16)
    generation = model / "generation_config.json"
    generation.write_text(generation.read_text().replace("0.6", "0.7"))
    second = dequantized_checkpoint(model, tmp_path / "cache", torch.bfloat16)
    assert second != first and "0.7" in (second / "generation_config.json").read_text()


def test_a_half_written_copy_is_never_used(tiny_dir: Path, tmp_path: Path) -> None:
    """A writer that died mid-copy left its temporary directory: the next start removes it and
    writes the copy whole."""
    target = dequantized_checkpoint(tiny_dir, tmp_path, torch.bfloat16)
    shutil.rmtree(target)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    remains = target.with_name(f"{target.name}.tmp-{int(dead.stdout)}")
    remains.mkdir()
    (remains / "config.json").write_text("{")  # cut short
    assert dequantized_checkpoint(tiny_dir, tmp_path, torch.bfloat16) == target
    assert not remains.exists() and json.loads((target / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_a_failed_copy_leaves_nothing(tiny_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    tensors = _tensors(model)
    name = next(n for n, t in tensors.items() if t.dtype == FP8)
    tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"][:1]  # a scale of the wrong shape
    save_file(tensors, model / "model.safetensors", {"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor {name}: .*scale_inv"):
        dequantized_checkpoint(model, tmp_path / "cache", torch.bfloat16)
    assert list((tmp_path / "cache").iterdir()) == []


def test_shards_whose_scales_live_in_another_file(tiny_dir: Path, tmp_path: Path) -> None:
    """DeepSeek-V3 ships 163 shards listed by model.safetensors.index.json; a weight's scale need
    not share its file."""
    model = tmp_path / "sharded"
    shutil.copytree(tiny_dir, model, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = _tensors(tiny_dir)
    scales = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    rest = {n: t for n, t in tensors.items() if n not in scales}
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file(rest, model / first, {"format": "pt"})
    save_file(scales, model / second, {"format": "pt"})
    weight_map = dict.fromkeys(rest, first) | dict.fromkeys(scales, second)
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    copy = dequantized_checkpoint(model, tmp_path / "cache", torch.bfloat16)
    listed = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    assert listed == dict.fromkeys(rest, first)
    assert not (copy / second).exists()  # it held only scales
    served_fp8, _ = load_checkpoint(tiny_dir, torch.bfloat16)
    served_copy, _ = load_checkpoint(copy, torch.bfloat16)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            served_fp8.state_dict().values(), served_copy.state_dict().values(), strict=True
        )
    )


def test_a_disk_without_room_is_refused_before_writing(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk cannot be made here: the free space the cache's disk reports is replaced."""
    nearly_full = shutil.disk_usage(tmp_path)._replace(free=1024)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: nearly_full)
    with pytest.raises(CheckpointError, match=r"needs .* GiB, .* are free: .* dequant_cache_dir"):
        dequantized_checkpoint(tiny_dir, tmp_path, torch.bfloat16)
    assert list(tmp_path.iterdir()) == []
