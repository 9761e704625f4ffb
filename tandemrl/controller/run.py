"""``tandemrl train``: the driver. Checks, starts Ray, launches workers and the controller.

Before anything starts (no Ray, nothing written) the driver refuses what cannot run: a runtime
problem of the config (``tandemrl.preflight``), a ``logger.log_dir`` that holds another run's
metrics (``--overwrite`` replaces them), and a checkpointed run that is already complete.

While the run is on, the driver shows progress: it polls the controller actor for finished
steps every ``POLL_INTERVAL_S``. The metrics files themselves are written by the controller
actor (``tandemrl.controller.actor``), before each step's checkpoint.

Stopping: the first SIGINT (Ctrl-C) or SIGTERM (what Slurm and Kubernetes send before a kill)
asks the controller to stop gracefully: it admits nothing more, finishes the step in flight,
writes a last checkpoint when checkpointing is on — the step's trainer checkpoint, or a rollout
snapshot when that is already written — and flushes the metrics files, all within
``checkpointing.preemption_grace_s``; the driver logs "stopped at step N; run the same command
to resume", stops Ray and exits with 128 + the signal's number. A second signal ends the driver
at once; Ray's processes go with it. Ray's own servers start with SIGTERM blocked, so a
SIGTERM sent to the whole process group reaches only the driver (``tandemrl.sigterm``).

At the end of a run the trained policy is written as a transformers folder
(``logger.save_final_model``, ``logger.final_model_dir``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from tandemrl.checkpoint.layout import MANIFEST, list_step_dirs
from tandemrl.checkpoint.restore import (
    RestorePlan,
    RestoreRefused,
    log_config_change,
    plan_restore,
)
from tandemrl.checkpoint.rollout_state import open_validation_versions
from tandemrl.config import MasterConfig, validate_single_controller_config
from tandemrl.controller.mps import MpsUnavailable, start_if_useful
from tandemrl.metrics.logger import previous_run_files
from tandemrl.metrics.progress import ProgressDisplay
from tandemrl.preflight import RunRefused, runtime_problems
from tandemrl.sigterm import ProcessTree, sigterm_blocked

log = logging.getLogger(__name__)

# How often the driver asks the controller for finished steps (seconds).
POLL_INTERVAL_S = 0.5
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
# Task-event records the embedded cluster's GCS keeps (Ray's default is 100,000, about 3 KB
# each); RAY_task_events_max_num_task_in_gcs in the environment wins (docs/long_runs.md).
EMBEDDED_GCS_TASK_EVENTS = 10_000
GCS_TASK_EVENTS_ENV = "RAY_task_events_max_num_task_in_gcs"


def exit_at_once(code: int) -> None:
    """End the driver now: no cleanup, no atexit handlers (Ray's would stop each of its
    servers in turn). Ray's servers share the driver's fate (they get SIGKILL when it dies),
    and the workers exit once their raylet is gone."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class StopSignals:
    """SIGINT/SIGTERM while a run is on: the first asks for a graceful stop (``signum``); the
    second runs ``on_exit_now`` (e.g. stop the MPS daemon) and calls ``exit_now``."""

    exit_now: Callable[[int], None] = exit_at_once
    on_exit_now: list[Callable[[], None]] = field(default_factory=list)
    signum: int | None = None
    _previous: dict[int, Any] | None = None

    def install(self) -> None:
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def restore(self) -> None:
        for sig, handler in (self._previous or {}).items():
            signal.signal(sig, handler)
        self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            log.warning(
                "%s received: stopping after the step in flight (send it again to stop at once)",
                name,
            )
            return
        log.warning(
            "%s received again: stopping at once; the same command resumes from the last "
            "checkpoint written",
            name,
        )
        for cleanup in self.on_exit_now:
            try:
                cleanup()
            except Exception:
                log.exception("while stopping at once")
        self.exit_now(128 + signum)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)


def init_ray(cfg: MasterConfig) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if ray.is_initialized():
        return

    if cfg.cluster.address is not None:
        ray.init(address=cfg.cluster.address, namespace=cfg.cluster.namespace, log_to_driver=True)
        return
    # Read by the GCS when it starts (Ray's default keeps 100,000 records).
    os.environ.setdefault(GCS_TASK_EVENTS_ENV, str(EMBEDDED_GCS_TASK_EVENTS))
    ray.init(
        num_cpus=cfg.cluster.num_cpus or os.cpu_count() or 1,
        num_gpus=cfg.cluster.num_gpus
        if cfg.cluster.num_gpus is not None
        else (torch.cuda.device_count()),
        include_dashboard=False,
        namespace=cfg.cluster.namespace,
        log_to_driver=True,
    )


