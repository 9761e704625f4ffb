"""RolloutManager's records: generation requests and row metadata carry every field by name."""

from __future__ import annotations

import asyncio
import dataclasses
import zlib

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.rollout.failures import FailureKind, RolloutDropped
from tandemrl.rollout.ledger import StagedSibling
from tandemrl.training.fake import FakeTrainer

G = 4


def make_manager(*overrides: str):
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            "grpo.num_prompts_per_step=2",
            f"grpo.num_generations_per_prompt={G}",
            f"policy.train_global_batch_size={2 * G}",
            f"policy.train_micro_batch_size={2 * G}",
            "async_rl.min_groups_for_streaming_train=2",
            "policy.generation.max_new_tokens=3",
            "policy.generation.temperature=0.7",
            "policy.generation.top_p=0.9",
            "grpo.overlong_filtering=true",
            *overrides,
        ),
    )
    controller = build_fake_controller(
        cfg, trainer=FakeTrainer(), engines=[FakeGenerationBackend(seed=3, completion_tokens=3)]
    )
    return controller.rollout_manager, controller.dataloader.next_item()


def test_requests_carry_every_field() -> None:
    manager, item = make_manager()
    group = manager.reserve(item, start_weight=0, target_step=0)
    requests = manager._requests(group, [0, 2], 5, [7, 8], 3)
    assert [r.request_id for r in requests] == [f"{item.prompt_id}/0/a5", f"{item.prompt_id}/2/a5"]
    for sibling, request in zip([0, 2], requests, strict=True):
        assert request.prompt_token_ids == [7, 8]
        assert request.max_new_tokens == 3
        assert request.temperature == 0.7
        assert request.top_p == 0.9
        assert request.stop_token_ids == manager.sampling.stop_token_ids
        expected_seed = zlib.crc32(f"{manager.seed}|{item.prompt_id}|{sibling}|5".encode())
        assert request.seed == expected_seed & 0x7FFFFFFF


def test_rows_carry_every_metadata_field_and_match_the_block() -> None:
    manager, item = make_manager()
    group = manager.reserve(item, start_weight=0, target_step=0)
    engine = manager.generation.engines[0]
    prompt_ids = manager.codec.encode(item.prompt)
    results = asyncio.run(
        engine.generate(manager._requests(group, list(range(G)), 1, prompt_ids, 3))
    )
    results[1].token_ids = results[1].token_ids[:2]  # stopped early: not truncated, kept
    results[1].logprobs = results[1].logprobs[:2]
    results[1].finish_reason = "stop"
    scored = asyncio.run(manager._score_all(group, results))
    for sibling, (result, outcome) in enumerate(zip(results, scored, strict=True)):
        group.staged[sibling] = StagedSibling(result=result, env_result=outcome)
    block, metas = manager._rows(group)
    rows = block.rows()
    for sibling, meta in enumerate(metas):
        result = results[sibling]
        assert meta.sample_id == f"{item.prompt_id}/{sibling}" == block.sample_ids[sibling]
        assert meta.group_id == item.prompt_id
        assert meta.sibling_index == sibling
        assert meta.reward == scored[sibling].reward
        truncated = sibling != 1
        assert meta.truncated is truncated
        assert meta.sample_mask == (0.0 if truncated else 1.0)  # overlong filtering
        assert meta.num_prompt_tokens == len(prompt_ids)
        assert meta.num_completion_tokens == len(result.token_ids)
        assert meta.start_weight_version == result.start_weight_version
        assert meta.end_weight_version == result.end_weight_version
        row = rows[meta.sample_id]
        assert row["input_ids"].tolist() == prompt_ids + result.token_ids
        assert row["reward"].item() == torch.tensor(meta.reward).item()
        assert row["sample_mask"].item() == meta.sample_mask


def test_completions_are_cut_to_fit_max_total_sequence_length() -> None:
    manager, item = make_manager("policy.max_total_sequence_length=10")
    group = manager.reserve(item, start_weight=0, target_step=0)
    assert manager.sampling.max_total_tokens == 10
    assert manager._completion_budget(group, [5] * 4) == 3  # max_new_tokens
    assert manager._completion_budget(group, [5] * 8) == 2  # 10 - 8
    with pytest.raises(RolloutDropped) as dropped:
        manager._completion_budget(group, [5] * 10)
    assert "policy.max_total_sequence_length=10" in dropped.value.record.cause
    assert dropped.value.record.kind is FailureKind.DATA


def test_a_prompt_the_codec_cannot_render_drops_its_group_with_the_reason() -> None:
    manager, item = make_manager()
    group = manager.reserve(item, start_weight=0, target_step=0)

    def refuse(prompt_item):
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant")

    manager.codec = dataclasses.replace(manager.codec, render_prompt=refuse)
    with pytest.raises(RolloutDropped) as dropped:
        manager._prompt_ids(group)
    assert "roles must alternate" in dropped.value.record.cause
    assert item.prompt_id in dropped.value.record.cause
