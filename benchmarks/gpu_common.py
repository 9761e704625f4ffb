"""Helpers of the GPU benchmarks: real-size random models, an engine host, a process proxy.

- ``QWEN2_SIZES``: the Qwen2-0.5B and Qwen2-1.5B architectures (random init, built from a
  config in code: nothing is downloaded), plus ``tiny`` for CPU smoke runs.
- ``EngineHost``: a ``TorchGenerationEngine`` plus what the benchmark needs around it: a
  long-tail completion-length workload (each request's ``max_new_tokens`` drawn from a
  clipped lognormal keyed by its request id), decode busy-time accounting, and the generation
  side of the CUDA-IPC and NCCL weight syncs. The same class runs in the controller's
  process or in a child process.
- ``RemoteObject``: runs an object in a spawned child process and forwards
  ``await proxy.method(...)`` calls to it over a pipe (the benchmark's stand-in for a Ray
  actor; the device machine has no Ray).
- ``device_plan``: which CUDA device the trainer and each engine use, from
  ``policy.generation.colocated`` (enabled / resources.gpus_per_node) and the GPU count.
- ``write_result``: a benchmark's result as ``<out>/<name>.json`` and its ``RESULT`` line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import random
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.records import GenerationRequest, GenerationResult
from tandemrl.transport.receiver import WeightReceiverHost

QWEN2_SIZES: dict[str, dict[str, Any]] = {
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "tie_word_embeddings": True,
        "max_position_embeddings": 1024,
    },
}
EOS_TOKEN_ID = 1


def build_model_folder(size: str, folder: Path, *, device: str = "cpu") -> Path:
    """A seeded random-init Qwen2 of ``size`` saved (bf16) with ``save_pretrained``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (folder / "config.json").is_file():
        return folder
    config = Qwen2Config(
        **QWEN2_SIZES[size], pad_token_id=0, eos_token_id=EOS_TOKEN_ID, bos_token_id=2
    )
    config.initializer_range = 0.02
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder, safe_serialization=True)
    del model
    return folder


def write_result(out: Path | None, name: str, result: dict[str, Any]) -> None:
    """Write ``result`` to ``<out>/<name>.json`` (when ``out`` is set), then print
    ``RESULT {json}``."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"RESULT {json.dumps(result)}", flush=True)


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


@dataclasses.dataclass(frozen=True)
class LongTail:
    """Completion lengths: lognormal(log(median), sigma) clipped to [minimum, cap]."""

    median: float = 24.0
    sigma: float = 1.0
    minimum: int = 4
    cap: int = 128

    def length(self, request_id: str) -> int:
        rng = random.Random(zlib.crc32(request_id.encode()))
        drawn = rng.lognormvariate(math.log(self.median), self.sigma)
        return int(min(self.cap, max(self.minimum, round(drawn))))

    def mean(self, samples: int = 20000) -> float:
        return sum(self.length(f"m{i}") for i in range(samples)) / samples


class EngineHost(WeightReceiverHost):
    """The generation engine of one benchmark run (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str,
        max_batch_size: int,
        lengths: LongTail | None,
        seed: int = 0,
        cuda_graphs: str = "auto",
        max_seq_len: int | None = None,
        free_cache_on_sleep: bool = True,
        sm_share: Any = None,
        steps_per_launch: int = 1,
        gpu_turns: Any = None,
        capture_lock: Any = None,
    ) -> None:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        torch.set_num_threads(1)
        self.engine = TorchGenerationEngine(
            model_path,
            device=device,
            dtype="auto",
            max_batch_size=max_batch_size,
            seed=seed,
            eos_token_ids=[EOS_TOKEN_ID],
            cuda_graphs=cuda_graphs,
            max_seq_len=max_seq_len,
            free_cache_on_sleep=free_cache_on_sleep,
            sm_share=sm_share,
            steps_per_launch=steps_per_launch,
            capture_lock=capture_lock,
        )
        self.lengths = lengths
        self.step_busy_s = 0.0
        self.created_at = time.perf_counter()
        step = self.engine._step

        # ``gpu_turns`` (a lock, gpu_grpo's shared_gpu_turns): each step holds it, and so does
        # each trainer call, so the two never have work on the GPU at once.
        turns = gpu_turns if gpu_turns is not None else contextlib.nullcontext()

        def timed_step(admit: list[Any]) -> list[Any]:
            with turns:
                started = time.perf_counter()
                try:
                    return step(admit)
                finally:
                    self.step_busy_s += time.perf_counter() - started

        # The engine looks its step up at call time; timing it here measures decode busy time.
        self.engine._step = timed_step  # type: ignore[method-assign]

    # ------------------------------------------------------------------ GenerationBackend

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self.lengths is not None:
            requests = [
                dataclasses.replace(
                    request,
                    max_new_tokens=min(
                        request.max_new_tokens, self.lengths.length(request.request_id)
                    ),
                )
                for request in requests
            ]
        return await self.engine.generate(requests)

    async def update_weights(self, version: int, weights: Any) -> None:
        await self.engine.update_weights(version, weights)

    async def weight_version(self) -> int:
        return await self.engine.weight_version()

    async def abort(self, request_ids: list[str]) -> None:
        await self.engine.abort(request_ids)

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake(self) -> None:
        await self.engine.wake()

    async def frozen_time(self) -> float:
        return await self.engine.frozen_time()

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    # ------------------------------------------------------------------ stats
    # (the weight-sync methods come from WeightReceiverHost)

    async def stats(self) -> dict[str, float]:
        stats = dataclasses.asdict(self.engine.stats)
        stats["step_busy_s"] = self.step_busy_s
        stats["asleep_s"] = self.engine.asleep_seconds
        return {key: float(value) for key, value in stats.items()}

    async def reset_stats(self) -> None:
        self.step_busy_s = 0.0
        self.engine.stats = type(self.engine.stats)()

    async def max_memory_gib(self) -> float:
        if self.engine.device.type != "cuda":
            return 0.0
        return torch.cuda.max_memory_allocated(self.engine.device) / 2**30


