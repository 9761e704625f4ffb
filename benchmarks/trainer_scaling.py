"""Trained tokens per second of the sharded trainer (FSDP2) against one process.

``--mode cpu`` (the default; gloo): the real trainer processes on local Ray — the unsharded
``PolicyWorker`` actor (data-parallel 1) and a 2-rank ``ShardedTrainer`` (data-parallel 2,
``tandemrl.controller.setup.launch_trainer_group``) — each timed over ``--steps`` whole RL
steps (get_logprobs, begin, train_microbatches, finish) on the same batch after one warm-up
step. Tokens are the step's loss tokens. Then both start again from the same weights, take
one step on the same batch, and the largest parameter difference is reported
(``dp2_max_param_diff``; float32 summation order is all that differs).

    RESULT {"dp1_tokens_per_s", "dp2_tokens_per_s", "dp2_over_dp1_tokens_per_s",
            "dp2_max_param_diff", ...}

On a 2-core machine two ranks share the cores with Ray and each other, so the ratio says
little about scaling; run it where each rank has cores of its own.

``--mode gpu`` (one GPU; NCCL): the FSDP2 trainer at size 1 (``ShardedPolicyWorker`` in a
one-rank NCCL group, bf16 parameters gathered, fp32 reduction) against today's single-process
trainer (``PolicyWorker``: fp32 parameters under bf16 autocast) on a 0.5B-shaped random Qwen2
(``gpu_common``), both in this process with ``examples/configs/grpo_gpu_1x.yaml``'s trainer
(compiled layers, packed rows, the training forward's logprobs reused). The workload is the
one of the MFU table in docs/benchmarks.md: 64 rows, lengths lognormal (median 512, sigma 0.6)
in [64, 1024], 34,777 tokens, the whole step in one packed micro-batch. Each trainer is the
median of ``--repeats`` whole steps after two warm-up steps, all in one event loop as in the
trainer's Ray actor (``--loop-per-step`` also times a loop per step: fresh executor threads).
MFU = (6 · parameters · tokens + causal attention) / step time / the bf16 matrix-product rate
measured at the start of the run (``mfu_datasheet``: against ``--peak-tflops``). Goal:
``fsdp1_over_single_step_time`` ≤ 1.05 and ``mfu`` ≥ 0.45.

    RESULT {"single_step_s", "fsdp1_step_s", "fsdp1_over_single_step_time", "mfu",
            "mfu_single", "matmul_ceiling_tflops", "variants", ...}

    python benchmarks/trainer_scaling.py                    # CPU, gloo
    python benchmarks/trainer_scaling.py --mode gpu --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tandemrl.config.loader import load_config
from tandemrl.training.batch import count_loss_tokens

CPU_PRESET = {  # Qwen2 h256 L4 (about 2.6 M parameters): compute is not all overhead
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "tie_word_embeddings": True,
    "max_position_embeddings": 256,
}
H200_BF16_PEAK_TFLOPS = 989.0


def build_cpu_model(folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        config = Qwen2Config(**CPU_PRESET, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def random_batch(
    rows: int, length: int, prompt: int, vocab: int, seed: int
) -> dict[str, torch.Tensor]:
    """Rows of ``length`` tokens (the first ``prompt`` masked), uneven by up to a quarter."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [
        length - int(torch.randint(0, length // 4, (1,), generator=generator)) for _ in range(rows)
    ]
    width = max(lengths)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    for row, size in enumerate(lengths):
        input_ids[row, :size] = torch.randint(3, vocab, (size,), generator=generator)
        attention[row, :size] = 1
    token_mask = attention.float()
    token_mask[:, :prompt] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, 1, generator=generator).expand(rows, width).contiguous(),
        "generation_logprobs": -torch.rand(rows, width, generator=generator) * token_mask,
    }


