"""vLLM as the worker's engine (`[engine] kind = "vllm"`): for checkpoints that need many GPUs or
nodes.

vLLM's `AsyncLLM` runs in this process (its EngineCore and GPU workers in child processes) and does
the batching, tensor/expert/pipeline parallelism and FP8 kernels. Where those FP8 kernels do not run
on this hardware (args.Devices.vllm_fp8), or the config says not to, an FP8 checkpoint is served
from its dequantized copy (worker_svc.model.dequant_cache), in the precision policy's dtype. The
worker keeps its own front: it renders the chat template and tokenizes as for the torch engine and
hands vLLM token ids, checks requests with the same rules, and bounds the waiting queue; vLLM
detokenizes, applies stop strings and samples, enforcing the worker's grammar of a request's tools
and JSON schema with its guidance backend. With tools, or a reasoning model's turn, the worker
decodes the tokens itself (worker_svc.decoding.completion_decoder), as the torch engine does, into
text, reasoning and tool-call pieces; vLLM's own reasoning parser (R1's think tags) holds the
grammar back until the thinking closes and keeps the thinking budget (its thinking_token_budget).
Load comes from vLLM's own scheduler stats (running, waiting, KV-cache use) through a stat logger,
and vLLM's Prometheus metrics land in the process's default registry, which the worker's metrics
port serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import torch
from opentelemetry import propagate
from vllm import SamplingParams as VllmSamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.logprobs import Logprob
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.outputs import RequestOutput
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, RequestStateStats, SchedulerStats

from infermesh.config import ConfigError
from infermesh.names import FinishReason, Precision
from infermesh.text.chat_templates import THINK, THINK_END
from infermesh.text.tokenizer import Tokenizer
from worker_svc.config import Batching, WorkerConfig
from worker_svc.decoding.completion_decoder import CompletionDecoder, TokenEnd
from worker_svc.decoding.grammar import lark_grammar
from worker_svc.decoding.reasoning_parser import thinking_of
from worker_svc.decoding.tool_parser import ToolMarkers
from worker_svc.engine.api import (
    DeviceCapabilities,
    EngineClosedError,
    EngineLoad,
    GenerationChunk,
    GenerationRequest,
    InvalidArgumentError,
    SamplingParams,
    TokenLogprob,
    ToolCallDelta,
)
from worker_svc.engine.cache_events import CacheEvents
from worker_svc.engine.meters import DecodeRateMeter, PrefillSpeedMeter
from worker_svc.engine.prompt_ids import prompt_token_ids
from worker_svc.engine.request_front import RequestFront
from worker_svc.model.checkpoint import CheckpointError
from worker_svc.model.dequant_cache import dequantized_checkpoint
from worker_svc.model.precision import (
    TORCH_DTYPES,
    choose_precision,
    cpu_has_native_bf16,
    probe_device,
    resolve_device,
)
from worker_svc.vllm_engine.args import (
    VLLM_FP8_NEEDS,
    Devices,
    check_fp8,
    check_known,
    check_mla_head,
    cpu_mla_backend,
    engine_args,
    fp8_checkpoint,
    known_engine_args,
)
from worker_svc.vllm_engine.kv_events import VllmKvEvents
from worker_svc.vllm_engine.output_tail import OutputTail, start_failure

logger = logging.getLogger(__name__)

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
# How often the worker looks whether vLLM's engine core still runs, where no request of its own
# found out first: vLLM marks it dead from a monitor thread, without a callback
_DEATH_POLL_S = 0.2
_ENGINE_DEAD = "vLLM's engine core died"


class _LoadMeter:
    """vLLM's scheduler stats as the worker's load, and its requests' prefills as the worker's
    measured prefill speed; fed by `_StatLogger` on AsyncLLM's output task."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._load = EngineLoad(0, 0, 0.0)
        self._rate = DecodeRateMeter()
        self._prefill = PrefillSpeedMeter()

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats | None) -> None:
        with self._lock:
            if scheduler is not None:
                self._load = EngineLoad(
                    scheduler.num_running_reqs,
                    scheduler.num_waiting_reqs,
                    0.0,
                    scheduler.kv_cache_usage,
                )
            if iteration is None:
                return
            if iteration.num_generation_tokens:
                self._rate.add(iteration.num_generation_tokens)
            for finished in iteration.finished_requests:
                # scheduled to first token: the prompt's uncached tokens and the decodes
                # batched with them, as the torch engine measures its prefill steps
                self._prefill.add(
                    finished.num_prompt_tokens - finished.num_cached_tokens, finished.prefill_time
                )

    def load(self) -> EngineLoad:
        with self._lock:
            return dataclasses.replace(
                self._load,
                tokens_per_second=self._rate.rate(),
                prefill_tokens_per_second=self._prefill.speed(),
            )


