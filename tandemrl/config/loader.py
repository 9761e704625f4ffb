"""Load the master config: YAML file -> overrides -> interpolation -> key check -> pydantic.

``load_config(path, overrides)`` goes through four stages, each reporting every problem it
finds as one ``ConfigError`` line that starts with the dotpath involved:

1. Overrides ``a.b.c=value`` are parsed as YAML scalars and written into the raw tree,
   creating missing mappings. They come first, so a ``${a.b.c}`` elsewhere follows them.
2. ``${dotted.path}`` references are resolved. A value that is exactly one reference takes
   the referenced value with its type; references inside a longer string are substituted as
   text. A path the file does not spell out resolves to the model's default when its block
   exists by default. ``$${`` writes a literal ``${``. Cycles and missing paths are errors.
3. Every key is checked against the models: an unknown key gets the closest valid key as a
   suggestion; a sampler knob of another sampler mode gets a message saying which modes it
   belongs to.
4. pydantic validates types and ranges; its errors are rewritten with dotpaths.

Cross-field rules are not checked here: see ``validate.py``.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tandemrl.config.models import SAMPLER_MODES, MasterConfig
from tandemrl.config.validate import ConfigError

_WHOLE_REFERENCE = re.compile(r"\$\{([^${}]*)\}")
_EMBEDDED_REFERENCE = re.compile(r"(?<!\$)\$\{([^${}]*)\}")
_ESCAPED_OPEN = "$${"
_MISSING = object()


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> MasterConfig:
    """Read, override, interpolate and type-check a master config (cross-field rules excluded)."""
    raw = _read_yaml(Path(path))
    apply_overrides(raw, overrides)
    resolved = resolve_references(raw)
    return config_from_dict(resolved)


def config_from_dict(data: dict[str, Any]) -> MasterConfig:
    """Check keys and types of an already interpolated tree."""
    problems: list[str] = []
    _check_model_keys(data, MasterConfig, "", problems)
    try:
        cfg = MasterConfig.model_validate(data)
    except ValidationError as exc:
        # Unknown keys were already reported, with suggestions, by the key check.
        reported = {message.split(": ", 1)[0] for message in problems}
        problems.extend(
            message
            for message in _validation_messages(exc)
            if message.split(": ", 1)[0] not in reported
        )
        raise ConfigError(problems) from None
    if problems:
        raise ConfigError(problems)
    return cfg


def config_to_dict(cfg: MasterConfig) -> dict[str, Any]:
    """Plain-data view of a config (YAML/JSON printable) that ``load_config`` reads back."""
    return _escape_references(cfg.model_dump(mode="json", by_alias=True))


# --------------------------------------------------------------------------- stage 0: file


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------- stage 1: overrides


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> None:
    """Write each ``a.b.c=value`` into ``raw`` in place; all malformed ones are reported."""
    problems: list[str] = []
    for override in overrides:
        key, sep, value_text = override.partition("=")
        key = key.strip()
        segments = key.split(".")
        if not sep or not key or any(not segment for segment in segments):
            problems.append(f"{override!r}: an override must look like a.b.c=value")
            continue
        try:
            value = yaml.safe_load(value_text)
        except yaml.YAMLError as exc:
            problems.append(f"{key}: override value {value_text!r} is not valid YAML ({exc})")
            continue
        problem = _set_path(raw, segments, value)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(problems)


def _set_path(raw: dict[str, Any], segments: list[str], value: Any) -> str:
    node: Any = raw
    for depth, segment in enumerate(segments[:-1]):
        child = _get_child(node, segment)
        if child is _MISSING or child is None:
            if not isinstance(node, dict):
                return f"{'.'.join(segments)}: cannot create key {segment!r} inside a list"
            child = {}
            node[segment] = child
        elif not isinstance(child, (dict, list)):
            where = ".".join(segments[: depth + 1])
            return (
                f"{'.'.join(segments)}: {where} holds {child!r}, not a mapping; cannot set a "
                "key below it"
            )
        node = child
    last = segments[-1]
    if isinstance(node, list):
        if not (last.isdigit() and int(last) < len(node)):
            return f"{'.'.join(segments)}: list index {last!r} out of range"
        node[int(last)] = value
    else:
        node[last] = value
    return ""


def _get_child(node: Any, segment: str) -> Any:
    if isinstance(node, dict):
        return node.get(segment, _MISSING)
    if isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
        return node[int(segment)]
    return _MISSING


# --------------------------------------------------------------------------- stage 2: references


def resolve_references(raw: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``raw`` with every ``${dotted.path}`` resolved."""
    resolver = _Resolver(raw)
    resolved = resolver.resolve(raw, "")
    if resolver.problems:
        raise ConfigError(resolver.problems)
    return resolved


