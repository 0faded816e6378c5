"""Tiny DeepSeek-V3 and DeepSeek-V2 checkpoints, written once per run; Triton's interpreter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.tiny_model import (
    write_tiny_checkpoint,
    write_v2_checkpoint,
    write_variant_checkpoint,
)
from tests.helpers.checkpoints import written_once
from tests.helpers.triton_interpreter import TritonInterpreter


@pytest.fixture(scope="session")
def interpreter() -> Iterator[TritonInterpreter]:
    """Triton's interpreter in a process of its own, shared by the Triton kernels' tests."""
    process = TritonInterpreter()
    try:
        yield process
    finally:
        process.close()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint: 2 layers, n_group 2, DeepSeek-V3's YaRN and context."""
    return written_once(tmp_path_factory, "tiny", write_tiny_checkpoint)


@pytest.fixture(scope="session")
def variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The second config: 3 layers, YaRN, n_group 4 / topk_group 2, q_lora_rank null."""
    return written_once(tmp_path_factory, "variant", write_variant_checkpoint)


@pytest.fixture(scope="session")
def v2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-V2: BF16, softmax gate, group-limited greedy, 3 layers, YaRN."""
    return written_once(tmp_path_factory, "v2", write_v2_checkpoint)


@pytest.fixture(scope="session")
def v2_lite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V2-Lite's shape: q_lora_rank null, greedy routing over all experts."""
    return written_once(
        tmp_path_factory, "v2-lite", lambda out: write_v2_checkpoint(out, lite=True)
    )


@pytest.fixture(scope="session")
def v32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint as DeepSeek-V3.2: each layer with a sparse-attention indexer (index_topk
    12)."""
    return written_once(tmp_path_factory, "v32", lambda out: write_tiny_checkpoint(out, v32=True))


@pytest.fixture(scope="session")
def v32_variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The V3.2 checkpoint with the variant's YaRN, n_group 4 / topk_group 2 and 3 layers."""
    return written_once(
        tmp_path_factory,
        "v32-variant",
        lambda out: write_tiny_checkpoint(out, variant=True, v32=True),
    )


@pytest.fixture(params=["tiny", "variant", "v2", "v2_lite"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")
