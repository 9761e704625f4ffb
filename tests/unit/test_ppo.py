"""PPO step runner with fakes: GAE wiring, epoch counts, critic warm-up, warm start, offload."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.controller.build import ControllerParts, build_controller, make_step_runner
from tandemrl.controller.ppo_step import (
    PPOSettings,
    PPOStepRunner,
    WarmStartError,
    advantage_stage,
    warm_start_critic,
)
from tandemrl.dataplane.rows import make_training_row
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel, fake_codec
from tandemrl.training.batch import collate_rows
from tandemrl.training.fake import FakeTrainer
from tandemrl.training.worker_common import WORKER_STATE_FILE

BASE = "examples/configs/ppo_tiny_cpu.yaml"


def make_cfg(*overrides: str):
    defaults = (
        "ppo.num_prompts_per_step=4",
        "ppo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8",
        "value.train_global_batch_size=8",
        "value.train_micro_batch_size=8",
        "ppo.max_num_steps=4",
        "ppo.ppo_epochs=1",
        "async_rl.max_buffered_rollouts=8",
        "async_rl.max_inflight_prompts=8",
        "logger.progress=false",
    )
    cfg = load_config(BASE, (*defaults, *overrides))
    validate_single_controller_config(cfg)
    return cfg


class CountingPolicy(FakeTrainer):
    """FakeTrainer plus the optimizer offload calls; every call lands in ``events``."""

    def __init__(self, events: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.events = events

    async def get_logprobs(self, batch):
        self.events.append("policy.get_logprobs")
        return await super().get_logprobs(batch)

    async def begin_train_step(self) -> None:
        self.events.append("policy.begin")
        await super().begin_train_step()

    async def finish_train_step(self):
        self.events.append("policy.finish")
        return await super().finish_train_step()

    async def offload_optimizer(self) -> None:
        self.events.append("policy.offload_optimizer")

    async def reload_optimizer(self) -> None:
        self.events.append("policy.reload_optimizer")


class CountingCritic:
    """A ValueTrainer without a model: constant values, counted optimizer steps."""

    def __init__(self, events: list[str], value: float = 0.25) -> None:
        self.events = events
        self.value = value
        self.optimizer_steps = 0
        self.trained_batches: list[dict[str, torch.Tensor]] = []
        self.warm_started_from: list[Path] = []
        self._open = False

    async def get_values(self, batch):
        self.events.append("critic.get_values")
        return torch.full(batch["input_ids"].shape, self.value) * batch["attention_mask"]

    async def begin_train_step(self) -> None:
        assert not self._open
        self._open = True
        self.events.append("critic.begin")

    async def train_microbatches(self, batch, *, step_num_sequences, step_num_tokens=None):
        assert self._open
        self.trained_batches.append(batch)
        return {"value_loss": 0.5}

    async def finish_train_step(self):
        assert self._open
        self._open = False
        self.optimizer_steps += 1
        self.events.append("critic.finish")
        return {"value_loss": 0.5, "grad_norm": 0.0}

    async def save_checkpoint(self, directory: Path, *, save_optimizer: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / WORKER_STATE_FILE).write_text(json.dumps({"kind": "value"}))

    async def load_checkpoint(self, directory: Path, *, load_optimizer: bool) -> None:
        self.events.append("critic.load_checkpoint")

    async def load_warm_start(self, checkpoint_dir: Path) -> None:
        self.warm_started_from.append(Path(checkpoint_dir))


def run_ppo(cfg, *, train_seconds_per_step: float = 0.0, step_hooks=None, latency=None):
    events: list[str] = []
    policy = CountingPolicy(events, train_seconds_per_step=train_seconds_per_step)
    critic = CountingCritic(events)
    latency = latency or LatencyModel("uniform", low=0.0, high=0.002)
    engines = [FakeGenerationBackend(latency=latency, seed=1)]
    parts = ControllerParts(
        trainer=policy,
        engines=engines,
        env=CountingEnv(),
        codec=fake_codec(),
        value_trainer=critic,
    )

    async def go():
        controller = build_controller(cfg, parts, step_hooks=step_hooks)
        history = await asyncio.wait_for(controller.run(), timeout=60)
        return controller, history

    controller, history = asyncio.run(go())
    return SimpleNamespace(
        controller=controller,
        history=history,
        policy=policy,
        critic=critic,
        engine=engines[0],
        events=events,
    )


# --------------------------------------------------------------------------- advantage stage


def test_advantage_stage_matches_hand_computed_gae_and_whitens_valid_tokens_only() -> None:
    rows = [
        make_training_row([5, 6], [7, 8, 9], [0.0, 0.0, 0.0], reward=1.0, sample_mask=1.0),
        make_training_row([5, 6], [7, 8], [0.0, 0.0], reward=0.0, sample_mask=0.0),
    ]
    batch = collate_rows(rows, pad_token_id=0)
    values = torch.tensor([[0.9, 0.9, 0.5, 0.6, 0.7], [0.9, 0.9, 0.3, 0.4, 0.0]])
    advantage_stage(batch, values, gamma=1.0, lam=0.5, normalize=False)
    # Row 0, reward 1 on its last token (t=4), gamma 1, lambda 0.5:
    #   t4: delta = 1 - 0.7 = 0.3                    A = 0.3
    #   t3: delta = 0 + 0.7 - 0.6 = 0.1             A = 0.1 + 0.5 * 0.3 = 0.25
    #   t2: delta = 0 + 0.6 - 0.5 = 0.1             A = 0.1 + 0.5 * 0.25 = 0.225
    # Row 1, reward 0 on t=3: t3: A = -0.4; t2: delta = 0.4 - 0.3 = 0.1, A = 0.1 - 0.2 = -0.1
    expected_adv = torch.tensor([[0, 0, 0.225, 0.25, 0.3], [0, 0, -0.1, -0.4, 0]])
    torch.testing.assert_close(batch["advantages"], expected_adv)
    torch.testing.assert_close(batch["returns"], (expected_adv + values) * batch["token_mask"])
    torch.testing.assert_close(batch["values"], values * batch["token_mask"])

    batch = collate_rows(rows, pad_token_id=0)
    advantage_stage(batch, values, gamma=1.0, lam=0.5, normalize=True)
    valid = torch.tensor([0.225, 0.25, 0.3])  # row 1 has sample_mask 0: not in the statistics
    whitened = (valid - valid.mean()) / valid.var(unbiased=False).add(1e-8).sqrt()
    torch.testing.assert_close(batch["advantages"][0, 2:], whitened)
    assert torch.all(batch["advantages"][1] == 0)
    # Returns come from the raw advantages: whitening only rescales what the policy sees.
    torch.testing.assert_close(batch["returns"], (expected_adv + values) * batch["token_mask"])


# --------------------------------------------------------------------------- epochs per step


def test_each_step_runs_critic_and_policy_epochs_in_order() -> None:
    cfg = make_cfg("ppo.ppo_epochs=3", "ppo.critic_ppo_epochs=2", "ppo.max_num_steps=4")
    run = run_ppo(cfg)
    assert len(run.history) == 4
    assert run.critic.optimizer_steps == 4 * 2
    assert run.policy.optimizer_steps == 4 * 3
    assert run.engine.weight_updates == [1, 2, 3, 4]
    one_step = [
        "policy.offload_optimizer",
        "critic.get_values",
        "policy.get_logprobs",
        *["critic.begin", "critic.finish"] * 2,
        *["policy.begin", "policy.finish"] * 3,
    ]
    assert run.events == one_step * 4
    # Every policy epoch of a step trains the whole step with the same prev_logprobs.
    for step in range(4):
        epochs = run.policy.steps[3 * step : 3 * step + 3]
        assert all(len(epoch.chunks) == 1 for epoch in epochs)
        assert all(epoch.num_sequences == 8 for epoch in epochs)
        first = epochs[0].chunks[0]
        for epoch in epochs[1:]:
            torch.testing.assert_close(epoch.chunks[0]["prev_logprobs"], first["prev_logprobs"])
            torch.testing.assert_close(epoch.chunks[0]["advantages"], first["advantages"])
    assert all({"values", "returns"} <= set(batch) for batch in run.critic.trained_batches)
    assert all(row["train/policy_trained"] == 1.0 for row in run.history)
    assert all(row["train/critic_value_loss"] == 0.5 for row in run.history)


def test_epoch_counts_are_independent() -> None:
    run = run_ppo(make_cfg("ppo.ppo_epochs=1", "ppo.critic_ppo_epochs=3", "ppo.max_num_steps=2"))
    assert run.critic.optimizer_steps == 6
    assert run.policy.optimizer_steps == 2


# --------------------------------------------------------------------------- critic warm-up


def test_warmup_trains_only_the_critic_and_skips_refit_then_shrinks_lookahead() -> None:
    cfg = make_cfg(
        "ppo.policy_training_start_step=2",
        "ppo.max_num_steps=6",
        "ppo.ppo_epochs=2",
        "ppo.critic_ppo_epochs=1",
        "async_rl.sampler.max_lookahead_versions=1",
        "async_rl.sampler.warmup_lookahead_versions=3",
        "async_rl.max_buffered_rollouts=16",
        "async_rl.max_inflight_prompts=16",
    )
    lookahead_after_step: list[tuple[int, int]] = []

    async def record(controller, row):
        version = int(row["trainer_version"])
        lookahead_after_step.append((version, controller.sampler.lookahead_at(version)))

    run = run_ppo(cfg, train_seconds_per_step=0.02, step_hooks=[record])
    assert len(run.history) == 6
    assert [row["trainer_version"] for row in run.history] == [1, 2, 3, 4, 5, 6]
    assert [row["train/policy_trained"] for row in run.history] == [0, 0, 1, 1, 1, 1]
    assert run.critic.optimizer_steps == 6
    assert run.policy.optimizer_steps == 4 * 2
    # No refit after the two warm-up steps: the first weights engines see are version 3.
    assert run.engine.weight_updates == [3, 4, 5, 6]
    assert run.events.count("policy.get_logprobs") == 4
    # Warm-up window 3 while the trainer is below version 2, the steady 1 from then on.
    assert lookahead_after_step == [(1, 3), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)]
    groups = [group for _, group in run.controller.trained_groups]
    # The wider warm-up gate was used: version-0 dispatches reached target step 3.
    assert max(g.target_step - g.start_weight for g in groups if g.start_weight == 0) == 3
    # Once the warm-up is over, dispatch leads by at most max_lookahead_versions.
    assert all(g.target_step - g.start_weight <= 1 for g in groups if g.start_weight >= 2)
    assert all(g.staleness <= 3 for g in groups)


def test_warmup_without_warmup_lookahead_keeps_the_sampler_lookahead() -> None:
    cfg = make_cfg("ppo.policy_training_start_step=1", "ppo.max_num_steps=3")
    run = run_ppo(cfg)
    assert [run.controller.sampler.lookahead_at(version) for version in range(4)] == [1] * 4
    assert run.engine.weight_updates == [2, 3]
    assert run.policy.optimizer_steps == 2
    assert run.critic.optimizer_steps == 3


# --------------------------------------------------------------------------- warm start


def fake_step_dir(root: Path) -> Path:
    step = root / "step_7"
    (step / "value").mkdir(parents=True)
    (step / "value" / WORKER_STATE_FILE).write_text(json.dumps({"kind": "value"}))
    return step


def test_warm_start_on_a_fresh_run_and_not_on_resume(tmp_path: Path) -> None:
    step = fake_step_dir(tmp_path)
    cfg = make_cfg(f"ppo.warm_start_value_checkpoint={step}")
    critic = CountingCritic([])

    assert asyncio.run(warm_start_critic(critic, cfg, resuming=True)) is False
    assert critic.warm_started_from == []
    assert asyncio.run(warm_start_critic(critic, cfg, resuming=False)) is True
    # The value/ subfolder itself is accepted too.
    cfg_value = make_cfg(f"ppo.warm_start_value_checkpoint={step / 'value'}")
    assert asyncio.run(warm_start_critic(critic, cfg_value, resuming=False)) is True
    assert critic.warm_started_from == [step / "value", step / "value"]
    assert asyncio.run(warm_start_critic(critic, make_cfg(), resuming=False)) is False

    bad = make_cfg(f"ppo.warm_start_value_checkpoint={tmp_path / 'nowhere'}")
    with pytest.raises(WarmStartError, match=r"ppo\.warm_start_value_checkpoint"):
        asyncio.run(warm_start_critic(critic, bad, resuming=False))


def test_runner_warm_starts_once_at_version_zero_only(tmp_path: Path) -> None:
    step = fake_step_dir(tmp_path)
    cfg = make_cfg(f"ppo.warm_start_value_checkpoint={step}")

    async def begin_twice(version: int) -> CountingCritic:
        critic = CountingCritic([])
        runner = PPOStepRunner.from_config(cfg, CountingPolicy([]), critic, pad_token_id=0)
        await runner.begin(version=version)
        await runner.begin(version=version + 1)
        return critic

    assert asyncio.run(begin_twice(0)).warm_started_from == [step / "value"]
    # A trainer version above 0 comes from a restored checkpoint: it holds the critic.
    assert asyncio.run(begin_twice(4)).warm_started_from == []


def test_controller_run_warm_starts_the_critic(tmp_path: Path) -> None:
    step = fake_step_dir(tmp_path)
    run = run_ppo(make_cfg(f"ppo.warm_start_value_checkpoint={step}", "ppo.max_num_steps=2"))
    assert run.critic.warm_started_from == [step / "value"]


def test_warm_start_loads_real_critic_weights(tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tandemrl.config.models import ValueConfig, ValueLossConfig
    from tandemrl.training.value_worker import ValueWorker

    model_dir = tmp_path / "model"
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(model_dir)

    def worker(seed: int) -> ValueWorker:
        return ValueWorker(
            ValueConfig(), ValueLossConfig(), model_path=model_dir, seed=seed, device="cpu"
        )

    source, fresh = worker(seed=1), worker(seed=2)
    batch = collate_rows(
        [make_training_row([3, 4], [5, 6, 7], [0.0] * 3, reward=1.0, sample_mask=1.0)], 0
    )
    asyncio.run(
        source.save_checkpoint(tmp_path / "run_a" / "step_3" / "value", save_optimizer=True)
    )
    before = asyncio.run(fresh.get_values(batch))
    assert not torch.allclose(before, asyncio.run(source.get_values(batch)))

    cfg = make_cfg(f"ppo.warm_start_value_checkpoint={tmp_path / 'run_a' / 'step_3'}")
    assert asyncio.run(warm_start_critic(fresh, cfg, resuming=False)) is True
    torch.testing.assert_close(
        asyncio.run(fresh.get_values(batch)), asyncio.run(source.get_values(batch))
    )
    assert fresh.optimizer_steps == 0  # weights only: the optimizer starts fresh


# --------------------------------------------------------------------------- runner details


def fake_slots_and_rows(num_groups: int, group_size: int):
    slots, rows = [], {}
    for g in range(num_groups):
        ids = [f"g{g}-{i}" for i in range(group_size)]
        for i, sid in enumerate(ids):
            rows[sid] = make_training_row(
                [1, 2], [3, 4, 5], [-1.0, -1.0, -1.0], reward=float(i % 2), sample_mask=1.0
            )
        slots.append(SimpleNamespace(sample_ids=ids, start_weight=0, target_step=0))
    return slots, rows


def test_a_step_in_several_chunks_still_makes_one_update_per_epoch() -> None:
    cfg = make_cfg("ppo.ppo_epochs=2", "ppo.critic_ppo_epochs=2")
    events: list[str] = []
    policy, critic = CountingPolicy(events), CountingCritic(events)
    runner = make_step_runner(cfg, policy, pad_token_id=0, value_trainer=critic)
    slots, rows = fake_slots_and_rows(4, 2)

    async def step():
        await runner.begin(version=0)
        await runner.train_chunk(slots[:1], rows, step_num_sequences=8)
        await runner.train_chunk(slots[1:], rows, step_num_sequences=8)
        return await runner.finish()

    metrics = asyncio.run(step())
    assert critic.optimizer_steps == 2 and policy.optimizer_steps == 2
    # Each epoch trains every chunk (2 rows, then 6) into one optimizer step.
    assert [b["input_ids"].shape[0] for b in critic.trained_batches] == [2, 6, 2, 6]
    assert all(len(s.chunks) == 2 and s.num_sequences == 8 for s in policy.steps)
    # The value stage and the critic's first epoch ran per chunk, as the chunks came.
    assert events[:6] == [
        "policy.offload_optimizer",
        "critic.get_values",
        "policy.get_logprobs",
        "critic.begin",
        "critic.get_values",
        "policy.get_logprobs",
    ]
    assert metrics["num_chunks"] == 2.0 and metrics["step_rows"] == 8.0
    assert runner.refit_after_step() is True
    assert metrics["policy_trained"] == 1.0 and "critic_value_loss" in metrics


def test_runner_exposes_the_critic_and_requires_one() -> None:
    cfg = make_cfg()
    critic = CountingCritic([])
    runner = make_step_runner(cfg, CountingPolicy([]), pad_token_id=0, value_trainer=critic)
    assert runner.value_trainer is critic
    with pytest.raises(ValueError, match="value_trainer"):
        make_step_runner(cfg, CountingPolicy([]), pad_token_id=0)


def test_no_offload_calls_when_the_flag_is_off() -> None:
    settings = PPOSettings.from_config(make_cfg())
    settings = PPOSettings(**{**settings.__dict__, "offload_optimizer": False})
    events: list[str] = []
    runner = PPOStepRunner(
        CountingPolicy(events), CountingCritic(events), settings=settings, pad_token_id=0
    )
    slots, rows = fake_slots_and_rows(4, 2)

    async def step():
        await runner.begin(version=0)
        await runner.train_chunk(slots, rows, step_num_sequences=8)
        await runner.finish()

    asyncio.run(step())
    assert "policy.offload_optimizer" not in events
    assert events[0] == "critic.get_values"


# --------------------------------------------------------------------------- real workers


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2-ppo")
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
        ),
    ],
)
def test_one_step_with_real_workers_offloads_and_counts_optimizer_steps(
    tiny_model_dir: Path, device: str
) -> None:
    from tandemrl.training.policy_worker import PolicyWorker
    from tandemrl.training.value_worker import ValueWorker

    cfg = make_cfg(
        f"policy.model_name={tiny_model_dir}",
        f"policy.device={device}",
        "ppo.ppo_epochs=3",
        "ppo.critic_ppo_epochs=2",
        "policy.generation.temperature=1.0",
    )
    policy = PolicyWorker(cfg.policy, cfg.loss_fn, seed=0)
    critic = ValueWorker(cfg.value, cfg.value_loss_fn, model_path=tiny_model_dir, device=device)
    runner = PPOStepRunner.from_config(cfg, policy, critic, pad_token_id=0)
    slots, rows = fake_slots_and_rows(4, 2)
    critic_before = [p.detach().cpu().clone() for p in critic.head.parameters()]

    async def step():
        await runner.begin(version=0)
        await runner.train_chunk(slots, rows, step_num_sequences=8)
        return await runner.finish()

    metrics = asyncio.run(step())
    assert policy.optimizer_steps == 3
    assert critic.optimizer_steps == 2
    assert metrics["optimizer_steps"] == 3 and metrics["critic_optimizer_steps"] == 2
    # Off before the critic, back for the first update (on CPU only recorded, nothing moves).
    assert policy.state()["optimizer_transitions"] == ["offload", "reload"]
    assert policy.optimizer_location == "device"
    # Later epochs move the policy away from prev_logprobs: the ratio is no longer exactly 1.
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-7)
    assert any(
        not torch.equal(before, after.detach().cpu())
        for before, after in zip(critic_before, critic.head.parameters(), strict=True)
    )
    assert runner.value_trainer is critic


def test_placement_gives_the_critic_half_the_trainer_share() -> None:
    from tandemrl.controller.setup import plan_placement

    cpu = plan_placement(make_cfg(), cluster_cpus=2, cluster_gpus=0)
    assert (cpu.generation_cpus, cpu.trainer_cpus, cpu.value_cpus) == (1.0, 0.5, 0.5)
    gpu = plan_placement(
        make_cfg("policy.device=cuda", "policy.generation.colocated.resources.gpus_per_node=1"),
        cluster_cpus=16,
        cluster_gpus=2,
    )
    assert (gpu.generation_gpus, gpu.trainer_gpus, gpu.value_gpus) == (1.0, 0.5, 0.5)
    grpo = plan_placement(
        load_config("examples/configs/grpo_tiny_cpu.yaml"), cluster_cpus=2, cluster_gpus=0
    )
    assert (grpo.trainer_cpus, grpo.value_cpus) == (1.0, 0.0)


def test_reuse_training_logprobs_skips_get_logprobs_with_one_epoch_only() -> None:
    events: list[str] = []
    policy = CountingPolicy(events)
    runner = make_step_runner(
        make_cfg("loss_fn.reuse_training_logprobs=true"),
        policy,
        pad_token_id=0,
        value_trainer=CountingCritic(events),
    )
    slots, rows = fake_slots_and_rows(4, 2)

    async def step():
        await runner.begin(version=0)
        await runner.train_chunk(slots, rows, step_num_sequences=8)
        await runner.finish()

    asyncio.run(step())
    assert "policy.get_logprobs" not in events and "critic.get_values" in events
    assert "prev_logprobs" not in policy.steps[0].chunks[0]  # the training forward supplies it
    settings = PPOSettings.from_config(make_cfg("loss_fn.reuse_training_logprobs=true"))
    settings = PPOSettings(**{**settings.__dict__, "ppo_epochs": 2})
    with pytest.raises(ValueError, match=r"loss_fn\.reuse_training_logprobs"):
        PPOStepRunner(CountingPolicy([]), CountingCritic([]), settings=settings, pad_token_id=0)
