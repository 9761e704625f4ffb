"""Episodes per second through NeMo-Gym's servers against TandemRL's built-in agent path.

The same task (one turn of the counting game: the user says ``583=``, the policy answers, the
answer is scored by per-position match), the same controller, scripted engine (no model
time: the engine answers at once) and recording trainer, in one process; only the agent
differs:

- built-in: ``CountingGameAgent(turns=1)`` calls the policy endpoint with the official
  ``openai`` client and scores in-process (env.name: agent);
- Gym: ``GymAgent`` posts each episode to Gym's ``simple_agent`` ``/run``, which calls Gym's
  ``vllm_model`` server (which calls the same endpoint), then our ``tandemrl_counting``
  resources server's ``/seed_session`` and ``/verify`` (env.name: nemo_gym).

The Gym servers are started once before both runs (not timed); each run's wall time covers
its episodes and training steps. Prints one line ``RESULT {json}`` with ``gym_over_builtin``
(Gym's episodes/s over the built-in path's) and the machine's load.

    TANDEMRL_NEMO_GYM_VENV=.venv-gym python benchmarks/nemo_gym.py --steps 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))  # the scripted engine and chat tokenizer
sys.path.insert(0, str(REPO / "tests" / "nemo_gym"))  # the Gym fixture's config

from agent_helpers import ScriptedEngine, chat_tokenizer, codec_for, end_id  # noqa: E402
from conftest import CONFIG_PATHS, DATASET, EXEMPLAR, GymServers, free_port  # noqa: E402

from tandemrl.agents import create_run_agent  # noqa: E402
from tandemrl.agents.counting_game import CountingGameAgent  # noqa: E402
from tandemrl.config.loader import load_config  # noqa: E402
from tandemrl.config.models import NemoGymConfig  # noqa: E402
from tandemrl.controller.build import ControllerParts, build_controller  # noqa: E402
from tandemrl.data.dataloader import PromptDataLoader  # noqa: E402
from tandemrl.data.dataset import PromptRecord, load_prompt_records  # noqa: E402
from tandemrl.nemo_gym.agent import GymAgent  # noqa: E402
from tandemrl.training.fake import FakeTrainer  # noqa: E402

AGENT_EXEMPLAR = REPO / "examples" / "configs" / "grpo_tiny_cpu_agent.yaml"


def shape(prompts: int, generations: int, steps: int, log_dir: str) -> tuple[str, ...]:
    return (
        f"grpo.num_prompts_per_step={prompts}",
        f"grpo.num_generations_per_prompt={generations}",
        f"policy.train_global_batch_size={prompts * generations}",
        f"policy.train_micro_batch_size={prompts * generations}",
        f"grpo.max_num_steps={steps}",
        f"async_rl.min_groups_for_streaming_train={prompts}",
        f"async_rl.max_buffered_rollouts={2 * prompts}",
        f"async_rl.max_inflight_prompts={2 * prompts}",
        f"logger.log_dir={log_dir}",
        "async_rl.stall_watchdog.enabled=false",
    )


def counting_answer(tokenizer):
    end = end_id(tokenizer)

    def answer(request):
        text = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)
        digit = int(text[: text.rindex("=")][-1])
        reply = "".join(str((digit + k) % 10) for k in range(1, 4))
        return [*tokenizer.encode(reply, add_special_tokens=False), end]

    return answer


def timed_run(cfg, agent, records) -> tuple[float, int]:
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answer(tokenizer))
    parts = ControllerParts(
        trainer=FakeTrainer(record_tensors=False),
        engines=[engine],
        env=None,
        codec=codec_for(tokenizer),
        dataloader=PromptDataLoader(records, max_num_epochs=100, seed=0, shuffle=False),
        agent=agent,
        tokenizer=tokenizer,
    )
    controller = build_controller(cfg, parts)
    started = time.monotonic()
    asyncio.run(controller.run())
    return time.monotonic() - started, len(engine.results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    args = parser.parse_args()
    if not os.environ.get("TANDEMRL_NEMO_GYM_VENV"):
        sys.exit("set TANDEMRL_NEMO_GYM_VENV to the Gym venv (scripts/install_nemo_gym.sh DIR)")
    log_dir = tempfile.mkdtemp(prefix="bench-nemo-gym-")
    size = shape(args.prompts, args.generations, args.steps, log_dir)

    port = free_port()
    starter = GymAgent(
        NemoGymConfig(config_paths=CONFIG_PATHS, startup_timeout_s=600),
        run_dir=Path(log_dir) / "gym",
        served_model_name="policy",
    )
    gym_started = time.monotonic()
    asyncio.run(starter.start(f"http://127.0.0.1:{port}/v1"))
    gym_start_s = time.monotonic() - gym_started
    assert starter.topology is not None
    gym = GymServers(starter, starter.topology, port)
    try:
        # The Gym exemplar's turn: three digits and the end of the turn (4 tokens).
        builtin_cfg = load_config(
            AGENT_EXEMPLAR,
            (
                *size,
                "env.kwargs.turns=1",
                "env.agent.max_turns=1",
                "policy.generation.max_new_tokens=4",
            ),
        )
        records = [PromptRecord(prompt=f"{i % 10}{(i * 7) % 10}{(i * 3) % 10}=") for i in range(64)]
        builtin_s, builtin_episodes = timed_run(builtin_cfg, CountingGameAgent(turns=1), records)

        gym_cfg = load_config(EXEMPLAR, (*gym.connect_overrides(), *size))
        gym_records = load_prompt_records(gym_cfg.data, gym_rows=True)[:64]
        gym_s, gym_episodes = timed_run(gym_cfg, create_run_agent(gym_cfg), gym_records)
    finally:
        asyncio.run(starter.stop())

    builtin_rate = builtin_episodes / builtin_s
    gym_rate = gym_episodes / gym_s
    result = {
        "builtin_episodes_per_s": round(builtin_rate, 1),
        "gym_episodes_per_s": round(gym_rate, 1),
        "gym_over_builtin": round(gym_rate / builtin_rate, 3),
        "episodes": {"builtin": builtin_episodes, "gym": gym_episodes},
        "gym_start_s": round(gym_start_s, 1),
        "load_1m": round(os.getloadavg()[0], 1),
        "dataset": str(DATASET.relative_to(REPO)),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
