"""Worker configuration, in the sections used in the field (``[server]``,
``[model]``, ``[attention]``, ``[quantization]``, ``[parallel]``) plus
``[router]``, the registry the worker reports to."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from infermesh.config import load_config, section

DEFAULT_MODEL_PATH = "models/tiny-deepseek-v3"


@section
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 50061
    # The host:port the router dials; empty: host:bound port.
    advertise_address: str = ""
    # Stable identity in the registry; empty: derived from the advertised address.
    worker_id: str = ""


@section
class RouterSection:
    address: str = "127.0.0.1:50051"


@section
class ModelSection:
    path: str = DEFAULT_MODEL_PATH  # a local HF-format checkpoint directory
    name: str = ""                  # the id clients ask for; empty: the directory's name
    dtype: str = "auto"             # auto, bfloat16, float16 or float32

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype: expected auto, bfloat16, float16 or float32, got {self.dtype!r}")

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path).resolve().name


@section
class AttentionSection:
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings


@section
class QuantizationSection:
    use_native_fp8: bool | None = None  # None: FP8 where the hardware runs it


@section
class ParallelSection:
    max_parallel: int = 8  # sequences generated at once; more wait in a queue

    def __post_init__(self) -> None:
        if self.max_parallel < 1:
            raise ValueError(f"max_parallel: must be at least 1, got {self.max_parallel}")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    server: ServerSection = dataclasses.field(default_factory=ServerSection)
    router: RouterSection = dataclasses.field(default_factory=RouterSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    attention: AttentionSection = dataclasses.field(default_factory=AttentionSection)
    quantization: QuantizationSection = dataclasses.field(default_factory=QuantizationSection)
    parallel: ParallelSection = dataclasses.field(default_factory=ParallelSection)


def load(path: str | None) -> WorkerConfig:
    return load_config(WorkerConfig, path, "infermesh_worker")
