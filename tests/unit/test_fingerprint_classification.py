"""Every config key is classified for restarts: operational or rollout-semantic, exactly one.

The walk covers the whole schema of ``MasterConfig``: nested blocks, every mode of a
discriminated union (the sampler), optional blocks (``ppo``, ``value``), and blocks inside
lists or mappings (a list item is walked as index ``0``, a mapping entry as ``<name>``, which
``*`` and ``**`` patterns match). A key added to the models without a decision fails here with
the line to add; so does a decision that no longer names a key.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel

from tandemrl.checkpoint.fingerprint import (
    BUILTIN_EXCLUDED_PATHS,
    ROLLOUT_SEMANTIC_PATHS,
    is_excluded,
)
from tandemrl.config.models import MasterConfig
from tandemrl.config.schema import models_in

WHERE = "tandemrl/checkpoint/fingerprint.py"
HOW = (
    f"Add each to exactly one list in {WHERE}: BUILTIN_EXCLUDED_PATHS if a change cannot "
    "alter prompts, generation, rewards, lineage or the meaning of a saved rollout (logging, "
    "placement, timeouts, performance knobs: a restart then resumes silently), otherwise "
    "ROLLOUT_SEMANTIC_PATHS (a restart then follows rollout_checkpointing.on_config_change). "
    "A whole new block can be one entry ('my_block.**'). Unsure: ROLLOUT_SEMANTIC_PATHS."
)


def _item_models(annotation: Any) -> tuple[str, list[type[BaseModel]]] | None:
    """(segment, models) when ``annotation`` is a list/tuple/dict holding config blocks."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _item_models(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _item_models(arg)
            if found is not None:
                return found
        return None
    if origin in (list, tuple, set, frozenset):
        models = [m for arg in typing.get_args(annotation) for m in models_in(arg)]
        return ("0", models) if models else None
    if origin is dict:
        args = typing.get_args(annotation)
        models = models_in(args[1]) if len(args) == 2 else []
        return ("<name>", models) if models else None
    return None


def schema_keys(model: type[BaseModel] = MasterConfig, prefix: tuple[str, ...] = ()) -> set[str]:
    """Dotpaths of every leaf key of ``model`` (aliases as a user writes them)."""
    keys: set[str] = set()
    for name, info in model.model_fields.items():
        path = (*prefix, info.alias or name)
        blocks = models_in(info.annotation)
        items = _item_models(info.annotation)
        if blocks:
            for block in blocks:
                keys |= schema_keys(block, path)
        elif items is not None:
            segment, item_blocks = items
            for block in item_blocks:
                keys |= schema_keys(block, (*path, segment))
        else:
            keys.add(".".join(path))
    return keys


def _matching(patterns: tuple[str, ...], key: str) -> list[str]:
    return [p for p in patterns if is_excluded(key.split("."), [p.split(".")])]


def test_every_config_key_is_operational_or_rollout_semantic_and_not_both():
    keys = schema_keys()
    assert len(keys) > 100, sorted(keys)  # the walk reached the nested blocks
    unclassified, both = [], []
    for key in sorted(keys):
        operational = _matching(BUILTIN_EXCLUDED_PATHS, key)
        semantic = _matching(ROLLOUT_SEMANTIC_PATHS, key)
        if not operational and not semantic:
            unclassified.append(key)
        elif operational and semantic:
            both.append(
                f"{key} (BUILTIN_EXCLUDED_PATHS {operational}, ROLLOUT_SEMANTIC_PATHS {semantic})"
            )
    assert not unclassified, (
        f"config key(s) not classified for restarts: {', '.join(unclassified)}. {HOW}"
    )
    assert not both, (
        f"config key(s) classified both ways in {WHERE}: {'; '.join(both)}. Keep each in one "
        "list (make the broader pattern narrower)."
    )


def test_every_classification_entry_names_a_config_key():
    keys = [key.split(".") for key in schema_keys()]
    for name, patterns in (
        ("BUILTIN_EXCLUDED_PATHS", BUILTIN_EXCLUDED_PATHS),
        ("ROLLOUT_SEMANTIC_PATHS", ROLLOUT_SEMANTIC_PATHS),
    ):
        stale = [p for p in patterns if not any(is_excluded(key, [p.split(".")]) for key in keys)]
        assert not stale, (
            f"{name} in {WHERE} lists {stale}, which match(es) no config key any more "
            "(renamed or removed?): update or delete the entry"
        )
        duplicates = sorted({p for p in patterns if patterns.count(p) > 1})
        assert not duplicates, f"{name} in {WHERE} lists {duplicates} twice"


def test_the_walk_sees_blocks_inside_lists_and_mappings():
    class Teacher(BaseModel):
        model_name: str = "t"

    class Block(BaseModel):
        teachers: list[Teacher] = []
        by_name: dict[str, Teacher] = {}
        plain: dict[str, int] = {}

    assert schema_keys(Block, ("x",)) == {
        "x.teachers.0.model_name",
        "x.by_name.<name>.model_name",
        "x.plain",
    }
    # a pattern with * covers a list index or a mapping key
    assert _matching(("x.teachers.*.model_name",), "x.teachers.0.model_name")
    assert _matching(("x.by_name.**",), "x.by_name.<name>.model_name")
