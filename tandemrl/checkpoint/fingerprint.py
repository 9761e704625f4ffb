"""The rollout-compatibility fingerprint of a config: fail-closed, with dotpath diffs.

Every config value is part of the identity unless a denylist entry says it is *operational*
(cannot change prompts, generation, rewards, lineage or the meaning of persisted rollouts):
logging, cluster placement, checkpoint location and cadence, run-length bounds, runtime
knobs of the data-plane transport, and anything that looks like a credential. A key added by a
future block is therefore part of the identity by default: a change to it refuses bootstrap
recovery instead of silently mixing incompatible rollouts.

``rollout_checkpointing.extra_fingerprint_excluded_paths`` adds dotpath patterns: ``*`` matches
one mapping key or list index, ``**`` any number of levels. The identity stored in a manifest
has credential-like values redacted, so a refused restart can list each changed dotpath with
its old and new value without leaking secrets.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tandemrl.config.models import MasterConfig
from tandemrl.config.redact import REDACTED, redact_value

__all__ = [
    "BUILTIN_EXCLUDED_PATHS",
    "REDACTED",
    "compatibility_identity",
    "diff_identities",
    "fingerprint_digest",
    "is_excluded",
]

# Operational dotpaths: they do not affect what a rollout is or how it is interpreted.
BUILTIN_EXCLUDED_PATHS: tuple[str, ...] = (
    "logger.**",
    "cluster.**",
    "checkpointing.checkpoint_dir",
    "checkpointing.save_period",
    "checkpointing.keep_top_k",
    "checkpointing.save_optimizer",
    "checkpointing.preemption_grace_s",
    "rollout_checkpointing.**",
    "data_plane.call_timeout_s",
    "data_plane.num_storage_units",
    "data_plane.actor_resources",
    # A sharded step is the one-process step (tests/unit/test_sharded_training.py), and a
    # sharded checkpoint restores at any size: the layout may change across restarts.
    "policy.dtensor_cfg.data_parallel_size",
    "policy.dtensor_cfg.timeout_s",
    "async_rl.stall_watchdog.**",
    "grpo.max_num_steps",
    "ppo.max_num_steps",
    "policy.generation.num_workers",
    "policy.device",
    "policy.generation.colocated.mps",
    "env.python_path",  # where env.target is imported from, not what it computes
)


def _segments(pattern: str) -> list[str]:
    return pattern.split(".")


def _match(pattern: list[str], path: list[str]) -> bool:
    """Does ``pattern`` match ``path`` or a prefix of it (a match removes the whole subtree)?"""
    if not pattern:
        return True  # matched a prefix: the subtree below goes with it
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, path[i:]) for i in range(len(path) + 1))
    if not path:
        return False
    if head == "*" or head == path[0]:
        return _match(rest, path[1:])
    return False


def is_excluded(path: list[str], patterns: list[list[str]]) -> bool:
    return any(_match(pattern, path) for pattern in patterns)


def _flatten(value: Any, prefix: list[str], out: dict[str, Any], patterns: list[list[str]]) -> None:
    if is_excluded(prefix, patterns) and prefix:
        return
    if isinstance(value, dict):
        if not value and prefix:
            out[".".join(prefix)] = {}
        for key in sorted(value):
            _flatten(value[key], [*prefix, str(key)], out, patterns)
    elif isinstance(value, list | tuple):
        if not value and prefix:
            out[".".join(prefix)] = []
        for index, item in enumerate(value):
            _flatten(item, [*prefix, str(index)], out, patterns)
    else:
        out[".".join(prefix)] = value


def compatibility_identity(
    cfg: MasterConfig, extra_excluded: list[str] | None = None
) -> dict[str, Any]:
    """Flat {dotpath: value} of everything that defines rollout compatibility (redacted)."""
    extra = (
        extra_excluded
        if extra_excluded is not None
        else cfg.rollout_checkpointing.extra_fingerprint_excluded_paths
    )
    patterns = [_segments(p) for p in (*BUILTIN_EXCLUDED_PATHS, *extra)]
    flat: dict[str, Any] = {}
    _flatten(cfg.model_dump(mode="json", by_alias=True), [], flat, patterns)
    return {path: redact_value(path, value) for path, value in flat.items()}


def fingerprint_digest(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def diff_identities(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per changed dotpath: ``path: old -> new`` (``<absent>`` for added/removed)."""
    lines = []
    for path in sorted(set(old) | set(new)):
        before, after = old.get(path, "<absent>"), new.get(path, "<absent>")
        if before != after:
            lines.append(
                f"{path}: {json.dumps(before, default=str)} -> {json.dumps(after, default=str)}"
            )
    return lines
