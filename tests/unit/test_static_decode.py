"""The static-cache decode step against transformers; CUDA graphs and the engine on CUDA."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tandemrl.generation import static_decode, torch_engine
from tandemrl.generation.static_decode import (
    StaticDecoder,
    _sample_sorted,
    bucket,
    fuse_projections,
    kv_bytes_per_token,
    unsupported_reason,
)
from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.models import load_causal_lm, resolve_model_path
from tandemrl.records import GenerationRequest, GenerationResult

torch.set_num_threads(1)

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _varied(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator) * 0.1
            parameter.add_(noise.to(parameter.device, parameter.dtype))
    return model


# The two task presets and every family of the architecture matrix the static path supports
# (Llama 3 rotary scaling, Qwen3's query/key norms, Mistral, Phi-3's fused projections), with
# every weight (norms included) moved off its initial value.
@pytest.fixture(
    scope="module", params=["qwen2-counting", "llama-small", "llama3", "qwen3", "mistral", "phi3"]
)
def preset_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = resolve_model_path(f"tiny://{request.param}", tmp_path_factory.mktemp("cache"))
    folder = tmp_path_factory.mktemp(request.param)
    _varied(load_causal_lm(base, device="cpu"), seed=3).save_pretrained(folder)
    return folder


def _reference_logits(model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens).logits.float()


@pytest.mark.parametrize("kv_write_in_attention", [True, False])
@pytest.mark.parametrize(
    ("rope_in_attention", "down_splits", "o_splits", "qkv_splits"),
    [
        (True, 1, 1, 1),
        (False, 1, 1, 1),
        (True, 2, 1, 1),
        (False, 4, 2, 1),
        (True, 4, 4, 1),
        (True, 4, 2, 2),
        (False, 1, 1, 4),
    ],
)
def test_decode_step_matches_transformers_logits(
    preset_path: Path,
    rope_in_attention: bool,
    down_splits: int,
    o_splits: int,
    qkv_splits: int,
    kv_write_in_attention: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both forms of the query rotation, of the cache write (by the attention or by a step of
    # its own) and of the down and output projections (one product, or partial products over
    # slices of the input features summed by the residual add).
    monkeypatch.setattr(static_decode, "ROPE_IN_ATTENTION", rope_in_attention)
    monkeypatch.setattr(static_decode, "KV_WRITE_IN_ATTENTION", kv_write_in_attention)
    monkeypatch.setattr(static_decode, "DOWN_SPLITS", down_splits)
    monkeypatch.setattr(static_decode, "O_SPLITS", o_splits)
    monkeypatch.setattr(static_decode, "QKV_SPLITS", qkv_splits)
    reference_model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (3, 20), generator=torch.Generator().manual_seed(0))
    reference = _reference_logits(reference_model, tokens)
    decoder = StaticDecoder(model, slots=8, max_len=32, use_graphs=False, compile_step=False)
    assert decoder.rope_in_attention is rope_in_attention
    assert decoder.kv_write_in_attention is (rope_in_attention and kv_write_in_attention)
    assert (decoder.down_splits, decoder.o_splits) == (down_splits, o_splits)
    assert decoder.qkv_splits == qkv_splits
    # Slots 5, 1, 6 (a gap and an unordered table), fed token by token: the step's own K/V.
    slots = torch.tensor([5, 1, 6])
    with torch.inference_mode():
        for position in range(tokens.shape[1]):
            decoder.tokens[slots] = tokens[:, position]
            decoder.positions[slots] = position
            logits = decoder.forward(8, 32)[slots]
            expected = reference[:, position]
            error = (logits - expected).abs().max() / expected.abs().max()
            assert error < 1e-5, (position, float(error))


@pytest.mark.parametrize("down_splits", [1, 2])
def test_prefill_then_step_matches_transformers(
    preset_path: Path, down_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(static_decode, "DOWN_SPLITS", down_splits)
    monkeypatch.setattr(static_decode, "QKV_SPLITS", down_splits)  # prefill shares the code
    reference_model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    tokens = torch.randint(3, model.config.vocab_size, (3, 20), generator=torch.Generator())
    reference = _reference_logits(reference_model, tokens)
    decoder = StaticDecoder(model, slots=4, max_len=24, use_graphs=False, compile_step=False)
    lengths = [10, 15, 19]  # different prompt lengths: the prefill pads on the right
    slots = [2, 0, 1]
    decoder.prefill(slots, [tokens[row, :n].tolist() for row, n in enumerate(lengths)])
    decoder.set_rows(
        slots,
        tokens=[int(tokens[row, n]) for row, n in enumerate(lengths)],
        positions=lengths,
        temperatures=[0.0, 1.0, 0.5],
        top_ps=[1.0, 1.0, 0.9],
    )
    with torch.inference_mode():
        logits = decoder.forward(4, 24)
    for row, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
        expected = reference[row, n]
        assert float((logits[slot] - expected).abs().max() / expected.abs().max()) < 1e-5


def test_sampled_step_reports_tempered_logprobs_and_advances(preset_path: Path) -> None:
    model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    decoder = StaticDecoder(model, slots=2, max_len=16, use_graphs=False, compile_step=False)
    decoder.set_rows(
        [0, 1], tokens=[5, 7], positions=[0, 0], temperatures=[0.0, 0.7], top_ps=[1, 1]
    )
    with torch.inference_mode():
        logits = decoder.forward(2, 16).clone()
    decoder.set_rows(
        [0, 1], tokens=[5, 7], positions=[0, 0], temperatures=[0.0, 0.7], top_ps=[1, 1]
    )
    (tokens,), (logprobs,) = decoder.step([0, 1], [0.3, 0.3], max_position=0, top_p=False)
    assert tokens[0] == int(logits[0].argmax())  # greedy
    expected = [
        torch.log_softmax(logits[0], -1)[tokens[0]],
        torch.log_softmax(logits[1] / 0.7, -1)[tokens[1]],
    ]
    assert max(abs(a - float(b)) for a, b in zip(logprobs, expected, strict=True)) < 1e-5
    assert decoder.positions[:2].tolist() == [1, 1]
    assert decoder.tokens[:2].tolist() == tokens


def test_launch_results_of_a_small_bucket_are_one_contiguous_block(preset_path: Path) -> None:
    """Rows bucket (8) below the slots (32): the launch's device results and its host staging
    are contiguous blocks, so on CUDA the copy between them stays asynchronous (a strided
    device-to-host copy goes through an unpinned temporary and waits for the device, which
    cost the engine its step in flight in every bucket below the slot count)."""
    model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    decoder = StaticDecoder(model, slots=32, max_len=16, use_graphs=False, compile_step=False)
    decoder.set_rows(
        [3, 6], tokens=[5, 7], positions=[0, 0], temperatures=[0.0, 0.0], top_ps=[1, 1]
    )
    launched = decoder.launch([3, 6], [0.5, 0.5], max_position=0, top_p=False)
    assert launched.results.shape == (1, 8, 2) and launched.results.is_contiguous()
    (tokens,), _ = decoder.collect(launched)
    assert tokens == decoder.tokens[[3, 6]].tolist()  # the fed-back inputs are the samples


def test_a_launch_of_several_steps_is_those_steps_one_at_a_time(preset_path: Path) -> None:
    """A decoder of 3 steps per launch samples what 3 one-step launches sample from the same
    draws (each step feeds the next on the device), and its launch's results are one
    contiguous [steps, rows, 2] block in the rows bucket (8, of 32 slots)."""
    model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    single = StaticDecoder(model, slots=32, max_len=24, use_graphs=False, compile_step=False)
    triple = StaticDecoder(
        model, slots=32, max_len=24, use_graphs=False, compile_step=False, steps=3
    )
    slots, prompts = [3, 0, 6], [[5, 6, 7], [9, 10], [4, 11, 12, 13]]
    for decoder in (single, triple):
        _admit(decoder, slots, prompts, [0.0, 1.0, 0.7], [1.0, 1.0, 1.0])
    generator = torch.Generator().manual_seed(3)
    draws = torch.rand(2, len(slots), 3, generator=generator).tolist()  # [launch][slot][step]
    expected_tokens, expected_logprobs = [], []
    for launch in range(2):
        for step in range(3):
            (tokens,), (logprobs,) = single.step(
                slots,
                [row[step] for row in draws[launch]],
                max_position=3 + 3 * launch + step,
                top_p=False,
            )
            expected_tokens.append(tokens)
            expected_logprobs.append(logprobs)
    actual_tokens, actual_logprobs = [], []
    for launch in range(2):
        launched = triple.launch(slots, draws[launch], max_position=3 + 3 * launch, top_p=False)
        assert launched.results.shape == (3, 8, 2) and launched.results.is_contiguous()
        tokens, logprobs = triple.collect(launched)
        actual_tokens += tokens
        actual_logprobs += logprobs
    assert actual_tokens == expected_tokens
    assert len({token for step in actual_tokens for token in step}) > 3  # not one repeated token
    flat = [
        abs(a - b)
        for x, y in zip(actual_logprobs, expected_logprobs, strict=True)
        for a, b in zip(x, y, strict=True)
    ]
    assert max(flat) < 1e-5
    assert torch.equal(triple.positions[slots], single.positions[slots])
    assert torch.equal(triple.tokens[slots], single.tokens[slots])
    with pytest.raises(ValueError, match="steps per launch must be >= 1"):
        StaticDecoder(model, slots=2, max_len=8, use_graphs=False, compile_step=False, steps=0)


def test_two_level_sampler_is_the_plain_inverse_cdf(preset_path: Path) -> None:
    model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    decoder = StaticDecoder(model, slots=2, max_len=8, use_graphs=False, compile_step=False)
    generator = torch.Generator().manual_seed(4)
    rows, vocab = 64, 1000  # not a multiple of the block: the last block is padded
    logits = torch.randn(rows, vocab, generator=generator) * 3
    temperatures = torch.rand(rows, generator=generator) + 0.5
    greedy = torch.arange(rows) % 5 == 0
    uniforms = torch.rand(rows, generator=generator)
    tokens, logprobs = decoder._sample_tokens(logits, temperatures, greedy, uniforms, None)
    # top_p = 1 keeps the whole distribution: the sorted sampler is then the plain one.
    expected_tokens, expected_logprobs = _sample_sorted(
        logits, temperatures, greedy, uniforms, torch.ones(rows)
    )
    plain = torch.log_softmax(logits / temperatures[:, None], -1).exp().cumsum(-1)
    by_cdf = torch.searchsorted(plain, (uniforms * plain[:, -1])[:, None], right=True)[:, 0]
    assert torch.equal(tokens[~greedy], by_cdf[~greedy])
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    tempered = torch.log_softmax(logits / temperatures[:, None], -1)
    assert torch.allclose(logprobs, tempered.gather(1, tokens[:, None])[:, 0], atol=1e-5)
    # The sorted sampler draws from a permuted CDF: same law, other tokens; greedy agrees.
    assert torch.equal(expected_tokens[greedy], tokens[greedy])
    assert torch.allclose(expected_logprobs[greedy], logprobs[greedy], atol=1e-5)


def test_fused_weights_follow_load_state_dict(preset_path: Path) -> None:
    model = load_causal_lm(preset_path, device="cpu", dtype="float32")
    layers = fuse_projections(model)
    assert fuse_projections(model)[0].qkv_weight.data_ptr() == layers[0].qkv_weight.data_ptr()
    other = _varied(load_causal_lm(preset_path, device="cpu", dtype="float32"), seed=9)
    with torch.no_grad():
        model.load_state_dict(other.state_dict())
    attention, mlp = other.model.layers[1].self_attn, other.model.layers[1].mlp
    if hasattr(attention, "qkv_proj"):  # Phi-3 keeps them fused itself
        expected_qkv, expected_gate_up = attention.qkv_proj.weight, mlp.gate_up_proj.weight
    else:
        expected_qkv = torch.cat(
            [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]
        )
        expected_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    assert torch.equal(layers[1].qkv_weight, expected_qkv)
    assert torch.equal(layers[1].gate_up_weight, expected_gate_up)
    if hasattr(attention, "q_norm"):  # Qwen3: the norms are the model's own tensors too
        assert torch.equal(layers[1].q_norm, attention.q_norm.weight)
        assert torch.equal(layers[1].k_norm, attention.k_norm.weight)
    # The model itself still computes what the other one does.
    tokens = torch.tensor([[5, 6, 7, 8]])
    assert torch.allclose(_reference_logits(model, tokens), _reference_logits(other, tokens))


def test_buckets_and_unsupported_models(preset_path: Path) -> None:
    assert [bucket(n, 8, 256) for n in (1, 8, 9, 200, 300)] == [8, 8, 16, 256, 256]
    model = load_causal_lm(preset_path, device="cpu")
    assert unsupported_reason(model) is None
    model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    assert "yarn" in (unsupported_reason(model) or "")
    with pytest.raises(ValueError, match="does not support"):
        StaticDecoder(model, slots=2, max_len=8, use_graphs=False, compile_step=False)


def test_seeded_requests_sample_the_same_tokens_whatever_the_steps_per_launch(
    preset_path: Path,
) -> None:
    """Each row draws its uniforms in the order of its steps: 1, 2 or 5 steps per launch (rows
    ending inside a launch, others joining at its boundaries) give a seeded request the same
    tokens and logprobs, stop tokens and length limits included."""
    prompts = [[5, 6, 7, 14], [9, 14], [4], [10, 11, 12, 13, 5, 6, 14]]
    requests = [
        GenerationRequest(f"r{i}", prompts[i % 4], max_new_tokens=3 + 2 * i, seed=i)
        for i in range(7)
    ]

    def run(steps: int, stop: tuple[int, ...]) -> list[GenerationResult]:
        engine = TorchGenerationEngine(
            preset_path,
            device="cpu",
            cuda_graphs="on",
            max_batch_size=3,
            steps_per_launch=steps,
            pipeline_steps=True,
            eos_token_ids=stop,
        )
        assert engine.steps_per_launch == steps

        async def body() -> list[GenerationResult]:
            try:
                return await engine.generate(requests)
            finally:
                await engine.shutdown()

        return asyncio.run(body())

    # A stop token the longest completion samples at its third step: it ends some requests.
    stop = (run(1, ())[-1].token_ids[2],)
    reference = run(1, stop)
    assert {result.finish_reason for result in reference} == {"stop", "length"}
    for steps in (2, 5):
        for expected, actual in zip(reference, run(steps, stop), strict=True):
            assert actual.token_ids == expected.token_ids
            assert actual.finish_reason == expected.finish_reason
            assert (
                max(abs(a - b) for a, b in zip(actual.logprobs, expected.logprobs, strict=True))
                < 1e-5
            )


def test_static_path_admits_a_quarter_of_its_slots_by_default(preset_path: Path) -> None:
    engine = TorchGenerationEngine(
        preset_path, device="cpu", cuda_graphs="on", max_batch_size=12, max_seq_len=16
    )
    assert engine.static_decode and engine.slots == 12
    assert engine.admission_batch == 3
    explicit = TorchGenerationEngine(
        preset_path, device="cpu", cuda_graphs="on", max_batch_size=12, admission_batch=1
    )
    assert explicit.admission_batch == 1


def test_engine_knob_refuses_unsupported_model_and_bad_values(
    preset_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match=r"cuda_graphs='sometimes'"):
        TorchGenerationEngine(preset_path, device="cpu", cuda_graphs="sometimes")
    # Several steps per launch are the static path's; the transformers-cache path says so.
    with caplog.at_level(logging.WARNING, logger=torch_engine.__name__):
        dynamic = TorchGenerationEngine(
            preset_path, device="cpu", cuda_graphs="off", steps_per_launch=3
        )
    assert dynamic.steps_per_launch == 1
    assert "policy.generation.torch.steps_per_launch=3 ignored" in caplog.text
    engine = TorchGenerationEngine(preset_path, device="cpu", cuda_graphs="on", max_seq_len=12)
    assert engine.static_decode and engine.slots == engine.max_batch_size

    async def body() -> None:
        with pytest.raises(ValueError, match=r"max_seq_len=12"):
            await engine.generate([GenerationRequest("long", [5] * 12, 4)])
        (result,) = await engine.generate([GenerationRequest("r", [5] * 8, 10)])
        assert len(result.token_ids) == 4 and result.finish_reason in ("length", "stop")
        await engine.shutdown()

    asyncio.run(body())
    # auto on CPU: the static path while its preallocated cache is small, one step at a time.
    small = TorchGenerationEngine(preset_path, device="cpu", max_batch_size=8)
    assert small.static_decode and not small.pipeline_steps
    budget = torch_engine.CPU_STATIC_CACHE_BYTES
    per_slot = small.max_seq_len * kv_bytes_per_token(small.model)
    too_many = budget // per_slot + 1
    assert not TorchGenerationEngine(
        preset_path, device="cpu", max_batch_size=too_many
    ).static_decode


# --------------------------------------------------------------------------- CUDA only


def _admit(
    decoder: StaticDecoder,
    slots: list[int],
    prompts: list[list[int]],
    temperatures: list[float],
    top_ps: list[float],
) -> None:
    """Prefill each prompt but its last token into its slot; that token is the next input."""
    decoder.prefill(slots, [prompt[:-1] for prompt in prompts])
    decoder.set_rows(
        slots,
        tokens=[prompt[-1] for prompt in prompts],
        positions=[len(prompt) - 1 for prompt in prompts],
        temperatures=temperatures,
        top_ps=top_ps,
    )


def _assert_steps_match(
    eager: StaticDecoder,
    graphed: StaticDecoder,
    slots: list[int],
    *,
    steps: int,
    stride: int,
    top_p: bool,
) -> None:
    """``steps`` launches of both decoders (``eager.steps`` decode steps each) draw the same
    tokens, logprobs within 1e-4."""
    per_launch = eager.steps
    for launch in range(steps):
        uniforms = [
            [
                (((launch * per_launch + k) * stride + slot) % 10) / 10 + 0.05
                for k in range(per_launch)
            ]
            for slot in slots
        ]
        position = 3 + launch * per_launch
        expected = eager.step(slots, uniforms, max_position=position, top_p=top_p)
        actual = graphed.step(slots, uniforms, max_position=position, top_p=top_p)
        assert actual[0] == expected[0]
        for actual_step, expected_step in zip(actual[1], expected[1], strict=True):
            assert max(abs(a - b) for a, b in zip(actual_step, expected_step, strict=True)) < 1e-4


def _five_rows_eager_and_graphed(
    preset_path: Path, compile_step: bool, *, steps: int
) -> tuple[StaticDecoder, StaticDecoder, list[int]]:
    """An eager and a graphed decoder (CUDA, ``steps`` decode steps a launch) with the same five
    rows admitted (greedy, tempered and top-p rows; slots out of order); and those slots."""
    model = load_causal_lm(preset_path, device="cuda", dtype="float32")
    options = {"slots": 16, "max_len": 64, "steps": steps}
    eager = StaticDecoder(model, use_graphs=False, compile_step=False, **options)
    graphed = StaticDecoder(model, use_graphs=True, compile_step=compile_step, **options)
    prompts = [[5 + i, 6, 7 + i, 8][: 2 + i % 3] for i in range(5)]
    slots = [0, 3, 4, 9, 2]
    for decoder in (eager, graphed):
        _admit(decoder, slots, prompts, [0.0, 1.0, 0.8, 0.0, 1.2], [1.0, 0.9, 1.0, 1.0, 0.5])
    return eager, graphed, slots


@cuda_only
@pytest.mark.parametrize("compile_step", [False, True])
@pytest.mark.parametrize("down_splits", [1, 2])
def test_graph_replay_matches_eager_step(
    preset_path: Path, compile_step: bool, down_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(static_decode, "DOWN_SPLITS", down_splits)
    monkeypatch.setattr(static_decode, "O_SPLITS", down_splits)
    monkeypatch.setattr(static_decode, "QKV_SPLITS", down_splits)
    eager, graphed, slots = _five_rows_eager_and_graphed(preset_path, compile_step, steps=1)
    _assert_steps_match(eager, graphed, slots, steps=12, stride=7, top_p=True)
    assert graphed.graph_count >= 1


@cuda_only
@pytest.mark.parametrize("top_p", [False, True])
def test_graph_of_several_steps_matches_eager_steps(preset_path: Path, top_p: bool) -> None:
    """One graph replay runs 4 decode steps (compiled), each fed by the one before on the
    device: the same tokens as the eager decoder's 4 steps."""
    eager, graphed, slots = _five_rows_eager_and_graphed(preset_path, True, steps=4)
    _assert_steps_match(eager, graphed, slots, steps=5, stride=7, top_p=top_p)
    assert graphed.graph_count >= 1


