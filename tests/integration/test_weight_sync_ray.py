"""Flat-buffer weight sync between real Ray actors (``policy.generation.weight_sync``).

On CPU the ``nccl`` transport broadcasts over gloo, through the same trainer / worker / pool
code the GPU run uses. CUDA IPC needs a GPU (its CPU protocol test is in
tests/unit/test_weight_sync_cuda.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.controller.actor import make_weight_sync
from tandemrl.controller.ray_proxy import ActorProxy
from tandemrl.controller.setup import launch
from tandemrl.controller.weight_sync import NcclWeightSync
from tandemrl.generation.worker import make_generation_worker_class
from tandemrl.models import resolve_model_path
from tandemrl.records import GenerationRequest
from tandemrl.rollout.generation_pool import GenerationPool
from tandemrl.training.policy_worker import create_policy_worker_actor

pytestmark = pytest.mark.integration

PROMPT = [5, 6, 7, 14]


def sync_config(tmp_path: Path, *overrides: str):
    return load_config(
        "examples/configs/grpo_tiny_cpu_sync.yaml",
        (
            f"logger.log_dir={tmp_path}",
            "logger.tensorboard=false",
            "logger.progress=false",
            "logger.plot=false",
            *overrides,
        ),
    )


async def greedy(engine, request_id: str):
    (result,) = await engine.generate([GenerationRequest(request_id, PROMPT, 6, temperature=0.0)])
    return result


async def trainer_logprobs(trainer, result) -> list[float]:
    """The trainer's logprobs of the generated tokens (its current weights)."""
    tokens = torch.tensor([result.prompt_token_ids + result.token_ids])
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    logprobs = await trainer.get_logprobs(batch)
    return logprobs[0, len(result.prompt_token_ids) :].tolist()


def test_nccl_over_gloo_between_actors_tracks_every_version_and_drops_a_dead_worker(
    ray_session, tmp_path
):
    ray = ray_session
    cfg = sync_config(tmp_path)
    model_path = str(resolve_model_path(cfg.policy.model_name))
    trainer_handle = create_policy_worker_actor(
        cfg.policy, cfg.loss_fn, model_path=model_path, seed=0, num_cpus=1
    )
    worker_class = make_generation_worker_class(num_cpus=1, num_gpus=0)
    handles = [
        worker_class.remote(model_path, device="cpu", max_batch_size=8, seed=index)
        for index in range(2)
    ]
    trainer = ActorProxy(trainer_handle)
    engines = [ActorProxy(handle) for handle in handles]
    pool = GenerationPool(engines)
    sync = make_weight_sync("nccl", trainer_handle, pool, timeout_s=60)
    assert isinstance(sync, NcclWeightSync)

    async def scenario() -> None:
        before = [await greedy(engine, f"v0-{i}") for i, engine in enumerate(engines)]
        seen = [before[0].logprobs]
        for version in (1, 2):
            # A stand-in for an optimizer step: the trainer's weights move.
            weights = await trainer.export_weights()
            generator = torch.Generator().manual_seed(version)
            moved = {
                name: value + 0.3 * torch.randn(value.shape, generator=generator)
                for name, value in weights.items()
            }
            moved["lm_head.weight"] = moved["model.embed_tokens.weight"]  # tied
            await trainer.load_weights(moved)
            assert await sync.sync(version) > 0
            for index, engine in enumerate(engines):
                assert await engine.weight_version() == version
                result = await greedy(engine, f"v{version}-{index}")
                assert result.start_weight_version == version
                # The generator now scores its tokens exactly as the trainer does ...
                expected = await trainer_logprobs(trainer, result)
                assert (
                    max(abs(a - b) for a, b in zip(result.logprobs, expected, strict=True)) < 1e-4
                )
            # ... and differently from the version before.
            assert result.logprobs != seen[-1]
            seen.append(result.logprobs)
        assert sync.members == (0, 1) and sync.groups_formed == 1

        # A worker dies between syncs: the next one drops it (as the object-store path would)
        # and broadcasts to the survivor in a new group.
        ray.kill(handles[0], no_restart=True)
        await asyncio.sleep(0.5)
        assert await sync.sync(3) > 0
        assert pool.live_indices == (1,) and pool.dead_workers == [0]
        assert sync.members == (1,) and sync.groups_formed == 2
        assert await engines[1].weight_version() == 3

    try:
        asyncio.run(scenario())
    finally:
        for handle in [trainer_handle, *handles]:
            ray.kill(handle, no_restart=True)


