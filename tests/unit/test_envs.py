"""Environments: counting reward formula, math answer extraction, create_environment."""

from __future__ import annotations

import asyncio
import re
import sys
import threading

import pytest

from tandemrl.config.models import EnvConfig
from tandemrl.envs import CountingEnv, MathEnv, create_environment
from tandemrl.envs.base import AsyncEnvironment, Environment
from tandemrl.envs.counting import clean_completion, continue_count, counting_target
from tandemrl.envs.math import extract_answer, parse_number
from tandemrl.records import EnvResult, PromptItem


def make_item(prompt: str, answer: object = None, task_source: str | None = None) -> PromptItem:
    return PromptItem(
        prompt_id="e0-i0", epoch=0, index=0, prompt=prompt, answer=answer, task_source=task_source
    )


# -- counting ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "target"),
    [("583=", "456"), ("129=", "012"), ("008=", "901"), ("7=", "890"), ("450 = ", "123")],
)
def test_counting_target_continues_from_last_digit_and_wraps(prompt: str, target: str) -> None:
    assert counting_target(prompt) == target


def test_continue_count_length() -> None:
    assert continue_count(8, 5) == "90123"
    assert continue_count(0, 1) == "1"


def test_counting_target_rejects_prompt_without_digit() -> None:
    with pytest.raises(ValueError, match="does not end in a digit"):
        counting_target("abc=")


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("456", 1.0),
        ("457", 2 / 3),
        ("000", 0.0),
        ("45", 2 / 3),  # shorter: divided by len(target)
        ("4", 1 / 3),
        ("4567", 3 / 4),  # longer: divided by len(completion)
        ("456456", 3 / 6),
        ("", 0.0),
        ("  456\n", 1.0),  # whitespace stripped
        ("456<eos>", 1.0),  # eos stripped
        ("456</s>999", 1.0),  # text after the first eos ignored
        ("56", 0.0),  # positions, not substrings
    ],
)
def test_counting_reward_formula(completion: str, reward: float) -> None:
    result = CountingEnv().score(make_item("583=", "456"), completion, truncated=False)
    assert result.reward == pytest.approx(reward)
    assert result.keep is True


def test_counting_derives_target_when_item_has_no_answer() -> None:
    env = CountingEnv(answer_length=4)
    result = env.score(make_item("129="), "0123", truncated=True)
    assert result.reward == 1.0
    assert result.metadata["target"] == "0123"
    assert result.metadata["exact_match"] is True
    assert result.metadata["truncated"] is True


def test_counting_answer_length_must_agree_with_dataset_answer() -> None:
    env = CountingEnv(answer_length=4)
    assert env.score(make_item("583=", "4567"), "4567", truncated=False).reward == 1.0
    with pytest.raises(ValueError, match="disagrees with env"):
        env.score(make_item("583=", "456"), "4567", truncated=False)
    # Without answer_length the dataset's answer is the target, whatever its length.
    assert CountingEnv().score(make_item("583=", "45"), "45", truncated=False).reward == 1.0


def test_counting_custom_eos_strings() -> None:
    env = CountingEnv(eos_strings=("#",))
    assert env.score(make_item("583=", "456"), "456#12", truncated=False).reward == 1.0
    assert clean_completion("45<eos>", ("#",)) == "45<eos>"


def test_counting_score_group_equals_score_per_completion() -> None:
    env = CountingEnv()
    item = make_item("583=", "456", "count")
    completions = ["456", "45", "4567", "", " 456<eos>9", "000"]
    truncated = [True, False, True, False, False, True]
    grouped = env.score_group(item, completions, truncated=truncated)
    one_by_one = [
        env.score(item, c, truncated=t) for c, t in zip(completions, truncated, strict=True)
    ]
    assert grouped == one_by_one


def test_score_group_reports_each_completion_failure_in_place() -> None:
    class Picky(Environment):
        def score(self, item, completion, *, truncated):
            if completion == "bad":
                raise ValueError("no")
            return EnvResult(reward=1.0)

    outcomes = Picky().score_group(make_item("1="), ["ok", "bad", "ok"], truncated=[False] * 3)
    assert outcomes[0] == outcomes[2] == EnvResult(reward=1.0)
    assert isinstance(outcomes[1], ValueError)


def test_counting_subclass_that_overrides_score_is_scored_through_it() -> None:
    class Doubled(CountingEnv):
        def score(self, item, completion, *, truncated):
            base = super().score(item, completion, truncated=truncated)
            return EnvResult(reward=2 * base.reward, metadata=base.metadata)

    outcomes = Doubled().score_group(make_item("583=", "456"), ["456", "4"], truncated=[False] * 2)
    assert [outcome.reward for outcome in outcomes] == [2.0, pytest.approx(2 / 3)]


