"""The ``/run`` body of one NeMo-Gym episode, built from a dataset row (``tandemrl.data.gym_rows``).

The row goes back to Gym as it was read, routed to the agent server that plays it, with the
episode's key in ``responses_create_params.metadata.extra_body``: Gym's model servers merge
``extra_body`` into every call they make to the policy, which is how the policy endpoint knows
which episode a call belongs to (``tandemrl.agents.server.BODY_KEY_FIELD``; docs/nemo_gym.md).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from tandemrl.agents.server import BODY_KEY_FIELD
from tandemrl.data.gym_rows import AGENT_TYPE


def run_body(gym_row: dict[str, Any], *, agent_name: str, episode_key: str) -> dict[str, Any]:
    """The ``/run`` body for one episode of ``gym_row`` (module docstring)."""
    body = copy.deepcopy(gym_row)
    body["agent_ref"] = {"type": AGENT_TYPE, "name": agent_name}
    params = body["responses_create_params"]
    metadata = dict(params.get("metadata") or {})
    extra_body = json.loads(metadata.get("extra_body") or "{}")
    extra_body[BODY_KEY_FIELD] = episode_key
    metadata["extra_body"] = json.dumps(extra_body)
    params["metadata"] = metadata
    return body
