"""The architecture matrix: one tiny chat preset per family people post-train, through every path.

Per family: the torch engine (transformers-cache decode, and the static-cache decode where the
family has it, or a refusal of ``cuda_graphs: on`` and a logged fallback where it has not), the
trainer (padded and packed micro-batches, the chunked logprob head, against a plain forward),
weight sync into the engine, checkpoint save and load, stop on every EOS id of the generation
config, and two synchronous GRPO steps in chat format whose importance weight is 1. vLLM runs
the same families in tests/vllm (its own environment). docs/models.md is the table these tests
hold the code to.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.config.models import LossConfig, PolicyConfig
from tandemrl.controller.actor import run_text_codec
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.dataplane.rows import make_training_row
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation import torch_engine
from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from tandemrl.models.special_tokens import model_eos_token_ids, stop_token_ids
from tandemrl.records import GenerationRequest, GenerationResult
from tandemrl.training.batch import collate_rows, count_loss_tokens
from tandemrl.training.policy_worker import PolicyWorker

torch.set_num_threads(1)


@dataclass(frozen=True)
class Family:
    static_decode: bool  # the static-cache decode path (else the transformers cache)
    packing: bool  # policy.sequence_packing: on


MATRIX = {
    "llama3": Family(static_decode=True, packing=True),
    "qwen2.5": Family(static_decode=True, packing=True),
    "qwen3": Family(static_decode=True, packing=True),
    "mistral": Family(static_decode=True, packing=True),
    "gemma3": Family(static_decode=False, packing=False),
    "phi3": Family(static_decode=True, packing=True),
    "qwen3-moe": Family(static_decode=False, packing=True),
}

# Engine and trainer compute the same float32 logprobs by different code: they agree to this.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("matrix-models")


@pytest.fixture(params=sorted(MATRIX))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def model_dir(family: str, models_dir: Path) -> Path:
    return resolve_model_path(f"tiny://{family}", models_dir)


def make_worker(model_dir: Path, **overrides) -> PolicyWorker:
    overrides.setdefault("device", "cpu")
    overrides.setdefault("train_micro_batch_size", 3)
    return PolicyWorker(PolicyConfig(model_name=str(model_dir), **overrides), LossConfig(), seed=0)


def make_engine(model_dir: Path, cuda_graphs: str) -> TorchGenerationEngine:
    return TorchGenerationEngine(
        model_dir, device="cpu", dtype="float32", cuda_graphs=cuda_graphs, max_batch_size=8
    )


def requests(count: int = 4, max_new_tokens: int = 10) -> list[GenerationRequest]:
    # Prompts of 2 to 14 tokens: longer than the Gemma preset's sliding window of 8.
    tokens = [5, 30, 41, 7, 60, 12, 75, 33, 9, 48, 21, 66, 17, 54]
    prompts = [tokens[: 2 + 4 * (index % 4)] for index in range(count)]
    return [
        GenerationRequest(f"r{index}", prompt, max_new_tokens, 1.0, 1.0, (), seed=index)
        for index, prompt in enumerate(prompts)
    ]


def generate(engine: TorchGenerationEngine, batch: list[GenerationRequest]):
    async def run() -> list[GenerationResult]:
        try:
            return await engine.generate(batch)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def rows_of(results: list[GenerationResult]):
    rows = []
    for index, result in enumerate(results):
        row = make_training_row(
            result.prompt_token_ids,
            result.token_ids,
            result.logprobs,
            reward=float(index % 2),
            sample_mask=1.0,
        )
        row["advantages"] = torch.tensor(1.0 if index % 2 else -1.0)
        rows.append(row)
    return collate_rows(rows, pad_token_id=0)


def assert_trainer_agrees(worker: PolicyWorker, results: list[GenerationResult]) -> None:
    """The trainer's logprob of every generated token is the engine's."""
    batch = rows_of(results)
    trainer = asyncio.run(worker.get_logprobs(batch))
    mask = batch["token_mask"] > 0
    torch.testing.assert_close(
        trainer[mask], batch["generation_logprobs"][mask], atol=LOGPROB_ATOL, rtol=0
    )


def test_engine_decodes_with_the_trainers_logprobs(
    family: str, model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker = make_worker(model_dir)
    dynamic = make_engine(model_dir, "off")
    assert not dynamic.static_decode
    assert_trainer_agrees(worker, generate(dynamic, requests()))
    if MATRIX[family].static_decode:
        static = make_engine(model_dir, "on")
        assert static.static_decode
        assert_trainer_agrees(worker, generate(static, requests()))
        return
    with pytest.raises(ValueError, match=r"cuda_graphs='on': the static decode path does not"):
        make_engine(model_dir, "on")
    with caplog.at_level(logging.INFO, logger=torch_engine.__name__):
        fallback = make_engine(model_dir, "auto")
    assert not fallback.static_decode
    assert "decoding through the transformers cache" in caplog.text


def plain_logprobs(model_dir: Path, batch) -> torch.Tensor:
    """log p(token t | tokens < t) from the model's own forward with the padding mask."""
    model = load_causal_lm(model_dir, dtype="float32", device="cpu")
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    picked = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked, (1, 0)) * batch["attention_mask"]


