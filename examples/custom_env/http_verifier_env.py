"""A reward computed by a verifier service over HTTP, without blocking the controller.

Each completion is one ``POST`` of ``{"prompt", "answer", "completion", "task_source"}`` (JSON)
to ``url`` with ``Authorization: Bearer <token>``; the service answers
``{"reward": <number>, ...}``, and every other field of its answer is kept as metadata.
``urllib`` blocks, so the environment sets ``scoring_threads``: the rollout manager runs a
group's scoring in one of that many worker threads while the controller's event loop keeps
generating and training (docs/environments.md, "Slow reward functions").

Use it in a config (the token is read from the environment variable ``token_env`` names, so
it never appears in a config file or a checkpoint):

    env:
      name: custom
      target: http_verifier_env:HttpVerifierEnv
      python_path: [examples/custom_env]
      kwargs: {url: "http://127.0.0.1:8000/verify", token_env: VERIFIER_TOKEN, threads: 8}

A request that fails (refused connection, timeout, HTTP error, an answer without a numeric
``reward``) raises: a data failure of that completion, retried up to
``async_rl.rollout_failure.max_data_retries`` times.
"""

from __future__ import annotations

import json
import os
import urllib.request

from tandemrl.envs.base import Environment
from tandemrl.records import EnvResult, PromptItem


class HttpVerifierEnv(Environment):
    def __init__(
        self, url: str, token_env: str = "VERIFIER_TOKEN", timeout_s: float = 10.0, threads: int = 8
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"env.kwargs.url must be an http(s) URL, got {url!r}")
        token = os.environ.get(token_env)
        if not token:
            raise ValueError(
                f"env.kwargs.token_env: environment variable {token_env} is not set; export the "
                "verifier's token there"
            )
        self.url = url
        self.timeout_s = timeout_s
        self.scoring_threads = threads  # groups scored at once, each in its own thread
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}

    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        body = {
            "prompt": item.prompt,
            "answer": item.answer,
            "completion": completion,
            "task_source": item.task_source,
        }
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers=self._headers, method="POST"
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            verdict = json.load(response)
        reward = verdict.get("reward") if isinstance(verdict, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(f"POST {self.url}: answer {verdict!r} has no numeric 'reward'")
        extra = {key: value for key, value in verdict.items() if key != "reward"}
        return EnvResult(
            reward=float(reward),
            metadata={**extra, "truncated": truncated, **self.item_metadata(item)},
        )