class _Resolver:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.problems: list[str] = []
        # Dotpaths whose values are being resolved, innermost last; a repeat is a cycle.
        self.stack: list[str] = []

    def resolve(self, node: Any, path: str) -> Any:
        if path in self.stack:
            cycle = [*self.stack[self.stack.index(path) :], path]
            self._problem(f"{cycle[0]}: reference cycle {' -> '.join(cycle)}")
            return None
        self.stack.append(path)
        try:
            if isinstance(node, dict):
                return {key: self.resolve(value, _join(path, key)) for key, value in node.items()}
            if isinstance(node, list):
                return [self.resolve(value, f"{path}.{i}") for i, value in enumerate(node)]
            if isinstance(node, str):
                return self._resolve_string(node, path)
            return node
        finally:
            self.stack.pop()

    def _resolve_string(self, text: str, path: str) -> Any:
        whole = _WHOLE_REFERENCE.fullmatch(text)
        if whole:
            return copy.deepcopy(self._lookup(whole.group(1), path))

        def substitute(match: re.Match[str]) -> str:
            value = self._lookup(match.group(1), path)
            if isinstance(value, (dict, list)):
                self._problem(
                    f"{path}: ${{{match.group(1)}}} is a {type(value).__name__} and cannot be "
                    "embedded in a string; reference it as the whole value instead"
                )
                return ""
            return "null" if value is None else str(value)

        return _EMBEDDED_REFERENCE.sub(substitute, text).replace(_ESCAPED_OPEN, "${")

    def _lookup(self, reference: str, from_path: str) -> Any:
        reference = reference.strip()
        segments = reference.split(".")
        if not reference or any(not segment for segment in segments):
            self._problem(f"{from_path}: ${{{reference}}} is not a valid dotted path")
            return None
        value, found_path, missing_at, siblings = _find(self.root, segments, self.resolve)
        if value is _MISSING:
            close = difflib.get_close_matches(missing_at, siblings, n=1, cutoff=0.6)
            suggestion = f"; did you mean {_join(found_path, close[0])}?" if close else ""
            if found_path and not siblings:
                reason = f"{found_path} is not set or not a mapping"
            else:
                reason = f"no {missing_at!r} under {found_path or 'the top level'}"
            self._problem(
                f"{from_path}: ${{{reference}}} refers to {reference}, which does not exist "
                f"({reason}){suggestion}"
            )
            return None
        return self.resolve(value, reference)

    def _problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)


def _find(
    root: dict[str, Any], segments: list[str], resolve: Callable[[Any, str], Any]
) -> tuple[Any, str, str, list[str]]:
    """Walk ``segments`` through the raw tree, falling back to model defaults.

    A string met on the way is resolved first (``resolve``), so a path may pass through a
    value that is itself a reference. Returns (value, deepest path found, first missing
    segment, keys available there); value is _MISSING when the path exists neither in the
    file nor among the defaults.
    """
    node: Any = root
    model: type[BaseModel] | None = MasterConfig
    walked: list[str] = []
    for segment in segments:
        if isinstance(node, str):
            node = resolve(node, ".".join(walked))
        child = _get_child(node, segment)
        if child is _MISSING and model is not None and isinstance(node, dict):
            child = _model_default(model, segment)
        if child is _MISSING:
            siblings: set[str] = set()
            if isinstance(node, dict):
                siblings.update(node)
                if model is not None:
                    siblings.update(_fields_by_key(model))
            return _MISSING, ".".join(walked), segment, sorted(map(str, siblings))
        model = _child_model(model, segment, child)
        node = child
        walked.append(segment)
    return node, ".".join(walked), "", []


