"""Memory of a long run: the checkpointed main job for N steps, every process's RSS sampled.

Runs ``tandemrl train --config examples/configs/grpo_tiny_cpu_checkpointed.yaml`` (checkpoints
every step, rollout snapshots, commit log) as a user would, in a session of its own, and every
``--interval-s`` seconds samples the resident memory of each process of the run (the driver
and everything below it: Ray's gcs_server and raylet, their agents, the controller actor, the
trainer, the generation worker) next to the step the run has reached (``metrics.jsonl``) and
the size of the checkpoint folder.

After ``--warmup-steps`` the RSS of each role is fitted against the step (Theil-Sen: the
median of the slopes between every two samples, which the swings of a process's RSS with the
phase of its step do not move; the least-squares slopes are reported beside them); the slopes
are in MB per 1,000 steps (goal: each at most 1 over a 5,000-step run). ``--analyze
<workdir>/samples.jsonl`` fits a finished soak's samples again. With
``--max-wall-s`` the run is stopped by SIGTERM to its process group (what ``timeout``, a
terminal or a batch scheduler sends) once that much time has passed, and the result records how
the stop went (exit code 143, the last checkpoint's step).

    python benchmarks/soak.py --steps 5000 --interval-s 5 --warmup-steps 1000
    python benchmarks/soak.py --steps 5000 --max-wall-s 600 --warmup-steps 200   # short mode
    python benchmarks/soak.py --steps 3000 --warmup-steps 1000 --heap-probe   # what grows

``--heap-probe`` puts ``benchmarks/heap_probe`` first on the run's ``PYTHONPATH``: its
``sitecustomize`` samples, inside the controller and trainer actors, glibc's heap in use and
free, the interpreter's blocks and the count of each type of object (see that file); the
RESULT then carries their slopes and the types whose count grew most.

Ends with one line ``RESULT {json}``; every sample is kept in ``<workdir>/samples.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import psutil

from tandemrl.checkpoint.layout import JOURNAL

REPO = Path(__file__).resolve().parents[1]
HEAP_PROBE = REPO / "benchmarks" / "heap_probe"
HEAP_FIELDS = ("anon_mb", "malloc_in_use_mb", "malloc_free_mb", "py_blocks", "gc_objects")
CONFIG = "examples/configs/grpo_tiny_cpu_checkpointed.yaml"
GOAL_MB_PER_1K_STEPS = 1.0
# Process title prefix (Ray names its workers ``ray::<Class>``) or executable -> role.
ROLES = (
    ("ray::SingleControllerActor", "controller"),
    ("ray::PolicyWorker", "trainer"),
    ("ray::ValueWorker", "critic"),
    ("ray::GenerationWorker", "generation"),
    ("gcs_server", "gcs"),
    ("raylet", "raylet"),
)


def role_of(process: psutil.Process, driver_pid: int) -> str:
    if process.pid == driver_pid:
        return "driver"
    try:
        title = " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "ray_other"
    for prefix, role in ROLES:
        if title.startswith(prefix) or Path(title.split(" ")[0]).name == prefix:
            return role
    return "ray_other"  # agents, log monitor, autoscaler monitor, idle workers


STATUS_PARTS = (("RssAnon:", "anon"), ("RssFile:", "file"), ("RssShmem:", "shmem"))


def rss_parts(pid: int) -> dict[str, float]:
    """MB of a process's resident memory by kind (``/proc/<pid>/status``, Linux): private
    heap and stacks (anon), mapped files and libraries (file), and shared memory (shmem: the
    pages of Ray's object store this process has touched, which the store's size bounds)."""
    parts: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                for field, name in STATUS_PARTS:
                    if line.startswith(field):
                        parts[name] = int(line.split()[1]) / 1024  # kB
    except OSError:
        return {}
    return parts


def rss_by_role(driver: psutil.Process) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """MB resident per role, over the driver and all its descendants, and per role the same
    split by kind (``rss_parts``; empty where /proc has no such fields)."""
    totals: dict[str, float] = defaultdict(float)
    parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    try:
        processes = [driver, *driver.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}, {}
    for process in processes:
        try:
            rss = process.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = role_of(process, driver.pid)
        totals[role] += rss
        for name, mb in rss_parts(process.pid).items():
            parts[role][name] += mb
    return dict(totals), {role: dict(split) for role, split in parts.items()}


def last_step(metrics: Path) -> int:
    """The step of the last whole line of ``metrics.jsonl`` (0 before the first)."""
    if not metrics.is_file():
        return 0
    with metrics.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(size - 8192, 0))
        lines = handle.read().splitlines()
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line being written
    return 0


def folder_mb(folder: Path) -> float:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue  # removed by retention meanwhile
    return total / 2**20


def lsq_slope_per_1k(points: list[tuple[int, float]]) -> float | None:
    """Least-squares MB per 1,000 steps; None with fewer than 3 distinct steps."""
    if len({step for step, _ in points}) < 3:
        return None
    fit = statistics.linear_regression([s for s, _ in points], [mb for _, mb in points])
    return round(fit.slope * 1000, 3)


def slope_per_1k(points: list[tuple[int, float]]) -> float | None:
    """Theil-Sen MB per 1,000 steps (the median of the slopes between every two samples);
    None with fewer than 3 distinct steps. A process's RSS swings with the phase of the step
    it is sampled in (the trainer's by ±10-20 MB: a checkpoint's buffers, the step's tensors);
    least squares turns such swings into slopes of ±0.7 MB per 1,000 steps over a 5,000-step
    run, the median of pairwise slopes is not moved by them."""
    if len({step for step, _ in points}) < 3:
        return None
    slopes = [
        (mb_b - mb_a) / (step_b - step_a)
        for index, (step_a, mb_a) in enumerate(points)
        for step_b, mb_b in points[index + 1 :]
        if step_b != step_a
    ]
    return round(statistics.median(slopes) * 1000, 3)


def step_at(samples: list[dict[str, Any]], when: float) -> float | None:
    """The run's step at wall-clock time ``when``, interpolated between RSS samples."""
    for before, after in pairwise(samples):
        if before["t"] <= when <= after["t"]:
            span = after["t"] - before["t"]
            share = (when - before["t"]) / span if span else 0.0
            return before["step"] + share * (after["step"] - before["step"])
    return None


def heap_summary(folder: Path, samples: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per probed actor: each HEAP_FIELDS value's slope per 1,000 steps after the warm-up
    (MB, or blocks and objects), and the 15 object types whose count grew most."""
    summary: dict[str, Any] = {}
    for path in sorted(folder.glob("*.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            row = json.loads(line)
            step = step_at(samples, row["t"])
            if step is not None and step >= warmup:
                rows.append((step, row))
        if len(rows) < 3:
            continue
        first, last = rows[0][1]["types"], rows[-1][1]["types"]
        grown = {name: last.get(name, 0) - first.get(name, 0) for name in {*first, *last}}
        summary[path.stem] = {
            "samples": len(rows),
            "steps": [round(rows[0][0]), round(rows[-1][0])],
            "per_1k_steps": {
                field: slope_per_1k([(step, row[field]) for step, row in rows])
                for field in HEAP_FIELDS
            },
            "first": {field: rows[0][1][field] for field in HEAP_FIELDS},
            "last": {field: rows[-1][1][field] for field in HEAP_FIELDS},
            "types_grown": dict(sorted(grown.items(), key=lambda kv: -kv[1])[:15]),
        }
    return summary


def fit_slopes(samples: list[dict[str, Any]], warmup_steps: int, steps: int) -> dict[str, Any]:
    """The slopes of every role, of the whole job, and by kind of memory, fitted over the
    training phase: after the warm-up, before the last step (the run's end imports matplotlib
    for the plot and stops its processes), samples where every role is present."""
    training = [s for s in samples if warmup_steps <= s["step"] < steps]
    roles = sorted({role for s in training for role in s["rss_mb"]})
    fitted = [s for s in training if set(s["rss_mb"]) == set(roles)]

    def by_role(fit: Any) -> dict[str, float | None]:
        return {
            role: fit([(s["step"], s["rss_mb"].get(role, 0.0)) for s in fitted]) for role in roles
        }

    def whole(fit: Any) -> float | None:
        return fit([(s["step"], sum(s["rss_mb"].values())) for s in fitted])

    kinds = sorted({kind for s in fitted for split in s["rss_parts_mb"].values() for kind in split})

    def kind_slopes(roles: set[str] | None) -> dict[str, float | None]:
        """Slope of each kind of memory summed over ``roles`` (None: every role)."""
        return {
            kind: slope_per_1k(
                [
                    (
                        s["step"],
                        sum(
                            split.get(kind, 0.0)
                            for role, split in s["rss_parts_mb"].items()
                            if roles is None or role in roles
                        ),
                    )
                    for s in fitted
                ]
            )
            for kind in kinds
        }

    lsq = by_role(lsq_slope_per_1k)
    return {
        "fitted": fitted,
        "slopes": by_role(slope_per_1k),
        "total": whole(slope_per_1k),
        "by_kind": {"controller": kind_slopes({"controller"}), "whole_job": kind_slopes(None)},
        "least_squares": {
            "controller_mb_per_1k_steps": lsq.get("controller"),
            "gcs_mb_per_1k_steps": lsq.get("gcs"),
            "total_mb_per_1k_steps": whole(lsq_slope_per_1k),
            "mb_per_1k_steps_by_role": lsq,
        },
    }


def analyze(path: Path, warmup_steps: int) -> dict[str, Any]:
    """The slopes of a finished soak from its ``samples.jsonl`` (``--analyze``)."""
    samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = max(s["step"] for s in samples)
    fits = fit_slopes(samples, warmup_steps, steps)
    checked = [fits["slopes"].get("controller"), fits["slopes"].get("gcs"), fits["total"]]
    return {
        "samples_file": str(path),
        "steps": steps,
        "fitted_samples": len(fits["fitted"]),
        "warmup_steps": warmup_steps,
        "controller_mb_per_1k_steps": fits["slopes"].get("controller"),
        "gcs_mb_per_1k_steps": fits["slopes"].get("gcs"),
        "total_mb_per_1k_steps": fits["total"],
        "mb_per_1k_steps_by_role": fits["slopes"],
        "fit": "theil-sen",
        "least_squares": fits["least_squares"],
        "goal_met": all(v is not None and v <= GOAL_MB_PER_1K_STEPS for v in checked),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--max-wall-s", type=float, default=None)
    parser.add_argument("--interval-s", type=float, default=5.0)
    parser.add_argument("--warmup-steps", type=int, default=1000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tandemrl-soak"))
    parser.add_argument(
        "--heap-probe", action="store_true", help="sample the controller's and trainer's heap"
    )
    parser.add_argument(
        "--tracemalloc", action="store_true", help="with --heap-probe: Python's growth by line"
    )
    parser.add_argument(
        "--largest",
        action="store_true",
        help="with --heap-probe: the largest objects in each sample (this distorts the slopes: "
        "benchmarks/heap_probe/sitecustomize.py)",
    )
    parser.add_argument(
        "--analyze",
        type=Path,
        default=None,
        help="fit the slopes of a finished soak's samples.jsonl instead of running one",
    )
    parser.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")
    args = parser.parse_args()
    if args.analyze is not None:
        print("RESULT " + json.dumps(analyze(args.analyze, args.warmup_steps)))
        return 0

    workdir = args.workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        parser.error(f"--workdir {workdir} is not empty (a soak starts a fresh run)")
    workdir.mkdir(parents=True, exist_ok=True)
    log_dir, checkpoint_dir = workdir / "logs", workdir / "ckpt"
    command = [
        sys.executable,
        "-m",
        "tandemrl.cli",
        "train",
        "--config",
        CONFIG,
        f"grpo.max_num_steps={args.steps}",
        f"logger.log_dir={log_dir}",
        f"checkpointing.checkpoint_dir={checkpoint_dir}",
        "logger.progress=false",
        "logger.save_final_model=false",
        *args.overrides,
    ]
    load_before = os.getloadavg()
    started = time.monotonic()
    samples: list[dict[str, Any]] = []
    stopped_by_signal = False
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    heap_dir = workdir / "heap"
    if args.heap_probe:
        heap_dir.mkdir()
        env["PYTHONPATH"] = f"{HEAP_PROBE}{os.pathsep}{REPO}"
        env["TANDEMRL_HEAP_PROBE_DIR"] = str(heap_dir)
        env["TANDEMRL_HEAP_PROBE_S"] = str(max(args.interval_s, 10.0))
        if args.tracemalloc:
            env["TANDEMRL_HEAP_PROBE_TRACEMALLOC"] = "1"
        if args.largest:
            env["TANDEMRL_HEAP_PROBE_LARGEST"] = "1"
    with (workdir / "run.log").open("wb") as run_log:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=run_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    driver = psutil.Process(process.pid)
    try:
        with (workdir / "samples.jsonl").open("w") as out:
            while process.poll() is None:
                elapsed = time.monotonic() - started
                if args.max_wall_s is not None and elapsed > args.max_wall_s:
                    stopped_by_signal = True
                    os.killpg(process.pid, signal.SIGTERM)
                    break
                rss, parts = rss_by_role(driver)
                sample = {
                    "t_s": round(elapsed, 1),
                    "t": round(time.time(), 1),
                    "step": last_step(log_dir / "metrics.jsonl"),
                    "rss_mb": {k: round(v, 2) for k, v in rss.items()},
                    "rss_parts_mb": {
                        role: {k: round(v, 2) for k, v in split.items()}
                        for role, split in parts.items()
                    },
                    "checkpoint_mb": round(folder_mb(checkpoint_dir), 2),
                    "load1": os.getloadavg()[0],
                }
                samples.append(sample)
                out.write(json.dumps(sample) + "\n")
                out.flush()
                time.sleep(args.interval_s)
        returncode = process.wait(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    wall = time.monotonic() - started

    steps = last_step(log_dir / "metrics.jsonl")
    fits = fit_slopes(samples, args.warmup_steps, steps)
    fitted, slopes, total = fits["fitted"], fits["slopes"], fits["total"]
    tail = (workdir / "run.log").read_text(errors="replace").splitlines()[-5:]
    checked = [slopes.get("controller"), slopes.get("gcs"), total]
    journal = checkpoint_dir / JOURNAL
    result = {
        "steps": steps,
        "steps_asked": args.steps,
        "wall_s": round(wall, 1),
        "steps_per_s": round(steps / wall, 2) if wall else None,
        "samples": len(samples),
        "fitted_samples": len(fitted),
        "warmup_steps": args.warmup_steps,
        "controller_mb_per_1k_steps": slopes.get("controller"),
        "gcs_mb_per_1k_steps": slopes.get("gcs"),
        "total_mb_per_1k_steps": total,
        "mb_per_1k_steps_by_role": slopes,
        "mb_per_1k_steps_by_kind": fits["by_kind"],
        "fit": "theil-sen",
        "least_squares": fits["least_squares"],
        "rss_mb_after_warmup": fitted[0]["rss_mb"] if fitted else None,
        "rss_mb_last": fitted[-1]["rss_mb"] if fitted else None,
        "checkpoint_mb_last": samples[-1]["checkpoint_mb"] if samples else None,
        "checkpoint_mb_max": max((s["checkpoint_mb"] for s in samples), default=None),
        "checkpoint_mb_final": round(folder_mb(checkpoint_dir), 2),
        "journal_mb": round(journal.stat().st_size / 2**20, 2) if journal.is_file() else None,
        "goal_met": all(v is not None and v <= GOAL_MB_PER_1K_STEPS for v in checked),
        "returncode": returncode,
        "stopped_by_sigterm": stopped_by_signal,
        "stop_said_resume": any("run the same command to resume" in line for line in tail),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "workdir": str(workdir),
    }
    if args.heap_probe:
        result["heap_probe"] = heap_summary(heap_dir, samples, args.warmup_steps)
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if returncode in (0, 128 + signal.SIGTERM) else 1


if __name__ == "__main__":
    raise SystemExit(main())