def training_batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(6):
        prompt = torch.randint(4, 80, (3 + index % 3,), generator=generator)
        completion = torch.randint(4, 80, (4 + index % 4,), generator=generator)
        logprobs = -torch.rand(completion.numel(), generator=generator) - 2.0
        row = make_training_row(
            prompt, completion, logprobs, reward=float(index % 2), sample_mask=1
        )
        row["advantages"] = torch.tensor(1.0 if index % 2 else -1.0)
        rows.append(row)
    return collate_rows(rows, pad_token_id=0)


def train_step(worker: PolicyWorker, batch, gradients: dict | None = None) -> dict[str, float]:
    """One optimizer step on ``batch``; ``gradients`` receives each parameter's gradient."""

    async def step() -> dict[str, float]:
        await worker.begin_train_step()
        await worker.train_microbatches(
            batch,
            step_num_sequences=batch["input_ids"].shape[0],
            step_num_tokens=count_loss_tokens(batch),
        )
        if gradients is not None:
            for name, parameter in worker.model.named_parameters():
                gradients[name] = parameter.grad.clone()
        return await worker.finish_train_step()

    return asyncio.run(step())


def test_trainer_padded_and_packed_match_the_plain_forward(family: str, model_dir: Path) -> None:
    batch = training_batch()
    reference = plain_logprobs(model_dir, batch)
    padded = make_worker(model_dir, sequence_packing="off")
    # Every family's logits are a plain lm_head of the last hidden state: the chunked head.
    assert padded.use_head_logprobs
    torch.testing.assert_close(
        asyncio.run(padded.get_logprobs(batch)), reference, atol=1e-5, rtol=0
    )
    if not MATRIX[family].packing:
        with pytest.raises(ValueError, match=r"policy\.sequence_packing: on cannot pack"):
            make_worker(model_dir, sequence_packing="on")
        assert train_step(padded, {**batch, "prev_logprobs": reference})["grad_norm"] > 0
        return
    packed = make_worker(model_dir, sequence_packing="on")
    assert packed.sequence_packing
    torch.testing.assert_close(
        asyncio.run(packed.get_logprobs(batch)), reference, atol=1e-5, rtol=0
    )
    batch["prev_logprobs"] = reference
    padded_grads: dict[str, torch.Tensor] = {}
    packed_grads: dict[str, torch.Tensor] = {}
    padded_metrics = train_step(padded, batch, padded_grads)
    packed_metrics = train_step(packed, batch, packed_grads)
    assert packed_metrics["loss"] == pytest.approx(padded_metrics["loss"], rel=1e-4)
    assert packed_grads.keys() == padded_grads.keys()
    for name, gradient in padded_grads.items():
        # The same sums in another order: equal up to float32 rounding of the whole tensor.
        error = (packed_grads[name] - gradient).norm() / gradient.norm().clamp(min=1e-12)
        assert error < 5e-5, (name, float(error))


