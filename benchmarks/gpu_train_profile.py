"""Training MFU of a full PolicyWorker step on one GPU, variant by variant, with checks.

One 0.5B-shaped random Qwen2 (``gpu_common``), one GRPO step of 64 sequences whose lengths
follow a clipped lognormal (median 512, sigma 0.6, [64, 1024]; 60-token prompts), bf16 autocast
over float32 master weights, fused AdamW. Each variant is the same worker with one setting
changed; a variant is timed as the median of ``--repeats`` whole steps (begin ->
train_microbatches -> finish, synchronised) after one warm-up step.

Variants: ``logits`` (the full-logits head: float32 [tokens, vocab] logprobs), ``head``
(``logprob_head``: chunked bf16 head at the loss positions only, fused passes compiled),
``head_eager`` (the same without torch.compile), micro-batch sizes, activation checkpointing,
``compiled_layers`` (torch.compile of every decoder layer), and ``packed_*`` (padding-free
micro-batches: ``policy.sequence_packing``, rows packed into one sequence with varlen
attention, micro-batches cut by real tokens); every other variant runs padded micro-batches.

Checks before timing (fresh random data): head vs full-logits logprobs and parameter
gradients on one micro-batch, relative error ||a - b|| / ||b||; packed vs padded micro-batch
(both through the head): the same errors.

FLOPs: ``conventional`` = 6 · N · tokens + 6 · layers · hidden · Σ len² (N counts the tied
embedding once, as the lm_head product); ``performed`` counts the head product
(2 · vocab · hidden per token, forward) only at the positions the head computes (the loss
positions), i.e. 6 · (N - vocab · hidden) · tokens + 6 · vocab · hidden · loss tokens +
attention. MFU = FLOPs / step time / measured bf16 matrix rate (8192³ product, random data).

    python benchmarks/gpu_train_profile.py --out runs/gpu_profile
    python benchmarks/gpu_train_profile.py --size tiny --sequences 8 --out /tmp/p   # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import LongTail, build_model_folder, make_train_batch

from tandemrl.config.loader import load_config
from tandemrl.training import logprob_head, policy_worker
from tandemrl.training.batch import count_loss_tokens, split_microbatches, trim_padding
from tandemrl.training.policy_worker import (
    PolicyWorker,
    sort_rows_by_length,
    split_by_rows_and_tokens,
)

PROMPT_TOKENS = 60
STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {message}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_ceiling(size: int = 8192) -> float:
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = []
    for repeat in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if repeat >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times) / 1e12


def flops(model: torch.nn.Module, lengths: list[int], loss_tokens: int) -> dict[str, float]:
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    head = config.vocab_size * config.hidden_size
    attention = 6 * config.num_hidden_layers * config.hidden_size * sum(n * n for n in lengths)
    tokens = sum(lengths)
    return {
        "conventional": 6 * params * tokens + attention,
        "performed": 6 * (params - head) * tokens + 6 * head * loss_tokens + attention,
        "params": params,
    }


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def check_head(worker: PolicyWorker, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Head vs full-logits path on the first micro-batch: logprobs and gradients."""
    micro = trim_padding(split_microbatches(sort_rows_by_length(batch)[0], 4)[0])
    mask = micro["token_mask"].to(worker.device)
    results: dict[str, Any] = {}
    for use_head in (True, False):
        worker.use_head_logprobs = use_head
        worker.optimizer.zero_grad(set_to_none=True)
        prepared = worker._prepare(micro, micro["token_mask"] > 0)
        logprobs, entropy = worker._forward(prepared, entropy="metric")
        (logprobs * mask).sum().backward()
        grads = {
            name: p.grad.detach().float().clone()
            for name, p in worker.model.named_parameters()
            if p.grad is not None and ("embed" in name or "layers.0." in name)
        }
        results[use_head] = ((logprobs * mask).detach(), (entropy * mask).detach(), grads)
    worker.optimizer.zero_grad(set_to_none=True)
    worker.use_head_logprobs = True
    head, plain = results[True], results[False]
    grad_errors = {name: relative_error(head[2][name], plain[2][name]) for name in plain[2]}
    return {
        "logprobs_rel_err": relative_error(head[0], plain[0]),
        "entropy_rel_err": relative_error(head[1], plain[1]),
        "grad_rel_err_max": max(grad_errors.values()),
        "grad_rel_err_embed": grad_errors.get("model.embed_tokens.weight", float("nan")),
        "finite": bool(torch.isfinite(head[0]).all()),
    }


