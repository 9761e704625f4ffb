"""TorchGenerationEngine against plain transformers: tokens, logprobs, batching, updates."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tandemrl.config.models import PolicyConfig
from tandemrl.generation import create_generation_backend
from tandemrl.generation.base import GenerationError
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.models import load_causal_lm, resolve_model_path
from tandemrl.records import GenerationRequest, GenerationResult

torch.set_num_threads(1)

EOS = 1
# Different lengths, so batches are left-padded; [4] is a one-token prompt (empty prefill).
PROMPTS = [[5, 6, 7, 14], [9, 14], [4], [10, 11, 12, 13, 5, 6, 14]]


def _perturbed(model: PreTrainedModel, seed: int, scale: float) -> None:
    """Random init is nearly uniform; noise makes greedy outputs varied and discriminating."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = resolve_model_path("tiny://qwen2-counting", tmp_path_factory.mktemp("cache"))
    model = load_causal_lm(base, device="cpu")
    _perturbed(model, seed=1, scale=0.15)
    folder = tmp_path_factory.mktemp("varied")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(model_path: Path) -> PreTrainedModel:
    return load_causal_lm(model_path, device="cpu")


@pytest.fixture(scope="module")
def new_weights(model_path: Path) -> dict[str, torch.Tensor]:
    """A different state dict (the 'trainer's next version')."""
    model = load_causal_lm(model_path, device="cpu")
    _perturbed(model, seed=2, scale=0.15)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def new_model(model_path: Path, new_weights: dict[str, torch.Tensor]) -> PreTrainedModel:
    model = load_causal_lm(model_path, device="cpu")
    model.load_state_dict(new_weights)
    return model


# Every engine test runs on both decode paths: the dynamic batch ("off") and the static slot
# table of static_decode ("on": on CPU the same step as the CUDA graphs, run eagerly), the
# latter with and without one launch in flight while the host records the previous one, and
# with 3 decode steps per launch (rows join and leave every 3 steps).
DECODE_PATHS = {
    "off": {"cuda_graphs": "off"},
    "static": {"cuda_graphs": "on", "pipeline_steps": True},
    "static-unpipelined": {"cuda_graphs": "on", "pipeline_steps": False},
    "static-3-per-launch": {"cuda_graphs": "on", "pipeline_steps": True, "steps_per_launch": 3},
}
DECODE_PATH: dict[str, object] = {}


@pytest.fixture(params=sorted(DECODE_PATHS), autouse=True)
def decode_path(request: pytest.FixtureRequest) -> str:
    DECODE_PATH.clear()
    DECODE_PATH.update(DECODE_PATHS[request.param])
    return request.param


def run_with_engine(
    model_path: Path,
    body: Callable[[TorchGenerationEngine], Awaitable[None]],
    **options: object,
) -> None:
    async def main() -> None:
        engine = TorchGenerationEngine(model_path, device="cpu", **{**DECODE_PATH, **options})
        try:
            await asyncio.wait_for(body(engine), timeout=30)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def greedy_reference(
    model: PreTrainedModel, prompt: list[int], max_new_tokens: int, eos: int | None = EOS
) -> list[int]:
    """Plain ``model.generate`` on the unpadded prompt; ``eos=None``: no stop token."""
    config = copy.deepcopy(model.generation_config)
    # None would fall back to the model config's EOS; an id outside the vocabulary never stops.
    config.eos_token_id = eos if eos is not None else model.config.vocab_size + 100
    config.pad_token_id = 0
    output = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        generation_config=config,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    generated = output[0, len(prompt) :].tolist()
    assert eos is not None or len(generated) == max_new_tokens
    return generated


@torch.no_grad()
def recomputed_logprobs(
    model: PreTrainedModel, result: GenerationResult, temperature: float = 1.0
) -> list[float]:
    """log p(token) from one unbatched forward pass over prompt + completion."""
    prompt_length = len(result.prompt_token_ids)
    tokens = torch.tensor([result.prompt_token_ids + result.token_ids])
    logits = model(tokens).logits[0, prompt_length - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1).tolist()


def max_abs_diff(left: list[float], right: list[float]) -> float:
    assert len(left) == len(right)
    return max(abs(a - b) for a, b in zip(left, right, strict=True))


