"""GRPO on GPUs: ceilings, decode vs the bandwidth floor, training MFU, weight sync, pumps.

Random-init Qwen2 models of real sizes (0.5B, 1.5B; built from a config in code), a synthetic
GRPO task (the counting prompts behind a 60-token prefix) whose completion lengths follow a
clipped lognormal long tail (``gpu_common.LongTail``). The controller runs in-process
(no Ray); the engine runs in the controller's process or in a spawned child process.

Parts (``--part``, several allowed; each prints ``RESULT {json}`` and writes ``<out>/*.json``):

- ``ceilings``: bf16 matrix product (8192³, random data) and device-to-device copy.
- ``decode``: the engine's decode tokens/s at batch 64 and 256 against plain
  ``model.generate`` and against the bandwidth floor (weights + KV cache bytes read per
  decode step ÷ measured copy bandwidth).
- ``train``: PolicyWorker fwd/bwd + optimizer tokens/s and MFU (6·N·tokens + attention) for
  0.5B, with and without activation checkpointing.
- ``sync``: weight-sync seconds for 0.5B and 1.5B: host round trip (export to CPU + load),
  in-process device copy, CUDA IPC to an engine in another process, and NCCL to an engine on
  another GPU when there are two.
- ``grpo``: the controller table: sync (in_order, lookahead 0), async (in_order 1),
  streaming weight_fifo (chunks of a quarter step) and streaming ready_first (whole-step
  chunks: a step trains the first groups to finish) by default; ``--modes`` adds in_order 2.
  Each colocated / sharing one GPU in one process / in two processes (CUDA IPC sync) / on two
  GPUs (NCCL sync) when there are two. The one-GPU placements run the config `tandemrl train`
  takes: ``policy.generation.colocated.enabled`` with ``stand_down`` on for the colocated
  placements and off for the others.
  ``colocated`` frees the engine's cache and graphs for every train step;
  ``colocated_kept`` and ``two_processes_paused`` stand the engine down without freeing
  (``policy.generation.colocated.free_cache_on_sleep=false``), in the trainer's process or in
  its own: the GPU then never runs decode and training at once. ``shared_gpu`` runs both at
  once: the engine's step thread decodes on a high-priority stream of its own beside the
  trainer's thread (``--engine-stream default`` puts it back on the trainer's stream).
  ``shared_gpu_split`` is ``shared_gpu`` with the SMs split between the two
  (``tandemrl.sm_partition``): the engine decodes on ``--engine-sms`` of them, the trainer runs
  on the rest, so neither waits for the other's blocks. ``shared_gpu_turns`` is ``shared_gpu``
  with the GPU taken in turns: each engine step (one decode launch) and each trainer call
  holds one lock, and the trainer waits for the device before and after its call, so decode
  and training never run at once but the engine keeps decoding whenever the trainer is idle.

    python benchmarks/gpu_grpo.py --part ceilings decode train sync grpo --out runs/gpu
    python benchmarks/gpu_grpo.py --size tiny --part decode train sync grpo   # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import (
    EOS_TOKEN_ID,
    QWEN2_SIZES,
    EngineHost,
    LongTail,
    RemoteObject,
    build_model_folder,
    device_plan,
    make_engine_host,
    make_train_batch,
)

from tandemrl.codec import TextCodec
from tandemrl.config.loader import load_config
from tandemrl.config.models import SamplerConfig
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.controller.weight_sync import (
    CudaIpcWeightSync,
    DeviceWeightSync,
    DirectWeightSync,
    NcclWeightSync,
)
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation import torch_engine
from tandemrl.records import GenerationRequest
from tandemrl.samplers import required_buffer_capacity
from tandemrl.sm_partition import SmShare, split_sms
from tandemrl.training.policy_worker import PolicyWorker
from tandemrl.transport.process_group import leave_process_group
from tandemrl.transport.sender import FlatWeightSender

PROMPT_PREFIX_TOKENS = 60
GOALS = {
    "decode_speedup_vs_generate": 10.0,
    "decode_floor_fraction_b256": 0.25,
    "train_mfu_0.5b": 0.45,
    "sync_fraction_of_step": 0.05,
    "async_speedup": 1.5,
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def emit(out: Path, name: str, payload: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"RESULT {json.dumps({'part': name, **payload})}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- ceilings


def part_ceilings(device: torch.device) -> dict[str, float]:
    size = 8192
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for repeat in range(13):
        synchronize(device)
        started = time.perf_counter()
        a @ b
        synchronize(device)
        if repeat >= 3:
            times.append(time.perf_counter() - started)
    tflops = 2 * size**3 / statistics.median(times) / 1e12
    del a, b
    source = torch.randn(2**30, device=device, dtype=torch.float32)  # 4 GiB
    target = torch.empty_like(source)
    times = []
    for repeat in range(13):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        if repeat >= 3:
            times.append(time.perf_counter() - started)
    bandwidth = 2 * source.numel() * 4 / statistics.median(times) / 1e12
    del source, target
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return {"bf16_matmul_tflops": tflops, "copy_tb_per_s": bandwidth}


# ---------------------------------------------------------------------- decode


def kv_bytes_per_token(config: Any, dtype_bytes: int = 2) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


async def _engine_decode(
    host: EngineHost, batch: int, prompt_len: int, new_tokens: int, seed: int
) -> float:
    generator = torch.Generator().manual_seed(seed)
    vocab = host.engine.vocab_size
    requests = [
        GenerationRequest(
            request_id=f"d{seed}-{row}",
            prompt_token_ids=torch.randint(3, vocab, (prompt_len,), generator=generator).tolist(),
            max_new_tokens=new_tokens,
            stop_token_ids=(),
        )
        for row in range(batch)
    ]
    host.engine.eos_token_ids = frozenset()  # fixed lengths for the measurement
    started = time.perf_counter()
    results = await host.generate(requests)
    elapsed = time.perf_counter() - started
    tokens = sum(len(result.token_ids) for result in results)
    return tokens / elapsed


def _plain_generate(model: Any, batch: int, prompt_len: int, new_tokens: int) -> float:
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
    synchronize(device)
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    synchronize(device)
    return batch * (output.shape[1] - prompt_len) / (time.perf_counter() - started)


def part_decode(folder: Path, device: torch.device, args: argparse.Namespace, bw: float) -> dict:
    """Engine decode (static path, ``cuda_graphs`` auto, and the dynamic path) vs generate."""
    rows: dict[int, dict[str, Any]] = {}
    weight_bytes, kv_token = 0, 0
    for mode in args.decode_engine_modes:
        host = EngineHost(
            str(folder), device=str(device), max_batch_size=512, lengths=None, cuda_graphs=mode
        )
        model = host.engine.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv_token = kv_bytes_per_token(model.config)
        suffix = "" if mode == "auto" else f"_{mode}"

        async def run(host: EngineHost = host, suffix: str = suffix) -> None:
            for batch in args.decode_batches:
                # Warm-up at the measured batch: compilation and graph capture stay outside.
                await _engine_decode(host, batch, args.prompt_len, args.new_tokens, seed=99)
                busy0, steps0 = host.step_busy_s, host.engine.stats.decode_steps
                engine_tps = await _engine_decode(
                    host, batch, args.prompt_len, args.new_tokens, batch
                )
                steps = host.engine.stats.decode_steps - steps0
                row = rows.setdefault(batch, {"batch": batch})
                row[f"engine{suffix}_tok_s"] = engine_tps
                row[f"engine{suffix}_ms_per_step"] = 1e3 * (host.step_busy_s - busy0) / steps
                row[f"engine{suffix}_static"] = host.engine.static_decode
            await host.shutdown()

        asyncio.run(run())
        if mode == args.decode_engine_modes[-1]:
            for batch in args.decode_batches:
                rows[batch]["plain_generate_tok_s"] = _plain_generate(
                    model, batch, args.prompt_len, args.new_tokens
                )
        del host, model
        _empty_cache(device)
    for row in rows.values():
        context = args.prompt_len + args.new_tokens / 2
        step_bytes = weight_bytes + row["batch"] * context * kv_token
        floor_tps = row["batch"] / (step_bytes / (bw * 1e12))
        for key in [key for key in row if key.endswith("_tok_s") and key.startswith("engine")]:
            row[key.replace("_tok_s", "_speedup_vs_generate")] = (
                row[key] / row["plain_generate_tok_s"]
            )
            row[key.replace("_tok_s", "_floor_fraction")] = row[key] / floor_tps
        row.update({"floor_tok_s": floor_tps, "floor_ms": 1e3 * step_bytes / (bw * 1e12)})
        row["step_bytes"] = step_bytes
        log(f"decode batch {row['batch']}: {row}")
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_token,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "rows": list(rows.values()),
    }


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- train


def training_flops(params: int, config: Any, lengths: list[int]) -> float:
    """6·N per token (forward + backward, lm_head included) + causal attention 6·L·d·len²."""
    attention = 6 * config.num_hidden_layers * config.hidden_size * sum(n * n for n in lengths)
    return 6 * params * sum(lengths) + attention


# ``--trainer tuned`` (the default for the grpo part): the trainer a user would run on a GPU,
# the settings of the best MFU row of docs/benchmarks.md: every decoder layer compiled, the
# micro-batch's rows packed into one sequence (``sequence_packing: auto`` packs on CUDA), all
# of a step's rows in one micro-batch, and no separate no-grad logprob forward (the training
# forward supplies ``prev_logprobs``; exact for GRPO's one optimizer step per batch).
# ``--trainer plain``: the settings the earlier tables ran (64-row micro-batches, eager
# layers, a get_logprobs forward per step).
TRAINER_OVERRIDES: dict[str, list[str]] = {
    "tuned": [
        "policy.compile_layers=true",
        "policy.sequence_packing=auto",
        "loss_fn.reuse_training_logprobs=true",
    ],
    "plain": [],
}


def max_total_sequence_length(args: argparse.Namespace) -> int:
    """The trainer's policy.max_total_sequence_length for the workload: prompt + completion."""
    return PROMPT_PREFIX_TOKENS + 16 + args.length_cap


