"""PPO in chunks (streaming samplers) and PPO steps shortened by a dropped prompt."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import test_ppo
import torch
import torch.nn.functional as F
from test_ppo import fake_slots_and_rows, make_cfg, run_ppo

from tandemrl.controller.ppo_step import PPOStepRunner, advantage_stage
from tandemrl.controller.step_runner import collate_step_rows
from tandemrl.generation.fake import LatencyModel
from tandemrl.training.policy_worker import PolicyWorker
from tandemrl.training.value_worker import ValueWorker

# The tiny model folder fixture of test_ppo, shared (module scope there, a fresh one here).
tiny_model_dir = test_ppo.tiny_model_dir


@pytest.mark.parametrize(
    "sampler",
    [
        "{name: weight_fifo, max_staleness_versions: 1}",
        "{name: ready_first, max_staleness_versions: 1}",
        "{name: windowed, max_staleness_versions: 1}",
    ],
    ids=["weight_fifo", "ready_first", "windowed"],
)
def test_ppo_streams_chunks_under_the_streaming_samplers(sampler):
    cfg = make_cfg(
        f"async_rl.sampler={sampler}",
        "async_rl.min_groups_for_streaming_train=1",
        "ppo.ppo_epochs=2",
        "ppo.critic_ppo_epochs=2",
        "ppo.max_num_steps=4",
    )
    # Long-tail latencies: a step's groups finish apart, so it trains in several chunks.
    run = run_ppo(cfg, latency=LatencyModel("lognormal", seconds=0.01, sigma=1.0))
    assert len(run.history) == 4
    # One optimizer step per epoch and model, whatever the chunking.
    assert run.critic.optimizer_steps == 4 * 2 and run.policy.optimizer_steps == 4 * 2
    assert all(step.num_sequences == 8 for step in run.policy.steps)
    chunks = [row["train/num_chunks"] for row in run.history]
    assert max(chunks) > 1, chunks
    assert run.engine.weight_updates == [1, 2, 3, 4]


def _workers(model_dir: Path, cfg):
    policy = PolicyWorker(cfg.policy, cfg.loss_fn, seed=0)
    critic = ValueWorker(cfg.value, cfg.value_loss_fn, model_path=model_dir, device="cpu")
    return policy, critic


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _step(runner: PPOStepRunner, chunks, rows, *, step_num_sequences: int) -> dict:
    async def go() -> dict:
        await runner.begin(version=0)
        for slots in chunks:
            await runner.train_chunk(slots, rows, step_num_sequences=step_num_sequences)
        return await runner.finish()

    return asyncio.run(go())


def test_a_chunked_ppo_step_updates_both_models_as_the_whole_step(tiny_model_dir: Path):
    cfg = make_cfg(
        f"policy.model_name={tiny_model_dir}", "ppo.ppo_epochs=2", "ppo.critic_ppo_epochs=2"
    )
    slots, rows = fake_slots_and_rows(4, 2)
    results = []
    for chunks in ([slots], [slots[:1], slots[1:3], slots[3:]]):
        policy, critic = _workers(tiny_model_dir, cfg)
        runner = PPOStepRunner.from_config(cfg, policy, critic, pad_token_id=0)
        metrics = _step(runner, chunks, rows, step_num_sequences=8)
        critic_params = _params(critic.backbone) + _params(critic.head)
        results.append((metrics, _params(policy.model), critic_params))
    (whole, whole_policy, whole_critic), (chunked, chunked_policy, chunked_critic) = results
    assert chunked["num_chunks"] == 3.0 and whole["num_chunks"] == 1.0
    for a, b in zip(whole_policy + whole_critic, chunked_policy + chunked_critic, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for key in ("critic_value_loss_first_epoch", "critic_grad_norm", "grad_norm", "loss"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), key


def test_a_step_shortened_by_a_drop_trains_on_its_actual_rows(tiny_model_dir: Path):
    """3 of the configured 4 groups (one dropped): the critic's token-mean value loss and the
    policy's sequence-mean loss divide by what the 3 groups hold (6 rows), checked against the
    losses and gradient norms computed here by hand."""
    cfg = make_cfg(
        f"policy.model_name={tiny_model_dir}",
        "ppo.ppo_epochs=1",
        "ppo.critic_ppo_epochs=1",
        "loss_fn.token_level_loss=false",
        "loss_fn.entropy_coef=0.0",
        "policy.max_grad_norm=null",
        "value.max_grad_norm=null",
    )
    slots, rows = fake_slots_and_rows(3, 2)
    policy, critic = _workers(tiny_model_dir, cfg)
    hand_policy, backbone, head = (
        copy.deepcopy(policy.model),
        copy.deepcopy(critic.backbone),
        copy.deepcopy(critic.head),
    )
    batch = collate_step_rows(slots, rows, pad_token_id=0)
    values = asyncio.run(critic.get_values(batch))
    prev = asyncio.run(policy.get_logprobs(batch))
    adv = cfg.ppo.adv_estimator
    advantage_stage(batch, values, gamma=adv.gamma, lam=adv.lambda_, normalize=True)
    runner = PPOStepRunner.from_config(cfg, policy, critic, pad_token_id=0)
    # The pump still names the configured step (4 groups x 2 = 8 sequences).
    metrics = _step(runner, [slots[:1], slots[1:]], rows, step_num_sequences=8)

    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    tokens, sequences = mask.sum(), batch["input_ids"].shape[0]
    assert (tokens, sequences) == (18, 6)

    # Critic, first epoch: new values equal the old, so the clip does not bind.
    hidden = backbone(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    new_values = F.pad(head(hidden[:, :-1]).squeeze(-1), (1, 0)) * batch["attention_mask"]
    value_loss = (0.5 * (new_values - batch["returns"]) ** 2 * mask).sum() / tokens
    value_loss.backward()
    value_grad_norm = torch.nn.utils.clip_grad_norm_(
        [*backbone.parameters(), *head.parameters()], float("inf")
    )
    assert metrics["critic_value_loss"] == pytest.approx(value_loss.item(), rel=1e-5)
    assert metrics["critic_grad_norm"] == pytest.approx(value_grad_norm.item(), rel=1e-4)

    # Policy: ratio 1 at the first epoch; the importance weight min(exp(prev - gen), 2);
    # each sequence's token mean, summed, divided by the 6 sequences.
    logits = hand_policy(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).logits
    logprobs = F.pad(
        torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0],
        (1, 0),
    )
    ratio = torch.exp(logprobs - prev)
    weights = torch.exp(prev - batch["generation_logprobs"]).clamp(max=2.0)
    per_token = weights * -batch["advantages"] * ratio
    policy_loss = ((per_token * mask).sum(1) / mask.sum(1)).sum() / sequences
    policy_loss.backward()
    policy_grad_norm = torch.nn.utils.clip_grad_norm_(hand_policy.parameters(), float("inf"))
    assert metrics["loss"] == pytest.approx(policy_loss.item(), rel=1e-4, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(policy_grad_norm.item(), rel=1e-4)
    assert metrics["step_rows"] == 6.0


def test_a_ppo_run_with_a_drop_budget_trains_the_shortened_step():
    """A prompt whose generations always fail is dropped (budget 1, shrink): its step trains
    the 3 groups left, one optimizer step per epoch, and the run goes on."""
    from test_ppo import CountingCritic, CountingPolicy

    from tandemrl.controller.build import ControllerParts, build_controller
    from tandemrl.envs.counting import CountingEnv
    from tandemrl.generation.fake import FakeGenerationBackend, fake_codec

    cfg = make_cfg(
        "async_rl.rollout_failure.max_skipped_prompts=1",
        "async_rl.rollout_failure.max_consecutive_dropped_prompts=1",
        "async_rl.rollout_failure.max_infra_retries=0",
        "async_rl.rollout_failure.backoff_initial_s=0",
        "ppo.max_num_steps=3",
    )
    events: list[str] = []
    policy, critic = CountingPolicy(events), CountingCritic(events)
    parts = ControllerParts(
        trainer=policy,
        engines=[FakeGenerationBackend(seed=1, fail_request_ids={"e0-i5/"})],
        env=CountingEnv(),
        codec=fake_codec(),
        value_trainer=critic,
    )

    async def go():
        return await asyncio.wait_for(build_controller(cfg, parts).run(), timeout=60)

    history = asyncio.run(go())
    assert [row["groups_trained"] for row in history] == [4, 3, 4]
    assert [step.num_sequences for step in policy.steps] == [8, 6, 8]
    assert history[1]["train/step_rows"] == 6.0
    assert sum(row["dropped_prompts"] for row in history) == 1
    assert critic.optimizer_steps == 3 and policy.optimizer_steps == 3