async def wait_for_steps(engine: TorchGenerationEngine, steps: int) -> None:
    while engine.stats.decode_steps < steps:
        await asyncio.sleep(0.001)


# --------------------------------------------------------------------------- correctness


def test_greedy_matches_generate_and_logprobs_match_forward(
    model_path: Path, model: PreTrainedModel
) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        requests = [
            GenerationRequest(f"r{i}", prompt, max_new_tokens=20, temperature=0.0)
            for i, prompt in enumerate(PROMPTS)
        ]
        results = await engine.generate(requests)
        assert [result.request_id for result in results] == ["r0", "r1", "r2", "r3"]
        assert engine.stats.max_running_batch == len(PROMPTS)
        for prompt, result in zip(PROMPTS, results, strict=True):
            reference = greedy_reference(model, prompt, 20)
            assert result.token_ids == reference
            assert result.prompt_token_ids == prompt
            assert result.finish_reason == ("stop" if reference[-1] == EOS else "length")
            assert max_abs_diff(result.logprobs, recomputed_logprobs(model, result)) < 1e-5
            assert result.token_weight_versions == [0] * len(result.token_ids)
        # The fixture's prompts cover both endings.
        assert {result.finish_reason for result in results} == {"stop", "length"}

    run_with_engine(model_path, body)


def test_sampled_logprobs_are_of_the_tempered_distribution(
    model_path: Path, model: PreTrainedModel
) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        requests = [
            GenerationRequest(
                f"r{i}", prompt, max_new_tokens=16, temperature=0.7, top_p=0.9, seed=i
            )
            for i, prompt in enumerate(PROMPTS * 2)
        ]
        results = await engine.generate(requests)
        for result in results:
            tempered = recomputed_logprobs(model, result, temperature=0.7)
            assert max_abs_diff(result.logprobs, tempered) < 1e-5
        # Same prompt, different seed: different samples (16 tokens from a flat-ish model).
        assert results[0].token_ids != results[4].token_ids

    run_with_engine(model_path, body)


def test_top_p_keeps_only_the_nucleus(model_path: Path, model: PreTrainedModel) -> None:
    prompt = PROMPTS[3]  # its first next-token distribution has one token above 0.9
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    top_token = int(first.argmax())
    assert float(first[top_token]) > 0.5

    async def body(engine: TorchGenerationEngine) -> None:
        requests = [
            GenerationRequest(f"r{seed}", prompt, max_new_tokens=1, top_p=0.5, seed=seed)
            for seed in range(20)
        ]
        results = await engine.generate(requests)
        assert {result.token_ids[0] for result in results} == {top_token}

    run_with_engine(model_path, body)


def test_seeded_requests_repeat_regardless_of_batch_company(model_path: Path) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        request = GenerationRequest("seeded", PROMPTS[0], max_new_tokens=12, seed=7)
        alone = await engine.generate([request])
        others = [GenerationRequest(f"o{i}", p, max_new_tokens=12) for i, p in enumerate(PROMPTS)]
        together = await engine.generate([*others, request])
        assert together[-1].token_ids == alone[0].token_ids

    run_with_engine(model_path, body)


def test_max_new_tokens_and_stop_tokens(model_path: Path, model: PreTrainedModel) -> None:
    prompt = PROMPTS[1]
    reference = greedy_reference(model, prompt, 12)
    stop = reference[4]
    first_stop = reference.index(stop)

    async def body(engine: TorchGenerationEngine) -> None:
        short, stopped = await engine.generate(
            [
                GenerationRequest("short", prompt, max_new_tokens=3, temperature=0.0),
                GenerationRequest(
                    "stopped", prompt, max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,)
                ),
            ]
        )
        assert short.token_ids == reference[:3]
        assert short.finish_reason == "length"
        # The stop token is part of the completion (the policy must learn to emit it).
        assert stopped.token_ids == reference[: first_stop + 1]
        assert stopped.finish_reason == "stop"
        assert len(stopped.logprobs) == len(stopped.token_weight_versions) == first_stop + 1

    run_with_engine(model_path, body)


