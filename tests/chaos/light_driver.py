"""A light stand-in for ``tandemrl train``, for chaos cases that restart a run many times.

It takes the same command line (``--config FILE`` and overrides), makes the driver's own
restart decision (``tandemrl.controller.run.plan_run``: a refusal exits 2, a config change it
goes on with is logged), then runs the real controller, checkpoint writer, commit log and
run journal in this one process, over the fake generation engine
(``policy.generation.backend: fake``, ``fake_latency``) and the fake trainer — no Ray, so an
attempt starts in the time of its imports instead of Ray's and three workers' start-up
(25-100 s on the shared CI machine). A SIGKILL of this process leaves the checkpoint
directory exactly as a killed ``tandemrl train`` leaves it: whatever the writer, the log and
the journal had written.

    python tests/chaos/light_driver.py --config FILE [a.b=c ...]
    python tests/chaos/light_driver.py --serve      # a zygote: see ``serve``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from tandemrl.config import ConfigError, load_and_validate
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.controller.run import plan_run
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation import create_generation_backend
from tandemrl.generation.fake import fake_codec
from tandemrl.preflight import RunRefused
from tandemrl.training.fake import FakeTrainer

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
TRAIN_SECONDS_PER_STEP = 0.02


async def _train(cfg, plan) -> None:
    engine = create_generation_backend(cfg.policy, "unused", seed=cfg.algorithm.seed)
    controller = build_controller(
        cfg,
        ControllerParts(
            trainer=FakeTrainer(train_seconds_per_step=TRAIN_SECONDS_PER_STEP),
            engines=[engine],
            env=CountingEnv(),
            codec=fake_codec(),
        ),
    )
    try:
        await controller.resume(plan)
        await controller.run()
    finally:
        if controller.journal is not None:
            controller.journal.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="light_driver")
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg, _, _ = load_and_validate(args.config, args.overrides)
    except ConfigError as exc:
        print("\n".join(exc.messages), file=sys.stderr)
        return EXIT_REFUSED
    logging.basicConfig(level=cfg.logger.level, format="%(levelname)s %(name)s: %(message)s")
    if cfg.policy.generation.backend != "fake":
        print("light_driver runs policy.generation.backend=fake only", file=sys.stderr)
        return EXIT_REFUSED
    try:
        plan = plan_run(cfg)
    except RunRefused as refused:
        print(f"{args.config}: cannot start", file=sys.stderr)
        print("\n".join(refused.problems), file=sys.stderr)
        return EXIT_REFUSED
    asyncio.run(_train(cfg, plan))
    return EXIT_OK


def serve() -> None:
    """Fork an attempt per request, after the imports above are paid once.

    Reads one JSON line per attempt from stdin, ``{"argv": [...], "log": PATH}``; forks a
    child in a session of its own (so a kill of its process group takes it) that writes its
    output to ``PATH``, runs ``main(argv)`` and writes its exit code to ``PATH.exit`` (a
    SIGKILLed child writes none); answers each request with the child's pid on stdout.
    Children are reaped by the kernel (SIGCHLD ignored). Ends when stdin closes.
    """
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = EXIT_FAILED
            try:
                os.setsid()
                fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = main(request["argv"])
            except BaseException:  # the child must never return into the server's loop
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                with open(request["log"] + ".exit", "w") as handle:
                    handle.write(str(code))
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
        sys.exit(0)
    sys.exit(main())
