"""Read a config file and the files it inherits from (``defaults:``) into one plain tree.

A file may start with ``defaults: parent.yaml`` or ``defaults: [a.yaml, b.yaml]``, as
NeMo-RL's configs do. Paths are relative to the file that names them (an absolute path is
taken as is); parents may have parents of their own. The tree is built depth first:

    parents, in the order listed (a later parent wins over an earlier one), then the file

Merging is key by key: two mappings merge recursively, anything else (a scalar, a list,
``null``) replaces what the parents had. A mapping that holds ``_override_: true`` replaces
the parents' mapping whole instead of merging into it (NeMo-RL's marker). ``${...}``
references are left as written; they are resolved once, on the merged tree
(``interpolation.py``), so a child's value flows into a parent's reference.

YAML is read the way OmegaConf reads it (``1e-8`` is a float, a duplicate key is an error),
but ``${...}`` is not parsed yet: a broken reference is reported with its dotpath later.
Problems name the file; a missing parent names the file that asked for it, and a cycle
prints the chain of files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tandemrl.config.errors import ConfigError

DEFAULTS_KEY = "defaults"
OVERRIDE_MARKER = "_override_"


def read_config_tree(path: str | Path) -> dict[str, Any]:
    """The merged plain tree of ``path`` and every file it inherits from."""
    return _read_with_parents(Path(path), chain=[])


def _read_with_parents(path: Path, chain: list[Path]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in [*chain[chain.index(resolved) :], resolved])
        raise ConfigError(f"{chain[-1]}: defaults: inheritance cycle {cycle}")
    tree = read_yaml_file(path)
    parents = tree.pop(DEFAULTS_KEY, None)
    if parents is None:
        return _strip_override_markers(tree)
    merged: dict[str, Any] = {}
    for parent in _parent_paths(path, parents):
        if not parent.is_file():
            raise ConfigError(
                f"{path}: defaults: {parent} not found (paths are relative to {path.parent})"
            )
        merged = merge_trees(merged, _read_with_parents(parent, [*chain, resolved]))
    return merge_trees(merged, tree)


def _parent_paths(path: Path, parents: Any) -> list[Path]:
    names = [parents] if isinstance(parents, str) else parents
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"{path}: defaults: must be a file name or a list of file names, got {parents!r}"
        )
    return [Path(name) if Path(name).is_absolute() else path.parent / name for name in names]


def read_yaml_file(path: Path) -> dict[str, Any]:
    """One YAML file as a plain dict (``${...}`` kept as text); problems name the file."""
    if not path.is_file():
        if path.exists():
            raise ConfigError(f"{path}: not a file")
        raise ConfigError(f"{path}: config file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc})") from None
    try:
        loaded = yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{path}: not valid YAML ({detail})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
    return {str(key): value for key, value in loaded.items()}


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with OmegaConf's two changes: YAML 1.2 floats, no duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# Dates stay strings (a config value is a number, a bool, a string, a list or a mapping).
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# 1e-8, 1.5E+3, .5, 10.: floats as in YAML 1.2 (PyYAML's 1.1 rules read "1e-8" as a string).
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.VERBOSE,
    ),
    list("-+0123456789."),
)


def merge_trees(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """``child`` over ``base``: mappings merge recursively, anything else replaces."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and value.get(OVERRIDE_MARKER) is True:
            merged[key] = _strip_override_markers(
                {k: v for k, v in value.items() if k != OVERRIDE_MARKER}
            )
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_trees(merged[key], value)
        else:
            merged[key] = _strip_override_markers(value)
    return merged


def _strip_override_markers(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: _strip_override_markers(item)
            for key, item in value.items()
            if key != OVERRIDE_MARKER
        }
    if isinstance(value, list):
        return [_strip_override_markers(item) for item in value]
    return value
