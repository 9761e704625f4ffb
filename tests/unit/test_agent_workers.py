"""Agents in worker processes (env.agent.workers): the same rows reach the trainer, failures
keep their class across the process boundary, and a worker that dies is an infrastructure
failure its episodes are retried from."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path

import pytest
from agent_helpers import (
    ScriptedEngine,
    agent_controller,
    chat_tokenizer,
    counting_answers,
    run_controller,
    small_agent_config,
)
from test_agent_rollouts import batch_rows, expected_row

from tandemrl.agents import AgentInfraFailure, create_agent
from tandemrl.agents.workers import AgentWorkerPool
from tandemrl.config import load_and_validate
from tandemrl.config.errors import ConfigError
from tandemrl.records import PromptItem
from tandemrl.rollout.failures import FailureKind

HERE = Path(__file__).parent
EXEMPLAR = HERE.parents[1] / "examples" / "configs" / "grpo_tiny_cpu_agent.yaml"


def worker_config(target: str, *overrides: str, steps: int = 2):
    return small_agent_config(
        "policy.generation.http_server.enabled=true",
        "env.agent.client=http",
        f"env.target=agent_worker_agents:{target}",
        f"env.python_path=[{HERE}]",
        *overrides,
        steps=steps,
    )


def test_episodes_in_two_workers_train_on_the_sampled_tokens(ray_session, tmp_path):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    log = tmp_path / "players"
    cfg = worker_config("Player", "env.agent.workers=2", f"env.kwargs={{log: {log}}}")
    controller, trainer = agent_controller(cfg, create_agent(cfg.env), engine, tokenizer)
    history = run_controller(controller, timeout=120)
    assert len(history) == 2
    by_episode: dict[str, list] = {}
    for result in engine.results:
        by_episode.setdefault(result.request_id.rsplit("/", 1)[0], []).append(result)
    finished = [turns for turns in by_episode.values() if len(turns) == 2]
    expected = Counter(expected_row(turns) for turns in finished)
    trained = Counter(batch_rows(trainer))
    assert sum(trained.values()) == 8
    assert all(count == 1 and row in expected for row, count in trained.items())
    assert history[-1]["reward_mean"] == 1.0
    # Played in both workers, neither of them this process.
    pids = set(log.read_text().split())
    assert len(pids) == 2 and str(os.getpid()) not in pids


def test_failures_in_a_worker_keep_their_class(ray_session):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    cfg = worker_config(
        "Troublesome",
        "env.agent.workers=1",
        "env.kwargs={}",
        "env.agent.episode_timeout_s=1",
        "async_rl.rollout_failure.max_data_retries=1",
        "async_rl.rollout_failure.max_infra_retries=1",
        "async_rl.rollout_failure.backoff_initial_s=0",
        steps=3,
    )
    controller, trainer = agent_controller(cfg, create_agent(cfg.env), engine, tokenizer, count=6)
    history = run_controller(controller, timeout=120)
    assert len(history) == 3 and len(trainer.steps) == 3  # every prompt trained in the end
    failures = controller.run_state.budgets.failures
    kinds = {(f.prompt_id, f.kind) for f in failures}
    assert kinds == {
        ("e0-i0", FailureKind.DATA),  # raised
        ("e0-i1", FailureKind.DATA),  # hung past episode_timeout_s
        ("e0-i2", FailureKind.DATA),  # malformed result
        ("e0-i3", FailureKind.INFRA),  # AgentInfraFailure
        ("e0-i4", FailureKind.DATA),  # a 400 it let propagate
    }
    text = " ".join(f.cause for f in failures)
    assert "agent raised RuntimeError: the agent's parser broke (agent worker 0)" in text
    assert "episode_timeout_s=1" in text and "not an AgentResult" in text
    assert "the sandbox is down (agent worker 0)" in text
    assert "agent raised BadRequestError" in text and "'not-the-policy' is not served here" in text
    assert controller.run_state.budgets.skipped_prompts == 0


def test_a_worker_that_dies_fails_its_episodes_as_infrastructure_and_comes_back(
    ray_session, tmp_path
):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    marker = tmp_path / "died"
    cfg = worker_config(
        "DiesOnce",
        "env.agent.workers=1",
        f"env.kwargs={{marker: {marker}}}",
        "async_rl.rollout_failure.max_infra_retries=2",
        "async_rl.rollout_failure.backoff_initial_s=0",
        steps=2,
    )
    controller, _ = agent_controller(cfg, create_agent(cfg.env), engine, tokenizer)
    history = run_controller(controller, timeout=120)
    assert marker.read_text() == "died"
    assert len(history) == 2 and history[-1]["reward_mean"] == 1.0
    failures = controller.run_state.budgets.failures
    assert failures and {f.kind for f in failures} == {FailureKind.INFRA}
    assert "e0-i1" in {f.prompt_id for f in failures}
    assert all("agent worker 0 died under the episode" in f.cause for f in failures)
    assert controller.run_state.budgets.skipped_prompts == 0


def test_a_groups_siblings_play_together_and_one_cancelled_lets_the_others_answer(ray_session):
    env = worker_config("Paced", "env.agent.workers=2", "env.kwargs={}").env
    pool = AgentWorkerPool(env, 2, num_cpus=0, same_node=False)
    first, second = (PromptItem(f"e0-i{i}", 0, i, "583=") for i in range(2))

    async def go():
        await pool.start("http://127.0.0.1:9/v1")  # Paced never calls the policy
        try:
            started = time.monotonic()
            plays = {
                key: asyncio.ensure_future(pool.run(item, key))
                for item, key in [
                    (first, "a0"),
                    (first, "a1"),
                    (first, "hang-a2"),
                    (second, "b0"),
                    (second, "b1"),
                ]
            }
            await asyncio.sleep(1.0)
            # The second group has answered; the first waits for its hung sibling.
            done_before = sorted(key for key, play in plays.items() if play.done())
            plays["hang-a2"].cancel()  # as its deadline would
            outcomes = await asyncio.gather(*plays.values(), return_exceptions=True)
            elapsed = time.monotonic() - started
            in_flight = list(pool.in_flight)
            # A whole group cancelled while it plays: the workers let it go.
            group = [asyncio.ensure_future(pool.run(second, f"hang-b{i}")) for i in range(3)]
            await asyncio.sleep(0.5)
            for task in group:
                task.cancel()
            await asyncio.gather(*group, return_exceptions=True)
            await asyncio.sleep(0.5)  # the cancels reach the worker
            after_cancel = list(pool.in_flight)
            again = await asyncio.wait_for(pool.run(second, "b2"), timeout=30)
        finally:
            await pool.stop()
        return done_before, outcomes, elapsed, in_flight, after_cancel, again

    done_before, outcomes, elapsed, in_flight, after_cancel, again = asyncio.run(go())
    a0, a1, hung, b0, b1 = outcomes
    assert done_before == ["b0", "b1"]
    assert isinstance(hung, asyncio.CancelledError)
    # The first group answered once its hung sibling was cancelled in the worker, not after
    # the agent's minute.
    assert elapsed < 30
    assert [r.metadata["key"] for r in (a0, a1, b0, b1)] == ["a0", "a1", "b0", "b1"]
    # Each group played in one worker, the two groups in different ones.
    assert a0.metadata["pid"] == a1.metadata["pid"] != b0.metadata["pid"] == b1.metadata["pid"]
    assert os.getpid() not in {a0.metadata["pid"], b0.metadata["pid"]}
    assert in_flight == after_cancel == [0, 0]
    assert again.metadata["key"] == "b2"


def test_stopping_the_pool_fails_its_episodes_in_flight_instead_of_hanging(ray_session):
    env = worker_config("Paced", "env.agent.workers=1", "env.kwargs={}").env
    pool = AgentWorkerPool(env, 1, num_cpus=0, same_node=False)
    item = PromptItem("e0-i0", 0, 0, "583=")

    async def go():
        await pool.start("http://127.0.0.1:9/v1")
        playing = asyncio.ensure_future(pool.run(item, "hang-0"))
        await asyncio.sleep(0.5)
        await pool.stop()
        return await asyncio.wait_for(asyncio.gather(playing, return_exceptions=True), 30)

    [outcome] = asyncio.run(go())
    assert isinstance(outcome, AgentInfraFailure) and "agent worker 0" in str(outcome)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("env.agent.workers=2",), "env.agent.workers: 2"),
        (
            (
                "env.agent.workers=2",
                "policy.generation.http_server.enabled=true",
                "env.agent.client=in_process",
            ),
            "env.agent.workers: 2",
        ),
    ],
)
def test_workers_without_the_endpoint_are_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_and_validate(EXEMPLAR, ("policy.generation.http_server.enabled=false", *overrides))
