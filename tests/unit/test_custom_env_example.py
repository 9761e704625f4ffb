"""The custom-environment example (examples/custom_env/): its config builds its environment
through env.python_path, the environment scores its dataset as documented, and the HTTP
verifier environment scores through a real loopback server."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandemrl.config import load_config, validate_single_controller_config
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.envs import create_environment
from tandemrl.records import PromptItem

CONFIG = "examples/custom_env/config.yaml"


@pytest.fixture
def example(monkeypatch):
    """The example's config and environment, built the way the controller builds them."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # env.python_path is undone afterwards
    cfg = load_config(CONFIG)
    assert validate_single_controller_config(cfg) == []
    return cfg, create_environment(cfg.env)


def test_the_example_builds_its_environment_from_the_folder_beside_its_config(example):
    cfg, env = example
    assert type(env).__module__ == "reverse_env"
    assert type(env).__name__ == "ReverseDigitsEnv"
    assert env.exact_bonus == cfg.env.kwargs["exact_bonus"] == 0.5


def test_the_example_scores_its_dataset_with_partial_credit_and_metadata(example):
    cfg, env = example
    loader = PromptDataLoader.from_config(cfg.data, max_num_epochs=1)
    item = loader.next_item()
    target = item.answer
    assert item.prompt == f"{target[::-1]}:"  # reverse_digits.jsonl, mapped by data.*_key
    assert item.task_source == f"reverse/{len(target)}"
    exact = env.score(item, target, truncated=False)
    assert exact.reward == 1.0 + 0.5 and exact.keep
    assert exact.metadata == {
        "correct": True,
        "answer": target,
        "digits": len(target),
        "truncated": False,
        "task_source": item.task_source,
    }
    wrong_first = ("0" if target[0] != "0" else "1") + target[1:]
    partial = env.score(item, wrong_first, truncated=False)
    assert partial.reward == pytest.approx((len(target) - 1) / len(target))
    assert partial.metadata["correct"] is False
    too_long = env.score(item, target + "9", truncated=True)
    assert too_long.reward == pytest.approx(len(target) / (len(target) + 1))
    assert too_long.metadata["truncated"] is True


def test_every_example_prompt_has_a_consistent_answer(example):
    cfg, _ = example
    loader = PromptDataLoader.from_config(cfg.data, max_num_epochs=1)
    items = [loader.next_item() for _ in range(loader.num_prompts)]
    assert len(items) == 160
    for item in items:
        assert item.prompt == f"{item.answer[::-1]}:", item
        assert item.metadata["digits"] == len(item.answer)


# -- http_verifier_env.py: a blocking HTTP verifier scored in threads ------------------------

TOKEN = "test-token-1234"


class ReverseVerifier(BaseHTTPRequestHandler):
    """A verifier service on loopback: bearer token required, reversal checked exactly."""

    def do_POST(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_error(401, "bad token")
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        correct = body["completion"].strip() == body["answer"]
        payload = json.dumps({"reward": 1.0 if correct else 0.0, "correct": correct}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:  # keep the test output quiet
        pass


@pytest.fixture
def verifier_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ReverseVerifier)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/verify"
    server.shutdown()
    server.server_close()


def http_env(monkeypatch, url: str, token: str):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("TEST_VERIFIER_TOKEN", token)
    cfg = load_config(CONFIG).env.model_copy(
        update={
            "target": "http_verifier_env:HttpVerifierEnv",
            "kwargs": {"url": url, "token_env": "TEST_VERIFIER_TOKEN", "threads": 2},
        }
    )
    return create_environment(cfg)


def test_the_http_verifier_scores_a_group_in_threads_and_keeps_its_answer(
    monkeypatch, verifier_url
):
    env = http_env(monkeypatch, verifier_url, TOKEN)
    assert env.scoring_threads == 2
    item = PromptItem("e0-i0", 0, 0, "583:", "385", "reverse/3")
    outcomes = asyncio.run(
        env.score_group_async(item, ["385", "384", " 385"], truncated=[False, False, True])
    )
    assert [o.reward for o in outcomes] == [1.0, 0.0, 1.0]
    assert outcomes[1].metadata == {
        "correct": False,
        "truncated": False,
        "task_source": "reverse/3",
    }


def test_a_refused_verifier_request_fails_each_completion_with_the_http_error(
    monkeypatch, verifier_url
):
    env = http_env(monkeypatch, verifier_url, "wrong-token")
    item = PromptItem("e0-i0", 0, 0, "583:", "385")
    outcomes = asyncio.run(env.score_group_async(item, ["385", "1"], truncated=[False, False]))
    assert all(isinstance(o, urllib.error.HTTPError) and o.code == 401 for o in outcomes)


def test_the_http_verifier_needs_its_token_variable(monkeypatch):
    monkeypatch.delenv("VERIFIER_TOKEN", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = load_config(CONFIG).env.model_copy(
        update={
            "target": "http_verifier_env:HttpVerifierEnv",
            "kwargs": {"url": "http://127.0.0.1:9/verify"},
        }
    )
    with pytest.raises(ValueError, match="VERIFIER_TOKEN is not set"):
        create_environment(cfg)
