"""In-process generation with a transformers causal LM: continuous batching over a KV cache.

State machine (one decode step at a time, under ``_step_lock``):

- ``generate`` puts its requests on a queue and waits for their futures.
- The background decode loop (an asyncio task) runs one *step* at a time in a one-thread
  executor, so the event loop keeps accepting requests, weight updates and aborts meanwhile.
  On CUDA that thread queues its work on a high-priority stream of its own, not on the
  default stream that a trainer in the same process uses (``_enter_engine_stream``), or on
  the stream of an SM share (``tandemrl.sm_partition``) when one is given.
  A step (1) rebuilds the KV cache if a weight update or a stand-down asked for it,
  (2) admits queued requests up to ``max_batch_size`` by prefilling their prompts and merging
  their caches into the running batch (grouped: see ``admission_batch``), (3) feeds every running sequence's last token through
  the model once, samples one token per sequence and (4) retires finished sequences.
- Continuous batching: new requests join the running batch at a step boundary, they do not
  wait for a "wave" to finish. Admission is grouped: queued requests enter only once
  ``admission_batch`` rows are free, or every queued request fits, or nothing is running. One
  prefill pass costs about one decode step whatever its size on a small model, so admitting a
  request at every step that frees a row spends a third of the engine's time in prefill when
  completions are short (the default CPU task: 4 new tokens); in groups of a quarter of the
  batch it spends a tenth, and the rows it leaves free for a few steps cost less. The batch is left-padded; merging pads the shorter cache on
  the left with masked zeros; retiring drops rows and trims columns no row uses any more.
  Positions are ``cumsum(attention_mask) - 1`` so padding never shifts a sequence.
- ``update_weights`` and ``sleep`` take the step lock, so they land between two steps. With
  ``recompute_kv_cache_after_weight_updates`` the in-flight sequences' cache is recomputed by
  one prefill over their tokens with the new weights before the next step; otherwise the cache
  computed under the old weights is kept (the next tokens mix old keys/values with new weights,
  which is what most async RL systems accept for throughput).
- Versions: each token records the weight version of the step that sampled it;
  ``start_weight_version`` is the version when the request was admitted to the batch (for a
  request aborted while still queued: when it was submitted).
- ``sleep`` stops decoding (in-flight requests freeze, new ones queue); on CUDA it also drops
  the KV cache and empties the allocator cache (weights stay resident), and the cache is
  recomputed on the first step after ``wake`` with the weights current then, whatever
  ``recompute_kv_cache_after_weight_updates`` says. ``frozen_time()`` is the total time spent
  asleep, for deadline clocks.

Logprob convention (the trainer must reproduce it):
    ``logprobs[i] = log_softmax(logits / temperature)[token_ids[i]]`` for ``temperature > 0``,
    and ``log_softmax(logits)`` (temperature 1) for greedy requests (``temperature == 0``).
    Logits are the raw model outputs in float32: top-p truncation changes *which* token is
    drawn but not the reported logprob (it is the untruncated tempered distribution), and no
    other logits processing exists. With the default ``temperature = 1`` this is exactly the
    plain ``log_softmax`` of the forward pass, which a trainer recomputes to within 1e-5.
    A stop token that ends a sequence is included in ``token_ids`` (with its logprob), so the
    policy learns to stop.

Two decode paths, one contract:

- *static* (``cuda_graphs="auto"`` for the families ``static_decode`` supports, on CUDA, and on
  CPU when the preallocated cache fits in ``CPU_STATIC_CACHE_BYTES``; or ``"on"``): the running batch lives in a fixed table of row slots over a static KV cache
  (``static_decode.StaticDecoder``). Admission prefills the new prompts through the
  decoder's own layer code, which writes their keys/values straight into free slots (the lowest free first, so busy
  slots stay packed); retirement frees the slot. The decode step is captured as a CUDA graph
  per (row bucket, attended-length bucket, top-p) and replayed, sampling inside the graph. The
  cache holds ``max_seq_len`` positions per slot; the slot count is ``max_batch_size`` or what
  ``kv_cache_memory_fraction`` of the free device memory holds, whichever is smaller. Weight
  updates copy into the model's parameters, which the graphs read through views. Recompute-KV
  re-prefills the running rows into their slots; ``sleep`` drops the cache and the graphs, and
  the first step after ``wake`` rebuilds both. On CPU the same step runs eagerly, one step at a
  time (no step in flight: nothing runs asynchronously there).
  One engine step *launches* ``steps_per_launch`` decode steps at once (on CUDA one graph
  replay, one upload of the draws, one download of the results, one wait): the host's work
  per token shrinks by that factor. Rows join and leave at launch boundaries; a row that
  finishes inside a launch keeps its slot (computed, its tokens dropped) to the launch's end,
  and its result waits for that end. On the H200 (docs/benchmarks.md, session 9) 4 steps a
  launch made a full 256-row batch's steady step 1-2% faster and GRPO's async steps 4-10%
  slower (later results, later weight updates), so the default is 1.
- *dynamic* (``"off"``, other architectures — logged once at start —, CPU models whose static
  cache would be large): the left-padded batch over a transformers ``DynamicCache`` described
  above.

Vision-language models (``models.vision``: Qwen2-VL, Qwen2.5-VL) take the dynamic path (the
static step has no vision tower and 1-D positions; logged at start). A request's
``image_inputs`` (the processor's ``pixel_values`` and ``image_grid_thw``) go through the
vision encoder once, in the prefill that admits the request; its rows' 3-D rotary positions
come from ``vision_position_ids``, which also gives each row's delta: every decode step then
feeds position ``tokens so far + delta`` (the same on the three axes), as the model's own
``generate`` does. A cache rebuild (recompute-KV, wake) prefills the images again.

Determinism: a request with ``seed`` draws its uniforms from its own ``random.Random(seed)``,
so its samples do not depend on which other requests share the batch (up to floating-point
differences of batched matrix products on near-ties). Requests without a seed draw from the
engine's generator (``seed`` of the constructor).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from tandemrl.generation.base import GenerationBackend, GenerationError
from tandemrl.generation.static_decode import (
    LaunchedStep,
    StaticDecoder,
    fuse_projections,
    kv_bytes_per_token,
    unsupported_reason,
)
from tandemrl.models import resolve_device
from tandemrl.models.vision import (
    image_embeddings,
    is_vision_model,
    load_policy_model,
    vision_position_ids,
)
from tandemrl.records import FinishReason, GenerationRequest, GenerationResult
from tandemrl.sm_partition import SmShare

logger = logging.getLogger(__name__)

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]

CUDA_GRAPH_MODES = ("auto", "on", "off")
# Static cache length when neither max_seq_len nor a smaller max_position_embeddings is given.
DEFAULT_STATIC_MAX_SEQ_LEN = 4096
# cuda_graphs="auto" on CPU takes the static path when its preallocated cache fits in this.
CPU_STATIC_CACHE_BYTES = 256 * 2**20


@dataclass
class EngineStats:
    """Counters for tests, benchmarks and logs; monotonic over the engine's life."""

    decode_steps: int = 0
    prefills: int = 0  # prefill forward passes: admissions and cache rebuilds
    admissions: int = 0  # steps that admitted queued requests (one prefill each at most)
    kv_recomputes: int = 0  # cache rebuilds after a weight update or a stand-down
    tokens_generated: int = 0
    weight_updates: int = 0
    max_running_batch: int = 0
    # Requests admitted while other sequences were mid-decode (continuous batching at work).
    joined_running_batch: int = 0
    graph_captures: int = 0  # static path: decode steps captured as CUDA graphs
    # Static path: seconds the step thread waited for the device to finish a launched step
    # (small against the steps' wall time when the host, not the device, sets the pace).
    device_wait_s: float = 0.0


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    rng: random.Random | None  # per-request sampler stream; None: the engine's stream
    stop_token_ids: frozenset[int]
    start_weight_version: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    slot: int = -1  # static path: the row slot this sequence decodes in
    launched: int = 0  # static path: decode steps launched for it (one may be in flight)
    # A vision-language row: max rotary position + 1 - prompt length (module docstring).
    rope_delta: int = 0

    @property
    def all_tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.token_ids

    def result(self) -> GenerationResult:
        assert self.finish_reason is not None
        return GenerationResult(
            request_id=self.request.request_id,
            prompt_token_ids=list(self.request.prompt_token_ids),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            token_weight_versions=list(self.token_weight_versions),
            start_weight_version=self.start_weight_version,
        )