def _model_default(model: type[BaseModel], key: str) -> Any:
    field = _fields_by_key(model).get(key)
    if field is None or field.is_required():
        return _MISSING
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        return default.model_dump(by_alias=True)
    return copy.deepcopy(default)


def _escape_references(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _escape_references(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_escape_references(value) for value in node]
    if isinstance(node, str):
        return node.replace("${", _ESCAPED_OPEN)
    return node


# --------------------------------------------------------------------------- stage 3: keys


def _fields_by_key(model: type[BaseModel]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        fields[name] = field
        if field.alias:
            fields[field.alias] = field
    return fields


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic model classes an annotation may hold (unwrapping Optional/Annotated/Union)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _mode_of(model: type[BaseModel]) -> str | None:
    """The ``name`` literal of a sampler config model."""
    field = model.model_fields.get("name")
    if field is None or typing.get_origin(field.annotation) is not typing.Literal:
        return None
    args = typing.get_args(field.annotation)
    return args[0] if len(args) == 1 else None


def _child_model(model: type[BaseModel] | None, key: str, value: Any) -> type[BaseModel] | None:
    if model is None:
        return None
    field = _fields_by_key(model).get(key)
    if field is None:
        return None
    candidates = _models_in(field.annotation)
    if len(candidates) == 1:
        return candidates[0]
    if candidates and isinstance(value, dict):
        by_mode = {_mode_of(candidate): candidate for candidate in candidates}
        return by_mode.get(value.get("name"))
    return None


def _check_model_keys(data: Any, model: type[BaseModel], path: str, problems: list[str]) -> None:
    if not isinstance(data, dict):
        return  # pydantic reports the wrong type
    fields = _fields_by_key(model)
    allows_extra = model.model_config.get("extra") == "allow"
    for key, value in data.items():
        dotted = _join(path, str(key))
        field = fields.get(key) if isinstance(key, str) else None
        if field is None:
            if not allows_extra:
                problems.append(_unknown_key_message(dotted, str(key), sorted(fields)))
            continue
        if value is None:
            continue
        candidates = _models_in(field.annotation)
        if len(candidates) == 1:
            _check_model_keys(value, candidates[0], dotted, problems)
        elif candidates:
            _check_sampler_keys(value, candidates, dotted, problems)


def _check_sampler_keys(
    data: Any, modes: Sequence[type[BaseModel]], path: str, problems: list[str]
) -> None:
    """Keys of a discriminated sampler block: tell apart typos and other modes' knobs."""
    if not isinstance(data, dict):
        return
    by_mode = {_mode_of(model): model for model in modes}
    chosen = by_mode.get(data.get("name"))
    if chosen is None:
        return  # missing or unknown name: reported by pydantic
    chosen_keys = _fields_by_key(chosen)
    if chosen.model_config.get("extra") == "allow":
        return  # a custom sampler's extra keys are its constructor arguments
    chosen_mode = data["name"]
    for key in data:
        if key in chosen_keys:
            continue
        owners = [
            mode
            for mode, model in by_mode.items()
            if mode != chosen_mode and key in model.model_fields and key not in ("name", "target")
        ]
        dotted = _join(path, str(key))
        if owners:
            problems.append(
                f"{dotted}: belongs to sampler mode(s) {', '.join(owners)}; it has no effect "
                f"under {chosen_mode} — remove it or change {path}.name"
            )
        else:
            problems.append(_unknown_key_message(dotted, str(key), sorted(chosen_keys)))
    _check_model_keys({k: v for k, v in data.items() if k in chosen_keys}, chosen, path, problems)


def _unknown_key_message(dotted: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"{dotted}: unknown key; did you mean {close[0]}?"
    return f"{dotted}: unknown key; valid keys here: {', '.join(valid)}"


# --------------------------------------------------------------------------- stage 4: pydantic


def _validation_messages(exc: ValidationError) -> list[str]:
    messages = []
    for error in exc.errors():
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
