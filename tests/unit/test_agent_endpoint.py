"""The policy endpoint on 127.0.0.1, driven by the official openai client: answers, refusals,
capture, and the in-process client's equal surface."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from agent_helpers import (
    ScriptedEngine,
    chat_tokenizer,
    counting_answers,
    end_id,
    service_for,
    started_endpoint,
)

from tandemrl.agents.inprocess import InProcessClient

MESSAGES = [{"role": "user", "content": "583="}]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_chat_turns_over_http_carry_and_capture_the_exact_sampled_tokens():
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    service = service_for(engine, tokenizer)

    async def go():
        endpoint = await started_endpoint(service)
        episode = service.registry.open("g0", 1, 1)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=episode.key, max_retries=0)
        try:
            first = await client.chat.completions.create(
                model="policy", messages=MESSAGES, max_tokens=4, logprobs=True
            )
            engine.version = 3  # new weights between the turns
            messages = [
                *MESSAGES,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "6="},
            ]
            second = await client.chat.completions.create(
                model="policy",
                messages=messages,
                max_tokens=4,
                extra_body={"return_token_ids": True},
            )
            models = await client.models.list()
        finally:
            await client.close()
            await endpoint.stop()
        return episode, first, second, models

    episode, first, second, models = run(go())
    assert first.choices[0].message.content == "456"
    assert second.choices[0].message.content == "789"
    assert [m.id for m in models.data] == ["policy"]
    for reply, result in zip((first, second), engine.results, strict=True):
        extra = reply.choices[0].message.model_extra
        assert extra["prompt_token_ids"] == result.prompt_token_ids
        assert extra["generation_token_ids"] == result.token_ids
        assert extra["generation_log_probs"] == pytest.approx(result.logprobs)
        assert reply.choices[0].finish_reason == "stop"
    # The prompt is the chat template's rendering, and the sampled stop token is kept.
    assert tokenizer.decode(engine.results[0].prompt_token_ids) == "<|user|>583=<eos><|assistant|>"
    assert engine.results[0].token_ids[-1] == end_id(tokenizer)
    # OpenAI's logprobs block and vLLM's token-id fields agree with the triple.
    assert [entry.logprob for entry in first.choices[0].logprobs.content] == pytest.approx(
        engine.results[0].logprobs
    )
    assert second.model_extra["prompt_token_ids"] == engine.results[1].prompt_token_ids
    assert second.choices[0].model_extra["token_ids"] == engine.results[1].token_ids
    # Each call is a captured turn, with its weight versions.
    turns = episode.turns
    assert [t.token_ids for t in turns] == [r.token_ids for r in engine.results]
    assert [(t.start_weight_version, t.end_weight_version) for t in turns] == [(0, 0), (3, 3)]
    assert second.model_extra["tandemrl"]["start_weight_version"] == 3


def test_bad_requests_get_their_documented_answers():
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(counting_answers(tokenizer))
    service = service_for(engine, tokenizer, max_total_tokens=12, max_turns=2)

    async def go():
        endpoint = await started_endpoint(service, max_request_bytes=2048)
        url = endpoint.url
        episode = service.registry.open("g0", 0, 1)
        answers: dict[str, tuple[int, str | None, str]] = {}

        async def call(name, key, **body):
            client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
            try:
                await client.chat.completions.create(**{"model": "policy", **body})
                answers[name] = (200, None, "")
            except openai.APIStatusError as error:
                param = error.body.get("param") if isinstance(error.body, dict) else None
                answers[name] = (error.status_code, param, str(error))
            finally:
                await client.close()

        ok = {"messages": MESSAGES, "max_tokens": 4}
        await call("unknown key", "not-a-key", **ok)
        await call("wrong model", episode.key, **{**ok, "model": "gpt-4"})
        await call("wrong temperature", episode.key, **ok, temperature=0.7)
        await call("wrong top_p", episode.key, **ok, top_p=0.9)
        await call("two choices", episode.key, **ok, n=2)
        await call("streaming", episode.key, **ok, stream=False, extra_body={"stream": True})
        await call("multi-token stop", episode.key, **ok, stop=["45"])
        await call("no messages", episode.key, messages=[])
        await call("oversized", episode.key, messages=[{"role": "user", "content": "1" * 5000}])
        await call("overflow", episode.key, messages=[{"role": "user", "content": "1234567890="}])
        await call("after overflow", episode.key, **ok)  # the overflow ended the episode
        async with httpx.AsyncClient() as raw:
            no_key = await raw.post(f"{url}/chat/completions", json={"model": "policy", **ok})
            health = await raw.get(url.removesuffix("/v1") + "/health")
        other = service.registry.open("g0", 1, 1)
        await call("first", other.key, **ok)
        await call("second", other.key, **ok)
        await call("past max_turns", other.key, **ok)
        third = service.registry.open("g0", 2, 1)
        service.registry.close(third, "dropped (its group was dropped)")
        await call("closed", third.key, **ok)
        await endpoint.stop()
        return answers, no_key, health, episode, other

    answers, no_key, health, episode, other = run(go())
    assert no_key.status_code == 401 and health.json() == {"status": "ok"}
    assert answers["unknown key"][0] == 401
    expected_400 = {
        "wrong model": "model",
        "wrong temperature": "temperature",
        "wrong top_p": "top_p",
        "two choices": "n",
        "streaming": "stream",
        "multi-token stop": "stop",
        "no messages": "messages",
        "oversized": "max_request_bytes",
        "overflow": "messages",
    }
    for name, param in expected_400.items():
        assert answers[name][:2] == (400, param), (name, answers[name])
    assert "maximum context length" in answers["overflow"][2]
    assert episode.ended_by == "context"
    assert answers["after overflow"][0] == 409 and "context" in answers["after overflow"][2]
    assert answers["first"][0] == answers["second"][0] == 200
    assert answers["past max_turns"][0] == 409 and "max_turns" in answers["past max_turns"][2]
    assert other.ended_by == "max_turns"
    assert answers["closed"][0] == 409 and "dropped" in answers["closed"][2]
    # Nothing refused reached the engine: two turns of `other` only.
    assert len(engine.results) == 2


def test_the_in_process_client_answers_with_the_same_objects_as_http():
    tokenizer = chat_tokenizer()

    async def episode_over(make_client):
        engine = ScriptedEngine(counting_answers(tokenizer))
        service = service_for(engine, tokenizer, max_total_tokens=12)
        endpoint = await started_endpoint(service)
        episode = service.registry.open("g0", 0, 1)
        client = make_client(service, endpoint.url, episode.key)
        try:
            reply = await client.chat.completions.create(model="policy", messages=MESSAGES)
            text = await client.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=2)
            try:
                await client.chat.completions.create(
                    model="policy", messages=MESSAGES, temperature=0.5
                )
            except openai.BadRequestError as error:
                refusal = (type(error), error.status_code, error.body)
        finally:
            await endpoint.stop()
        dump = reply.model_dump()
        dump.pop("created")
        text_dump = text.model_dump()
        text_dump.pop("created")
        return type(reply), dump, text_dump, refusal, [t.token_ids for t in episode.turns]

    def http(service, url, key):
        return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)

    def in_process(service, url, key):
        return InProcessClient(service, key)

    over_http = run(episode_over(http))
    local = run(episode_over(in_process))
    assert over_http == local
    assert over_http[1]["choices"][0]["message"]["content"] == "456"
    assert over_http[2]["choices"][0]["generation_token_ids"] == over_http[4][1]


def test_unknown_routes_and_faults_of_the_endpoint_get_http_answers(caplog):
    tokenizer = chat_tokenizer()
    service = service_for(ScriptedEngine(counting_answers(tokenizer)), tokenizer)

    async def broken_chat(key, body):
        raise ValueError("a bug in the service")

    async def go():
        endpoint = await started_endpoint(service)
        root = endpoint.url.removesuffix("/v1")
        async with httpx.AsyncClient() as raw:
            unknown = await raw.post(f"{root}/v1/embeddings", json={})
            wrong_method = await raw.get(f"{root}/v1/chat/completions")
        service.chat = broken_chat  # the handler looks the method up per request
        episode = service.registry.open("g0", 0, 1)
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=episode.key, max_retries=0)
        try:
            with pytest.raises(openai.InternalServerError) as fault:
                await client.chat.completions.create(model="policy", messages=MESSAGES)
        finally:
            await client.close()
        async with httpx.AsyncClient() as raw:
            health = await raw.get(f"{root}/health")
        await endpoint.stop()
        return unknown, wrong_method, fault.value, health

    unknown, wrong_method, fault, health = run(go())
    assert unknown.status_code == 404
    assert wrong_method.status_code == 405
    assert fault.status_code == 500
    assert "ValueError: a bug in the service" in str(fault)
    assert fault.body["type"] == "InternalServerError"
    # The fault is logged with its traceback, and the endpoint keeps serving.
    assert any(r.exc_info and "failed" in r.getMessage() for r in caplog.records)
    assert health.status_code == 200
