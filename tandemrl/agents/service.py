"""The policy behind both agent clients: checks a request, renders it, generates, captures.

``PolicyService.chat(key, body)`` and ``.completion(key, body)`` take an OpenAI request body
(a dict, as JSON gives it) and the bearer key, and return the OpenAI response body (a dict)
or raise ``RequestError`` with the HTTP status and a message naming the request field. The
HTTP server (``server.py``) and the in-process client (``inprocess.py``) are thin shells
around it, so an agent sees the same answers either way and every call is captured the same.

One call, step by step:

1. the key → its open episode (401 unknown key, 409 finished/dropped/ended by a limit);
2. the body is checked: ``model``, sampling parameters (``temperature``/``top_p`` must be the
   run's unless ``allow_sampling_overrides``; parameters that would change the distribution
   or ask for several choices are refused), ``messages``/``prompt``, ``stop`` (single tokens);
3. the prompt ids: chat messages rendered with the tokenizer's chat template
   (``apply_chat_template``, ``add_generation_prompt=True``) and encoded without special
   tokens, as ``data.prompt_format: chat`` does; a completions prompt as text, or ids as given;
4. the token budget: min(max_tokens, ``max_tokens_per_turn``, room in the context, room in
   ``max_tokens_per_episode``); no room in the context ends the episode (``context``, 400
   "maximum context length"), the call after ``max_turns`` ends it too (409);
5. one ``GenerationRequest`` through the ``GenerationPool`` (seeded per episode and call),
   bounded by ``call_timeout_s`` of awake time; an engine failure or the deadline is recorded
   on the episode as its infrastructure failure (503 / 504);
6. the turn is recorded on the episode (prompt ids, sampled ids, logprobs, finish reason,
   weight versions), and the answer built with the token fields NeMo-RL's servers return.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandemrl.agents.episodes import Episode, EpisodeClosed, EpisodeRegistry, UnknownEpisodeKey
from tandemrl.records import AgentTurn, GenerationRequest, GenerationResult
from tandemrl.rollout.generation_pool import GenerationPool, NoGenerationWorkers, within_awake_time

# Parameters that would change the sampling distribution away from the run's (or give more
# than one choice per turn), with the value that leaves it unchanged.
NEUTRAL_PARAMETERS: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "logit_bias": None,
}
SAMPLING_TOLERANCE = 1e-6


class RequestError(Exception):
    """A request the endpoint answers with an error: HTTP ``status``, the request field."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        return {
            400: "BadRequestError",
            401: "AuthenticationError",
            409: "ConflictError",
            500: "InternalServerError",
            503: "ServiceUnavailableError",
            504: "TimeoutError",
        }.get(self.status, "APIError")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True)
class ServiceSettings:
    """What the service enforces (from policy.generation, http_server and env.agent)."""

    served_model_name: str
    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]
    max_tokens_per_turn: int
    max_total_tokens: int  # policy.max_total_sequence_length: prompt + completion of a call
    max_turns: int
    max_tokens_per_episode: int | None = None
    call_timeout_s: float | None = None
    allow_sampling_overrides: bool = False
    seed: int = 0


ChatRenderer = Callable[[list[dict[str, Any]], Any, dict[str, Any]], list[int]]


