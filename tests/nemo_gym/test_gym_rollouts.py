"""GRPO steps whose episodes NeMo-Gym's real servers play (simple_agent, vllm_model, our
tandemrl_counting resources server), driven by the controller in this process over a scripted
engine and a recording trainer: what reaches the trainer is exactly what the engine sampled,
the reward is what Gym's /verify answered, and a Gym server killed mid-episode is a retried
infrastructure failure after which the run goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
from agent_helpers import ScriptedEngine, chat_tokenizer, codec_for, end_id
from conftest import AGENT, EXEMPLAR, GymServers

from tandemrl.agents import create_run_agent
from tandemrl.config.loader import load_config
from tandemrl.config.models import MasterConfig
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import load_prompt_records
from tandemrl.records import GenerationRequest
from tandemrl.rollout.failures import FailureKind
from tandemrl.training.fake import FakeTrainer

PROMPTS_PER_STEP = 2
GENERATIONS = 4


def gym_config(gym: GymServers, tmp_path, *overrides: str, steps: int = 3) -> MasterConfig:
    return load_config(
        EXEMPLAR,
        (
            *gym.connect_overrides(),
            f"grpo.num_prompts_per_step={PROMPTS_PER_STEP}",
            f"grpo.num_generations_per_prompt={GENERATIONS}",
            f"policy.train_global_batch_size={PROMPTS_PER_STEP * GENERATIONS}",
            f"policy.train_micro_batch_size={PROMPTS_PER_STEP * GENERATIONS}",
            f"grpo.max_num_steps={steps}",
            f"async_rl.min_groups_for_streaming_train={PROMPTS_PER_STEP}",
            f"async_rl.max_buffered_rollouts={2 * PROMPTS_PER_STEP}",
            f"async_rl.max_inflight_prompts={2 * PROMPTS_PER_STEP}",
            f"logger.log_dir={tmp_path}",
            *overrides,
        ),
    )


def counting_player(tokenizer):
    """Continues the count from the digit before the last '=' of the rendered prompt, right in
    the first digit and in the others only for even seeds: rewards differ within a group."""
    end = end_id(tokenizer)

    def answer(request: GenerationRequest) -> list[int]:
        text = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)
        digit = int(text[: text.rindex("=")][-1])
        right = (request.seed or 0) % 2 == 0
        reply = "".join(str((digit + k) % 10 if right or k == 1 else 0) for k in range(1, 4))
        return [*tokenizer.encode(reply, add_special_tokens=False), end]

    return answer


def build(cfg: MasterConfig, engine, tokenizer, trainer):
    records = load_prompt_records(cfg.data, gym_rows=True)[:16]
    parts = ControllerParts(
        trainer=trainer,
        engines=[engine],
        env=None,
        codec=codec_for(tokenizer),
        dataloader=PromptDataLoader(records, max_num_epochs=1, seed=0, shuffle=False),
        agent=create_run_agent(cfg),
        tokenizer=tokenizer,
    )
    return build_controller(cfg, parts)


def trained_rows(trainer: FakeTrainer) -> list[tuple[list[int], list[float], list[float]]]:
    """Per trained row: its real token ids, loss mask and generation logprobs."""
    rows = []
    for step in trainer.steps:
        for batch in step.chunks:
            for index in range(batch["input_ids"].shape[0]):
                length = int(batch["attention_mask"][index].sum())
                rows.append(
                    (
                        batch["input_ids"][index, :length].tolist(),
                        batch["token_mask"][index, :length].tolist(),
                        batch["generation_logprobs"][index, :length].tolist(),
                    )
                )
    return rows


def test_gym_episodes_train_on_exactly_the_tokens_the_engine_sampled(gym: GymServers, tmp_path):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_player(tokenizer))
    trainer = FakeTrainer()
    cfg = gym_config(gym, tmp_path)
    controller = build(cfg, engine, tokenizer, trainer)
    history = asyncio.run(asyncio.wait_for(controller.run(), timeout=180))

    assert len(history) == 3
    rows = trained_rows(trainer)
    assert len(rows) == 3 * PROMPTS_PER_STEP * GENERATIONS
    unmatched = list(engine.results)
    for token_ids, mask, logprobs in rows:
        # every trained row is one engine call, token for token and logprob for logprob: Gym's
        # model server sent chat messages, the endpoint rendered them and captured the turn,
        # nothing was re-tokenised on the way back
        match = next(
            result
            for result in unmatched
            if [*result.prompt_token_ids, *result.token_ids] == token_ids
            and all(
                abs(got - want) < 1e-6
                for got, want in zip(
                    logprobs[len(result.prompt_token_ids) :], result.logprobs, strict=True
                )
            )
        )
        unmatched.remove(match)
        prompt_length = len(match.prompt_token_ids)
        assert mask == [0.0] * prompt_length + [1.0] * len(match.token_ids)
    # the reward is the resources server's: the right first digit scores 1/3, all three 1
    assert all(0.3 < step["reward_mean"] < 1.0 for step in history), history
    assert controller.run_state.budgets.failures == []


def _agent_server_process(gym: GymServers) -> psutil.Process:
    """The Python process serving the Gym agent (a child of the launcher's shell)."""
    port = gym.topology.agent(AGENT).port
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
            return psutil.Process(connection.pid)
    raise AssertionError(f"nothing listens on the agent server's port {port}")


def test_a_gym_agent_server_killed_mid_episode_is_a_retried_infrastructure_failure(
    gym: GymServers, tmp_path
):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_player(tokenizer))
    engine.latency_s = 0.3  # episodes are in flight when the kill comes
    trainer = FakeTrainer()
    cfg = gym_config(
        gym,
        tmp_path,
        "async_rl.rollout_failure.max_infra_retries=8",
        "async_rl.rollout_failure.backoff_initial_s=0.5",
        "async_rl.rollout_failure.backoff_max_s=4",
        steps=3,
    )
    controller = build(cfg, engine, tokenizer, trainer)
    victim = _agent_server_process(gym)

    async def run_and_kill() -> list[dict[str, float]]:
        run = asyncio.create_task(controller.run())
        while len(engine.results) < 3:  # the first episodes are inside Gym
            await asyncio.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        return await asyncio.wait_for(run, timeout=240)

    started = time.monotonic()
    history = asyncio.run(run_and_kill())

    assert len(history) == 3, history  # the run went on to its last step
    failures = controller.run_state.budgets.failures
    infra = [failure for failure in failures if failure.kind is FailureKind.INFRA]
    assert infra, failures
    assert any(f"Gym agent server {AGENT}" in failure.cause for failure in infra), infra
    assert all(failure.kind is FailureKind.INFRA for failure in failures), failures
    assert controller.run_state.budgets.dropped == []
    # the launcher started the agent server again, on the same port
    assert _agent_server_process(gym).pid != victim.pid
    assert time.monotonic() - started < 240
