"""vLLM (CPU build) on the architecture matrix: every family's tiny chat preset serves sampled
completions whose logprobs are the trainer's, before and after a weight update from the trainer,
and stops at every EOS id the model folder names (docs/models.md lists the results)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from vllm_helpers import run, vllm_policy_cfg

from tandemrl.config.models import LossConfig, PolicyConfig
from tandemrl.dataplane.rows import make_training_row
from tandemrl.generation.vllm_engine import VllmGenerationEngine
from tandemrl.models import load_tokenizer, resolve_model_path
from tandemrl.models.special_tokens import model_eos_token_ids, stop_token_ids
from tandemrl.records import GenerationRequest, GenerationResult
from tandemrl.training.batch import collate_rows, count_loss_tokens
from tandemrl.training.policy_worker import PolicyWorker

FAMILIES = ["llama3", "qwen2.5", "qwen3", "mistral", "gemma3", "phi3", "qwen3-moe"]


def requests(stops: tuple[int, ...], prefix: str) -> list[GenerationRequest]:
    tokens = [5, 30, 41, 7, 60, 12, 75, 33, 9, 48, 21, 66, 17, 54]
    return [
        GenerationRequest(
            f"{prefix}-{index}", tokens[: 2 + 3 * (index % 5)], 16, 1.0, 1.0, stops, seed=index
        )
        for index in range(24)
    ]


def batch_of(results: list[GenerationResult]):
    rows = []
    for index, result in enumerate(results):
        row = make_training_row(
            result.prompt_token_ids, result.token_ids, result.logprobs, float(index % 2), 1.0
        )
        row["advantages"] = torch.tensor(1.0 if index % 2 else -1.0)
        rows.append(row)
    return collate_rows(rows, pad_token_id=0)


def assert_trainer_agrees(worker: PolicyWorker, results: list[GenerationResult]) -> None:
    batch = batch_of(results)
    trainer = asyncio.run(worker.get_logprobs(batch))
    mask = batch["token_mask"] > 0
    torch.testing.assert_close(trainer[mask], batch["generation_logprobs"][mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_serves_the_trainers_distribution_and_stops_at_each_eos(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = resolve_model_path(f"tiny://{family}", tmp_path_factory.mktemp("models"))
    tokenizer = load_tokenizer(folder)
    stops = stop_token_ids(tokenizer, folder)
    eos_ids = set(model_eos_token_ids(folder))
    cfg = vllm_policy_cfg(max_model_len=256)
    engine = VllmGenerationEngine(cfg, folder, seed=0)
    worker = PolicyWorker(
        PolicyConfig(model_name=str(folder), device="cpu", optimizer={"lr": 1e-2}),
        LossConfig(),
        seed=0,
    )
    try:
        before = run(engine.generate(requests(stops, "before")))
        assert_trainer_agrees(worker, before)
        ended = {r.token_ids[-1] for r in before if r.finish_reason == "stop"}
        assert ended <= set(stops) and ended & eos_ids, ended
        for result in before:
            assert not set(result.token_ids[:-1]) & set(stops), result

        # Two optimizer steps, each one's weights into the engine under the next version.
        results = before
        for version in (1, 2):
            batch = batch_of(results)
            batch["prev_logprobs"] = asyncio.run(worker.get_logprobs(batch))

            async def step_and_sync(batch=batch, version=version) -> None:
                await worker.begin_train_step()
                await worker.train_microbatches(
                    batch,
                    step_num_sequences=batch["input_ids"].shape[0],
                    step_num_tokens=count_loss_tokens(batch),
                )
                await worker.finish_train_step()
                await engine.update_weights(version, await worker.export_weights())

            asyncio.run(step_and_sync())
            results = run(engine.generate(requests(stops, f"v{version}")))
            assert {v for result in results for v in result.token_weight_versions} == {version}
            assert_trainer_agrees(worker, results)
    finally:
        engine.shutdown_sync()
