"""Restore selection, the config fingerprint, damaged bundles, and ``tandemrl inspect``.

Bundles are real: a controller over fakes (``build_fake_controller``) runs a few steps with a
trainer checkpoint after every step, is stopped by a step hook, and writes rollout snapshots
anchored on its last trainer checkpoint. Every test works on its own copy of that directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tandemrl.checkpoint.fingerprint import (
    REDACTED,
    compatibility_identity,
    diff_identities,
    fingerprint_digest,
    is_excluded,
)
from tandemrl.checkpoint.inspect import describe_checkpoint_dir, inspect_command, render_text
from tandemrl.checkpoint.layout import (
    DATA_PLANE_DIR,
    DATALOADER,
    MANIFEST,
    REPLACEMENT_RESERVE,
    REPLAY_INDEX,
    ROLLOUT_RECOVERY,
    TRAIN_STATE,
    CheckpointCorrupt,
    bootstrap_dir,
    list_snapshot_dirs,
    list_step_dirs,
    snapshot_dir,
    write_manifest,
)
from tandemrl.checkpoint.restore import RestoreRefused, plan_restore
from tandemrl.cli import main
from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.dataplane.base import DataPlaneError
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.records import EnvResult, GenerationResult, PromptItem
from tandemrl.rollout.ledger import StagedSibling
from tandemrl.training.fake import FakeTrainer

NUM_PROMPTS = 24
STOP_AFTER_STEP = 3
GROUP_SIZE = 2
EXEMPLAR = "examples/configs/grpo_tiny_cpu_checkpointed.yaml"


def make_cfg(checkpoint_dir: Path, *overrides: str):
    return load_config(
        EXEMPLAR,
        (
            "grpo.num_prompts_per_step=4",
            f"grpo.num_generations_per_prompt={GROUP_SIZE}",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8",
            "grpo.max_num_steps=1000",
            "grpo.max_num_epochs=1",
            "async_rl.min_groups_for_streaming_train=2",
            "async_rl.max_buffered_rollouts=8",
            "async_rl.max_inflight_prompts=8",
            f"checkpointing.checkpoint_dir={checkpoint_dir}",
            "checkpointing.save_period=1",
            "checkpointing.keep_top_k=null",
            "rollout_checkpointing.snapshot_attempt_interval_s=1000",  # snapshots written by hand
            "rollout_checkpointing.keep_latest_k=3",
            "logger.progress=false",
            *overrides,
        ),
    )


class HoldingEngine(FakeGenerationBackend):
    """The instant fake engine until generation holds the weights of ``hold_from_version``;
    every request made from then on is held (never answered) until the run stops and cancels
    it. None: never holds."""

    def __init__(self, *, hold_from_version: int | None, seed: int) -> None:
        super().__init__(seed=seed)
        self.hold_from_version = hold_from_version
        self.held: set[str] = set()  # ids of the requests held now

    async def generate(self, requests):
        if self.hold_from_version is None or self._version < self.hold_from_version:
            return await super().generate(requests)
        request_ids = {request.request_id for request in requests}
        self.held |= request_ids
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self.held -= request_ids
        raise AssertionError("a held request was answered")


def settle_rollouts(engine: HoldingEngine):
    """A step hook: wait until the rollout pump is at rest, its buffer full (reserved plus
    ready groups) and each group in flight held by ``engine``, so that what a step leaves for
    the next is the same on every machine: the next step's groups committed, and from the
    holding version on, the groups dispatched after it unfinished, with no sibling staged."""

    async def settle(controller, row) -> None:
        def at_rest() -> bool:
            buffer = controller.buffer
            held_groups, rest = divmod(len(engine.held), GROUP_SIZE)
            return (
                len(buffer) == buffer.capacity
                and rest == 0
                and held_groups == controller.inflight_count
            )

        deadline = time.monotonic() + 60
        while not at_rest():
            assert time.monotonic() < deadline, (
                f"the rollouts never came to rest after step {controller.state.step}: buffer "
                f"{len(controller.buffer)}/{controller.buffer.capacity}, "
                f"{controller.inflight_count} group(s) in flight, {len(engine.held)} held request(s)"
            )
            await asyncio.sleep(0.001)

    return settle


def make_controller(
    cfg,
    *,
    seed: int = 0,
    stop_after_step: int | None = None,
    hold_from_version: int | None = None,
):
    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(NUM_PROMPTS)]
    engine = HoldingEngine(hold_from_version=hold_from_version, seed=seed)
    hooks = []
    if hold_from_version is not None:
        hooks.append(settle_rollouts(engine))
    if stop_after_step is not None:

        async def stop(controller, row) -> None:
            if controller.state.step >= stop_after_step:
                raise _Stop

        hooks.append(stop)
    return build_fake_controller(
        cfg,
        trainer=FakeTrainer(),
        engines=[engine],
        dataloader=PromptDataLoader(records, max_num_epochs=1, seed=3),
        step_hooks=hooks,
    )


class _Stop(Exception):
    """Raised by a step hook to end a run at a chosen step (the checkpoint is already on disk)."""


async def _produce(cfg) -> None:
    # Every step's hook waits until the rollouts are at rest; from version 3 on, generation
    # holds every request, so the groups dispatched after step 3 are in flight at the stop,
    # none with a finished sibling, however loaded the machine is.
    controller = make_controller(
        cfg, stop_after_step=STOP_AFTER_STEP, hold_from_version=STOP_AFTER_STEP
    )
    await controller.resume(plan_restore(cfg))
    # A non-empty replacement reserve, so its sidecar exists in every bundle.
    controller.run_state.replacement_reserve = [PromptItem("spare-0", 0, 0, "spare=", answer="1")]
    with pytest.raises(_Stop):
        await controller.run()
    # The run was cancelled after step 3's checkpoint; its in-flight groups (one step's worth,
    # all held) stay in the ledger. Stage one finished sibling of the first of them (as token
    # capture keeps it).
    unfinished = controller.rollout_manager.ledger.unfinished()
    assert len(unfinished) == 4 and not any(group.staged for group in unfinished)
    assert len(controller.buffer.ready_groups()) == 4  # step 4's groups, committed
    group = unfinished[0]
    prompt_ids = controller.rollout_manager.codec.encode(group.item.prompt)
    group.staged[0] = StagedSibling(
        result=GenerationResult(
            request_id=f"{group.group_id}/0/a1",
            prompt_token_ids=prompt_ids,
            token_ids=prompt_ids[:2],
            logprobs=[-0.5, -0.25],
            finish_reason="stop",
            token_weight_versions=[3, 3],
            start_weight_version=3,
        ),
        env_result=EnvResult(reward=1.0),
    )
    for _ in range(2):
        assert await controller.checkpointer.attempt_snapshot() is not None
    controller.journal.close()
    if controller.commit_log is not None:
        controller.commit_log.close()


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """step_1..step_3 (each with its rollout state) and two snapshots anchored on step_3."""
    root = tmp_path_factory.mktemp("golden") / "ckpt"
    asyncio.run(_produce(make_cfg(root)))
    assert [step for step, _ in list_step_dirs(root)] == [1, 2, 3]
    assert [seq for seq, _ in list_snapshot_dirs(root / "step_3")] == [1, 2]
    return root


@pytest.fixture
def ckpt(golden, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(golden, target)
    return target


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime (ns): proves nothing was touched."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            info = path.stat()
            state[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns)
    return state


def corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    assert data, f"{path} is empty"
    if how == "flip":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    else:
        path.write_bytes(data[: len(data) // 2])


def bundle_relpaths(bundle: Path) -> list[str]:
    return sorted(
        str(path.relative_to(bundle))
        for path in bundle.rglob("*")
        if path.is_file() and "rollout_snapshots" not in path.relative_to(bundle).parts
    )


async def _resume_fresh(cfg, seed: int = 1):
    controller = make_controller(cfg, seed=seed)
    plan = plan_restore(cfg)
    summary = await controller.resume(plan)
    controller.journal.close()
    if controller.commit_log is not None:
        controller.commit_log.close()
    return plan, controller, summary


# ---------------------------------------------------------------------------- fingerprint


def _identity(*overrides: str):
    return compatibility_identity(make_cfg(Path("/tmp/unused"), *overrides))


@pytest.mark.parametrize(
    "override",
    [
        "logger.log_dir=/elsewhere",
        "cluster.num_cpus=7",
        "checkpointing.checkpoint_dir=/other/place",
        "checkpointing.save_period=5",
        "grpo.max_num_steps=17",
        "rollout_checkpointing.keep_latest_k=9",
        "policy.generation.num_workers=2",
    ],
)
def test_operational_values_do_not_change_the_fingerprint(override):
    base, changed = _identity(), _identity(override)
    assert fingerprint_digest(base) == fingerprint_digest(changed)
    assert diff_identities(base, changed) == []


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("policy.optimizer.lr=0.001", "policy.optimizer.lr: 0.0003 -> 0.001"),
        ("grpo.num_generations_per_prompt=4", "grpo.num_generations_per_prompt: 2 -> 4"),
        ("policy.generation.max_new_tokens=8", "policy.generation.max_new_tokens: 4 -> 8"),
        ("token_capture.enabled=false", "token_capture.enabled: true -> false"),
        ("loss_fn.token_level_loss=false", "loss_fn.token_level_loss: true -> false"),
        ("env.kwargs.difficulty=3", 'env.kwargs.difficulty: "<absent>" -> 3'),
    ],
)
def test_rollout_semantic_values_change_the_fingerprint_with_a_dotpath_diff(override, line):
    base, changed = _identity(), _identity(override)
    assert fingerprint_digest(base) != fingerprint_digest(changed)
    # an empty mapping is part of the identity too: filling it shows as two lines
    assert line in diff_identities(base, changed)
    assert all(entry.split(":")[0] in line for entry in diff_identities(base, changed))


@pytest.mark.parametrize(
    ("pattern", "path", "excluded"),
    [
        ("policy.optimizer.lr", "policy.optimizer.lr", True),
        ("policy.optimizer", "policy.optimizer.betas.0", True),  # a prefix takes the subtree
        ("policy.*.lr", "policy.optimizer.lr", True),
        ("policy.*.lr", "policy.lr", False),  # * is exactly one level
        ("policy.*.lr", "policy.a.b.lr", False),
        ("policy.optimizer.betas.*", "policy.optimizer.betas.1", True),  # * matches list indices
        ("policy.**.lr", "policy.lr", True),  # ** is any number of levels, zero included
        ("policy.**.lr", "policy.a.b.c.lr", True),
        ("**.temperature", "policy.generation.temperature", True),
        ("**.temperature", "policy.generation.top_p", False),
        ("env.workers.*.log_dir", "env.workers.3.log_dir", True),
        ("env.workers.*.log_dir", "env.workers.3.endpoint", False),
    ],
)
def test_exclusion_patterns(pattern, path, excluded):
    assert is_excluded(path.split("."), [pattern.split(".")]) is excluded


def test_extra_excluded_paths_remove_values_and_their_children():
    extra = "rollout_checkpointing.extra_fingerprint_excluded_paths=[policy.generation.temperature, 'policy.optimizer.betas.*', 'env.**.endpoint']"
    base = _identity(extra, "env.kwargs.agent.endpoint=http://a")
    changed = _identity(
        extra,
        "env.kwargs.agent.endpoint=http://b",
        "policy.generation.temperature=0.5",
        "policy.optimizer.betas=[0.8, 0.9]",
    )
    assert "policy.generation.temperature" not in base
    assert not any(key.startswith("policy.optimizer.betas") for key in base)
    assert fingerprint_digest(base) == fingerprint_digest(changed)
    # without the exclusions the same changes are refused
    assert len(diff_identities(_identity(), _identity("policy.generation.temperature=0.5"))) == 1


def test_credentials_are_redacted_but_rollout_semantics_named_like_them_are_not():
    identity = _identity(
        "env.kwargs.hf_token=hf_abc", "env.kwargs.credentials={user: u, password: p}"
    )
    assert identity["env.kwargs.hf_token"] == REDACTED
    assert identity["env.kwargs.credentials.user"] == REDACTED
    assert identity["env.kwargs.credentials.password"] == REDACTED
    assert "hf_abc" not in json.dumps(identity)
    for key in ("policy.generation.max_new_tokens", "token_capture.enabled", "data.prompt_key"):
        assert identity[key] != REDACTED, key
    # a secret rotated between attempts does not block recovery
    rotated = _identity(
        "env.kwargs.hf_token=hf_xyz", "env.kwargs.credentials={user: u, password: q}"
    )
    assert fingerprint_digest(identity) == fingerprint_digest(rotated)


# ---------------------------------------------------------------------------- plan_restore


def test_latest_uses_the_newest_snapshot_and_trainer_checkpoint_mode_ignores_it(ckpt):
    latest = plan_restore(make_cfg(ckpt))
    assert latest.trainer_dir == ckpt / "step_3"
    assert latest.rollout_dir == snapshot_dir(ckpt / "step_3", 2)
    assert latest.step == 3
    reasons = {candidate.path.name: candidate.reason for candidate in latest.considered}
    assert reasons["snapshot_000001"] == "older than the chosen snapshot"
    assert reasons["step_2"] == "older than the chosen checkpoint"

    trainer_only = plan_restore(
        make_cfg(ckpt, "rollout_checkpointing.restore_mode=trainer_checkpoint")
    )
    assert trainer_only.trainer_dir == trainer_only.rollout_dir == ckpt / "step_3"
    assert trainer_only.step == 3


def test_both_modes_restore_a_whole_consistent_state(ckpt):
    for mode in ("latest", "trainer_checkpoint"):
        cfg = make_cfg(ckpt, f"rollout_checkpointing.restore_mode={mode}")
        _, controller, summary = asyncio.run(_resume_fresh(cfg))
        assert controller.state.step == 3 and controller.trainer_version == 3
        assert summary["committed_groups"] == len(controller.buffer.ready_groups())
        assert controller.trainer.weights_version == 3
        assert [item.prompt_id for item in controller.run_state.replacement_reserve] == ["spare-0"]


def test_selection_never_modifies_the_directory(ckpt):
    before = tree_state(ckpt)
    for mode in ("latest", "trainer_checkpoint"):
        plan_restore(make_cfg(ckpt, f"rollout_checkpointing.restore_mode={mode}"))
        describe_checkpoint_dir(ckpt)
    assert tree_state(ckpt) == before


def _bootstrap_only(tmp_path: Path, *overrides: str) -> Path:
    """A directory holding bootstrap state only: a snapshot written before the first step."""
    root = tmp_path / "boot"
    cfg = make_cfg(root, *overrides)

    async def produce() -> None:
        controller = make_controller(cfg)
        await controller.resume(plan_restore(cfg))
        for _ in range(3):  # some groups commit, none trains (no run, so no step)
            controller.rollout_manager.reserve(
                controller.dataloader.next_item(), start_weight=0, target_step=0
            )
        assert await controller.checkpointer.attempt_snapshot() is not None
        controller.journal.close()
        if controller.commit_log is not None:
            controller.commit_log.close()

    asyncio.run(produce())
    assert (bootstrap_dir(root) / MANIFEST).is_file()
    assert list_snapshot_dirs(bootstrap_dir(root))
    return root


def test_trainer_checkpoint_mode_refuses_bootstrap_only_state_and_modifies_nothing(tmp_path):
    root = _bootstrap_only(tmp_path)
    before = tree_state(root)
    cfg = make_cfg(root, "rollout_checkpointing.restore_mode=trainer_checkpoint")
    with pytest.raises(RestoreRefused, match="bootstrap") as info:
        plan_restore(cfg)
    assert "restore_mode=latest" in str(info.value)
    assert tree_state(root) == before
    # latest recovers it: the three prompts come back as unfinished groups
    plan, _, summary = asyncio.run(_resume_fresh(make_cfg(root)))
    assert plan.trainer_dir is None and plan.rollout_dir is not None
    assert summary["committed_groups"] == 0 and summary["unfinished_groups"] == 3
    assert summary["commit_log"]["records"] == 0  # the snapshot was the last thing logged


def test_bootstrap_with_a_changed_config_is_refused_listing_the_dotpaths(tmp_path):
    root = _bootstrap_only(tmp_path)
    before = tree_state(root)
    cfg = make_cfg(root, "policy.optimizer.lr=0.001", "grpo.num_generations_per_prompt=4")
    with pytest.raises(RestoreRefused) as info:
        plan_restore(cfg)
    message = str(info.value)
    assert "policy.optimizer.lr: 0.0003 -> 0.001" in message
    assert "grpo.num_generations_per_prompt: 2 -> 4" in message
    assert tree_state(root) == before
    # an operational change is fine
    assert plan_restore(make_cfg(root, "logger.log_dir=/somewhere/else")).rollout_dir is not None


def test_incompatible_snapshot_is_skipped_for_the_trainer_checkpoint(ckpt):
    # keep: the trainer checkpoint's own rollout state (written under the old config too) is
    # what the restart resumes; the snapshots of the old config are skipped
    cfg = make_cfg(ckpt, "policy.optimizer.lr=0.001", "rollout_checkpointing.on_config_change=keep")
    plan = plan_restore(cfg)
    assert plan.trainer_dir == plan.rollout_dir == ckpt / "step_3"
    skipped = [c for c in plan.considered if c.kind == "snapshot"]
    assert len(skipped) == 2 and not any(c.chosen for c in skipped)
    assert all("policy.optimizer.lr: 0.0003 -> 0.001" in c.reason for c in skipped)
    assert plan.config_change is not None and plan.config_change.policy == "keep"
    assert plan.config_change.changes == ["policy.optimizer.lr: 0.0003 -> 0.001"]


def test_temporary_and_unfinished_bundles_are_never_selected_nor_deleted(ckpt):
    # an interrupted trainer checkpoint and snapshot (atomic_directory's tmp names) ...
    shutil.copytree(
        ckpt / "step_3",
        ckpt / ".step_4.tmp-0123456789ab",
        ignore=shutil.ignore_patterns("rollout_snapshots"),
    )
    shutil.copytree(
        snapshot_dir(ckpt / "step_3", 2),
        ckpt / "step_3" / "rollout_snapshots" / ".snapshot_000003.tmp-abcdef012345",
    )
    # ... a published-looking snapshot and step without a manifest
    unfinished = snapshot_dir(ckpt / "step_3", 4)
    shutil.copytree(snapshot_dir(ckpt / "step_3", 2), unfinished)
    (unfinished / MANIFEST).unlink()
    shutil.copytree(
        ckpt / "step_2", ckpt / "step_5", ignore=shutil.ignore_patterns("rollout_snapshots")
    )
    (ckpt / "step_5" / MANIFEST).unlink()
    before = tree_state(ckpt)

    plan = plan_restore(make_cfg(ckpt))
    assert plan.trainer_dir == ckpt / "step_3"
    assert plan.rollout_dir == snapshot_dir(ckpt / "step_3", 2)
    reasons = {c.path.name: c.reason for c in plan.considered}
    assert "missing manifest" in reasons["step_5"]
    assert "missing manifest" in reasons["snapshot_000004"]
    assert not any(".tmp-" in str(c.path) for c in plan.considered)
    info = describe_checkpoint_dir(ckpt)
    assert len(info["ignored_temporaries"]) == 2
    assert tree_state(ckpt) == before


# ---------------------------------------------------------------------------- damaged bundles

SIDECARS = [TRAIN_STATE, DATALOADER, REPLAY_INDEX, ROLLOUT_RECOVERY, REPLACEMENT_RESERVE]


def test_golden_bundles_hold_every_sidecar(golden):
    for bundle in (golden / "step_3", snapshot_dir(golden / "step_3", 2)):
        files = bundle_relpaths(bundle)
        for name in [*SIDECARS, MANIFEST, f"{DATA_PLANE_DIR}/{MANIFEST}"]:
            assert name in files, (bundle, name)
        assert any(f.startswith(f"{DATA_PLANE_DIR}/rows") for f in files)
    assert any(f.startswith("policy/") for f in bundle_relpaths(golden / "step_3"))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_snapshot_falls_back_to_the_previous_one(golden, tmp_path, how):
    newest = snapshot_dir(golden / "step_3", 2)
    for relative in bundle_relpaths(newest):
        ckpt = tmp_path / f"{how}-{relative.replace('/', '_')}"
        shutil.copytree(golden, ckpt)
        corrupt(snapshot_dir(ckpt / "step_3", 2) / relative, how)
        plan = plan_restore(make_cfg(ckpt))
        assert plan.rollout_dir == snapshot_dir(ckpt / "step_3", 1), relative
        (skipped,) = [c for c in plan.considered if c.path.name == "snapshot_000002"]
        assert skipped.reason.startswith("corrupt") and Path(relative).name in skipped.reason
        # the fallback restores whole
        _, controller, _ = asyncio.run(_resume_fresh(make_cfg(ckpt)))
        assert controller.state.step == 3
        shutil.rmtree(ckpt)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_trainer_checkpoint_falls_back_to_the_previous_step(golden, tmp_path, how):
    newest = golden / "step_3"
    for relative in bundle_relpaths(newest):
        ckpt = tmp_path / f"{how}-{relative.replace('/', '_')}"
        shutil.copytree(golden, ckpt)
        corrupt(ckpt / "step_3" / relative, how)
        plan = plan_restore(make_cfg(ckpt))
        assert plan.trainer_dir == plan.rollout_dir == ckpt / "step_2", relative
        (skipped,) = [c for c in plan.considered if c.path.name == "step_3"]
        assert skipped.reason.startswith("corrupt") and Path(relative).name in skipped.reason
        _, controller, _ = asyncio.run(_resume_fresh(make_cfg(ckpt)))
        assert controller.state.step == 2 and controller.trainer.weights_version == 2
        shutil.rmtree(ckpt)


def test_a_damaged_snapshot_with_no_older_one_falls_back_to_the_trainer_checkpoint(ckpt):
    shutil.rmtree(snapshot_dir(ckpt / "step_3", 1))
    corrupt(snapshot_dir(ckpt / "step_3", 2) / REPLAY_INDEX, "flip")
    plan = plan_restore(make_cfg(ckpt))
    assert plan.rollout_dir == plan.trainer_dir == ckpt / "step_3"


def test_when_no_trainer_checkpoint_verifies_the_restart_refuses(ckpt):
    for step in (1, 2):
        shutil.rmtree(ckpt / f"step_{step}")
    corrupt(ckpt / "step_3" / DATALOADER, "truncate")
    before = tree_state(ckpt)
    with pytest.raises(RestoreRefused, match=DATALOADER) as info:
        plan_restore(make_cfg(ckpt))
    assert "Nothing was modified" in str(info.value)
    assert tree_state(ckpt) == before
    assert describe_checkpoint_dir(ckpt)["outcome"] == "refused"


def _rewrite_with_valid_digests(bundle: Path, relative: str, data: bytes) -> None:
    """Replace a file *and* re-digest the manifest: damage the checksums cannot see."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    (bundle / relative).write_bytes(data)
    payload = {k: v for k, v in manifest.items() if k not in ("files", "format")}
    write_manifest(bundle, payload)


