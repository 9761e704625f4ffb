"""``tandemrl inspect DIR``: what a restart from a checkpoint directory would resume.

``describe_checkpoint_dir`` runs the very selection a restart runs (``plan_restore_dir``,
read-only) and reads the chosen rollout state: the step and trainer version it resumes after,
the committed groups it makes selectable again, the unfinished groups it redispatches (with the
recovery granularity stored for each and the siblings already staged), and why every other
bundle is skipped (damaged — with the reason —, older, or written under a different config —
with the changed dotpaths), and what the commit log adds on top of the chosen bundle (records,
groups it restores or reopens, torn tails ignored), how each model folder of the chosen
trainer checkpoint is laid out (one process's files, or a sharded trainer's DCP shards: at how
many ranks, which files, any missing), the validation passes it re-opens, and —
with ``checkpointing.metric_name`` — which trainer checkpoint is the best and why (scores from
the run journal's reported passes, ``tandemrl.checkpoint.best``). With a config, it also
compares the config identities the chosen rollout state was generated under with the given
config's, lists every changed dotpath, and says what a restart does under the configured
``rollout_checkpointing.on_config_change`` and under each of the others. Without a config the
restore mode is taken as ``latest`` and no fingerprint is checked; the result says so.
``inspect_command`` prints it as text or JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tandemrl.checkpoint.best import best_record, explain, read_best_record, score_of
from tandemrl.checkpoint.commit_log import branch_records, fold, list_segments, read_log
from tandemrl.checkpoint.commit_replay import commit_log_dir
from tandemrl.checkpoint.journal import read_journal, reported_validations
from tandemrl.checkpoint.layout import (
    JOURNAL,
    MANIFEST,
    POLICY_DIR,
    SNAPSHOTS_DIR,
    VALUE_DIR,
    CheckpointCorrupt,
    bootstrap_dir,
    list_step_dirs,
    read_manifest,
)
from tandemrl.checkpoint.restore import (
    ON_CONFIG_CHANGE,
    UNRESUMABLE_CHANGES,
    CurrentConfig,
    RestorePlan,
    RestoreRefused,
    config_change_refusal,
    plan_restore_dir,
)
from tandemrl.checkpoint.rollout_state import read_rollout_state, unfinished_groups
from tandemrl.config.models import MasterConfig
from tandemrl.dataplane.atomic import is_temporary_name
from tandemrl.training.worker_common import SHARDED_LAYOUT, WORKER_STATE_FILE

EXIT_OK = 0
EXIT_REFUSED = 1  # a restart would refuse this directory (or it cannot be read)
EXIT_INVALID = 2


def _leftovers(checkpoint_dir: Path) -> list[str]:
    """Temporary or interrupted folders a restart ignores (never selected, never deleted)."""
    found: list[str] = []
    anchors = [path for _, path in list_step_dirs(checkpoint_dir)]
    anchors.append(bootstrap_dir(checkpoint_dir))
    for parent in [checkpoint_dir, *(anchor / SNAPSHOTS_DIR for anchor in anchors)]:
        if parent.is_dir():
            found.extend(
                str(child) for child in sorted(parent.iterdir()) if is_temporary_name(child.name)
            )
    return found


def _rollout_summary(directory: Path) -> dict[str, Any]:
    state = read_rollout_state(directory)
    committed = [] if state.replay_index is None else state.replay_index["groups"]
    unfinished = unfinished_groups(state)
    return {
        "sampler": state.sampler.get("name"),
        "shadow": state.replay_index is None,
        "consumed_groups": state.controller.get("consumed_groups"),
        "dataloader": {
            "epoch": state.dataloader.get("epoch"),
            "position": state.dataloader.get("position"),
            "num_prompts": state.dataloader.get("num_prompts"),
            "requeued": len(state.dataloader.get("requeued", [])),
        },
        "committed_groups": [
            {
                "group_id": group["group_id"],
                "start_weight": group["start_weight"],
                "end_weight": group["end_weight"],
                "target_step": group["target_step"],
                "rows": len(group["rows_meta"]),
            }
            for group in committed
        ],
        "unfinished_groups": [
            {
                "group_id": group.group_id,
                "prompt_id": group.item.prompt_id,
                "granularity": group.granularity,
                "staged_siblings": sorted(group.staged),
                # What the restart does with the staged siblings (spec: sibling keeps them).
                "reused_siblings": sorted(group.staged) if group.granularity == "sibling" else [],
                "start_weight": group.start_weight,
                "target_step": group.target_step,
            }
            for group in unfinished
        ],
        "shadow_prompts": len(state.shadow_prompts),
        "replacement_reserve": len(state.replacement_reserve),
        "commit_log_next_lsn": state.commit_log_next_lsn,
        "validation_open": [
            {
                "version": int(entry["version"]),
                "pending_prompts": len(entry.get("pending", [])),
                "finished_prompts": len(entry.get("results", [])),
            }
            for entry in (state.validation or {}).get("open", [])
        ],
    }


def _commit_log_summary(
    checkpoint_dir: Path, from_lsn: int | None, restore_mode: str
) -> dict[str, Any] | None:
    """The log on disk and what a restart replays from it (raises CheckpointCorrupt)."""
    directory = commit_log_dir(checkpoint_dir)
    if not directory.is_dir():
        return None
    contents = read_log(directory)
    summary: dict[str, Any] = {
        "path": str(directory),
        "segments": [path.name for _, path in list_segments(directory)],
        "records": len(contents.records),
        "torn_tails_ignored": [f"{path} @ byte {offset}" for path, offset in contents.torn],
        "replay_from_lsn": from_lsn,
        "replayed_records": 0,
        "committed_groups": [],
        "reopened_groups": [],
        "dropped_groups": [],
    }
    if from_lsn is None or restore_mode != "latest":
        summary["note"] = (
            "not replayed: the chosen state was written without the log"
            if from_lsn is None
            else "not replayed in restore_mode trainer_checkpoint"
        )
        return summary
    replay = fold(branch_records(contents.records, from_lsn))
    summary.update(
        replayed_records=replay.records,
        committed_groups=list(replay.committed),
        reopened_groups=list(replay.admitted),
        dropped_groups=sorted(replay.dropped),
    )
    return summary


def _model_layouts(trainer_dir: Path) -> dict[str, Any]:
    """How each model folder of a trainer checkpoint is laid out: one process's files, or a
    sharded trainer's DCP folder (its ranks, shard files, and any the metadata lists but the
    folder lacks)."""
    layouts: dict[str, Any] = {}
    for folder in (POLICY_DIR, VALUE_DIR):
        directory = trainer_dir / folder
        state_file = directory / WORKER_STATE_FILE
        if not state_file.is_file():
            continue
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError) as exc:
            layouts[folder] = {"error": f"unreadable {state_file}: {exc}"}
            continue
        info: dict[str, Any] = {
            "layout": state.get("layout", "single"),
            "data_parallel_size": state.get("data_parallel_size", 1),
            "optimizer_steps": state.get("optimizer_steps"),
            "has_optimizer": state.get("has_optimizer"),
        }
        if info["layout"] == SHARDED_LAYOUT:
            from tandemrl.training.fsdp import describe_sharded_folder

            info.update(describe_sharded_folder(directory))
        layouts[folder] = info
    return layouts


def _trainer_version(plan: RestorePlan) -> int:
    if plan.rollout_dir is None:
        return 0
    if (plan.rollout_dir / MANIFEST).is_file():
        return int(read_manifest(plan.rollout_dir).get("trainer_version", plan.step))
    return plan.step


def _best_checkpoint(
    checkpoint_dir: Path, cfg: MasterConfig | None, resumed_step: int
) -> dict[str, Any] | None:
    """The best trainer checkpoint by the run's metric (``--config``, else the one the run
    recorded in best_checkpoint.json), ranked with the passes its lineage reported."""
    recorded = read_best_record(checkpoint_dir)
    if cfg is not None and cfg.checkpointing.metric_name is not None:
        name, higher = cfg.checkpointing.metric_name, cfg.checkpointing.higher_is_better
    elif recorded is not None and isinstance(recorded.get("metric_name"), str):
        name, higher = recorded["metric_name"], bool(recorded.get("higher_is_better", True))
    else:
        return None
    journal = checkpoint_dir / JOURNAL
    events = read_journal(journal) if journal.is_file() else []
    # What a restart from here would rank with: reports of versions above the resumed step
    # are voided (those steps are trained again).
    events.append({"event": "start", "resumed_step": resumed_step})
    scores = {}
    for version, metrics in reported_validations(events).items():
        value = score_of(metrics, name)
        if value is not None:
            scores[version] = value
    on_disk = [step for step, _ in list_step_dirs(checkpoint_dir)]
    record = best_record(
        checkpoint_dir, metric_name=name, higher_is_better=higher, scores=scores, on_disk=on_disk
    )
    record["why"] = explain(record, on_disk)
    return record


def describe_checkpoint_dir(path: str | Path, cfg: MasterConfig | None = None) -> dict[str, Any]:
    """What a restart from ``path`` would resume; pure (reads, never writes). JSON-able."""
    checkpoint_dir = Path(path)
    if cfg is not None:
        restore_mode = cfg.rollout_checkpointing.restore_mode
        current: CurrentConfig | None = CurrentConfig.of(cfg)
        notes = [f"restore_mode {restore_mode} and fingerprint taken from the given config"]
    else:
        restore_mode, current = "latest", None
        notes = [
            "no --config given: restore_mode assumed 'latest' and the config fingerprint was "
            "not checked (a restart with a changed config may refuse or skip snapshots)"
        ]
    result: dict[str, Any] = {
        "checkpoint_dir": str(checkpoint_dir),
        "exists": checkpoint_dir.is_dir(),
        "restore_mode": restore_mode,
        "fingerprint_checked": current is not None,
        "notes": notes,
        "outcome": "fresh",
        "refused": None,
        "error": None,
        "step": 0,
        "trainer_version": 0,
        "trainer_checkpoint": None,
        "rollout_state": None,
        "candidates": [],
        "ignored_temporaries": _leftovers(checkpoint_dir),
        "journal": str(checkpoint_dir / JOURNAL) if (checkpoint_dir / JOURNAL).is_file() else None,
        "resume": None,
        "commit_log": None,
        "models": {},
        "config_change": None,
        "best_checkpoint": None,
    }
    try:
        plan = plan_restore_dir(checkpoint_dir, restore_mode=restore_mode, current=current)
    except RestoreRefused as exc:
        result.update(outcome="refused", refused=str(exc))
        return result
    result["candidates"] = [
        {"path": str(c.path), "kind": c.kind, "chosen": c.chosen, "reason": c.reason}
        for c in plan.considered
    ]
    if plan.fresh:
        result["notes"].append("nothing to resume: a restart starts from the initial model")
        return result
    result.update(
        outcome="resume",
        step=plan.step,
        trainer_checkpoint=None if plan.trainer_dir is None else str(plan.trainer_dir),
        rollout_state=str(plan.rollout_dir),
    )
    if plan.trainer_dir is not None:
        result["models"] = _model_layouts(plan.trainer_dir)
    try:
        result["trainer_version"] = _trainer_version(plan)
        assert plan.rollout_dir is not None
        result["resume"] = _rollout_summary(plan.rollout_dir)
        result["commit_log"] = _commit_log_summary(
            checkpoint_dir, result["resume"]["commit_log_next_lsn"], restore_mode
        )
    except CheckpointCorrupt as exc:
        # Digests matched but the content does not parse: a restart fails here too.
        result.update(outcome="error", error=str(exc))
        return result
    try:
        result["best_checkpoint"] = _best_checkpoint(checkpoint_dir, cfg, plan.step)
    except ValueError as exc:  # a corrupt journal line
        result["notes"].append(f"best checkpoint not ranked: {exc}")
    change = plan.config_change
    if change is not None:
        result["config_change"] = {
            "policy": change.policy,
            "sources": [{"where": where, "changes": lines} for where, lines in change.sources],
            "outcomes": _outcomes(plan, result),
        }
        refusal = config_change_refusal(plan)
        if refusal is not None:
            result.update(outcome="refused", refused=refusal)
    return result


def _outcomes(plan: RestorePlan, info: dict[str, Any]) -> dict[str, str]:
    """What a restart with a changed config does under each on_config_change policy."""
    resume = info["resume"]
    log_info = info["commit_log"] or {}
    committed = len(resume["committed_groups"]) + len(log_info.get("committed_groups", []))
    unfinished = len(resume["unfinished_groups"]) + len(log_info.get("reopened_groups", []))
    staged = sum(len(group["staged_siblings"]) for group in resume["unfinished_groups"])
    outcomes = {
        "refuse": "starts nothing and modifies nothing (tandemrl train exits with code 2)",
        "drop_rollouts": (
            f"resumes the model and optimizer of step {plan.step} and the dataloader and "
            f"sampler position; generates the {committed} committed and {unfinished} "
            f"unfinished group(s) again, for the same target steps ({staged} staged "
            "sibling(s) of the bundle discarded)"
        ),
        "keep": (
            f"resumes everything and trains the {committed} committed group(s) and the "
            f"staged siblings of the {unfinished} unfinished group(s) as they were generated, "
            "under the previous config"
        ),
    }
    assert set(outcomes) == set(ON_CONFIG_CHANGE)
    change = plan.config_change
    assert change is not None
    unresumable = [line for line in change.changes if line.split(":")[0] in UNRESUMABLE_CHANGES]
    if unresumable:
        for policy in ("drop_rollouts", "keep"):
            outcomes[policy] = (
                f"starts nothing either: {'; '.join(unresumable)} cannot be resumed under any "
                "policy"
            )
    return outcomes


# ---------------------------------------------------------------------------- rendering


def render_text(info: dict[str, Any]) -> str:
    lines = [f"checkpoint dir: {info['checkpoint_dir']}  (restore_mode {info['restore_mode']})"]
    lines.extend(f"note: {note}" for note in info["notes"])
    change = info.get("config_change")
    if info["outcome"] == "refused":
        lines.append(f"REFUSED: a restart would not start:\n  {info['refused']}")
    if info["outcome"] == "fresh":
        lines.append("resume: none (fresh start)")
    elif info["outcome"] != "refused" or change is not None:
        source = info["rollout_state"]
        lines.append(
            ("otherwise it would " if info["outcome"] == "refused" else "")
            + f"resume: after step {info['step']}, trainer_version {info['trainer_version']}; "
            f"model from {info['trainer_checkpoint'] or 'the initial model (bootstrap)'}; "
            f"rollout state from {source}"
        )
    if change is not None:
        lines.append("config changed since the rollout state was generated:")
        for source in change["sources"]:
            lines.extend(f"  {line}  (since {source['where']})" for line in source["changes"])
        lines.append(
            f"rollout_checkpointing.on_config_change={change['policy']}: a restart "
            f"{change['outcomes'][change['policy']]}"
        )
        for policy, outcome in change["outcomes"].items():
            if policy != change["policy"]:
                lines.append(f"  with on_config_change={policy} it {outcome}")
    if info["error"]:
        lines.append(f"ERROR: the chosen rollout state cannot be read:\n  {info['error']}")
    for folder, layout in info.get("models", {}).items():
        lines.append(_render_layout(folder, layout))
    resume = info["resume"]
    if resume is not None:
        loader = resume["dataloader"]
        lines.append(
            f"sampler {resume['sampler']}; consumed groups {resume['consumed_groups']}; "
            f"dataloader epoch {loader['epoch']} position {loader['position']}/"
            f"{loader['num_prompts']} (+{loader['requeued']} requeued)"
        )
        if resume["shadow"]:
            lines.append(
                f"shadow mode: no replay index; {resume['shadow_prompts']} buffered prompt(s) "
                "go back to the dataloader and are regenerated"
            )
        committed = resume["committed_groups"]
        lines.append(f"committed groups restorable: {len(committed)}")
        for group in committed:
            lines.append(
                f"  {group['group_id']:<14} rows {group['rows']:>3}  start_weight "
                f"{group['start_weight']}  end_weight {group['end_weight']}  target_step "
                f"{group['target_step']}"
            )
        unfinished = resume["unfinished_groups"]
        lines.append(f"unfinished groups to redispatch: {len(unfinished)}")
        for group in unfinished:
            staged = group["staged_siblings"]
            if not staged:
                policy = "nothing staged: every sibling is generated"
            elif group["granularity"] == "sibling":
                policy = f"reuses staged siblings {staged}, generates the others"
            else:
                policy = f"discards {len(staged)} staged sibling(s), regenerates every sibling"
            lines.append(f"  {group['group_id']:<14} {group['granularity']:<12} {policy}")
        lines.append(f"replacement reserve: {resume['replacement_reserve']} prompt(s)")
        for opened in resume["validation_open"]:
            lines.append(
                f"validation pass of version {opened['version']} re-opened: "
                f"{opened['pending_prompts']} prompt(s) to evaluate, "
                f"{opened['finished_prompts']} kept"
            )
    if info.get("best_checkpoint") is not None:
        lines.append(info["best_checkpoint"]["why"])
    commit_log = info.get("commit_log")
    if commit_log is not None:
        lines.append(
            f"commit log {commit_log['path']}: {commit_log['records']} record(s) in "
            f"{len(commit_log['segments'])} segment(s)"
        )
        if "note" in commit_log:
            lines.append(f"  {commit_log['note']}")
        else:
            lines.append(
                f"  replays {commit_log['replayed_records']} record(s) from LSN "
                f"{commit_log['replay_from_lsn']}: {len(commit_log['committed_groups'])} "
                f"committed group(s) restored, {len(commit_log['reopened_groups'])} unfinished "
                f"group(s) reopened, {len(commit_log['dropped_groups'])} dropped"
            )
            if commit_log["committed_groups"]:
                lines.append(f"  committed: {' '.join(commit_log['committed_groups'])}")
            if commit_log["reopened_groups"]:
                lines.append(f"  reopened: {' '.join(commit_log['reopened_groups'])}")
        for torn in commit_log["torn_tails_ignored"]:
            lines.append(f"  ignored a record cut off by a kill: {torn}")
    if info["candidates"]:
        lines.append("bundles considered:")
        for candidate in info["candidates"]:
            mark = "USE " if candidate["chosen"] else "skip"
            lines.append(
                f"  {mark} {candidate['kind']:<9} {candidate['path']}\n       {candidate['reason']}"
            )
    for leftover in info["ignored_temporaries"]:
        lines.append(f"ignored (temporary or interrupted, never selected): {leftover}")
    return "\n".join(lines)


def _render_layout(folder: str, layout: dict[str, Any]) -> str:
    if "error" in layout and "layout" not in layout:
        return f"{folder}/: ERROR {layout['error']}"
    steps = f"{layout['optimizer_steps']} optimizer step(s)"
    optimizer = "with" if layout.get("has_optimizer") else "without"
    if layout["layout"] != SHARDED_LAYOUT:
        return (
            f"{folder}/: one process's folder (safetensors), {steps}, {optimizer} optimizer state"
        )
    line = (
        f"{folder}/: sharded at {layout['data_parallel_size']} rank(s) (DCP in "
        f"{layout['dcp_dir']}: {len(layout['shard_files'])} shard file(s) "
        f"{' '.join(layout['shard_files'])}; RNG of rank(s) {layout['rng_ranks']}), {steps}, "
        f"{optimizer} optimizer state; restores at any policy.dtensor_cfg.data_parallel_size"
    )
    if layout.get("error"):
        line += f"\n  ERROR {layout['error']}"
    if layout.get("missing"):
        line += f"\n  MISSING (a restore refuses this folder): {' '.join(layout['missing'])}"
    return line


def inspect_command(
    path: str,
    config: str | None = None,
    overrides: list[str] | None = None,
    *,
    as_json: bool = False,
) -> int:
    """Print what a restart from ``path`` would resume; 0 resumable or fresh, 1 refused/error."""
    cfg = None
    if config is not None:
        from tandemrl.config import ConfigError, load_config

        try:
            cfg = load_config(config, list(overrides or []))
        except ConfigError as exc:
            print(f"{config}: invalid config", file=sys.stderr)
            for message in exc.messages:
                print(message, file=sys.stderr)
            return EXIT_INVALID
    elif overrides:
        print("tandemrl inspect: overrides need --config", file=sys.stderr)
        return EXIT_INVALID
    info = describe_checkpoint_dir(path, cfg)
    print(json.dumps(info, indent=2) if as_json else render_text(info))
    return EXIT_REFUSED if info["outcome"] in ("refused", "error") else EXIT_OK
