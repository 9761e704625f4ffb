"""A vision-language run (policy.is_vlm, the real processor, images in every row) killed
with SIGKILL while a rollout snapshot is written and while committed groups wait in its
buffer, restarted until it finishes: every prompt trained exactly once, and every trained
row held its prompt's images intact, whether it came from the rollout, a data-plane
snapshot or the commit log's replay (``light_driver.ImageCheckingTrainer`` fails the attempt
otherwise). Light attempts (fake engine and trainer, real controller, writer, commit log and
journal) keep it within seconds."""

from __future__ import annotations

import pytest
from chaos_harness import VLM_CHECKPOINTING, VLM_CONFIG, RunShape, dump, run_with_kills

pytestmark = pytest.mark.chaos

SHAPE = RunShape(
    num_prompts=64,
    epochs=1,
    prompts_per_step=4,
    generations_per_prompt=2,
    config=VLM_CONFIG,
    # A snapshot attempt every 0.1 s: a light attempt is over within seconds on a fast
    # machine, and each write lasts milliseconds, so many writes give the poll a chance to
    # see one (at 0.5 s, CI's machine finished the second attempt before it saw any).
    extra=(*VLM_CHECKPOINTING, "rollout_checkpointing.snapshot_attempt_interval_s=0.1"),
)
POINTS = ["with_buffered_groups", "snapshot_write"]


def test_a_killed_vlm_run_restores_its_image_rows_and_trains_every_prompt_once(tmp_path):
    report = run_with_kills(
        tmp_path,
        POINTS,
        shape=SHAPE,
        light=True,
    )
    dump(report, tmp_path / "chaos_report.json")
    print("RESULT", report.result())
    assert [kill.point for kill in report.kills] == POINTS, report.kills
    assert report.kills[0].hit, report.kills
    assert report.final_returncode == 0, (tmp_path / "attempt_02.log").read_text()[-3000:]
    proof = report.audit
    assert proof["groups_lost"] == 0 and proof["groups_duplicated"] == 0, proof
    assert proof["unexpected_groups"] == [], proof
    assert proof["steps"] == SHAPE.total_steps and proof["step_numbering_continuous"], proof
    # committed VLM groups came back from disk (snapshot and/or commit log), not regenerated
    assert proof["restored_committed"] + proof["log_replayed_committed"] > 0, proof
    assert proof["groups_regenerated"] == 0, proof
