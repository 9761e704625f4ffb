"""Helpers of the vLLM backend tests (importable: this folder is on sys.path under pytest)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandemrl.config.models import PolicyConfig
from tandemrl.models import load_causal_lm, load_tokenizer
from tandemrl.records import GenerationRequest

T = TypeVar("T")

# The tiny Qwen2 preset has tied embeddings: the case vLLM's CPU reload gets wrong by itself.
TINY_PRESET = "tiny://qwen2-counting"


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine to completion (the engine serves callers on any event loop)."""
    return asyncio.run(coroutine)


def vllm_policy_cfg(max_batch_size: int = 64, max_model_len: int | None = 128) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": TINY_PRESET,
            "device": "cpu",
            "precision": "float32",
            "generation": {
                "backend": "vllm",
                "max_batch_size": max_batch_size,
                "vllm_cfg": {"async_engine": True, "max_model_len": max_model_len},
            },
        }
    )


def requests_for(
    prompts: list[list[int]],
    *,
    prefix: str,
    max_new_tokens: int = 8,
    temperature: float = 0.0,
    seed: int | None = None,
) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"{prefix}-{index}",
            prompt_token_ids=prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=None if seed is None else seed + index,
        )
        for index, prompt in enumerate(prompts)
    ]


def perturbed_model_dir(tiny_model_dir: Path, target: Path, *, seed: int, scale: float) -> Path:
    """The tiny model with seeded noise on every parameter, saved (ties kept) into ``target``."""
    model = load_causal_lm(tiny_model_dir, "float32", "cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters lists a tied matrix once, so embedding and head stay one tensor.
        for _, parameter in model.named_parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(target, safe_serialization=True)
    load_tokenizer(tiny_model_dir).save_pretrained(target)
    return target


def teacher_forced_logprobs(
    model_dir: Path, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits / temperature) of each completion token, one forward pass."""
    model = load_causal_lm(model_dir, "float32", "cpu")
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits / scale, dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()
