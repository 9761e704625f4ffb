"""Fixtures of the vLLM backend tests: the tiny model, one shared engine, weight helpers.

These tests run only in the vLLM environment (``scripts/install_vllm.sh .venv-vllm``, then
``.venv-vllm/bin/python -m pytest tests/vllm``); the main test run does not collect this folder.
Starting an engine costs 10-80 s on the shared 2-core machines, so one engine serves the whole
session; a test that changes its weights puts the original ones back before it returns.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# One OpenMP thread, unpinned, in the engine process as in the test process (FIELD-NOTES).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from vllm_helpers import TINY_PRESET, run, vllm_policy_cfg

from tandemrl.generation.vllm_engine import VllmGenerationEngine
from tandemrl.models import load_causal_lm, load_tokenizer, resolve_model_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model_path(TINY_PRESET, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Iterator[VllmGenerationEngine]:
    vllm_engine = VllmGenerationEngine(vllm_policy_cfg(), tiny_model_dir, seed=0)
    yield vllm_engine
    vllm_engine.shutdown_sync()


@pytest.fixture(scope="session")
def original_weights(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return {
        name: tensor.clone()
        for name, tensor in load_causal_lm(tiny_model_dir, "float32", "cpu").state_dict().items()
    }


@pytest.fixture(scope="session")
def encode(tiny_model_dir: Path):
    tokenizer = load_tokenizer(tiny_model_dir)

    def _encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return _encode


@pytest.fixture
def restore_weights(engine: VllmGenerationEngine, original_weights: dict[str, torch.Tensor]):
    """Put the preset's weights back (under a new version) after a test that changed them."""
    yield
    version = engine.current_weight_version + 1
    run(engine.update_weights(version, original_weights))
