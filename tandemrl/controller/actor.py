"""The SingleController as a Ray actor: a thin wrapper that builds and runs the plain class.

The driver creates the heavy workers (generation engines, policy trainer) and hands their
handles here (for a sharded trainer, the ``ShardedTrainer`` over its ranks' handles); this actor builds the light, pure-state parts (buffer, sampler, data plane,
dataloader, ledger) from the config in its own process, runs both pumps in its event loop,
and lets the driver poll finished steps (``progress``) and what each pump waits on
(``status``) while ``run`` is in progress. It reserves no CPU: it mostly waits.

The metrics files (``metrics.jsonl``, TensorBoard, samples, the plot) are written here, in
the controller's process, as each step closes and before its checkpoint: a restart from a
checkpoint never lacks the rows of the steps it holds. The driver only shows progress.

The weight synchroniser is the one part chosen here rather than in ``build_controller``:
``make_weight_sync`` turns the transport settled at launch (``object_store``, ``cuda_ipc`` or
``nccl``) into an object whose ``sync(version)`` drives the trainer and generation actors; the
controller only ever calls ``sync``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import torch

from tandemrl.agents import create_run_agent, is_agent_run
from tandemrl.checkpoint.restore import RestorePlan
from tandemrl.codec import TextCodec, text_codec
from tandemrl.config.models import MasterConfig
from tandemrl.config.redact import redact_tree
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.controller.ray_proxy import ActorProxy
from tandemrl.controller.single_controller import SingleController
from tandemrl.controller.weight_sync import (
    CudaIpcWeightSync,
    NcclWeightSync,
    RayObjectStoreWeightSync,
    WeightSynchronizer,
)
from tandemrl.data.prompt_format import PromptRenderer
from tandemrl.data.vision_prompts import VisionPromptEncoder
from tandemrl.envs import create_environment
from tandemrl.heap import trim_periodically
from tandemrl.metrics.logger import MetricsLogger
from tandemrl.models import load_tokenizer, resolve_tokenizer_path, special_tokens
from tandemrl.models.vision import load_processor
from tandemrl.rollout.generation_pool import GenerationPool
from tandemrl.training.trainer_group import ShardedTrainer

HEAP_TRIM_INTERVAL_S = 30.0


def run_tokenizer(cfg: MasterConfig, model_path: str) -> Any:
    """The run's tokenizer: ``policy.tokenizer.name``, else the model folder's (a
    vision-language run: its processor's)."""
    if cfg.policy.is_vlm:
        return load_processor(model_path).tokenizer
    return load_tokenizer(resolve_tokenizer_path(cfg.policy.tokenizer.name, model_path))


def run_text_codec(cfg: MasterConfig, model_path: str, tokenizer: Any = None) -> TextCodec:
    """The run's codec: its tokenizer (``run_tokenizer``, unless given), prompts rendered in
    ``data.prompt_format``, and every stop id of the model folder and of ``policy.generation``
    (``tandemrl.models.special_tokens``). With ``policy.is_vlm`` the model folder's processor
    encodes each prompt with its images, and its tokenizer decodes."""
    if cfg.policy.is_vlm:
        return vision_codec(cfg, model_path)
    if tokenizer is None:
        tokenizer = run_tokenizer(cfg, model_path)
    data, generation = cfg.data, cfg.policy.generation
    renderer = PromptRenderer(
        tokenizer,
        prompt_format=data.prompt_format,
        system_prompt=data.system_prompt,
        messages_key=data.messages_key,
    )
    return text_codec(
        tokenizer,
        render_prompt=renderer.text if data.prompt_format != "raw" else None,
        stop_token_ids=special_tokens.stop_token_ids(
            tokenizer,
            model_path,
            extra_ids=generation.stop_token_ids,
            stop_strings=generation.stop_strings,
        ),
        pad_token_id=special_tokens.pad_token_id(tokenizer, model_path),
    )


def vision_codec(cfg: MasterConfig, model_path: str) -> TextCodec:
    """``run_text_codec`` of a vision-language run (``tandemrl.data.vision_prompts``)."""
    data, generation = cfg.data, cfg.policy.generation
    processor = load_processor(model_path)
    tokenizer = processor.tokenizer
    dataset = data.dataset
    # Relative image paths are read from the dataset file's folder.
    base_dir = Path(dataset).expanduser().parent if dataset and "://" not in dataset else None
    encoder = VisionPromptEncoder(
        processor,
        image_key=data.image_key,
        max_image_pixels=data.max_image_pixels,
        base_dir=base_dir,
        prompt_format=data.prompt_format,
        system_prompt=data.system_prompt,
        messages_key=data.messages_key,
    )
    return text_codec(
        tokenizer,
        stop_token_ids=special_tokens.stop_token_ids(
            tokenizer,
            model_path,
            extra_ids=generation.stop_token_ids,
            stop_strings=generation.stop_strings,
        ),
        pad_token_id=special_tokens.pad_token_id(tokenizer, model_path),
        encode_with_images=encoder.encode,
    )


def as_trainer(handle: Any) -> Any:
    """What the controller calls: a sharded trainer fans out to its ranks itself; one
    worker's actor handle is wrapped so that its methods are awaited like local ones."""
    return handle if isinstance(handle, ShardedTrainer) else ActorProxy(handle)


def make_weight_sync(
    transport: str, trainer_handle: Any, pool: GenerationPool, *, timeout_s: float
) -> WeightSynchronizer:
    """The synchroniser for ``transport`` over the trainer actor and the pool's workers."""
    if transport == "object_store":
        return RayObjectStoreWeightSync(trainer_handle, pool)
    if transport == "cuda_ipc":
        return CudaIpcWeightSync(ActorProxy(trainer_handle), pool, timeout_s=timeout_s)
    if transport == "nccl":
        return NcclWeightSync(ActorProxy(trainer_handle), pool, timeout_s=timeout_s)
    raise ValueError(
        f"policy.generation.weight_sync={transport!r} is not a transport; use object_store, "
        "cuda_ipc or nccl (auto is settled at launch)"
    )


class SingleControllerActor:
    def __init__(
        self,
        cfg: MasterConfig,
        model_path: str,
        trainer_handle: Any,
        engine_handles: list[Any],
        restore_plan: RestorePlan,
        *,
        value_trainer_handle: Any = None,
        teacher_handles: list[list[Any]] | None = None,
        weight_sync: str = "object_store",
        overwrite_logs: bool = False,
    ) -> None:
        torch.set_num_threads(1)
        logging.basicConfig(level=cfg.logger.level)
        self.cfg = cfg
        self.model_path = model_path
        self.trainer_handle = trainer_handle
        self.engine_handles = list(engine_handles)
        self.restore_plan = restore_plan
        self.value_trainer_handle = value_trainer_handle  # PPO critic; None on GRPO
        # On-policy distillation: each teacher's worker actors.
        self.teacher_handles = teacher_handles or []
        self.weight_sync = weight_sync  # the transport settled at launch
        self.overwrite_logs = overwrite_logs
        self.controller: SingleController | None = None
        self._run_task: asyncio.Task[Any] | None = None

    def _build(self, metrics: MetricsLogger) -> SingleController:
        engines = [ActorProxy(handle) for handle in self.engine_handles]
        tokenizer = run_tokenizer(self.cfg, self.model_path)
        agent_run = is_agent_run(self.cfg.env)
        parts = ControllerParts(
            trainer=as_trainer(self.trainer_handle),
            engines=engines,
            env=None if agent_run else create_environment(self.cfg.env),
            agent=create_run_agent(self.cfg) if agent_run else None,
            tokenizer=tokenizer,
            codec=run_text_codec(self.cfg, self.model_path, tokenizer),
            weight_sync=lambda pool: make_weight_sync(
                self.weight_sync,
                self.trainer_handle,
                pool,
                timeout_s=self.cfg.policy.generation.weight_sync_timeout_s,
            ),
            value_trainer=None
            if self.value_trainer_handle is None
            else as_trainer(self.value_trainer_handle),
            coalesce_generate_calls=True,
            metrics_sink=metrics,
            teacher_engines=[
                [ActorProxy(handle) for handle in workers] for workers in self.teacher_handles
            ]
            if self.cfg.is_distillation
            else None,
            # A long run keeps nothing per trained group (the journal records them).
            keep_trained_groups=False,
        )
        return build_controller(self.cfg, parts, model_path=self.model_path)

    async def run(self) -> list[dict[str, float]]:
        plan = self.restore_plan
        # Opens nothing until the first step: a run failing before it leaves log_dir as it was.
        metrics = MetricsLogger(
            self.cfg.logger,
            resume_step=0 if plan.fresh else plan.step + 1,
            total_steps=self.cfg.algorithm.max_num_steps,
            display=False,
            overwrite=self.overwrite_logs,
            run_config=redact_tree(self.cfg.model_dump(mode="json", by_alias=True)),
        )
        # A long run's controller frees as much as it allocates; glibc keeps the freed
        # pages unless asked (tandemrl.heap).
        trimmer = asyncio.create_task(trim_periodically(HEAP_TRIM_INTERVAL_S))
        try:
            self.controller = self._build(metrics)
            self._run_task = asyncio.current_task()
            await self.controller.resume(plan)
            return await self.controller.run()
        finally:
            trimmer.cancel()
            metrics.close()  # flushes, and writes the plot

    async def progress(self, since: int) -> list[dict[str, float]]:
        """Metrics rows of the steps finished after the first ``since`` ones (the driver has
        shown the first ``since``; the controller forgets them)."""
        if self.controller is None:
            return []
        return self.controller.take_progress(since)

    async def request_stop(self) -> None:
        """Stop gracefully (SIGTERM, Ctrl-C at the driver): ``run`` returns after the step in
        flight, with a last checkpoint when checkpointing is on."""
        if self.controller is not None:
            self.controller.request_stop()

    async def status(self) -> dict[str, Any]:
        if self.controller is None:
            return {"state": "building"}
        return {
            "step": self.controller.state.step,
            "trainer_version": self.controller.trainer_version,
            "inflight": self.controller.inflight_count,
            "waiting_on": dict(self.controller.waiting_on),
        }

    async def stop(self) -> None:
        if self._run_task is not None and not self._run_task.done():
            self._run_task.cancel()
