"""GRPO in chunks (a streaming in_order sampler) when a prompt is dropped between two chunks.

The run trains step 0 in two chunks, and one of its four groups is dropped after the first
chunk trained: the step then holds 3 groups (6 rows) where the pump planned 4 (8). With the
real tiny policy worker in-process, the step must equal one unchunked step over the same 6
rows: one optimizer step, the loss normalised by the rows (and tokens) the step trained.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation.base import GenerationError
from tandemrl.generation.fake import FakeGenerationBackend, fake_codec
from tandemrl.training.api import TrainBatch
from tandemrl.training.batch import count_loss_tokens
from tandemrl.training.policy_worker import PolicyWorker

N, G = 4, 2
VOCAB = 16  # the fake codec's and the fake engine's vocabulary


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2-grpo")
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def make_cfg(model_dir: Path, *overrides: str):
    return load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"policy.model_name={model_dir}",
            f"grpo.num_prompts_per_step={N}",
            f"grpo.num_generations_per_prompt={G}",
            f"policy.train_global_batch_size={N * G}",
            f"policy.train_micro_batch_size={N * G}",
            "grpo.max_num_steps=1",
            "grpo.max_num_epochs=1",
            "async_rl.min_groups_for_streaming_train=2",  # streaming: chunks of >= 2 groups
            "async_rl.max_inflight_prompts=8",
            "async_rl.max_buffered_rollouts=8",
            "async_rl.rollout_failure.max_skipped_prompts=1",
            "async_rl.rollout_failure.max_consecutive_dropped_prompts=1",
            "async_rl.rollout_failure.max_infra_retries=0",
            "async_rl.rollout_failure.backoff_initial_s=0",
            "logger.progress=false",
            # Adam's first step is lr x g / (|g| + eps): with the default eps it is about
            # lr x sign(g), blind to how the gradient was normalised and sharp on near-zero
            # gradients. A large eps keeps the update proportional to g, so the weights
            # below show a wrong normalisation and not float rounding.
            "policy.optimizer.eps=1e-3",
            *overrides,
        ),
    )


class GatedEngine(FakeGenerationBackend):
    """The instant fake engine, except that a prompt named in ``gates`` waits until its gate
    returns True (polled), and then fails if it is named in ``fail`` too."""

    def __init__(self, gates: dict[str, Callable[[], bool]], fail: set[str]) -> None:
        super().__init__(seed=0)
        self.gates = gates
        self.fail = fail

    async def generate(self, requests):
        prompts = {request.request_id.split("/")[0] for request in requests}
        for prompt in sorted(prompts & self.gates.keys()):
            while not self.gates[prompt]():
                await asyncio.sleep(0.001)
            if prompt in self.fail:
                raise GenerationError(f"injected failure for {prompt}")
        return await super().generate(requests)


class RecordingPolicy(PolicyWorker):
    """The real policy worker, keeping each chunk it trains and the count the chunk declared."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chunks: list[TrainBatch] = []
        self.declared: list[int] = []

    async def train_microbatches(self, batch, *, step_num_sequences, step_num_tokens=None):
        kept = {key: value.clone() for key, value in batch.items()}
        metrics = await super().train_microbatches(
            batch, step_num_sequences=step_num_sequences, step_num_tokens=step_num_tokens
        )
        self.chunks.append(kept)
        self.declared.append(step_num_sequences)
        return metrics


def run_with_a_drop_between_chunks(cfg) -> tuple[RecordingPolicy, list[dict[str, float]]]:
    """Step 0: e0-i0 and e0-i1 come at once (the first chunk); e0-i2 fails once that chunk
    trained (dropped: budget 1, shrink); e0-i3 comes once the drop is counted (the second
    chunk, of one group)."""
    policy = RecordingPolicy(cfg.policy, cfg.loss_fn, seed=0)
    holder: dict[str, object] = {}

    def dropped() -> bool:
        controller = holder["controller"]
        return controller.state.dropped_for_step.get(0, 0) == 1  # type: ignore[attr-defined]

    engine = GatedEngine(
        gates={"e0-i2": lambda: len(policy.chunks) >= 1, "e0-i3": dropped}, fail={"e0-i2"}
    )
    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(12)]
    parts = ControllerParts(
        trainer=policy,
        engines=[engine],
        env=CountingEnv(),
        codec=fake_codec(VOCAB),
        dataloader=PromptDataLoader(records, max_num_epochs=1, seed=0, shuffle=False),
    )
    controller = build_controller(cfg, parts)
    holder["controller"] = controller

    async def go() -> list[dict[str, float]]:
        return await asyncio.wait_for(controller.run(), timeout=60)

    return policy, asyncio.run(go())


def concatenated(chunks: list[TrainBatch]) -> TrainBatch:
    width = {chunk["input_ids"].shape[1] for chunk in chunks}
    assert len(width) == 1, width  # equal lengths: the chunks concatenate without re-padding
    return {key: torch.cat([chunk[key] for chunk in chunks]) for key in chunks[0]}


@pytest.mark.parametrize("token_level_loss", [True, False], ids=["token_mean", "sequence_mean"])
def test_a_drop_between_two_chunks_trains_the_step_on_its_actual_rows(
    tiny_model_dir: Path, token_level_loss: bool
):
    cfg = make_cfg(tiny_model_dir, f"loss_fn.token_level_loss={str(token_level_loss).lower()}")
    policy, history = run_with_a_drop_between_chunks(cfg)

    # The step trained 3 groups in two chunks (2 groups, then 1), one optimizer step, and
    # every chunk declared the same (planned) count, so the worker normalised it itself.
    assert [row["groups_trained"] for row in history] == [3]
    assert history[0]["dropped_prompts"] == 1
    assert [int(chunk["input_ids"].shape[0]) for chunk in policy.chunks] == [4, 2]
    assert policy.declared == [N * G, N * G]
    assert policy.optimizer_steps == 1
    assert history[0]["train/num_chunks"] == 2.0

    # The same 6 rows as one unchunked step with exact counts, on a fresh worker.
    whole = concatenated(policy.chunks)
    reference = PolicyWorker(cfg.policy, cfg.loss_fn, seed=0)

    async def one_step() -> dict[str, float]:
        await reference.begin_train_step()
        await reference.train_microbatches(
            whole, step_num_sequences=6, step_num_tokens=count_loss_tokens(whole)
        )
        return await reference.finish_train_step()

    expected = asyncio.run(one_step())
    assert expected["grad_norm"] > 0
    assert history[0]["train/grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    assert history[0]["train/loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
    assert history[0]["train/num_tokens"] == expected["num_tokens"]
    trained = dict(policy.model.named_parameters())
    for name, param in reference.model.named_parameters():
        torch.testing.assert_close(trained[name], param, atol=1e-6, rtol=1e-5, msg=name)