def test_task_source_attached_only_when_present() -> None:
    with_source = CountingEnv().score(make_item("583=", "456", "count"), "456", truncated=False)
    without = CountingEnv().score(make_item("583=", "456"), "456", truncated=False)
    assert with_source.metadata["task_source"] == "count"
    assert "task_source" not in without.metadata
    math_result = MathEnv().score(make_item("1+1=", 2, "math/add"), "2", truncated=False)
    assert math_result.metadata["task_source"] == "math/add"


# -- math -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "rule"),
    [
        ("19", "19", "last"),
        ("12+7=19", "19", "equals"),
        ("I think 3 then 4 so 5", "5", "last"),
        ("The answer: 42. Check: 40+2=42", "42", "answer"),
        ("answer is: -3", "-3", "answer"),
        ("so x = 1,024 items", "1,024", "equals"),
        ("we get \\boxed{3/4} (not 7)", "3/4", "boxed"),
        ("\\boxed{1} then \\boxed{2.5}", "2.5", "boxed"),
        ("Answer: 7 = 7.0", "7", "answer"),
        ("x=.5", ".5", "equals"),
        ("no digits here", None, "no_number"),
        ("\\boxed{}", None, "empty_boxed"),
        # A chat model's free-form replies.
        ("The answer is 42.", "42", "answer"),
        ("The answer is 67 because we take 7 from 74.", "67", "answer"),
        ("The final answer is $-83$.", "-83", "answer"),
        ("**Answer:** 176", "176", "answer"),
        ("So 74 - 7 = **67**. Ask me 1 more!", "67", "bold"),
        ("**42**", "42", "bold"),
        ("To find the answer, compute 7*6 = 42.", "42", "equals"),
        ("It is \\boxed{\\frac{4}{3}}.", "4/3", "boxed"),
        ("5/6 + 1/2 = \\dfrac{4}{3}", "4/3", "equals"),
        ("12 \u2212 95 = \u221283", "-83", "equals"),
    ],
)
def test_math_extract_answer(completion: str, answer: str | None, rule: str) -> None:
    assert extract_answer(completion) == (answer, rule)


@pytest.mark.parametrize(
    ("text", "value"),
    [("3/4", 0.75), ("-12", -12), ("1,024", 1024), ("2.50", 2.5), (" 6 / 8 ", 0.75), (".5", 0.5)],
)
def test_math_parse_number(text: str, value: float) -> None:
    assert float(parse_number(text)) == pytest.approx(value)


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("19", 19, 1.0),
        ("19.0", 19, 1.0),
        ("18", 19, 0.0),
        ("0.75", "3/4", 1.0),
        ("6/8", "3/4", 1.0),
        ("3/4", 0.75, 1.0),
        ("2/3", "0.6666667", 1.0),  # within the relative tolerance
        ("0.667", "2/3", 0.0),
        ("the sum is \\boxed{31.25}", 31.25, 1.0),
        ("-83", "-83", 1.0),
        ("83", -83, 0.0),
        ("Sure! 74 - 7 = 67. The answer is 67.", 67, 1.0),
        ("We add them: \\boxed{\\frac{4}{3}}", "4/3", 1.0),
    ],
)
def test_math_reward(completion: str, answer: object, reward: float) -> None:
    result = MathEnv().score(make_item("q=", answer), completion, truncated=False)
    assert result.reward == reward
    assert result.metadata["malformed"] is False
    assert result.metadata["correct"] is (reward == 1.0)


def test_math_tolerance_is_configurable() -> None:
    loose = MathEnv(abs_tol=0.01, rel_tol=0.0)
    assert loose.score(make_item("q=", "2/3"), "0.667", truncated=False).reward == 1.0


@pytest.mark.parametrize("completion", ["", "no number", "\\boxed{x}", "1/0"])
def test_math_flags_malformed_output(completion: str) -> None:
    result = MathEnv().score(make_item("q=", 4), completion, truncated=True)
    assert result.reward == 0.0
    assert result.metadata["malformed"] is True
    assert result.metadata["truncated"] is True


@pytest.mark.parametrize("answer", [None, "four", True, "1/0"])
def test_math_bad_target_raises(answer: object) -> None:
    with pytest.raises(ValueError, match="e0-i0"):
        MathEnv().score(make_item("q=", answer), "4", truncated=False)