@cuda_only
def test_graphs_recaptured_after_release_match_eager(preset_path: Path) -> None:
    """A colocated engine's wake: release() drops cache and graphs, allocate() rebuilds, and
    the keys seen before are recaptured without warm-up runs; the steps still match eager."""
    model = load_causal_lm(preset_path, device="cuda", dtype="float32")
    eager = StaticDecoder(model, slots=16, max_len=64, use_graphs=False, compile_step=False)
    graphed = StaticDecoder(model, slots=16, max_len=64, use_graphs=True, compile_step=True)
    prompts = [[5, 6, 7, 8], [9, 10], [4, 11, 12]]
    slots = [0, 5, 2]
    for wake in range(2):
        for decoder in (eager, graphed):
            if wake:
                decoder.release()
                decoder.allocate()
            _admit(decoder, slots, prompts, [0.0, 1.0, 0.7], [1.0, 1.0, 1.0])
        _assert_steps_match(eager, graphed, slots, steps=4, stride=3, top_p=False)
        assert graphed.graph_count >= 1
    assert graphed._warmed == set(graphed._graphs)  # every key recaptured was warmed once


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_kernel_is_the_inverse_cdf(dtype: torch.dtype) -> None:
    from tandemrl.generation.decode_sampler import sample_rows

    generator = torch.Generator().manual_seed(5)
    rows, vocab = 96, 151_936 - 7  # a ragged last chunk
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
    logits[5, 17] = logits[5, 90_000] = 60.0  # a tie: the argmax is the first column
    temperatures = torch.rand(rows, generator=generator) + 0.5
    greedy = torch.arange(rows) % 6 == 5
    temperatures[greedy] = 1.0
    uniforms = torch.rand(rows, generator=generator)
    uniforms[0], uniforms[1] = 0.0, 1.0 - 1e-7  # both ends of the CDF
    tokens, logprobs = sample_rows(
        logits.cuda(), temperatures.cuda(), greedy.cuda(), uniforms.cuda()
    )
    tokens, logprobs = tokens.cpu(), logprobs.cpu()
    tempered = torch.log_softmax(logits.double() / temperatures[:, None].double(), -1)
    assert torch.equal(tokens[greedy], logits.float().argmax(-1)[greedy])
    assert int(tokens[5]) == 17
    # Sampled rows: u lies in the token's CDF step (up to float32 summation order).
    cdf = tempered.exp().cumsum(-1)
    picked = tokens[~greedy]
    upper = cdf[~greedy].gather(1, picked[:, None])[:, 0]
    lower = upper - tempered[~greedy].gather(1, picked[:, None])[:, 0].exp()
    target = uniforms[~greedy].double()
    assert bool(((lower <= target + 1e-5) & (target <= upper + 1e-5)).all())
    expected = tempered.gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs.double(), expected, atol=1e-4)


