"""Kill a real ``tandemrl train`` run at chosen moments (SIGKILL, or SIGTERM: the graceful
stop a scheduler asks for), restart it, audit it.

Used by ``tests/chaos/test_sigkill.py`` (a few kills, CI) and ``benchmarks/chaos_restart.py``
(more kills, random times). One attempt is one ``tandemrl train`` subprocess in its own
session (``start_new_session=True``). Ray's gcs_server and raylet stay in that process group,
but the Ray *workers* (generation, trainer, controller actor) each get a process group of their
own, so a group kill alone would orphan them. Every process of the run therefore carries a
marker in its environment (``TANDEMRL_CHAOS_RUN``, inherited through the raylet); a kill is
``killpg`` of the driver's group plus SIGKILL of every marked process, repeated until none is
left, and the attempt's Ray session folder is removed afterwards.

Kill points, detected from outside by polling the checkpoint directory and the run journal:

- ``mid_generation``: shortly after the attempt's first trained step (rollouts in flight).
- ``mid_train``: the groups of the next step have all committed but the step has not closed
  (a heuristic: prompts are dispatched in (epoch, index) order, ``num_prompts_per_step`` each).
- ``trainer_checkpoint_write``: a ``.step_N.tmp-*`` folder exists (N at least two steps past
  the resumed one, so a previous checkpoint of this attempt exists).
- ``snapshot_write``: a ``.snapshot_*.tmp-*`` folder exists under an anchor.
- ``validation_open``: a validation pass this attempt opened at version N has not reported, and
  ``step_N``'s checkpoint (which holds it open) is published (needs ``RunShape.val_period``).
- ``random``: a seeded delay (0-4 s) after the attempt's first committed group, or (one time
  in four) 2-45 s after the process started: a kill during start-up or restore.
- ``with_buffered_groups``: this attempt trained a step and published its trainer
  checkpoint, and at least two groups it committed wait untrained in the buffer.

A kill point written ``<point>:SIGTERM`` (e.g. ``mid_generation:SIGTERM``) sends SIGTERM to
the driver's process group at that moment instead, as ``timeout`` or a batch scheduler does:
the run stops gracefully (last checkpoint or rollout snapshot, exit 143) and the attempt is
then checked to have left no process behind.

``audit`` replays the journal (``tandemrl.checkpoint.journal.lineage``) into the proof, and
with validation on, counts the passes reported per version in the final lineage.

``run_config_change_case`` is the restart-with-a-changed-config case: a run is killed with
committed groups waiting, then restarted with ``policy.generation.temperature`` changed under
each ``rollout_checkpointing.on_config_change`` policy — ``refuse`` (the real ``tandemrl
train``: exit 2, the changed dotpath named, the directory byte for byte unchanged),
``drop_rollouts`` (killed again) and ``keep`` (to the end). Its attempts that train run
``light_driver.py`` (the driver's own restart decision and the real controller, writer, log
and journal over the fake engine and trainer, no Ray), forked by one ``--serve`` zygote that
paid the imports once, so a start costs nothing but the run itself.
``config_change_audit`` proves 0 lost, 0 duplicated, and that no group generated under an
earlier config was trained after the change except those ``keep`` said it kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandemrl.checkpoint.journal import lineage, read_journal
from tandemrl.checkpoint.layout import JOURNAL

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "grpo_tiny_cpu_checkpointed.yaml"
# The vision-language run of the chaos case (``VLM_CHECKPOINTING`` makes it checkpointed).
VLM_CONFIG = REPO / "examples" / "configs" / "grpo_tiny_cpu_vlm.yaml"
VLM_CHECKPOINTING = (
    "checkpointing.enabled=true",
    "checkpointing.save_data_plane=true",
    "token_capture.enabled=true",
)
LIGHT_DRIVER = REPO / "tests" / "chaos" / "light_driver.py"
DISTILL_CONFIG = REPO / "examples" / "configs" / "distill_tiny_cpu.yaml"
MARKER_ENV = "TANDEMRL_CHAOS_RUN"
POLL_S = 0.004
# The run's process list is refreshed this often while waiting for a kill point, so the kill
# itself needs no /proc scan.
PID_REFRESH_S = 0.5
RAY_SESSIONS = Path("/tmp/ray")

KILL_POINTS = (
    "mid_generation",
    "mid_train",
    "trainer_checkpoint_write",
    "snapshot_write",
    "validation_open",
    "random",
    "with_buffered_groups",
)


@dataclass(frozen=True)
class RunShape:
    num_prompts: int = 64
    epochs: int = 2
    prompts_per_step: int = 8
    generations_per_prompt: int = 8
    commit_log: bool = True
    # The algorithm block the run's step keys live in, and the config it starts from.
    algorithm: str = "grpo"
    config: Path = CONFIG
    # More overrides (a distillation run: its teacher, checkpointing, token capture).
    extra: tuple[str, ...] = ()
    # Validation passes every val_period versions (0: off): val_samples held-out prompts,
    # val_generations sampled completions each.
    val_period: int = 0
    val_samples: int = 64
    val_generations: int = 1

    @property
    def total_steps(self) -> int:
        return self.num_prompts * self.epochs // self.prompts_per_step

    def prompt_ids(self) -> set[str]:
        return {f"e{e}-i{i}" for e in range(self.epochs) for i in range(self.num_prompts)}

    def validated_versions(self) -> list[int]:
        if not self.val_period:
            return []
        return list(range(self.val_period, self.total_steps + 1, self.val_period))

    def overrides(self, workdir: Path) -> list[str]:
        batch = self.prompts_per_step * self.generations_per_prompt
        algo = self.algorithm
        return [
            f"data.num_prompts={self.num_prompts}",
            f"{algo}.max_num_epochs={self.epochs}",
            f"{algo}.num_prompts_per_step={self.prompts_per_step}",
            f"{algo}.num_generations_per_prompt={self.generations_per_prompt}",
            f"policy.train_global_batch_size={batch}",
            f"policy.train_micro_batch_size={batch}",
            f"async_rl.max_buffered_rollouts={2 * self.prompts_per_step}",
            f"async_rl.max_inflight_prompts={2 * self.prompts_per_step}",
            f"async_rl.min_groups_for_streaming_train={self.prompts_per_step}",
            f"{algo}.max_num_steps=1000",
            "checkpointing.save_period=1",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.5",
            f"rollout_checkpointing.commit_log={str(self.commit_log).lower()}",
            f"checkpointing.checkpoint_dir={workdir / 'ckpt'}",
            f"logger.log_dir={workdir / 'logs'}",
            "logger.progress=false",
            "logger.tensorboard=false",
            "logger.plot=false",
            *self.extra,
            *(
                [
                    f"{algo}.val_period={self.val_period}",
                    f"{algo}.max_val_samples={self.val_samples}",
                    f"{algo}.val_num_generations={self.val_generations}",
                    f"policy.generation.val_temperature={1.0 if self.val_generations > 1 else 0.0}",
                    "data.validation=builtin://counting",
                ]
                if self.val_period
                else []
            ),
        ]


def distillation_shape(**kwargs: Any) -> RunShape:
    """A checkpointed on-policy distillation run: the exemplar's settings with crash recovery
    on, and a teacher built on first use (the ``tiny://`` student preset itself: what is
    proven here is the bookkeeping of its scores, not learning)."""
    return RunShape(
        algorithm="on_policy_distillation",
        config=DISTILL_CONFIG,
        extra=(
            "on_policy_distillation.teachers.0.model_name=tiny://qwen2-counting",
            "checkpointing.enabled=true",
            "checkpointing.save_data_plane=true",
            "token_capture.enabled=true",
        ),
        **kwargs,
    )


@dataclass
class Kill:
    attempt: int
    point: str  # as given: "mid_generation", "mid_generation:SIGTERM"
    hit: bool  # the kill point was observed (False: the fallback timer fired instead)
    seconds_after_start: float
    trained_steps_seen: int  # trained events in the journal at the kill
    detail: str = ""
    processes: int = 0  # processes of the run (driver, Ray daemons, workers) killed
    signal: str = "SIGKILL"
    returncode: int | None = None  # SIGTERM: the driver's exit code (143: a graceful stop)
    left_behind: int = 0  # SIGTERM: processes of the run still alive after the stop


def split_kill_point(entry: str) -> tuple[str, str]:
    """``mid_generation`` -> (mid_generation, SIGKILL); ``mid_generation:SIGTERM`` -> SIGTERM."""
    point, _, sig = entry.partition(":")
    sig = sig or "SIGKILL"
    if sig not in ("SIGKILL", "SIGTERM"):
        raise ValueError(f"kill point {entry!r}: the signal is SIGKILL or SIGTERM")
    return point, sig


@dataclass
class ChaosReport:
    kills: list[Kill] = field(default_factory=list)
    attempts: int = 0
    final_returncode: int | None = None
    wall_s: float = 0.0
    stragglers_killed: int = 0
    audit: dict[str, Any] = field(default_factory=dict)

    def result(self) -> dict[str, Any]:
        return {
            "kills": len(self.kills),
            "kills_hit": sum(kill.hit for kill in self.kills),
            "kill_points": [kill.point for kill in self.kills],
            "attempts": self.attempts,
            "final_returncode": self.final_returncode,
            "stragglers_killed": self.stragglers_killed,
            "wall_s": round(self.wall_s, 1),
            **{
                key: self.audit[key]
                for key in (
                    "groups_lost",
                    "groups_duplicated",
                    "groups_regenerated",
                    "siblings_regenerated",
                    "finished_groups_generated_again",
                    "finished_siblings_generated_again",
                    "regenerated_after_restore",
                    "log_replayed_committed",
                    "steps",
                    "step_numbering_continuous",
                    "validation_reports",
                    "validation_reopened",
                )
            },
        }


# ---------------------------------------------------------------------------- processes


def _marked_pids(marker: str) -> set[int]:
    """Every live process whose environment carries ``marker`` (the driver and Ray's tree)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                if needle in handle.read():
                    found.add(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited meanwhile, or not ours to read
    return found


def _sigkill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _sigkill_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


class ForkedProcess:
    """A child of the light driver's zygote, with the part of ``Popen``'s interface that
    ``Attempt`` uses. Not our child: its end is seen from its exit-code file (written by a
    child that ends by itself) or from its pid disappearing (a SIGKILL; the zygote's kernel
    reaps it)."""

    def __init__(self, pid: int, log_path: Path) -> None:
        self.pid = pid
        self.exit_path = Path(f"{log_path}.exit")
        self.returncode: int | None = None

    def _alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
        return state != b"Z"

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.exit_path.is_file() and not self._alive():
                self.returncode = int(self.exit_path.read_text() or 1)
            elif not self._alive():
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(LIGHT_DRIVER), timeout or 0.0)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode


class LightZygote:
    """``light_driver.py --serve``: imports once, then forks one light attempt per request
    (each start then costs nothing but the run itself)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(LIGHT_DRIVER), "--serve"],
            cwd=REPO,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def start(self, argv: list[str], log_path: Path) -> ForkedProcess:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"argv": argv, "log": str(log_path)}) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer.strip():
            raise RuntimeError(f"the light driver's zygote ended ({self.process.poll()})")
        return ForkedProcess(int(answer), log_path)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Attempt:
    """One start of the run: ``tandemrl train``, or with ``zygote`` a light attempt
    (``light_driver.py``) forked by it."""

    def __init__(
        self,
        index: int,
        workdir: Path,
        overrides: list[str],
        marker: str,
        *,
        zygote: LightZygote | None = None,
        config: Path = CONFIG,
    ) -> None:
        self.index = index
        self.log_path = workdir / f"attempt_{index:02d}.log"
        env = {
            **os.environ,
            "RAY_AUTH_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false",
            MARKER_ENV: marker,
        }
        self.marker = marker
        self.started = time.monotonic()
        self._pids: set[int] = set()
        self._pids_at = 0.0
        self.process: subprocess.Popen[bytes] | ForkedProcess
        if zygote is not None:
            self.process = zygote.start(["--config", str(config), *overrides], self.log_path)
            return
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandemrl.cli",
                    "train",
                    "--config",
                    str(config),
                    *overrides,
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def running(self) -> bool:
        return self.process.poll() is None

    def refresh_pids(self, *, force: bool = False) -> None:
        if isinstance(self.process, ForkedProcess):
            self._pids = {self.process.pid}  # a light attempt starts no process of its own
            return
        if force or time.monotonic() - self._pids_at > PID_REFRESH_S:
            self._pids = _marked_pids(self.marker)
            self._pids_at = time.monotonic()

    def pids(self) -> set[int]:
        return set(self._pids)

    def kill_everything(self, timeout_s: float = 30.0) -> int:
        """SIGKILL the process group and every marked process; return the stragglers killed."""
        _sigkill_group(self.process.pid)  # False when the group is gone: stragglers only
        for pid in self._pids:
            _sigkill(pid)
        self.process.wait()
        stragglers = 0
        deadline = time.monotonic() + timeout_s
        while True:
            left = _marked_pids(self.marker)
            if not left:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of the killed run survive SIGKILL: {sorted(left)}")
            stragglers += sum(_sigkill(pid) for pid in left)
            time.sleep(0.05)
        self._remove_ray_session()
        return stragglers

    def stop_with_sigterm(self, timeout_s: float = 240.0) -> tuple[int, int]:
        """SIGTERM to the driver's process group; wait for the graceful stop. Returns (exit
        code, processes of the run still alive 20 s after the driver exited); every process
        left is then killed."""
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            returncode = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_everything()
            raise RuntimeError(
                f"the run did not stop within {timeout_s} s of SIGTERM:\n{self.tail()}"
            ) from None
        deadline = time.monotonic() + 20
        while _marked_pids(self.marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = len(_marked_pids(self.marker))
        self.kill_everything()
        return returncode, left

    def _remove_ray_session(self) -> None:
        # Ray names the session after the driver's pid; other runs' sessions are left alone.
        for session in RAY_SESSIONS.glob(f"session_*_{self.process.pid}"):
            shutil.rmtree(session, ignore_errors=True)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------------------- observation


def _journal_events(path: Path) -> list[dict[str, Any]]:
    return read_journal(path) if path.is_file() else []


class Observer:
    """What the run is doing, seen from its checkpoint directory and journal."""

    def __init__(self, checkpoint_dir: Path, starts_before: int, shape: RunShape) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.journal = checkpoint_dir / JOURNAL
        self.starts_before = starts_before
        self.shape = shape

    def events(self) -> list[dict[str, Any]]:
        return _journal_events(self.journal)

    def this_attempt(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """This attempt's ``start`` event and the events after it."""
        events = self.events()
        starts = [i for i, event in enumerate(events) if event["event"] == "start"]
        if len(starts) <= self.starts_before:
            return None, []
        first = starts[self.starts_before]
        return events[first], events[first + 1 :]

    def tmp_step_dirs(self) -> list[str]:
        if not self.checkpoint_dir.is_dir():
            return []
        return [
            entry.name
            for entry in os.scandir(self.checkpoint_dir)
            if entry.name.startswith(".step_") and ".tmp-" in entry.name
        ]

    def newest_step(self) -> int:
        """The newest published trainer checkpoint's step (0: none)."""
        if not self.checkpoint_dir.is_dir():
            return 0
        steps = [
            int(entry.name[len("step_") :])
            for entry in os.scandir(self.checkpoint_dir)
            if entry.name.startswith("step_") and entry.name[len("step_") :].isdigit()
        ]
        return max(steps, default=0)

    def tmp_snapshot_dirs(self) -> list[str]:
        if not self.checkpoint_dir.is_dir():
            return []
        found = []
        for anchor in os.scandir(self.checkpoint_dir):
            if not (anchor.name.startswith("step_") or anchor.name == "bootstrap"):
                continue
            root = Path(anchor.path) / "rollout_snapshots"
            if root.is_dir():
                found.extend(
                    f"{anchor.name}/{entry.name}"
                    for entry in os.scandir(root)
                    if entry.name.startswith(".snapshot_") and ".tmp-" in entry.name
                )
        return found