# -- create_environment -----------------------------------------------------------------------


class ConstantEnv(Environment):
    def __init__(self, reward: float = 0.5) -> None:
        self.reward = reward

    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        return EnvResult(reward=self.reward)


class NotAnEnv:
    pass


def test_create_builtin_environments_with_kwargs() -> None:
    counting = create_environment(EnvConfig(name="counting", kwargs={"answer_length": 5}))
    assert isinstance(counting, CountingEnv)
    assert counting.answer_length == 5
    assert isinstance(create_environment(EnvConfig(name="math")), MathEnv)


def test_create_custom_environment() -> None:
    env = create_environment(
        EnvConfig(name="custom", target=f"{__name__}:ConstantEnv", kwargs={"reward": 0.25})
    )
    assert isinstance(env, ConstantEnv)
    assert env.score(make_item("1="), "x", truncated=False).reward == 0.25


@pytest.mark.parametrize(
    ("target", "error", "message"),
    [
        ("no_such_module_xyz:Env", ImportError, "env.target='no_such_module_xyz:Env'"),
        (f"{__name__}:Missing", ImportError, "has no 'Missing'"),
        (f"{__name__}:NotAnEnv", TypeError, "not a subclass"),
        ("just_a_module", ValueError, "module:ClassName"),
        (None, ValueError, "env.target is not set"),
    ],
)
def test_create_custom_environment_errors(target: str | None, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        create_environment(EnvConfig(name="custom", target=target))


def test_create_environment_rejects_bad_kwargs_and_stray_target() -> None:
    with pytest.raises(TypeError, match=r"env\.kwargs"):
        create_environment(EnvConfig(name="math", kwargs={"tolerance": 1}))
    with pytest.raises(ValueError, match=r"env\.name: custom"):
        create_environment(EnvConfig(name="counting", target="x:Y"))


def test_scoring_errors_propagate() -> None:
    with pytest.raises(ValueError, match="does not end in a digit"):
        CountingEnv().score(make_item("no digits="), "123", truncated=False)


# -- scoring off the event loop: scoring_threads and AsyncEnvironment ------------------------


class GatedJudge(AsyncEnvironment):
    """Each call waits until ``needed`` calls are in flight at once (or fails after 5 s)."""

    def __init__(self, needed: int, fail_on: str | None = None) -> None:
        self.needed = needed
        self.fail_on = fail_on
        self.in_flight = 0
        self.most_in_flight = 0
        self.enough: asyncio.Event | None = None

    async def score_async(self, item, completion, *, truncated):
        if self.enough is None:
            self.enough = asyncio.Event()
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.in_flight >= self.needed:
            self.enough.set()
        try:
            await asyncio.wait_for(self.enough.wait(), timeout=5)
        finally:
            self.in_flight -= 1
        if completion == self.fail_on:
            raise ConnectionError(f"judge refused {completion!r}")
        return EnvResult(reward=float(len(completion)), metadata={"judged": True})


def test_async_environment_scores_siblings_concurrently_and_fails_them_one_by_one() -> None:
    judge = GatedJudge(needed=3, fail_on="bb")  # completes only if all 3 calls overlap
    outcomes = asyncio.run(
        judge.score_group_async(make_item("1="), ["a", "bb", "ccc"], truncated=[False] * 3)
    )
    assert judge.most_in_flight == 3
    assert [type(o) for o in outcomes] == [EnvResult, ConnectionError, EnvResult]
    assert (outcomes[0].reward, outcomes[2].reward) == (1.0, 3.0)
    assert "judge refused 'bb'" in str(outcomes[1])


def test_max_concurrent_scores_caps_calls_in_flight_across_groups() -> None:
    class CappedJudge(AsyncEnvironment):
        max_concurrent_scores = 2

        def __init__(self) -> None:
            self.in_flight = self.most_in_flight = self.calls = 0

        async def score_async(self, item, completion, *, truncated):
            self.in_flight += 1
            self.calls += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            for _ in range(3):  # hold the slot over a few loop turns
                await asyncio.sleep(0)
            self.in_flight -= 1
            return EnvResult(reward=1.0)

    judge = CappedJudge()

    async def two_groups():
        return await asyncio.gather(
            judge.score_group_async(make_item("1="), ["a"] * 4, truncated=[False] * 4),
            judge.score_group_async(make_item("2="), ["b"] * 4, truncated=[False] * 4),
        )

    first, second = asyncio.run(two_groups())
    assert judge.calls == 8 and len(first) == len(second) == 4
    assert judge.most_in_flight == 2
    # a second event loop (a script scoring twice) gets a semaphore of its own
    asyncio.run(two_groups())
    assert judge.calls == 16


def test_async_environment_score_runs_outside_an_event_loop() -> None:
    judge = GatedJudge(needed=1)
    assert judge.score(make_item("1="), "abcd", truncated=False).reward == 4.0


def test_blocking_scorer_with_scoring_threads_leaves_the_event_loop_free() -> None:
    """The scorer blocks its thread until a coroutine on the loop releases it: with
    scoring_threads it finishes; inline it would deadlock the loop (not run here)."""

    class BlockingVerifier(Environment):
        scoring_threads = 2

        def __init__(self) -> None:
            self.release = threading.Event()
            self.threads: set[int] = set()

        def score(self, item, completion, *, truncated):
            self.threads.add(threading.get_ident())
            if not self.release.wait(timeout=5):
                raise TimeoutError("never released: the event loop was blocked")
            return EnvResult(reward=1.0)

    verifier = BlockingVerifier()

    async def score_while_the_loop_runs():
        scoring = asyncio.ensure_future(
            verifier.score_group_async(make_item("1="), ["a", "b"], truncated=[False, False])
        )
        while not verifier.threads:  # the loop keeps turning while the thread blocks
            await asyncio.sleep(0.001)
        verifier.release.set()
        return await scoring

    outcomes = asyncio.run(score_while_the_loop_runs())
    assert [o.reward for o in outcomes] == [1.0, 1.0]
    assert threading.get_ident() not in verifier.threads


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("scoring_threads", -1, "scoring_threads must be an integer >= 0"),
        ("scoring_threads", 1.5, "scoring_threads must be an integer >= 0"),
        ("max_concurrent_scores", 0, "max_concurrent_scores must be None"),
    ],
)
def test_create_environment_refuses_scoring_settings_that_would_stall(
    attribute: str, value: object, message: str
) -> None:
    setattr(ConfigurableJudge, attribute, value)
    try:
        with pytest.raises(ValueError, match=re.escape(message)) as raised:
            create_environment(EnvConfig(name="custom", target=f"{__name__}:ConfigurableJudge"))
        assert "env.target=" in str(raised.value)
    finally:
        ConfigurableJudge.scoring_threads = 0
        ConfigurableJudge.max_concurrent_scores = None


