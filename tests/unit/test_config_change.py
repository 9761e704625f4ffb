"""A restart with a changed config, with fakes: say what changed, never mix in rollouts it
makes invalid.

A run is "killed" while committed groups wait in the buffer and others are generating (the
commit log loses what was still queued, the journal stops), then restarted with
``policy.generation.temperature`` changed under each ``rollout_checkpointing.on_config_change``
policy. The journal proves exactly-once training and, with each attempt's config fingerprint,
under which config every trained group was generated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest
from test_checkpoint_restart import all_prompt_ids, make_cfg
from test_checkpoint_restore import tree_state
from test_commit_log_restart import LOG_CFG, attempt, build

from tandemrl.checkpoint.fingerprint import compatibility_identity
from tandemrl.checkpoint.inspect import describe_checkpoint_dir, inspect_command, render_text
from tandemrl.checkpoint.journal import lineage, read_journal
from tandemrl.checkpoint.layout import JOURNAL, MANIFEST, list_step_dirs
from tandemrl.checkpoint.restore import RestoreRefused, plan_restore
from tandemrl.cli import main
from tandemrl.controller.run import plan_run

TEMPERATURE = "policy.generation.temperature: 1.0 -> 0.7"


def cfg_at(checkpoint_dir: Path, *overrides: str):
    return make_cfg(checkpoint_dir, *LOG_CFG, *overrides)


def buffered(controller) -> bool:
    """A kill point with rollouts of every kind on hand: a step trained and checkpointed,
    committed groups waiting in the buffer, and groups still generating."""
    saved = controller.checkpointer.last_saved_step
    return (
        len(controller.history) >= 1
        and saved is not None
        and saved >= controller.history[0]["step"]
        and controller.buffer.num_ready >= 2
        and controller.inflight_count >= 1
    )


def killed_run(ckpt: Path, *overrides: str, seed: int = 0) -> None:
    finished = asyncio.run(
        attempt(cfg_at(ckpt, *overrides), kill_after_s=None, seed=seed, kill_when=buffered)
    )
    assert not finished, "the run finished before its kill"


def starts(ckpt: Path) -> list[dict]:
    return [event for event in read_journal(ckpt / JOURNAL) if event["event"] == "start"]


def exactly_once(ckpt: Path) -> None:
    result = lineage(read_journal(ckpt / JOURNAL))
    trained = result.trained_groups()
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert set(trained) == all_prompt_ids(), sorted(all_prompt_ids() - set(trained))
    assert sorted(result.trained) == list(range(1, len(result.trained) + 1))


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """A run killed with committed groups in its buffer and others generating (copied per
    test)."""
    ckpt = tmp_path_factory.mktemp("killed") / "ckpt"
    killed_run(ckpt)
    return ckpt


@pytest.fixture
def ckpt(killed, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(killed, copy)
    return copy


def test_refuse_names_every_changed_dotpath_and_modifies_nothing(ckpt, capsys):
    before = tree_state(ckpt)
    with pytest.raises(RestoreRefused) as refused:
        plan_restore(
            cfg_at(ckpt, "policy.generation.temperature=0.7", "+env.kwargs.api_token=other-s3cret")
        )
    message = str(refused.value)
    assert TEMPERATURE in message and "since step_" in message
    assert "drop_rollouts" in message and "keep" in message and "Nothing was" in message
    # a credential is named but its value is not
    assert 'env.kwargs.api_token: "<absent>" -> "<redacted>"' in message
    assert "s3cret" not in message
    assert tree_state(ckpt) == before

    # tandemrl train: could not start (exit 2), before Ray or any worker, nothing written
    code = main(
        [
            "train",
            "--config",
            "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
            *_cli_overrides(ckpt),
            "policy.generation.temperature=0.7",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot start" in err and TEMPERATURE in err
    assert tree_state(ckpt) == before


def _cli_overrides(ckpt: Path) -> list[str]:
    """The overrides of ``make_cfg`` + LOG_CFG, for the command line."""
    cfg = cfg_at(ckpt)
    return [
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8",
        f"grpo.max_num_epochs={cfg.grpo.max_num_epochs}",
        "async_rl.min_groups_for_streaming_train=2",
        "async_rl.max_buffered_rollouts=8",
        "async_rl.max_inflight_prompts=8",
        f"checkpointing.checkpoint_dir={ckpt}",
        f"logger.log_dir={ckpt.parent / 'logs'}",
    ]


def _targets(controller) -> dict[str, int | None]:
    groups = {slot.group_id: slot.target_step for slot in controller.buffer.ready_groups()}
    groups.update({g.group_id: g.target_step for g in controller.run_state.recovered_groups})
    return groups


def test_drop_rollouts_generates_every_restored_group_again_for_its_own_step(ckpt, caplog):
    # What a restart keeps (on a copy): the groups, their target steps, the data position
    keep_copy = ckpt.parent / "keep"
    shutil.copytree(ckpt, keep_copy)

    async def resumed(directory: Path, *overrides: str):
        cfg = cfg_at(directory, "policy.generation.temperature=0.7", *overrides)
        controller = build(cfg, seed=1)
        await controller.resume(plan_run(cfg))  # the driver's decision, logged
        state = (
            _targets(controller),
            controller.dataloader.state_dict(),
            controller.sampler.dispatch_state(),
        )
        controller.commit_log.close()
        controller.journal.close()
        return controller, state

    _, (kept, loader, dispatch) = asyncio.run(
        resumed(keep_copy, "rollout_checkpointing.on_config_change=keep")
    )
    with caplog.at_level(logging.WARNING):
        controller, (targets, loader_after, dispatch_after) = asyncio.run(
            resumed(ckpt, "rollout_checkpointing.on_config_change=drop_rollouts")
        )
    assert any(TEMPERATURE in record.getMessage() for record in caplog.records)
    # nothing committed is left to train; every restored group is generated again, for the
    # step it was admitted for, and no prompt is drawn again (no requeue, same positions)
    assert controller.buffer.num_ready == 0
    assert all(not group.staged for group in controller.run_state.recovered_groups)
    assert targets == kept and len(targets) >= 3
    assert loader_after == loader and loader_after["requeued"] == []
    assert dispatch_after == dispatch
    start = starts(ckpt)[-1]
    change = start["config_change"]
    assert change["policy"] == "drop_rollouts" and TEMPERATURE in change["changes"]
    assert change["dropped_committed"] and start["restored_committed"] == []
    assert sorted(change["dropped_committed"] + change["dropped_unfinished"]) == sorted(targets)

    # killed again under the new config; then the same command (default policy, refuse)
    # resumes without asking again: the choice was recorded under the new identity
    temperature = "policy.generation.temperature=0.7"
    killed_run(ckpt, temperature, "rollout_checkpointing.on_config_change=drop_rollouts", seed=2)
    plan = plan_restore(cfg_at(ckpt, temperature))
    assert plan.config_change is None
    assert asyncio.run(attempt(cfg_at(ckpt, temperature), kill_after_s=60, seed=3))

    exactly_once(ckpt)
    result = lineage(read_journal(ckpt / JOURNAL))
    # every group was trained under the config it was generated under: none of the old
    # config's was trained after the change
    assert result.trained_under_another_config() == []
    assert result.regenerated_after_restore == []


def test_keep_trains_the_restored_groups_and_says_so(ckpt, caplog):
    cfg = cfg_at(
        ckpt, "policy.generation.temperature=0.7", "rollout_checkpointing.on_config_change=keep"
    )
    with caplog.at_level(logging.WARNING):
        plan_run(cfg)  # what the driver says before anything starts
        assert asyncio.run(attempt(cfg, kill_after_s=60, seed=1))
    messages = [record.getMessage() for record in caplog.records]
    assert any("on_config_change=keep" in message for message in messages)
    assert any(TEMPERATURE in message for message in messages)
    start = starts(ckpt)[-1]
    assert start["config_change"]["policy"] == "keep"
    kept = start["config_change"]["kept_committed"]
    assert kept and set(kept) <= set(start["restored_committed"])
    exactly_once(ckpt)
    # the kept groups were trained by the new attempt, as generated under the old config
    mixed = {
        group
        for _, group, _, _ in lineage(read_journal(ckpt / JOURNAL)).trained_under_another_config()
    }
    assert set(kept) <= mixed


def test_a_group_size_change_is_refused_under_every_policy(ckpt):
    for policy in ("drop_rollouts", "keep"):
        cfg = cfg_at(
            ckpt,
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=16",
            f"rollout_checkpointing.on_config_change={policy}",
        )
        with pytest.raises(RestoreRefused, match=r"num_generations_per_prompt: 2 -> 4.*whatever"):
            plan_restore(cfg)
        info = describe_checkpoint_dir(ckpt, cfg)
        assert info["outcome"] == "refused", info["config_change"]
        assert "cannot be resumed under any policy" in info["config_change"]["outcomes"][policy]


@pytest.mark.parametrize(
    "override",
    [
        "logger.level=WARNING",
        "policy.generation.max_batch_size=7",
        "async_rl.stall_watchdog.timeout_s=99",
        "checkpointing.preemption_grace_s=5",
    ],
)
def test_an_operational_change_resumes_silently(ckpt, override):
    plan = plan_restore(cfg_at(ckpt, override))
    assert plan.config_change is None and not plan.fresh


def test_a_stored_identity_is_compared_without_the_current_operational_keys(ckpt):
    # A checkpoint written before a key was listed as operational holds it in its identity
    # (and a fingerprint over it): a restart still resumes it silently.
    _, step = list_step_dirs(ckpt)[-1]
    manifest_path = step / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    # a trainer checkpoint records the same identity as a snapshot
    assert manifest["identity"] == compatibility_identity(cfg_at(ckpt))
    manifest["identity"]["policy.generation.weight_sync"] = "nccl"
    manifest["identity"]["checkpointing.preemption_grace_s"] = 30.0
    manifest["fingerprint"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    for snapshot in (step / "rollout_snapshots").glob("snapshot_*"):
        shutil.rmtree(snapshot)  # the trainer checkpoint's own state is what is compared
    assert plan_restore(cfg_at(ckpt)).config_change is None
    # a rollout-semantic value recorded differently is a change
    manifest["identity"]["policy.generation.top_p"] = 0.5
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(RestoreRefused, match=r"policy\.generation\.top_p: 0\.5 -> 1\.0"):
        plan_restore(cfg_at(ckpt))


def test_a_change_is_seen_through_the_commit_log_of_a_later_attempt(ckpt):
    # An attempt under temperature 0.7 (drop_rollouts) commits groups and is killed before
    # its first step: its groups are in the log, on the branch of the last trainer checkpoint
    # (written under 1.0). Going back to 1.0 would mix them in: refused, naming the attempt.
    changed = (
        "policy.generation.temperature=0.7",
        "rollout_checkpointing.on_config_change=drop_rollouts",
    )
    finished = asyncio.run(
        attempt(
            cfg_at(ckpt, *changed),
            kill_after_s=None,
            seed=1,
            kill_when=lambda c: not c.history and c.buffer.num_ready >= 1,
        )
    )
    assert not finished
    with pytest.raises(RestoreRefused) as refused:
        plan_restore(cfg_at(ckpt))
    assert "policy.generation.temperature: 0.7 -> 1.0" in str(refused.value)


def test_inspect_shows_the_changed_dotpaths_and_the_outcome_under_each_policy(ckpt, capsys):
    before = tree_state(ckpt)
    info = describe_checkpoint_dir(ckpt, cfg_at(ckpt, "policy.generation.temperature=0.7"))
    assert info["outcome"] == "refused"
    change = info["config_change"]
    assert change["policy"] == "refuse"
    assert change["sources"][0]["changes"] == [TEMPERATURE]
    assert set(change["outcomes"]) == {"refuse", "drop_rollouts", "keep"}
    committed = len(info["resume"]["committed_groups"]) + len(
        info["commit_log"]["committed_groups"]
    )
    assert committed >= 2
    assert f"generates the {committed} committed" in change["outcomes"]["drop_rollouts"]
    text = render_text(info)
    assert TEMPERATURE in text and "on_config_change=refuse: a restart starts nothing" in text
    assert "with on_config_change=keep it resumes everything" in text
    # under drop_rollouts the restart would start: inspect exits 0 and says what it does
    code = inspect_command(
        str(ckpt),
        "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
        [
            *_cli_overrides(ckpt),
            *LOG_CFG,
            "policy.generation.temperature=0.7",
            "rollout_checkpointing.on_config_change=drop_rollouts",
        ],
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "on_config_change=drop_rollouts: a restart resumes the model" in out
    assert tree_state(ckpt) == before