def engine_max_seq_len(args: argparse.Namespace) -> int:
    if args.engine_max_seq_len is not None:
        return args.engine_max_seq_len
    return max_total_sequence_length(args)


def micro_batch_rows(args: argparse.Namespace) -> int:
    if args.micro_batch is not None:
        return args.micro_batch
    return args.prompts_per_step * args.group_size if args.trainer == "tuned" else 64


def grpo_config(folder: Path, args: argparse.Namespace, overrides: list[str] = ()) -> Any:
    n, g = args.prompts_per_step, args.group_size
    base = [
        f"policy.model_name={folder}",
        f"policy.device={'cuda' if torch.cuda.is_available() else 'cpu'}",
        f"policy.train_global_batch_size={n * g}",
        f"policy.train_micro_batch_size={micro_batch_rows(args)}",
        f"policy.max_total_sequence_length={max_total_sequence_length(args)}",
        f"policy.generation.max_new_tokens={args.length_cap}",
        "policy.optimizer.lr=1.0e-6",
        f"grpo.num_prompts_per_step={n}",
        f"grpo.num_generations_per_prompt={g}",
        "loss_fn.entropy_coef=0.0",
    ]
    return load_config("examples/configs/grpo_tiny_cpu.yaml", (*base, *overrides))


def part_train(folder: Path, device: torch.device, args: argparse.Namespace, peak: float) -> dict:
    rows = []
    tail = LongTail(median=args.train_len_median, sigma=0.6, minimum=64, cap=args.train_len_cap)
    lengths = [tail.length(f"t{i}") for i in range(args.train_sequences)]
    for checkpointing in (False, True):
        cfg = grpo_config(
            folder,
            args,
            [
                f"policy.train_micro_batch_size={args.train_micro_batch}",
                f"policy.max_total_sequence_length={args.train_len_cap}",
                f"policy.dtensor_cfg.activation_checkpointing={str(checkpointing).lower()}",
            ],
        )
        worker = PolicyWorker(cfg.policy, cfg.loss_fn, model_path=folder)
        params = sum(p.numel() for p in worker.model.parameters())
        config = worker.model.config
        batch = make_train_batch(
            lengths, config.vocab_size, seed=1, prompt_tokens=PROMPT_PREFIX_TOKENS
        )

        async def step(worker: PolicyWorker = worker, batch: dict = batch) -> None:
            await worker.begin_train_step()
            await worker.train_microbatches(batch, step_num_sequences=len(lengths))
            await worker.finish_train_step()

        asyncio.run(step())  # warm-up (allocates optimizer state)
        synchronize(device)
        _reset_peak(device)
        times = []
        for _ in range(args.train_repeats):
            started = time.perf_counter()
            asyncio.run(step())
            synchronize(device)
            times.append(time.perf_counter() - started)
        seconds = statistics.median(times)
        asyncio.run(worker.get_logprobs(batch))  # warm-up of the no-grad path
        synchronize(device)
        started = time.perf_counter()
        asyncio.run(worker.get_logprobs(batch))
        synchronize(device)
        logprob_seconds = time.perf_counter() - started
        flops = training_flops(params, config, lengths)
        rows.append(
            {
                "activation_checkpointing": checkpointing,
                "params": params,
                "tokens": sum(lengths),
                "padded_tokens": _padded_tokens(lengths, args.train_micro_batch),
                "step_s": seconds,
                "tokens_per_s": sum(lengths) / seconds,
                "mfu": flops / seconds / (peak * 1e12),
                "logprob_tokens_per_s": sum(lengths) / logprob_seconds,
                "logprob_mfu": flops / 3 / logprob_seconds / (peak * 1e12),
                "max_memory_gib": _peak_gib(device),
            }
        )
        log(f"train: {rows[-1]}")
        del worker
        _empty_cache(device)
    return {"lengths_mean": statistics.mean(lengths), "sequences": len(lengths), "rows": rows}


