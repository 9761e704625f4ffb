"""Lossless restart with fakes: "kill" a run (the commit log loses what was still queued, the
journal stops), restart from disk, and prove from the journal that every prompt was trained
exactly once and no finished group or sibling was generated twice."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest
from test_checkpoint_restart import EPOCHS, all_prompt_ids, make_cfg, make_loader

from tandemrl.buffer import ReplayBufferError
from tandemrl.checkpoint.commit_replay import apply_replay, replay_for
from tandemrl.checkpoint.fingerprint import compatibility_identity, fingerprint_digest
from tandemrl.checkpoint.inspect import describe_checkpoint_dir, render_text
from tandemrl.checkpoint.journal import lineage, read_journal
from tandemrl.checkpoint.layout import JOURNAL, list_snapshot_dirs, list_step_dirs
from tandemrl.checkpoint.restore import plan_restore
from tandemrl.checkpoint.rollout_state import read_rollout_state
from tandemrl.config.loader import load_config
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel
from tandemrl.training.fake import FakeTrainer

# Snapshots far apart: between them only the commit log keeps finished work.
LOG_CFG = ("rollout_checkpointing.snapshot_attempt_interval_s=30",)


# Groups whose every generation fails (dropped after their retries), for the drop tests.
FAILING = frozenset()


def build(cfg, seed: int, failing: frozenset[str] = FAILING):
    engine = FakeGenerationBackend(
        latency=LatencyModel("uniform", low=0.0, high=0.004),
        seed=seed,
        fail_request_ids={f"{group}/" for group in failing},
    )
    return build_fake_controller(
        cfg,
        trainer=FakeTrainer(train_seconds_per_step=0.002),
        engines=[engine],
        dataloader=make_loader(),
    )


async def attempt(
    cfg, *, kill_after_s: float | None, seed: int, kill_when=None, failing=FAILING
) -> bool:
    """One attempt; at ``kill_after_s`` (or once ``kill_when(controller)``) it dies like a
    SIGKILL would leave it on disk."""
    controller = build(cfg, seed, failing)
    await controller.resume(plan_restore(cfg))
    task = asyncio.create_task(controller.run())
    if kill_when is None:
        done, _ = await asyncio.wait({task}, timeout=kill_after_s)
    else:
        while not task.done() and not kill_when(controller):
            await asyncio.sleep(0.001)
        done = task.done()
    if done:
        task.result()
        controller.journal.close()
        return True
    if controller.commit_log is not None:
        controller.commit_log.abandon()  # records still queued never reach the file
    controller.journal.record = lambda *args, **kwargs: None  # a dead process writes nothing
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


def run_killed(cfg, seed: int, kills: int = 4, failing=FAILING) -> None:
    """Kill each attempt after 1-3 of its steps and once 0-3 groups of the next are ready."""
    rng = random.Random(seed)
    for index in range(kills):
        steps, ready = rng.randint(1, 3), rng.randint(0, 3)

        def kill_when(controller, steps=steps, ready=ready) -> bool:
            return len(controller.history) >= steps and controller.buffer.num_ready >= ready

        finished = asyncio.run(
            attempt(cfg, kill_after_s=None, seed=index, kill_when=kill_when, failing=failing)
        )
        assert not finished, "the run finished before its kill"
    assert asyncio.run(attempt(cfg, kill_after_s=60, seed=kills, failing=failing))


def proof(checkpoint_dir: Path) -> dict:
    result = lineage(read_journal(checkpoint_dir / JOURNAL))
    trained = result.trained_groups()
    fresh = Counter((group, sibling) for _, group, sibling in result.fresh_generations)
    replays = [event.get("replayed") or {} for event in result.restores]
    return {
        "duplicated": len(trained) - len(set(trained)),
        "lost": sorted(all_prompt_ids() - set(trained)),
        "continuous": sorted(result.trained) == list(range(1, len(result.trained) + 1)),
        "groups_generated_again": sorted({g for (g, _), count in fresh.items() if count > 1}),
        "finished_again": result.finished_again(),
        "regenerated_after_restore": result.regenerated_after_restore,
        "replayed_committed": sum(replay.get("committed_groups", 0) for replay in replays),
        "attempts": result.attempts,
    }


@pytest.mark.parametrize(
    "overrides",
    [
        ("rollout_recovery.default_granularity=sibling",),
        ("rollout_recovery.default_granularity=prompt_group",),
        (
            "async_rl.sampler={name: windowed, max_staleness_versions: 1}",
            "async_rl.max_buffered_rollouts=12",
        ),
    ],
    ids=["in_order-sibling", "in_order-prompt_group", "windowed"],
)
def test_killed_runs_lose_nothing_and_generate_nothing_twice(tmp_path, overrides):
    cfg = make_cfg(tmp_path / "ckpt", *LOG_CFG, *overrides)
    run_killed(cfg, seed=11)

    result = proof(tmp_path / "ckpt")
    assert result["attempts"] == 5
    assert result["duplicated"] == 0 and result["continuous"], result
    if "sampler" not in overrides[0]:
        assert result["lost"] == [], result  # windowed evicts stale groups by design
    assert result["groups_generated_again"] == [], result
    assert result["regenerated_after_restore"] == [], result
    if "sibling" in overrides[0]:
        assert result["finished_again"] == [], result
    # the log, not a snapshot, brought committed groups back
    assert result["replayed_committed"] > 0, result


@pytest.mark.parametrize("policy", ["shrink", "replace"])
def test_dropped_prompts_stay_dropped_and_replacements_are_not_drawn_twice(tmp_path, policy):
    failing = frozenset({"e0-i5", "e0-i13", "e0-i22", "e1-i3", "e1-i17", "e1-i30"})

    def cfg_in(directory: Path):
        return make_cfg(
            directory,
            *LOG_CFG,
            "async_rl.rollout_failure.max_infra_retries=0",
            "async_rl.rollout_failure.max_skipped_prompts=20",
            "async_rl.rollout_failure.max_consecutive_dropped_prompts=20",
            f"async_rl.rollout_failure.on_dropped_prompt={policy}",
            "async_rl.rollout_failure.replacement_reserve_size=2",
        )

    # The same run without kills: what it trains is the reference (replace may end the run
    # with spare prompts it cannot complete a step with).
    run_killed(cfg_in(tmp_path / "reference"), seed=5, kills=0, failing=failing)
    reference = proof(tmp_path / "reference")
    assert failing <= set(reference["lost"]), reference
    run_killed(cfg_in(tmp_path / "ckpt"), seed=5, failing=failing)
    result = proof(tmp_path / "ckpt")
    assert result["duplicated"] == 0 and result["continuous"], result
    assert result["lost"] == reference["lost"], (result, reference)
    assert result["groups_generated_again"] == [], result
    assert result["finished_again"] == [], result


def test_without_the_log_the_same_kills_regenerate_work(tmp_path):
    cfg = make_cfg(tmp_path / "ckpt", *LOG_CFG, "rollout_checkpointing.commit_log=false")
    run_killed(cfg, seed=11)
    result = proof(tmp_path / "ckpt")
    assert result["duplicated"] == 0 and result["lost"] == [] and result["continuous"]
    assert result["replayed_committed"] == 0
    assert not (tmp_path / "ckpt" / "commit_log").exists()


def test_replay_restores_groups_consumed_by_rolled_back_steps_and_is_idempotent(tmp_path):
    cfg = make_cfg(tmp_path / "ckpt", *LOG_CFG, "checkpointing.save_period=1000")

    async def scenario():
        # Killed after a few steps: no trainer checkpoint (save_period 1000), only the bootstrap
        # snapshot written at the fresh start, so every step is rolled back on restart.
        assert not await attempt(
            cfg,
            kill_after_s=None,
            seed=0,
            kill_when=lambda c: c.state.step >= 2 and c.buffer.num_ready > 0,
        )
        plan = plan_restore(cfg)
        assert plan.step == 0 and "bootstrap" in str(plan.rollout_dir)
        state = read_rollout_state(plan.rollout_dir)
        replay, tip = replay_for(Path(cfg.checkpointing.checkpoint_dir), state.commit_log_next_lsn)
        controller = build(cfg, seed=1)
        await controller.resume(plan)
        ready = {slot.group_id for slot in controller.buffer.ready_groups()}
        assert ready == set(replay.committed) and ready
        # groups that a (now rolled back) step had consumed are trainable again
        trained_before = {
            group
            for event in read_journal(tmp_path / "ckpt" / JOURNAL)
            if event["event"] == "trained"
            for group in event["groups"]
        }
        assert trained_before and trained_before <= ready
        # rows are in the data plane with the logged stamps
        rows = await controller.data_plane.get(
            [sid for slot in controller.buffer.ready_groups() for sid in slot.sample_ids]
        )
        assert len(rows) == len(ready) * controller.settings.group_size
        # the dataloader continues after every prompt drawn before the kill
        drawn = set(replay.committed) | set(replay.admitted)
        assert controller.dataloader.peek().prompt_id not in drawn
        assert controller.sampler.num_admitted == len(drawn)
        # replaying the same records again changes nothing
        before = (
            [s.to_state() for s in controller.buffer.live_groups()],
            [g.group_id for g in controller.run_state.recovered_groups],
            controller.dataloader.state_dict(),
        )
        await apply_replay(
            controller.run_state, replay, rows=controller.rollout_manager, source="test"
        )
        after = (
            [s.to_state() for s in controller.buffer.live_groups()],
            [g.group_id for g in controller.run_state.recovered_groups],
            controller.dataloader.state_dict(),
        )
        assert before == after
        controller.commit_log.close()
        controller.journal.close()
        return tip

    asyncio.run(scenario())


def test_segments_are_trimmed_as_bundles_move_on(tmp_path):
    cfg = make_cfg(tmp_path / "ckpt", "checkpointing.keep_top_k=2")
    assert asyncio.run(attempt(cfg, kill_after_s=60, seed=0))
    ckpt = tmp_path / "ckpt"
    segments = sorted((ckpt / "commit_log").iterdir())
    assert 1 <= len(segments) <= 3, [s.name for s in segments]  # one per step without trimming
    bundles = [path for _, path in list_step_dirs(ckpt)]
    bundles += [snap for anchor in list(bundles) for _, snap in list_snapshot_dirs(anchor)]
    first_kept = int(segments[0].name.split("_")[1].split(".")[0])
    for bundle in bundles:
        next_lsn = read_rollout_state(bundle).commit_log_next_lsn
        assert next_lsn is not None and next_lsn >= first_kept


def test_inspect_reports_what_the_log_restores(tmp_path):
    # Only the bootstrap snapshot (save_period 1000): every group committed since is in the log.
    cfg = make_cfg(tmp_path / "ckpt", *LOG_CFG, "checkpointing.save_period=1000")
    kill_when = lambda c: c.state.step >= 1 and c.buffer.num_ready > 0  # noqa: E731
    assert not asyncio.run(attempt(cfg, kill_after_s=None, seed=0, kill_when=kill_when))
    info = describe_checkpoint_dir(tmp_path / "ckpt")
    log_info = info["commit_log"]
    assert log_info is not None and log_info["records"] > 0
    assert log_info["replayed_records"] > 0
    text = render_text(info)
    assert "commit log" in text and "replays" in text


def test_commit_log_true_is_the_default_and_operational():
    def check(path: str, *overrides: str) -> None:
        validate_single_controller_config(load_config(path, list(overrides)))

    # true is the default and means "whenever checkpointing can use it": written out (as
    # validate --print writes it) it must load as the same, valid run, checkpointing or not.
    check("examples/configs/grpo_tiny_cpu.yaml", "rollout_checkpointing.commit_log=true")
    check("examples/configs/grpo_tiny_cpu.yaml")
    # the key is operational: not part of the fingerprint
    on = load_config("examples/configs/grpo_tiny_cpu_checkpointed.yaml", [])
    off = load_config(
        "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
        ["rollout_checkpointing.commit_log=false"],
    )
    assert fingerprint_digest(compatibility_identity(on)) == fingerprint_digest(
        compatibility_identity(off)
    )


def test_adopting_a_committed_group_twice_is_refused():
    from tandemrl.buffer import ReplayBuffer, Slot
    from tandemrl.records import RowMeta

    buffer = ReplayBuffer(group_size=1, capacity=1)
    meta = RowMeta("g/0", "g", 0, 1.0, 1.0, 2, 2, False, 0, 0)
    buffer.adopt_committed(Slot("g", 0, None, 5, 0, True, [meta]))
    assert buffer.next_dispatch_index == 6 and buffer.num_ready == 1
    with pytest.raises(ReplayBufferError, match="already in the buffer"):
        buffer.adopt_committed(Slot("g", 0, None, 7, 0, True, [meta]))


assert EPOCHS == 2  # the shapes above assume the shared restart fixture's two epochs


# Without the "filtered" record a restart owes replacements twice and the buffer fills with
# groups no step takes: the run then hangs instead of failing, hence the timeout.
@pytest.mark.timeout(120)
def test_dynamic_sampling_under_kills_trains_each_prompt_at_most_once(tmp_path):
    """Zero-advantage groups filtered by dynamic sampling stay filtered across kills (the
    "filtered" record carries the replacement credits): nothing is trained twice or out of
    order, and every prompt is trained or filtered, but for the tail the data cannot fill."""
    cfg = make_cfg(
        tmp_path / "ckpt",
        *LOG_CFG,
        "grpo.use_dynamic_sampling=true",
        "async_rl.min_groups_for_streaming_train=4",
    )
    validate_single_controller_config(cfg)
    run_killed(cfg, seed=5, kills=3)
    events = read_journal(tmp_path / "ckpt" / JOURNAL)
    filtered = {g for event in events if event["event"] == "filtered" for g in event["groups"]}
    result = proof(tmp_path / "ckpt")
    assert len(filtered) > 10, "the counting task on fake tokens has groups of equal rewards"
    assert result["duplicated"] == 0 and result["continuous"], result
    assert not filtered & set(lineage(events).trained_groups())
    # When the data runs out, in_order (lookahead 1) leaves at most two steps unfilled.
    assert len(set(result["lost"]) - filtered) < 2 * 4, result