def test_model_eos_stops_unless_disabled(model_path: Path, model: PreTrainedModel) -> None:
    prompt = PROMPTS[0]
    reference = greedy_reference(model, prompt, 20)
    assert reference[-1] == EOS and len(reference) < 20

    async def with_eos(engine: TorchGenerationEngine) -> None:
        (result,) = await engine.generate([GenerationRequest("a", prompt, 20, temperature=0.0)])
        assert result.token_ids == reference and result.finish_reason == "stop"

    async def without_eos(engine: TorchGenerationEngine) -> None:
        (result,) = await engine.generate([GenerationRequest("a", prompt, 20, temperature=0.0)])
        assert result.token_ids[: len(reference)] == reference
        assert len(result.token_ids) == 20 and result.finish_reason == "length"

    run_with_engine(model_path, with_eos)
    run_with_engine(model_path, without_eos, eos_token_ids=())


def test_generation_stops_at_max_position_embeddings(model_path: Path) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        assert engine.max_positions == 128
        prompt = [5] * 120
        (result,) = await engine.generate([GenerationRequest("long", prompt, 50)])
        assert len(prompt) + len(result.token_ids) <= 128
        if result.finish_reason == "length":
            assert len(prompt) + len(result.token_ids) == 128

    run_with_engine(model_path, body, eos_token_ids=())


def test_invalid_requests_are_refused(model_path: Path) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        with pytest.raises(ValueError, match="empty prompt"):
            await engine.generate([GenerationRequest("e", [], 4)])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.generate([GenerationRequest("v", [5, 999], 4)])
        with pytest.raises(ValueError, match="max_position_embeddings"):
            await engine.generate([GenerationRequest("p", [5] * 128, 4)])
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate([GenerationRequest("t", [5], 4, top_p=0.0)])
        assert engine.stats.decode_steps == 0

    run_with_engine(model_path, body)


# --------------------------------------------------------------------------- batching


def test_concurrent_callers_share_one_batch(model_path: Path, model: PreTrainedModel) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        calls = [
            engine.generate(
                [
                    GenerationRequest(f"c{call}-{i}", p, 8, temperature=0.0)
                    for i, p in enumerate(PROMPTS)
                ]
            )
            for call in range(3)
        ]
        outputs = await asyncio.gather(*calls)
        # All 12 sequences were decoded together: one step per token position, not per call.
        assert engine.stats.max_running_batch == 12
        assert engine.stats.decode_steps == 8
        for results in outputs:
            for prompt, result in zip(PROMPTS, results, strict=True):
                assert result.token_ids == greedy_reference(model, prompt, 8, eos=None)

    run_with_engine(model_path, body, eos_token_ids=())


def test_requests_join_a_running_batch(model_path: Path, model: PreTrainedModel) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        first = asyncio.ensure_future(
            engine.generate([GenerationRequest("long", PROMPTS[3], 60, temperature=0.0)])
        )
        await wait_for_steps(engine, 5)
        late = await engine.generate(
            [GenerationRequest(f"late{i}", p, 6, temperature=0.0) for i, p in enumerate(PROMPTS)]
        )
        assert not first.done()  # the late requests finished while the long one still ran
        (long_result,) = await first
        assert engine.stats.joined_running_batch == len(PROMPTS)
        assert engine.stats.max_running_batch == 1 + len(PROMPTS)
        assert long_result.token_ids == greedy_reference(model, PROMPTS[3], 60, eos=None)
        assert max_abs_diff(long_result.logprobs, recomputed_logprobs(model, long_result)) < 1e-5
        for prompt, result in zip(PROMPTS, late, strict=True):
            assert result.token_ids == greedy_reference(model, prompt, 6, eos=None)
            assert max_abs_diff(result.logprobs, recomputed_logprobs(model, result)) < 1e-5

    run_with_engine(model_path, body, eos_token_ids=())


def test_max_batch_size_caps_the_running_batch(model_path: Path, model: PreTrainedModel) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        requests = [
            GenerationRequest(f"r{i}", p, 5 + i, temperature=0.0) for i, p in enumerate(PROMPTS)
        ]
        results = await engine.generate(requests)
        assert engine.stats.max_running_batch == 2
        for request, result in zip(requests, results, strict=True):
            assert result.token_ids == greedy_reference(
                model, request.prompt_token_ids, request.max_new_tokens, eos=None
            )

    run_with_engine(model_path, body, max_batch_size=2, eos_token_ids=())


