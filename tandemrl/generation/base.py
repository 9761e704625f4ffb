"""The generation-backend contract shared by the torch engine, vLLM and the test fakes.

An engine serves many concurrent ``generate`` calls, batching them internally. Weight updates
arrive between decode steps (in-flight): every generated token records the weight version that
sampled it. ``sleep``/``wake`` are the colocated stand-down: while asleep no token is decoded
and request deadlines do not advance.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

from tandemrl.records import GenerationRequest, GenerationResult


class GenerationError(RuntimeError):
    """Infrastructure failure inside a generation backend (worker died, transport, timeout)."""


class GenerationBackend(ABC):
    @abstractmethod
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate completions; results are in request order."""

    async def generate_groups(
        self, groups: list[list[GenerationRequest]]
    ) -> list[list[GenerationResult] | BaseException]:
        """``generate`` for each group at once; per group its results or the exception it raised.

        One call carries many groups, so a remote worker pays one call's overhead for all of
        them (``GenerationPool`` with ``coalesce_calls``); a failure stays with its group.
        """
        return list(
            await asyncio.gather(
                *(self.generate(group) for group in groups), return_exceptions=True
            )
        )

    @abstractmethod
    async def update_weights(self, version: int, weights: Any) -> None:
        """Load new weights (a state dict or a backend-specific handle) as ``version``."""

    @abstractmethod
    async def weight_version(self) -> int: ...

    async def abort(self, request_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """Stop the given requests; their results come back with finish_reason 'aborted'."""

    async def sleep(self) -> None:  # noqa: B027 - optional hook
        """Colocated stand-down: free accelerator memory, freeze in-flight requests."""

    async def wake(self) -> None:  # noqa: B027 - optional hook
        """Resume after ``sleep``."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
