"""SIGKILL (and SIGTERM) the real tiny CPU run at chosen points, restart it until it finishes,
prove from the run journal that every prompt of every epoch was trained exactly once and that
no finished group or sibling was generated twice (the commit log keeps what committed after the
newest snapshot).

The kill points (see ``chaos_harness``): SIGKILL mid-generation right after a step closed,
with that version's validation pass open (its checkpoint holds it open), while a trainer
checkpoint is being written, and while a rollout snapshot is being written; then SIGTERM to
the run's process group mid-generation (a preemption: the run stops gracefully, exit 143, and
leaves no process). The run validates every 8 versions: every pass is reported exactly once,
the one open at the kill after the restart. Each restart is the same ``tandemrl train``
command; it resumes from the newest compatible bundle. ``benchmarks/chaos_restart.py`` is the
longer variant (more kills, random times).
"""

from __future__ import annotations

import json
import re

import pytest
from chaos_harness import (
    REPO,
    RunShape,
    audit,
    distillation_shape,
    dump,
    leftover_temporaries,
    run_with_kills,
)

CHAOS_CONFIGS = REPO / "examples" / "configs"

pytestmark = pytest.mark.chaos

# validation_open also stands for mid_generation (rollouts are in flight when a pass opens),
# which keeps the test at four kills.
CI_KILL_POINTS = [
    "validation_open",
    "trainer_checkpoint_write",
    "snapshot_write",
    "mid_generation:SIGTERM",
]


