"""A dequantized copy of an FP8 checkpoint, for an engine that cannot run its FP8 weights (vLLM on
a CPU without AMX, on V100 or MI100): written once into a cache directory, reused on later starts.

The copy is an ordinary HF checkpoint in one float dtype: every FP8 tensor that has a
`<name>_scale_inv` partner is dequantized by kernel.weight_dequant (the torch engine's loader does
the same: FP32 products, rounded once to the dtype), the scales are dropped, everything else is
copied as stored, and config.json loses its quantization_config. It is keyed by the checkpoint's
identity (its resolved path and every file's name, size and modification time) and the dtype, so
an edited or replaced checkpoint gets a new copy. It is written into a temporary directory beside
its final place and renamed there when complete: a start that dies half-way leaves no copy that a
later start would take for whole, and the next start for the same key removes the remains.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker_svc.model.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    ShardReader,
    open_shard,
    read_config,
    weight_map,
)
from worker_svc.model.kernel import FP8, weight_dequant

logger = logging.getLogger(__name__)

_FORMAT = 1  # bump when the copy's layout changes: old copies are then never reused
_SCALE_SUFFIX = "_scale_inv"
_TMP_MARK = ".tmp-"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# safetensors' dtype names -> bytes per element, for sizing the copy from the shard headers
_ITEMSIZE = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1}


def dequantized_checkpoint(
    model_dir: str | Path, cache_dir: str | Path, dtype: torch.dtype
) -> Path:
    """The directory of model_dir's checkpoint with its FP8 weights in `dtype`: the cached copy if
    there is one, else written now (minutes for DeepSeek-V3: 1.3 TB in BF16). Raises
    CheckpointError naming the file at fault, or the space the copy needs and the disk lacks."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dequantized_checkpoint: {dtype} is not one of {list(_DTYPE_NAMES)}")
    source = Path(model_dir).resolve()
    read_config(source)  # a checkpoint this worker serves: its quantization_config is checked
    cache = Path(cache_dir)
    target = cache / f"{source.name}-{_DTYPE_NAMES[dtype]}-{_identity(source, dtype)}"
    if (target / "config.json").exists():
        logger.info("FP8 checkpoint %s: reusing its %s copy %s", source, dtype, target)
        return target
    cache.mkdir(parents=True, exist_ok=True)
    _remove_remains(target)
    tensors = weight_map(source)
    _check_space(source, tensors, cache, dtype)
    partial = target.with_name(f"{target.name}{_TMP_MARK}{os.getpid()}")
    logger.info(
        "FP8 checkpoint %s: writing its %s copy to %s (once: later starts reuse it)",
        source,
        dtype,
        target,
    )
    started = time.monotonic()
    try:
        _write_copy(source, tensors, partial, dtype)
        partial.rename(target)  # atomic: the copy appears whole or not at all
    except OSError:
        if not (target / "config.json").exists():
            raise
        logger.info("another worker wrote %s first: using it", target)  # the same bytes
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    logger.info("%s ready after %.1f s", target, time.monotonic() - started)
    return target


def _identity(source: Path, dtype: torch.dtype) -> str:
    """A digest of what makes the copy: this format, the dtype, the checkpoint's path and its
    files' names, sizes and modification times (reading 700 GB to hash them would take longer
    than writing the copy)."""
    digest = hashlib.sha256(f"{_FORMAT} {_DTYPE_NAMES[dtype]} {source}".encode())
    for path in sorted(p for p in source.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"\n{path.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _remove_remains(target: Path) -> None:
    """Temporary directories of this copy whose writer is gone (it died mid-copy)."""
    for leftover in target.parent.glob(f"{target.name}{_TMP_MARK}*"):
        pid = leftover.name.rsplit(_TMP_MARK, 1)[1]
        if not pid.isdigit() or not _alive(int(pid)):
            logger.info("removing %s, left by a start that did not finish", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fp8_weights(tensors: dict[str, str]) -> set[str]:
    """The FP8 weights: the tensors stored with a block-scale partner."""
    return {name for name in tensors if name + _SCALE_SUFFIX in tensors}


def _copied(tensors: dict[str, str]) -> dict[str, str]:
    """The tensors of the copy, by shard: all but the FP8 weights' scales."""
    fp8 = _fp8_weights(tensors)
    return {
        name: file
        for name, file in tensors.items()
        if not (name.endswith(_SCALE_SUFFIX) and name.removesuffix(_SCALE_SUFFIX) in fp8)
    }


def _check_space(source: Path, tensors: dict[str, str], cache: Path, dtype: torch.dtype) -> None:
    """Raises CheckpointError when the cache's disk cannot hold the copy (sized from the shards'
    headers: nothing is loaded)."""
    fp8, copied = _fp8_weights(tensors), _copied(tensors)
    needed = 0
    for file in sorted(set(copied.values())):
        with open_shard(source / file) as shard:
            for name in (n for n, f in copied.items() if f == file):
                info = shard.get_slice(name)
                size = dtype.itemsize if name in fp8 else _ITEMSIZE.get(info.get_dtype(), 4)
                needed += int(torch.Size(info.get_shape()).numel()) * size
    free = shutil.disk_usage(cache).free
    if needed > free:
        raise CheckpointError(
            f"{cache}: the {dtype} copy of {source} needs {needed / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB are free: free space or set [quantization] dequant_cache_dir"
        )


def _write_copy(source: Path, tensors: dict[str, str], out: Path, dtype: torch.dtype) -> None:
    """source's checkpoint with its FP8 weights dequantized, into the new directory out: shard by
    shard, so memory holds one shard's tensors at a time."""
    out.mkdir()
    fp8, copied = _fp8_weights(tensors), _copied(tensors)
    reader = ShardReader(source, tensors)
    try:
        for file in sorted(set(copied.values())):
            names = sorted(name for name, f in copied.items() if f == file)
            shard = {name: _tensor(reader, name, name in fp8, dtype) for name in names}
            save_file(shard, out / file, {"format": "pt"})
    finally:
        reader.close()
    if (source / INDEX_FILE).exists():
        index = json.loads((source / INDEX_FILE).read_text())
        index.pop("metadata", None)  # its total_size counted FP8 bytes
        index["weight_map"] = copied
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    written = {"config.json", INDEX_FILE, SINGLE_FILE, *tensors.values()}
    for path in source.iterdir():  # the tokenizer, the generation config, the model's own code
        if path.is_file() and path.name not in written:
            shutil.copy2(path, out / path.name)


def _tensor(reader: ShardReader, name: str, fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    tensor, file = reader.get(name)
    if not fp8:
        return tensor.contiguous()
    scale, _ = reader.get(name + _SCALE_SUFFIX)
    try:
        if tensor.dtype != FP8:
            raise ValueError(f"has a {_SCALE_SUFFIX} partner but is {tensor.dtype}")
        return weight_dequant(tensor, scale, dtype=dtype)
    except ValueError as e:
        raise CheckpointError(f"{reader.model_dir / file}: tensor {name}: {e}") from None