def _ordinal(prompt_id: str, num_prompts: int) -> int:
    epoch, index = prompt_id[1:].split("-i")
    return int(epoch) * num_prompts + int(index)


class KillPoint:
    """Polled until ``ready`` returns a detail string: then the attempt is killed."""

    def __init__(self, point: str, rng: random.Random) -> None:
        self.point = point
        self.delay_from_process_start: float | None = None
        self.delay_from_generating: float | None = None
        self.generating_since: float | None = None
        self.first_trained_at: float | None = None
        self.after_first_step_s = rng.uniform(0.05, 0.4)
        if point == "random":
            if rng.random() < 0.25:
                self.delay_from_process_start = rng.uniform(2.0, 45.0)
            else:
                self.delay_from_generating = rng.uniform(0.0, 4.0)

    def ready(self, attempt: Attempt, observer: Observer) -> str | None:
        if self.point == "random" and self.delay_from_process_start is not None:
            if attempt.elapsed() >= self.delay_from_process_start:
                return f"{self.delay_from_process_start:.1f} s after process start"
            return None
        if self.point == "trainer_checkpoint_write":
            start, _ = observer.this_attempt()
            if start is None:
                return None
            wanted = int(start.get("resumed_step", 0)) + 2
            for name in observer.tmp_step_dirs():
                step = int(name[len(".step_") :].split(".tmp-")[0])
                if step >= wanted:
                    return name
            return None
        if self.point == "snapshot_write":
            start, _ = observer.this_attempt()
            names = observer.tmp_snapshot_dirs() if start is not None else []
            return names[0] if names else None
        if self.point == "validation_open":
            _, after = observer.this_attempt()
            reported = {e["version"] for e in after if e["event"] == "validated"}
            for event in after:
                version = event.get("version")
                if (
                    event["event"] == "validation_opened"
                    and version not in reported
                    and (observer.checkpoint_dir / f"step_{version}" / "manifest.json").is_file()
                ):
                    return f"the pass of version {version} open, step_{version} published"
            return None
        start, after = observer.this_attempt()
        if start is None:
            return None
        now = time.monotonic()
        trained = [event for event in after if event["event"] == "trained"]
        if self.point == "random":
            assert self.delay_from_generating is not None
            if self.generating_since is None and any(e["event"] == "generated" for e in after):
                self.generating_since = now
            if self.generating_since is not None and (
                now - self.generating_since >= self.delay_from_generating
            ):
                return f"{self.delay_from_generating:.2f} s after this attempt's first commit"
            return None
        if self.point == "mid_generation":
            if trained and self.first_trained_at is None:
                self.first_trained_at = now
            if self.first_trained_at is not None and (
                now - self.first_trained_at >= self.after_first_step_s
            ):
                return f"{self.after_first_step_s:.2f} s after step {trained[0]['step']} closed"
            return None
        if self.point == "with_buffered_groups":
            resumed = int(start.get("resumed_step", 0))
            newest = observer.newest_step()
            if not trained or newest <= resumed:
                return None
            done = {group for event in trained for group in event["groups"]}
            waiting = {e["group_id"] for e in after if e["event"] == "generated"} - done
            if len(waiting) < 2:
                return None
            return (
                f"step_{newest} on disk, {len(waiting)} committed group(s) of this attempt waiting"
            )
        if self.point == "mid_train":
            last_step = trained[-1]["step"] if trained else int(start.get("resumed_step", 0))
            generated = {
                event["group_id"] for event in observer.events() if event["event"] == "generated"
            }
            generated.update(start.get("restored_committed", []))
            per_step = observer.shape.prompts_per_step
            next_groups = range(last_step * per_step, (last_step + 1) * per_step)
            ordinals = {_ordinal(group, observer.shape.num_prompts) for group in generated}
            if trained and all(ordinal in ordinals for ordinal in next_groups):
                return f"all groups of step {last_step + 1} committed, step still open"
            return None
        raise ValueError(f"unknown kill point {self.point!r}; known: {KILL_POINTS}")