class ConfigurableJudge(AsyncEnvironment):
    async def score_async(self, item, completion, *, truncated):
        return EnvResult(reward=0.0)


# -- env.python_path: importing a custom environment from a folder ---------------------------

ENV_MODULE = """
from tandemrl.envs.base import Environment
from tandemrl.records import EnvResult


class FolderEnv(Environment):
    def __init__(self, reward=0.75):
        self.reward = reward

    def score(self, item, completion, *, truncated):
        return EnvResult(reward=self.reward)
"""


def test_custom_environment_imports_from_env_python_path(tmp_path, monkeypatch) -> None:
    module = f"folder_env_{tmp_path.name.replace('-', '_')}"  # unique: sys.modules is global
    (tmp_path / "envs_here").mkdir()
    (tmp_path / "envs_here" / f"{module}.py").write_text(ENV_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # undone after the test
    cfg = EnvConfig(name="custom", target=f"{module}:FolderEnv", kwargs={"reward": 0.5})
    with pytest.raises(ImportError, match=r"env\.python_path"):
        create_environment(cfg)  # not importable without the folder
    env = create_environment(cfg.model_copy(update={"python_path": ["envs_here"]}))
    assert env.score(make_item("1="), "x", truncated=False).reward == 0.5
    assert sys.path[0] == str(tmp_path / "envs_here")


def test_env_python_path_that_is_not_a_folder_is_refused_by_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = EnvConfig(name="custom", target="m:E", python_path=["missing_folder"])
    with pytest.raises(FileNotFoundError, match=r"env\.python_path\[0\]='missing_folder'"):
        create_environment(cfg)


def test_env_python_path_is_not_part_of_the_rollout_fingerprint() -> None:
    from tandemrl.checkpoint.fingerprint import compatibility_identity
    from tandemrl.config.models import MasterConfig

    here = MasterConfig(env=EnvConfig(name="custom", target="m:E", python_path=["a"]))
    there = here.model_copy(update={"env": here.env.model_copy(update={"python_path": ["b"]})})
    other_target = here.model_copy(update={"env": here.env.model_copy(update={"target": "m:F"})})
    assert compatibility_identity(here) == compatibility_identity(there)
    assert compatibility_identity(here) != compatibility_identity(other_target)
