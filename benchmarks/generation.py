"""Generation tokens/s: the torch engine against the vLLM engine, same model, same batch.

Both engines serve the same tiny model (default ``tiny://qwen2-counting``) in float32 on CPU
with one thread each. After one warm-up batch per engine, rounds alternate between them (the
machines are noisy; alternating spreads the noise over both): each round is ``--batch``
requests of ``--new-tokens`` tokens, temperature 1, one seed per request. tokens/s is the
tokens generated (EOS can end a sequence early) divided by the wall time of the rounds.
Ends with one line ``RESULT {...}`` holding both figures and ``vllm_over_torch``.

Needs the vLLM environment (``scripts/install_vllm.sh .venv-vllm``):

    .venv-vllm/bin/python benchmarks/generation.py [--batch 64] [--new-tokens 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import torch

from tandemrl.config.models import PolicyConfig
from tandemrl.generation.base import GenerationBackend
from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.generation.vllm_engine import VllmGenerationEngine
from tandemrl.models import load_tokenizer, resolve_model_path
from tandemrl.records import GenerationRequest


def make_requests(prompts: list[list[int]], tag: str, new_tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"{tag}-{index}",
            prompt_token_ids=prompt,
            max_new_tokens=new_tokens,
            temperature=1.0,
            seed=index,
        )
        for index, prompt in enumerate(prompts)
    ]


async def timed_batch(
    engine: GenerationBackend, prompts: list[list[int]], tag: str, new_tokens: int
) -> tuple[int, float]:
    started = time.perf_counter()
    results = await engine.generate(make_requests(prompts, tag, new_tokens))
    return sum(len(result.token_ids) for result in results), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny://qwen2-counting")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    # Counting prompts like the default task's ("583="), all distinct.
    prompts = [
        list(tokenizer(f"{index * 37 % 1000}=", add_special_tokens=False)["input_ids"])
        for index in range(args.batch)
    ]
    cfg = PolicyConfig.model_validate(
        {
            "model_name": args.model,
            "device": "cpu",
            "precision": "float32",
            "generation": {
                "backend": "vllm",
                "max_batch_size": args.batch,
                "vllm_cfg": {"async_engine": True},
            },
        }
    )
    started = time.perf_counter()
    vllm_engine = VllmGenerationEngine(cfg, model_path, seed=0)
    vllm_startup_s = time.perf_counter() - started

    async def measure() -> dict[str, float]:
        torch_engine = TorchGenerationEngine(
            model_path, device="cpu", dtype="float32", max_batch_size=args.batch
        )
        engines: dict[str, GenerationBackend] = {"torch": torch_engine, "vllm": vllm_engine}
        tokens = dict.fromkeys(engines, 0)
        seconds = dict.fromkeys(engines, 0.0)
        try:
            for name, engine in engines.items():
                await timed_batch(engine, prompts, f"warmup-{name}", args.new_tokens)
            for round_index in range(args.rounds):
                for name, engine in engines.items():
                    count, elapsed = await timed_batch(
                        engine, prompts, f"{name}-{round_index}", args.new_tokens
                    )
                    tokens[name] += count
                    seconds[name] += elapsed
        finally:
            await torch_engine.shutdown()
            await vllm_engine.shutdown()
        return {name: tokens[name] / seconds[name] for name in engines}

    rates = asyncio.run(measure())
    result = {
        "model": args.model,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "torch_tokens_per_s": round(rates["torch"], 1),
        "vllm_tokens_per_s": round(rates["vllm"], 1),
        "vllm_over_torch": round(rates["vllm"] / rates["torch"], 3),
        "vllm_startup_s": round(vllm_startup_s, 1),
    }
    print(
        f"torch {result['torch_tokens_per_s']:.0f} tokens/s, vllm {result['vllm_tokens_per_s']:.0f} "
        f"tokens/s: vllm/torch = {result['vllm_over_torch']:.2f}x "
        f"(vLLM start-up {result['vllm_startup_s']:.0f} s)"
    )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