def _stat_logger(meter: _LoadMeter) -> Any:
    """A vLLM stat logger class (vLLM instantiates it per engine) that feeds ``meter``."""

    class _StatLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM ships no type information
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._meter = meter

        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            self._meter.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _StatLogger


class VllmEngine:
    """The InferenceEngine protocol over vLLM's AsyncLLM; start with `start(config)`."""

    def __init__(
        self,
        llm: AsyncLLM,
        tokenizer: Tokenizer,
        capabilities: DeviceCapabilities,
        max_model_len: int,
        vocab_size: int,
        parallel: Batching,
        meter: _LoadMeter,
        kv_events: VllmKvEvents,
    ) -> None:
        self._llm, self.tokenizer, self.capabilities = llm, tokenizer, capabilities
        self.text_files = tokenizer.text_files
        self._markers = ToolMarkers.of(tokenizer)
        self.max_model_len = max_model_len
        self._kv_events = kv_events
        self.cache_events = kv_events.events
        self._front = RequestFront(
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            max_parallel=parallel.max_parallel,
            max_waiting=parallel.max_waiting,
        )
        self._meter = meter
        self._dead = asyncio.Event()  # a request found vLLM's engine core dead

    @classmethod
    async def start(cls, config: WorkerConfig) -> VllmEngine:
        """Checks the config against this machine, dequantizes an FP8 checkpoint where vLLM cannot
        run FP8 (once: the copy is cached), then starts vLLM (slow: it loads and profiles the
        model)."""
        devices = _devices()
        fp8 = fp8_checkpoint(config.model.path)
        check_known(config.engine.vllm, known_engine_args())
        check_fp8(config, devices, fp8)
        precision = _precision(config, devices, fp8)
        args = engine_args(config, devices, precision)
        if not devices.gpu_count:  # a GPU's MLA backend is vLLM's choice among many, at start
            backend = cpu_mla_backend(config, devices, precision)
            check_mla_head(config, backend, _mla_head_sizes(backend))
        if "structured_outputs_config" in config.engine.vllm:
            raise ConfigError(
                "[engine.vllm] structured_outputs_config: the worker sets it (the guidance "
                "backend runs its grammars)"
            )
        if "reasoning_parser" in config.engine.vllm:
            raise ConfigError(
                "[engine.vllm] reasoning_parser: the worker sets it (from [model] reasoning_format)"
            )
        if "kv_events_config" in config.engine.vllm:
            raise ConfigError(
                "[engine.vllm] kv_events_config: the worker sets it (it reads vLLM's cache events "
                "for Worker.CacheEvents)"
            )
        # the worker's grammars (worker_svc.decoding.grammar) are llguidance's Lark
        args["structured_outputs_config"] = StructuredOutputsConfig(backend="guidance")
        tokenizer = Tokenizer(config.model.path, config.model.chat_template or None)
        reasoning = config.model.configured_reasoning
        if reasoning is None:
            reasoning = tokenizer.reasoning_format
        if reasoning:
            if _has_think_tokens(tokenizer):
                # both formats' thinking opens in the prompt (V3.1's when asked): R1's parser
                # reads from the prompt's last tag whether a sequence is thinking
                args["reasoning_parser"] = "deepseek_r1"
            else:
                logger.warning(
                    "the think tags are not tokens of this tokenizer: on vLLM, grammars apply to "
                    "the thinking too and thinking budgets are not kept"
                )
        if config.cache.swap_space is not None:
            logger.warning(
                "[cache] swap_space is ignored: vLLM's V1 engine recomputes preempted sequences"
            )
        if not devices.gpu_count:
            # vLLM binds its OpenMP threads to cores by default: on a shared host, cores others use
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if fp8 and precision != "fp8":
            try:
                copy = await asyncio.to_thread(
                    dequantized_checkpoint,
                    config.model.path,
                    config.quantization.cache_dir(),
                    TORCH_DTYPES[precision],
                )
            except CheckpointError as e:  # a broken checkpoint, or no room for the copy
                raise ConfigError(f"[model] path: no {precision} copy for vLLM: {e}") from None
            args["model"] = str(copy)
        _check_engine_args(args, config.engine.vllm)
        meter = _LoadMeter()
        output = OutputTail()
        kv_events = VllmKvEvents(
            CacheEvents(config.cache.events_history, config.cache.events_backlog)
        )
        args["kv_events_config"] = kv_events.config
        if int(args.get("data_parallel_size", 1)) > 1:
            # vLLM's rank r publishes to the endpoint's port + r, where nobody listens
            logger.warning("Worker.CacheEvents reports data-parallel rank 0's prefix cache only")
        try:
            with output.capture():
                llm = AsyncLLM.from_engine_args(
                    AsyncEngineArgs(**args), stat_loggers=[_stat_logger(meter)]
                )
        except RuntimeError as e:  # an EngineCore process failed: its output has the cause
            kv_events.close()
            output.drain()
            raise ConfigError(start_failure(e, output.cause())) from None
        except BaseException:
            kv_events.close()
            raise
        model_config = llm.vllm_config.model_config
        served = (
            "fp8"
            if model_config.quantization == "fp8"
            else _PRECISIONS.get(model_config.dtype, "bf16")
        )
        capabilities = dataclasses.replace(
            _capabilities(config, devices, served, llm, Path(args["model"])),
            reasoning_format=reasoning,
        )
        parallel = config.parallel.resolved(capabilities.device, capabilities.device_name)
        assert parallel.max_parallel is not None, "resolved above"
        logger.info(
            "vLLM serving %s in %s on %s (max_model_len %d)",
            args["model"],
            served,
            capabilities.device_name,
            model_config.max_model_len,
        )
        return cls(
            llm,
            tokenizer,
            capabilities,
            model_config.max_model_len,
            model_config.get_vocab_size(),
            parallel,
            meter,
            kv_events,
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Streams the completion; closing the iterator aborts the vLLM request."""
        self._front.check(request)
        prompt, params = self._prepare(request)
        with self._front.admitted():
            async with contextlib.aclosing(self._run(request, prompt, params)) as chunks:
                async for chunk in chunks:
                    yield chunk

    async def _run(
        self, request: GenerationRequest, prompt: TokensPrompt, params: VllmSamplingParams
    ) -> AsyncGenerator[GenerationChunk, None]:
        """vLLM's outputs for an admitted request, as chunks; a request that ends early is aborted
        in vLLM."""
        carrier: dict[str, str] | None = None
        if self._llm.vllm_config.observability_config.otlp_traces_endpoint:  # vLLM traces too
            carrier = {}
            propagate.inject(carrier)
        finished = False
        completion_tokens = 0
        # with tools or thinking, text, reasoning and calls come from the worker's own decoding of
        # the tokens, as on the torch engine; vLLM's text (markers skipped) cannot tell a call's
        # arguments from text, nor the thinking from the answer
        thinking = thinking_of(self.tokenizer, self.capabilities.reasoning_format, request)
        decoder = (
            CompletionDecoder(
                self.tokenizer, request.sampling.stop, request.constraints, self._markers, thinking
            )
            if request.constraints.tools or thinking is not None
            else None
        )
        try:
            async for out in self._llm.generate(
                prompt, params, request.request_id, trace_headers=carrier
            ):
                chunk = self._chunk(
                    out,
                    len(prompt["prompt_token_ids"]),
                    completion_tokens,
                    request.sampling,
                    decoder,
                )
                completion_tokens = chunk.completion_tokens
                finished = out.finished
                if chunk.token_ids or chunk.text or chunk.finish_reason is not None:
                    yield chunk
            if not finished:
                raise EngineClosedError("vLLM ended the request before it finished")
        except VLLMValidationError as e:  # the grammar, refused before generation starts
            raise InvalidArgumentError(
                f"the tools or json_schema cannot be enforced: {e}"
            ) from None
        except EngineDeadError:
            self._dead.set()
            raise EngineClosedError(_ENGINE_DEAD) from None
        finally:
            if not finished:
                await self._llm.abort(request.request_id)

    def prompt_tokens(self, request: GenerationRequest) -> int:
        self._front.check(request)
        return len(prompt_token_ids(self.tokenizer, request))

    def load(self) -> EngineLoad:
        return self._meter.load()

    async def died(self) -> str:
        """Returns once vLLM's engine core is dead: at once when a request found out, else within
        _DEATH_POLL_S of vLLM noticing its process gone."""
        while not self._llm.errored:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dead.wait(), _DEATH_POLL_S)
        return f"{_ENGINE_DEAD}: it can serve no more requests"

    async def close(self) -> None:
        self._front.close()
        self._llm.shutdown()
        self._kv_events.close()

    def _prepare(self, request: GenerationRequest) -> tuple[TokensPrompt, VllmSamplingParams]:
        """The checked request as vLLM's prompt and sampling params."""
        ids = prompt_token_ids(self.tokenizer, request)  # renders tools as for the torch engine
        p = request.sampling
        budget = self._front.budget(len(ids), p.max_tokens)
        constraints = request.constraints
        grammar = lark_grammar(constraints, self._markers) if constraints.active else None
        thinking = thinking_of(self.tokenizer, self.capabilities.reasoning_format, request)
        # vLLM keeps the budget where its reasoning parser runs (the think tags are tokens)
        keeps_budget = self._llm.vllm_config.reasoning_config is not None
        thinking_budget = (
            thinking.budget
            if keeps_budget and thinking is not None and thinking.parser.thinking
            else None
        )
        params = VllmSamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            max_tokens=budget,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids),
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            logprobs=p.top_logprobs if p.logprobs else None,
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=True,
            structured_outputs=StructuredOutputsParams(grammar=grammar) if grammar else None,
            thinking_token_budget=thinking_budget,
        )
        return TokensPrompt(prompt_token_ids=ids), params

    def _chunk(
        self,
        out: RequestOutput,
        prompt_tokens: int,
        done: int,
        sampling: SamplingParams,
        decoder: CompletionDecoder | None,
    ) -> GenerationChunk:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        finish: FinishReason | None = None
        if out.finished:
            # "abort": vLLM dropped the request itself (ours are dropped by the consumer leaving)
            if completion.finish_reason not in _FINISH_REASONS:
                raise RuntimeError(
                    f"vLLM ended request {out.request_id} with {completion.finish_reason!r}"
                )
            finish = _FINISH_REASONS[completion.finish_reason]
        text, calls, reasoning = completion.text, None, ""
        if decoder is not None:
            reasoning, text, calls, finish = _decode(
                decoder, tokens, finish, completion.stop_reason
            )
        logprobs = None
        if sampling.logprobs:
            logprobs = [
                self._logprob(token, alternatives, sampling.top_logprobs)
                for token, alternatives in zip(tokens, completion.logprobs or (), strict=False)
            ]
        queue_s = 0.0
        stats = out.metrics  # RequestStateStats: engine-core timestamps, 0 until set
        if (
            done == 0
            and isinstance(stats, RequestStateStats)
            and stats.scheduled_ts
            and stats.queued_ts
        ):
            queue_s = max(stats.scheduled_ts - stats.queued_ts, 0.0)
        return GenerationChunk(
            text,
            tokens,
            finish,
            prompt_tokens,
            done + len(tokens),
            out.num_cached_tokens or 0,
            logprobs,
            queue_s,
            calls,
            reasoning,
            0 if decoder is None else decoder.reasoning_tokens,
        )

    def _logprob(self, token: int, alternatives: dict[int, Logprob], top: int) -> TokenLogprob:
        decode = self.tokenizer.decode
        ranked = sorted(alternatives.items(), key=lambda kv: kv[1].rank or 0)[:top]
        return TokenLogprob(
            decode([token]),
            alternatives[token].logprob,
            tuple(TokenLogprob(decode([i]), lp.logprob) for i, lp in ranked),
        )


