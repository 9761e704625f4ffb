"""``tandemrl train`` itself on one GPU against the in-process benchmark, on one workload.

The workload is ``gpu_grpo.py``'s: a random-init Qwen2 of ``--size`` (its full vocabulary),
``--prompts-per-step`` x ``--group-size`` completions a step whose lengths follow the clipped
lognormal long tail (``gpu_common.LongTail``), prompts of 64 tokens (a 60-token prefix and a
counting prompt), the tuned trainer settings (compiled layers, packed rows, no separate
logprob forward). For each mode (``--modes``: sync, in_order 1, ready_first by default):

- **CLI**: a fresh process runs ``tandemrl.cli.main(["train", ...])`` (the real command: Ray
  actors for the engine, the trainer and the controller, the weight sync ``auto`` picks, the
  config one GPU takes with ``colocated.stand_down: false`` under a private MPS daemon). The
  only addition is a Ray worker setup hook (``cli_gpu_hook.py``) that gives the engine the
  same long-tail lengths. Figures come from the run's ``metrics.jsonl``.
- **in-process**: ``gpu_grpo.run_grpo`` with placement ``two_processes`` (the engine in a
  process of its own beside the trainer, CUDA IPC sync, stand-down off): the same config
  without Ray.

Both measure the steps after ``--warmup-steps``. Prints a table, then one ``RESULT {json}``
line with each mode's median step time and trained tokens/s on both paths,
``cli_ready_first_over_sync`` and ``cli_in_order_over_sync`` (CLI steps/s ratios, from median
step times), and ``cli_over_inprocess_max`` (the largest CLI / in-process median step-time
ratio over the modes). Goals (issue 29): async / sync >= 1.5 and CLI within 1.15x.

    python benchmarks/cli_gpu.py --out runs/cli_gpu
    python benchmarks/cli_gpu.py --size tiny --steps 3 --warmup-steps 2   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

PREFIX = "0123456789" * 6  # 60 tokens of the character tokenizer, like gpu_grpo's prefix
GOALS = {"cli_async_over_sync": 1.5, "cli_over_inprocess_max": 1.15}
DEFAULT_MODES = ["sync", "async_in_order_1", "streaming_ready_first"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_wide_tokenizer(folder: Path, vocab_size: int) -> None:
    """The tiny models' character tokenizer, widened to the model's vocabulary: the characters
    keep their ids, every other id decodes to a placeholder, so any sampled id has text."""
    from tandemrl.models.tokenizer import build_char_tokenizer

    build_char_tokenizer(vocab_size=vocab_size).save_pretrained(folder)


def write_dataset(path: Path, num_prompts: int, seed: int = 0) -> None:
    from tandemrl.data.dataset import generate_counting_records

    with path.open("w") as handle:
        for record in generate_counting_records(num_prompts, seed):
            handle.write(json.dumps({"prompt": PREFIX + record.prompt, "answer": record.answer}))
            handle.write("\n")


def cli_overrides(folder: Path, dataset: Path, mode: str, args: Any, log_dir: Path) -> list[str]:
    """The overrides ``gpu_grpo.run_grpo`` applies for ``mode`` (placement two_processes),
    as ``tandemrl train`` takes them, plus the dataset and where the run writes."""
    import gpu_grpo
    import torch

    base = [
        f"policy.model_name={folder}",
        f"policy.device={'cuda' if torch.cuda.is_available() else 'cpu'}",
        f"policy.train_global_batch_size={args.prompts_per_step * args.group_size}",
        f"policy.train_micro_batch_size={gpu_grpo.micro_batch_rows(args)}",
        f"policy.max_total_sequence_length={gpu_grpo.max_total_sequence_length(args)}",
        f"policy.generation.max_new_tokens={args.length_cap}",
        f"policy.generation.max_batch_size={args.max_batch}",
        f"policy.generation.torch.max_seq_len={gpu_grpo.engine_max_seq_len(args)}",
        "policy.optimizer.lr=1.0e-6",
        f"grpo.num_prompts_per_step={args.prompts_per_step}",
        f"grpo.num_generations_per_prompt={args.group_size}",
        "loss_fn.entropy_coef=0.0",
        f"data.dataset={dataset}",
        "env.name=counting",
        f"logger.log_dir={log_dir}",
        "logger.progress=false",
        "logger.tensorboard=false",
        "logger.plot=false",
        "logger.save_final_model=false",
        "logger.sample_log_period=0",
    ]
    mode_overrides = gpu_grpo.mode_overrides(mode, "two_processes", args)
    return [*base, *gpu_grpo.TRAINER_OVERRIDES[args.trainer], *mode_overrides]


def run_cli(folder: Path, dataset: Path, mode: str, args: Any, work: Path) -> dict[str, Any]:
    """``tandemrl train`` in a fresh process; the measured steps' figures from metrics.jsonl."""
    log_dir = work / f"cli_{mode}"
    overrides = cli_overrides(folder, dataset, mode, args, log_dir)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "TANDEMRL_BENCH_LONG_TAIL": f"{args.length_median},{args.length_sigma},{args.length_cap}",
    }
    started = time.perf_counter()
    child = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.cli_timeout_s,
        check=False,
    )
    wall = time.perf_counter() - started
    (work / f"cli_{mode}.log").write_text(child.stdout + child.stderr)
    if child.returncode != 0:
        raise RuntimeError(
            f"tandemrl train ({mode}) exited {child.returncode}:\n{child.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [row for row in rows if row["step"] > args.warmup_steps]
    return summarize(mode, "cli", measured, wall_s=wall)


def summarize(mode: str, path: str, measured: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    step_times = [row["step_time_s"] for row in measured]
    # Completion tokens of the groups each step trained (tokens_per_s is per step time).
    trained = sum(row["tokens_per_s"] * row["step_time_s"] for row in measured)
    return {
        "mode": mode,
        "path": path,
        "steps": len(measured),
        "median_step_s": statistics.median(step_times),
        "mean_step_s": statistics.mean(step_times),
        # Completion tokens trained a second, over the measured steps (both paths alike).
        "trained_tokens_per_s": trained / sum(step_times),
        "weight_sync_s": statistics.mean(row["weight_sync_s"] for row in measured),
        "train_idle_frac": statistics.mean(row["train_idle_frac"] for row in measured),
        "staleness_mean": statistics.mean(row["staleness_mean"] for row in measured),
        **extra,
    }


def run_inprocess(folder: Path, mode: str, args: Any) -> dict[str, Any]:
    import gpu_grpo

    result = gpu_grpo.run_grpo(folder, mode, "two_processes", args, args.ceil_tflops)
    step_times = [step["wall_s"] for step in result["per_step"]]
    return {
        "mode": mode,
        "path": "inprocess",
        "steps": result["steps"],
        "median_step_s": statistics.median(step_times) if step_times else result["step_time_s"],
        "mean_step_s": result["step_time_s"],
        # gpu_grpo's completion tokens of the trained groups over the measured wall time.
        "trained_tokens_per_s": result["completion_tokens_per_s"],
        "trainer_tokens_per_s": result["trained_tokens_per_s"],
        "weight_sync_s": result["weight_sync_s"],
        "train_idle_frac": result["train_idle_frac"],
        "staleness_mean": result["staleness_mean"],
        "trainer_mfu_while_busy": result["trainer_mfu_while_busy"],
    }


def child_main(overrides: list[str]) -> int:
    """The CLI process: Ray with the long-tail hook (and MPS before it), then the command."""
    import ray
    import torch

    from tandemrl.cli import main as cli_main
    from tandemrl.config.loader import load_config
    from tandemrl.controller.mps import start_if_useful

    config = "examples/configs/grpo_tiny_cpu.yaml"
    cfg = load_config(config, overrides)
    daemon = start_if_useful(cfg, gpus_visible=torch.cuda.device_count())
    try:
        # What tandemrl train's own init would do, plus the worker setup hook.
        ray.init(
            num_cpus=os.cpu_count() or 1,
            num_gpus=torch.cuda.device_count(),
            include_dashboard=False,
            namespace="tandemrl",
            log_to_driver=True,
            runtime_env={"worker_process_setup_hook": "cli_gpu_hook.apply"},
        )
        return cli_main(["train", "--config", config, *overrides])
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if daemon is not None:
            daemon.stop()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    parser.add_argument("--paths", nargs="+", default=["cli", "inprocess"])
    parser.add_argument("--out", type=Path, default=Path("runs/cli_gpu"))
    parser.add_argument("--cli-timeout-s", type=float, default=420)
    known, rest = parser.parse_known_args()
    import gpu_grpo
    import torch
    from gpu_common import build_model_folder

    # The workload's settings are gpu_grpo's (--size, --steps, --warmup-steps, lengths, ...).
    args = gpu_grpo.build_parser().parse_args(["--out", str(known.out), *rest])
    if args.warmup_steps is None:
        args.warmup_steps = 3 if args.trainer == "tuned" else 1
    args.cli_timeout_s = known.cli_timeout_s
    known.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cli_gpu_", dir=known.out))
    build_device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = build_model_folder(args.size, args.models / f"qwen2-{args.size}", device=build_device)
    if not (folder / "tokenizer.json").is_file():
        from transformers import AutoConfig

        write_wide_tokenizer(folder, AutoConfig.from_pretrained(folder).vocab_size)
    dataset = work / "prompts.jsonl"
    write_dataset(dataset, num_prompts=4096)
    rows: list[dict[str, Any]] = []
    for mode in known.modes:
        for path in known.paths:
            log(f"{path} {mode} ...")
            try:
                row = (
                    run_cli(folder, dataset, mode, args, work)
                    if path == "cli"
                    else run_inprocess(folder, mode, args)
                )
            except Exception as exc:  # one failed row is reported, the others still run
                log(f"{path} {mode} FAILED: {exc}")
                row = {"mode": mode, "path": path, "error": str(exc)[-3000:]}
            rows.append(row)
            (known.out / "cli_gpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    result = compare(rows)
    for row in rows:
        if "error" in row:
            log(f"{row['path']:>9} {row['mode']:>22}  FAILED")
            continue
        log(
            f"{row['path']:>9} {row['mode']:>22}  median step {row['median_step_s']:.3f} s  "
            f"trained {row['trained_tokens_per_s']:.0f} tok/s  sync "
            f"{1e3 * row['weight_sync_s']:.1f} ms  trainer idle {row['train_idle_frac']:.2f}"
        )
    print("RESULT " + json.dumps(result), flush=True)


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = {(row["path"], row["mode"]): row for row in rows if "error" not in row}
    result: dict[str, Any] = {"goals": GOALS, "rows": rows}
    for (path, mode), row in ok.items():
        result[f"{path}_{mode}_median_step_s"] = row["median_step_s"]
        result[f"{path}_{mode}_trained_tokens_per_s"] = row["trained_tokens_per_s"]
    for key, mode in (
        ("cli_ready_first_over_sync", "streaming_ready_first"),
        ("cli_in_order_over_sync", "async_in_order_1"),
    ):
        if ("cli", "sync") in ok and ("cli", mode) in ok:
            result[key] = ok[("cli", "sync")]["median_step_s"] / ok[("cli", mode)]["median_step_s"]
    ratios = [
        ok[("cli", mode)]["median_step_s"] / ok[("inprocess", mode)]["median_step_s"]
        for (path, mode) in ok
        if path == "cli" and ("inprocess", mode) in ok
    ]
    if ratios:
        result["cli_over_inprocess_max"] = max(ratios)
    return result


if __name__ == "__main__":
    main()
