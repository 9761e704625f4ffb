"""A generation backend for tests and benchmarks: controllable latency, deterministic tokens.

Latency is drawn per request from a seeded model (``fixed``, ``uniform`` or ``lognormal``
long tail). Tokens are a deterministic function of the prompt, the seed and the request id, so
two runs with the same seed generate the same text. It honours the colocated stand-down:
while asleep no request advances, and the time spent asleep is reported by ``frozen_time``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any, Literal

from tandemrl.codec import TextCodec
from tandemrl.generation.base import GenerationBackend, GenerationError
from tandemrl.records import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class LatencyModel:
    """Per-request latency in seconds.

    fixed: always ``seconds``; uniform: in [low, high]; lognormal: median ``seconds`` and
    log-space spread ``sigma`` (sigma 1.0 puts the 99th percentile about 10x the median).
    """

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    seconds: float = 0.0
    low: float = 0.0
    high: float = 0.0
    sigma: float = 1.0

    @classmethod
    def from_config(cls, spec: dict[str, Any] | None) -> LatencyModel:
        return cls(**spec) if spec else cls()

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.seconds
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high)
        return self.seconds * math.exp(rng.gauss(0.0, self.sigma))


class FakeGenerationBackend(GenerationBackend):
    def __init__(
        self,
        *,
        latency: LatencyModel | None = None,
        seed: int = 0,
        vocab_size: int = 16,
        completion_tokens: int = 4,
        fail_request_ids: set[str] | None = None,
        max_concurrency: int | None = None,
    ) -> None:
        self.latency = latency or LatencyModel()
        self.seed = seed
        self.vocab_size = vocab_size
        self.completion_tokens = completion_tokens
        self._rng = random.Random(seed)
        self._version = 0
        self._awake = asyncio.Event()
        self._awake.set()
        self._asleep = asyncio.Event()
        self._asleep_since: float | None = None
        self._frozen_total = 0.0
        self._aborted: set[str] = set()
        self.dead = False
        # Requests whose id starts with one of these prefixes raise GenerationError (tests).
        self.fail_request_ids = fail_request_ids or set()
        # None: unlimited parallelism; n: at most n requests decode at once (a throughput-bound
        # engine: a step of R requests of latency L takes about R * L / n seconds).
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._instant = (
            self.latency.kind == "fixed" and self.latency.seconds == 0 and self._slots is None
        )
        self.requests_served = 0
        self.weight_updates: list[int] = []
        # Byte b of the token stream becomes token b % vocab_size: one translate per request.
        self._byte_tokens = bytes(byte % vocab_size for byte in range(256))

    def _tokens_for(self, request: GenerationRequest, prompt_text: str | None = None) -> list[int]:
        """Deterministic tokens of ``request``; ``prompt_text`` is ``str(prompt_token_ids)``.

        A stream of crc32 values of "seed|request id|prompt" (each round continues from the
        last value) gives 4 bytes per round; token i is byte i modulo the vocabulary. Cheap on
        purpose: with zero latency the benchmarks measure the controller, not this hash.
        """
        if prompt_text is None:
            prompt_text = str(request.prompt_token_ids)
        key = f"{self.seed}|{request.request_id}|{prompt_text}".encode()
        return self._token_stream(key, min(request.max_new_tokens, self.completion_tokens))

    def _token_stream(self, key: bytes, count: int) -> list[int]:
        state = zlib.crc32(key)
        stream = state.to_bytes(4, "little")
        while len(stream) < count:
            state = zlib.crc32(key, state)
            stream += state.to_bytes(4, "little")
        return list(stream[:count].translate(self._byte_tokens))

    async def _wait_latency(self, seconds: float) -> None:
        # The request's clock advances only while awake, so a stand-down freezes it.
        remaining = seconds
        if remaining <= 0 and not self._awake.is_set():
            await self._awake.wait()
        while remaining > 0:
            await self._awake.wait()
            started = time.monotonic()
            try:
                await asyncio.wait_for(self._asleep.wait(), timeout=remaining)
            except TimeoutError:
                return
            remaining -= time.monotonic() - started

    def _check_alive(self, request: GenerationRequest) -> None:
        if self.dead:
            raise GenerationError("fake generation worker is dead")
        if self.fail_request_ids and any(
            request.request_id.startswith(p) for p in self.fail_request_ids
        ):
            raise GenerationError(f"injected failure for {request.request_id}")

    def _result(self, request: GenerationRequest, start_version: int) -> GenerationResult:
        if request.request_id in self._aborted:
            return GenerationResult(
                request.request_id,
                list(request.prompt_token_ids),
                [],
                [],
                "aborted",
                [],
                start_version,
            )
        tokens = self._tokens_for(request)
        self.requests_served += 1
        count = len(tokens)
        return GenerationResult(
            request.request_id,
            list(request.prompt_token_ids),
            tokens,
            [-1.0] * count,
            "length" if count >= request.max_new_tokens else "stop",
            [self._version] * count,
            start_version,
        )

    async def _one(self, request: GenerationRequest) -> GenerationResult:
        self._check_alive(request)
        start_version = self._version
        await self._wait_latency(self.latency.sample(self._rng))
        if self.dead:
            raise GenerationError("fake generation worker died mid-request")
        return self._result(request, start_version)

    async def _one_limited(self, request: GenerationRequest) -> GenerationResult:
        if self._slots is None:
            return await self._one(request)
        async with self._slots:
            return await self._one(request)

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self._instant and self._awake.is_set():
            # Zero latency: no per-request tasks, so benchmarks measure the controller.
            if self.dead or self.fail_request_ids:
                for request in requests:
                    self._check_alive(request)
            await asyncio.sleep(0)
            return self._results_now(requests)
        call = self._one_limited if self._slots is not None else self._one
        return list(await asyncio.gather(*(call(r) for r in requests)))

    def _results_now(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Results of zero-latency requests: ``_result`` of each, inlined (the benchmarks run
        this for every sequence); siblings share their prompt's text form."""
        version = self._version
        aborted = self._aborted
        seed_prefix = f"{self.seed}|"
        most_tokens = self.completion_tokens
        byte_tokens = self._byte_tokens
        crc32 = zlib.crc32
        results = []
        served = 0
        prompt: list[int] | None = None
        prompt_suffix = ""
        for request in requests:
            request_id = request.request_id
            if request_id in aborted:
                results.append(self._result(request, version))
                continue
            if request.prompt_token_ids is not prompt:
                prompt = request.prompt_token_ids
                prompt_suffix = f"|{prompt}"
            max_new_tokens = request.max_new_tokens
            count = most_tokens if most_tokens < max_new_tokens else max_new_tokens
            key = (seed_prefix + request_id + prompt_suffix).encode()
            if count <= 4:  # _token_stream's first round, inlined
                tokens = list(crc32(key).to_bytes(4, "little")[:count].translate(byte_tokens))
            else:
                tokens = self._token_stream(key, count)
            served += 1
            results.append(
                GenerationResult(
                    request_id,
                    list(prompt),
                    tokens,
                    [-1.0] * count,
                    "length" if count >= max_new_tokens else "stop",
                    [version] * count,
                    version,
                )
            )
        self.requests_served += served
        return results

    async def update_weights(self, version: int, weights: Any) -> None:
        self._version = version
        self.weight_updates.append(version)

    async def weight_version(self) -> int:
        return self._version

    async def abort(self, request_ids: list[str]) -> None:
        self._aborted.update(request_ids)

    async def sleep(self) -> None:
        if self._awake.is_set():
            self._awake.clear()
            self._asleep.set()
            self._asleep_since = time.monotonic()

    async def wake(self) -> None:
        if not self._awake.is_set():
            assert self._asleep_since is not None
            self._frozen_total += time.monotonic() - self._asleep_since
            self._asleep_since = None
            self._asleep.clear()
            self._awake.set()

    async def frozen_time(self) -> float:
        """Seconds spent asleep so far (deadline clocks exclude them)."""
        extra = time.monotonic() - self._asleep_since if self._asleep_since is not None else 0.0
        return self._frozen_total + extra


def fake_codec(vocab_size: int = 16) -> TextCodec:
    """A text codec matching the fake engine: characters map to ids, ids decode to digits."""
    digits = "0123456789"
    # Byte b decodes to the digit b % 10, so a list of ids in 0..255 decodes in one translate.
    digit_of_byte = bytes(ord(digits[byte % 10]) for byte in range(256))

    def decode(ids: list[int]) -> str:
        try:
            raw = bytes(ids) if type(ids) is list else None
        except ValueError:  # an id outside 0..255
            raw = None
        if raw is None:
            return "".join([digits[i % 10] for i in ids])
        return raw.translate(digit_of_byte).decode("ascii")

    return TextCodec(
        encode=lambda text: [ord(ch) % vocab_size for ch in text],
        decode=decode,
        eos_token_id=None,
        pad_token_id=0,
    )
