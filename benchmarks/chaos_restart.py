"""Chaos restart benchmark: SIGKILL the real tiny CPU run many times, restart, audit.

The longer variant of ``tests/chaos/test_sigkill.py``: every chosen kill point once (trainer
checkpoint write, snapshot write, mid-generation, mid-train-step), then ``--random`` kills at
seeded random times, restarting the same ``tandemrl train`` command after each until the run
finishes. The run journal is replayed into the proof and the figures:

- ``kills``: kills survived (every one was followed by a restart that resumed);
- ``groups_lost``: prompts of some epoch never trained (must be 0);
- ``groups_duplicated``: extra trainings of a group in the final lineage (must be 0);
- ``groups_regenerated`` / ``siblings_regenerated``: committed groups with a sibling generated
  more than once (journal ``generated`` events). With the commit log on (the default) every
  committed group is durable before it is trainable, so this must be 0; with
  ``--no-commit-log`` it is the work a kill costs (groups committed after the last snapshot);
- ``finished_groups_generated_again`` / ``finished_siblings_generated_again``: siblings that
  finished (journal ``staged`` events: generated, scored, and — with the log — written to it)
  in more than one attempt (must be 0 with the log; sibling recovery);
- ``regenerated_after_restore``: siblings generated again although a restore had brought them
  back from disk (must be empty);
- ``log_replayed_committed``: committed groups that restarts took from the commit log.

    python benchmarks/chaos_restart.py [--random 6] [--seed 1] [--num-prompts 64] [--workdir D]
                                       [--no-commit-log]

Ends with one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "chaos"))

from chaos_harness import RunShape, dump, leftover_temporaries, run_with_kills

CHOSEN_POINTS = ["trainer_checkpoint_write", "snapshot_write", "mid_generation", "mid_train"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--random", type=int, default=6, help="random-time kills after the chosen ones"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--no-commit-log",
        action="store_true",
        help="rollout_checkpointing.commit_log=false: the snapshot-only baseline",
    )
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tandemrl-chaos-"))
    shape = RunShape(
        num_prompts=args.num_prompts, epochs=args.epochs, commit_log=not args.no_commit_log
    )
    points = [*CHOSEN_POINTS, *["random"] * args.random]
    report = run_with_kills(workdir, points, shape=shape, seed=args.seed)
    dump(report, workdir / "chaos_report.json")
    result = report.result()
    result["kills_survived"] = len(report.kills) if report.final_returncode == 0 else 0
    result["interrupted_writes_left"] = len(leftover_temporaries(workdir / "ckpt"))
    result["workdir"] = str(workdir)
    result["commit_log"] = shape.commit_log
    ok = (
        report.final_returncode == 0
        and result["groups_lost"] == 0
        and result["groups_duplicated"] == 0
        and result["regenerated_after_restore"] == []
        and result["step_numbering_continuous"]
        and result["steps"] == shape.total_steps
    )
    result["exactly_once"] = ok
    result["lossless"] = (
        result["groups_regenerated"] == 0 and result["finished_siblings_generated_again"] == 0
    )
    if shape.commit_log:
        ok = ok and result["lossless"]
    print(f"kills: {[(k.point, k.hit, k.detail) for k in report.kills]}")
    print(f"audit: {json.dumps(report.audit)}")
    print("RESULT " + json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
