"""CheckpointBarrier: captures wait for running mutations and hold new ones back."""

from __future__ import annotations

import asyncio

import pytest

from tandemrl.barrier import CheckpointBarrier


def test_a_capture_waits_for_running_mutations_and_holds_new_ones_back():
    async def scenario() -> list[str]:
        barrier = CheckpointBarrier()
        events: list[str] = []
        release_mutation = asyncio.Event()

        async def mutation(name: str, hold: asyncio.Event | None = None) -> None:
            async with barrier.mutation():
                events.append(f"{name} in")
                if hold is not None:
                    await hold.wait()
                events.append(f"{name} out")

        async def capture() -> None:
            async with barrier.capture():
                events.append("capture in")
                await asyncio.sleep(0)
                events.append("capture out")

        first = asyncio.create_task(mutation("m1", release_mutation))
        await asyncio.sleep(0)
        snapshot = asyncio.create_task(capture())
        await asyncio.sleep(0)
        assert barrier.capturing and events == ["m1 in"]  # the capture waits for m1
        second = asyncio.create_task(mutation("m2"))
        for _ in range(3):
            await asyncio.sleep(0)
        assert events == ["m1 in"]  # m2 is held back while the capture waits
        release_mutation.set()
        await asyncio.gather(first, snapshot, second)
        assert not barrier.capturing and barrier._mutations == 0
        return events

    assert asyncio.run(scenario()) == [
        "m1 in",
        "m1 out",
        "capture in",
        "capture out",
        "m2 in",
        "m2 out",
    ]


def test_a_failed_mutation_leaves_the_count_at_zero_and_captures_proceed():
    async def scenario() -> None:
        barrier = CheckpointBarrier()
        with pytest.raises(RuntimeError, match="commit failed"):
            async with barrier.mutation():
                raise RuntimeError("commit failed")
        assert barrier._mutations == 0
        async with barrier.capture():
            assert barrier.capturing
        assert not barrier.capturing

    asyncio.run(scenario())
