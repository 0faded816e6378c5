"""Tiny DeepSeek-V3 and DeepSeek-V2 checkpoints, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.tiny_model import (
    write_tiny_checkpoint,
    write_v2_checkpoint,
    write_variant_checkpoint,
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny checkpoint: 2 layers, n_group 2, DeepSeek-V3's YaRN and context."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The second config: 3 layers, YaRN, n_group 4 / topk_group 2, q_lora_rank null."""
    return write_variant_checkpoint(tmp_path_factory.mktemp("variant"))


@pytest.fixture(scope="session")
def v2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-V2: BF16, softmax gate, group-limited greedy, 3 layers, YaRN."""
    return write_v2_checkpoint(tmp_path_factory.mktemp("v2"))


@pytest.fixture(scope="session")
def v2_lite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V2-Lite's shape: q_lora_rank null, greedy routing over all experts."""
    return write_v2_checkpoint(tmp_path_factory.mktemp("v2-lite"), lite=True)


@pytest.fixture(scope="session")
def v32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint as DeepSeek-V3.2: each layer with a sparse-attention indexer (index_topk
    12)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v32"), v32=True)


@pytest.fixture(scope="session")
def v32_variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The V3.2 checkpoint with the variant's YaRN, n_group 4 / topk_group 2 and 3 layers."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v32-variant"), variant=True, v32=True)


@pytest.fixture(params=["tiny", "variant", "v2", "v2_lite"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")
