"""The vLLM backend against the torch engine, a forward pass, and a freshly started engine."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

import psutil
import pytest
import torch
from vllm_helpers import (
    perturbed_model_dir,
    requests_for,
    run,
    teacher_forced_logprobs,
    vllm_policy_cfg,
)

from tandemrl.generation.base import GenerationError
from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.generation.vllm_engine import (
    VLLM_MISSING_MESSAGE,
    VllmGenerationEngine,
    serialize_state_dict,
)
from tandemrl.models import load_causal_lm
from tandemrl.records import GenerationRequest, GenerationResult
from tandemrl.sigterm import blocked_signals, sigterm_blocked

PROMPTS = ["583=", "12=", "7=", "9045=", "31=", "66=", "2=", "808="]


@pytest.fixture(scope="module")
def prompts(encode) -> list[list[int]]:
    return [encode(text) for text in PROMPTS]


def assert_versions(result: GenerationResult, allowed: set[int]) -> None:
    assert len(result.token_weight_versions) == len(result.token_ids) == len(result.logprobs)
    assert set(result.token_weight_versions) <= allowed
    assert result.token_weight_versions == sorted(result.token_weight_versions)


# ---------------------------------------------------------------------- refusals


def test_refuses_to_start_without_vllm(monkeypatch, tiny_model_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(ImportError, match=re.escape(VLLM_MISSING_MESSAGE)):
        VllmGenerationEngine(vllm_policy_cfg(), tiny_model_dir)


def test_refuses_sync_engine_and_colocation(tiny_model_dir: Path) -> None:
    cfg = vllm_policy_cfg()
    cfg.generation.vllm_cfg.async_engine = False
    with pytest.raises(ValueError, match=r"policy\.generation\.vllm_cfg\.async_engine"):
        VllmGenerationEngine(cfg, tiny_model_dir)
    cfg = vllm_policy_cfg()
    cfg.generation.colocated.enabled = True
    with pytest.raises(ValueError, match=r"policy\.generation\.colocated\.enabled"):
        VllmGenerationEngine(cfg, tiny_model_dir)


# ---------------------------------------------------------------------- generation


def test_greedy_generation_matches_torch_engine(
    engine: VllmGenerationEngine, tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    requests = requests_for(prompts, prefix="greedy", max_new_tokens=12)
    version = engine.current_weight_version
    vllm_results = run(engine.generate(requests))

    async def torch_generate() -> list[GenerationResult]:
        torch_engine = TorchGenerationEngine(tiny_model_dir, device="cpu", dtype="float32")
        try:
            return await torch_engine.generate(requests)
        finally:
            await torch_engine.shutdown()

    torch_results = run(torch_generate())
    for ours, reference in zip(vllm_results, torch_results, strict=True):
        assert ours.request_id == reference.request_id
        assert ours.token_ids == reference.token_ids
        assert ours.finish_reason == reference.finish_reason
        assert ours.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
        assert ours.start_weight_version == version
        assert_versions(ours, {version})


def test_sampled_logprobs_are_of_the_tempered_distribution(
    engine: VllmGenerationEngine, tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    temperature = 0.7
    requests = requests_for(
        prompts, prefix="tempered", max_new_tokens=8, temperature=temperature, seed=100
    )
    results = run(engine.generate(requests))
    again = run(
        engine.generate(
            requests_for(
                prompts, prefix="again", max_new_tokens=8, temperature=temperature, seed=100
            )
        )
    )
    largest_gap_to_raw = 0.0
    for request, result, repeat in zip(requests, results, again, strict=True):
        # A request's seed fixes its samples, whatever else shares the batch.
        assert repeat.token_ids == result.token_ids
        tempered = teacher_forced_logprobs(
            tiny_model_dir, request.prompt_token_ids, result.token_ids, temperature
        )
        raw = teacher_forced_logprobs(
            tiny_model_dir, request.prompt_token_ids, result.token_ids, 1.0
        )
        assert result.logprobs == pytest.approx(tempered, abs=1e-4)
        largest_gap_to_raw = max(
            largest_gap_to_raw, max(abs(a - b) for a, b in zip(result.logprobs, raw, strict=True))
        )
    # The comparison above can tell the two conventions apart on this model.
    assert largest_gap_to_raw > 1e-2


# ---------------------------------------------------------------------- weight updates


def test_weight_update_equals_fresh_engine_with_tied_embeddings(
    engine: VllmGenerationEngine,
    tiny_model_dir: Path,
    prompts: list[list[int]],
    tmp_path: Path,
    restore_weights: None,
) -> None:
    assert load_causal_lm(tiny_model_dir, "float32", "cpu").config.tie_word_embeddings
    new_dir = perturbed_model_dir(tiny_model_dir, tmp_path / "updated", seed=1, scale=0.05)
    new_weights = load_causal_lm(new_dir, "float32", "cpu").state_dict()
    before = run(engine.generate(requests_for(prompts, prefix="before", max_new_tokens=8)))

    version = engine.current_weight_version + 1
    run(engine.update_weights(version, new_weights))
    assert run(engine.weight_version()) == version

    def batch(prefix: str):
        greedy = requests_for(prompts, prefix=f"{prefix}-greedy", max_new_tokens=8)
        sampled = requests_for(
            prompts, prefix=f"{prefix}-sampled", max_new_tokens=8, temperature=1.0, seed=7
        )
        return greedy + sampled

    updated = run(engine.generate(batch("updated")))
    updated_checksum = run(engine.worker_weight_checksum())

    # Started as in a Ray worker, which inherits the raylet's blocked SIGTERM
    # (tandemrl.sigterm): vLLM's engine core must still stop on the SIGTERM vLLM sends it.
    children_before = {child.pid for child in psutil.Process().children()}
    with sigterm_blocked():
        fresh = VllmGenerationEngine(vllm_policy_cfg(), new_dir, seed=0, weight_version=version)
    engine_cores = [c for c in psutil.Process().children() if c.pid not in children_before]
    assert engine_cores
    assert all(signal.SIGTERM not in blocked_signals(core.pid) for core in engine_cores)
    try:
        reference = run(fresh.generate(batch("fresh")))
        fresh_checksum = run(fresh.worker_weight_checksum())
    finally:
        fresh.shutdown_sync()

    assert updated_checksum == pytest.approx(fresh_checksum, rel=1e-6)
    for ours, theirs in zip(updated, reference, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
        assert_versions(ours, {version})
        assert ours.start_weight_version == version
    # Against the new weights' own forward pass, and different from the old model's output.
    for prompt, ours in zip(prompts, updated[: len(prompts)], strict=True):
        expected = teacher_forced_logprobs(new_dir, prompt, ours.token_ids, 1.0)
        assert ours.logprobs == pytest.approx(expected, abs=1e-4)
    changed = [
        old.token_ids != new.token_ids
        or max(abs(a - b) for a, b in zip(old.logprobs, new.logprobs, strict=False)) > 1e-2
        for old, new in zip(before, updated[: len(prompts)], strict=True)
    ]
    assert all(changed)

    # The fresh engine is shut down: its calls refuse, its loop thread is gone.
    with pytest.raises(GenerationError, match="shut down"):
        run(fresh.generate(batch("late")))
    assert not fresh._thread.is_alive()
    assert not any(core.is_running() and core.status() != "zombie" for core in engine_cores)


def test_update_in_flight_labels_each_token_with_its_version(
    engine: VllmGenerationEngine,
    tiny_model_dir: Path,
    prompts: list[list[int]],
    original_weights: dict[str, torch.Tensor],
    tmp_path: Path,
    restore_weights: None,
) -> None:
    new_weights = load_causal_lm(
        perturbed_model_dir(tiny_model_dir, tmp_path / "noisy", seed=2, scale=0.05),
        "float32",
        "cpu",
    ).state_dict()
    max_new_tokens = 100  # prompt + completion stays inside max_model_len = 128
    baseline = run(
        engine.generate(requests_for(prompts, prefix="baseline", max_new_tokens=max_new_tokens))
    )

    async def generate_across_update(attempt: int, delay_s: float, new: int):
        requests = requests_for(prompts, prefix=f"cross{attempt}", max_new_tokens=max_new_tokens)
        task = asyncio.create_task(engine.generate(requests))
        await asyncio.sleep(delay_s)
        await engine.update_weights(new, new_weights)
        return await task

    crossed = 0
    # Timing decides where the update lands; a few delays make a crossing all but certain.
    for attempt, delay_s in enumerate([0.2, 0.05, 0.5, 0.1, 1.0]):
        # Every attempt starts from the original weights, so the greedy prefix is known.
        old = engine.current_weight_version + 1
        run(engine.update_weights(old, original_weights))
        new = old + 1
        results = run(generate_across_update(attempt, delay_s, new))
        for result, reference in zip(results, baseline, strict=True):
            assert result.start_weight_version == old
            assert_versions(result, {old, new})
            switch = result.token_weight_versions.count(old)
            # Tokens labelled with the old version are exactly what the old weights produce.
            assert result.token_ids[:switch] == reference.token_ids[:switch]
            if 0 < switch < len(result.token_ids):
                crossed += 1
        if crossed:
            break
    assert crossed > 0


def test_state_dict_payload_keeps_tied_tensors(tiny_model_dir: Path) -> None:
    from safetensors.torch import load

    state = load_causal_lm(tiny_model_dir, "float32", "cpu").state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    loaded = load(serialize_state_dict(state))
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)


# ---------------------------------------------------------------------- abort, stand-down


def test_abort_queued_in_flight_and_just_submitted_requests(
    engine: VllmGenerationEngine, prompts: list[list[int]]
) -> None:
    async def scenario():
        # Queued: the scheduler is paused, so nothing of these has run when they are aborted.
        await engine.sleep()
        queued = requests_for(prompts[:2], prefix="queued", max_new_tokens=100)
        queued_task = asyncio.create_task(engine.generate(queued))
        await asyncio.sleep(0.2)
        await engine.abort([request.request_id for request in queued])
        queued_results = await queued_task
        await engine.wake()
        frozen = await engine.frozen_time()

        # In flight: two of four long requests are aborted while the others run on.
        running = requests_for(prompts[:4], prefix="running", max_new_tokens=110)
        running_task = asyncio.create_task(engine.generate(running))
        await asyncio.sleep(0.1)
        await engine.abort([running[0].request_id, running[1].request_id, "no-such-request"])
        running_results = await running_task

        # Just submitted: the abort is scheduled before the request reaches vLLM.
        fresh = requests_for(prompts[:2], prefix="fresh", max_new_tokens=100)
        fresh_task = asyncio.create_task(engine.generate(fresh))
        await asyncio.sleep(0)
        await engine.abort([request.request_id for request in fresh])
        fresh_results = await fresh_task
        return queued_results, frozen, running_results, fresh_results

    queued_results, frozen, running_results, fresh_results = run(scenario())
    assert frozen >= 0.2
    for result in queued_results:
        assert result.finish_reason == "aborted"
        assert result.token_ids == []
    for result in running_results[:2] + fresh_results:
        assert result.finish_reason == "aborted"
        assert len(result.token_ids) < 100
        assert_versions(result, {engine.current_weight_version})
    for result in running_results[2:]:
        assert result.finish_reason in ("stop", "length")
    # The engine still serves normally afterwards.
    after = run(engine.generate(requests_for(prompts[:2], prefix="after-abort")))
    assert all(result.finish_reason in ("stop", "length") for result in after)


def test_duplicate_in_flight_request_id_is_refused(
    engine: VllmGenerationEngine, prompts: list[list[int]]
) -> None:
    requests = requests_for(prompts[:1], prefix="dup") * 2
    with pytest.raises(ValueError, match="already in flight"):
        run(engine.generate(requests))


def test_invalid_request_is_refused_and_its_batch_stopped(
    engine: VllmGenerationEngine, prompts: list[list[int]]
) -> None:
    too_long = requests_for([prompts[0] * 40], prefix="too-long")  # 160 tokens > 128
    batch = requests_for(prompts[:3], prefix="with-bad", max_new_tokens=100) + too_long
    with pytest.raises(ValueError, match="too-long"):
        run(engine.generate(batch))
    # Nothing of the batch is left in flight, and the engine keeps serving.
    assert engine._inflight == set()
    after = run(engine.generate(requests_for(prompts[:2], prefix="after-bad")))
    assert all(result.finish_reason in ("stop", "length") for result in after)


def test_recompute_mode_continues_in_flight_sequences_under_new_weights(
    engine: VllmGenerationEngine,
    tiny_model_dir: Path,
    prompts: list[list[int]],
    original_weights: dict[str, torch.Tensor],
    tmp_path: Path,
    restore_weights: None,
) -> None:
    new_weights = load_causal_lm(
        perturbed_model_dir(tiny_model_dir, tmp_path / "noisy", seed=3, scale=0.05),
        "float32",
        "cpu",
    ).state_dict()
    max_new_tokens = 100
    recompute = VllmGenerationEngine(
        vllm_policy_cfg(), tiny_model_dir, seed=0, recompute_kv_cache_after_weight_updates=True
    )

    async def generate_across_update(attempt: int, delay_s: float, new: int):
        requests = requests_for(prompts, prefix=f"re{attempt}", max_new_tokens=max_new_tokens)
        task = asyncio.create_task(recompute.generate(requests))
        await asyncio.sleep(delay_s)
        await recompute.update_weights(new, new_weights)
        return await task

    crossed: list[tuple[list[int], GenerationResult, int]] = []
    try:
        for attempt, delay_s in enumerate([0.2, 0.05, 0.5, 0.1, 1.0]):
            old = recompute.current_weight_version + 1
            run(recompute.update_weights(old, original_weights))
            results = run(generate_across_update(attempt, delay_s, old + 1))
            for prompt, result in zip(prompts, results, strict=True):
                assert_versions(result, {old, old + 1})
                switch = result.token_weight_versions.count(old)
                if 0 < switch < len(result.token_ids):
                    crossed.append((prompt, result, switch))
            if crossed:
                break
    finally:
        recompute.shutdown_sync()
    assert crossed

    # After the switch the sequence continues exactly as the new weights continue its text
    # from scratch: its keys/values were recomputed, none of the old weights' are left.
    run(engine.update_weights(engine.current_weight_version + 1, new_weights))
    continuations = run(
        engine.generate(
            [
                GenerationRequest(
                    request_id=f"continue-{index}",
                    prompt_token_ids=prompt + result.token_ids[:switch],
                    max_new_tokens=len(result.token_ids) - switch,
                    temperature=0.0,
                )
                for index, (prompt, result, switch) in enumerate(crossed)
            ]
        )
    )
    for (_, result, switch), continuation in zip(crossed, continuations, strict=True):
        assert continuation.token_ids == result.token_ids[switch:]
        assert continuation.logprobs == pytest.approx(result.logprobs[switch:], abs=1e-4)