async def one_step(trainer: Any, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    batch = dict(batch)
    batch["prev_logprobs"] = await trainer.get_logprobs(batch)
    await trainer.begin_train_step()
    await trainer.train_microbatches(
        batch,
        step_num_sequences=batch["input_ids"].shape[0],
        step_num_tokens=count_loss_tokens(batch),
    )
    return await trainer.finish_train_step()


async def timed_steps(trainer: Any, batch: dict[str, torch.Tensor], steps: int) -> float:
    """Loss tokens per second over ``steps`` steps after one warm-up step."""
    await one_step(trainer, batch)
    started = time.perf_counter()
    for _ in range(steps):
        await one_step(trainer, batch)
    return steps * count_loss_tokens(batch) / (time.perf_counter() - started)


def flat_params(flat: Any) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in flat.to_state_dict().items()}


def cpu_mode(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from tandemrl.controller.actor import as_trainer
    from tandemrl.controller.setup import launch_trainer_group, plan_placement
    from tandemrl.training.policy_worker import create_policy_worker_actor

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    model_dir = build_cpu_model(Path(tempfile.mkdtemp(prefix="trainer_scaling_")) / "model")
    overrides = (
        f"policy.model_name={model_dir}",
        f"policy.train_micro_batch_size={args.micro_batch}",
        f"policy.max_total_sequence_length={args.length}",
    )
    batch = random_batch(args.rows, args.length, args.length // 4, CPU_PRESET["vocab_size"], 0)
    result: dict[str, Any] = {
        "mode": "cpu",
        "rows": args.rows,
        "loss_tokens_per_step": count_loss_tokens(batch),
        "steps": args.steps,
        "load_average_1m": os.getloadavg()[0],
    }

    def start(ranks: int) -> tuple[Any, list[Any], Any]:
        cfg = load_config(
            "examples/configs/grpo_tiny_cpu.yaml",
            (*overrides, f"policy.dtensor_cfg.data_parallel_size={ranks}"),
        )
        if ranks == 1:
            handle = create_policy_worker_actor(cfg.policy, cfg.loss_fn, model_path=model_dir)
            ray.get(handle.get_state.remote())
            return as_trainer(handle), [handle], None
        placement = plan_placement(cfg, cluster_cpus=4, cluster_gpus=0)
        trainer, _, group = launch_trainer_group(cfg, placement, str(model_dir), uses_gpu=False)
        return trainer, trainer.ranks, group

    def stop(handles: list[Any], group: Any) -> None:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        if group is not None:
            ray.util.remove_placement_group(group)

    async def export(trainer: Any, handles: list[Any]) -> Any:
        if len(handles) == 1:
            return await handles[0].export_weights_flat.remote()
        weights, statuses = trainer.export_weights_flat_refs()
        await trainer.wait_exported(statuses)
        return await weights

    after: dict[int, dict[str, torch.Tensor]] = {}
    for ranks in (1, 2):
        trainer, handles, group = start(ranks)
        try:
            after[ranks] = flat_params(
                asyncio.run(_first_step_then_export(trainer, handles, batch, export))
            )
            result[f"dp{ranks}_tokens_per_s"] = round(
                asyncio.run(timed_steps(trainer, batch, args.steps)), 1
            )
        finally:
            stop(handles, group)
    result["dp2_over_dp1_tokens_per_s"] = round(
        result["dp2_tokens_per_s"] / result["dp1_tokens_per_s"], 3
    )
    result["dp2_max_param_diff"] = max(
        float((after[2][name] - value).abs().max()) for name, value in after[1].items()
    )
    result["load_average_1m_end"] = os.getloadavg()[0]
    ray.shutdown()
    return result


async def _first_step_then_export(trainer: Any, handles: list[Any], batch: Any, export: Any) -> Any:
    await one_step(trainer, batch)
    return await export(trainer, handles)


# ---------------------------------------------------------------------------- GPU


GPU_VARIANTS = {
    # name: (sharded, overrides)
    "single": (False, ()),
    "fsdp1": (True, ()),
    "single_eager": (False, ("policy.compile_layers=false",)),
    "fsdp1_eager": (True, ("policy.compile_layers=false",)),
    # fsdp1 keeps the gathered weights from the forward to the backward at one rank (the
    # default); this one frees them after the forward and gathers them again.
    "fsdp1_reshard": (True, ("policy.dtensor_cfg.reshard_after_forward=true",)),
}


def matmul_ceiling_tflops(size: int = 8192) -> float:
    """The bf16 matrix-product rate this GPU reaches now (the MFU's denominator)."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = []
    for repeat in range(13):
        torch.cuda.synchronize()
        started = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        if repeat >= 3:
            times.append(time.perf_counter() - started)
    del a, b
    torch.cuda.empty_cache()
    return 2 * size**3 / statistics.median(times) / 1e12


def gpu_mode(args: argparse.Namespace) -> dict[str, Any]:
    """FSDP2 at size 1 against the single-process trainer, on one GPU (see the docstring)."""
    from gpu_common import QWEN2_SIZES, LongTail, build_model_folder, make_train_batch

    from tandemrl.training.policy_worker import PolicyWorker
    from tandemrl.training.rank_group import (
        join_rank_group,
        leave_rank_group,
        open_rank_rendezvous,
    )
    from tandemrl.training.sharded_workers import ShardedPolicyWorker

    if not torch.cuda.is_available():
        raise SystemExit("--mode gpu needs a CUDA device")
    model_dir = build_model_folder(args.size, Path(args.model_dir), device="cuda")
    tail = LongTail(median=args.length_median, sigma=0.6, minimum=64, cap=args.length)
    lengths = [tail.length(f"t{i}") for i in range(args.rows)]
    vocab = int(QWEN2_SIZES[args.size]["vocab_size"])
    batch = make_train_batch(lengths, vocab, seed=1, prompt_tokens=16)
    tokens = sum(lengths)
    ceiling = matmul_ceiling_tflops()
    store, address = open_rank_rendezvous(1, 120.0, "nccl")
    join_rank_group(address, 0, store=store, device=torch.device("cuda", 0))
    results: dict[str, Any] = {}
    try:
        for name in args.variants:
            sharded, overrides = GPU_VARIANTS[name]
            cfg = load_config(
                "examples/configs/grpo_gpu_1x.yaml",
                (
                    f"policy.model_name={model_dir}",
                    "policy.device=cuda",
                    f"policy.train_micro_batch_size={args.micro_batch}",
                    f"policy.max_total_sequence_length={args.length}",
                    *overrides,
                ),
            )
            worker_class = ShardedPolicyWorker if sharded else PolicyWorker
            worker = worker_class(cfg.policy, cfg.loss_fn, seed=0)
            params = sum(p.numel() for p in worker.model.parameters())
            config = worker.model.config
            flops = 6 * params * tokens + 6 * config.num_hidden_layers * config.hidden_size * sum(
                n * n for n in lengths
            )
            pauses: list[tuple[float, int]] = []
            times = gpu_step_times(
                worker, batch, args.repeats, gc_pauses=pauses, gc_freeze=args.gc_freeze
            )
            if args.loop_per_step:
                per_step = gpu_step_times(worker, batch, args.repeats, loop_per_step=True)
                results.setdefault("loop_per_step", {})[name] = round(
                    statistics.median(per_step), 4
                )
            seconds = statistics.median(times)
            results[name] = {
                "step_s": round(seconds, 4),
                "tokens_per_s": round(tokens / seconds, 1),
                "mfu": round(flops / seconds / (ceiling * 1e12), 4),
                "mfu_datasheet": round(flops / seconds / (args.peak_tflops * 1e12), 4),
                "step_times_s": [round(t, 4) for t in times],
                "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
                "gc_ms_per_step": [round(seconds * 1e3, 2) for seconds, _ in pauses],
                "gc_full_collections": sum(full for _, full in pauses),
            }
            if args.profile_dir:
                profile_step(
                    worker, batch, Path(args.profile_dir) / f"{name}.txt", trace=args.trace
                )
                if args.cprofile:
                    cprofile_step(worker, batch, Path(args.profile_dir) / f"{name}.cprofile.txt")
            print(f"{name}: {results[name]}", flush=True)
            del worker
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    finally:
        leave_rank_group()
    result: dict[str, Any] = {
        "mode": "gpu",
        "device": torch.cuda.get_device_name(),
        "size": args.size,
        "rows": args.rows,
        "tokens_per_step": tokens,
        "repeats": args.repeats,
        "matmul_ceiling_tflops": round(ceiling, 1),
        "variants": results,
    }
    if "single" in results and "fsdp1" in results:
        single, fsdp = results["single"], results["fsdp1"]
        result |= {
            "single_step_s": single["step_s"],
            "fsdp1_step_s": fsdp["step_s"],
            "fsdp1_over_single_step_time": round(fsdp["step_s"] / single["step_s"], 3),
            "single_tokens_per_s": single["tokens_per_s"],
            "fsdp1_tokens_per_s": fsdp["tokens_per_s"],
            "mfu": fsdp["mfu"],
            "mfu_single": single["mfu"],
        }
    return result


async def gpu_step(worker: Any, batch: dict[str, torch.Tensor]) -> None:
    """One RL step as grpo_gpu_1x.yaml runs it: the training forward supplies the logprobs
    (``loss_fn.reuse_training_logprobs``), so there is no separate logprob pass."""
    await worker.begin_train_step()
    await worker.train_microbatches(
        batch,
        step_num_sequences=batch["input_ids"].shape[0],
        step_num_tokens=count_loss_tokens(batch),
    )
    await worker.finish_train_step()


class GcPauses:
    """Time the interpreter's garbage collector spent inside a span (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0  # collections of the oldest generation
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.full += info["generation"] == 2

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def gpu_step_times(
    worker: Any,
    batch: dict[str, torch.Tensor],
    repeats: int,
    *,
    loop_per_step: bool = False,
    gc_pauses: list[tuple[float, int]] | None = None,
    gc_freeze: bool = False,
) -> list[float]:
    """Step times after two warm-up steps. All steps run in one event loop, as in the
    trainer's Ray actor, so the worker's calls reuse the loop's executor threads;
    ``loop_per_step`` gives each step a loop (and so fresh executor threads) of its own.
    ``gc_pauses`` receives each timed step's collector time and full collections;
    ``gc_freeze`` moves every object alive after the warm-up out of the collector's reach."""

    async def timed_step() -> float:
        torch.cuda.synchronize()
        with GcPauses() as pauses:
            started = time.perf_counter()
            await gpu_step(worker, batch)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
        if gc_pauses is not None:
            gc_pauses.append((pauses.seconds, pauses.full))
        return seconds

    async def all_steps() -> list[float]:
        for _ in range(2):
            await gpu_step(worker, batch)
        if gc_freeze:
            gc.collect()
            gc.freeze()
        times = [await timed_step() for _ in range(repeats)]
        if gc_freeze:
            gc.unfreeze()
        return times

    if loop_per_step:
        return [asyncio.run(timed_step()) for _ in range(repeats + 2)][2:]
    return asyncio.run(all_steps())


def device_gaps(events: Any, threshold_us: float = 20.0, listed: int = 15) -> str:
    """Where the device waits: the union of the kernels' intervals against their span, and
    the longest idle gaps between kernels with the kernels on either side."""
    kernels = sorted(
        (event.time_range.start, event.time_range.end, event.name)
        for event in events
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kernels:
        return "no device kernels recorded"
    busy, gaps, reach, before = 0.0, [], kernels[0][0], kernels[0][2]
    for start, end, name in kernels:
        if start > reach:
            gaps.append((start - reach, before[:60], name[:60]))
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, before = end, name
    span = reach - kernels[0][0]
    long_gaps = [gap for gap in gaps if gap[0] >= threshold_us]
    lines = [
        f"device busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span; "
        f"{len(gaps)} gaps, {sum(g[0] for g in gaps) / 1e3:.2f} ms in all; "
        f"{len(long_gaps)} of >= {threshold_us:.0f} us, {sum(g[0] for g in long_gaps) / 1e3:.2f} ms"
    ]
    for length, after, next_name in sorted(long_gaps, reverse=True)[:listed]:
        lines.append(f"  gap {length:8.1f} us after {after!r} before {next_name!r}")
    return "\n".join(lines)


def cprofile_step(worker: Any, batch: dict[str, torch.Tensor], path: Path) -> None:
    """Host time of one step by Python function: ``fsdp_step_profile.profile_step`` (cProfile
    over the worker's synchronous API on this thread), on a worker the timed steps warmed."""
    from fsdp_step_profile import profile_step as cprofile_table

    path.write_text(cprofile_table(worker, batch))


def profile_step(
    worker: Any, batch: dict[str, torch.Tensor], path: Path, *, trace: bool = False
) -> None:
    """torch.profiler tables of one step (device and host time) and Dynamo's counters. The
    step runs in the same event loop as two warm-up steps before it, as the timed steps do
    (a loop of its own would give it fresh executor threads; see ``gpu_step_times``). The
    table's first line adds the step's wall time and the device time of its kernels."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    async def warm_then_profiled() -> tuple[Any, float]:
        for _ in range(2):
            await gpu_step(worker, batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            await gpu_step(worker, batch)
            torch.cuda.synchronize()
            wall = time.perf_counter() - started
        return prof, wall

    path.parent.mkdir(parents=True, exist_ok=True)
    prof, wall = asyncio.run(warm_then_profiled())
    if trace:
        traced = path.with_suffix(".trace.json")
        prof.export_chrome_trace(str(traced))
        with traced.open("rb") as raw, gzip.open(f"{traced}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        traced.unlink()
    averages = prof.key_averages()
    kernel_us = sum(  # the kernels' own rows (the host ops' rows repeat their time)
        event.self_device_time_total
        for event in averages
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    with path.open("w") as out:
        out.write(
            f"step wall {wall * 1e3:.2f} ms; device time of all kernels {kernel_us / 1e3:.2f} ms\n"
        )
        out.write(device_gaps(prof.events()) + "\n")
        out.write(averages.table(sort_by="self_cuda_time_total", row_limit=160))
        out.write("\n")
        out.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
        out.write("\n")
        out.write(json.dumps({key: dict(value) for key, value in counters.items()}, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--steps", type=int, default=4, help="cpu: timed steps per size")
    parser.add_argument("--repeats", type=int, default=5, help="gpu: timed steps per trainer")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--length", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--size", default="0.5b", help="gpu: a gpu_common.QWEN2_SIZES key")
    parser.add_argument("--model-dir", default="/tmp/trainer_scaling_model")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
    parser.add_argument("--length-median", type=float, default=512.0, help="gpu: rows' lengths")
    parser.add_argument(
        "--variants", nargs="+", default=["single", "fsdp1"], choices=sorted(GPU_VARIANTS)
    )
    parser.add_argument("--profile-dir", default=None, help="gpu: torch.profiler tables here")
    parser.add_argument("--trace", action="store_true", help="gpu: and a gzipped Chrome trace")
    parser.add_argument(
        "--cprofile", action="store_true", help="gpu: and the host time by Python function"
    )
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gpu: gc.freeze() after the warm-up steps (the collector skips what was built)",
    )
    parser.add_argument(
        "--loop-per-step",
        action="store_true",
        help="gpu: also time each step in an event loop of its own (fresh executor threads)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode == "cpu":
        args.rows, args.length = args.rows or 32, args.length or 64
        args.micro_batch = args.micro_batch or 8
        result = cpu_mode(args)
    else:
        args.rows, args.length = args.rows or 64, args.length or 1024
        args.micro_batch = args.micro_batch or args.rows  # packed: the whole step at once
        result = gpu_mode(args)
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