def tokenizer_chat_renderer(tokenizer: Any, encode: Callable[[str], list[int]]) -> ChatRenderer:
    """Messages → prompt ids with the tokenizer's chat template, encoded like the run's
    prompts (``data.prompt_format: chat``: rendered text, no special tokens added)."""

    def render(messages: list[dict[str, Any]], tools: Any, extra: dict[str, Any]) -> list[int]:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra
        )
        return encode(text)

    return render


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(
                    400,
                    f"{where}[{index}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                    "supported",
                    param=where,
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RequestError(400, f"{where} must be a string or a list of text parts", param=where)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` for the chat template (text content, roles checked)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(400, f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(400, f"{where}.role {role!r} is not a chat role", param=where)
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""
        rendered = dict(message)
        rendered["content"] = _text_of(content, f"{where}.content")
        checked.append(rendered)
    return checked


class PolicyService:
    """See the module docstring."""

    def __init__(
        self,
        pool: GenerationPool,
        *,
        registry: EpisodeRegistry,
        settings: ServiceSettings,
        render_chat: ChatRenderer,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        token_text: Callable[[int], str] | None = None,
        stop_string_ids: Callable[[str], int | None] | None = None,
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.settings = settings
        self.render_chat = render_chat
        self.encode = encode
        self.decode = decode
        self.token_text = token_text or (lambda token_id: decode([token_id]))
        # A stop string's one token id (None when it is not one token).
        self.stop_string_ids = stop_string_ids
        self._stop_ids = frozenset(settings.stop_token_ids)
        self.calls = 0
        self.created = int(time.time())

    # ------------------------------------------------------------------ routes

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.settings.served_model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "tandemrl",
                }
            ],
        }

    async def chat(self, key: str | None, body: Any) -> dict[str, Any]:
        episode = self._episode(key)
        body = self._check_body(body)
        messages = check_messages(body.get("messages"))
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise RequestError(
                400, "chat_template_kwargs must be an object", param="chat_template_kwargs"
            )
        try:
            prompt_ids = self.render_chat(messages, body.get("tools"), extra)
        except RequestError:
            raise
        except Exception as exc:  # the template is user data: a bad conversation for it
            raise RequestError(
                400, f"the chat template cannot render messages: {exc}", param="messages"
            ) from exc
        turn, result, ended = await self._generate(episode, body, prompt_ids)
        content = self.decode(self._without_stop(result.token_ids))
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "prompt_token_ids": result.prompt_token_ids,
            "generation_token_ids": result.token_ids,
            "generation_log_probs": result.logprobs,
        }
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": result.finish_reason,
            "logprobs": self._logprobs(body, result),
        }
        response: dict[str, Any] = {
            "id": f"chatcmpl-{episode.request_prefix}/t{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.settings.served_model_name,
            "choices": [choice],
            "usage": self._usage(result),
            "tandemrl": self._stamps(turn, result, ended),
        }
        if body.get("return_token_ids"):
            response["prompt_token_ids"] = result.prompt_token_ids
            choice["token_ids"] = result.token_ids
        return response

    async def completion(self, key: str | None, body: Any) -> dict[str, Any]:
        episode = self._episode(key)
        body = self._check_body(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = self.encode(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            prompt_ids = list(prompt)
        else:
            raise RequestError(
                400,
                "prompt must be a string or a non-empty list of token ids (one prompt per call)",
                param="prompt",
            )
        turn, result, ended = await self._generate(episode, body, prompt_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.decode(self._without_stop(result.token_ids)),
            "finish_reason": result.finish_reason,
            "logprobs": None,
            "prompt_token_ids": result.prompt_token_ids,
            "generation_token_ids": result.token_ids,
            "generation_log_probs": result.logprobs,
            "token_ids": result.token_ids,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "tokens": [self._token_name(body, t) for t in result.token_ids],
                "token_logprobs": result.logprobs,
                "top_logprobs": None,
                "text_offset": None,
            }
        return {
            "id": f"cmpl-{episode.request_prefix}/t{turn}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.settings.served_model_name,
            "choices": [choice],
            "usage": self._usage(result),
            "tandemrl": self._stamps(turn, result, ended),
        }

    # ------------------------------------------------------------------ checks

    def _episode(self, key: str | None) -> Episode:
        try:
            return self.registry.lookup(key)
        except UnknownEpisodeKey as exc:
            raise RequestError(401, str(exc)) from exc
        except EpisodeClosed as exc:
            raise RequestError(409, str(exc)) from exc

    def _check_body(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        settings = self.settings
        model = body.get("model")
        if model != settings.served_model_name:
            raise RequestError(
                400,
                f"model {model!r} is not served here; use {settings.served_model_name!r} "
                "(policy.generation.http_server.served_model_name)",
                param="model",
            )
        if body.get("stream"):
            raise RequestError(400, "stream: streaming responses are not supported", param="stream")
        for name, run_value in (("temperature", settings.temperature), ("top_p", settings.top_p)):
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RequestError(400, f"{name} must be a number, got {value!r}", param=name)
            if (
                abs(value - run_value) > SAMPLING_TOLERANCE
                and not settings.allow_sampling_overrides
            ):
                raise RequestError(
                    400,
                    f"{name}={value} differs from the run's policy.generation.{name}="
                    f"{run_value}: the trainer's importance weights assume the run's sampling "
                    f"distribution. Leave {name} out, send {run_value}, or set "
                    "policy.generation.http_server.allow_sampling_overrides: true",
                    param=name,
                )
        for name, neutral in NEUTRAL_PARAMETERS.items():
            value = body.get(name)
            if value is None or value == neutral or (name == "top_k" and value == 0):
                continue
            raise RequestError(
                400,
                f"{name}={value!r} is not supported: it would change the sampling distribution "
                f"or the number of choices (send {neutral!r} or leave it out)",
                param=name,
            )
        return body

    def _max_tokens(self, body: dict[str, Any]) -> int:
        for name in ("max_completion_tokens", "max_tokens"):
            value = body.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(400, f"{name} must be a positive integer", param=name)
            return min(value, self.settings.max_tokens_per_turn)
        return self.settings.max_tokens_per_turn

    def _stop_ids_of(self, body: dict[str, Any]) -> tuple[int, ...]:
        stop = body.get("stop")
        if stop is None:
            return self.settings.stop_token_ids
        strings = [stop] if isinstance(stop, str) else stop
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise RequestError(400, "stop must be a string or a list of strings", param="stop")
        extra = []
        for text in strings:
            token_id = self.stop_string_ids(text) if self.stop_string_ids is not None else None
            if token_id is None:
                raise RequestError(
                    400,
                    f"stop string {text!r} is not one token of the policy's tokenizer; the "
                    "engine stops on single tokens only (the run's stop tokens always apply)",
                    param="stop",
                )
            extra.append(token_id)
        return tuple(dict.fromkeys((*self.settings.stop_token_ids, *extra)))

    # ------------------------------------------------------------------ generation

    async def _generate(
        self, episode: Episode, body: dict[str, Any], prompt_ids: list[int]
    ) -> tuple[int, GenerationResult, str | None]:
        """Generate one turn of ``episode``; returns (call index, result, limit that ended the
        episode with this turn or None)."""
        settings = self.settings
        wanted = self._max_tokens(body)
        stop_ids = self._stop_ids_of(body)
        if episode.calls >= settings.max_turns:
            episode.end("max_turns")
            raise RequestError(409, str(episode.refusal()))
        room = settings.max_total_tokens - len(prompt_ids)
        if room < 1:
            episode.end("context")
            raise RequestError(
                400,
                f"This model's maximum context length is {settings.max_total_tokens} tokens "
                f"(policy.max_total_sequence_length); the prompt is {len(prompt_ids)} tokens, "
                "which leaves no room for a completion. The episode ends truncated.",
                param="messages",
            )
        budget, limit = wanted, None
        if room < budget:
            budget, limit = room, "context"
        if settings.max_tokens_per_episode is not None:
            left = settings.max_tokens_per_episode - episode.generated_tokens
            if left < budget:
                budget, limit = left, "max_tokens_per_episode"
        turn = episode.calls
        episode.calls += 1
        episode.generated_tokens += budget
        temperature = body.get("temperature", settings.temperature)
        top_p = body.get("top_p", settings.top_p)
        request_id = f"{episode.request_prefix}/t{turn}"
        request = GenerationRequest(
            request_id,
            prompt_ids,
            budget,
            float(settings.temperature if temperature is None else temperature),
            float(settings.top_p if top_p is None else top_p),
            stop_ids,
            zlib.crc32(f"{settings.seed}|{request_id}".encode()) & 0x7FFFFFFF,
        )
        episode.in_flight.add(request_id)
        try:
            result = await self._call_engine(episode, request)
        finally:
            episode.in_flight.discard(request_id)
        episode.generated_tokens -= budget - len(result.token_ids)
        if result.finish_reason == "aborted":
            episode.aborted = True
            raise RequestError(409, f"episode {episode.request_prefix}: its generation was aborted")
        episode.turns.append(
            AgentTurn(
                result.prompt_token_ids,
                result.token_ids,
                result.logprobs,
                result.finish_reason,
                result.start_weight_version,
                result.end_weight_version,
            )
        )
        ended = None
        if limit is not None and result.finish_reason == "length":
            episode.end(limit)  # the turn was cut by the context or the episode's budget
            ended = limit
        self.calls += 1
        return turn, result, ended

    async def _call_engine(self, episode: Episode, request: GenerationRequest) -> GenerationResult:
        timeout = self.settings.call_timeout_s
        try:
            if timeout is None:
                results = await self.pool.generate([request])
            else:

                async def timed_out() -> TimeoutError:
                    await self.pool.abort([request.request_id])
                    return TimeoutError(
                        f"call {request.request_id} exceeded env.agent.call_timeout_s={timeout} "
                        "(awake time)"
                    )

                results = await within_awake_time(
                    self.pool.generate([request]),
                    timeout_s=timeout,
                    frozen_time=self.pool.frozen_time,
                    timed_out=timed_out,
                )
        except asyncio.CancelledError:
            raise
        except TimeoutError as exc:
            episode.infra_failure = exc
            raise RequestError(504, str(exc)) from exc
        except Exception as exc:  # the engine or its worker failed: infrastructure
            episode.infra_failure = exc
            status = 503
            raise RequestError(
                status,
                f"generation failed ({type(exc).__name__}: {exc})"
                + (
                    "; no generation worker is left" if isinstance(exc, NoGenerationWorkers) else ""
                ),
            ) from exc
        return results[0]

    # ------------------------------------------------------------------ answers

    def _without_stop(self, token_ids: list[int]) -> list[int]:
        if token_ids and token_ids[-1] in self._stop_ids:
            return token_ids[:-1]
        return token_ids

    def _token_name(self, body: dict[str, Any], token_id: int) -> str:
        if body.get("return_tokens_as_token_ids"):
            return f"token_id:{token_id}"
        return self.token_text(token_id)

    def _logprobs(self, body: dict[str, Any], result: GenerationResult) -> dict[str, Any] | None:
        if not body.get("logprobs"):
            return None
        return {
            "content": [
                {
                    "token": self._token_name(body, token_id),
                    "logprob": logprob if math.isfinite(logprob) else -9999.0,
                    "bytes": None,
                    "top_logprobs": [],
                }
                for token_id, logprob in zip(result.token_ids, result.logprobs, strict=True)
            ]
        }

    @staticmethod
    def _usage(result: GenerationResult) -> dict[str, int]:
        prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    @staticmethod
    def _stamps(turn: int, result: GenerationResult, ended: str | None) -> dict[str, Any]:
        return {
            "turn": turn,
            "start_weight_version": result.start_weight_version,
            "end_weight_version": result.end_weight_version,
            "episode_ended": ended,
        }


def single_token_stop(tokenizer: Any) -> Callable[[str], int | None]:
    """A request's stop string → its one token id in ``tokenizer`` (None if it is more)."""
    vocab = tokenizer.get_vocab()

    def lookup(text: str) -> int | None:
        token_id = vocab.get(text)
        if token_id is not None:
            return int(token_id)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        return int(encoded[0]) if len(encoded) == 1 else None

    return lookup