@cuda_only
def test_engine_static_path_matches_plain_path_on_cuda(preset_path: Path) -> None:
    prompts = [[5, 6, 7, 14], [9, 14], [4], [10, 11, 12, 13, 5, 6, 14]]

    async def run(mode: str) -> list[list[int]]:
        engine = TorchGenerationEngine(
            preset_path, device="cuda", dtype="float32", cuda_graphs=mode, eos_token_ids=()
        )
        assert engine.static_decode == (mode == "on")
        requests = [
            GenerationRequest(f"r{i}", prompt, 12 + i, temperature=0.0)
            for i, prompt in enumerate(prompts)
        ]
        results = await engine.generate(requests)
        await engine.sleep()
        await engine.wake()
        again = await engine.generate(requests[:2])
        await engine.shutdown()
        assert [r.token_ids for r in again] == [r.token_ids for r in results[:2]]
        return [result.token_ids for result in results]

    assert asyncio.run(run("on")) == asyncio.run(run("off"))


@cuda_only
@pytest.mark.parametrize("free_cache", [True, False])
def test_sleep_frees_or_keeps_the_cache_on_cuda(preset_path: Path, free_cache: bool) -> None:
    """policy.generation.colocated.free_cache_on_sleep: a sleep mid-generation frees the
    cache and graphs (wake re-prefills the running rows) or keeps both (nothing recomputed);
    either way the greedy tokens are those of a run that never slept."""
    prompts = [[5, 6, 7, 14], [9, 14]]
    requests = [GenerationRequest(f"r{i}", p, 40, temperature=0.0) for i, p in enumerate(prompts)]

    async def run(sleep: bool) -> list[list[int]]:
        engine = TorchGenerationEngine(
            preset_path,
            device="cuda",
            dtype="float32",
            cuda_graphs="on",
            eos_token_ids=(),
            free_cache_on_sleep=free_cache,
        )
        running = asyncio.ensure_future(engine.generate(requests))
        if sleep:
            while engine.stats.decode_steps < 5:
                await asyncio.sleep(0.001)
            graphs = engine._decoder.graph_count
            await engine.sleep()
            assert engine._decoder.allocated == (not free_cache)
            assert engine._decoder.graph_count == (0 if free_cache else graphs)
            await asyncio.sleep(0.05)
            await engine.wake()
        results = await running
        assert engine.stats.kv_recomputes == (1 if sleep and free_cache else 0)
        await engine.shutdown()
        return [result.token_ids for result in results]

    assert asyncio.run(run(sleep=True)) == asyncio.run(run(sleep=False))


