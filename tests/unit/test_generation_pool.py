"""GenerationPool's call coalescing: one engine call per worker per event-loop turn."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError

from tandemrl.generation.base import GenerationError
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.records import GenerationRequest
from tandemrl.rollout.generation_pool import GenerationPool, NoGenerationWorkers


def group(name: str, size: int = 3) -> list[GenerationRequest]:
    return [GenerationRequest(f"{name}/{i}", [1, 2, 3], 4, seed=i) for i in range(size)]


class RecordingEngine(FakeGenerationBackend):
    """Records how many groups each ``generate_groups`` call carried."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.batches: list[list[str]] = []

    async def generate_groups(self, groups):
        self.batches.append([requests[0].request_id.split("/")[0] for requests in groups])
        return await super().generate_groups(groups)


def test_calls_made_in_one_turn_travel_as_one_engine_call():
    async def main():
        engine = RecordingEngine(seed=0)
        pool = GenerationPool([engine], coalesce_calls=True)
        names = [f"g{i}" for i in range(5)]
        results = await asyncio.gather(*(pool.generate(group(name)) for name in names))
        # A later turn starts a new batch.
        later = await pool.generate(group("late"))
        return engine, pool, names, results, later

    engine, pool, names, results, later = asyncio.run(main())
    assert engine.batches == [names, ["late"]]
    assert pool.engine_calls == 2
    for name, result in zip(names, results, strict=True):
        assert [r.request_id for r in result] == [f"{name}/{i}" for i in range(3)]
    assert [r.request_id for r in later] == ["late/0", "late/1", "late/2"]
    # The same tokens as uncoalesced calls: coalescing changes transport, not results.
    direct = FakeGenerationBackend(seed=0)
    assert [r.token_ids for r in results[2]] == [
        r.token_ids for r in asyncio.run(direct.generate(group("g2")))
    ]


def test_a_batch_holds_at_most_max_requests_per_call():
    async def main():
        engine = RecordingEngine(seed=0)
        pool = GenerationPool([engine], coalesce_calls=True, max_requests_per_call=6)
        names = [f"g{i}" for i in range(5)]
        calls = [pool.generate(group(name)) for name in names]  # 3 requests each
        calls.append(pool.generate(group("big", size=8)))  # larger than the cap: alone
        calls.append(pool.generate(group("tail")))
        results = await asyncio.gather(*calls)
        return engine, pool, results

    engine, pool, results = asyncio.run(main())
    assert engine.batches == [["g0", "g1"], ["g2", "g3"], ["g4"], ["big"], ["tail"]]
    assert pool.engine_calls == 5
    assert [len(result) for result in results] == [3, 3, 3, 3, 3, 8, 3]
    assert [r.request_id for r in results[5]] == [f"big/{i}" for i in range(8)]


def test_max_requests_per_call_must_be_positive():
    with pytest.raises(ValueError, match="max_requests_per_call must be >= 1"):
        GenerationPool([FakeGenerationBackend()], coalesce_calls=True, max_requests_per_call=0)


def test_without_coalescing_each_call_is_its_own_engine_call():
    async def main():
        engine = RecordingEngine(seed=0)
        pool = GenerationPool([engine])
        await asyncio.gather(*(pool.generate(group(f"g{i}")) for i in range(4)))
        return engine, pool

    engine, pool = asyncio.run(main())
    assert engine.batches == []
    assert pool.engine_calls == 4


def test_a_failing_call_does_not_fail_the_calls_it_was_batched_with():
    async def main():
        engine = RecordingEngine(seed=0, fail_request_ids={"bad/"})
        pool = GenerationPool([engine], coalesce_calls=True)
        outcomes = await asyncio.gather(
            pool.generate(group("ok1")),
            pool.generate(group("bad")),
            pool.generate(group("ok2")),
            return_exceptions=True,
        )
        return engine, pool, outcomes

    engine, pool, outcomes = asyncio.run(main())
    assert engine.batches == [["ok1", "bad", "ok2"]]
    assert isinstance(outcomes[1], GenerationError)
    assert "injected failure for bad/0" in str(outcomes[1])
    assert [r.request_id for r in outcomes[0]] == ["ok1/0", "ok1/1", "ok1/2"]
    assert [r.request_id for r in outcomes[2]] == ["ok2/0", "ok2/1", "ok2/2"]
    assert pool.num_alive == 1


class DeadWorker(FakeGenerationBackend):
    async def generate_groups(self, groups):
        raise RayActorError()