# ---------------------------------------------------------------------------- the run


def run_with_kills(
    workdir: Path,
    points: list[str],
    *,
    shape: RunShape | None = None,
    seed: int = 0,
    point_timeout_s: float = 150.0,
    final_timeout_s: float = 420.0,
    log: Any = print,
    light: bool = False,
) -> ChaosReport:
    """Run, killing once per entry of ``points``, then let the last attempt finish.

    ``light``: attempts are ``light_driver.py`` over the fake engine and trainer
    (``LIGHT_OVERRIDES``), forked by one zygote, instead of ``tandemrl train``."""
    shape = shape or RunShape()
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = shape.overrides(workdir)
    if light:
        overrides += LIGHT_OVERRIDES
    zygote = LightZygote() if light else None
    checkpoint_dir = workdir / "ckpt"
    rng = random.Random(seed)
    marker = uuid.uuid4().hex
    report = ChaosReport()
    started = time.monotonic()
    pending = list(points)
    attempt: Attempt | None = None
    try:
        while True:
            starts_before = sum(
                event["event"] == "start" for event in _journal_events(checkpoint_dir / JOURNAL)
            )
            attempt = Attempt(
                report.attempts, workdir, overrides, marker, zygote=zygote, config=shape.config
            )
            report.attempts += 1
            observer = Observer(checkpoint_dir, starts_before, shape)
            if not pending:
                try:
                    report.final_returncode = attempt.process.wait(timeout=final_timeout_s)
                except subprocess.TimeoutExpired:
                    attempt.kill_everything()
                    raise RuntimeError(
                        f"the final attempt did not finish in {final_timeout_s} s:\n{attempt.tail()}"
                    ) from None
                # A finished run leaves nothing behind either.
                report.stragglers_killed += attempt.kill_everything()
                break
            point_name, kill_signal = split_kill_point(pending[0])
            point = KillPoint(point_name, rng)
            detail, hit = _wait_for(point, attempt, observer, point_timeout_s)
            if not attempt.running():
                # It finished (or crashed) before the kill point: nothing more to kill.
                report.final_returncode = attempt.process.wait()
                report.stragglers_killed += attempt.kill_everything()
                log(
                    f"attempt {attempt.index} exited with {report.final_returncode} before {pending[0]}"
                )
                break
            trained_seen = sum(event["event"] == "trained" for event in observer.events())
            processes = len(attempt.pids())
            returncode, left_behind = None, 0
            if kill_signal == "SIGTERM":
                returncode, left_behind = attempt.stop_with_sigterm()
            else:
                report.stragglers_killed += attempt.kill_everything()
            kill = Kill(
                attempt.index,
                pending.pop(0),
                hit,
                round(attempt.elapsed(), 2),
                trained_seen,
                detail,
                processes,
                kill_signal,
                returncode,
                left_behind,
            )
            report.kills.append(kill)
            log(f"kill {len(report.kills)}: {kill}")
    except BaseException:
        # A failed assertion, a test timeout or ^C: leave no process of the run behind.
        if attempt is not None:
            attempt.kill_everything()
        raise
    finally:
        if zygote is not None:
            zygote.close()
    report.wall_s = time.monotonic() - started
    report.audit = audit(checkpoint_dir, shape)
    return report


