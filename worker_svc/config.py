"""Worker configuration, in the sections used in the field (``[server]``,
``[model]``, ``[attention]``, ``[quantization]``, ``[parallel]``, ``[cache]``) plus
``[router]``, the registry the worker reports to."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal, cast

from infermesh.config import ConfigError, MetricsSection, load_config, section
from infermesh.prefix_hash import BLOCK_TOKENS
from infermesh.text.chat_templates import REASONING_FORMATS, ReasoningFormat
from infermesh.tls import TlsSection
from worker_svc.hardware.gpu_profiles import gpu_profiles
from worker_svc.hardware.sizing import ModelSize, model_size_of

DEFAULT_MODEL_PATH = "models/tiny-deepseek-v3"


@section
class WorkerServerSection:
    # The address the worker's gRPC server listens on.
    host: str = "127.0.0.1"
    # The worker's gRPC port; 0: any free port (advertised as bound).
    port: int = 50061
    # The host:port the router dials; empty: host:bound port.
    advertise_address: str = ""
    # Stable identity in the registry; empty: derived from the advertised address.
    worker_id: str = ""


# The phases a worker serves (Capabilities.role): "prefill" workers compute prompts' KV blocks
# for "decode" workers, which take them and decode (prefill on P, decode on D); "both" does all.
Role = Literal["prefill", "decode", "both"]


@section
class WorkerSection:
    # prefill: never a request's worker, it prefills prompts for decode workers; decode: its
    # requests' prompts are prefilled on a prefill worker when the router has one; both: the
    # worker prefills its own (docs/OPERATING.md)
    role: Role = "both"
    # The worker's link zone (a rack, an NVLink or RDMA domain, a datacenter): the router prices
    # KV transfers to and from it by [routing] link_gbps within a zone and zone_link_gbps across
    # zones; empty: the unnamed zone
    zone: str = ""


@section
class RouterSection:
    # The router's gRPC target; several routers as the gateway's [router] address lists them:
    # registrations and heartbeats go round robin to the routers whose health check says
    # SERVING, so none goes to a router that cannot write it to the registry.
    address: str = "127.0.0.1:50051"


@section
class ModelSection:
    path: str = DEFAULT_MODEL_PATH  # a local HF-format checkpoint directory
    name: str = ""  # the id clients ask for; empty: the directory's name
    dtype: str = "auto"  # auto, bfloat16, float16 or float32
    # A Jinja chat template file served instead of the checkpoint's; empty: the checkpoint's, or
    # its family's tool template when the checkpoint's cannot render tool definitions.
    chat_template: str = ""
    # How the model reasons: "deepseek_r1" (it always thinks, between <think> and </think>, before
    # its answer), "deepseek_v3" (it thinks when a request's thinking is set: V3.1, V3.2), "" (it
    # does not); auto: as the served chat template says (R1's opens <think> in its generation
    # prompt, V3.1's and V3.2's read a `thinking` flag).
    reasoning_format: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"dtype: expected auto, bfloat16, float16 or float32, got {self.dtype!r}"
            )
        if self.reasoning_format != "auto" and self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(
                'reasoning_format: expected auto, "" (no reasoning), deepseek_r1 or deepseek_v3, '
                f"got {self.reasoning_format!r}"
            )

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path).resolve().name

    @property
    def configured_reasoning(self) -> ReasoningFormat | None:
        """reasoning_format, None for auto (checked in __post_init__)."""
        if self.reasoning_format == "auto":
            return None
        return cast(ReasoningFormat, self.reasoning_format)


@section
class AttentionSection:
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings


@section
class QuantizationSection:
    # None: FP8 where the engine runs it on this hardware; false: never (an FP8 checkpoint is
    # dequantized: at load by the checkpoint engine, into dequant_cache_dir for vLLM); true: FP8 or
    # the worker does not start
    use_native_fp8: bool | None = None
    # vllm only: where the dequantized copy of an FP8 checkpoint is written, once per checkpoint and
    # precision; empty: $XDG_CACHE_HOME/infermesh/dequant (~/.cache/infermesh/dequant)
    dequant_cache_dir: str = ""

    def cache_dir(self) -> Path:
        """dequant_cache_dir, or its default under the user's cache directory."""
        if self.dequant_cache_dir:
            return Path(self.dequant_cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "infermesh" / "dequant"


# The per-GPU batching knobs operators use in the field: (max_parallel, dynamic_batch_timeout_ms) by
# a name in the device name
_GPU_BATCHING_DEFAULTS = {"V100": (4, 200), "A100": (8, 150), "MI100": (4, 250)}
_OTHER_GPU_BATCHING_DEFAULTS = (8, 150)  # a GPU the table does not name: as the A100
# development: a batch as large as the benchmark's concurrency, no holding
_CPU_BATCHING_DEFAULTS = (32, 0)


@section
class ParallelSection:
    """Continuous batching: how many sequences run together and how requests wait for a place."""

    # most running sequences; None: the device's default (the table above)
    max_parallel: int | None = None
    # how long a waiting request may be held to form a larger batch; None: the device's default
    dynamic_batch_timeout_ms: int | None = None
    max_waiting: int = 256  # requests queued past the running batch; more get RESOURCE_EXHAUSTED
    # prompt tokens computed per step in all, so running decodes never stall long
    prefill_chunk_size: int = 256
    # the same when no sequence is decoding: nothing waits on the step, and a long prompt's
    # prefill costs less in fewer, larger steps (each step expands every cached latent of it
    # again). A step attending absorbed (V3.2's sparse prefill) holds scores of this many
    # queries over the whole context: lower it where those do not fit
    idle_prefill_chunk_size: int = 2048
    # Model parallelism across GPUs and nodes: only [engine] kind = "vllm" serves more than one GPU.
    tensor_parallel_size: int = 1
    # Pipeline stages the model's layers are split over (vllm only).
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = (
        1  # > 1: the routed experts spread over the tensor (x data) parallel ranks
    )

    def __post_init__(self) -> None:
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be at least 1, got {getattr(self, key)}")
        if self.max_parallel is not None and self.max_parallel < 1:
            raise ValueError(f"max_parallel: must be at least 1, got {self.max_parallel}")
        if self.dynamic_batch_timeout_ms is not None and self.dynamic_batch_timeout_ms < 0:
            raise ValueError(
                f"dynamic_batch_timeout_ms: must be >= 0, got {self.dynamic_batch_timeout_ms}"
            )
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if self.prefill_chunk_size < 1:
            raise ValueError(
                f"prefill_chunk_size: must be at least 1, got {self.prefill_chunk_size}"
            )
        if self.idle_prefill_chunk_size < self.prefill_chunk_size:
            raise ValueError(
                f"idle_prefill_chunk_size: must be at least prefill_chunk_size "
                f"({self.prefill_chunk_size}), got {self.idle_prefill_chunk_size}"
            )

    def resolved(self, device: str, device_name: str) -> Batching:
        """This section with the unset knobs taken from the defaults for the device
        ("cuda"/"rocm"/"cpu")."""
        defaults = (
            _CPU_BATCHING_DEFAULTS
            if device == "cpu"
            else next(
                (v for k, v in _GPU_BATCHING_DEFAULTS.items() if k in device_name),
                _OTHER_GPU_BATCHING_DEFAULTS,
            )
        )
        return Batching(
            max_parallel=defaults[0] if self.max_parallel is None else self.max_parallel,
            dynamic_batch_timeout_ms=defaults[1]
            if self.dynamic_batch_timeout_ms is None
            else self.dynamic_batch_timeout_ms,
            max_waiting=self.max_waiting,
            prefill_chunk_size=self.prefill_chunk_size,
            idle_prefill_chunk_size=self.idle_prefill_chunk_size,
        )


@dataclasses.dataclass(frozen=True)
class Batching:
    """A ParallelSection resolved for a device: every knob set."""

    max_parallel: int
    dynamic_batch_timeout_ms: int
    max_waiting: int
    prefill_chunk_size: int
    idle_prefill_chunk_size: int


MIN_CPU_CACHE_BYTES = 64 * 2**20


@section
class CacheSection:
    """The paged MLA latent cache."""

    block_size: int = 16  # tokens per block
    # share of device memory for weights, activations and the cache
    gpu_memory_utilization: float = 0.9
    # the cache's size on a CPU; unset: one whole context of max_model_len (a 163840-token context
    # of the tiny model is 115-230 MB), and no less than MIN_CPU_CACHE_BYTES
    cpu_cache_bytes: int | None = None
    enable_prefix_caching: bool = True  # reuse the cache of a prompt prefix already computed
    swap_space: float | None = (
        None  # GiB of host memory for preempted sequences' cache (vLLM V0 only)
    )
    # Worker.CacheEvents: the recent events kept for a router that reconnects (more missed: a
    # snapshot), and the events a subscriber may fall behind before it is dropped to resync
    events_history: int = 65536
    # The events a subscriber may fall behind before it is dropped to resync.
    events_backlog: int = 65536

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size % BLOCK_TOKENS:
            raise ValueError(
                f"block_size: must be a positive multiple of {BLOCK_TOKENS} (the blocks the mesh "
                f"names cached prefixes by), got {self.block_size}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for key in ("events_history", "events_backlog"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be at least 1, got {getattr(self, key)}")
        if self.cpu_cache_bytes is not None and self.cpu_cache_bytes < 1:
            raise ValueError(f"cpu_cache_bytes: must be at least 1, got {self.cpu_cache_bytes}")

    def cpu_budget_bytes(self, context_bytes: int) -> int:
        """The cache's size on a CPU, given what one whole context of max_model_len takes."""
        if self.cpu_cache_bytes is not None:
            return self.cpu_cache_bytes
        return max(MIN_CPU_CACHE_BYTES, context_bytes)


_SIZE_KEYS = (
    "total_params_b",
    "active_params_b",
    "kv_bytes_per_token",
    "index_topk",
    "index_bytes_per_token",
)
_SIZE_DEFAULTS = {
    "total_params_b": 8.0,
    "active_params_b": 8.0,
    "kv_bytes_per_token": 131072,
    "index_topk": 0,
    "index_bytes_per_token": 0,
}


# A fourth engine adds its name here and a branch in worker_svc.engine.factory.load_engine.
EngineKind = Literal["checkpoint", "sim", "vllm"]
# [engine] omp_wait_policy: how idle OpenMP threads wait (worker_svc/torch_engine/threads.py)
WaitPolicy = Literal["auto", "passive", "active", "runtime"]
AUTO_THREADS = 0  # [engine] threads: chosen from the cores available


@section
class EngineSection:
    """Which engine serves: the checkpoint at [model] path, or a simulated GPU (no model)."""

    kind: EngineKind = "checkpoint"  # vllm: the checkpoint served by vLLM (`make vllm`)
    # sim only: a profile of gpu_profiles.toml, how many of them, and the model.
    gpu: str = "H100"
    # 0: the fewest that hold the weights (in the GPU's precision) and a KV budget of
    # [parallel] max_parallel sequences of kv_budget_tokens (worker_svc/hardware/sizing.py)
    gpu_count: int = 0
    # sim only: the KV cache tokens each of max_parallel sequences is sized for (with gpu_count 0).
    kv_budget_tokens: int = 4096
    # The model: a bundled config of worker_svc/model/configs/ ("DeepSeek-V3", "DeepSeek-V2-Lite",
    # ...), a checkpoint directory or a config.json; or, unset, the sizes below (defaults where
    # unset: 8B dense, 128 KiB of KV cache per token). index_topk > 0 simulates DeepSeek-V3.2's
    # sparse attention: each query attends to at most index_topk tokens, after the indexer scored
    # all of them, reading index_bytes_per_token of cached indexer keys per token.
    model: str = ""
    total_params_b: float | None = None  # billions of weights held in memory
    active_params_b: float | None = None  # billions read per token (MoE: the active experts)
    # bytes of KV cache per token, all layers
    kv_bytes_per_token: int | None = None
    # V3.2: the tokens each query attends to (0: dense attention)
    index_topk: int | None = None
    # V3.2: bytes of cached indexer keys per token, all layers
    index_bytes_per_token: int | None = None
    zero_latency: bool = False  # tokens at once: for measuring the mesh's own overhead
    # sim only, attention: FLOPs of one query attending to one cached token (all layers; 0 leaves
    # its compute out), and (V3.2) of the indexer scoring one cached token for one query.
    attention_flops_per_key: float = 0.0
    # sim only, V3.2: FLOPs of the indexer scoring one cached token for one query.
    index_flops_per_key: float = 0.0
    # sim only: the link its KV blocks cross to a peer (Worker.KVBlocks), gigabits a second (0:
    # instant), as the router's [routing] link_gbps
    link_gbps: float = 0.0
    # sim only: its KV blocks carry their bytes to a peer (zeros, kv_transfer_bytes_per_token a
    # token), so that a real network's speed counts; false: they carry none
    kv_block_bytes: bool = False
    # sim only: wall seconds per simulated second (4: steps and transfers four times slower, its
    # reported speeds too, so that a busy machine's jitter weighs less in what it times)
    time_scale: float = 1.0
    # checkpoint only, the CPU thread policy (worker_svc/torch_engine/threads.py): torch's OpenMP
    # threads (0: the cores available less reserved_cores, at least one), the cores left to the
    # services beside the worker (gateway, router, Redis, a client), and how idle threads wait
    # (auto: passive; runtime: libgomp's default)
    threads: int = AUTO_THREADS
    # checkpoint only: cores left to the services beside the worker when threads is 0.
    reserved_cores: int = 1
    # checkpoint only: how idle OpenMP threads wait (auto: passive; runtime: libgomp's default).
    omp_wait_policy: WaitPolicy = "auto"
    # checkpoint only, on a CUDA GPU: decode steps of up to this many sequences replay a CUDA graph
    # of the step captured for the next size up (keys padded to a power of two, at least 256); a
    # larger batch, a prefill step, or a size whose capture failed (one warning) runs eager. []: off
    cuda_graph_batch_sizes: list[int] = dataclasses.field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64]
    )
    # checkpoint only, on a CUDA GPU Triton compiles for: a MoE layer's routed experts run as two
    # grouped launches without host synchronisation (false: one by one, the reference loop, which
    # a CUDA graph cannot capture)
    grouped_moe: bool = True
    # vllm only: vLLM engine arguments past those the other sections set ([engine.vllm] table; the
    # environment's INFERMESH_WORKER_ENGINE_VLLM takes a JSON object)
    vllm: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0 (0: auto), got {self.threads}")
        if self.reserved_cores < 0:
            raise ValueError(f"reserved_cores: must be >= 0, got {self.reserved_cores}")
        if self.link_gbps < 0:
            raise ValueError(f"link_gbps: must be >= 0, got {self.link_gbps}")
        if any(size < 1 for size in self.cuda_graph_batch_sizes):
            raise ValueError(
                f"cuda_graph_batch_sizes: each must be >= 1, got {self.cuda_graph_batch_sizes}"
            )
        if self.time_scale <= 0:
            raise ValueError(f"time_scale: must be positive, got {self.time_scale}")
        if self.gpu not in gpu_profiles():
            raise ValueError(
                f"gpu: unknown profile {self.gpu!r}; known: {', '.join(gpu_profiles())}"
            )
        if self.model:
            try:
                model_size_of(self.model)
            except ValueError as e:
                raise ValueError(f"model: {e}") from None
        given = [key for key in _SIZE_KEYS if getattr(self, key) is not None]
        if self.model and given:
            raise ValueError(
                f"model: {self.model!r} sets the sizes; {', '.join(given)} must be left unset"
            )
        size = self.size()
        if self.gpu_count < 0 or size.kv_values_per_token < 1 or self.kv_budget_tokens < 1:
            raise ValueError(
                "need gpu_count >= 0, kv_bytes_per_token >= 1 and kv_budget_tokens >= 1"
            )
        if (
            min(
                self.attention_flops_per_key,
                size.index_topk,
                size.index_values_per_token,
                self.index_flops_per_key,
            )
            < 0
        ):
            raise ValueError(
                "attention_flops_per_key, index_topk, index_bytes_per_token and "
                "index_flops_per_key must be >= 0"
            )
        if not 0 < size.active_params <= size.params:
            raise ValueError(
                f"need 0 < active_params_b ({size.active_params / 1e9}) "
                f"<= total_params_b ({size.params / 1e9})"
            )

    def size(self) -> ModelSize:
        """The simulated model's sizes: the `model`'s config.json's, or the keys' (defaults where
        unset)."""
        if self.model:
            return model_size_of(self.model)
        total, active, kv, topk, index = (
            _SIZE_DEFAULTS[key] if getattr(self, key) is None else getattr(self, key)
            for key in _SIZE_KEYS
        )
        return ModelSize.of_params("sim", total * 1e9, active * 1e9, int(kv), int(index), int(topk))


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    server: WorkerServerSection = dataclasses.field(default_factory=WorkerServerSection)
    worker: WorkerSection = dataclasses.field(default_factory=WorkerSection)
    router: RouterSection = dataclasses.field(default_factory=RouterSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    attention: AttentionSection = dataclasses.field(default_factory=AttentionSection)
    quantization: QuantizationSection = dataclasses.field(default_factory=QuantizationSection)
    parallel: ParallelSection = dataclasses.field(default_factory=ParallelSection)
    cache: CacheSection = dataclasses.field(default_factory=CacheSection)
    engine: EngineSection = dataclasses.field(default_factory=EngineSection)
    metrics: MetricsSection = dataclasses.field(default_factory=MetricsSection)
    tls: TlsSection = dataclasses.field(default_factory=TlsSection)

    def __post_init__(self) -> None:
        if self.engine.kind != "vllm":
            p = self.parallel
            many = [
                k
                for k in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size")
                if getattr(p, k) > 1
            ]
            if many:
                raise ValueError(
                    f"[parallel] {many[0]}: the {self.engine.kind} engine serves on one device; "
                    'set [engine] kind = "vllm" to spread a model over GPUs'
                )


def load(path: str | None) -> WorkerConfig:
    try:
        return load_config(WorkerConfig, path, "infermesh_worker")
    except ConfigError:
        raise
    except ValueError as e:  # a check across sections (WorkerConfig.__post_init__)
        raise ConfigError(f"{path or 'worker config'}: {e}") from None