def test_a_train_run_with_nccl_sync_keeps_the_generators_on_the_trainers_weights(
    ray_session, tmp_path
):
    """What ``tandemrl train`` runs (launch, then the controller actor's run), in sync mode
    (lookahead 0): every row is generated by the weights it is trained with, so the importance
    weight is exactly 1 at every step only if every broadcast reached both workers; both
    end on the run's last version."""
    steps = 4
    cfg = sync_config(
        tmp_path,
        f"grpo.max_num_steps={steps}",
        "policy.generation.num_workers=2",
        "policy.generation.weight_sync=nccl",
        "policy.generation.weight_sync_timeout_s=60",
    )
    launched = launch(cfg)
    try:
        started = time.monotonic()
        rows = ray_session.get(launched.controller.run.remote(), timeout=600)
        elapsed = time.monotonic() - started
        for engine in launched.engines:
            assert ray_session.get(engine.weight_version.remote(), timeout=60) == steps
            assert ray_session.get(engine.stats.remote(), timeout=60)["weight_updates"] == steps
    finally:
        launched.shutdown()
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        assert row["staleness_max"] == 0
        assert abs(row["train/is_weight_max"] - 1.0) < 1e-3, row
        assert abs(row["train/kl_gen_trainer"]) < 1e-5, row
        assert 0 < row["weight_sync_s"] < elapsed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_between_actors_sharing_a_gpu(ray_session, tmp_path):
    """What the sync delivered, not how fast: the engine mapped over CUDA IPC answers exactly
    as an engine given the same weights through the object store (same dtype, same kernels),
    at the new version, and differently from before the sync."""
    ray = ray_session
    cfg = sync_config(tmp_path, "policy.device=cuda")
    model_path = str(resolve_model_path(cfg.policy.model_name))
    trainer_handle = create_policy_worker_actor(
        cfg.policy, cfg.loss_fn, model_path=model_path, seed=0, num_cpus=1, num_gpus=0.5
    )
    worker_class = make_generation_worker_class(num_cpus=1, num_gpus=0.25)
    ipc_handle = worker_class.remote(model_path, device="cuda", max_batch_size=8, seed=0)
    copy_handle = worker_class.remote(model_path, device="cuda", max_batch_size=8, seed=0)
    trainer = ActorProxy(trainer_handle)
    ipc_engine, copied_engine = ActorProxy(ipc_handle), ActorProxy(copy_handle)
    sync = make_weight_sync("cuda_ipc", trainer_handle, GenerationPool([ipc_engine]), timeout_s=60)

    async def scenario() -> None:
        before = await greedy(ipc_engine, "v0")
        weights = await trainer.export_weights()
        generator = torch.Generator().manual_seed(1)
        moved = {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
        moved["lm_head.weight"] = moved["model.embed_tokens.weight"]
        await trainer.load_weights(moved)
        await sync.sync(1)
        await copied_engine.update_weights(1, await trainer.export_weights())
        assert await ipc_engine.weight_version() == 1
        assert (await ipc_engine.stats())["weight_updates"] == 1
        after = await greedy(ipc_engine, "v1")
        reference = await greedy(copied_engine, "v1-copy")
        assert after.start_weight_version == 1
        assert after.token_ids == reference.token_ids
        assert after.logprobs == reference.logprobs
        assert after.logprobs != before.logprobs

    try:
        asyncio.run(scenario())
    finally:
        for actor in (trainer_handle, ipc_handle, copy_handle):
            ray.kill(actor, no_restart=True)