class TorchGenerationEngine(GenerationBackend):
    """A transformers model serving concurrent ``generate`` calls from one event loop.

    Use one engine from one event loop (its asyncio primitives bind to the first loop that
    uses them).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        max_batch_size: int = 256,
        recompute_kv_cache_after_weight_updates: bool = False,
        seed: int = 0,
        weight_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        cuda_graphs: str = "auto",
        compile_step: bool = True,
        max_seq_len: int | None = None,
        kv_cache_memory_fraction: float = 0.5,
        pipeline_steps: bool | None = None,
        admission_batch: int | None = None,
        free_cache_on_sleep: bool = True,
        sm_share: SmShare | None = None,
        steps_per_launch: int = 1,
        capture_lock: threading.Lock | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(
                f"policy.generation.torch.cuda_graphs={cuda_graphs!r}: choose one of "
                f"{', '.join(CUDA_GRAPH_MODES)}"
            )
        if admission_batch is not None and admission_batch < 1:
            raise ValueError(
                f"policy.generation.torch.admission_batch={admission_batch}: must be >= 1"
            )
        if steps_per_launch < 1:
            raise ValueError(
                f"policy.generation.torch.steps_per_launch={steps_per_launch}: must be >= 1"
            )
        if max_seq_len is not None and max_seq_len < 2:
            raise ValueError(f"policy.generation.torch.max_seq_len={max_seq_len}: must be >= 2")
        if not 0 < kv_cache_memory_fraction <= 1:
            raise ValueError(
                "policy.generation.torch.kv_cache_memory_fraction="
                f"{kv_cache_memory_fraction}: must be in (0, 1]"
            )
        self.device = resolve_device(device)
        self.model = load_policy_model(model_path, dtype=dtype, device=self.device)
        self.is_vlm = is_vision_model(self.model)
        self.max_batch_size = max_batch_size
        self.recompute_kv_cache_after_weight_updates = recompute_kv_cache_after_weight_updates
        # sleep() on CUDA frees the KV cache and CUDA graphs (policy.generation.colocated.
        # free_cache_on_sleep); False: it only pauses, and wake() resumes with both intact.
        self.free_cache_on_sleep = free_cache_on_sleep
        config = self.model.config.get_text_config()  # a VLM's text model's settings
        # Stop tokens every request gets: the model's EOS (None: read from the model).
        self.eos_token_ids = frozenset(
            _model_eos_token_ids(self.model) if eos_token_ids is None else eos_token_ids
        )
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        static_len = max_seq_len or min(self.max_positions or DEFAULT_STATIC_MAX_SEQ_LEN, 4096)
        self.static_decode = self._choose_static(cuda_graphs, static_len)
        if self.static_decode and max_seq_len is None:
            max_seq_len = static_len
        self.max_seq_len = max_seq_len
        # Longest sequence (prompt + completion) a request may reach; None: unbounded.
        limits = [limit for limit in (self.max_positions, max_seq_len) if limit is not None]
        self.length_limit: int | None = min(limits) if limits else None
        self._pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self._rng = random.Random(seed)
        self._version = weight_version
        self.stats = EngineStats()

        # Owned by the event-loop thread.
        self._queue: deque[_Sequence] = deque()
        self._work = asyncio.Event()
        self._awake = asyncio.Event()
        self._awake.set()
        self._step_lock = asyncio.Lock()
        self._loop_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._asleep_since: float | None = None
        self._asleep_total = 0.0

        # The running batch: touched only inside a step (or under the step lock).
        self._running: list[_Sequence] = []
        # Keys/values of every token but each row's last one, left-padded to a common length.
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, cache length], 1 = real token
        self._needs_kv_rebuild = False
        # The CUDA device is per thread: the step thread must run on the engine's device, or an
        # engine on cuda:1 captures its graphs on cuda:0's stream (seen on the two-GPU machine).
        # It also runs on a stream of its own (see _enter_engine_stream): ``sm_share``'s,
        # whose kernels run on that share's SMs only (tandemrl.sm_partition), if given.
        self.sm_share = sm_share
        # Held while the static decoder captures a CUDA graph (StaticDecoder.capture_lock): for
        # a process whose other threads use the same GPU, which hold it around their work.
        self.capture_lock = capture_lock
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="tandemrl-gen",
            initializer=_enter_engine_stream,
            initargs=(self.device, sm_share),
        )

        # Static path: the decoder (cache + graphs) is built at the first step and dropped by
        # sleep; the slot count is fixed here, from the memory free now.
        self._decoder: StaticDecoder | None = None
        # update_weights: (names and shapes sent, the copy plan for them); see _weight_plan.
        self._weight_plan_cache: (
            tuple[tuple[Any, ...], tuple[list[torch.Tensor], list[str]]] | None
        ) = None
        # The launched, uncollected step: (handle, its rows, the weight version it used).
        self._in_flight: tuple[LaunchedStep, list[_Sequence], int] | None = None
        # Launch step n+1 before recording step n (the host works while the device runs). None:
        # on CUDA only; on CPU a launch runs the step at once, so the step in flight buys
        # nothing and costs a wasted step per finished row (15% of a CPU engine's time with
        # the default job's 4-token completions).
        self.pipeline_steps = (
            self.device.type == "cuda" if pipeline_steps is None else pipeline_steps
        )
        self._use_graphs = self.static_decode and self.device.type == "cuda"
        self._compile_step = self._use_graphs and compile_step
        # Decode steps per launch (module docstring); the dynamic path decodes one at a time.
        if steps_per_launch > 1 and not self.static_decode:
            logger.warning(
                "policy.generation.torch.steps_per_launch=%d ignored: this engine decodes "
                "through the transformers cache (cuda_graphs=%r), one step at a time",
                steps_per_launch,
                cuda_graphs,
            )
        self.steps_per_launch = steps_per_launch if self.static_decode else 1
        self.slots = self._plan_slots(kv_cache_memory_fraction) if self.static_decode else 0
        self._free_slots = list(range(self.slots))
        capacity = self.slots if self.static_decode else max_batch_size
        if admission_batch is None:
            # A quarter of the rows on both paths (module docstring). Static path on the H200,
            # 256 slots, 1,024 long-tail requests (docs/benchmarks.md): 17.7 k tokens/s
            # admitting each freed row at once, 51.1 k by 16, 43.8 k by 32, 70.8 k by 64.
            admission_batch = max(1, capacity // 4)
        self.admission_batch = min(admission_batch, capacity)
        if self.static_decode:
            # Views, not copies: weight updates keep the graphs' fused tensors current.
            with torch.no_grad():
                fuse_projections(self.model)

    # ------------------------------------------------------------------ public API

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self._closed:
            raise GenerationError("generation engine is shut down")
        loop = asyncio.get_running_loop()
        sequences = [self._new_sequence(request, loop) for request in requests]
        if not sequences:
            return []
        self._ensure_decode_loop()
        self._queue.extend(sequences)
        self._work.set()
        try:
            return list(await asyncio.gather(*(seq.future for seq in sequences)))
        except asyncio.CancelledError:
            # The caller gave up (timeout, shutdown): stop spending compute on these rows.
            self._spawn(self._abort_where(lambda seq: seq in sequences))
            raise

    async def update_weights(self, version: int, weights: Any) -> None:
        """Load a state dict between two decode steps, then report ``version``."""
        if not isinstance(weights, Mapping):
            raise TypeError(
                f"torch engine update_weights expects a state dict (mapping of name to tensor), "
                f"got {type(weights).__name__}"
            )
        async with self._step_lock:
            await self._in_executor(self._load_state_dict, weights)
            self._version = version
            self.stats.weight_updates += 1
            if self.recompute_kv_cache_after_weight_updates and self._running:
                self._needs_kv_rebuild = True

    async def weight_version(self) -> int:
        return self._version

    @property
    def current_weight_version(self) -> int:
        return self._version

    async def abort(self, request_ids: list[str]) -> None:
        wanted = set(request_ids)
        await self._abort_where(lambda seq: seq.request.request_id in wanted)

    async def sleep(self) -> None:
        async with self._step_lock:
            if self._asleep_since is not None:
                return
            self._asleep_since = time.monotonic()
            self._awake.clear()
            # The static path's step in flight finishes first (its rows may end with it).
            finished = await self._in_executor(self._drain) if self._in_flight else []
            if self.device.type == "cuda" and self.free_cache_on_sleep:
                # Free the KV cache; the first step after wake recomputes it.
                if self._decoder is not None:
                    self._decoder.release()
                self._cache = None
                self._mask = None
                self._needs_kv_rebuild = bool(self._running)
                await self._in_executor(torch.cuda.empty_cache)
        for seq in finished:
            _resolve(seq)

    async def wake(self) -> None:
        if self._asleep_since is None:
            return
        self._asleep_total += time.monotonic() - self._asleep_since
        self._asleep_since = None
        self._awake.set()

    @property
    def asleep(self) -> bool:
        return self._asleep_since is not None

    @property
    def rows_in_flight(self) -> int:
        """Requests queued or decoding now (zero once every caller is answered or gone)."""
        return len(self._running) + len(self._queue)

    @property
    def asleep_seconds(self) -> float:
        """Seconds spent asleep so far (monotonic clock), the current stand-down included."""
        current = time.monotonic() - self._asleep_since if self._asleep_since is not None else 0.0
        return self._asleep_total + current

    async def frozen_time(self) -> float:
        """``asleep_seconds``: deadline clocks subtract it to count awake time only."""
        return self.asleep_seconds

    async def shutdown(self) -> None:
        """Finish every request as aborted, stop the decode loop, release the thread."""
        if self._closed:
            return
        await self._abort_where(lambda seq: True)
        self._closed = True
        self._work.set()
        self._awake.set()
        if self._loop_task is not None:
            await self._loop_task
        for task in list(self._background):
            await task
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    # ------------------------------------------------------------------ event-loop side

    def _new_sequence(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop
    ) -> _Sequence:
        prompt = request.prompt_token_ids
        where = f"request {request.request_id!r}"
        if not prompt:
            raise ValueError(f"{where}: empty prompt_token_ids")
        if request.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if request.temperature < 0:
            raise ValueError(f"{where}: temperature must be >= 0, got {request.temperature}")
        if not 0 < request.top_p <= 1:
            raise ValueError(f"{where}: top_p must be in (0, 1], got {request.top_p}")
        if request.image_inputs is not None and not self.is_vlm:
            raise ValueError(
                f"{where}: carries image inputs, but the engine's model is text-only "
                "(policy.is_vlm needs an image-text-to-text model folder)"
            )
        bad = [token for token in prompt if not 0 <= token < self.vocab_size]
        if bad:
            raise ValueError(
                f"{where}: token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        if self.length_limit is not None and len(prompt) >= self.length_limit:
            limit = (
                f"the model's max_position_embeddings={self.max_positions}"
                if self.length_limit == self.max_positions
                else f"policy.generation.torch.max_seq_len={self.max_seq_len}"
            )
            raise ValueError(
                f"{where}: prompt of {len(prompt)} tokens leaves no room to generate within {limit}"
            )
        return _Sequence(
            request=request,
            future=loop.create_future(),
            rng=random.Random(request.seed) if request.seed is not None else None,
            stop_token_ids=frozenset(request.stop_token_ids) | self.eos_token_ids,
            start_weight_version=self._version,
        )

    def _ensure_decode_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._decode_loop())

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _in_executor(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _decode_loop(self) -> None:
        while True:
            await self._work.wait()
            await self._awake.wait()
            async with self._step_lock:
                if self._closed:
                    return
                if self._asleep_since is not None:
                    continue
                admit = self._pop_admissible()
                if not admit and not self._running:
                    # Nothing to decode (the queue held only requests their callers dropped).
                    self._work.clear()
                    continue
                try:
                    finished = await self._in_executor(self._step, admit)
                except Exception as exc:  # a failed step leaves the batch unusable
                    logger.exception("decode step failed; failing %d requests", len(self._running))
                    failed = self._running + [seq for seq in admit if seq not in self._running]
                    self._reset_batch()
                    for seq in failed:
                        if not seq.future.done():
                            seq.future.set_exception(
                                GenerationError(f"decode step failed: {exc!r}")
                            )
                    continue
            for seq in finished:
                _resolve(seq)

    def _pop_admissible(self) -> list[_Sequence]:
        admit: list[_Sequence] = []
        limit = self.slots if self.static_decode else self.max_batch_size
        free = limit - len(self._running)
        if self._running and free < self.admission_batch and free < len(self._queue):
            return admit  # wait until a group of rows is free (module docstring)
        while self._queue and len(self._running) + len(admit) < limit:
            seq = self._queue.popleft()
            if seq.future.done():  # cancelled by its caller while queued
                continue
            seq.start_weight_version = self._version
            admit.append(seq)
        if admit:
            self.stats.admissions += 1
        return admit

    async def _abort_where(self, predicate: Callable[[_Sequence], bool]) -> None:
        queued = [seq for seq in self._queue if predicate(seq)]
        if queued:
            self._queue = deque(seq for seq in self._queue if not predicate(seq))
        async with self._step_lock:
            rows = [row for row, seq in enumerate(self._running) if predicate(seq)]
            running = await self._in_executor(self._drop_rows, rows) if rows else []
        for seq in [*queued, *running]:
            seq.finish_reason = "aborted"
            _resolve(seq)

    # ------------------------------------------------------------------ compute side (one thread)

    @torch.inference_mode()
    def _step(self, admit: list[_Sequence]) -> list[_Sequence]:
        if self.static_decode:
            return self._static_step(admit)
        if self._needs_kv_rebuild:
            self._rebuild_kv()
        if admit:
            if self._running:
                self.stats.joined_running_batch += len(admit)
            key_values, mask = self._prefill([seq.all_tokens[:-1] for seq in admit], admit)
            self._merge_into_batch(key_values, mask)
            self._running.extend(admit)

        rows = len(self._running)
        assert self._mask is not None
        last_tokens = torch.tensor(
            [[seq.all_tokens[-1]] for seq in self._running], dtype=torch.long, device=self.device
        )
        mask = torch.cat([self._mask, self._mask.new_ones(rows, 1)], dim=1)
        # Position of the fed token = number of real tokens before it (cumsum(mask) - 1).
        positions = self._mask.sum(dim=1, keepdim=True)
        if self.is_vlm:  # plus each row's rotary delta, the same on the three axes
            deltas = torch.tensor([seq.rope_delta for seq in self._running], device=self.device)
            positions = (positions + deltas[:, None]).unsqueeze(0).expand(3, -1, -1)
        output = self.model(
            input_ids=last_tokens,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = output.past_key_values
        self._mask = mask
        token_ids, logprobs = self._sample(output.logits[:, -1, :], self._running)
        return self._record(token_ids, logprobs)

    def _append(self, seq: _Sequence, token: int, logprob: float, version: int) -> bool:
        """Add one sampled token to ``seq``; True when that finishes it."""
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.token_weight_versions.append(version)
        if token in seq.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= seq.request.max_new_tokens or (
            self.length_limit is not None
            and len(seq.request.prompt_token_ids) + len(seq.token_ids) >= self.length_limit
        ):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _record(self, token_ids: list[int], logprobs: list[float]) -> list[_Sequence]:
        """Append each running row's new token; retire the rows that finished."""
        rows = len(self._running)
        version = self._version
        keep: list[int] = []
        finished: list[_Sequence] = []
        for row, seq in enumerate(self._running):
            if self._append(seq, token_ids[row], logprobs[row], version):
                finished.append(seq)
            else:
                keep.append(row)
        self.stats.decode_steps += 1
        self.stats.tokens_generated += rows
        self.stats.max_running_batch = max(self.stats.max_running_batch, rows)
        if finished:
            self._select_rows(keep)
        return finished

    def _static_step(self, admit: list[_Sequence]) -> list[_Sequence]:
        """Launch the next steps, then collect the launch before (one launch in flight).

        While the device runs launch n+1 the host records launch n's tokens. A row that launch
        n finishes was already fed to launch n+1; those results are dropped (its slot is free
        only from the next launch on, and launches run in order). Tokens carry the weight
        version of the launch that sampled them. Each row draws its uniforms in the order of
        its steps, so a seeded request samples the same tokens whatever ``steps_per_launch``.
        """
        decoder = self._ensure_decoder()
        finished: list[_Sequence] = []
        if self._needs_kv_rebuild:
            # Re-prefilling needs every sampled token: collect the step in flight first.
            finished += self._collect_in_flight()
            self._needs_kv_rebuild = False
            if self._running:
                self._load_slots(decoder, self._running)
                self.stats.kv_recomputes += 1
        if admit:
            if self._running:
                self.stats.joined_running_batch += len(admit)
            for seq in admit:
                seq.slot = heapq.heappop(self._free_slots)
                seq.launched = 0
            self._running.extend(admit)
            self._load_slots(decoder, admit)
        running = list(self._running)
        if not running:  # the collected step finished every row
            return finished
        graphs_before = decoder.graph_count
        steps = decoder.steps
        launched = decoder.launch(
            [seq.slot for seq in running],
            [_draws(seq.rng or self._rng, steps) for seq in running],
            max_position=max(len(seq.request.prompt_token_ids) + seq.launched for seq in running)
            - 1,
            top_p=any(seq.request.top_p < 1.0 for seq in running),
        )
        for seq in running:
            seq.launched += steps
        self.stats.graph_captures += decoder.graph_count - graphs_before
        finished += self._collect_in_flight()
        self._in_flight = (launched, running, self._version)
        if not self.pipeline_steps:
            finished += self._collect_in_flight()
        return finished

    def _collect_in_flight(self) -> list[_Sequence]:
        """Record the tokens of the launch in flight (if any) for the rows still running."""
        if self._in_flight is None:
            return []
        launched, sequences, version = self._in_flight
        self._in_flight = None
        assert self._decoder is not None
        waited_from = time.perf_counter()
        token_ids, logprobs = self._decoder.collect(launched)
        self.stats.device_wait_s += time.perf_counter() - waited_from
        finished = []
        for step_tokens, step_logprobs in zip(token_ids, logprobs, strict=True):
            rows = [
                (seq, token, logprob)
                for seq, token, logprob in zip(sequences, step_tokens, step_logprobs, strict=True)
                if seq.finish_reason is None and seq.slot >= 0  # not finished, not aborted
            ]
            if not rows:
                break
            for seq, token, logprob in rows:
                if self._append(seq, token, logprob, version):
                    finished.append(seq)
            self.stats.decode_steps += 1
            self.stats.tokens_generated += len(rows)
            self.stats.max_running_batch = max(self.stats.max_running_batch, len(rows))
        if finished:
            done = {id(seq) for seq in finished}
            self._select_rows([row for row, seq in enumerate(self._running) if id(seq) not in done])
        return finished

    def _drain(self) -> list[_Sequence]:
        """Collect the step in flight, so that nothing on the device still reads the cache."""
        with torch.inference_mode():
            return self._collect_in_flight()

    def _ensure_decoder(self) -> StaticDecoder:
        if self._decoder is None:
            assert self.max_seq_len is not None
            self._decoder = StaticDecoder(
                self.model,
                slots=self.slots,
                max_len=self.max_seq_len,
                use_graphs=self._use_graphs,
                compile_step=self._compile_step,
                steps=self.steps_per_launch,
            )
            if self.sm_share is not None:
                self._decoder.capture_stream = self.sm_share.capture_stream
            self._decoder.capture_lock = self.capture_lock
        if not self._decoder.allocated:
            self._decoder.allocate()
            self._needs_kv_rebuild = bool(self._running)
        return self._decoder

    def _load_slots(self, decoder: StaticDecoder, sequences: list[_Sequence]) -> None:
        """Prefill ``sequences`` into their slots and set each slot's next input."""
        slots = [seq.slot for seq in sequences]
        decoder.prefill(slots, [seq.all_tokens[:-1] for seq in sequences])
        decoder.set_rows(
            slots,
            tokens=[seq.all_tokens[-1] for seq in sequences],
            positions=[len(seq.all_tokens) - 1 for seq in sequences],
            temperatures=[seq.request.temperature for seq in sequences],
            top_ps=[seq.request.top_p for seq in sequences],
        )
        self.stats.prefills += 1

    def _sample(
        self, logits: torch.Tensor, sequences: Sequence[_Sequence]
    ) -> tuple[list[int], list[float]]:
        """One token per row and its logprob under the tempered, untruncated distribution."""
        logits = logits.float()
        temperatures = [seq.request.temperature for seq in sequences]
        top_ps = [seq.request.top_p for seq in sequences]
        scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
        logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
        probs = logprobs.exp()
        if any(p < 1.0 for p in top_ps):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            top_p = torch.tensor(top_ps, device=logits.device)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
            candidate_probs = sorted_probs.masked_fill(outside, 0.0)
        else:
            candidate_probs, order = probs, None
        cdf = candidate_probs.cumsum(dim=-1)
        uniforms = torch.tensor(
            [(seq.rng or self._rng).random() for seq in sequences],
            dtype=cdf.dtype,
            device=logits.device,
        )
        picks = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)
        picks = picks.clamp(max=cdf.shape[-1] - 1)
        tokens = order.gather(1, picks) if order is not None else picks
        greedy = torch.tensor([t == 0 for t in temperatures], device=logits.device)
        tokens = torch.where(greedy[:, None], logits.argmax(dim=-1, keepdim=True), tokens)
        chosen = logprobs.gather(1, tokens)
        return tokens.squeeze(1).tolist(), chosen.squeeze(1).tolist()

    def _prefill(
        self, token_lists: list[list[int]], sequences: Sequence[_Sequence]
    ) -> tuple[KeyValues | None, torch.Tensor]:
        """Keys/values of left-padded ``token_lists`` (those of ``sequences``); None when every
        list is empty. A vision-language batch runs the vision encoder over the sequences'
        images here and sets each sequence's rotary delta."""
        rows, width = len(token_lists), max(len(tokens) for tokens in token_lists)
        mask = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        if width == 0:
            return None, mask
        input_ids = torch.full((rows, width), self._pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(token_lists):
            if tokens:
                input_ids[row, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
                mask[row, width - len(tokens) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        input_ids = input_ids.to(self.device)
        model_inputs: dict[str, torch.Tensor] = {"input_ids": input_ids}
        if self.is_vlm:
            positions, model_inputs = self._vision_prefill_inputs(input_ids, mask, sequences)
        output = self.model(
            **model_inputs,
            attention_mask=mask,
            position_ids=positions,
            # A cache of full-length layers, passed in: the model's own would keep only the
            # last window of a sliding-window layer (Gemma), and the batch is merged, trimmed
            # and masked column by column over the whole length.
            past_key_values=DynamicCache(),
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.prefills += 1
        real = mask.bool()[:, None, :, None]
        # Zero the padding's keys/values so no kernel can ever turn a masked slot into NaN.
        key_values = [
            (keys.masked_fill(~real, 0.0), values.masked_fill(~real, 0.0))
            for keys, values in _layers(output.past_key_values)
        ]
        return key_values, mask

    def _vision_prefill_inputs(
        self, input_ids: torch.Tensor, mask: torch.Tensor, sequences: Sequence[_Sequence]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """3-D positions of a vision-language prefill and its ``inputs_embeds`` (the vision
        encoder over every sequence's images, in row order); sets each row's rotary delta."""
        width = input_ids.shape[1]
        prompt_mask = torch.zeros_like(mask, dtype=torch.bool)
        for row, seq in enumerate(sequences):
            start = width - int(mask[row].sum())  # left padded
            prompt_mask[row, start : start + len(seq.request.prompt_token_ids)] = True
        with_images = [seq.request.image_inputs for seq in sequences if seq.request.image_inputs]
        grids = pixels = None
        if with_images:
            grids = torch.cat([inputs["image_grid_thw"] for inputs in with_images]).to(self.device)
            pixels = torch.cat([inputs["pixel_values"] for inputs in with_images])
            pixels = pixels.to(self.device, self.model.dtype)
        positions, deltas = vision_position_ids(self.model, input_ids, mask, grids, prompt_mask)
        for seq, delta in zip(sequences, deltas.tolist(), strict=True):
            seq.rope_delta = int(delta)
        embeds = image_embeddings(self.model, input_ids, prompt_mask, pixels, grids)
        return positions, {"inputs_embeds": embeds}

    def _rebuild_kv(self) -> None:
        self._needs_kv_rebuild = False
        if not self._running:
            self._cache, self._mask = None, None
            return
        key_values, self._mask = self._prefill(
            [seq.all_tokens[:-1] for seq in self._running], self._running
        )
        self._cache = DynamicCache(ddp_cache_data=key_values) if key_values else None
        self.stats.kv_recomputes += 1

    def _merge_into_batch(self, key_values: KeyValues | None, mask: torch.Tensor) -> None:
        if not self._running or self._mask is None:
            self._cache = DynamicCache(ddp_cache_data=key_values) if key_values else None
            self._mask = mask
            return
        width = max(self._mask.shape[1], mask.shape[1])
        old = _layers(self._cache) if self._cache is not None else None
        new = key_values
        if old is None and new is None:
            merged = None
        else:
            template = old if old is not None else new
            assert template is not None
            old = old or _zeros_like_layers(template, len(self._running))
            new = new or _zeros_like_layers(template, mask.shape[0])
            merged = [
                (
                    torch.cat([_left_pad(k_old, width), _left_pad(k_new, width)], dim=0),
                    torch.cat([_left_pad(v_old, width), _left_pad(v_new, width)], dim=0),
                )
                for (k_old, v_old), (k_new, v_new) in zip(old, new, strict=True)
            ]
        self._mask = torch.cat([_left_pad_mask(self._mask, width), _left_pad_mask(mask, width)])
        self._cache = DynamicCache(ddp_cache_data=merged) if merged else None

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch, then drop columns no kept row uses."""
        if self.static_decode:
            kept = set(keep)
            for row, seq in enumerate(self._running):
                if row not in kept:
                    heapq.heappush(self._free_slots, seq.slot)
                    seq.slot = -1
            self._running = [self._running[row] for row in keep]
            return
        self._running = [self._running[row] for row in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        if self._mask is None:  # cache dropped by sleep; rebuilt from tokens later
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._mask = self._mask.index_select(0, index)
        used = self._mask.any(dim=0)
        first = int(used.int().argmax()) if bool(used.any()) else self._mask.shape[1]
        self._mask = self._mask[:, first:]
        if self._cache is not None:
            self._cache = DynamicCache(
                ddp_cache_data=[
                    (
                        keys.index_select(0, index)[:, :, first:],
                        values.index_select(0, index)[:, :, first:],
                    )
                    for keys, values in _layers(self._cache)
                ]
            )

    @torch.inference_mode()
    def _drop_rows(self, rows: list[int]) -> list[_Sequence]:
        dropped = set(rows)
        removed = [self._running[row] for row in rows]
        self._select_rows([row for row in range(len(self._running)) if row not in dropped])
        return removed

    def _reset_batch(self) -> None:
        self._running = []
        # A failed step may leave the static cache half-written: start from a fresh one.
        self._in_flight = None
        if self._decoder is not None:
            self._decoder.release()
        self._free_slots = list(range(self.slots))
        self._cache, self._mask = None, None
        self._needs_kv_rebuild = False

    def _choose_static(self, cuda_graphs: str, static_len: int) -> bool:
        if cuda_graphs == "off":
            return False
        reason = unsupported_reason(self.model)
        if self.is_vlm:
            reason = (
                "vision-language models (a vision encoder at prefill and 3-D rotary positions; "
                f"model_type {self.model.config.model_type!r})"
            )
        if cuda_graphs == "on":
            if reason is not None:
                raise ValueError(
                    f"policy.generation.torch.cuda_graphs='on': the static decode path does not "
                    f"support this model: {reason}; use 'auto' or 'off'"
                )
            return True
        if reason is not None:
            logger.info(
                "torch engine: decoding through the transformers cache, not the static decode "
                "path (policy.generation.torch.cuda_graphs=auto): it does not support %s",
                reason,
            )
            return False
        if self.device.type == "cuda":
            return True
        # CPU: the hand-written step is cheaper than transformers' forward (no mask building,
        # no cache concatenation), but its cache is preallocated for every slot at full length.
        cache_bytes = self.max_batch_size * static_len * kv_bytes_per_token(self.model)
        return cache_bytes <= CPU_STATIC_CACHE_BYTES

    def _plan_slots(self, memory_fraction: float) -> int:
        """``max_batch_size``, or fewer slots where the free device memory holds fewer."""
        if self.device.type != "cuda":
            return self.max_batch_size
        assert self.max_seq_len is not None
        free, _ = torch.cuda.mem_get_info(self.device)
        slot_bytes = self.max_seq_len * kv_bytes_per_token(self.model)
        # Keep room for the graphs' activations (logits of every slot, float32, a few copies).
        reserve = 6 * self.max_batch_size * self.vocab_size * 4
        fits = int((free * memory_fraction - reserve) // slot_bytes)
        if fits < 1:
            raise ValueError(
                f"static KV cache: one slot of policy.generation.torch.max_seq_len="
                f"{self.max_seq_len} tokens needs {slot_bytes / 2**20:.1f} MiB, but "
                f"kv_cache_memory_fraction={memory_fraction} of the {free / 2**30:.1f} GiB free "
                f"leaves less; lower max_seq_len or raise the fraction"
            )
        if fits < self.max_batch_size:
            logger.warning(
                "static KV cache: %d slots of %d tokens fit in %.0f%% of the free memory "
                "(max_batch_size %d)",
                fits,
                self.max_seq_len,
                100 * memory_fraction,
                self.max_batch_size,
            )
        return min(self.max_batch_size, fits)

    @torch.inference_mode()
    def _load_state_dict(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy ``weights`` into the model's own tensors (in place: the static decoder's fused
        views and captured graphs see the new values).

        One ``_foreach_copy_`` over a plan checked once per set of names and shapes (a weight
        sync sends the same names every time): ``load_state_dict`` spent milliseconds of host
        time per sync walking the modules and copying tensor by tensor. On CUDA the copy is
        waited for before this returns, so a sender may reuse its buffer once the update is
        reported (a CUDA-IPC buffer is read by this process's stream, which the trainer's
        process cannot see).
        """
        targets, names = self._weight_plan(weights)
        sources = [weights[name] for name in names]
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            # The step thread's stream is its own: weights written on the default stream (by
            # a trainer in this process) are read once that work is done.
            stream.wait_stream(torch.cuda.default_stream(self.device))
        if all(
            source.device == target.device for source, target in zip(sources, targets, strict=True)
        ):
            torch._foreach_copy_(targets, sources)
        else:  # a host round trip: CPU tensors into a CUDA model
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source)
        if stream is not None:
            stream.synchronize()

    def _weight_plan(
        self, weights: Mapping[str, torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[str]]:
        """(target tensors, the sent names to copy into them) for ``weights``: every name must
        be the model's, with its shape; every tensor of the model must be sent (a tied one
        under any of its names); a storage sent under two names is copied once."""
        key = tuple((name, tuple(tensor.shape)) for name, tensor in weights.items())
        if self._weight_plan_cache is not None and self._weight_plan_cache[0] == key:
            return self._weight_plan_cache[1]
        own = self.model.state_dict(keep_vars=True)
        unexpected = sorted(name for name in weights if name not in own)
        if unexpected:
            raise KeyError(f"update_weights: unknown parameter names {unexpected[:5]}")
        wrong = [
            f"{name}: sent {tuple(weights[name].shape)}, the model has {tuple(own[name].shape)}"
            for name in weights
            if weights[name].shape != own[name].shape
        ]
        if wrong:
            raise ValueError(f"update_weights: shape mismatch for {wrong[:5]}")
        targets: list[torch.Tensor] = []
        names: list[str] = []
        copied: set[tuple[int, tuple[int, ...]]] = set()
        for name in weights:
            target = own[name].data
            where = (target.data_ptr(), tuple(target.shape))
            if where in copied:
                continue
            copied.add(where)
            targets.append(target)
            names.append(name)
        missing = sorted(
            name
            for name, tensor in own.items()
            if name not in weights and (tensor.data_ptr(), tuple(tensor.shape)) not in copied
        )
        if missing:
            raise KeyError(f"update_weights: missing parameters {missing[:5]}")
        self._weight_plan_cache = (key, (targets, names))
        return targets, names


# ---------------------------------------------------------------------- helpers


# The step thread's own stream (see _enter_engine_stream; False: the default stream, as
# before) and its priority (lower is higher; CUDA maps it into the device's range).
OWN_STREAM = True
STREAM_PRIORITY = -1


def _enter_engine_stream(device: torch.device, sm_share: SmShare | None = None) -> None:
    """Make ``device`` the calling (step) thread's CUDA device and give the thread a
    high-priority stream of its own (no-op off CUDA).

    Every thread of a process starts on the device's legacy default stream, so an engine
    sharing its process with a trainer (each in its own thread) would queue its decode steps
    behind the trainer's kernels: the GPU would run one or the other, never both. On its own
    non-blocking stream a decode step runs beside the trainer's kernels, and the high priority
    puts its small kernels first in line for the SMs that the trainer's blocks free (it still
    waits for those: on the H200 a 0.5B decode step took 1.8 ms beside training against 1.0 ms
    alone, docs/benchmarks.md session 7). The new stream first waits for the work queued so far
    (the engine's weights were loaded on the default stream). With ``sm_share`` the stream is
    the share's: its kernels run on the share's SMs only, which a trainer on the other share
    of the split never takes (``tandemrl.sm_partition``).
    """
    if device.type != "cuda":
        return
    if device.index is not None:
        torch.cuda.set_device(device)
    if sm_share is not None:
        sm_share.enter()
        return
    if not OWN_STREAM:
        return
    stream = torch.cuda.Stream(device, priority=STREAM_PRIORITY)
    stream.wait_stream(torch.cuda.current_stream(device))
    torch.cuda.set_stream(stream)


def _draws(rng: random.Random, steps: int) -> list[float]:
    """One row's uniforms for a launch of ``steps`` decode steps, in the order of the steps."""
    return [rng.random() for _ in range(steps)]


def _resolve(seq: _Sequence) -> None:
    if not seq.future.done():
        seq.future.set_result(seq.result())


def _model_eos_token_ids(model: torch.nn.Module) -> list[int]:
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def _layers(cache: Any) -> KeyValues:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _zeros_like_layers(template: KeyValues, rows: int) -> KeyValues:
    return [
        (
            keys.new_zeros((rows, *keys.shape[1:2], 0, keys.shape[3])),
            values.new_zeros((rows, *values.shape[1:2], 0, values.shape[3])),
        )
        for keys, values in template
    ]


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Pad a [rows, heads, length, dim] cache tensor with zeros on the left to ``width``."""
    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    pad = tensor.new_zeros((tensor.shape[0], tensor.shape[1], missing, tensor.shape[3]))
    return torch.cat([pad, tensor], dim=2)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)
