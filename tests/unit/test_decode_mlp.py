"""SiLU·up and the split down projection (``decode_mlp.py``): the torch reference (CPU), the
Triton kernel under Triton's CPU interpreter (only with ``TRITON_INTERPRET=1``, skipped in CI),
and the kernel on CUDA against the reference, alone and inside the static decode step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandemrl.generation import decode_mlp, static_decode
from tandemrl.generation.decode_mlp import (
    LAUNCH_TABLE,
    MlpLaunch,
    launch_config,
    launch_silu_down,
    reference_silu_down_partials,
    silu_down_partials,
)
from tandemrl.generation.static_decode import StaticDecoder
from tandemrl.models import load_causal_lm, resolve_model_path

torch.set_num_threads(1)

cuda_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() and decode_mlp.triton is not None),
    reason="needs CUDA and Triton",
)
# TRITON_INTERPRET=1 PYTHONPATH=<a Triton install> pytest ...: the kernel's indexing on CPU.
interpreted = pytest.mark.skipif(
    not (os.environ.get("TRITON_INTERPRET") == "1" and decode_mlp.triton is not None),
    reason="needs TRITON_INTERPRET=1 and Triton",
)

# Qwen2-0.5B: hidden 896, intermediate 4864 (gate_up [rows, 9728]), four splits of 1216.
HIDDEN, INTERMEDIATE, SPLITS = 896, 4864, 4


def make_inputs(rows, hidden, intermediate, device="cpu", dtype=torch.float32, seed=0):
    """gate_up [rows, 2 x intermediate] and down_weight [hidden, intermediate] of unit-scale
    outputs (a Qwen-like 1/sqrt(intermediate) weight scale)."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * intermediate, generator=generator)
    down_weight = torch.randn(hidden, intermediate, generator=generator) / intermediate**0.5
    return gate_up.to(device, dtype), down_weight.to(device, dtype)