def _wait_for(
    point: KillPoint, attempt: Attempt, observer: Observer, timeout_s: float
) -> tuple[str | None, bool]:
    """Poll until the kill point is reached (detail, True), the attempt exits (None, True) or
    ``timeout_s`` passes (detail, False)."""
    while attempt.running():
        attempt.refresh_pids()
        detail = point.ready(attempt, observer)
        if detail is not None:
            return detail, True
        if attempt.elapsed() > timeout_s:
            return f"not seen within {timeout_s} s: killed by timer", False
        time.sleep(POLL_S)
    return None, True


def audit(checkpoint_dir: Path, shape: RunShape) -> dict[str, Any]:
    """The exactly-once proof, replayed from the run journal."""
    result = lineage(read_journal(checkpoint_dir / JOURNAL))
    trained = result.trained_groups()
    counts = Counter(trained)
    fresh = Counter((group, sibling) for _, group, sibling in result.fresh_generations)
    regenerated_groups = {group for (group, _), count in fresh.items() if count > 1}
    steps = sorted(result.trained)
    finished_again = result.finished_again()
    replays = [event.get("replayed") or {} for event in result.restores]
    validation = validation_audit(read_journal(checkpoint_dir / JOURNAL))
    # On-policy distillation: teacher passes per group over every attempt's commits (the
    # journal's ``generated`` events carry them); a committed group must be scored once.
    teacher_passes: Counter[str] = Counter()
    for event in read_journal(checkpoint_dir / JOURNAL):
        if event["event"] == "generated" and "teacher_passes" in event:
            teacher_passes[event["group_id"]] += int(event["teacher_passes"])
    return {
        **validation,
        "teacher_passes": sum(teacher_passes.values()),
        "teacher_passes_redone": sorted(g for g, n in teacher_passes.items() if n > 1),
        "trained_without_teacher_pass": sorted(set(trained) - set(teacher_passes))
        if teacher_passes
        else [],
        "attempts": result.attempts,
        "steps": len(steps),
        "expected_steps": shape.total_steps,
        "step_numbering_continuous": steps == list(range(1, len(steps) + 1)),
        "groups_trained": len(trained),
        "groups_lost": len(shape.prompt_ids() - set(trained)),
        "groups_duplicated": sum(count - 1 for count in counts.values() if count > 1),
        "unexpected_groups": sorted(set(trained) - shape.prompt_ids()),
        "step_sizes": sorted({len(groups) for groups in result.trained.values()}),
        # Work lost to a kill: a group whose commit (journal ``generated``) shows a sibling
        # generated fresh more than once. With the commit log on it must be 0.
        "groups_regenerated": len(regenerated_groups),
        "siblings_regenerated": sum(count - 1 for count in fresh.values()),
        # From ``staged`` events: a sibling that finished (generated and scored) in more than
        # one attempt, and the groups they belong to. Sibling recovery keeps every finished
        # sibling whose log record reached the disk; one that finished within the last
        # moment before the kill (record still queued) is generated again and counted here.
        "finished_groups_generated_again": len({group for group, _ in finished_again}),
        "finished_siblings_generated_again": len(finished_again),
        "finished_again": [f"{group}/{sibling}" for group, sibling in finished_again],
        "log_replayed_committed": sum(int(r.get("committed_groups", 0)) for r in replays),
        "log_replayed_unfinished": sum(int(r.get("reopened_groups", 0)) for r in replays),
        "regenerated_after_restore": list(result.regenerated_after_restore),
        "resumed_steps": [int(event.get("resumed_step", 0)) for event in result.restores],
        "restored_committed": sum(len(e.get("restored_committed", [])) for e in result.restores),
        "restored_staged": sum(len(e.get("restored_staged", [])) for e in result.restores),
    }


