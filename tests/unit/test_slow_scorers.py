"""Slow reward functions inside a real controller run: one slow group never stalls the others,
and a scorer that raises is a data failure of its sibling (fake engine and trainer)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.envs.base import AsyncEnvironment
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.records import EnvResult
from tandemrl.rollout.failures import FailureKind
from tandemrl.training.fake import FakeTrainer

N, G = 4, 2
NUM_PROMPTS = 16
# Groups scored while the slow one waits: more than one step's worth, so they come from
# several rounds of dispatch, not one burst.
OTHERS_BEFORE_RELEASE = N + 2


def make_cfg(*overrides: str):
    return load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"grpo.num_prompts_per_step={N}",
            f"grpo.num_generations_per_prompt={G}",
            f"policy.train_global_batch_size={N * G}",
            f"policy.train_micro_batch_size={N * G}",
            "grpo.max_num_steps=100",
            "grpo.max_num_epochs=1",
            f"async_rl.min_groups_for_streaming_train={N}",
            "logger.progress=false",
            *overrides,
        ),
    )


def run(cfg, env):
    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(NUM_PROMPTS)]
    loader = PromptDataLoader(records, max_num_epochs=1, seed=0, shuffle=False)

    async def go():
        controller = build_fake_controller(
            cfg, trainer=FakeTrainer(), engines=[FakeGenerationBackend(seed=0)], dataloader=loader
        )
        controller.rollout_manager.env = env
        await asyncio.wait_for(controller.run(), timeout=30)
        return controller

    return asyncio.run(go())


def trained_ids(controller) -> list[str]:
    return sorted(group.group_id for _, group in controller.trained_groups)


# ready_first trains whatever is ready, so the steps go on without the slow group; generation
# may run two steps ahead of the trainer.
READY_FIRST = (
    "async_rl.sampler={name: ready_first, max_staleness_versions: 2}",
    "async_rl.max_buffered_rollouts=12",
    "async_rl.max_inflight_prompts=12",
)


class SlowJudge(AsyncEnvironment):
    """Scores like the counting task; the first group waits (awaiting, as an HTTP judge would)
    until ``OTHERS_BEFORE_RELEASE`` other groups were scored."""

    def __init__(self, slow_prompt: str) -> None:
        self.counting = CountingEnv()
        self.slow_prompt = slow_prompt
        self.others_scored: set[str] = set()
        self.others_done = asyncio.Event()
        self.others_seen_while_slow_waited = 0

    async def score_async(self, item, completion, *, truncated):
        if item.prompt_id == self.slow_prompt:
            await asyncio.wait_for(self.others_done.wait(), timeout=10)
            self.others_seen_while_slow_waited = len(self.others_scored)
        else:
            self.others_scored.add(item.prompt_id)
            if len(self.others_scored) >= OTHERS_BEFORE_RELEASE:
                self.others_done.set()
        return self.counting.score(item, completion, truncated=truncated)


def test_a_slow_async_scorer_does_not_stall_the_other_groups():
    judge = SlowJudge("e0-i0")
    controller = run(make_cfg(*READY_FIRST), judge)
    # Had scoring blocked the event loop, no other group could have been scored (wait_for
    # above would time out and fail e0-i0's siblings).
    assert judge.others_seen_while_slow_waited >= OTHERS_BEFORE_RELEASE
    assert controller.rollout_manager.budgets.failures == []
    assert trained_ids(controller) == sorted(f"e0-i{i}" for i in range(NUM_PROMPTS))
    # Steps were trained while e0-i0 was still being scored: it lands in a later step.
    step_of = {group.group_id: step for step, group in controller.trained_groups}
    assert step_of["e0-i0"] > 0


class SlowBlockingVerifier(CountingEnv):
    """A blocking scorer (a synchronous HTTP client, say) run in threads: the first group's
    thread blocks until other groups were scored on the other thread."""

    scoring_threads = 2

    def __init__(self, slow_prompt: str) -> None:
        super().__init__()
        self.slow_prompt = slow_prompt
        self.lock = threading.Lock()
        self.others_scored: set[str] = set()
        self.others_done = threading.Event()
        self.others_seen_while_slow_waited = 0

    def score(self, item, completion, *, truncated):
        if item.prompt_id == self.slow_prompt:
            if not self.others_done.wait(timeout=10):
                raise TimeoutError("no other group was scored: the event loop was blocked")
            self.others_seen_while_slow_waited = len(self.others_scored)
        else:
            with self.lock:
                self.others_scored.add(item.prompt_id)
                if len(self.others_scored) >= OTHERS_BEFORE_RELEASE:
                    self.others_done.set()
        return super().score(item, completion, truncated=truncated)


def test_a_blocking_scorer_in_scoring_threads_does_not_stall_the_other_groups():
    verifier = SlowBlockingVerifier("e0-i0")
    controller = run(make_cfg(*READY_FIRST), verifier)
    assert verifier.others_seen_while_slow_waited >= OTHERS_BEFORE_RELEASE
    assert controller.rollout_manager.budgets.failures == []
    assert trained_ids(controller) == sorted(f"e0-i{i}" for i in range(NUM_PROMPTS))


class FlakyJudge(AsyncEnvironment):
    """Raises on chosen calls: ``fail[prompt_id]`` lists the 1-based call numbers that fail."""

    def __init__(self, fail: dict[str, set[int]]) -> None:
        self.counting = CountingEnv()
        self.fail = fail
        self.calls: Counter[str] = Counter()

    async def score_async(self, item, completion, *, truncated):
        self.calls[item.prompt_id] += 1  # before any await: calls are numbered in sibling order
        call = self.calls[item.prompt_id]
        await asyncio.sleep(0)  # the siblings' calls are in flight together from here
        if call in self.fail.get(item.prompt_id, set()):
            raise ConnectionError(f"judge unreachable for {item.prompt_id}")
        return self.counting.score(item, completion, truncated=truncated)


def test_a_raising_async_scorer_is_a_data_failure_of_that_sibling_only():
    cfg = make_cfg("async_rl.rollout_failure.max_data_retries=2")
    judge = FlakyJudge({"e0-i0": {2}})  # the second call of e0-i0: sibling 1, first attempt
    controller = run(cfg, judge)
    assert trained_ids(controller) == sorted(f"e0-i{i}" for i in range(NUM_PROMPTS))
    manager = controller.rollout_manager
    assert manager.generated_siblings == NUM_PROMPTS * G + 1  # only sibling 1 generated again
    failures = manager.budgets.failures
    assert [(f.prompt_id, f.sibling_index, f.kind) for f in failures] == [
        ("e0-i0", 1, FailureKind.DATA)
    ]
    assert "ConnectionError: judge unreachable for e0-i0" in failures[0].cause


class ShortJudge(AsyncEnvironment):
    """Its own ``score_group_async`` returns one result too few, once, for ``prompt_id``."""

    def __init__(self, prompt_id: str) -> None:
        self.cut_once = {prompt_id}

    async def score_async(self, item, completion, *, truncated):
        return EnvResult(reward=1.0)

    async def score_group_async(self, item, completions, *, truncated):
        outcomes = await super().score_group_async(item, completions, truncated=truncated)
        if item.prompt_id in self.cut_once:
            self.cut_once.discard(item.prompt_id)
            return outcomes[:-1]
        return outcomes


def test_an_async_scorer_returning_the_wrong_count_fails_that_round_with_a_clear_cause():
    controller = run(make_cfg("async_rl.rollout_failure.max_data_retries=1"), ShortJudge("e0-i2"))
    assert len(trained_ids(controller)) == NUM_PROMPTS
    failures = controller.rollout_manager.budgets.failures
    assert [(f.prompt_id, f.sibling_index) for f in failures] == [("e0-i2", 0), ("e0-i2", 1)]
    assert "ShortJudge.score_group_async returned 1 entries for 2 completions" in failures[0].cause