@cuda_only
def test_engine_decodes_on_its_own_stream_beside_default_stream_work(
    preset_path: Path, tmp_path: Path
) -> None:
    """A trainer sharing the engine's process keeps the default stream busy: the engine's
    steps run on a high-priority stream of their own, give the tokens of an idle GPU, and a
    weight update written on the default stream is read only once it is written."""
    prompts = [[5, 6, 7, 14], [9, 14], [4]]
    requests = [GenerationRequest(f"r{i}", p, 24, temperature=0.0) for i, p in enumerate(prompts)]
    big = torch.randn(2048, 2048, device="cuda")

    async def run(
        path: Path, busy: bool = False, weights: dict[str, torch.Tensor] | None = None
    ) -> list[list[int]]:
        engine = TorchGenerationEngine(
            path, device="cuda", dtype="float32", cuda_graphs="on", eos_token_ids=()
        )
        stream = await engine._in_executor(torch.cuda.current_stream)
        assert stream != torch.cuda.default_stream()
        assert stream.priority < 0
        if weights is not None:
            for _ in range(20):  # work queued ahead of the sent tensors on the default stream
                big @ big
            await engine.update_weights(1, {name: t.cuda() * 1 for name, t in weights.items()})
        running = asyncio.ensure_future(engine.generate(requests))
        while busy and not running.done():
            big @ big  # on the default stream, as a trainer's kernels are
            await asyncio.sleep(0)
        results = await running
        await engine.shutdown()
        return [result.token_ids for result in results]

    alone = asyncio.run(run(preset_path))
    assert asyncio.run(run(preset_path, busy=True)) == alone
    varied = _varied(load_causal_lm(preset_path, dtype=torch.float32, device="cpu"), seed=5)
    varied.save_pretrained(tmp_path)
    updated = asyncio.run(run(preset_path, weights=varied.state_dict()))
    assert updated == asyncio.run(run(tmp_path))
    assert updated != alone