def _decode(
    decoder: CompletionDecoder,
    tokens: list[int],
    finish: FinishReason | None,
    stop_reason: int | str | None,
) -> tuple[str, str, list[ToolCallDelta] | None, FinishReason | None]:
    """A delta's tokens through the worker's decoder. vLLM keeps a stop token (an eos, or one of
    stop_token_ids: its `stop_reason` is not a stop string) as the last of a finished request's
    tokens; a stop string, which vLLM stopped at too, the decoder finds itself."""
    last_end: TokenEnd | None = None
    if finish == "length":
        last_end = "length"
    elif finish == "stop" and not isinstance(stop_reason, str):
        last_end = "stop_token"
    reasoning, text, calls, decoded_finish = "", "", list[ToolCallDelta](), None
    for i, token in enumerate(tokens):
        if decoder.stopped:
            break
        decoded = decoder.add(token, last_end if i == len(tokens) - 1 else None)
        reasoning += decoded.reasoning_text
        text += decoded.text
        calls += decoded.tool_calls or ()
        decoded_finish = decoded.finish or decoded_finish
    return reasoning, text, calls or None, decoded_finish or finish


def _has_think_tokens(tokenizer: Tokenizer) -> bool:
    """Both think tags are tokens of the vocabulary, as vLLM's reasoning parser needs."""
    vocab = tokenizer.hf.get_vocab()
    return THINK in vocab and THINK_END in vocab


