"""One generation worker as a real Ray actor: concurrent generate, weights via the object store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tandemrl.generation.worker import make_generation_worker_class
from tandemrl.models import load_causal_lm, resolve_model_path
from tandemrl.records import GenerationRequest, GenerationResult

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 14], [9, 14], [4, 4, 4]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_path("tiny://qwen2-counting", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def worker(ray_session, model_path: Path):
    worker_class = make_generation_worker_class(num_cpus=1, num_gpus=0)
    handle = worker_class.remote(str(model_path), device="cpu", max_batch_size=32, seed=0)
    yield handle
    ray_session.get(handle.shutdown.remote(), timeout=30)
    ray_session.kill(handle)


@torch.no_grad()
def recomputed_logprobs(model: PreTrainedModel, result: GenerationResult) -> list[float]:
    prompt_length = len(result.prompt_token_ids)
    tokens = torch.tensor([result.prompt_token_ids + result.token_ids])
    logprobs = torch.log_softmax(model(tokens).logits[0, prompt_length - 1 : -1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1).tolist()


def assert_close(left: list[float], right: list[float], tolerance: float = 1e-5) -> None:
    assert len(left) == len(right)
    assert max(abs(a - b) for a, b in zip(left, right, strict=True)) < tolerance


def test_worker_generates_and_loads_weights_from_the_object_store(
    ray_session, worker, model_path: Path
) -> None:
    ray = ray_session
    status = ray.get(worker.ping.remote(), timeout=60)
    assert status["pid"] != os.getpid()
    assert status["torch_threads"] == 1
    assert status["weight_version"] == 0 and not status["asleep"]

    model = load_causal_lm(model_path, device="cpu")
    # Two concurrent calls into one async actor are decoded in one batch (queued during a
    # stand-down, so both are waiting when decoding starts).
    ray.get(worker.sleep.remote())
    calls = [
        worker.generate.remote(
            [
                GenerationRequest(f"c{call}-{i}", p, 6, seed=call * 10 + i)
                for i, p in enumerate(PROMPTS)
            ]
        )
        for call in range(2)
    ]
    ready, _ = ray.wait(calls, num_returns=2, timeout=0.2)
    assert ready == []
    ray.get(worker.wake.remote())
    outputs = ray.get(calls, timeout=60)
    assert ray.get(worker.stats.remote())["max_running_batch"] == 2 * len(PROMPTS)
    for results in outputs:
        for prompt, result in zip(PROMPTS, results, strict=True):
            assert result.prompt_token_ids == prompt
            assert result.token_weight_versions == [0] * len(result.token_ids)
            assert_close(result.logprobs, recomputed_logprobs(model, result))

    # The trainer's next version travels through the object store.
    generator = torch.Generator().manual_seed(5)
    new_weights = {
        name: tensor + 0.2 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }
    new_weights["lm_head.weight"] = new_weights["model.embed_tokens.weight"]  # tied
    weights_ref = ray.put(new_weights)
    ray.get(worker.update_weights.remote(1, weights_ref), timeout=60)
    assert ray.get(worker.weight_version.remote()) == 1
    model.load_state_dict(new_weights)
    (after,) = ray.get(
        worker.generate.remote([GenerationRequest("after", PROMPTS[0], 8, temperature=0.0)]),
        timeout=60,
    )
    assert after.start_weight_version == 1
    assert after.token_weight_versions == [1] * len(after.token_ids)
    assert_close(after.logprobs, recomputed_logprobs(model, after))


def test_worker_stand_down_and_abort(ray_session, worker) -> None:
    ray = ray_session
    frozen_before = ray.get(worker.frozen_time.remote())
    ray.get(worker.sleep.remote())
    assert ray.get(worker.ping.remote())["asleep"]
    pending = worker.generate.remote([GenerationRequest("frozen", PROMPTS[1], 50)])
    ready, _ = ray.wait([pending], timeout=0.3)
    assert ready == []  # no decoding while asleep
    ray.get(worker.abort.remote(["frozen"]))
    (result,) = ray.get(pending, timeout=30)
    assert result.finish_reason == "aborted" and result.token_ids == []
    ray.get(worker.wake.remote())
    assert ray.get(worker.frozen_time.remote()) - frozen_before >= 0.3
    (awake,) = ray.get(worker.generate.remote([GenerationRequest("awake", PROMPTS[1], 3)]))
    assert len(awake.token_ids) >= 1
