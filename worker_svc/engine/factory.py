"""The engine layer's factory: the engine ``[engine] kind`` names, built from the worker's config.
Only the checkpoint and vllm engines import torch, each on demand, so a simulated worker process
stays small."""

from __future__ import annotations

import asyncio
import os

from worker_svc.config import WorkerConfig
from worker_svc.engine.api import InferenceEngine
from worker_svc.sim_engine.engine import SimEngine
from worker_svc.torch_engine import threads


async def load_engine(config: WorkerConfig) -> InferenceEngine:
    """The engine ``[engine] kind`` names, loaded and ready to serve."""
    if config.engine.kind == "sim":
        return SimEngine.from_config(config)
    if config.engine.kind == "vllm":
        from worker_svc.vllm_engine.engine import VllmEngine

        return await VllmEngine.start(config)
    # before the engine's import brings torch, whose OpenMP runtime reads the policy as it loads
    threads.apply(
        threads.choose_threads(
            threads.available_cores(),
            config.engine.threads,
            config.engine.reserved_cores,
            config.engine.omp_wait_policy,
            os.environ,
        )
    )
    from worker_svc.torch_engine.engine import Engine

    return await asyncio.to_thread(
        Engine.from_checkpoint,
        config.model.path,
        dtype=config.model.dtype,
        use_native_fp8=config.quantization.use_native_fp8,
        max_model_len=config.attention.max_model_len,
        parallel=config.parallel,
        cache=config.cache,
        chat_template=config.model.chat_template or None,
        reasoning_format=config.model.configured_reasoning,
        cuda_graph_batch_sizes=config.engine.cuda_graph_batch_sizes,
        grouped_moe=config.engine.grouped_moe,
    )
