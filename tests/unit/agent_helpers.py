"""Shared parts of the agent tests: a scripted engine, a chat tokenizer, a small agent run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tandemrl.agents.episodes import EpisodeRegistry
from tandemrl.agents.server import PolicyEndpoint
from tandemrl.agents.service import (
    PolicyService,
    ServiceSettings,
    single_token_stop,
    tokenizer_chat_renderer,
)
from tandemrl.codec import TextCodec, text_codec
from tandemrl.config.loader import load_config
from tandemrl.config.models import MasterConfig
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.controller.single_controller import SingleController
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.generation.base import GenerationBackend, GenerationError
from tandemrl.models.chat_formats import COUNTING_CHAT
from tandemrl.models.tokenizer import CHAR_ALPHABET, build_char_tokenizer
from tandemrl.records import GenerationRequest, GenerationResult
from tandemrl.rollout.generation_pool import GenerationPool
from tandemrl.training.fake import FakeTrainer

EXEMPLAR = "examples/configs/grpo_tiny_cpu_agent.yaml"


def chat_tokenizer(template: str = COUNTING_CHAT.template, extra: tuple[str, ...] = ()) -> Any:
    """The exemplar's character tokenizer with its chat markers (and ``extra`` special tokens)."""
    tokenizer = build_char_tokenizer(CHAR_ALPHABET, (*COUNTING_CHAT.special_tokens, *extra))
    tokenizer.chat_template = template
    return tokenizer


def end_id(tokenizer: Any) -> int:
    """The token that ends a turn of the counting chat format: the tokenizer's <eos>."""
    return int(tokenizer.eos_token_id)


def codec_for(tokenizer: Any) -> TextCodec:
    return text_codec(tokenizer, stop_token_ids=(end_id(tokenizer),))


class ScriptedEngine(GenerationBackend):
    """Answers each request with ``answer(request)`` token ids, distinct logprobs, and the
    current weight version; records every result. ``fail``: request ids that raise."""

    def __init__(self, answer: Callable[[GenerationRequest], list[int]]) -> None:
        self.answer = answer
        self.version = 0
        self.results: list[GenerationResult] = []
        self.fail: Callable[[GenerationRequest], bool] = lambda request: False
        self.latency_s = 0.0
        self.aborted: set[str] = set()
        self.frozen = 0.0

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        out = []
        for request in requests:
            if self.fail(request):
                raise GenerationError(f"scripted failure of {request.request_id}")
            tokens = self.answer(request)[: request.max_new_tokens]
            stop = bool(tokens) and tokens[-1] in request.stop_token_ids
            start = self.version
            result = GenerationResult(
                request.request_id,
                list(request.prompt_token_ids),
                tokens,
                [-0.1 * (index + 1) - 0.001 * len(self.results) for index in range(len(tokens))],
                "stop" if stop else "length",
                [self.version] * len(tokens),
                start,
            )
            if request.request_id in self.aborted:
                result = GenerationResult(
                    request.request_id, list(request.prompt_token_ids), [], [], "aborted", [], start
                )
            self.results.append(result)
            out.append(result)
        return out

    async def update_weights(self, version: int, weights: Any) -> None:
        self.version = version

    async def weight_version(self) -> int:
        return self.version

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.update(request_ids)

    async def frozen_time(self) -> float:
        return self.frozen


def counting_answers(tokenizer: Any) -> Callable[[GenerationRequest], list[int]]:
    """A perfect counting player: continue from the digit before the last '=' of the prompt."""
    end = end_id(tokenizer)

    def answer(request: GenerationRequest) -> list[int]:
        text = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)
        digit = int(text.rstrip("=")[-1])
        reply = "".join(str((digit + k) % 10) for k in range(1, 4))
        return [*tokenizer.encode(reply, add_special_tokens=False), end]

    return answer


def service_for(
    engine: GenerationBackend,
    tokenizer: Any,
    *,
    registry: EpisodeRegistry | None = None,
    **settings: Any,
) -> PolicyService:
    codec = codec_for(tokenizer)
    values: dict[str, Any] = {
        "served_model_name": "policy",
        "temperature": 1.0,
        "top_p": 1.0,
        "stop_token_ids": (end_id(tokenizer),),
        "max_tokens_per_turn": 4,
        "max_total_tokens": 64,
        "max_turns": 4,
    }
    values.update(settings)
    return PolicyService(
        GenerationPool([engine]),
        registry=registry or EpisodeRegistry(),
        settings=ServiceSettings(**values),
        render_chat=tokenizer_chat_renderer(tokenizer, codec.encode),
        encode=codec.encode,
        decode=codec.decode,
        stop_string_ids=single_token_stop(tokenizer),
    )


async def started_endpoint(service: PolicyService, **kwargs: Any) -> PolicyEndpoint:
    endpoint = PolicyEndpoint(service, **kwargs)
    await endpoint.start()
    return endpoint


def small_agent_config(*overrides: str, steps: int = 2) -> MasterConfig:
    """The exemplar shrunk to 2 prompts x 2 episodes a step, with room for the three-digit
    answers (and the end of the turn) of ``CountingGameAgent()`` and ``counting_answers``."""
    return load_config(
        EXEMPLAR,
        (
            "policy.generation.max_new_tokens=4",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=4",
            "policy.train_micro_batch_size=4",
            f"grpo.max_num_steps={steps}",
            "async_rl.min_groups_for_streaming_train=2",
            "async_rl.max_buffered_rollouts=4",
            "async_rl.max_inflight_prompts=4",
            "logger.log_dir=/tmp/tandemrl-agent-tests",
            *overrides,
        ),
    )


def prompts(count: int = 8) -> PromptDataLoader:
    records = [PromptRecord(prompt=f"{i % 10}{(i * 7) % 10}=") for i in range(count)]
    return PromptDataLoader(records, max_num_epochs=1, seed=0, shuffle=False)


def agent_controller(
    cfg: MasterConfig,
    agent: Any,
    engine: GenerationBackend,
    tokenizer: Any,
    *,
    trainer: FakeTrainer | None = None,
    count: int = 8,
) -> tuple[SingleController, FakeTrainer]:
    trainer = trainer or FakeTrainer()
    parts = ControllerParts(
        trainer=trainer,
        engines=[engine],
        env=None,
        codec=codec_for(tokenizer),
        dataloader=prompts(count),
        agent=agent,
        tokenizer=tokenizer,
    )
    return build_controller(cfg, parts), trainer


def run_controller(controller: SingleController, timeout: float = 60.0) -> list[dict[str, float]]:
    return asyncio.run(asyncio.wait_for(controller.run(), timeout=timeout))
