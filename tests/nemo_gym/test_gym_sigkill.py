"""SIGKILL a real ``tandemrl train`` NeMo-Gym run mid-generation (the tiny model, the torch
engine, Ray), restart it, and prove from the run journal that every prompt of every epoch was
trained exactly once: no group lost, none duplicated, nothing restored from disk generated
again. The Gym servers (the session's) outlive the killed trainer, as servers started with
``gym env start`` would; the restarted run connects to them again.
"""

from __future__ import annotations

import json

import pytest
from chaos_harness import RunShape, audit, dump, run_with_kills
from conftest import DATASET, EXEMPLAR, GymServers

pytestmark = pytest.mark.chaos


def test_sigkill_of_a_gym_run_loses_and_duplicates_no_group(gym: GymServers, tmp_path):
    rows = DATASET.read_text().splitlines()[:8]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("\n".join(rows) + "\n")
    overrides = [arg for arg in gym.connect_overrides() if not arg.startswith("data.dataset=")]
    shape = RunShape(
        num_prompts=len(rows),
        epochs=2,
        prompts_per_step=4,
        generations_per_prompt=4,
        config=EXEMPLAR,
        extra=(
            *overrides,
            f"data.dataset={dataset}",
            "data.shuffle=false",
            "checkpointing.enabled=true",
            "checkpointing.save_data_plane=true",
        ),
    )
    report = run_with_kills(tmp_path, ["mid_generation"], shape=shape, seed=0)
    dump(report, tmp_path / "chaos_report.json")
    print("RESULT", json.dumps(report.result()))

    assert report.final_returncode == 0, report
    assert report.kills[0].hit, report.kills
    proof = audit(tmp_path / "ckpt", shape)
    assert proof["attempts"] == 2
    assert proof["groups_lost"] == 0, proof
    assert proof["groups_duplicated"] == 0, proof
    assert proof["unexpected_groups"] == [], proof
    assert proof["steps"] == shape.total_steps and proof["step_numbering_continuous"], proof
    # nothing restored from disk (committed groups, staged episodes) was played again
    assert proof["regenerated_after_restore"] == [], proof
    assert proof["groups_regenerated"] == 0, proof
