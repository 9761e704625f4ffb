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

A vision-language run (``policy.is_vlm``, the chaos VLM case) encodes its prompts with the
model folder's real processor (images included) and trains with ``ImageCheckingTrainer``:
every trained row must hold its prompt's processed images, intact — the pixels of one of the
dataset's images, the same for every row of a group, as many patches as its prompt has image
tokens — whether the row came from the rollout, a data-plane snapshot or the commit log's
replay; a row that does not fails the attempt.

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


class ImageCheckingTrainer(FakeTrainer):
    """The fake trainer, refusing any train batch whose image fields are not intact."""

    def __init__(self, image_digests: set[str], *, image_token_id: int, group_size: int) -> None:
        super().__init__(train_seconds_per_step=TRAIN_SECONDS_PER_STEP, record_tensors=False)
        self.image_digests = image_digests
        self.image_token_id = image_token_id
        self.group_size = group_size

    async def train_microbatches(self, batch, *, step_num_sequences, step_num_tokens=None):
        pixels, counts = batch["mm.pixel_values"], batch["mm_count.pixel_values"].tolist()
        prompt = (batch["input_ids"] == self.image_token_id) & (batch["token_mask"] == 0)
        for row, count in enumerate(counts):
            digest = pixel_digest(pixels[row, :count])
            if digest not in self.image_digests:
                raise AssertionError(f"row {row}: its pixels are none of the dataset's images")
            if int(prompt[row].sum()) * 4 != count:  # 2 x 2 patches per image token
                raise AssertionError(f"row {row}: {count} patches for its image tokens")
            if row % self.group_size and digest != pixel_digest(pixels[row - 1, : counts[row - 1]]):
                raise AssertionError(f"row {row}: another image than its group's")
        return await super().train_microbatches(
            batch, step_num_sequences=step_num_sequences, step_num_tokens=step_num_tokens
        )


def pixel_digest(pixels) -> str:
    import hashlib

    return hashlib.sha256(pixels.contiguous().numpy().tobytes()).hexdigest()


def _vision_parts(cfg):
    """(codec, trainer) of a vision-language run: the processor's codec and a trainer that
    checks the images of every row against the dataset's own."""
    from tandemrl.controller.actor import run_text_codec
    from tandemrl.data.dataloader import PromptDataLoader
    from tandemrl.models import resolve_model_path

    model_path = str(resolve_model_path(cfg.policy.model_name))
    codec = run_text_codec(cfg, model_path)
    loader = PromptDataLoader.from_config(cfg.data, max_num_epochs=1, images=True)
    digests = {pixel_digest(codec.encode_prompt_inputs(item)[1]["pixel_values"]) for item in loader}
    image_token_id = codec.encode("<|image_pad|>")[0]
    group_size = cfg.algorithm.num_generations_per_prompt
    return codec, ImageCheckingTrainer(
        digests, image_token_id=image_token_id, group_size=group_size
    )


async def _train(cfg, plan) -> None:
    engine = create_generation_backend(cfg.policy, "unused", seed=cfg.algorithm.seed)
    codec, trainer = fake_codec(), FakeTrainer(train_seconds_per_step=TRAIN_SECONDS_PER_STEP)
    if cfg.policy.is_vlm:
        codec, trainer = _vision_parts(cfg)
    controller = build_controller(
        cfg,
        ControllerParts(trainer=trainer, engines=[engine], env=CountingEnv(), codec=codec),
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