def act_rounded_once(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up in float64, rounded once to ``dtype`` (the kernel's act), as float64."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype).double()


def split_products(act: torch.Tensor, down_weight: torch.Tensor, splits: int) -> torch.Tensor:
    part = act.shape[1] // splits
    return torch.stack(
        [
            act[:, s * part : (s + 1) * part] @ down_weight[:, s * part : (s + 1) * part].T
            for s in range(splits)
        ]
    )


# --------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_reference_is_the_eager_silu_and_split_product(splits: int) -> None:
    gate_up, down_weight = make_inputs(12, 64, 256)
    got = reference_silu_down_partials(gate_up, down_weight, splits)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    # Bit for bit the static step's eager form, and its partial sums add up to the product.
    assert torch.equal(got, StaticDecoder._split_linear(act, down_weight, splits))
    torch.testing.assert_close(got.sum(0), F.linear(act, down_weight), rtol=1e-5, atol=1e-5)


def test_shape_dtype_and_cpu_fallback() -> None:
    gate_up, down_weight = make_inputs(8, 64, 256, dtype=torch.bfloat16)
    got = silu_down_partials(gate_up, down_weight, 4)  # CPU: the reference itself
    assert got.shape == (4, 8, 64) and got.dtype == torch.bfloat16
    assert torch.equal(got, reference_silu_down_partials(gate_up, down_weight, 4))


def test_bad_shapes_are_refused() -> None:
    gate_up, down_weight = make_inputs(8, 64, 250)
    for function in (reference_silu_down_partials, silu_down_partials):
        with pytest.raises(ValueError, match="intermediate size 250 must divide into splits=4"):
            function(gate_up, down_weight, 4)
        with pytest.raises(ValueError, match=r"gate_up must be \[rows, 2 x intermediate\]"):
            function(gate_up[:, :-2], down_weight, 2)


def test_launch_table_covers_every_rows_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    # No bucket is tiled by more rows than it has (the smallest tile is tl.dot's 16).
    rows_bucket = static_decode.MIN_ROWS_BUCKET
    while rows_bucket <= 1024:
        assert launch_config(rows_bucket).block_m <= max(rows_bucket, decode_mlp.MIN_BLOCK)
        rows_bucket *= 2
    assert launch_config(10_000) == LAUNCH_TABLE[-1][1]
    override = MlpLaunch(32, 64, 128, 8, 2)
    monkeypatch.setattr(decode_mlp, "LAUNCH_OVERRIDE", override)
    assert launch_config(8) == launch_config(256) == override


@pytest.mark.parametrize("down_splits", [2, 4])
def test_static_step_with_the_switch_on_is_unchanged_on_cpu(
    down_splits: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # On CPU the switch routes through silu_down_partials' reference: the same logits, bit
    # for bit, for the decode step and after a prefill.
    monkeypatch.setattr(static_decode, "DOWN_SPLITS", down_splits)
    path = resolve_model_path("tiny://llama-small", tmp_path)
    model = load_causal_lm(path, device="cpu", dtype="float32")
    decoder = StaticDecoder(model, slots=8, max_len=16, use_graphs=False, compile_step=False)
    logits = {}
    for fused in (False, True):
        monkeypatch.setattr(static_decode, "FUSED_SILU_DOWN", fused)
        with torch.inference_mode():
            decoder.prefill([0, 3], [[5, 6, 7], [8, 9]])
            decoder.tokens[:4] = torch.tensor([10, 11, 12, 13])
            decoder.positions[:4] = torch.tensor([3, 0, 0, 2])
            logits[fused] = decoder.forward(4, 16)
    assert torch.equal(logits[True], logits[False])


# --------------------------------------------------------------------------- interpreter


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("rows", "hidden", "intermediate", "splits"),
    # Uneven blocks: 688 (llama-small, slices of 172), hidden 96 (not a block multiple).
    [(5, 64, 256, 4), (8, 96, 688, 4), (16, 128, 512, 2), (37, HIDDEN // 4, INTERMEDIATE // 4, 4)],
)
def test_kernel_indexing_under_the_interpreter(
    rows: int, hidden: int, intermediate: int, splits: int, dtype: torch.dtype
) -> None:
    # Triton 3.6's interpreter multiplies bf16 tiles wrongly (a bf16 tl.dot of 16x16 random
    # tiles is off by ~1e10), so the half-precision path is checked in float16 here.
    gate_up, down_weight = make_inputs(rows, hidden, intermediate, dtype=dtype)
    expected = split_products(act_rounded_once(gate_up, dtype), down_weight.double(), splits)
    for launch in (MlpLaunch(16, 32, 64, 4, 1), MlpLaunch(64, 128, 128, 4, 1)):
        got = launch_silu_down(gate_up, down_weight, splits, launch)
        assert got.shape == (splits, rows, hidden) and got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@interpreted
def test_kernel_reads_strided_inputs_under_the_interpreter() -> None:
    wide = torch.randn(9, 2 * 128 + 8, generator=torch.Generator().manual_seed(1))
    gate_up = wide[:, 4 : 4 + 256]  # rows strided by 264
    down_weight = torch.randn(128, 64, generator=torch.Generator().manual_seed(2)).T
    got = launch_silu_down(gate_up, down_weight, 2, MlpLaunch(16, 64, 32, 4, 1))
    expected = reference_silu_down_partials(gate_up.double(), down_weight.double(), 2)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- CUDA only


@cuda_kernel
@pytest.mark.parametrize("rows", [8, 16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_triton_kernel_matches_reference(rows: int, dtype: torch.dtype, compiled: bool) -> None:
    # Each parametrization recompiles silu_down_partials (one code object): start afresh.
    torch._dynamo.reset()
    # The static step calls the kernel inside torch.compile(fullgraph=True): check that too.
    fused = torch.compile(silu_down_partials, fullgraph=True) if compiled else silu_down_partials
    gate_up, down_weight = make_inputs(rows, HIDDEN, INTERMEDIATE, "cuda", dtype)
    got = fused(gate_up, down_weight, SPLITS)
    assert got.shape == (SPLITS, rows, HIDDEN) and got.dtype == dtype
    # The kernel's own rounding (act rounded once), exactly: only the float32 accumulation
    # order and the output's rounding differ.
    exact = split_products(act_rounded_once(gate_up, dtype), down_weight.double(), SPLITS)
    scale = float(exact.abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * scale)
        return
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=2e-3 * scale)
    # Against the eager bf16 computation (silu rounded to bf16, then the product rounded
    # again): one extra rounding of each act element, so a looser bound.
    eager = reference_silu_down_partials(gate_up, down_weight, SPLITS).double()
    assert float((got.double() - eager).abs().max()) <= 2e-2 * scale
    # And the partial sums add up to the plain product of the eager act.
    gate, up = gate_up.chunk(2, dim=-1)
    plain = F.linear(F.silu(gate) * up, down_weight).double()
    assert float((got.double().sum(0) - plain).abs().max()) <= 4e-2 * scale


@cuda_kernel
def test_triton_kernel_launch_override_and_uneven_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every launch shape the benchmark may try, on a shape no block divides (masked edges).
    gate_up, down_weight = make_inputs(37, 96, 688, "cuda", torch.float32)
    exact = split_products(act_rounded_once(gate_up, torch.float32), down_weight.double(), 4)
    for launch in (MlpLaunch(16, 32, 64, 4, 4), MlpLaunch(128, 64, 128, 8, 3)):
        monkeypatch.setattr(decode_mlp, "LAUNCH_OVERRIDE", launch)
        got = silu_down_partials(gate_up, down_weight, 4)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["qwen2-counting", "llama-small"])
def preset_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The tiny presets with noise on every weight (as test_static_decode.py does).
    base = resolve_model_path(f"tiny://{request.param}", tmp_path_factory.mktemp("cache"))
    model = load_causal_lm(base, device="cpu")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator) * 0.1
            parameter.add_(noise.to(parameter.dtype))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder


@cuda_kernel
@pytest.mark.parametrize("compile_step", [False, True])
@pytest.mark.parametrize("down_splits", [2, 4])
def test_graph_with_fused_mlp_matches_eager_reference(
    preset_path: Path, compile_step: bool, down_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The graphed decoder (prefill and every captured step) runs the kernel; the eager one
    # runs the torch reference. float32: the same tokens and logprobs within 1e-4.
    monkeypatch.setattr(static_decode, "DOWN_SPLITS", down_splits)
    model = load_causal_lm(preset_path, device="cuda", dtype="float32")
    eager = StaticDecoder(model, slots=16, max_len=64, use_graphs=False, compile_step=False)
    graphed = StaticDecoder(model, slots=16, max_len=64, use_graphs=True, compile_step=compile_step)
    prompts = [[5 + i, 6, 7 + i, 8][: 2 + i % 3] for i in range(5)]
    slots = [0, 3, 4, 9, 2]
    for decoder, fused in ((eager, False), (graphed, True)):
        monkeypatch.setattr(static_decode, "FUSED_SILU_DOWN", fused)
        decoder.prefill(slots, [prompt[:-1] for prompt in prompts])
        decoder.set_rows(
            slots,
            tokens=[prompt[-1] for prompt in prompts],
            positions=[len(prompt) - 1 for prompt in prompts],
            temperatures=[0.0, 1.0, 0.8, 0.0, 1.2],
            top_ps=[1.0, 1.0, 1.0, 1.0, 1.0],
        )
    for step in range(8):
        uniforms = [((step * 7 + slot) % 10) / 10 + 0.05 for slot in slots]
        position = 3 + step
        monkeypatch.setattr(static_decode, "FUSED_SILU_DOWN", False)
        expected = eager.step(slots, uniforms, max_position=position, top_p=False)
        monkeypatch.setattr(static_decode, "FUSED_SILU_DOWN", True)
        actual = graphed.step(slots, uniforms, max_position=position, top_p=False)
        assert actual[0] == expected[0]
        assert max(abs(a - b) for a, b in zip(actual[1], expected[1], strict=True)) < 1e-4
    assert graphed.graph_count >= 1