def test_sigkill_and_restart_trains_every_prompt_exactly_once(tmp_path):
    # One validation prompt in flight at a time: the pass of version 8 then lasts a few times
    # longer than step_8's checkpoint write, under load too. (With four at a time the pass
    # took 0.58 s and ended before step_8 was published in a CI run at load 5, and the kill
    # fell on the last version's pass, leaving nothing for the other kill points.) Three
    # epochs, 24 steps: room for the later kill points when the machine is slow to show them.
    shape = RunShape(
        epochs=3,
        val_period=8,
        val_samples=64,
        val_generations=4,
        extra=("grpo.val_batch_size=1",),
    )
    report = run_with_kills(tmp_path, CI_KILL_POINTS, shape=shape, seed=0)
    dump(report, tmp_path / "chaos_report.json")
    print("RESULT", report.result())

    assert [kill.point for kill in report.kills] == CI_KILL_POINTS, report.kills
    assert report.final_returncode == 0
    # each kill landed where it was meant to (a write kill: while its temporary folder existed)
    kills = {kill.point: kill for kill in report.kills}
    assert kills["trainer_checkpoint_write"].hit, kills
    assert ".step_" in kills["trainer_checkpoint_write"].detail, kills
    assert kills["validation_open"].hit, kills
    # a mid-run kill takes the Ray workers too (own process groups): driver, gcs, raylet, at
    # least the generation worker, the trainer and the controller actor
    assert kills["validation_open"].processes >= 6, kills
    # the preemption: a graceful stop with 128 + SIGTERM, no process of the run left behind,
    # and it said where it stopped and how to resume
    preempted = kills["mid_generation:SIGTERM"]
    assert preempted.hit and preempted.returncode == 143, kills
    assert preempted.left_behind == 0, kills
    stop_log = (tmp_path / f"attempt_{preempted.attempt:02d}.log").read_text()
    assert re.search(r"stopped at step \d+; run the same command to resume", stop_log)
    assert "Traceback" not in stop_log
    # the snapshot write is a few milliseconds long: seen most of the time, not always
    # interrupted folders are swept by the next successful write, never left to pile up
    assert leftover_temporaries(tmp_path / "ckpt") == []

    proof = audit(tmp_path / "ckpt", shape)
    assert proof["attempts"] == len(CI_KILL_POINTS) + 1
    assert proof["groups_lost"] == 0, proof
    assert proof["groups_duplicated"] == 0, proof
    assert proof["unexpected_groups"] == [], proof
    assert proof["steps"] == shape.total_steps and proof["step_numbering_continuous"], proof
    assert proof["step_sizes"] == [shape.prompts_per_step], proof
    # nothing restored from disk (committed groups, staged siblings) was generated again
    assert proof["regenerated_after_restore"] == [], proof
    # lossless: no committed group and no finished sibling was generated twice — groups that
    # committed after the newest snapshot came back from the commit log
    assert proof["groups_regenerated"] == 0 and proof["siblings_regenerated"] == 0, proof
    assert proof["finished_siblings_generated_again"] == 0, proof
    # every restart after the first kill resumed from a trainer checkpoint, not from scratch
    assert all(step > 0 for step in proof["resumed_steps"][1:]), proof
    # every step's metrics row is in metrics.jsonl exactly once: a row is written before its
    # step's checkpoint, and rows of steps a restart trains again are replaced
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in lines]
    assert logged == list(range(1, shape.total_steps + 1)), logged

    # Validation: the kill came with a pass open; the restart re-opened it at its version;
    # every scheduled version was reported once in the final lineage, and once in the file.
    opened_at_kill = int(kills["validation_open"].detail.split("version ")[1].split(" ")[0])
    assert opened_at_kill in proof["validation_reopened"], proof
    expected = {version: 1 for version in shape.validated_versions()}
    assert proof["validation_reports"] == expected, proof
    lines = (tmp_path / "logs" / "validation.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["trainer_version"] for line in lines) == sorted(expected)


def test_sigkill_of_a_distillation_run_scores_no_committed_group_twice(tmp_path):
    """A distillation run killed mid-generation (groups committed with their teacher logprobs,
    others in flight) resumes with every committed group's logprobs from the checkpoint: each
    trained group was scored by its teacher exactly once, over both attempts."""
    shape = distillation_shape(num_prompts=32, epochs=1)
    # Generous deadlines: three Ray workers load models on two shared cores before step 1.
    report = run_with_kills(
        tmp_path,
        ["mid_generation"],
        shape=shape,
        seed=0,
        point_timeout_s=600.0,
        final_timeout_s=900.0,
    )
    dump(report, tmp_path / "chaos_report.json")
    print("RESULT", {**report.result(), "teacher_passes": report.audit["teacher_passes"]})

    assert report.final_returncode == 0
    assert report.kills[0].hit, report.kills
    proof = report.audit
    assert proof["attempts"] == 2
    assert proof["groups_lost"] == 0 and proof["groups_duplicated"] == 0, proof
    assert proof["steps"] == shape.total_steps and proof["step_numbering_continuous"], proof
    assert proof["groups_regenerated"] == 0, proof
    # the restart brought committed groups back (snapshot or commit log) ...
    assert proof["restored_committed"] > 0, proof
    # ... and no teacher scored any committed group a second time
    assert proof["teacher_passes_redone"] == [], proof
    assert proof["trained_without_teacher_pass"] == [], proof
    rows = [
        json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in rows] == list(range(1, shape.total_steps + 1))
    assert sum(row["train/teacher_groups_scored_in_train_pump"] for row in rows) == 0
    assert all("train/reverse_kl" in row for row in rows)


def test_sigkill_of_a_multi_turn_agent_run_loses_and_replays_no_episode(tmp_path):
    """The agent exemplar (two-turn episodes over the HTTP endpoint), killed mid-generation
    and while a snapshot is written: finished episodes come back from disk with their turns,
    unfinished ones are played again from their first turn."""
    shape = RunShape(
        num_prompts=24,
        epochs=1,
        prompts_per_step=4,
        generations_per_prompt=4,
        config=CHAOS_CONFIGS / "grpo_tiny_cpu_agent.yaml",
        extra=("checkpointing.enabled=true", "checkpointing.save_data_plane=true"),
    )
    points = ["mid_generation", "snapshot_write"]
    report = run_with_kills(tmp_path, points, shape=shape, seed=1)
    dump(report, tmp_path / "chaos_report.json")
    print("RESULT", report.result())
    assert report.final_returncode == 0
    assert [kill.point for kill in report.kills] == points, report.kills
    proof = audit(tmp_path / "ckpt", shape)
    assert proof["groups_lost"] == 0 and proof["groups_duplicated"] == 0, proof
    assert proof["steps"] == shape.total_steps and proof["step_numbering_continuous"], proof
    assert proof["regenerated_after_restore"] == [], proof
    assert proof["groups_regenerated"] == 0 and proof["siblings_regenerated"] == 0, proof
    assert proof["finished_siblings_generated_again"] == 0, proof
    # Episodes staged or committed before a kill were restored, not played again.
    assert (
        proof["restored_committed"] + proof["restored_staged"] + proof["log_replayed_committed"] > 0
    ), proof
