"""``tandemrl train``: the driver. Validates, starts Ray, launches workers and the controller.

The driver owns what a user looks at: the progress display and the metrics files (JSONL,
TensorBoard, the final plot). It polls the controller actor for finished steps every
``POLL_INTERVAL_S`` and writes them; the pumps themselves run inside the actor.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from tandemrl.config import MasterConfig, validate_single_controller_config
from tandemrl.config.redact import redact_tree
from tandemrl.metrics.logger import MetricsLogger

log = logging.getLogger(__name__)

# How often the driver asks the controller for finished steps (seconds).
POLL_INTERVAL_S = 0.5


def init_ray(cfg: MasterConfig) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if ray.is_initialized():
        return

    if cfg.cluster.address is not None:
        ray.init(address=cfg.cluster.address, namespace=cfg.cluster.namespace, log_to_driver=True)
        return
    ray.init(
        num_cpus=cfg.cluster.num_cpus or os.cpu_count() or 1,
        num_gpus=cfg.cluster.num_gpus
        if cfg.cluster.num_gpus is not None
        else (torch.cuda.device_count()),
        include_dashboard=False,
        namespace=cfg.cluster.namespace,
        log_to_driver=True,
    )


def run_training(cfg: MasterConfig) -> int:
    """Train until max_num_steps or the data runs out; return a process exit code."""
    if cfg.cluster.address is None:
        # Embedded single-machine Ray: keep every socket (TransferQueue's included) on loopback.
        # Ray reads this when it is first imported, hence before the import below.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from tandemrl.controller.setup import launch

    logging.basicConfig(
        level=cfg.logger.level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    for warning in validate_single_controller_config(cfg):
        log.warning("%s", warning)
    started_ray = not ray.is_initialized()
    init_ray(cfg)
    launched = launch(cfg)
    metrics = MetricsLogger(
        cfg.logger,
        resume_step=launched.resume_step,
        total_steps=cfg.algorithm.max_num_steps,
        run_config=redact_tree(cfg.model_dump(mode="json", by_alias=True)),
    )
    try:
        run_ref = launched.controller.run.remote()
        seen = 0
        while True:
            done, _ = ray.wait([run_ref], timeout=POLL_INTERVAL_S)
            seen = _drain_progress(launched.controller, metrics, seen)
            if done:
                ray.get(run_ref)  # re-raises a pump's exception here
                break
        _drain_progress(launched.controller, metrics, seen)
    finally:
        metrics.close()
        launched.shutdown()
        if started_ray:
            ray.shutdown()
    log.info("training finished; metrics in %s", cfg.logger.log_dir)
    return 0


def _drain_progress(controller: Any, metrics: MetricsLogger, seen: int) -> int:
    import ray

    rows = ray.get(controller.progress.remote(seen))
    for row in rows:
        metrics.log_step(row)
    return seen + len(rows)
