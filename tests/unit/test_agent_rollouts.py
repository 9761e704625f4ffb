"""Agent runs through the controller (fake trainer, scripted engine): what reaches the trainer,
prefix splits, failures by class, limits, and the recovery state of finished episodes."""

from __future__ import annotations

import asyncio
from collections import Counter

import openai
import pytest
from agent_helpers import (
    ScriptedEngine,
    agent_controller,
    chat_tokenizer,
    counting_answers,
    run_controller,
    small_agent_config,
)

from tandemrl.agents import Agent, AgentInfraFailure, AgentResult
from tandemrl.agents.counting_game import CountingGameAgent
from tandemrl.config.models import RolloutRecoveryConfig
from tandemrl.records import PromptItem
from tandemrl.rollout.failures import FailureKind, RolloutDropped
from tandemrl.rollout.ledger import OwnershipLedger, resolve_granularity


def batch_rows(trainer):
    """Every trained row as (input ids, token mask, logprobs), padding cut off."""
    rows = []
    for step in trainer.steps:
        for chunk in step.chunks:
            for index in range(chunk["input_ids"].shape[0]):
                length = int(chunk["attention_mask"][index].sum())
                rows.append(
                    (
                        tuple(chunk["input_ids"][index, :length].tolist()),
                        tuple(chunk["token_mask"][index, :length].tolist()),
                        tuple(
                            round(x, 5)
                            for x in chunk["generation_logprobs"][index, :length].tolist()
                        ),
                    )
                )
    return rows


def expected_row(turns):
    """Turns merged by prefix: the last prompt + its tokens, mask 1 exactly where sampled."""
    ids, mask, logprobs = [], [], []
    for turn in turns:
        new = turn.prompt_token_ids[len(ids) :]
        assert turn.prompt_token_ids[: len(ids)] == ids  # the prefix holds
        ids += new + turn.token_ids
        mask += [0.0] * len(new) + [1.0] * len(turn.token_ids)
        logprobs += [0.0] * len(new) + turn.logprobs
    return tuple(ids), tuple(mask), tuple(round(x, 5) for x in logprobs)


@pytest.mark.parametrize("client", ["http", "in_process"])
def test_the_trainer_trains_on_the_engines_sampled_tokens_turn_by_turn(client):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    cfg = small_agent_config(f"env.agent.client={client}")
    controller, trainer = agent_controller(cfg, CountingGameAgent(), engine, tokenizer)
    history = run_controller(controller)
    assert len(history) == 2
    by_episode: dict[str, list] = {}
    for result in engine.results:
        by_episode.setdefault(result.request_id.rsplit("/", 1)[0], []).append(result)
    # The rollout pump may have run further than the trainer: episodes still in their first
    # turn when the run stopped (seen on a fast GPU machine) are never trained.
    assert all(len(turns) <= 2 for turns in by_episode.values())
    finished = [turns for turns in by_episode.values() if len(turns) == 2]
    assert len(finished) >= 8
    expected = Counter(expected_row(turns) for turns in finished)
    trained = Counter(batch_rows(trainer))
    # 8 trained episodes, each one row: the prompt, both sampled turns (mask 1, their
    # logprobs) and the environment's reply between (mask 0).
    assert sum(trained.values()) == 8
    assert all(count == 1 and row in expected for row, count in trained.items())
    assert history[-1]["reward_mean"] == 1.0  # the scripted player counts right
    assert history[-1]["agent/prefix_split_frac"] == 0.0
    assert history[-1]["agent/turns_mean"] == 2.0


def test_version_stamps_of_an_episode_span_its_turns():
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    original = engine.generate

    async def generate(requests):  # new weights arrive between every episode's two turns
        if requests[0].request_id.endswith("/t1"):
            engine.version = 7
        return await original(requests)

    engine.generate = generate
    cfg = small_agent_config(steps=1)
    controller, _ = agent_controller(cfg, CountingGameAgent(), engine, tokenizer)
    rows = []
    original_commit = controller.buffer.commit

    def commit(group_id, metas, end_weight):
        rows.extend(metas)
        return original_commit(group_id, metas, end_weight)

    controller.buffer.commit = commit
    run_controller(controller)
    assert rows and all(
        (row.start_weight_version, row.end_weight_version) == (0, 7) for row in rows[:2]
    )


