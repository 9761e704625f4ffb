"""The stall watchdog: notices a controller that stops making progress and says why.

Progress is a committed group or a finished train step. When neither happened for
``async_rl.stall_watchdog.timeout_s``, the watchdog reports what each pump is waiting on (the
pumps keep ``waiting_on`` current), the oldest in-flight group and the buffer occupancy; with
``action: warn`` it logs that once per timeout period and lets the run go on, with
``action: abort`` it ends the run with ``StallDetected`` carrying the same report. The run's
services add what they know is wrong (an agent's NeMo-Gym server that stopped answering).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from tandemrl.config.models import StallWatchdogConfig

if TYPE_CHECKING:  # the controller runs the watchdog; imported for its type only
    from tandemrl.controller.single_controller import SingleController

log = logging.getLogger(__name__)

# Checks per timeout period: a stall is reported at most timeout_s / CHECKS_PER_TIMEOUT late.
CHECKS_PER_TIMEOUT = 4
# How long the report waits for each service's health (probes of Gym servers take 2 s).
HEALTH_TIMEOUT_S = 10.0


class StallDetected(RuntimeError):
    """async_rl.stall_watchdog (action: abort) found no progress for timeout_s."""


def stall_report(
    controller: SingleController, idle_s: float, services: list[str] | None = None
) -> str:
    now = time.monotonic()
    oldest = min(controller.inflight_started_at.values(), default=None)
    oldest_text = f"oldest started {now - oldest:.1f} s ago" if oldest is not None else "none"
    return (
        f"no progress for {idle_s:.1f} s (async_rl.stall_watchdog.timeout_s): "
        f"rollout pump waiting on [{controller.waiting_on['rollout']}]; "
        f"train pump waiting on [{controller.waiting_on['train']}]; "
        f"in-flight groups {controller.inflight_count} ({oldest_text}); "
        f"buffer {controller.buffer.num_ready} ready / {controller.buffer.num_reserved} reserved; "
        f"trainer version {controller.trainer_version}; "
        f"generation workers alive {controller.generation.num_alive}"
        + "".join(f"; {note}" for note in services or [])
    )


async def service_health(controller: SingleController) -> list[str]:
    """What the run's services report as wrong (each asked with a deadline: a report must
    not stall on the thing that stalled)."""
    notes = []
    for service in controller.services:
        try:
            note = await asyncio.wait_for(service.health(), timeout=HEALTH_TIMEOUT_S)
        except TimeoutError:
            note = f"{type(service).__name__} did not report its health within {HEALTH_TIMEOUT_S} s"
        if note:
            notes.append(note)
    return notes


async def stall_watchdog(controller: SingleController, cfg: StallWatchdogConfig) -> None:
    period = cfg.timeout_s / CHECKS_PER_TIMEOUT
    last_warned = 0.0
    while True:
        await asyncio.sleep(period)
        idle = time.monotonic() - controller.last_progress_at
        if idle < cfg.timeout_s:
            continue
        report = stall_report(controller, idle, await service_health(controller))
        if cfg.action == "abort":
            raise StallDetected(report)
        if time.monotonic() - last_warned >= cfg.timeout_s:
            log.warning("%s", report)
            controller.stall_warnings += 1
            last_warned = time.monotonic()
