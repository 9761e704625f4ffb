"""SIGKILL the real tiny CPU run at chosen points, restart it until it finishes, prove from
the run journal that every prompt of every epoch was trained exactly once and that no finished
group or sibling was generated twice (the commit log keeps what committed after the newest
snapshot).

The kill points (see ``chaos_harness``): while a trainer checkpoint is being written, while a
rollout snapshot is being written, and mid-generation shortly after a step closed. Each
restart is the same ``tandemrl train`` command; it resumes from the newest compatible bundle.
``benchmarks/chaos_restart.py`` is the longer variant (more kills, random times).
"""

from __future__ import annotations

import json

import pytest
from chaos_harness import REPO, RunShape, audit, dump, leftover_temporaries, run_with_kills

CHAOS_CONFIGS = REPO / "examples" / "configs"

pytestmark = pytest.mark.chaos

CI_KILL_POINTS = ["trainer_checkpoint_write", "snapshot_write", "mid_generation"]


def test_sigkill_and_restart_trains_every_prompt_exactly_once(tmp_path):
    shape = RunShape()
    report = run_with_kills(tmp_path, CI_KILL_POINTS, shape=shape, seed=0)
    dump(report, tmp_path / "chaos_report.json")
    print("RESULT", report.result())

    assert [kill.point for kill in report.kills] == CI_KILL_POINTS, report.kills
    assert report.final_returncode == 0
    # each kill landed where it was meant to (a write kill: while its temporary folder existed)
    kills = {kill.point: kill for kill in report.kills}
    assert kills["trainer_checkpoint_write"].hit, kills
    assert ".step_" in kills["trainer_checkpoint_write"].detail, kills
    assert kills["mid_generation"].hit, kills
    # a mid-run kill takes the Ray workers too (own process groups): driver, gcs, raylet, at
    # least the generation worker, the trainer and the controller actor
    assert kills["mid_generation"].processes >= 6, kills
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