def make_engine_host(kwargs: dict[str, Any]) -> EngineHost:
    return EngineHost(**kwargs)


# ---------------------------------------------------------------------- process proxy


def _serve(conn: Any, factory: Any, factory_arg: Any) -> None:
    target = factory(factory_arg)
    loop = asyncio.new_event_loop()
    send_lock = threading.Lock()
    tasks: set[asyncio.Task[Any]] = set()

    def reply(payload: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(payload)

    async def handle(call_id: int, name: str, args: tuple[Any, ...], kwargs: dict) -> None:
        try:
            result = await getattr(target, name)(*args, **kwargs)
        except Exception as exc:
            reply((call_id, False, RuntimeError(f"{name} failed in the child: {exc!r}")))
        else:
            reply((call_id, True, result))

    async def main() -> None:
        while True:
            message = await loop.run_in_executor(None, conn.recv)
            if message is None:
                break
            task = loop.create_task(handle(*message))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        for task in list(tasks):
            await task

    loop.run_until_complete(main())
    conn.close()


class RemoteObject:
    """``await proxy.method(*args)`` runs ``method`` on an object in a spawned child process."""

    def __init__(self, factory: Any, factory_arg: Any) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child_conn, factory, factory_arg), daemon=True
        )
        self.process.start()
        child_conn.close()
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._call(name, args, kwargs)

        return call

    async def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        call_id = next(self._ids)
        future = self._loop.create_future()
        self._pending[call_id] = future
        with self._send_lock:
            self._conn.send((call_id, name, args, kwargs))
        return await future

    def _read(self) -> None:
        assert self._loop is not None
        while True:
            try:
                call_id, ok, payload = self._conn.recv()
            except EOFError:
                break
            future = self._pending.pop(call_id)
            if self._loop.is_closed():  # the caller's loop ended (a failed run): nobody waits
                break
            self._loop.call_soon_threadsafe(_settle, future, ok, payload)

    def close(self) -> None:
        with self._send_lock:
            self._conn.send(None)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def _settle(future: asyncio.Future[Any], ok: bool, payload: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(payload)
    else:
        future.set_exception(payload)


# ---------------------------------------------------------------------- placement


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    trainer_device: str
    engine_devices: list[str]
    transport: str  # "device" (same process), "ipc" (same GPU, other process), "nccl"


def device_plan(cfg: Any, *, num_gpus: int, engine_processes: bool) -> DevicePlan:
    """Colocated: everything on GPU 0. Otherwise GPU 0 trains and the next ``gpus_per_node``
    GPUs generate (one engine each); with one GPU, both share it.

    The trainer takes GPU 0 because the policy worker runs on "cuda", which every one of its
    executor threads resolves to the thread's current device, GPU 0 unless set otherwise.
    """
    colocated = cfg.policy.generation.colocated
    if num_gpus == 0:
        return DevicePlan("cpu", ["cpu"], "ipc" if engine_processes else "device")
    if colocated.enabled or num_gpus == 1:
        return DevicePlan("cuda:0", ["cuda:0"], "ipc" if engine_processes else "device")
    generation_gpus = colocated.resources.gpus_per_node
    if not 1 <= generation_gpus < num_gpus:
        raise ValueError(
            f"policy.generation.colocated.resources.gpus_per_node={generation_gpus}: non-colocated "
            f"generation needs between 1 and {num_gpus - 1} GPUs (GPU 0 trains)"
        )
    engines = [f"cuda:{index}" for index in range(1, generation_gpus + 1)]
    # Engines in this process read the trainer's buffer by peer copy; others join NCCL.
    return DevicePlan("cuda:0", engines, "nccl" if engine_processes else "device")


def make_train_batch(
    lengths: list[int], vocab: int, seed: int, *, prompt_tokens: int
) -> dict[str, torch.Tensor]:
    """A GRPO training batch of random rows of ``lengths``; the first ``prompt_tokens`` are masked."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(3, vocab, (length,), generator=generator)
        attention[row, :length] = 1
    token_mask = attention.float()
    token_mask[:, :prompt_tokens] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, 1, generator=generator).expand(rows, width).contiguous(),
        "generation_logprobs": -torch.rand(rows, width, generator=generator) * token_mask,
        "prev_logprobs": -torch.rand(rows, width, generator=generator) * token_mask,
    }
