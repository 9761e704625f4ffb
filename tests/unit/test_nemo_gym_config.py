"""env.name: nemo_gym without Gym: its config rules, the refusal without a Gym venv, Gym rows
and their /run bodies, a NeMo-RL Gym config ported, recovery granularity from the rows, and how
GymAgent sorts a /run's outcome into a reward, a data failure or an infrastructure failure
(against a scripted Gym agent server). The real Gym servers are in tests/nemo_gym.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tandemrl.agents import AgentInfraFailure
from tandemrl.config import check_config, load_config
from tandemrl.config.models import NemoGymConfig, RolloutRecoveryConfig
from tandemrl.config.validate import ConfigError, validate_single_controller_config
from tandemrl.controller.watchdog import service_health
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import DatasetError, load_prompt_records
from tandemrl.data.gym_rows import GYM_ROW_KEY, parse_gym_jsonl
from tandemrl.nemo_gym.agent import GymAgent
from tandemrl.nemo_gym.rows import run_body
from tandemrl.nemo_gym.servers import GymServer, GymTopology
from tandemrl.nemo_gym.venv import GymVenvMissing, check_gym_venv
from tandemrl.rollout.failures import DataFailure
from tandemrl.rollout.ledger import OwnershipLedger

EXEMPLAR = "examples/configs/grpo_tiny_cpu_nemo_gym.yaml"
AGENT = "tandemrl_counting_simple_agent"


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as raised:
        validate_single_controller_config(load_config(EXEMPLAR, overrides))
    return str(raised.value)


def test_the_exemplar_is_valid_and_each_rule_names_its_dotpath():
    validate_single_controller_config(load_config(EXEMPLAR))
    both = problems("++env.nemo_gym.head_server={host: 127.0.0.1, port: 9}")
    assert "env.nemo_gym: give exactly one of config_paths" in both
    assert "policy.generation.http_server.enabled: must be true" in problems(
        "policy.generation.http_server.enabled=false"
    )
    assert "policy.generation.http_server.port: 0" in problems(
        "env.nemo_gym.config_paths=[]", "++env.nemo_gym.head_server={host: 127.0.0.1, port: 9}"
    )
    assert "env.nemo_gym.run_timeout_s: 200.0 must be below" in problems(
        "env.nemo_gym.run_timeout_s=200"
    )
    assert "data.dataset: 'builtin://counting'" in problems("data.dataset=builtin://counting")
    assert "env.agent.client: in_process" in problems("env.agent.client=in_process")
    assert "env.nemo_gym: set, but env.name is 'counting'" in problems(
        "env.name=counting",
        "policy.generation.http_server.enabled=false",
        "data.dataset=builtin://counting",
        "env.agent.max_turns=8",
        "env.agent.episode_timeout_s=300",
    )


def test_without_a_gym_venv_the_run_refuses_to_start_and_says_how_to_install(monkeypatch):
    # What `tandemrl validate` and `tandemrl train` report before anything starts
    # (tandemrl.preflight runs this check for env.name: nemo_gym).
    monkeypatch.delenv("TANDEMRL_NEMO_GYM_VENV", raising=False)
    with pytest.raises(GymVenvMissing, match=r"env\.nemo_gym\.venv is not set") as raised:
        check_gym_venv(load_config(EXEMPLAR, ("env.nemo_gym.venv=null",)).env.nemo_gym.venv)
    assert "bash scripts/install_nemo_gym.sh" in str(raised.value)
    with pytest.raises(GymVenvMissing, match=r"'/nonexistent' holds no bin/python"):
        check_gym_venv("/nonexistent")


def gym_rows(tmp_path: Path, rows: list[object]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


ROW = {
    "responses_create_params": {"input": [{"role": "user", "content": "583="}]},
    "expected_answer": "456",
    "agent_ref": {"type": "responses_api_agents", "name": AGENT},
    "task_source": "counting",
}


def test_gym_rows_become_prompts_and_their_run_body_carries_the_episode_key(tmp_path):
    records = parse_gym_jsonl(json.dumps(ROW) + "\n\n", "rows.jsonl")
    assert [(r.prompt, r.agent_ref, r.task_source) for r in records] == [
        ("583=", AGENT, "counting")
    ]
    assert records[0].metadata[GYM_ROW_KEY] == ROW
    row = {**ROW, "responses_create_params": {**ROW["responses_create_params"]}}
    row["responses_create_params"]["metadata"] = {"extra_body": json.dumps({"seed": 3})}
    body = run_body(row, agent_name="other_agent", episode_key="KEY")
    assert body["agent_ref"] == {"type": "responses_api_agents", "name": "other_agent"}
    extra = json.loads(body["responses_create_params"]["metadata"]["extra_body"])
    assert extra == {"seed": 3, "tandemrl_episode_key": "KEY"}
    assert "metadata" not in ROW["responses_create_params"]  # the dataset row is untouched

    bad = gym_rows(tmp_path, [ROW, {"agent_ref": {"name": AGENT}}])
    cfg = load_config(EXEMPLAR, (f"data.dataset={bad}",)).data
    with pytest.raises(
        DatasetError, match=r"rows.jsonl:2: a NeMo-Gym row needs 'responses_create_params'"
    ):
        load_prompt_records(cfg, gym_rows=True)
    bad = gym_rows(tmp_path, [{**ROW, "agent_ref": "x"}])
    with pytest.raises(DatasetError, match=r"rows.jsonl:1: 'agent_ref' must be"):
        load_prompt_records(cfg, gym_rows=True)


def test_recovery_granularity_follows_agent_then_task_source_then_default(tmp_path):
    rows = [
        ROW,  # agent entry wins over its task source's
        {**ROW, "agent_ref": {"type": "responses_api_agents", "name": "plain"}},  # task source
        {k: v for k, v in ROW.items() if k != "agent_ref"},  # no agent_ref: task source
        {k: v for k, v in ROW.items() if k not in ("agent_ref", "task_source")},  # default
    ]
    path = gym_rows(tmp_path, rows)
    cfg = load_config(EXEMPLAR, (f"data.dataset={path}",))
    loader = PromptDataLoader(
        load_prompt_records(cfg.data, gym_rows=True), max_num_epochs=1, seed=0, shuffle=False
    )
    recovery = RolloutRecoveryConfig(
        default_granularity="sibling",
        task_source_granularity_overrides={"counting": "prompt_group"},
        agent_granularity_overrides={AGENT: "sibling"},
    )
    ledger = OwnershipLedger(recovery, token_capture=True)
    groups = [
        ledger.open(loader.next_item(), group_id=f"g{i}", target_step=0, start_weight=0)
        for i in range(4)
    ]
    assert [group.granularity for group in groups] == [
        "sibling",
        "prompt_group",
        "prompt_group",
        "sibling",
    ]
    # persisted: a restart under another config keeps each group's resolved policy
    state = json.loads(json.dumps(ledger.state_dict()))
    restored = OwnershipLedger.groups_from_state(state)
    assert [group.granularity for group in restored] == [
        "sibling",
        "prompt_group",
        "prompt_group",
        "sibling",
    ]
    assert [group.item.agent_ref for group in restored] == [AGENT, "plain", None, None]


def test_a_nemo_rl_gym_config_ports_to_env_name_nemo_gym(tmp_path):
    path = tmp_path / "nemo_rl_gym.yaml"
    # NeMo-RL's Gym keys over the plain tiny job; the Gym block is Gym's own global config
    # next to config_paths.
    path.write_text(
        textwrap.dedent(
            f"""
            defaults: {Path("examples/configs/grpo_tiny_cpu.yaml").resolve()}
            policy:
              model_name: tiny://qwen2-counting-chat
              generation:
                vllm_cfg: {{expose_http_server: true}}
            grpo:
              max_rollout_turns: 1
            data:
              dataset: null
              train:
                dataset_name: NemoGymDataset
                data_path: tandemrl/nemo_gym/resources_servers/tandemrl_counting/data/train.jsonl
              default:
                dataset_name: NemoGymDataset
                env_name: nemo_gym
                processor: nemo_gym_data_processor
            env:
              name: null
              should_use_nemo_gym: true
              should_log_nemo_gym_responses: true
              nemo_gym:
                config_paths: [resources_servers/tandemrl_counting/configs/tandemrl_counting.yaml]
                rollout_max_attempts_to_avoid_lp_nan: 1
                policy_model: {{responses_api_models: {{vllm_model: {{uses_reasoning_parser: false}}}}}}
            async_rl:
              rollout_failure:
                nemo_gym: {{rollout_timeout_s: 90}}
            """
        )
    )
    report = check_config(path)
    assert report.errors == [], report.errors
    cfg = load_config(path)
    assert cfg.env.name == "nemo_gym"
    assert cfg.env.nemo_gym.config_paths == [
        "resources_servers/tandemrl_counting/configs/tandemrl_counting.yaml"
    ]
    assert cfg.env.nemo_gym.overrides == {
        "policy_model": {"responses_api_models": {"vllm_model": {"uses_reasoning_parser": False}}}
    }
    assert cfg.policy.generation.http_server.enabled
    assert cfg.env.agent.max_turns == 1
    assert cfg.env.nemo_gym.run_timeout_s == 90
    assert cfg.data.dataset.endswith("tandemrl_counting/data/train.jsonl")


# --------------------------------------------------------------------------- /run outcomes


def agent_with(handler, *, run_timeout_s: float = 5.0) -> GymAgent:
    agent = GymAgent(
        NemoGymConfig(config_paths=["x.yaml"], run_timeout_s=run_timeout_s),
        run_dir=Path("/tmp"),
        served_model_name="policy",
    )
    # Port 9 (discard) answers nothing on loopback: the probe lists the servers as down.
    agent.topology = GymTopology(
        {
            AGENT: GymServer(AGENT, "responses_api_agents", "127.0.0.1", 9),
            "tandemrl_counting": GymServer(
                "tandemrl_counting", "resources_servers", "127.0.0.1", 9
            ),
        },
        "http://127.0.0.1:9",
    )
    agent._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return agent


class Client:
    api_key = "EPISODE"


def item_of(row: dict[str, object]):
    record = parse_gym_jsonl(json.dumps(row), "rows.jsonl")[0]
    from tandemrl.records import PromptItem

    return PromptItem(
        "e0-i0", 0, 0, record.prompt, None, record.task_source, record.agent_ref, record.metadata
    )


def outcome(handler, row=ROW, **kwargs):
    async def play():
        return await agent_with(handler, **kwargs).run(item_of(row), Client())

    return asyncio.run(play())


def test_a_run_answer_is_the_reward_and_verify_numbers_are_metrics():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={**ROW, "reward": 0.5, "exact_match": False, "note": "x"})

    result = outcome(handler)
    assert (result.reward, result.metadata) == (0.5, {"exact_match": False})
    extra = json.loads(seen[0]["responses_create_params"]["metadata"]["extra_body"])
    assert extra == {"tandemrl_episode_key": "EPISODE"}


def test_run_failures_are_sorted_into_data_and_infrastructure():
    verify_error = "Hit an exception in SimpleAgent___a calling an inner server: b'ValueError()'"
    with pytest.raises(DataFailure, match=r"/run answered HTTP 500: .*ValueError"):
        outcome(lambda request: httpx.Response(500, json=verify_error))
    with pytest.raises(DataFailure, match="without a numeric reward"):
        outcome(lambda request: httpx.Response(200, json={"response": {}}))

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(
        AgentInfraFailure, match=rf"Gym agent server {AGENT} \(127.0.0.1:9\): /run failed"
    ):
        outcome(refused)

    def hangs(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(AgentInfraFailure) as raised:
        outcome(hangs)
    message = str(raised.value)
    assert "run_timeout_s=5.0" in message
    assert "Gym resources server tandemrl_counting (127.0.0.1:9)" in message
    no_agent = {k: v for k, v in ROW.items() if k != "agent_ref"}
    with pytest.raises(DataFailure, match=r"env\.nemo_gym\.default_agent is not set"):
        outcome(lambda request: httpx.Response(200, json={"reward": 1.0}), row=no_agent)


def test_the_stall_report_names_the_gym_servers_that_stopped_answering():
    agent = agent_with(lambda request: httpx.Response(200, json={"reward": 1.0}))

    class Rollouts:  # what the agent runner forwards to its agent
        async def health(self) -> str | None:
            return await agent.health()

    notes = asyncio.run(service_health(SimpleNamespace(services=[Rollouts()])))
    assert notes == [
        f"not answering: Gym agent server {AGENT} (127.0.0.1:9), "
        "Gym resources server tandemrl_counting (127.0.0.1:9)"
    ]