def validation_audit(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Validation passes in the final lineage: reports per version (a ``start`` that resumed
    after step N voids the reports of versions above N, a fresh start all of them), and the
    passes restarts re-opened."""
    reports: Counter[int] = Counter()
    for event in events:
        if event["event"] == "start":
            resumed = int(event.get("resumed_step", 0))
            fresh = "source" in event and event["source"] is None
            reports = Counter({v: n for v, n in reports.items() if v <= resumed and not fresh})
        elif event["event"] == "validated":
            reports[int(event["version"])] += 1
    reopened = [
        int(e["version"])
        for e in events
        if e["event"] == "validation_opened" and int(e.get("restarts", 0)) > 0
    ]
    return {
        "validation_reports": dict(sorted(reports.items())),
        "validation_reopened": reopened,
    }


def leftover_temporaries(checkpoint_dir: Path) -> list[str]:
    """Interrupted bundle folders the kills left (never selected by a restart)."""
    found = [p.name for p in checkpoint_dir.iterdir() if ".tmp-" in p.name]
    for anchor in checkpoint_dir.iterdir():
        root = anchor / "rollout_snapshots"
        if root.is_dir():
            found.extend(f"{anchor.name}/{p.name}" for p in root.iterdir() if ".tmp-" in p.name)
    return found


def dump(report: ChaosReport, path: Path) -> None:
    payload = {
        "result": report.result(),
        "audit": report.audit,
        "kills": [kill.__dict__ for kill in report.kills],
    }
    path.write_text(json.dumps(payload, indent=2))


# ---------------------------------------------------------------------------- config change

TEMPERATURE = "policy.generation.temperature"
# The fake engine of light_driver.py: a step lasts long enough to be caught mid-run.
LIGHT_OVERRIDES = (
    "policy.generation.backend=fake",
    "policy.generation.fake_latency={kind: uniform, low: 0.01, high: 0.05}",
)


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256) and every folder (-> "dir")."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        found[relative] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@dataclass
class ConfigChangeReport:
    kills: list[Kill] = field(default_factory=list)
    refused_returncode: int | None = None
    refused_output: str = ""
    refused_seconds: float = 0.0
    refused_modified: list[str] = field(default_factory=list)  # paths a refusal changed
    final_returncode: int | None = None
    wall_s: float = 0.0
    audit: dict[str, Any] = field(default_factory=dict)


def run_config_change_case(
    workdir: Path,
    *,
    shape: RunShape,
    point_timeout_s: float = 60.0,
    final_timeout_s: float = 120.0,
    log: Any = print,
) -> ConfigChangeReport:
    """Kill a run with committed groups waiting; restart it with a changed temperature under
    refuse, drop_rollouts (killed again) and keep (to the end). Module docstring."""
    workdir.mkdir(parents=True, exist_ok=True)
    base = [*shape.overrides(workdir), *LIGHT_OVERRIDES]
    checkpoint_dir = workdir / "ckpt"
    marker = uuid.uuid4().hex
    report = ConfigChangeReport()
    started = time.monotonic()
    restarts = [
        (f"{TEMPERATURE}=0.7", "rollout_checkpointing.on_config_change=refuse"),
        (f"{TEMPERATURE}=0.7", "rollout_checkpointing.on_config_change=drop_rollouts"),
        (f"{TEMPERATURE}=0.5", "rollout_checkpointing.on_config_change=keep"),
    ]
    attempt: Attempt | None = None
    zygote = LightZygote()
    try:
        for index, changed in enumerate([(), *restarts]):
            starts_before = sum(
                event["event"] == "start" for event in _journal_events(checkpoint_dir / JOURNAL)
            )
            refuse = "rollout_checkpointing.on_config_change=refuse" in changed
            before = tree_digest(checkpoint_dir) if refuse else {}
            # The refused restart is the real command: it must exit before Ray starts.
            attempt = Attempt(
                index, workdir, [*base, *changed], marker, zygote=None if refuse else zygote
            )
            if refuse or "rollout_checkpointing.on_config_change=keep" in changed:
                timeout = point_timeout_s if refuse else final_timeout_s
                try:
                    code = attempt.process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        f"attempt {index} did not end in {timeout} s:\n{attempt.tail()}"
                    ) from None
                attempt.kill_everything()
                if refuse:
                    report.refused_returncode = code
                    report.refused_output = attempt.log_path.read_text(errors="replace")
                    report.refused_seconds = round(attempt.elapsed(), 1)
                    after = tree_digest(checkpoint_dir)
                    report.refused_modified = sorted(
                        path
                        for path in set(before) | set(after)
                        if before.get(path) != after.get(path)
                    )
                else:
                    report.final_returncode = code
                log(f"attempt {index} {changed}: exit {code}")
                continue
            point = KillPoint("with_buffered_groups", random.Random(index))
            observer = Observer(checkpoint_dir, starts_before, shape)
            detail, hit = _wait_for(point, attempt, observer, point_timeout_s)
            if not attempt.running():
                raise RuntimeError(
                    f"attempt {index} {changed} exited ({attempt.process.poll()}) before its "
                    f"kill point:\n{attempt.tail()}"
                )
            processes = len(attempt.pids())
            attempt.kill_everything()
            trained_seen = sum(event["event"] == "trained" for event in observer.events())
            kill = Kill(
                index,
                point.point,
                hit,
                round(attempt.elapsed(), 2),
                trained_seen,
                detail or "",
                processes,
            )
            report.kills.append(kill)
            log(f"kill {len(report.kills)} {changed}: {kill}")
    except BaseException:
        if attempt is not None:
            attempt.kill_everything()
        raise
    finally:
        zygote.close()
    report.wall_s = round(time.monotonic() - started, 1)
    report.audit = config_change_audit(checkpoint_dir, shape)
    return report


def config_change_audit(checkpoint_dir: Path, shape: RunShape) -> dict[str, Any]:
    """``audit``, plus under which config each trained group was generated: no group of an
    earlier config trained after the change, except those ``keep`` kept."""
    events = read_journal(checkpoint_dir / JOURNAL)
    result = lineage(events)
    starts = [event for event in events if event["event"] == "start"]
    first = starts[0]
    by_policy = {(s.get("config_change") or {}).get("policy"): s for s in starts[1:]}
    drop, keep = by_policy.get("drop_rollouts"), by_policy.get("keep")
    mixed = result.trained_under_another_config()
    first_config = result.fingerprints[first["attempt"]]
    kept: set[str] = set()
    if keep is not None:
        change = keep["config_change"]
        kept = set(change["kept_committed"]) | set(change["kept_unfinished"])

    def describe(entries: list[tuple[int, str, str, str | None]]) -> list[str]:
        return [
            f"{group} step {step} by {trainer} from {generator}"
            for step, group, trainer, generator in entries
        ]

    return {
        **audit(checkpoint_dir, shape),
        "config_changes": {
            policy: start["config_change"]["changes"]
            for policy, start in by_policy.items()
            if policy
        },
        "dropped_committed": [] if drop is None else drop["config_change"]["dropped_committed"],
        "dropped_unfinished": [] if drop is None else drop["config_change"]["dropped_unfinished"],
        "kept": sorted(kept),
        # Groups generated under the first config, trained by an attempt under another one.
        "old_config_trained_after_change": describe(
            [
                m
                for m in mixed
                if m[2] != first["attempt"]
                and (m[3] is None or result.fingerprints.get(m[3]) == first_config)
            ]
        ),
        # What the drop_rollouts attempt trained that it did not generate under its config.
        "drop_attempt_trained_across_change": describe(
            [m for m in mixed if drop is not None and m[2] == drop["attempt"]]
        ),
        # What the keep attempt trained across the change: must be among what it kept.
        "keep_attempt_trained_across_change": describe(
            [m for m in mixed if keep is not None and m[2] == keep["attempt"]]
        ),
        "keep_attempt_trained_not_kept": describe(
            [m for m in mixed if keep is not None and m[2] == keep["attempt"] and m[1] not in kept]
        ),
    }
