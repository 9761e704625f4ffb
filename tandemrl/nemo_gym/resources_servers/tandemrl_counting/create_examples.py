"""Write this server's datasets: ``data/example.jsonl`` (5 rows) and ``data/train.jsonl`` (256).

Each row is a NeMo-Gym row for the counting task: the prompt (three digits and ``=``, drawn as
TandemRL's ``builtin://counting`` draws them) as the user message of
``responses_create_params``, its ``expected_answer``, the agent that plays it
(``agent_ref``) and its ``task_source``. Run it from this folder with any Python:

    python create_examples.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

AGENT = "tandemrl_counting_simple_agent"


def rows(count: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        digits = [rng.randrange(10) for _ in range(3)]
        out.append(
            {
                "responses_create_params": {
                    "input": [{"role": "user", "content": "".join(map(str, digits)) + "="}]
                },
                "expected_answer": "".join(str((digits[-1] + k) % 10) for k in range(1, 4)),
                "agent_ref": {"type": "responses_api_agents", "name": AGENT},
                "task_source": "tandemrl_counting",
            }
        )
    return out


def main() -> None:
    data = Path(__file__).resolve().parent / "data"
    for name, count, seed in (("example", 5, 0), ("train", 256, 1)):
        with (data / f"{name}.jsonl").open("w") as file:
            for row in rows(count, seed):
                file.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