def shutdown_embedded_ray() -> None:
    """``ray.shutdown`` for the Ray instance this driver started with SIGTERM blocked.

    Ray stops each of its servers with SIGTERM and gives it a second before SIGKILL; ours ignore
    SIGTERM (``tandemrl.sigterm``), so every one of those seconds was spent waiting (about 4 s
    at the end of every run). They are killed at once instead, which is what the wait ended
    in anyway. The servers' own children (the raylet's agents) would outlive them: they are
    killed too (``tandemrl.sigterm.ProcessTree``).
    """
    import ray
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    kill_all = getattr(node, "kill_all_processes", None)
    servers = [
        info.process.pid
        for infos in getattr(node, "all_processes", {}).values()
        for info in infos
        if getattr(info, "process", None) is not None
    ]
    tree = ProcessTree(servers)
    if kill_all is not None:

        def kill_without_grace(**kwargs: Any) -> Any:
            return kill_all(**{**kwargs, "allow_graceful": False})

        node.kill_all_processes = kill_without_grace  # type: ignore[union-attr]
    ray.shutdown()
    killed = tree.kill_survivors()
    if killed:
        log.debug("killed %d process(es) Ray's servers left behind: %s", len(killed), killed)


def check_run_can_start(cfg: MasterConfig, plan: RestorePlan, *, overwrite_logs: bool) -> None:
    """Raise ``RunRefused`` with every reason the run cannot start; changes nothing."""
    problems = runtime_problems(cfg)
    if plan.fresh and not overwrite_logs:
        found = previous_run_files(cfg.logger.log_dir)
        if found:
            names = ", ".join(path.name for path in found)
            problems.append(
                f"logger.log_dir={cfg.logger.log_dir!r} already holds another run ({names}); a "
                "new run there would mix with it. Set logger.log_dir to a new folder (e.g. "
                f"logger.log_dir={cfg.logger.log_dir.rstrip('/')}_2), or pass --overwrite to "
                "replace it"
                + (
                    ""
                    if cfg.checkpointing.enabled
                    else "; to continue a run, enable checkpointing (checkpointing.enabled: true)"
                )
            )
    if problems:
        raise RunRefused(problems)


def plan_run(cfg: MasterConfig) -> RestorePlan:
    """What this start resumes, decided read-only before any process starts. A restart that
    must not start — a config changed under ``on_config_change: refuse``, no trainer
    checkpoint that verifies — raises ``RunRefused``; a config change it goes on with is
    logged, every changed dotpath, before anything trains."""
    try:
        plan = plan_restore(cfg)
    except RestoreRefused as refused:
        raise RunRefused([str(refused)]) from refused
    log_config_change(plan)
    return plan


def run_already_complete(cfg: MasterConfig, plan: RestorePlan) -> bool:
    """Every step is trained, and no validation pass is left open in the checkpoint (one that
    a kill interrupted after the last step still runs)."""
    if plan.fresh or plan.step < cfg.algorithm.max_num_steps:
        return False
    return plan.rollout_dir is None or not open_validation_versions(plan.rollout_dir)