def _padded_tokens(lengths: list[int], micro: int) -> int:
    lengths = sorted(lengths, reverse=True)  # the worker sorts rows by length
    return sum(
        max(lengths[i : i + micro]) * len(lengths[i : i + micro])
        for i in range(0, len(lengths), micro)
    )


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


# ---------------------------------------------------------------------- weight sync


def _engine_kwargs(folder: Path, device: str, args: argparse.Namespace, lengths: Any) -> dict:
    return {
        "model_path": str(folder),
        "device": device,
        "max_batch_size": args.max_batch,
        "lengths": lengths,
        "steps_per_launch": args.steps_per_launch,
    }


async def _time_syncs(sync: Any, repeats: int) -> list[float]:
    return [await sync.sync(version) for version in range(1, repeats + 1)]


def part_sync(folders: dict[str, Path], device: torch.device, args: argparse.Namespace) -> dict:
    num_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    rows = []
    for size, folder in folders.items():
        rows.append(_sync_one(size, folder, device, args, num_gpus))
        log(f"sync: {rows[-1]}")
        _empty_cache(device)
    return {"rows": rows}


class _CpuExporter:
    """The host round trip of ``DirectWeightSync``: a CPU copy of every tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    async def export_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}


def _sync_one(
    size: str, folder: Path, device: torch.device, args: argparse.Namespace, num_gpus: int
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from tandemrl.rollout.generation_pool import GenerationPool

    trainer_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    trainer_model.to(device)
    sender = FlatWeightSender(trainer_model, torch.bfloat16)
    row: dict[str, Any] = {"size": size, "bytes": sender.layout.nbytes}
    if args.sync_nccl_only and num_gpus >= 2:
        asyncio.run(_sync_nccl(row, sender, folder, device, args))
        return row

    async def in_process() -> None:
        host = EngineHost(**_engine_kwargs(folder, str(device), args, None))
        host_trip = DirectWeightSync(_CpuExporter(trainer_model), GenerationPool([host]))
        row["host_round_trip_s"] = statistics.median(await _time_syncs(host_trip, 2))
        device_sync = DeviceWeightSync(sender, [host])
        row["device_copy_s"] = statistics.median(await _time_syncs(device_sync, 5))
        row.update(_sync_breakdown(sender, host.engine))
        engine_params = host.engine.model.state_dict()
        row["device_copy_max_abs_err"] = max(
            float((engine_params[name].float() - value.to(torch.bfloat16).float()).abs().max())
            for name, value in trainer_model.state_dict().items()
        )
        await host.shutdown()

    asyncio.run(in_process())
    _empty_cache(device)

    async def ipc() -> None:
        remote = RemoteObject(make_engine_host, _engine_kwargs(folder, str(device), args, None))
        try:
            await remote.weight_version()  # the child has built its engine
            sync = CudaIpcWeightSync(sender, [remote])
            started = time.perf_counter()
            await sync.sync(0)
            row["ipc_first_sync_s"] = time.perf_counter() - started  # maps the handle
            row["ipc_s"] = statistics.median(await _time_syncs(sync, 5))
            await remote.shutdown()
        finally:
            remote.close()

    asyncio.run(ipc())
    if num_gpus >= 2:
        asyncio.run(_sync_nccl(row, sender, folder, device, args))
    return row


def _sync_breakdown(sender: FlatWeightSender, engine: Any, repeats: int = 5) -> dict[str, float]:
    """Medians of the parts of an in-process sync, each timed alone between device syncs: the
    trainer's staging, the engine's load of the staged views (its ``_load_state_dict``), and
    the module-walking ``load_state_dict`` that load replaced (for comparison)."""
    views = sender.layout.views(sender.buffer)

    def timed(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            synchronize(sender.device)
            started = time.perf_counter()
            fn()
            synchronize(sender.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def module_load() -> None:
        with torch.no_grad():
            engine.model.load_state_dict(views, strict=False)

    return {
        "stage_s": timed(sender.stage),
        "engine_load_s": timed(lambda: engine._load_state_dict(views)),
        "module_load_state_dict_s": timed(module_load),
    }


async def _sync_nccl(
    row: dict[str, Any],
    sender: FlatWeightSender,
    folder: Path,
    device: torch.device,
    args: argparse.Namespace,
) -> None:
    remote = RemoteObject(make_engine_host, _engine_kwargs(folder, "cuda:1", args, None))
    try:
        await remote.weight_version()
        sync = NcclWeightSync(sender, [remote])
        started = time.perf_counter()
        await sync.sync(0)  # forms the group (TCP store, NCCL communicator) first
        row["nccl_first_sync_s"] = time.perf_counter() - started
        row["nccl_s"] = statistics.median(await _time_syncs(sync, 5))
        await remote.shutdown()
    finally:
        remote.close()
        leave_process_group()


# ---------------------------------------------------------------------- GRPO


# Each mode's async_rl.sampler (sync: in_order without lookahead, and no importance weights).
SAMPLERS: dict[str, dict[str, Any]] = {
    "sync": {"name": "in_order", "max_lookahead_versions": 0},
    "async_in_order_1": {"name": "in_order", "max_lookahead_versions": 1},
    "async_in_order_2": {"name": "in_order", "max_lookahead_versions": 2},
    "streaming_weight_fifo": {"name": "weight_fifo", "max_staleness_versions": 1},
    "streaming_ready_first": {"name": "ready_first", "max_staleness_versions": 1},
}
MODES: dict[str, list[str]] = {
    mode: [
        "async_rl.sampler={" + ", ".join(f"{key}: {value}" for key, value in sampler.items()) + "}",
        *(["loss_fn.use_importance_sampling_correction=false"] if mode == "sync" else []),
    ]
    for mode, sampler in SAMPLERS.items()
}
# Groups per train chunk of the streaming modes when --stream-chunk-groups is not given: a
# quarter step for weight_fifo (the table's streaming rows since run C), the whole step for
# ready_first (a step is the first N groups to finish, whatever their dispatch order).
STREAM_CHUNK_FRACTION = {"streaming_weight_fifo": 4, "streaming_ready_first": 1}


class TimedTrainer:
    """Delegates to the policy worker; counts busy seconds and tokens of its coroutine calls."""

    def __init__(self, worker: PolicyWorker) -> None:
        self._worker = worker
        self.busy_s = 0.0
        self.train_tokens = 0
        self.logprob_tokens = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._worker, name)
        if not inspect.iscoroutinefunction(attribute):
            return attribute

        async def timed(*args: Any, **kwargs: Any) -> Any:
            if args and isinstance(args[0], dict) and "attention_mask" in args[0]:
                tokens = int(args[0]["attention_mask"].sum())
                if name == "train_microbatches":
                    self.train_tokens += tokens
                elif name == "get_logprobs":
                    self.logprob_tokens += tokens
            started = time.perf_counter()
            try:
                return await attribute(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - started

        return timed


def bench_codec() -> TextCodec:
    prefix = [3 + (7 * index) % 200 for index in range(PROMPT_PREFIX_TOKENS)]
    return TextCodec(
        encode=lambda text: prefix + [3 + ord(ch) % 200 for ch in text],
        decode=lambda ids: "".join(str(i % 10) for i in ids),
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
    )


# Placements whose engine stands down while the trainer runs (policy.generation.colocated):
# "colocated" frees its cache and graphs; "colocated_kept" (free_cache_on_sleep=false) and
# "two_processes_paused" (the engine in its own process) only pause.
STANDS_DOWN = ("colocated", "colocated_kept", "two_processes_paused")
REMOTE_ENGINE = ("two_processes", "two_processes_paused", "two_gpus")


def mode_overrides(mode: str, placement: str, args: argparse.Namespace) -> list[str]:
    n = args.prompts_per_step
    stands_down = placement in STANDS_DOWN
    chunk = n
    if mode in STREAM_CHUNK_FRACTION and not stands_down:  # a colocated step is one batch
        chunk = args.stream_chunk_groups or max(1, n // STREAM_CHUNK_FRACTION[mode])
    overrides = [
        *MODES[mode],
        f"async_rl.min_groups_for_streaming_train={chunk}",
        f"async_rl.max_buffered_rollouts={sampler_capacity(mode, n)}",
        f"async_rl.max_inflight_prompts={sampler_capacity(mode, n)}",
        f"grpo.max_num_steps={args.warmup_steps + args.steps}",
        "policy.generation.colocated.free_cache_on_sleep=" + str(placement == "colocated").lower(),
    ]
    if placement == "two_gpus":
        overrides += [
            "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.gpus_per_node=1",
        ]
    else:  # one GPU: what `tandemrl train` runs, with or without the stand-down
        overrides += [
            "policy.generation.colocated.enabled=true",
            f"policy.generation.colocated.stand_down={str(stands_down).lower()}",
        ]
    return overrides


def sampler_capacity(mode: str, groups_per_step: int) -> int:
    """The mode's sampler's required buffer capacity (= its in-flight cap here): the batch
    being trained plus the batches its gate lets dispatch run ahead."""
    sampler = TypeAdapter(SamplerConfig).validate_python(SAMPLERS[mode])
    return required_buffer_capacity(sampler, groups_per_step)


async def engine_stats(engines: list[Any]) -> dict[str, float]:
    """Counters summed over engines; ``step_busy_s`` is averaged (a busy fraction per engine)."""
    each = [await engine.stats() for engine in engines]
    total = {key: sum(stats[key] for stats in each) for key in each[0]}
    total["step_busy_s"] /= len(each)
    return total


@functools.cache
def sm_split(device: torch.device, engine_sms: int) -> tuple[SmShare, SmShare]:
    """One split per process and count (green contexts live as long as the process)."""
    return split_sms(device, engine_sms)


def hold_around_calls(worker: PolicyWorker, *, synchronize: bool) -> threading.Lock:
    """A lock each of the worker's calls holds, for an engine thread in the same process.

    ``synchronize`` (shared_gpu_turns): the call also waits for the device before it starts
    (the engine's decode launch in flight) and before it lets go (its own kernels), and the
    engine's steps hold the lock too (``EngineHost(gpu_turns=...)``), so the two take turns.
    Without it (every other in-process placement) only the engine's CUDA graph captures hold
    it (``capture_lock``): a device-wide synchronize in the trainer's thread, which inductor
    runs when it autotunes a new shape, fails while a capture is open in the engine's thread.
    """
    lock = threading.Lock()
    call = worker._executor._locked
    cuda = synchronize and torch.cuda.is_available()  # on CPU every call is synchronous already

    def held(fn: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            if cuda:
                torch.cuda.synchronize()
            try:
                return call(fn, *args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.synchronize()

    worker._executor._locked = held  # type: ignore[method-assign]
    return lock


def run_grpo(
    folder: Path, mode: str, placement: str, args: argparse.Namespace, peak: float
) -> dict:
    overrides = [*TRAINER_OVERRIDES[args.trainer], *mode_overrides(mode, placement, args)]
    cfg = grpo_config(folder, args, overrides)
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if placement != "two_gpus":
        num_gpus = min(num_gpus, 1)  # the one-GPU placements
    remote_engine = placement in REMOTE_ENGINE
    plan = device_plan(cfg, num_gpus=num_gpus, engine_processes=remote_engine)
    trainer_device = torch.device(plan.trainer_device)
    if trainer_device.type == "cuda":
        torch.cuda.set_device(trainer_device)
    lengths = LongTail(median=args.length_median, sigma=args.length_sigma, cap=args.length_cap)
    worker = PolicyWorker(cfg.policy, cfg.loss_fn, model_path=folder)
    engine_share = None
    if placement == "shared_gpu_split":
        engine_share, worker._executor.sm_share = sm_split(trainer_device, args.engine_sms)
        if args.split_engine == "whole":
            engine_share = None  # the engine decodes on every SM, the trainer on its share
    gpu_turns = capture_lock = None
    if placement == "shared_gpu_turns":
        gpu_turns = hold_around_calls(worker, synchronize=True)
    elif not remote_engine:
        capture_lock = hold_around_calls(worker, synchronize=False)
    trainer = TimedTrainer(worker)
    sender = FlatWeightSender(worker.model, torch.bfloat16)
    engines: list[Any] = []
    remotes: list[RemoteObject] = []
    for engine_device in plan.engine_devices:
        engine_kwargs = _engine_kwargs(folder, engine_device, args, lengths)
        # The static cache's positions per slot (policy.generation.torch.max_seq_len): what a
        # user sets for this workload, the trainer's max_total_sequence_length; 0: the engine's
        # default (the model's positions, at most 4096), 20x the bytes to allocate and zero
        # at every colocated wake.
        engine_kwargs["max_seq_len"] = engine_max_seq_len(args) or None
        engine_kwargs["free_cache_on_sleep"] = cfg.policy.generation.colocated.free_cache_on_sleep
        if engine_share is not None:
            engine_kwargs["sm_share"] = engine_share
        if gpu_turns is not None:
            engine_kwargs["gpu_turns"] = gpu_turns
        if capture_lock is not None:
            engine_kwargs["capture_lock"] = capture_lock
        if remote_engine:
            remotes.append(RemoteObject(make_engine_host, engine_kwargs))
            engines.append(remotes[-1])
        else:
            engines.append(EngineHost(**engine_kwargs))

    async def run() -> dict[str, Any]:
        if plan.transport == "nccl":
            weight_sync: Any = NcclWeightSync(sender, engines)
        elif plan.transport == "ipc":
            weight_sync = CudaIpcWeightSync(sender, engines)
        else:
            weight_sync = DeviceWeightSync(sender, engines)
        await weight_sync.sync(0)  # engines start from the trainer's exact (bf16) weights
        marks: dict[str, Any] = {}

        marks["per_step"] = []

        async def hook(controller: Any, row: dict[str, float]) -> None:
            if row["step"] < args.warmup_steps:
                return
            now = time.perf_counter()
            stats = await engine_stats(engines)
            if row["step"] == args.warmup_steps:
                marks["t0"] = now
                marks["trainer0"] = (trainer.busy_s, trainer.train_tokens, trainer.logprob_tokens)
                marks["engine0"] = stats
            # Per measured step: wall, trainer and decode busy seconds since the last step end,
            # so compilation or graph capture leaking into a measured step shows.
            marks["per_step"].append((row["step"], now, trainer.busy_s, stats))

        parts = ControllerParts(
            trainer=trainer,
            engines=engines,
            env=CountingEnv(),
            codec=bench_codec(),
            weight_sync=weight_sync,
        )
        controller = build_controller(cfg, parts, step_hooks=[hook])
        history = await controller.run()
        wall = time.perf_counter() - marks["t0"]
        engine_end = await engine_stats(engines)
        memory = max([await engine.max_memory_gib() for engine in engines])
        for engine in engines:
            await engine.shutdown()
        return {
            "history": history,
            "wall": wall,
            "marks": marks,
            "engine_end": engine_end,
            "engine_memory_gib": memory,
        }

    try:
        raw = asyncio.run(run())
    finally:
        for remote in remotes:
            remote.close()
        if plan.transport == "nccl":
            leave_process_group()
    measured = [row for row in raw["history"] if row["step"] > args.warmup_steps]
    wall = raw["wall"]
    busy0, train_tokens0, logprob_tokens0 = raw["marks"]["trainer0"]
    engine0, engine1 = raw["marks"]["engine0"], raw["engine_end"]
    params = sum(p.numel() for p in worker.model.parameters())
    train_tokens = trainer.train_tokens - train_tokens0
    logprob_tokens = trainer.logprob_tokens - logprob_tokens0
    trainer_busy = trainer.busy_s - busy0
    flops = 6 * params * train_tokens + 2 * params * logprob_tokens
    completion_tokens = sum(row["tokens_per_s"] * row["step_time_s"] for row in measured)
    step_time = statistics.mean(row["step_time_s"] for row in measured)
    sync_s = statistics.mean(row["weight_sync_s"] for row in measured)
    decode_busy = engine1["step_busy_s"] - engine0["step_busy_s"]
    marks_per_step = raw["marks"]["per_step"]
    per_step = [
        {
            "step": step,
            "wall_s": round(t - t_prev, 4),
            "trainer_busy_s": round(busy - busy_prev, 4),
            "decode_busy_s": round(stats["step_busy_s"] - stats_prev["step_busy_s"], 4),
            # Of that, the step thread's waits for the device (the rest is host work).
            "device_wait_s": round(stats["device_wait_s"] - stats_prev["device_wait_s"], 4),
            # Engine work that a warmed-up run should not see, and the admissions' count.
            **{
                key: stats[key] - stats_prev[key]
                for key in ("graph_captures", "admissions", "decode_steps", "kv_recomputes")
                if key in stats
            },
        }
        for (_, t_prev, busy_prev, stats_prev), (step, t, busy, stats) in itertools.pairwise(
            marks_per_step
        )
    ]
    result = {
        "mode": mode,
        "placement": placement,
        "trainer": args.trainer,
        "micro_batch_rows": micro_batch_rows(args),
        "engine_max_seq_len": engine_max_seq_len(args),
        "warmup_steps": args.warmup_steps,
        "transport": plan.transport,
        "devices": {"trainer": plan.trainer_device, "engines": plan.engine_devices},
        "steps": len(measured),
        "steps_per_s": len(measured) / wall,
        "completion_tokens_per_s": completion_tokens / wall,
        # Tokens the trainer took per second (prompts and completions of the trained rows):
        # a streaming step trains the groups that finished first, a sync step its own batch.
        "trained_tokens_per_s": train_tokens / wall,
        "step_time_s": step_time,
        "weight_sync_s": sync_s,
        "sync_fraction_of_step": sync_s / step_time,
        "staleness_mean": statistics.mean(row["staleness_mean"] for row in measured),
        "reward_mean": statistics.mean(row["reward_mean"] for row in measured),
        "train_idle_frac": statistics.mean(row["train_idle_frac"] for row in measured),
        "rollout_idle_frac": statistics.mean(row["rollout_idle_frac"] for row in measured),
        "trainer_busy_frac": trainer_busy / wall,
        "decode_busy_frac": decode_busy / wall,
        "decode_tok_s_while_busy": (engine1["tokens_generated"] - engine0["tokens_generated"])
        / max(decode_busy, 1e-9),
        "mean_decode_batch": (engine1["tokens_generated"] - engine0["tokens_generated"])
        / max(engine1["decode_steps"] - engine0["decode_steps"], 1),
        "trainer_mfu_while_busy": flops / max(trainer_busy, 1e-9) / (peak * 1e12),
        "engine_max_memory_gib": raw["engine_memory_gib"],
        "per_step": per_step,
    }
    log(f"grpo {mode} {placement}: {json.dumps(result)}")
    return result


def part_grpo(folder: Path, args: argparse.Namespace, peak: float) -> dict:
    results: list[dict[str, Any]] = []
    for placement in args.placements:
        for mode in args.modes:
            if placement == "two_gpus" and torch.cuda.device_count() < 2:
                continue
            try:
                results.append(run_grpo(folder, mode, placement, args, peak))
            except Exception:
                log(f"grpo {mode} {placement} FAILED:\n{traceback.format_exc()}")
                results.append(
                    {"mode": mode, "placement": placement, "error": traceback.format_exc()[-2000:]}
                )
            # Keep what is done so far should the run be cut off at its time limit.
            (args.out / "grpo.json").write_text(json.dumps({"partial": results}, indent=1) + "\n")
    speedups = {}
    for placement in args.placements:
        by_mode = {
            r["mode"]: r for r in results if r["placement"] == placement and "error" not in r
        }
        if "sync" in by_mode:
            base = by_mode["sync"]["steps_per_s"]
            speedups[placement] = {m: r["steps_per_s"] / base for m, r in by_mode.items()}
    for row in results:  # a short table last, for logs read from their end
        if "error" in row:
            log(f"{row['placement']:>14} {row['mode']:>22}  FAILED")
            continue
        ratio = speedups.get(row["placement"], {}).get(row["mode"], float("nan"))
        first = row["per_step"][0] if row["per_step"] else {}
        log(
            f"{row['placement']:>14} {row['mode']:>22}  {row['steps_per_s']:.3f} steps/s "
            f"({ratio:.2f}x sync)  busy trainer {row['trainer_busy_frac']:.2f} "
            f"decode {row['decode_busy_frac']:.2f}  sync {1e3 * row['weight_sync_s']:.1f} ms  "
            f"first measured step {first}"
        )
    return {
        "workload": {
            "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size,
            "length_median": args.length_median,
            "length_sigma": args.length_sigma,
            "length_cap": args.length_cap,
            "length_mean": LongTail(
                args.length_median, args.length_sigma, 4, args.length_cap
            ).mean(),
            "prompt_tokens": PROMPT_PREFIX_TOKENS + 5,
        },
        "rows": results,
        "speedup_vs_sync": speedups,
    }


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The command line (also what ``cli_gpu.py`` reads the shared workload settings with)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", nargs="+", default=["ceilings", "decode", "train", "sync", "grpo"]
    )
    parser.add_argument("--size", default="0.5b", choices=sorted(QWEN2_SIZES))
    parser.add_argument("--sync-sizes", nargs="+", default=None)
    parser.add_argument(
        "--sync-nccl-only", action="store_true", help="with 2+ GPUs: time only the NCCL sync"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_grpo"))
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "gpu_models")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument(
        "--decode-engine-modes",
        nargs="+",
        default=["auto", "off"],
        help="policy.generation.torch.cuda_graphs values to time the engine with",
    )
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--train-sequences", type=int, default=64)
    parser.add_argument("--train-micro-batch", type=int, default=16)
    parser.add_argument("--train-len-median", type=float, default=512)
    parser.add_argument("--train-len-cap", type=int, default=1024)
    parser.add_argument("--train-repeats", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="grpo training micro-batch rows (default: the whole step when tuned, else 64)",
    )
    parser.add_argument(
        "--trainer",
        default="tuned",
        choices=sorted(TRAINER_OVERRIDES),
        help="grpo trainer settings: tuned = compiled layers, packed rows, one micro-batch, "
        "no separate logprob forward; plain = the earlier untuned settings",
    )
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--length-median", type=float, default=24)
    parser.add_argument("--length-sigma", type=float, default=1.0)
    parser.add_argument(
        "--engine-max-seq-len",
        type=int,
        default=None,
        help="grpo engines' static cache positions per slot (default: the trainer's "
        "max_total_sequence_length; 0: the engine's default, up to 4096)",
    )
    parser.add_argument("--length-cap", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="unmeasured steps per grpo row (default 3 with --trainer tuned: the compiled "
        "layers compile a static and then a dynamic-shape graph; else 1)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=["sync", "async_in_order_1", "streaming_weight_fifo", "streaming_ready_first"],
    )
    parser.add_argument(
        "--stream-chunk-groups",
        type=int,
        default=None,
        help="groups per train chunk (async_rl.min_groups_for_streaming_train) of the streaming "
        "modes; default a quarter step for weight_fifo, the whole step for ready_first",
    )
    parser.add_argument(
        "--placements",
        nargs="+",
        default=["colocated", "shared_gpu", "two_processes"],
        choices=[
            "colocated",
            "colocated_kept",
            "shared_gpu",
            "shared_gpu_split",
            "shared_gpu_turns",
            "two_processes",
            "two_processes_paused",
            "two_gpus",
        ],
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="Python's thread switch interval (sys.setswitchinterval; default: Python's 5 ms). "
        "shared_gpu runs the engine's step thread beside the trainer's thread in one process",
    )
    parser.add_argument(
        "--sm-carveout",
        type=int,
        default=None,
        help="SMs that cuBLASLt products leave free (torch._C._set_sm_carveout_experimental; "
        "with --blas-library cublaslt, every product): room for the engine's decode kernels "
        "beside the trainer's persistent matrix products in shared_gpu",
    )
    parser.add_argument("--blas-library", choices=["cublas", "cublaslt"], default=None)
    parser.add_argument(
        "--engine-sms",
        type=int,
        default=40,
        help="shared_gpu_split: SMs for the engine (the driver rounds up to its group size); "
        "the trainer gets the rest",
    )
    parser.add_argument(
        "--split-engine",
        choices=["share", "whole"],
        default="share",
        help="shared_gpu_split: the engine decodes on its share of the SMs, or on the whole "
        "GPU (its own high-priority stream) while only the trainer is confined to its share",
    )
    parser.add_argument(
        "--engine-stream",
        choices=["own", "default"],
        default="own",
        help="engines in this process (shared_gpu, colocated*) decode on a high-priority stream "
        "of their own (the engine's default) or on the default stream, the trainer's "
        "(torch_engine.OWN_STREAM)",
    )
    parser.add_argument(
        "--steps-per-launch",
        type=int,
        default=1,
        help="policy.generation.torch.steps_per_launch of the GRPO rows' engines: decode steps "
        "per graph replay and host wait",
    )
    parser.add_argument("--ceil-tflops", type=float, default=784.0)
    parser.add_argument("--ceil-tbps", type=float, default=4.22)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.warmup_steps is None:
        args.warmup_steps = 3 if args.trainer == "tuned" else 1
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.blas_library is not None:
        torch.backends.cuda.preferred_blas_library(args.blas_library)
    if args.sm_carveout is not None:
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
    torch_engine.OWN_STREAM = args.engine_stream == "own"
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    build_device = "cuda" if device.type == "cuda" else "cpu"
    folder = build_model_folder(args.size, args.models / f"qwen2-{args.size}", device=build_device)
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "torch": torch.__version__,
        "switch_interval_ms": sys.getswitchinterval() * 1000,
        "sm_carveout": args.sm_carveout,
        "blas_library": args.blas_library,
        "engine_stream": args.engine_stream,
        "steps_per_launch": args.steps_per_launch,
    }
    emit(args.out, "env", summary)
    peak, bandwidth = args.ceil_tflops, args.ceil_tbps
    for part in args.part:
        started = time.perf_counter()
        try:
            if part == "ceilings":
                payload = part_ceilings(device)
                peak, bandwidth = payload["bf16_matmul_tflops"], payload["copy_tb_per_s"]
            elif part == "decode":
                payload = part_decode(folder, device, args, bandwidth)
            elif part == "train":
                payload = part_train(folder, device, args, peak)
            elif part == "sync":
                sizes = args.sync_sizes or [args.size]
                folders = {
                    size: build_model_folder(
                        size, args.models / f"qwen2-{size}", device=build_device
                    )
                    for size in sizes
                }
                payload = part_sync(folders, device, args)
            elif part == "grpo":
                payload = part_grpo(folder, args, peak)
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception:
            log(f"part {part} FAILED:\n{traceback.format_exc()}")
            payload = {"error": traceback.format_exc()[-3000:]}
        payload["seconds"] = time.perf_counter() - started
        payload["goals"] = GOALS
        emit(args.out, part, payload)


if __name__ == "__main__":
    main()
