"""Questions about the config models' shape, answered from their type annotations.

Which model a field holds (unwrapping ``Optional``/``Annotated``/unions), which sampler
mode a mapping picks through its ``name``, and the keys a model accepts (aliases
included). Interpolation (for defaults) and the key check (for unknown keys) both ask.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel


def fields_by_key(model: type[BaseModel]) -> dict[str, Any]:
    """Field infos of ``model`` by every key a user may write (field name and alias)."""
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        fields[name] = info
        if info.alias:
            fields[info.alias] = info
    return fields


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The model classes an annotation may hold (unwrapping Optional, Annotated, unions)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in models_in(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def mode_of(model: type[BaseModel]) -> str | None:
    """The single ``name`` literal of a discriminated union member (a sampler mode)."""
    info = model.model_fields.get("name")
    if info is None or typing.get_origin(info.annotation) is not typing.Literal:
        return None
    args = typing.get_args(info.annotation)
    return args[0] if len(args) == 1 else None


def model_for(annotation: Any, value: Any) -> type[BaseModel] | None:
    """The model a field's ``value`` is validated as, or None (not a block, or unknown mode)."""
    candidates = models_in(annotation)
    if len(candidates) == 1:
        return candidates[0]
    if candidates and isinstance(value, dict):
        return {mode_of(candidate): candidate for candidate in candidates}.get(value.get("name"))
    return None