class DropsEarlierReplies(Agent):
    """A counting player whose follow-up re-sends turn 1 differently from what was sampled."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def run(self, item: PromptItem, client) -> AgentResult:
        messages = [{"role": "user", "content": item.prompt}]
        first = await client.chat.completions.create(model="policy", messages=messages)
        content = first.choices[0].message.content
        if self.how == "template":
            content = "<think>" + content  # stripped by the template below
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "6="}]
        await client.chat.completions.create(model="policy", messages=messages)
        return AgentResult(reward=1.0 if item.prompt.startswith("0") else 0.0)


@pytest.mark.parametrize("how", ["tokenizer", "template"])
def test_a_broken_prefix_splits_the_episode_into_rows_of_the_sampled_ids(how):
    if how == "tokenizer":
        # "45" (and every other pair of consecutive digits) is one token of this tokenizer:
        # re-encoding the sampled "4", "5", "6" gives "45", "6" — the ids drift.
        tokenizer = chat_tokenizer(extra=tuple(f"{d}{(d + 1) % 10}" for d in range(10)))
    else:
        # A template that drops earlier assistant turns' reasoning (everything in them).
        tokenizer = chat_tokenizer(
            template=(
                "{%- for m in messages %}"
                "{%- if m['role'] == 'assistant' and m['content'].startswith('<think>') %}"
                "{{- '<|assistant|>' + eos_token }}"
                "{%- else %}{{- '<|' + m['role'] + '|>' + m['content'] + eos_token }}{%- endif %}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
            )
        )
    engine = ScriptedEngine(counting_answers(chat_tokenizer()))
    cfg = small_agent_config("env.agent.client=in_process", steps=1)
    controller, trainer = agent_controller(cfg, DropsEarlierReplies(how), engine, tokenizer)
    history = run_controller(controller)
    assert history[-1]["agent/prefix_split_frac"] == 1.0
    trained = Counter(batch_rows(trainer))
    expected = Counter(expected_row([result]) for result in engine.results)
    # One row per turn, each exactly as the engine saw and sampled it.
    assert sum(trained.values()) == 8
    assert all(row in expected for row in trained)
    if how == "tokenizer":
        # The follow-up prompts hold the re-encoded pairs; no trained loss token is one.
        pairs = set(tokenizer.convert_tokens_to_ids([f"{d}{(d + 1) % 10}" for d in range(10)]))
        second_turns = [r for r in engine.results if r.request_id.endswith("/t1")]
        assert all(pairs & set(r.prompt_token_ids) for r in second_turns)
        for ids, mask, _ in trained:
            assert not pairs & {token for token, m in zip(ids, mask, strict=True) if m}

    # on_prefix_mismatch: error fails such an episode as a data failure of its sibling.
    engine = ScriptedEngine(counting_answers(chat_tokenizer()))
    cfg = small_agent_config(
        "env.agent.client=in_process",
        "token_capture.on_prefix_mismatch=error",
        "async_rl.rollout_failure.max_data_retries=0",
        steps=1,
    )
    controller, trainer = agent_controller(cfg, DropsEarlierReplies(how), engine, tokenizer)
    manager = controller.rollout_manager
    group = manager.reserve(PromptItem("e0-i3", 0, 3, "33="), start_weight=0, target_step=0)
    with pytest.raises(RolloutDropped, match="on_prefix_mismatch: error"):
        asyncio.run(manager._run_all_episodes(group, manager.agents))
    failures = controller.run_state.budgets.failures
    assert failures and all(f.kind is FailureKind.DATA for f in failures)


class Troublesome(Agent):
    """Each prompt's first two episodes fail in their own way, then it plays correctly."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.runs: Counter[str] = Counter()
        self.player = CountingGameAgent()

    async def run(self, item: PromptItem, client) -> AgentResult:
        self.runs[item.prompt_id] += 1
        if self.runs[item.prompt_id] <= 2:
            trouble = ["raise", "hang", "malformed", "tool down", "endpoint down"][item.index % 5]
            if trouble == "raise":
                raise RuntimeError("the agent's parser broke")
            if trouble == "hang":
                await asyncio.sleep(60)  # a tool that never answers
            if trouble == "malformed":
                return {"reward": 1.0}  # type: ignore[return-value]
            if trouble == "tool down":
                raise AgentInfraFailure("the sandbox is down")
            lost = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{self.port}/v1", api_key="k", max_retries=0
            )
            await lost.chat.completions.create(model="policy", messages=[])
        return await self.player.run(item, client)