@pytest.mark.parametrize("admission_batch", [1, 3])
def test_admission_waits_for_a_group_of_free_rows(
    model_path: Path, model: PreTrainedModel, admission_batch: int
) -> None:
    """Rows free one per step (distinct lengths); queued requests enter ``admission_batch`` at
    a time while more wait than fit, yet every result is what an unbatched generate gives."""
    lengths = [2, 3, 4, 5, 6, 7, 8, 9]

    async def body(engine: TorchGenerationEngine) -> None:
        requests = [
            GenerationRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], n, temperature=0.0)
            for i, n in enumerate(lengths)
        ]
        results = await engine.generate(requests)
        assert engine.stats.max_running_batch == 4
        # One admission of 4, then one per freed row, or one per admission_batch freed rows
        # and a last one for what is left (all of it fits). Three steps per launch free the
        # rows two at a time (lengths 2 and 3 end in the first launch, 4 and 5 in the second):
        # 4, 2, 2 by ones; by threes, 4, then 4 once the batch is empty.
        if engine.steps_per_launch == 1:
            assert engine.stats.admissions == (5 if admission_batch == 1 else 3)
        else:
            assert engine.stats.admissions == (3 if admission_batch == 1 else 2)
        for request, result in zip(requests, results, strict=True):
            assert result.token_ids == greedy_reference(
                model, request.prompt_token_ids, request.max_new_tokens, eos=None
            )

    run_with_engine(
        model_path, body, max_batch_size=4, admission_batch=admission_batch, eos_token_ids=()
    )


def test_admission_batch_must_be_positive(model_path: Path) -> None:
    with pytest.raises(ValueError, match=r"policy\.generation\.torch\.admission_batch"):
        TorchGenerationEngine(model_path, device="cpu", admission_batch=0)
    with pytest.raises(ValueError, match=r"policy\.generation\.torch\.steps_per_launch=0"):
        TorchGenerationEngine(model_path, device="cpu", steps_per_launch=0)
    assert TorchGenerationEngine(model_path, device="cpu", cuda_graphs="on").steps_per_launch == 1


# --------------------------------------------------------------------------- weight updates


@pytest.mark.parametrize("recompute", [True, False])
def test_update_weights_mid_generation(
    model_path: Path,
    model: PreTrainedModel,
    new_model: PreTrainedModel,
    new_weights: dict[str, torch.Tensor],
    recompute: bool,
) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        running = asyncio.ensure_future(
            engine.generate([GenerationRequest("r", PROMPTS[0], 40, temperature=0.0)])
        )
        await wait_for_steps(engine, 5)
        await engine.update_weights(1, new_weights)
        assert await engine.weight_version() == 1
        (result,) = await running
        versions = result.token_weight_versions
        switch = versions.index(1)
        assert 5 <= switch < 40
        assert versions == [0] * switch + [1] * (40 - switch)
        assert result.start_weight_version == 0 and result.end_weight_version == 1
        old_part = recomputed_logprobs(model, result)[:switch]
        assert max_abs_diff(result.logprobs[:switch], old_part) < 1e-5
        new_part = recomputed_logprobs(new_model, result)[switch:]
        if recompute:
            # The cache was rebuilt under the new weights: exactly the trainer's recomputation.
            assert max_abs_diff(result.logprobs[switch:], new_part) < 1e-5
            assert engine.stats.kv_recomputes == 1
        else:
            # Stale keys/values from the old weights: close to nothing the trainer recomputes.
            assert max_abs_diff(result.logprobs[switch:], new_part) > 1e-3
            assert engine.stats.kv_recomputes == 0

        # A request after the update runs entirely on the new weights.
        (after,) = await engine.generate([GenerationRequest("after", PROMPTS[2], 10)])
        assert after.start_weight_version == 1 and after.token_weight_versions == [1] * 10
        assert max_abs_diff(after.logprobs, recomputed_logprobs(new_model, after)) < 1e-5

    run_with_engine(
        model_path,
        body,
        eos_token_ids=(),
        recompute_kv_cache_after_weight_updates=recompute,
    )


