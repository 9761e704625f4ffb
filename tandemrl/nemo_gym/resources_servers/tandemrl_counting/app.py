"""A NeMo-Gym resources server for TandemRL's counting task (runs in the Gym venv).

Written against Gym's own base classes (``SimpleResourcesServer``): Gym's agents call
``/seed_session`` (nothing to seed: the task has no state) and ``/verify`` with the row and
the model's response. The reward is the counting task's, imported from ``tandemrl.envs.counting``
so the Gym run and the built-in run score alike: the assistant's text, cut at the first
end-of-sequence marker and stripped, against the row's ``expected_answer`` (or the target
derived from the prompt), per-position matches ÷ the longer length.

A row that cannot be scored (no user prompt, a prompt that is not a counting prompt) makes
``/verify`` answer 422 naming the field, which TandemRL counts as a data failure of that
sibling.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from pydantic import ConfigDict

from tandemrl.envs.counting import clean_completion, counting_target, positional_match_reward


class CountingResourcesServerConfig(BaseResourcesServerConfig):
    """No settings of its own: host, port and name come from the Gym config."""


class CountingVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")  # the row's own fields ride along
    expected_answer: str | None = None


class CountingVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")
    expected_answer: str
    completion: str
    exact_match: bool


def _text(content: Any) -> str:
    """A Responses API message content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    return "".join(
        part.get("text", "") if isinstance(part, dict) else getattr(part, "text", "")
        for part in content or []
    )


def last_user_prompt(body: BaseVerifyRequest) -> str:
    params = body.responses_create_params
    prompt_input = params.input
    if isinstance(prompt_input, str):
        return prompt_input
    for message in reversed(list(prompt_input or [])):
        message_dict = message if isinstance(message, dict) else message.model_dump()
        if message_dict.get("role") == "user":
            return _text(message_dict.get("content"))
    raise HTTPException(422, "responses_create_params.input holds no user message to count from")


def assistant_text(body: BaseVerifyRequest) -> str:
    """The text of the response's assistant messages, in order."""
    parts = []
    for item in body.response.output:
        if getattr(item, "type", None) == "message" and getattr(item, "role", None) == "assistant":
            parts.append(_text([part.model_dump() for part in item.content]))
    return "".join(parts)


class CountingResourcesServer(SimpleResourcesServer):
    config: CountingResourcesServerConfig

    async def verify(self, body: CountingVerifyRequest) -> CountingVerifyResponse:
        target = body.expected_answer
        if target is None:
            try:
                target = counting_target(last_user_prompt(body))
            except ValueError as error:
                raise HTTPException(422, f"expected_answer is missing and {error}") from error
        completion = clean_completion(assistant_text(body))
        return CountingVerifyResponse(
            **{
                **body.model_dump(),
                "expected_answer": target,
                "reward": positional_match_reward(target, completion),
                "completion": completion,
                "exact_match": completion == target,
            }
        )


if __name__ == "__main__":
    CountingResourcesServer.run_webserver()