def check_packing(worker: PolicyWorker, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Packed vs padded forward/backward of one micro-batch (bf16): logprobs and gradients."""
    micro = trim_padding(sort_rows_by_length(batch)[0])
    mask = micro["token_mask"].to(worker.device)
    results: dict[bool, Any] = {}
    for packed in (True, False):
        worker.optimizer.zero_grad(set_to_none=True)
        prepared = worker._prepare(micro, micro["token_mask"] > 0, packed)
        logprobs, _ = worker._forward(prepared, entropy="none")
        (logprobs * mask).sum().backward()
        grads = {
            name: p.grad.detach().float().clone()
            for name, p in worker.model.named_parameters()
            if p.grad is not None
        }
        results[packed] = ((logprobs * mask).detach(), grads)
    worker.optimizer.zero_grad(set_to_none=True)
    packed, padded = results[True], results[False]
    grad_errors = {name: relative_error(packed[1][name], padded[1][name]) for name in padded[1]}
    return {
        "logprobs_rel_err": relative_error(packed[0], padded[0]),
        "logprobs_max_abs": float((packed[0] - padded[0]).abs().max()),
        "grad_rel_err_max": max(grad_errors.values()),
        "grad_rel_err_median": statistics.median(grad_errors.values()),
        "finite": bool(torch.isfinite(packed[0]).all()),
    }


def time_steps(worker: PolicyWorker, batch: dict[str, torch.Tensor], repeats: int) -> dict:
    async def step() -> dict[str, float]:
        await worker.begin_train_step()
        await worker.train_microbatches(batch, step_num_sequences=batch["input_ids"].shape[0])
        return await worker.finish_train_step()

    started = time.perf_counter()
    metrics = asyncio.run(step())  # warm-up: compiles, allocates optimizer state
    sync()
    warmup_s = time.perf_counter() - started
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    marks: dict[str, list[float]] = {}
    with phase_marks(marks):
        for _ in range(repeats):
            started = time.perf_counter()
            marks.setdefault("step_start", []).append(started)
            asyncio.run(step())
            sync()
            times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    phases = {
        # host: sorting, cutting and moving the micro-batches; queueing every forward and
        # backward (the loop never waits); waiting for the device to drain the queue.
        "prepare_s": statistics.median(
            e - b for b, e in zip(marks["step_start"], marks["prepared"], strict=True)
        ),
        "enqueue_s": statistics.median(
            e - b for b, e in zip(marks["prepared"], marks["metrics_start"], strict=True)
        ),
        "drain_s": statistics.median(
            e - b for b, e in zip(marks["metrics_start"], marks["metrics_end"], strict=True)
        ),
    }
    return {
        "step_s": statistics.median(times),
        "step_s_all": [round(t, 4) for t in times],
        **phases,
        "warmup_s": warmup_s,
        "peak_gib": peak,
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
    }


@contextlib.contextmanager
def phase_marks(marks: dict[str, list[float]]):
    """Record host times inside train_microbatches: after the last micro-batch is prepared
    (the first forward starts), and around the one metrics read-back."""
    original_metrics = policy_worker.metrics_to_floats
    original_prepare = PolicyWorker._prepare

    def metrics(rows):
        marks.setdefault("metrics_start", []).append(time.perf_counter())
        try:
            return original_metrics(rows)
        finally:
            marks.setdefault("metrics_end", []).append(time.perf_counter())

    def prepare(self, micro, needed, *args):
        result = original_prepare(self, micro, needed, *args)
        # The last call of a step wins: overwrite this step's entry.
        times = marks.setdefault("prepared", [])
        if len(times) == len(marks["step_start"]):
            times[-1] = time.perf_counter()
        else:
            times.append(time.perf_counter())
        return result

    policy_worker.metrics_to_floats = metrics
    PolicyWorker._prepare = prepare
    try:
        yield
    finally:
        policy_worker.metrics_to_floats = original_metrics
        PolicyWorker._prepare = original_prepare


def padded_tokens(
    batch: dict[str, torch.Tensor], micro: int, tokens: int | None, packed: bool = False
) -> int:
    ordered, _ = sort_rows_by_length(batch)
    if packed:
        return int(ordered["attention_mask"].sum())
    return sum(
        part["input_ids"].shape[0] * int(part["attention_mask"].sum(1).max())
        for part in split_by_rows_and_tokens(ordered, micro, tokens)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "gpu_models")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_profile"))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--median", type=float, default=512)
    parser.add_argument("--cap", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=200.0, help="skip variants after this")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[
            "head",
            "head_mb32",
            "head_tok32k",
            "logits",
            "compiled_layers",
            "compiled_mb32",
            "compiled_tok32k",
            "compiled_tok48k",
            "compiled_mb64",
            "packed_tok32k",
            "compiled_packed_tok16k",
            "compiled_packed_tok32k",
            "compiled_packed_all",
        ],
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    ceiling = matmul_ceiling() if cuda else float("nan")
    log(f"bf16 matmul ceiling {ceiling:.1f} TFLOP/s")
    folder = build_model_folder(args.size, args.models / f"qwen2-{args.size}", device=device)
    log("model folder ready")
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"policy.model_name={folder}",
            f"policy.device={device}",
            "policy.train_micro_batch_size=16",
            f"policy.max_total_sequence_length={args.cap}",
            "policy.optimizer.lr=1.0e-6",
            "loss_fn.entropy_coef=0.0",
            # CPU smoke runs pack through the reference attention.
            f"policy.sequence_packing={'auto' if cuda else 'on'}",
        ),
    )
    worker = PolicyWorker(cfg.policy, cfg.loss_fn, model_path=folder)
    log(f"worker ready; head path supported: {worker.use_head_logprobs}")
    tail = LongTail(median=args.median, sigma=0.6, minimum=64, cap=args.cap)
    lengths = [tail.length(f"t{i}") for i in range(args.sequences)]
    vocab = worker.model.config.vocab_size
    batch = make_train_batch(lengths, vocab, seed=1, prompt_tokens=PROMPT_TOKENS)
    loss_tokens = count_loss_tokens(batch)
    work = flops(worker.model, lengths, loss_tokens)
    summary: dict[str, Any] = {
        "ceiling_tflops": ceiling,
        "tokens": sum(lengths),
        "loss_tokens": loss_tokens,
        "sequences": len(lengths),
        **{f"flops_{k}": v for k, v in work.items()},
    }
    checks = {"check": check_head}
    if worker.sequence_packing:
        checks["check_packing"] = check_packing
    for key, check in checks.items():
        try:
            summary[key] = check(
                worker, make_train_batch(lengths[:8], vocab, seed=7, prompt_tokens=PROMPT_TOKENS)
            )
        except Exception as exc:  # reported in the summary; the timings still run
            summary[key] = {"error": repr(exc)}
            traceback.print_exc()
        log(f"{key.replace('_', ' ')}: {summary[key]}")
    packing_available = worker.sequence_packing

    settings = {
        "head": {},
        "logits": {"use_head_logprobs": False},
        "head_eager": {"compile_head": False},
        "head_mb8": {"micro": 8},
        "head_mb32": {"micro": 32},
        "head_tok32k": {"micro": 64, "tokens": 32768},
        "head_ckpt": {"checkpointing": True},
        # From here on the worker is rebuilt with policy.compile_layers: true (once).
        "compiled_layers": {"compile_layers": True},
        "compiled_mb32": {"compile_layers": True, "micro": 32},
        "compiled_tok32k": {"compile_layers": True, "micro": 64, "tokens": 32768},
        "compiled_tok48k": {"compile_layers": True, "micro": 64, "tokens": 49152},
        "compiled_mb64": {"compile_layers": True, "micro": 64},
        # Packed micro-batches (policy.sequence_packing); "tokens" then counts real tokens.
        "packed_tok16k": {"packing": True, "micro": 64, "tokens": 16384},
        "packed_tok32k": {"packing": True, "micro": 64, "tokens": 32768},
        "packed_all": {"packing": True, "micro": 64},
        "compiled_packed_tok8k": {
            "compile_layers": True,
            "packing": True,
            "micro": 64,
            "tokens": 8192,
        },
        "compiled_packed_tok16k": {
            "compile_layers": True,
            "packing": True,
            "micro": 64,
            "tokens": 16384,
        },
        "compiled_packed_tok32k": {
            "compile_layers": True,
            "packing": True,
            "micro": 64,
            "tokens": 32768,
        },
        "compiled_packed_all": {"compile_layers": True, "packing": True, "micro": 64},
        # The same with the head passes compiled for any vocabulary size (all dims symbolic).
        "compiled_packed_all_dynamic_head": {
            "compile_layers": True,
            "packing": True,
            "micro": 64,
            "static_vocab": False,
        },
    }
    rows = []
    for name in args.variants:
        change = settings[name]
        # torch.compile of 24 layers (forward and backward) takes a while: start it early.
        compiling = change.get("compile_layers") and not worker.cfg.compile_layers
        reserve = 60.0 if compiling else 0.0
        if time.perf_counter() - STARTED > args.budget_s - reserve:
            log(f"{name}: skipped (past --budget-s)")
            rows.append({"variant": name, "skipped": True})
            continue
        if compiling:
            del worker
            torch.cuda.empty_cache() if cuda else None
            compiled_cfg = cfg.policy.model_copy(update={"compile_layers": True})
            worker = PolicyWorker(compiled_cfg, cfg.loss_fn, model_path=folder)
        micro = change.get("micro", 16)
        tokens = change.get("tokens")
        worker.cfg.train_micro_batch_size = micro
        worker.cfg.train_micro_batch_tokens = tokens
        worker.use_head_logprobs = change.get("use_head_logprobs", True)
        packing = change.get("packing", False)
        if packing and not packing_available:
            rows.append({"variant": name, "error": "sequence packing unavailable here"})
            continue
        worker.sequence_packing = packing
        logprob_head.COMPILE_ON_CUDA = change.get("compile_head", True)
        static_vocab = change.get("static_vocab", True)
        if static_vocab != logprob_head.STATIC_VOCAB:
            logprob_head.STATIC_VOCAB = static_vocab
            logprob_head._KERNELS.clear()  # recompiled on the next call
        if change.get("checkpointing"):
            worker.model.gradient_checkpointing_enable()
        row: dict[str, Any] = {
            "variant": name,
            "micro": micro,
            "tokens_budget": tokens,
            "packed": packing,
            "padded": padded_tokens(batch, micro, tokens, packing),
        }
        try:
            row.update(time_steps(worker, batch, args.repeats))
            for key in ("conventional", "performed"):
                row[f"mfu_{key}"] = work[key] / row["step_s"] / (ceiling * 1e12)
            row["tokens_per_s"] = sum(lengths) / row["step_s"]
        except Exception as exc:
            row["error"] = repr(exc)[:500]
            traceback.print_exc()
            # Close the failed step so that the next variant can begin one.
            worker._step.active = False
            worker.optimizer.zero_grad(set_to_none=True)
        if change.get("checkpointing"):
            worker.model.gradient_checkpointing_disable()
        rows.append(row)
        log(f"{name}: {row}")
        summary["rows"] = rows
        (args.out / "train_profile.json").write_text(json.dumps(summary, indent=1) + "\n")
        if cuda:
            torch.cuda.empty_cache()
    summary["rows"] = rows

    timed = [r for r in rows if "step_s" in r]
    if cuda and timed and time.perf_counter() - STARTED < args.budget_s + 20:
        best = min(timed, key=lambda r: r["step_s"])
        worker.cfg.train_micro_batch_size = best["micro"]
        worker.cfg.train_micro_batch_tokens = best["tokens_budget"]
        worker.sequence_packing = best["packed"]
        worker.use_head_logprobs = True
        logprob_head.COMPILE_ON_CUDA = True
        if not logprob_head.STATIC_VOCAB:
            logprob_head.STATIC_VOCAB = True
            logprob_head._KERNELS.clear()

        async def step() -> None:
            await worker.begin_train_step()
            await worker.train_microbatches(batch, step_num_sequences=len(lengths))
            await worker.finish_train_step()

        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as profiler:
            asyncio.run(step())
            sync()
        table = profiler.key_averages().table(sort_by="self_device_time_total", row_limit=30)
        (args.out / "profile.txt").write_text(table)
        summary["profiled_variant"] = best["variant"]

    (args.out / "train_profile.json").write_text(json.dumps(summary, indent=1) + "\n")
    header = ("variant", "micro", "budget", "padded", "step s", "prep", "enqueue", "drain")
    header += ("tok/s", "MFU conv", "MFU perf", "peak GiB")
    print("\n" + " ".join(f"{h:>9s}" for h in header))
    for r in rows:
        if "step_s" not in r:
            print(f"{r['variant']:>9s} {r.get('error', 'skipped')}")
            continue
        cells = (
            r["variant"],
            str(r["micro"]),
            str(r["tokens_budget"]),
            str(r["padded"]),
            f"{r['step_s']:.3f}",
            f"{r['prepare_s']:.3f}",
            f"{r['enqueue_s']:.3f}",
            f"{r['drain_s']:.3f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['mfu_conventional']:.1%}",
            f"{r['mfu_performed']:.1%}",
            f"{r['peak_gib']:.1f}",
        )
        print(" ".join(f"{c:>9s}" for c in cells))
    print(f"RESULT {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    main()