def test_compiled_call_during_another_threads_trace_runs_eagerly() -> None:
    """An engine and a compiled trainer in one process: while one thread traces (FX's flag is
    process-wide), a compiled function called from another thread raised; once the decoder
    allows it, the call runs its eager code and returns the same result."""
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")

    def call_while_another_thread_traces() -> torch.Tensor:
        tracing, release = threading.Event(), threading.Event()

        class Blocking(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                tracing.set()
                release.wait(30)
                return x + 1

        tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(Blocking(),))
        tracer.start()
        try:
            assert tracing.wait(30)
            return compiled(torch.ones(3))
        finally:
            release.set()
            tracer.join()

    with torch._dynamo.config.patch(error_on_nested_fx_trace=True):
        with pytest.raises(RuntimeError, match="symbolically trace a dynamo-optimized"):
            call_while_another_thread_traces()
        static_decode.allow_compiled_calls_during_traces()
        assert torch.equal(call_while_another_thread_traces(), torch.full((3,), 3.0))


def test_graph_capture_waits_for_and_holds_the_capture_lock(
    preset_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer thread sharing the process holds the lock around its CUDA work (a device-wide
    synchronize fails while a capture is open): a capture waits for it and holds it. CPU: the
    capture itself is faked, the step inside it runs for real."""
    lock = threading.Lock()
    engine = TorchGenerationEngine(
        preset_path, device="cpu", cuda_graphs="on", max_batch_size=8, max_seq_len=16,
        capture_lock=lock,
    )  # fmt: skip
    decoder = engine._ensure_decoder()
    assert decoder.capture_lock is lock
    held_while_capturing: list[bool] = []

    @contextlib.contextmanager
    def fake_capture(graph: object, **options: object):
        held_while_capturing.append(lock.locked())
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    key = (8, 16, False)
    decoder._warmed.add(key)  # no warm-up runs (they need a CUDA side stream)

    def capture_as_the_engine_does() -> None:
        with torch.inference_mode():
            decoder._capture(key)

    with lock:  # the trainer's call
        capture = threading.Thread(target=capture_as_the_engine_does)
        capture.start()
        capture.join(0.3)
        assert capture.is_alive() and held_while_capturing == []
    capture.join(60)
    assert not capture.is_alive()
    assert held_while_capturing == [True] and key in decoder._graphs
    assert not lock.locked()


def test_rebuild_that_finishes_every_row_launches_nothing(preset_path: Path) -> None:
    """A KV rebuild first collects the step in flight; if that ends every row, no launch."""
    engine = TorchGenerationEngine(
        preset_path,
        device="cpu",
        cuda_graphs="on",
        eos_token_ids=(),
        recompute_kv_cache_after_weight_updates=True,
        pipeline_steps=True,
    )
    loop = asyncio.new_event_loop()
    try:
        seq = engine._new_sequence(GenerationRequest("r", [5, 6], 2), loop)
        assert engine._step([seq]) == []  # step 1 launched, nothing collected yet
        assert engine._step([]) == []  # step 2 launched, step 1 collected
        assert len(seq.token_ids) == 1 and engine._in_flight is not None
        engine._needs_kv_rebuild = True  # as after update_weights
        assert engine._step([]) == [seq]  # step 2 collected: the row is done
        assert seq.finish_reason == "length" and len(seq.token_ids) == 2
        assert engine._in_flight is None and engine._running == []
        assert engine.stats.decode_steps == 2
    finally:
        loop.close()
