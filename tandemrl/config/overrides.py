"""Command-line overrides in Hydra's syntax, applied to the plain tree before interpolation.

Each override is parsed by Hydra's override parser (the grammar NeMo-RL users type), so a
value is typed as Hydra types it: ``40`` an int, ``1e-5`` a float, ``true`` a bool, ``null``
None, ``[0.9, 0.99]`` a list, ``{name: windowed}`` a mapping, ``${a.b}`` a reference,
anything else a string (quote it to keep spaces or special characters).

=================  =============================================================
``a.b=value``      set ``a.b``; missing mappings on the way are created (TandemRL
                   keys have defaults, so the file need not spell ``a.b`` out)
``+a.b=value``     add ``a.b``; refused when the file already sets it
``++a.b=value``    set ``a.b`` whether or not the file sets it
``~a.b``           delete ``a.b`` (its default applies again); refused when absent
``~a.b=value``     delete ``a.b`` only if it holds ``value``
=================  =============================================================

Overrides are applied in order, before interpolation, so a ``${a.b}`` elsewhere in the
file follows an override of ``a.b``. Every malformed or inapplicable override is reported,
each naming the override as typed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tandemrl.config.errors import ConfigError

_MISSING = object()


def apply_overrides(tree: dict[str, Any], overrides: Iterable[str]) -> None:
    """Apply every override to ``tree`` in place; all problems are reported together."""
    # Imported here: Hydra's parser builds an ANTLR grammar on first use.
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    problems: list[str] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            detail = " ".join(str(exc).split()).split(" See https://", 1)[0]
            problems.append(
                f"{text!r}: not a valid override ({detail}); write a.b=value, +a.b=value, "
                "++a.b=value or ~a.b"
            )
            continue
        if override.package is not None or override.is_sweep_override():
            problems.append(f"{text!r}: packages (@) and sweeps are not supported")
            continue
        segments = override.key_or_group.split(".")
        if any(not segment for segment in segments):
            problems.append(f"{text!r}: the key has an empty segment; write a.b=value")
            continue
        if override.type == OverrideType.DEL:
            expected = override.value() if "=" in text else _MISSING
            problem = _delete(tree, segments, expected)
        else:
            value = override.value()
            current = _get(tree, segments)
            if override.type == OverrideType.ADD and current is not _MISSING:
                problem = (
                    f"{override.key_or_group}: already set to {current!r}; {text} only adds a "
                    f"new key — write {text[1:]} or +{text} to change it"
                )
            else:
                problem = _set(tree, segments, value)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(problems)


def _get(tree: Any, segments: list[str]) -> Any:
    node = tree
    for segment in segments:
        node = _child(node, segment)
        if node is _MISSING:
            return _MISSING
    return node


def _child(node: Any, segment: str) -> Any:
    if isinstance(node, dict):
        return node.get(segment, _MISSING)
    if isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
        return node[int(segment)]
    return _MISSING


def _set(tree: dict[str, Any], segments: list[str], value: Any) -> str:
    dotted = ".".join(segments)
    node: Any = tree
    for depth, segment in enumerate(segments[:-1]):
        child = _child(node, segment)
        if child is _MISSING or child is None:
            if not isinstance(node, dict):
                return f"{dotted}: cannot create key {segment!r} inside a list"
            child = {}
            node[segment] = child
        elif not isinstance(child, dict | list):
            where = ".".join(segments[: depth + 1])
            return f"{dotted}: {where} holds {child!r}, not a mapping; cannot set a key below it"
        node = child
    last = segments[-1]
    if isinstance(node, list):
        if not (last.isdigit() and int(last) < len(node)):
            return f"{dotted}: list index {last!r} out of range"
        node[int(last)] = value
    else:
        node[last] = value
    return ""


def _delete(tree: dict[str, Any], segments: list[str], expected: Any) -> str:
    dotted = ".".join(segments)
    parent = _get(tree, segments[:-1]) if len(segments) > 1 else tree
    current = _child(parent, segments[-1]) if parent is not _MISSING else _MISSING
    if current is _MISSING:
        return f"{dotted}: ~{dotted} deletes nothing; the config does not set {dotted}"
    if expected is not _MISSING and current != expected:
        return (
            f"{dotted}: ~{dotted}={expected!r} deletes only when the value is {expected!r}; it is "
            f"{current!r}"
        )
    if isinstance(parent, list):
        del parent[int(segments[-1])]
    else:
        del parent[segments[-1]]
    return ""