def test_failures_are_charged_by_class_and_the_run_goes_on():
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: the endpoint is unreachable
    cfg = small_agent_config(
        "env.agent.episode_timeout_s=0.5",
        "async_rl.rollout_failure.max_data_retries=1",
        "async_rl.rollout_failure.max_infra_retries=1",
        "async_rl.rollout_failure.backoff_initial_s=0",
        steps=3,
    )
    agent = Troublesome(port)
    controller, trainer = agent_controller(cfg, agent, engine, tokenizer, count=6)
    history = run_controller(controller)
    assert len(history) == 3 and len(trainer.steps) == 3  # every prompt trained in the end
    causes = {
        (f.prompt_id, f.kind, f.cause.split(":")[0]) for f in controller.run_state.budgets.failures
    }
    kinds = {prompt: kind for prompt, kind, _ in causes}
    assert kinds["e0-i0"] is FailureKind.DATA  # raised
    assert kinds["e0-i1"] is FailureKind.DATA  # hung past episode_timeout_s
    assert kinds["e0-i2"] is FailureKind.DATA  # malformed result
    assert kinds["e0-i3"] is FailureKind.INFRA  # AgentInfraFailure
    assert kinds["e0-i4"] is FailureKind.INFRA  # endpoint unreachable
    text = " ".join(f.cause for f in controller.run_state.budgets.failures)
    assert "episode_timeout_s=0.5" in text and "not an AgentResult" in text
    assert "unreachable" in text and "the sandbox is down" in text
    assert controller.run_state.budgets.skipped_prompts == 0


def test_an_engine_failure_under_a_call_is_an_infrastructure_failure_of_the_episode():
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    engine.fail = lambda request: (
        "/a1/" in request.request_id and request.request_id.startswith("e0-i0/")
    )

    class SwallowsErrors(Agent):  # catches the 503 and returns a reward anyway
        async def run(self, item, client):
            try:
                return await CountingGameAgent().run(item, client)
            except openai.APIStatusError:
                return AgentResult(reward=0.5)

    cfg = small_agent_config(
        "async_rl.rollout_failure.max_infra_retries=1",
        "async_rl.rollout_failure.backoff_initial_s=0",
        steps=1,
    )
    controller, _ = agent_controller(cfg, SwallowsErrors(), engine, tokenizer)
    history = run_controller(controller)
    failures = controller.run_state.budgets.failures
    assert [f.kind for f in failures] == [FailureKind.INFRA]
    assert "scripted failure" in failures[0].cause
    assert history[-1]["reward_mean"] == 1.0  # the retried episodes played for real


class Greedy(Agent):
    """Calls until the endpoint refuses, and lets the refusal propagate."""

    async def run(self, item, client):
        messages = [{"role": "user", "content": item.prompt}]
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "1="},
            ]


@pytest.mark.parametrize(
    ("overrides", "limit"),
    [
        (("env.agent.max_turns=3",), "max_turns"),
        (("policy.max_total_sequence_length=24",), "context"),
        (("env.agent.max_tokens_per_episode=6",), "max_tokens_per_episode"),
    ],
)
def test_a_limit_ends_the_episode_truncated_without_failing_it(overrides, limit):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    cfg = small_agent_config("env.agent.client=in_process", *overrides, steps=1)
    controller, trainer = agent_controller(cfg, Greedy(), engine, tokenizer)
    history = run_controller(controller)
    assert controller.run_state.budgets.failures == []
    assert history[-1]["agent/truncated_frac"] == 1.0
    assert history[-1]["reward_mean"] == 0.0
    rows = batch_rows(trainer)
    assert len(rows) == 4 and all(
        len(ids) <= cfg.policy.max_total_sequence_length for ids, _, _ in rows
    )
    episodes = {r.request_id.rsplit("/", 1)[0] for r in engine.results}
    calls = Counter(r.request_id.rsplit("/", 1)[0] for r in engine.results)
    if limit == "max_turns":
        assert set(calls.values()) == {3}
    if limit == "max_tokens_per_episode":
        assert all(
            sum(len(r.token_ids) for r in engine.results if r.request_id.startswith(e)) == 6
            for e in episodes
        )