def test_update_weights_checks_names(
    model_path: Path, new_weights: dict[str, torch.Tensor]
) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        with pytest.raises(KeyError, match="unknown parameter"):
            await engine.update_weights(1, {**new_weights, "bogus.weight": torch.zeros(1)})
        partial = {k: v for k, v in new_weights.items() if "layers.0." not in k}
        with pytest.raises(KeyError, match="missing parameters"):
            await engine.update_weights(1, partial)
        with pytest.raises(TypeError, match="state dict"):
            await engine.update_weights(1, "weights.safetensors")
        name = "model.layers.0.mlp.up_proj.weight"
        wrong_shape = {**new_weights, name: new_weights[name][:-1]}
        with pytest.raises(ValueError, match=f"shape mismatch for .*{name}"):
            await engine.update_weights(1, wrong_shape)
        assert await engine.weight_version() == 0  # a refused update loads nothing
        # A tied model may receive the shared tensor under one name only.
        untied_names = {k: v for k, v in new_weights.items() if k != "lm_head.weight"}
        await engine.update_weights(3, untied_names)
        assert await engine.weight_version() == 3
        assert torch.equal(engine.model.lm_head.weight, new_weights["model.embed_tokens.weight"])
        # The copy plan is checked once per set of names: a later update with the same names
        # (the weight sync's case) loads new values through the cached plan.
        doubled = {k: 2 * v for k, v in untied_names.items()}
        await engine.update_weights(4, doubled)
        assert torch.equal(engine.model.lm_head.weight, doubled["model.embed_tokens.weight"])
        for name, tensor in doubled.items():
            assert torch.equal(engine.model.state_dict()[name], tensor.to(engine.model.dtype))

    run_with_engine(model_path, body)


# --------------------------------------------------------------------------- sleep, abort


def test_sleep_freezes_decoding_and_wake_resumes(model_path: Path, model: PreTrainedModel) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        running = asyncio.ensure_future(
            engine.generate([GenerationRequest("r", PROMPTS[1], 40, temperature=0.0)])
        )
        await wait_for_steps(engine, 3)
        await engine.sleep()
        assert engine.asleep
        frozen_at = engine.stats.decode_steps
        queued = asyncio.ensure_future(
            engine.generate([GenerationRequest("q", PROMPTS[2], 5, temperature=0.0)])
        )
        await asyncio.sleep(0.3)
        assert engine.stats.decode_steps == frozen_at
        assert not running.done() and not queued.done()
        assert await engine.frozen_time() >= 0.3
        await engine.wake()
        assert not engine.asleep
        (result,) = await running
        (queued_result,) = await queued
        stood_down = await engine.frozen_time()
        assert 0.3 <= stood_down < 5
        await asyncio.sleep(0.05)
        assert await engine.frozen_time() == stood_down == engine.asleep_seconds  # clock stopped
        assert result.token_ids == greedy_reference(model, PROMPTS[1], 40, eos=None)
        assert queued_result.token_ids == greedy_reference(model, PROMPTS[2], 5, eos=None)

    run_with_engine(model_path, body, eos_token_ids=())


def test_abort_running_and_queued_requests(model_path: Path, model: PreTrainedModel) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        # max_batch_size=1: "running" decodes, "queued" waits its turn, "kept" after it.
        call = asyncio.ensure_future(
            engine.generate(
                [
                    GenerationRequest("running", PROMPTS[0], 60, temperature=0.0),
                    GenerationRequest("queued", PROMPTS[1], 60, temperature=0.0),
                    GenerationRequest("kept", PROMPTS[2], 6, temperature=0.0),
                ]
            )
        )
        await wait_for_steps(engine, 4)
        await engine.abort(["running", "queued", "unknown-id"])
        running, queued, kept = await call
        assert running.finish_reason == "aborted"
        assert 4 <= len(running.token_ids) < 60
        assert (
            running.token_ids
            == greedy_reference(model, PROMPTS[0], 60, eos=None)[: len(running.token_ids)]
        )
        assert len(running.logprobs) == len(running.token_weight_versions) == len(running.token_ids)
        assert queued.finish_reason == "aborted" and queued.token_ids == []
        assert kept.finish_reason == "length"
        assert kept.token_ids == greedy_reference(model, PROMPTS[2], 6, eos=None)

    run_with_engine(model_path, body, max_batch_size=1, eos_token_ids=())


