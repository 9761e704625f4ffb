"""Load the master config: files -> overrides -> interpolation -> NeMo-RL names -> keys -> types.

``read_config(path, overrides)`` runs every stage and keeps going past problems, so one
run reports all of them, each as one line that starts with the dotpath involved:

1. ``files.py``: the YAML file and the files it inherits from (``defaults:``). A file that
   cannot be read stops here.
2. ``overrides.py``: command-line overrides (``a.b=v``, ``+a.b=v``, ``++a.b=v``, ``~a.b``).
   A malformed override stops here.
3. ``interpolation.py``: ``${...}`` references and resolvers; a value that cannot be
   resolved is reported and left out.
4. ``nemo_rl.py``: keys written the NeMo-RL way are renamed, harmless ones (disabled
   blocks, nulls) dropped, and subtrees TandemRL cannot honour refused in one line each.
5. ``keys.py``: every remaining key must be one the models define.
6. pydantic checks types and ranges; each error becomes a dotpath line, and the offending
   value is left out so the rest can still be checked.

The result holds the config built from what passed (``config``), every problem, the
notices (renamed or ignored keys) and the dotpaths whose values were left out. Cross-field
rules are not checked here: ``check.py`` runs them on that config in the same pass.
``load_config`` is the strict form: it raises ``ConfigError`` on any problem.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tandemrl.config.errors import ConfigError
from tandemrl.config.files import read_config_tree
from tandemrl.config.interpolation import resolve_tree
from tandemrl.config.keys import check_keys
from tandemrl.config.models import SAMPLER_MODES, MasterConfig
from tandemrl.config.nemo_rl import Dropped, translate_nemo_rl
from tandemrl.config.overrides import apply_overrides

__all__ = [
    "LoadReport",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "read_config",
    "resolve_references",
]

# Rounds of "leave out the values pydantic refused, validate again" before giving up.
_PRUNE_ROUNDS = 4


@dataclass
class LoadReport:
    """What loading found: the config built from what passed, and every problem."""

    config: MasterConfig | None
    problems: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    # Dotpaths whose values were left out (unresolvable, refused, wrong type): a cross-field
    # rule that names one of them would be judging a default, not the user's value.
    broken_paths: list[str] = field(default_factory=list)
    # NeMo-RL keys that were not carried over, with the reason (``tandemrl port`` lists them).
    dropped: list[Dropped] = field(default_factory=list)


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> MasterConfig:
    """Read, override, interpolate and type-check a master config (cross-field rules excluded)."""
    report = read_config(path, overrides)
    if report.problems or report.config is None:
        raise ConfigError(report.problems)
    return report.config


def read_config(path: str | Path, overrides: Iterable[str] = ()) -> LoadReport:
    """Every stage on ``path``; file and override problems raise, the rest are collected."""
    tree = read_config_tree(path)
    apply_overrides(tree, overrides)
    return load_tree(tree)


def load_tree(tree: dict[str, Any]) -> LoadReport:
    """Stages 3-6 on an already merged and overridden tree."""
    resolved = resolve_tree(tree)
    report = from_resolved(resolved.tree)
    report.problems[:0] = resolved.problems
    report.broken_paths[:0] = resolved.broken_paths
    return report


def from_resolved(tree: dict[str, Any]) -> LoadReport:
    """Stages 4-6 on an interpolated tree."""
    translation = translate_nemo_rl(copy.deepcopy(tree))
    pruned, key_problems = check_keys(translation.tree, MasterConfig)
    config, type_problems, type_paths = _validate_best_effort(pruned)
    return LoadReport(
        config=config,
        problems=[*translation.refusals, *key_problems, *type_problems],
        notices=translation.notices,
        broken_paths=[*translation.refused_paths, *type_paths],
        dropped=translation.dropped,
    )


def resolve_references(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with every ``${...}`` resolved; raises ConfigError listing what cannot be."""
    resolved = resolve_tree(raw)
    if resolved.problems:
        raise ConfigError(resolved.problems)
    return resolved.tree


def config_from_dict(data: dict[str, Any]) -> MasterConfig:
    """Check keys and types of an already interpolated tree (raises on any problem)."""
    report = from_resolved(data)
    if report.problems or report.config is None:
        raise ConfigError(report.problems)
    return report.config


def config_to_dict(cfg: MasterConfig) -> dict[str, Any]:
    """Plain-data view of a config (YAML/JSON printable) that ``load_config`` reads back."""
    return escape_references(cfg.model_dump(mode="json", by_alias=True))


def escape_references(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: escape_references(value) for key, value in node.items()}
    if isinstance(node, list):
        return [escape_references(value) for value in node]
    if isinstance(node, str):
        return node.replace("${", "\\${")
    return node


# --------------------------------------------------------------------------- pydantic


def _validate_best_effort(
    tree: dict[str, Any],
) -> tuple[MasterConfig | None, list[str], list[str]]:
    """(config, one line per type error, dotpaths left out to build the config)."""
    problems: list[str] = []
    left_out: list[str] = []
    tree = copy.deepcopy(tree)
    for _ in range(_PRUNE_ROUNDS):
        try:
            return MasterConfig.model_validate(tree), problems, left_out
        except ValidationError as exc:
            errors = exc.errors()
            problems.extend(m for m in _validation_messages(errors) if m not in problems)
            removed = False
            for error in errors:
                keys = _loc_keys(error["loc"])
                if keys and _remove(tree, keys):
                    left_out.append(".".join(keys))
                    removed = True
            if not removed:
                break
    return None, problems, left_out


def _loc_keys(loc: tuple[Any, ...]) -> list[str]:
    """The mapping keys of a pydantic error location (list indexes and union tags dropped)."""
    keys: list[str] = []
    for index, item in enumerate(loc):
        if isinstance(item, int):
            break  # leave the whole list out, not one item
        if item in SAMPLER_MODES and index > 0 and loc[index - 1] == "sampler":
            continue
        keys.append(str(item))
    return keys


def _remove(tree: dict[str, Any], keys: list[str]) -> bool:
    node: Any = tree
    for key in keys[:-1]:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    if isinstance(node, dict) and keys[-1] in node:
        del node[keys[-1]]
        return True
    return False


def _validation_messages(errors: list[Any]) -> list[str]:
    messages = []
    for error in errors:
        path = _loc_to_path(error["loc"])
        kind = error["type"]
        if kind == "union_tag_not_found":
            messages.append(f"{_join(path, 'name')}: required; one of {', '.join(SAMPLER_MODES)}")
        elif kind == "union_tag_invalid":
            tag = error.get("ctx", {}).get("tag")
            messages.append(
                f"{_join(path, 'name')}: {tag!r} is not a sampler mode; use one of "
                f"{', '.join(SAMPLER_MODES)}"
            )
        elif kind == "extra_forbidden":
            messages.append(f"{path}: unknown key")
        else:
            shown = repr(error.get("input"))
            if len(shown) > 60:
                shown = shown[:57] + "..."
            messages.append(f"{path or '(top level)'}: {error['msg']} (got {shown})")
    return messages


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for index, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(f"{parts.pop() if parts else ''}[{item}]")
            continue
        # pydantic puts the discriminator tag of a union member into the location.
        if item in SAMPLER_MODES and index > 0 and loc[index - 1] == "sampler":
            continue
        parts.append(str(item))
    return ".".join(parts)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
