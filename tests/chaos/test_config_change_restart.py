"""SIGKILL a run with committed groups waiting in its buffer, restart it with a changed
rollout-semantic value (``policy.generation.temperature``) under each
``rollout_checkpointing.on_config_change`` policy, and prove from the run journal what each
did (``chaos_harness.run_config_change_case``):

- ``refuse`` (the real ``tandemrl train``): exit code 2 before Ray starts, the changed dotpath
  named as ``old -> new``, not one byte of the checkpoint directory changed;
- ``drop_rollouts``: killed again mid-run; nothing it trained was generated under the old
  temperature, though it had committed and unfinished groups to drop;
- ``keep``: to the end, training only the groups it said it kept across the change;

and over the whole run every prompt trained exactly once, steps without a gap.
"""

from __future__ import annotations

import pytest
from chaos_harness import TEMPERATURE, RunShape, run_config_change_case

pytestmark = pytest.mark.chaos

SHAPE = RunShape(num_prompts=40, epochs=1, prompts_per_step=4, generations_per_prompt=2)


def test_a_killed_run_restarted_with_a_changed_config_under_each_policy(tmp_path):
    report = run_config_change_case(tmp_path, shape=SHAPE)
    proof = report.audit
    print("RESULT", {key: value for key, value in proof.items() if key != "finished_again"})

    # refuse: could not start (exit 2), said what changed and how to go on, modified nothing
    assert report.refused_returncode == 2, report.refused_output
    assert f"{TEMPERATURE}: 1.0 -> 0.7" in report.refused_output
    assert "on_config_change=drop_rollouts" in report.refused_output
    assert report.refused_modified == []
    assert "Ray instance" not in report.refused_output, report.refused_output  # before Ray

    # both kills landed with committed groups waiting, after a trainer checkpoint
    assert [kill.point for kill in report.kills] == ["with_buffered_groups"] * 2
    assert all(kill.hit for kill in report.kills), report.kills
    assert report.final_returncode == 0

    assert proof["config_changes"]["drop_rollouts"] == [f"{TEMPERATURE}: 1.0 -> 0.7"]
    assert proof["config_changes"]["keep"] == [f"{TEMPERATURE}: 0.7 -> 0.5"]
    assert proof["dropped_committed"], proof  # there was something to drop
    # drop_rollouts: no group generated at temperature 1.0 trained after the change
    assert proof["old_config_trained_after_change"] == [], proof
    assert proof["drop_attempt_trained_across_change"] == [], proof
    # keep: only what it said it kept crossed the change
    assert proof["kept"], proof
    assert proof["keep_attempt_trained_not_kept"] == [], proof

    assert proof["groups_lost"] == 0 and proof["groups_duplicated"] == 0, proof
    assert proof["unexpected_groups"] == [], proof
    assert proof["steps"] == SHAPE.total_steps and proof["step_numbering_continuous"], proof
    assert proof["step_sizes"] == [SHAPE.prompts_per_step], proof