def test_weight_sync_and_checkpoint_round_trip(
    family: str, model_dir: Path, tmp_path: Path
) -> None:
    worker = make_worker(model_dir, optimizer={"lr": 1e-2})
    batch = training_batch(seed=1)
    batch["prev_logprobs"] = asyncio.run(worker.get_logprobs(batch))
    before = batch["prev_logprobs"]
    train_step(worker, batch)  # Adam's first step moves every weight, norms included
    after = asyncio.run(worker.get_logprobs(batch))
    assert (after - before).abs().max() > 1e-2

    # Weight sync: the engine (its fastest path for the family) samples from the new weights.
    engine = make_engine(model_dir, "auto")
    assert engine.static_decode == MATRIX[family].static_decode

    async def sync_then_generate() -> list[GenerationResult]:
        try:
            await engine.update_weights(1, await worker.export_weights())
            return await engine.generate(requests())
        finally:
            await engine.shutdown()

    results = asyncio.run(sync_then_generate())
    assert {version for r in results for version in r.token_weight_versions} == {1}
    assert_trainer_agrees(worker, results)

    # Checkpoint: a fresh worker that loads it computes the same logprobs; the folder is a
    # model folder in its own right, chat template and EOS list included.
    checkpoint = tmp_path / "policy"
    asyncio.run(worker.save_checkpoint(checkpoint, save_optimizer=True))
    restored = make_worker(model_dir, optimizer={"lr": 1e-2})
    asyncio.run(restored.load_checkpoint(checkpoint, load_optimizer=True))
    torch.testing.assert_close(asyncio.run(restored.get_logprobs(batch)), after)
    assert restored.optimizer_steps == 1
    assert load_tokenizer(checkpoint).chat_template == load_tokenizer(model_dir).chat_template
    assert model_eos_token_ids(checkpoint) == model_eos_token_ids(model_dir)
    assert_trainer_agrees(worker, generate(make_engine(checkpoint, "auto"), requests()))


def test_generation_stops_at_every_eos_id_of_the_generation_config(
    family: str, model_dir: Path
) -> None:
    """The chat presets' generation config lists the end-of-turn token and <eos> (Mistral: <eos>
    alone); a completion ends at the first of either, on both decode paths."""
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    eos_ids = generation_config["eos_token_id"]
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    tokenizer = load_tokenizer(model_dir)
    # The rollout's stop list holds them all, the tokenizer's EOS included.
    assert set(stop_token_ids(tokenizer, model_dir)) == {*eos_ids, tokenizer.eos_token_id}
    many = requests(count=48, max_new_tokens=24)
    modes = ["off", "on"] if MATRIX[family].static_decode else ["off"]
    for mode in modes:
        results = generate(make_engine(model_dir, mode), many)
        ended_on = set()
        for result in results:
            stops = [i for i, token in enumerate(result.token_ids) if token in eos_ids]
            if result.finish_reason == "stop":
                assert stops == [len(result.token_ids) - 1], result
                ended_on.add(result.token_ids[-1])
            else:
                assert result.finish_reason == "length" and stops == [], result
        assert ended_on == set(eos_ids), (mode, ended_on)


def test_sync_grpo_in_chat_format_has_importance_weight_one(family: str, model_dir: Path) -> None:
    """Two on-policy GRPO steps, prompts rendered by the family's chat template: the trainer's
    logprobs are the generator's at every step (after a weight sync in between)."""
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu_sync.yaml",
        (
            f"policy.model_name={model_dir}",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=4",
            "policy.max_total_sequence_length=96",
            "policy.generation.max_new_tokens=6",
            "policy.generation.torch.cuda_graphs=auto",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
            "grpo.max_num_steps=2",
            "async_rl.max_buffered_rollouts=4",
            "async_rl.max_inflight_prompts=4",
            "data.prompt_format=chat",
            "data.system_prompt=Count on.",
        ),
    )
    worker = PolicyWorker(cfg.policy, cfg.loss_fn, seed=0)
    engine = TorchGenerationEngine(model_dir, device="cpu", max_batch_size=8, seed=0)
    codec = run_text_codec(cfg, str(model_dir))
    parts = ControllerParts(trainer=worker, engines=[engine], env=CountingEnv(), codec=codec)

    async def run() -> list[dict[str, float]]:
        try:
            return await asyncio.wait_for(build_controller(cfg, parts).run(), timeout=120)
        finally:
            await engine.shutdown()

    history = asyncio.run(run())
    assert [row["step"] for row in history] == [1, 2]
    for row in history:
        assert row["staleness_max"] == 0
        assert abs(row["train/is_weight_max"] - 1.0) < 1e-4, row
        assert abs(row["train/kl_gen_trainer"]) < 1e-6, row
    assert worker.optimizer_steps == 2
