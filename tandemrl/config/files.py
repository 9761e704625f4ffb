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

YAML is read the way OmegaConf reads it (``1e-8`` is a float, duplicate keys are errors).
Problems name the file; a missing parent names the file that asked for it, and a cycle
prints the chain of files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

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
        loaded = OmegaConf.load(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc})") from None
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{path}: not valid YAML ({detail})") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
    tree = OmegaConf.to_container(loaded, resolve=False)
    assert isinstance(tree, dict)
    return {str(key): value for key, value in tree.items()}


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
