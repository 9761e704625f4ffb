"""NeMo-Gym dataset rows (``env.name: nemo_gym``): a Gym JSONL line as a TandemRL prompt.

A Gym row (what ``gym dataset collate`` writes and every ``resources_servers/*/data/*.jsonl``
holds) is a JSON object with ``responses_create_params`` (the Responses API request: its
``input`` messages, tools, sampling fields), ``agent_ref`` (``{"type": "responses_api_agents",
"name": <agent server>}``, optional), ``task_source`` (optional) and whatever fields the
resources server's ``/verify`` reads (``expected_answer``, test cases...).

``gym_record`` maps one onto a ``PromptRecord``: the prompt is the text of its last user
message (for logs and samples only: Gym's agent builds the conversation), ``agent_ref`` is the
agent's name, ``task_source`` as given, and the whole row is kept under ``metadata["gym_row"]``
(``tandemrl.nemo_gym.rows.run_body`` turns it back into the agent's ``/run`` body).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # dataset.py imports this module; the records come from there at call time
    from tandemrl.data.dataset import PromptRecord

GYM_ROW_KEY = "gym_row"
AGENT_TYPE = "responses_api_agents"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def last_user_text(params: dict[str, Any]) -> str:
    prompt_input = params.get("input")
    if isinstance(prompt_input, str):
        return prompt_input
    for message in reversed(prompt_input or []):
        if isinstance(message, dict) and message.get("role") == "user":
            return _text(message.get("content"))
    return ""


def gym_record(row: Any, where: str) -> PromptRecord:
    """One Gym row → record; ``where`` ("<file>:<line>") names it in errors."""
    from tandemrl.data.dataset import DatasetError, PromptRecord

    if not isinstance(row, dict):
        raise DatasetError(
            f"{where}: a NeMo-Gym row must be a JSON object, got {type(row).__name__}"
        )
    params = row.get("responses_create_params")
    if not isinstance(params, dict) or "input" not in params:
        raise DatasetError(
            f"{where}: a NeMo-Gym row needs 'responses_create_params' with an 'input' "
            f"(the Responses API request); fields present: {sorted(row)}"
        )
    agent_ref = row.get("agent_ref")
    agent_name = None
    if agent_ref is not None:
        agent_name = agent_ref.get("name") if isinstance(agent_ref, dict) else None
        if not isinstance(agent_name, str) or not agent_name:
            raise DatasetError(
                f'{where}: \'agent_ref\' must be {{"type": "{AGENT_TYPE}", "name": '
                f"<agent server>}}, got {agent_ref!r}"
            )
    task_source = row.get("task_source")
    if task_source is not None and not isinstance(task_source, str):
        raise DatasetError(f"{where}: 'task_source' must be a string, got {task_source!r}")
    prompt = last_user_text(params) or json.dumps(params.get("input"))[:200]
    return PromptRecord(
        prompt=prompt,
        answer=None,
        task_source=task_source,
        agent_ref=agent_name,
        metadata={GYM_ROW_KEY: row},
    )


def parse_gym_jsonl(text: str, source: str) -> list[PromptRecord]:
    from tandemrl.data.dataset import DatasetError

    records = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{line_number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(
                f"{where}: invalid JSON: {error.msg} (column {error.colno})"
            ) from error
        records.append(gym_record(row, where))
    if not records:
        raise DatasetError(f"{source}: the dataset holds no rows (data.dataset)")
    return records