def test_a_worker_death_fails_every_batched_call_and_takes_the_worker_out():
    async def main():
        pool = GenerationPool([DeadWorker(seed=0)], coalesce_calls=True)
        outcomes = await asyncio.gather(
            *(pool.generate(group(f"g{i}")) for i in range(3)), return_exceptions=True
        )
        with pytest.raises(NoGenerationWorkers, match="all 1 generation worker"):
            await pool.generate(group("after"))
        return pool, outcomes

    pool, outcomes = asyncio.run(main())
    assert all(isinstance(outcome, GenerationError) for outcome in outcomes)
    assert all("generation worker 0 died" in str(outcome) for outcome in outcomes)
    assert pool.dead_workers == [0]


class SlowPrefix(FakeGenerationBackend):
    """Requests named ``slow...`` take 0.5 s; records the ids it was asked to abort."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.abort_calls: list[list[str]] = []

    async def generate(self, requests):
        if requests[0].request_id.startswith("slow"):
            await asyncio.sleep(0.5)
        return await super().generate(requests)

    async def abort(self, request_ids):
        self.abort_calls.append(list(request_ids))
        await super().abort(request_ids)


def test_with_a_deadline_calls_are_not_coalesced_so_each_keeps_its_own_clock():
    async def main():
        engine = SlowPrefix(seed=0)
        pool = GenerationPool([engine], generation_timeout_s=0.2, coalesce_calls=True)
        fast_call = asyncio.ensure_future(pool.generate(group("fast")))
        slow_call = asyncio.ensure_future(pool.generate(group("slow")))
        with pytest.raises(TimeoutError, match=r"generation_timeout_s=0\.2"):
            await slow_call
        fast = await fast_call
        return engine, pool, fast

    engine, pool, fast = asyncio.run(main())
    assert not pool.coalesce_calls
    assert [r.request_id for r in fast] == ["fast/0", "fast/1", "fast/2"]
    assert engine.abort_calls == [["slow/0", "slow/1", "slow/2"]]
    assert pool.timeouts == 1
    assert pool.engine_calls == 2


def test_a_cancelled_caller_leaves_its_batchmates_their_results():
    async def main():
        engine = SlowPrefix(seed=0)
        pool = GenerationPool([engine], coalesce_calls=True)
        kept = asyncio.ensure_future(pool.generate(group("kept")))
        dropped = asyncio.ensure_future(pool.generate(group("dropped")))
        await asyncio.sleep(0)  # both join the same batch
        dropped.cancel()
        return pool, await kept, dropped

    pool, kept, dropped = asyncio.run(main())
    assert dropped.cancelled()
    assert [r.request_id for r in kept] == ["kept/0", "kept/1", "kept/2"]
    assert pool.engine_calls == 1


# ---------------------------------------------------------------- inside a controller


def controller_run(coalesce: bool, *overrides: str):
    from tandemrl.config.loader import load_config
    from tandemrl.controller.build import ControllerParts, build_controller
    from tandemrl.data.dataloader import PromptDataLoader
    from tandemrl.data.dataset import PromptRecord
    from tandemrl.envs.counting import CountingEnv
    from tandemrl.generation.fake import fake_codec
    from tandemrl.training.fake import FakeTrainer

    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8",
            "grpo.max_num_steps=4",
            "grpo.max_num_epochs=1",
            "async_rl.min_groups_for_streaming_train=4",
            "async_rl.max_buffered_rollouts=8",
            "async_rl.max_inflight_prompts=8",
            *overrides,
        ),
    )
    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(16)]
    engine = RecordingEngine(seed=0)
    parts = ControllerParts(
        trainer=FakeTrainer(),
        engines=[engine],
        env=CountingEnv(),
        codec=fake_codec(),
        dataloader=PromptDataLoader(records, max_num_epochs=1, seed=0, shuffle=False),
        coalesce_generate_calls=coalesce,
    )

    async def go():
        controller = build_controller(cfg, parts)
        await asyncio.wait_for(controller.run(), timeout=30)
        return controller

    controller = asyncio.run(go())
    trained = [
        (step, group.group_id, group.rewards, group.completion_tokens)
        for step, group in controller.trained_groups
    ]
    return controller, engine, trained


def test_a_coalescing_controller_trains_the_same_groups_with_fewer_engine_calls():
    plain, _, plain_trained = controller_run(False)
    coalesced, engine, trained = controller_run(True)
    assert coalesced.generation.coalesce_calls
    assert trained == plain_trained  # same groups in the same steps, same rewards
    assert len(trained) == 16
    assert plain.generation.engine_calls == 16
    assert coalesced.generation.engine_calls == len(engine.batches) < 16
    assert sum(len(batch) for batch in engine.batches) == 16


def test_a_rollout_deadline_turns_coalescing_off():
    controller, engine, trained = controller_run(
        True, "async_rl.rollout_failure.rollout_timeout_s=30"
    )
    assert not controller.generation.coalesce_calls
    assert engine.batches == []
    assert len(trained) == 16