def run_training(cfg: MasterConfig, *, overwrite_logs: bool = False) -> int:
    """Train until max_num_steps or the data runs out; return a process exit code."""
    if cfg.cluster.address is None:
        # Embedded single-machine Ray: keep every socket (TransferQueue's included) on loopback.
        # Ray reads this when it is first imported, hence before the import below.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    logging.basicConfig(
        level=cfg.logger.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    for warning in validate_single_controller_config(cfg):
        log.warning("%s", warning)
    plan = plan_run(cfg)
    if run_already_complete(cfg, plan):
        log.warning(
            "this run is already complete: %s holds step %d of %d (%s). To train further, raise "
            "%s.max_num_steps; to start a new run, set checkpointing.checkpoint_dir and "
            "logger.log_dir to new folders",
            cfg.checkpointing.checkpoint_dir,
            plan.step,
            cfg.algorithm.max_num_steps,
            plan.trainer_dir,
            cfg.algorithm_key,
        )
        return EXIT_OK
    check_run_can_start(cfg, plan, overwrite_logs=overwrite_logs)
    # Imported once the run may start: a refusal answers before Ray's (slow) import.
    import ray

    from tandemrl.controller.setup import launch

    if cfg.checkpointing.enabled:
        log.info("%s", plan.describe())
    else:
        log.info("a new run; checkpointing is off, so a stopped run cannot be resumed")

    gpus_visible = (
        cfg.cluster.num_gpus if cfg.cluster.num_gpus is not None else torch.cuda.device_count()
    )
    try:
        # Before Ray starts: its workers inherit the daemon's pipe folder from this process.
        mps = start_if_useful(cfg, gpus_visible=gpus_visible)
    except MpsUnavailable as error:
        raise RunRefused([str(error)]) from error
    started_ray = not ray.is_initialized()
    signals = StopSignals()
    if mps is not None:
        signals.on_exit_now.append(mps.stop)
    # Ray's servers start with SIGTERM blocked: a SIGTERM to the run's process group reaches
    # only this driver, which stops the run gracefully (tandemrl.sigterm). One arriving
    # meanwhile is handled when the block ends.
    with sigterm_blocked():
        init_ray(cfg)
        signals.install()  # after ray.init: Ray's own SIGTERM handler would only dump a stack
    launched = None
    try:
        launched = launch(cfg, plan, overwrite_logs=overwrite_logs)
        step = _drive(cfg, launched, signals)
        if signals.signum is None or not cfg.checkpointing.enabled:
            _save_final_model(cfg, launched)
        if signals.signum is not None:
            _say_stopped(cfg, step)
            return signals.exit_code
    finally:
        if launched is not None:
            launched.shutdown()
        if started_ray:
            shutdown_embedded_ray()
        if mps is not None:
            mps.stop()
        signals.restore()
    log.info("training finished; metrics in %s", cfg.logger.log_dir)
    return EXIT_OK


def _drive(cfg: MasterConfig, launched: Any, signals: StopSignals) -> int:
    """Run the controller to its end, showing progress; return the last finished step."""
    import ray

    display = ProgressDisplay(
        enabled=cfg.logger.progress,
        total_steps=cfg.algorithm.max_num_steps,
        initial_step=max(launched.resume_step - 1, 0),
    )
    step = int(max(launched.resume_step - 1, 0))
    seen = 0
    stop_deadline: float | None = None
    try:
        run_ref = launched.controller.run.remote()
        while True:
            if signals.signum is not None and stop_deadline is None:
                launched.controller.request_stop.remote()
                stop_deadline = time.monotonic() + cfg.checkpointing.preemption_grace_s
            done, _ = ray.wait([run_ref], timeout=POLL_INTERVAL_S)
            rows = ray.get(launched.controller.progress.remote(seen))
            for row in rows:
                display.update(row)
                step = int(row["step"])
            seen += len(rows)
            if done:
                ray.get(run_ref)  # re-raises a pump's exception here
                break
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                log.warning(
                    "the run did not stop within checkpointing.preemption_grace_s=%s s",
                    cfg.checkpointing.preemption_grace_s,
                )
                break
    finally:
        display.close()
    return step


def _save_final_model(cfg: MasterConfig, launched: Any) -> None:
    if not cfg.logger.save_final_model:
        return
    target = Path(cfg.logger.final_model_dir)
    if not target.is_absolute():
        target = Path(cfg.logger.log_dir) / target
    path = launched.save_final_model(str(target.resolve()))
    log.info("final model (a transformers folder) saved to %s", path)


def newest_trainer_checkpoint(checkpoint_dir: Path) -> int | None:
    """The step of the newest published trainer checkpoint in ``checkpoint_dir`` (None: none)."""
    steps = [step for step, path in list_step_dirs(checkpoint_dir) if (path / MANIFEST).is_file()]
    return max(steps, default=None)


def _say_stopped(cfg: MasterConfig, step: int) -> None:
    if cfg.checkpointing.enabled:
        checkpoint_dir = Path(cfg.checkpointing.checkpoint_dir)
        saved = newest_trainer_checkpoint(checkpoint_dir)
        where = (
            f"the last checkpoint is in {checkpoint_dir}"
            if saved in (step, None)
            else f"it resumes from the checkpoint of step {saved} in {checkpoint_dir}: the stop "
            "did not finish within checkpointing.preemption_grace_s"
        )
        log.warning("stopped at step %d; run the same command to resume (%s)", step, where)
    else:
        log.warning(
            "stopped at step %d; checkpointing is off (checkpointing.enabled: false), so this "
            "run cannot be resumed (a new one needs --overwrite or a new logger.log_dir)%s",
            step,
            f"; the model of step {step} is in "
            f"{Path(cfg.logger.log_dir) / cfg.logger.final_model_dir}"
            if cfg.logger.save_final_model
            else "",
        )
