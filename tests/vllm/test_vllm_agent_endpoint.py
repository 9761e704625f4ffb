"""The policy endpoint in front of the vLLM backend: the official openai client over HTTP gets
exactly the token ids and logprobs vLLM sampled, turn after turn, and they are captured."""

from __future__ import annotations

import asyncio

import openai
import pytest
from vllm_helpers import teacher_forced_logprobs

from tandemrl.agents.episodes import EpisodeRegistry
from tandemrl.agents.server import PolicyEndpoint
from tandemrl.agents.service import PolicyService, ServiceSettings
from tandemrl.generation.vllm_engine import VllmGenerationEngine
from tandemrl.rollout.generation_pool import GenerationPool
from tandemrl.rollout.token_capture import merge_turns


class Recording:
    """The engine, with every result it returned kept."""

    def __init__(self, engine: VllmGenerationEngine) -> None:
        self.engine = engine
        self.results: list = []

    async def generate(self, requests):
        results = await self.engine.generate(requests)
        self.results.extend(results)
        return results

    async def abort(self, request_ids):
        await self.engine.abort(request_ids)

    async def frozen_time(self):
        return await self.engine.frozen_time()


def test_the_endpoint_serves_vllm_tokens_and_logprobs_exactly(engine, encode, tiny_model_dir):
    recording = Recording(engine)

    def render(messages, tools, extra):  # the counting preset has no chat template: raw text
        return encode("".join(message["content"] for message in messages))

    service = PolicyService(
        GenerationPool([recording]),
        registry=EpisodeRegistry(),
        settings=ServiceSettings(
            served_model_name="policy",
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=(),
            max_tokens_per_turn=6,
            max_total_tokens=64,
            max_turns=4,
        ),
        render_chat=render,
        encode=encode,
        decode=lambda ids: "".join(str(i) for i in ids),
    )

    async def go():
        endpoint = PolicyEndpoint(service)
        await endpoint.start()
        episode = service.registry.open("g0", 0, 1)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=episode.key, max_retries=0)
        try:
            first = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "583="}], max_tokens=6
            )
            ids = first.choices[0].message.model_extra
            follow_up = ids["prompt_token_ids"] + ids["generation_token_ids"] + encode("=")
            second = await client.completions.create(model="policy", prompt=follow_up, max_tokens=6)
        finally:
            await client.close()
            await endpoint.stop()
        return episode, first, second

    episode, first, second = asyncio.run(asyncio.wait_for(go(), timeout=120))
    chat_fields = first.choices[0].message.model_extra
    text_fields = second.choices[0].model_extra
    for fields, result in zip((chat_fields, text_fields), recording.results, strict=True):
        assert fields["prompt_token_ids"] == result.prompt_token_ids
        assert fields["generation_token_ids"] == result.token_ids
        assert fields["generation_log_probs"] == pytest.approx(result.logprobs)
        assert len(result.token_ids) == 6
    assert chat_fields["prompt_token_ids"] == encode("583=")
    # vLLM's logprobs are the model's: a forward pass over the captured row gives the same.
    (row,) = merge_turns(episode.turns, on_prefix_mismatch="error")
    assert row.token_mask.count(1.0) == 12  # both turns' sampled tokens, the "=" between masked
    start = len(episode.turns[0].prompt_token_ids)
    forward = teacher_forced_logprobs(
        tiny_model_dir, row.input_ids[:start], row.input_ids[start:], 1.0
    )
    masks = row.token_mask[start:]
    sampled = [lp for lp, mask in zip(forward, masks, strict=True) if mask]
    captured = [lp for lp, mask in zip(row.logprobs[start:], masks, strict=True) if mask]
    assert sampled == pytest.approx(captured, abs=2e-3)