def _precision(config: WorkerConfig, devices: Devices, fp8: bool) -> Precision:
    """The policy's choice for vLLM on these devices, logged with its reason."""
    try:
        choice = choose_precision(
            devices.kind,
            devices.compute_capability,
            fp8_gemm=devices.vllm_fp8,
            fp8_needs=VLLM_FP8_NEEDS[devices.kind],
            cpu_has_bf16=cpu_has_native_bf16(),
            dtype=config.model.dtype,
            use_native_fp8=config.quantization.use_native_fp8,
            fp8_weights=fp8,
        )
    except ValueError as e:
        raise ConfigError(f"[model] dtype: {e}") from None
    logger.info("vLLM on %s: serving %s (%s)", devices.name, choice.precision, choice.reason)
    return choice.precision


_PRECISIONS: dict[torch.dtype, Precision] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
}


def _devices() -> Devices:
    """The GPUs present, asked through vLLM's platform (NVML): initializing CUDA in this process
    before vLLM starts its GPU workers would force them onto the slower spawn start."""
    if not current_platform.is_cuda_alike():  # CUDA or ROCm
        # the check vLLM's CPU FP8 kernels make themselves
        return Devices(0, cpu_amx=torch.cpu._is_amx_tile_supported())
    capability = current_platform.get_device_capability()
    cc = f"{capability.major}.{capability.minor}" if capability is not None else ""
    return Devices(current_platform.device_count(), cc, rocm=current_platform.is_rocm())


