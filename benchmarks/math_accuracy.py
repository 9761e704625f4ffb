"""Accuracy of a model folder on arithmetic problems, prompted and scored the way a run trains.

Renders every problem of ``--dataset`` (default ``builtin://math-heldout``: none of its
problems is in ``builtin://math``) with the run config's ``data.prompt_format`` and
``data.system_prompt`` and the model's own tokenizer, generates with the torch engine (stopping
on every EOS id of the folder and ``policy.generation.stop_token_ids``/``stop_strings``), and
scores with the math environment. ``--samples 0`` (default) decodes greedily; ``--samples K``
draws K completions per problem at ``policy.generation.temperature`` and reports their mean
reward (the training reward's expectation). Run it on the base model and on a trainer
checkpoint (``<checkpoint_dir>/step_N/policy`` is a model folder) to see what training changed:

    python benchmarks/math_accuracy.py --config examples/configs/grpo_smollm2_math_gpu.yaml
    python benchmarks/math_accuracy.py --config examples/configs/grpo_smollm2_math_gpu.yaml \\
        --model checkpoints/grpo_smollm2_math_gpu/step_200/policy

Prints one ``RESULT {json}`` line: accuracy, how many completions ended on a stop token, their
mean length, the extraction rule counts, and a few example completions.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time

from tandemrl.config import load_config
from tandemrl.config.models import DataConfig
from tandemrl.controller.actor import run_text_codec
from tandemrl.data.dataset import load_prompt_records
from tandemrl.envs.math import MathEnv
from tandemrl.generation import engine_options
from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.models import resolve_model_path
from tandemrl.records import GenerationRequest, PromptItem


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's YAML config")
    parser.add_argument("--model", default=None, help="model folder (default: policy.model_name)")
    parser.add_argument("--dataset", default="builtin://math-heldout")
    parser.add_argument("--limit", type=int, default=None, help="first N problems only")
    parser.add_argument("--samples", type=int, default=0, help="0: greedy; K: K samples each")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--examples", type=int, default=5, help="completions shown in RESULT")
    parser.add_argument("overrides", nargs="*", metavar="a.b.c=value")
    return parser.parse_args(argv)


async def generate(engine: TorchGenerationEngine, requests: list[GenerationRequest]):
    try:
        return await engine.generate(requests)
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.model is not None:
        overrides.append(f"policy.model_name={args.model}")
    cfg = load_config(args.config, overrides)
    model_path = resolve_model_path(cfg.policy.model_name)
    codec = run_text_codec(cfg, str(model_path))
    data = DataConfig(**{**cfg.data.model_dump(), "dataset": args.dataset})
    records = load_prompt_records(data)[: args.limit]
    items = [
        PromptItem(f"eval-{index}", 0, index, record.prompt, record.answer, record.task_source)
        for index, record in enumerate(records)
    ]
    generation = cfg.policy.generation
    samples = max(args.samples, 1)
    temperature = generation.temperature if args.samples > 0 else 0.0
    max_new_tokens = args.max_new_tokens or generation.max_new_tokens
    stops = codec.stop_token_ids  # the folder's EOS ids, the tokenizer's, the configured ones
    requests = [
        GenerationRequest(
            f"{item.prompt_id}/{sample}",
            codec.encode_prompt(item),
            max_new_tokens,
            temperature,
            generation.top_p,
            stops,
            seed=index * samples + sample,
        )
        for index, item in enumerate(items)
        for sample in range(samples)
    ]
    options = engine_options(cfg.policy, seed=cfg.algorithm.seed)
    options["max_batch_size"] = min(options["max_batch_size"], max(len(requests), 1))
    started = time.perf_counter()
    engine = TorchGenerationEngine(model_path, **options)
    results = asyncio.run(generate(engine, requests))
    seconds = time.perf_counter() - started

    env = MathEnv(**cfg.env.kwargs) if cfg.env.name == "math" else MathEnv()
    rewards, rules, examples = [], collections.Counter(), []
    for request, result in zip(requests, results, strict=True):
        item = items[int(request.request_id.split("/")[0].removeprefix("eval-"))]
        completion = result.token_ids
        if completion and completion[-1] in stops:
            completion = completion[:-1]
        text = codec.decode(completion)
        scored = env.score(item, text, truncated=result.finish_reason == "length")
        rewards.append(scored.reward)
        rules[str(scored.metadata.get("extraction"))] += 1
        if len(examples) < args.examples:
            examples.append({"prompt": item.prompt, "answer": str(item.answer), "reply": text})
    result = {
        "model": str(model_path),
        "dataset": args.dataset,
        "prompt_format": cfg.data.prompt_format,
        "problems": len(items),
        "samples_per_problem": samples,
        "decoding": "greedy" if args.samples == 0 else f"temperature {temperature}",
        "accuracy": sum(rewards) / len(rewards) if rewards else 0.0,
        "stopped": sum(r.finish_reason == "stop" for r in results) / max(len(results), 1),
        "mean_completion_tokens": sum(len(r.token_ids) for r in results) / max(len(results), 1),
        "extraction": dict(rules),
        "seconds": round(seconds, 2),
        "device": str(engine.device),
        "static_decode": engine.static_decode,
        "examples": examples,
    }
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