def test_finished_episodes_survive_the_ledger_state_and_agent_refs_pick_the_granularity():
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    cfg = small_agent_config("env.agent.client=in_process", steps=1)
    controller, _ = agent_controller(cfg, CountingGameAgent(), engine, tokenizer)
    manager = controller.rollout_manager
    item = PromptItem("e0-i0", 0, 0, "58=")
    group = manager.reserve(item, start_weight=0, target_step=0)
    asyncio.run(manager._run_all_episodes(group, manager.agents))
    ledger = controller.run_state.ledger
    restored = OwnershipLedger.groups_from_state(ledger.state_dict())[0]
    assert restored.staged.keys() == group.staged.keys() == {0, 1}
    for sibling in (0, 1):
        assert restored.staged[sibling].episode == group.staged[sibling].episode
        assert restored.staged[sibling].env_result == group.staged[sibling].env_result
    assert len(restored.staged[0].episode.turns) == 2
    # The rows rebuilt from the restored episodes are the rows of the live ones.
    live_block, live_metas = manager._rows(group)
    block, metas = manager._rows(restored)
    assert metas == live_metas
    assert block.fields["input_ids"].tolist() == live_block.fields["input_ids"].tolist()

    recovery = RolloutRecoveryConfig(
        agent_granularity_overrides={"pkg.mod:Agent": "prompt_group"},
        task_source_granularity_overrides={"math": "prompt_group"},
    )
    plain = PromptItem("p", 0, 0, "1=")
    assert resolve_granularity(plain, recovery) == "sibling"
    assert resolve_granularity(plain, recovery, default_agent_ref="pkg.mod:Agent") == "prompt_group"
    other_agent = PromptItem("p", 0, 0, "1=", agent_ref="pkg.mod:Other")
    assert (
        resolve_granularity(other_agent, recovery, default_agent_ref="pkg.mod:Agent") == "sibling"
    )
    by_source = PromptItem("p", 0, 0, "1=", task_source="math")
    assert resolve_granularity(by_source, recovery, default_agent_ref="x:Y") == "prompt_group"


class SlowTool(Agent):
    """Waits on a slow tool (0.6 s), during which the engine stands down for ``frozen_s``."""

    def __init__(self, engine: ScriptedEngine, frozen_s: float) -> None:
        self.engine = engine
        self.frozen_s = frozen_s

    async def run(self, item, client):
        await asyncio.sleep(0.05)
        if self.frozen_s and not self.engine.frozen:  # one stand-down, seen by both episodes
            self.engine.frozen = self.frozen_s  # the clocks stop while the engine is asleep
        await asyncio.sleep(0.55)
        return await CountingGameAgent().run(item, client)


@pytest.mark.parametrize("frozen_s", [0.0, 1.0])
def test_the_episode_deadline_counts_awake_time_only(frozen_s):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    cfg = small_agent_config(
        "env.agent.client=in_process",
        "env.agent.episode_timeout_s=0.4",
        "async_rl.rollout_failure.max_data_retries=0",
        steps=1,
    )
    controller, _ = agent_controller(cfg, SlowTool(engine, frozen_s), engine, tokenizer)
    manager = controller.rollout_manager
    group = manager.reserve(PromptItem("e0-i0", 0, 0, "58="), start_weight=0, target_step=0)
    if frozen_s:  # 0.6 s of wall time, 1 s of it stood down: well within 0.4 s awake
        asyncio.run(manager._run_all_episodes(group, manager.agents))
        assert sorted(group.staged) == [0, 1]
    else:
        with pytest.raises(RolloutDropped, match=r"episode_timeout_s=0\.4"):
            asyncio.run(manager._run_all_episodes(group, manager.agents))