def _mla_head_sizes(backend: str) -> list[int]:
    """The MLA latent widths vLLM runs on attention `backend`: the backend's own that its shared
    MLA metadata also accepts (it checks every request's)."""
    shared = MLACommonBackend.get_supported_head_sizes()
    own = AttentionBackendEnum[backend].get_class().get_supported_head_sizes()
    return [size for size in own or shared if size in shared]


def _check_engine_args(args: dict[str, Any], passed: dict[str, Any]) -> None:
    """Raises ConfigError naming the argument vLLM refuses: vLLM's own messages often do not name
    it, so each `[engine.vllm]` key is tried alone over the mapped sections."""
    try:
        AsyncEngineArgs(**args).create_engine_config()
        return
    except (ValueError, TypeError) as e:
        refusal = e
    mapped = {k: v for k, v in args.items() if k not in passed}
    for key, value in passed.items():
        try:
            AsyncEngineArgs(**mapped, **{key: value}).create_engine_config()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"[engine.vllm] {key} = {value!r}: vLLM refused it: {e}") from None
    raise ConfigError(
        f"vLLM refused the engine arguments of [model], [attention], [cache] and [parallel] "
        f"({', '.join(f'{k}={v!r}' for k, v in mapped.items())}): {refusal}"
    ) from None


def _capabilities(
    config: WorkerConfig, devices: Devices, served: Precision, llm: AsyncLLM, model_dir: Path
) -> DeviceCapabilities:
    """What the router is told: the device, what vLLM runs, the weights' (as served, from
    model_dir) and the KV cache's memory."""
    probed = probe_device(resolve_device())
    gpus = (
        config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size
        if devices.gpu_count
        else 1
    )
    hf_config = llm.vllm_config.model_config.hf_config
    cache = llm.vllm_config.cache_config
    latent = getattr(hf_config, "kv_lora_rank", 0) + getattr(hf_config, "qk_rope_head_dim", 0)
    itemsize = (
        1 if cache.cache_dtype.startswith("fp8") else llm.vllm_config.model_config.dtype.itemsize
    )
    per_token = latent * hf_config.num_hidden_layers * itemsize
    return dataclasses.replace(
        probed,
        precision=served,
        memory_total_bytes=probed.memory_total_bytes * gpus,
        gpu_count=gpus,
        weight_bytes=sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
        kv_cache_bytes=(cache.num_gpu_blocks or 0) * cache.block_size * per_token,
        model_type=str(getattr(hf_config, "model_type", "")),
    )
