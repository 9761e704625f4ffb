"""Where a one-rank FSDP2 step's time goes against the single-process trainer (one GPU).

Runs the policy trainer's step phases on the calling thread (no executor), each followed by a
device synchronisation, for ``PolicyWorker`` and ``ShardedPolicyWorker`` at one NCCL rank on
the MFU workload of ``trainer_scaling.py --mode gpu``; then the finish phase split into its
parts (the cross-rank counts, clipping, the optimizer step) and a cProfile of one sharded
step (the 40 most expensive functions by own time). Diagnostic only: prints a
``RESULT {json}`` line with each phase's median milliseconds.

    python benchmarks/fsdp_step_profile.py [--repeats 5] [--compile true|false]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tandemrl.config.loader import load_config
from tandemrl.training.batch import count_loss_tokens


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def phase_times(worker: Any, batch: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    rows, tokens = batch["input_ids"].shape[0], count_loss_tokens(batch)
    marks: dict[str, list[float]] = {"begin": [], "train": [], "finish": []}
    for repeat in range(repeats + 2):
        begin = timed(worker._begin_train_step)
        train = timed(lambda: worker._train_microbatches(batch, rows, tokens))
        finish = timed(worker._finish_train_step)
        if repeat >= 2:
            for name, value in zip(marks, (begin, train, finish), strict=True):
                marks[name].append(value)
    return {name: round(statistics.median(values), 2) for name, values in marks.items()}


def finish_parts(worker: Any, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    rows, tokens = batch["input_ids"].shape[0], count_loss_tokens(batch)
    worker._begin_train_step()
    worker._train_microbatches(batch, rows, tokens)
    torch.cuda.synchronize()
    parts = {
        "sum_int_x2": timed(lambda: [worker.replicas.sum_int(1) for _ in range(2)]),
        "clip": timed(worker._clip_gradients),
        "optimizer_step": timed(worker.optimizer.step),
        "scheduler_step": timed(worker.scheduler.step),
        "zero_grad": timed(lambda: worker.optimizer.zero_grad(set_to_none=True)),
    }
    worker._step.end()
    return {name: round(value, 2) for name, value in parts.items()}


def profile_step(worker: Any, batch: dict[str, torch.Tensor]) -> str:
    rows, tokens = batch["input_ids"].shape[0], count_loss_tokens(batch)
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    worker._begin_train_step()
    worker._train_microbatches(batch, rows, tokens)
    worker._finish_train_step()
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def main() -> None:
    from gpu_common import QWEN2_SIZES, LongTail, build_model_folder, make_train_batch

    from tandemrl.training.policy_worker import PolicyWorker
    from tandemrl.training.rank_group import (
        join_rank_group,
        leave_rank_group,
        open_rank_rendezvous,
    )
    from tandemrl.training.sharded_workers import ShardedPolicyWorker

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--compile", default="true")
    parser.add_argument("--model-dir", default="/tmp/trainer_scaling_model")
    parser.add_argument("--profile-out", default=None)
    args = parser.parse_args()
    model_dir = build_model_folder(args.size, Path(args.model_dir), device="cuda")
    tail = LongTail(median=512.0, sigma=0.6, minimum=64, cap=1024)
    lengths = [tail.length(f"t{i}") for i in range(args.rows)]
    vocab = int(QWEN2_SIZES[args.size]["vocab_size"])
    batch = make_train_batch(lengths, vocab, seed=1, prompt_tokens=16)
    cfg = load_config(
        "examples/configs/grpo_gpu_1x.yaml",
        (
            f"policy.model_name={model_dir}",
            "policy.device=cuda",
            f"policy.train_micro_batch_size={args.rows}",
            "policy.max_total_sequence_length=1024",
            f"policy.compile_layers={args.compile}",
        ),
    )
    store, address = open_rank_rendezvous(1, 120.0, "nccl")
    join_rank_group(address, 0, store=store, device=torch.device("cuda", 0))
    result: dict[str, Any] = {"rows": args.rows, "tokens": sum(lengths), "compile": args.compile}
    try:
        for name, worker_class in (("single", PolicyWorker), ("fsdp1", ShardedPolicyWorker)):
            worker = worker_class(cfg.policy, cfg.loss_fn, seed=0)
            result[name] = {
                "phases_ms": phase_times(worker, batch, args.repeats),
                "finish_parts_ms": finish_parts(worker, batch),
            }
            print(name, result[name], flush=True)
            if name == "fsdp1":
                text = profile_step(worker, batch)
                if args.profile_out:
                    Path(args.profile_out).write_text(text)
                print(text[:12000], flush=True)
            del worker
            torch.cuda.empty_cache()
    finally:
        leave_rank_group()
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