@pytest.mark.parametrize(
    "relative",
    [
        TRAIN_STATE,
        DATALOADER,
        REPLAY_INDEX,
        ROLLOUT_RECOVERY,
        REPLACEMENT_RESERVE,
        "data_plane/manifest.json",
    ],
)
def test_content_damage_behind_valid_digests_is_a_clear_error_naming_the_file(ckpt, relative):
    bundle = snapshot_dir(ckpt / "step_3", 2)
    original = (bundle / relative).read_bytes()
    _rewrite_with_valid_digests(bundle, relative, original[: len(original) // 3])
    plan = plan_restore(make_cfg(ckpt))
    assert plan.rollout_dir == bundle  # the digests match: the planner cannot tell
    with pytest.raises((CheckpointCorrupt, DataPlaneError), match=Path(relative).name):
        asyncio.run(_resume_fresh(make_cfg(ckpt)))
    info = describe_checkpoint_dir(ckpt)
    if relative.startswith(DATA_PLANE_DIR):
        assert info["outcome"] == "resume"  # inspect does not load rows
    else:
        assert info["outcome"] == "error" and Path(relative).name in info["error"]


def test_rows_that_disagree_with_the_replay_index_are_refused(ckpt):
    """Step 2's rows under step 3's snapshot, re-digested: the replay index catches it."""
    newer = snapshot_dir(ckpt / "step_3", 2)
    shutil.rmtree(newer / DATA_PLANE_DIR)
    shutil.copytree(ckpt / "step_2" / DATA_PLANE_DIR, newer / DATA_PLANE_DIR)
    payload = json.loads((newer / MANIFEST).read_text())
    write_manifest(newer, {k: v for k, v in payload.items() if k not in ("files", "format")})
    assert plan_restore(make_cfg(ckpt)).rollout_dir == newer
    with pytest.raises(CheckpointCorrupt, match="refusing a partial restore"):
        asyncio.run(_resume_fresh(make_cfg(ckpt)))


# ---------------------------------------------------------------------------- inspect


def test_describe_reports_what_a_restart_resumes(ckpt):
    info = describe_checkpoint_dir(ckpt)
    assert info["outcome"] == "resume" and info["restore_mode"] == "latest"
    assert not info["fingerprint_checked"] and "not checked" in info["notes"][0]
    assert info["step"] == info["trainer_version"] == 3
    assert info["rollout_state"] == str(snapshot_dir(ckpt / "step_3", 2))
    _, controller, _ = asyncio.run(_resume_fresh(make_cfg(ckpt)))
    resume_info = info["resume"]
    assert [g["group_id"] for g in resume_info["committed_groups"]] == [
        slot.group_id for slot in controller.buffer.ready_groups()
    ]
    recovered = {group.group_id: group for group in controller.run_state.recovered_groups}
    assert {g["group_id"] for g in resume_info["unfinished_groups"]} == set(recovered)
    for group in resume_info["unfinished_groups"]:
        assert group["granularity"] == "sibling"
        assert group["staged_siblings"] == sorted(recovered[group["group_id"]].staged)
    assert resume_info["unfinished_groups"][0]["staged_siblings"] == [0]
    assert "reuses staged siblings [0]" in render_text(info)
    assert resume_info["replacement_reserve"] == 1
    json.dumps(info)  # JSON-able


def test_describe_with_a_config_names_the_changed_dotpaths_of_skipped_snapshots(ckpt):
    info = describe_checkpoint_dir(ckpt, make_cfg(ckpt, "policy.optimizer.lr=0.001"))
    assert info["fingerprint_checked"]
    assert info["rollout_state"] == str(ckpt / "step_3")
    assert info["outcome"] == "refused"  # on_config_change: refuse, the default
    skipped = [c for c in info["candidates"] if c["kind"] == "snapshot"]
    assert all("policy.optimizer.lr: 0.0003 -> 0.001" in c["reason"] for c in skipped)


def test_describe_a_bootstrap_directory_and_its_refusal_in_trainer_checkpoint_mode(tmp_path):
    root = _bootstrap_only(tmp_path, "rollout_recovery.default_granularity=prompt_group")
    info = describe_checkpoint_dir(root)
    assert info["outcome"] == "resume" and info["trainer_checkpoint"] is None
    assert {g["granularity"] for g in info["resume"]["unfinished_groups"]} == {"prompt_group"}
    refused = describe_checkpoint_dir(
        root, make_cfg(root, "rollout_checkpointing.restore_mode=trainer_checkpoint")
    )
    assert refused["outcome"] == "refused" and "bootstrap" in refused["refused"]


def test_inspect_cli_text_and_json(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "resume: after step 3" in text and "snapshot_000002" in text
    assert "committed groups restorable" in text and "not checked" in text

    cfg_args = ["--config", EXEMPLAR, f"checkpointing.checkpoint_dir={ckpt}"]
    # the exemplar differs from the config the bundles were written under: a restart with it
    # is refused (on_config_change: refuse), naming every changed dotpath
    assert main(["inspect", str(ckpt), "--json", *cfg_args, "grpo.num_prompts_per_step=4"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint_checked"] and info["outcome"] == "refused"
    changes = info["config_change"]["sources"][0]["changes"]
    assert "grpo.num_generations_per_prompt: 2 -> 8" in changes, changes

    corrupt(ckpt / "step_3" / "policy" / "fake_trainer.json", "flip")
    for step in (1, 2):
        shutil.rmtree(ckpt / f"step_{step}")
    assert inspect_command(str(ckpt)) == 1
    assert "REFUSED" in capsys.readouterr().out


def test_inspect_cli_refuses_overrides_without_a_config(capsys):
    with pytest.raises(SystemExit) as info:
        main(["inspect", "somewhere", "a.b=1"])
    assert info.value.code == 2


def test_writer_digests_nested_manifests(ckpt):
    """The data plane's own manifest is covered by the bundle's (a damaged one is seen)."""
    manifest = json.loads((ckpt / "step_3" / MANIFEST).read_text())
    assert f"{DATA_PLANE_DIR}/{MANIFEST}" in manifest["files"]


def test_a_later_write_sweeps_the_folders_of_interrupted_writes(ckpt):
    stale_step = ckpt / ".step_4.tmp-0123456789ab"
    stale_snapshot = ckpt / "step_3" / "rollout_snapshots" / ".snapshot_000003.tmp-0123456789ab"
    for stale in (stale_step, stale_snapshot):
        stale.mkdir()
        (stale / TRAIN_STATE).write_text("{partial")
    cfg = make_cfg(ckpt)

    async def run_one_more_step() -> None:
        controller = make_controller(cfg, stop_after_step=4)
        await controller.resume(plan_restore(cfg))
        written = await controller.checkpointer.attempt_snapshot()
        assert written == snapshot_dir(ckpt / "step_3", 3)
        assert not stale_snapshot.exists() and stale_step.exists()
        with pytest.raises(_Stop):
            await controller.run()
        controller.journal.close()
        if controller.commit_log is not None:
            controller.commit_log.close()

    asyncio.run(run_one_more_step())
    assert not stale_step.exists()
    assert (ckpt / "step_4" / MANIFEST).is_file()


def test_inspect_an_empty_directory_and_an_invalid_config(tmp_path, capsys):
    info = describe_checkpoint_dir(tmp_path / "nothing-here")
    assert info["outcome"] == "fresh" and not info["exists"] and info["candidates"] == []
    assert inspect_command(str(tmp_path / "nothing-here")) == 0
    assert "fresh start" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path), "--config", EXEMPLAR, "grpo.no_such_key=1"]) == 2
    assert "grpo.no_such_key" in capsys.readouterr().err
