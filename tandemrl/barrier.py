"""The checkpoint barrier: a snapshot sees the buffer and the data plane in one consistent state.

Group commits and destructive data-plane clears are *mutations*; many may run at once.
A snapshot *capture* waits until running mutations finish and holds new ones back until it is
done, so the data-plane snapshot and the replay index describe the same groups. Generation
itself never waits here: only the short commit/clear sections do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class CheckpointBarrier:
    def __init__(self) -> None:
        self._mutations = 0
        self._capturing = False
        self._changed = asyncio.Condition()

    def mutation(self) -> _Mutation:
        """``async with barrier.mutation():`` around a group commit or a destructive clear."""
        return _Mutation(self)

    async def _enter_mutation_during_capture(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._capturing)
            self._mutations += 1

    async def _leave_mutation_during_capture(self) -> None:
        async with self._changed:
            self._mutations -= 1
            self._changed.notify_all()

    @asynccontextmanager
    async def capture(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._capturing)
            self._capturing = True
            try:
                await self._changed.wait_for(lambda: self._mutations == 0)
            except BaseException:
                # Cancelled while mutations drained: lift the hold, or every commit would block.
                self._capturing = False
                self._changed.notify_all()
                raise
        try:
            yield
        finally:
            async with self._changed:
                self._capturing = False
                self._changed.notify_all()

    @property
    def capturing(self) -> bool:
        return self._capturing


class _Mutation:
    """``CheckpointBarrier.mutation``: the lock is taken only while a capture is on.

    Only a capture waits on the mutation count, and it raises ``_capturing`` before it does,
    so with no capture on, entering and leaving are a plain count change (no await can split
    it). Mutations run once per committed group; captures once per checkpoint.
    """

    __slots__ = ("_barrier",)

    def __init__(self, barrier: CheckpointBarrier) -> None:
        self._barrier = barrier

    async def __aenter__(self) -> None:
        barrier = self._barrier
        if barrier._capturing:
            await barrier._enter_mutation_during_capture()
        else:
            barrier._mutations += 1

    async def __aexit__(self, *exc_info: object) -> None:
        barrier = self._barrier
        if barrier._capturing:
            await barrier._leave_mutation_during_capture()
        else:
            barrier._mutations -= 1