def test_abort_while_asleep(model_path: Path) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        call = asyncio.ensure_future(engine.generate([GenerationRequest("r", PROMPTS[0], 60)]))
        await wait_for_steps(engine, 2)
        await engine.sleep()
        await engine.abort(["r"])
        (result,) = await call
        assert result.finish_reason == "aborted"
        await engine.wake()

    run_with_engine(model_path, body, eos_token_ids=())


def test_cancelled_caller_frees_its_rows(model_path: Path) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(
                engine.generate([GenerationRequest("slow", PROMPTS[0], 120)]), timeout=0.05
            )
        # A step already running when the caller gave up may finish; after it the rows go.
        for _ in range(2000):
            if engine.rows_in_flight == 0:
                break
            await asyncio.sleep(0.005)
        assert engine.rows_in_flight == 0
        steps = engine.stats.decode_steps
        await asyncio.sleep(0.1)
        assert engine.stats.decode_steps == steps  # nothing left to decode
        (result,) = await engine.generate([GenerationRequest("next", PROMPTS[1], 3)])
        assert result.finish_reason == "length"

    run_with_engine(model_path, body, eos_token_ids=())


def test_shutdown_finishes_inflight_requests_as_aborted(model_path: Path) -> None:
    async def main() -> None:
        engine = TorchGenerationEngine(model_path, device="cpu", eos_token_ids=())
        call = asyncio.ensure_future(engine.generate([GenerationRequest("r", PROMPTS[0], 100)]))
        await wait_for_steps(engine, 2)
        await engine.shutdown()
        (result,) = await call
        assert result.finish_reason == "aborted"
        with pytest.raises(GenerationError, match="shut down"):
            await engine.generate([GenerationRequest("late", PROMPTS[0], 2)])

    asyncio.run(main())


def test_caller_cancelled_while_queued_is_never_decoded(model_path: Path) -> None:
    async def body(engine: TorchGenerationEngine) -> None:
        await engine.sleep()
        call = asyncio.ensure_future(engine.generate([GenerationRequest("q", PROMPTS[0], 50)]))
        await asyncio.sleep(0.01)  # enqueued, frozen
        call.cancel()
        await engine.wake()
        await asyncio.sleep(0.05)
        assert engine.stats.decode_steps == 0
        (result,) = await engine.generate([GenerationRequest("next", PROMPTS[1], 3)])
        assert result.finish_reason == "length"
        assert engine.stats.decode_steps == 3

    run_with_engine(model_path, body, eos_token_ids=())


def test_create_generation_backend_follows_policy_config(model_path: Path) -> None:
    cfg = PolicyConfig.model_validate(
        {
            "device": "cpu",
            "precision": "float32",
            "generation": {"max_batch_size": 3, "torch": {"steps_per_launch": 2}},
        }
    )

    async def main() -> None:
        engine = create_generation_backend(
            cfg, model_path, recompute_kv_cache_after_weight_updates=True, seed=5
        )
        assert isinstance(engine, TorchGenerationEngine)
        assert engine.max_batch_size == 3
        assert engine.recompute_kv_cache_after_weight_updates
        assert engine.device.type == "cpu" and engine.model.dtype == torch.float32
        assert engine.steps_per_launch == 2 and engine.static_decode
        results = await engine.generate(
            [GenerationRequest(f"r{i}", p, 2) for i, p in enumerate(PROMPTS)]
        )
        assert [len(result.token_ids) for result in results] == [2] * len(PROMPTS)
        assert engine.stats.max_running_batch == 3
        await engine.shutdown()

    asyncio.run(main())
    fake = cfg.model_copy(
        update={"generation": cfg.generation.model_copy(update={"backend": "fake"})}
    )
    assert isinstance(create_generation_backend(fake, model_path), FakeGenerationBackend)
    megatron = cfg.model_copy(
        update={"generation": cfg.generation.model_copy(update={"backend": "megatron"})}
    )
    with pytest.raises(ValueError, match=r"policy\.generation\.backend='megatron'"):
        create_generation_backend(megatron, model_path)
