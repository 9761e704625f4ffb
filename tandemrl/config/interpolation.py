"""Resolve ``${...}`` in the plain config tree with OmegaConf, reporting every failure by dotpath.

What a value may hold (OmegaConf's grammar, as in NeMo-RL's configs):

- ``${a.b.c}``: another key. A value that is exactly one reference takes the referenced
  value with its type (an int stays an int, a mapping stays a mapping); references inside a
  longer string are substituted as text.
- ``${.key}``, ``${..key}``: relative to the mapping that holds the value (one dot: a
  sibling, two: a key of the parent, and so on).
- ``${mul:a,b}``, ``${add:a,b}``, ``${div:a,b}``, ``${max:a,b}``, ``${min:a,b}``: arithmetic,
  nested as deep as needed (``${mul:${a},${b}}``); ``mul``, ``add``, ``max``, ``min`` take any
  number of arguments, ``div`` is true division. OmegaConf's own ``oc.*`` resolvers (such as
  ``${oc.env:NAME}``) work too.
- ``\\${`` writes a literal ``${``.

A reference to a TandemRL key the file does not write resolves to that key's default, as
long as the block holding it exists (``${grpo.num_prompts_per_step}`` with a ``grpo:``
block that leaves it out is 16); a reference into an absent or ``null`` block is an error.

Every value that cannot be resolved (a missing key, an unknown resolver, a cycle, a syntax
error, a resolver that raises, a mandatory ``???`` left unset) is one problem naming its
dotpath. It is never kept as a literal string. ``resolve_tree`` returns the resolved tree
without those values, plus the problems and the dotpaths they came from, so that later
stages can still check everything else.
"""

from __future__ import annotations

import difflib
import functools
import operator
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    GrammarParseError,
    InterpolationKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    UnsupportedInterpolationType,
)
from pydantic import BaseModel

from tandemrl.config.models import MasterConfig
from tandemrl.config.schema import model_for

RESOLVERS = ("mul", "add", "div", "max", "min")
_MISSING = object()
_REFERENCE = re.compile(r"\$\{([^${}:]*)\}")


def register_resolvers() -> None:
    """The arithmetic resolvers NeMo-RL's configs use (idempotent)."""
    functions = {
        "mul": lambda *values: functools.reduce(operator.mul, values),
        "add": lambda *values: functools.reduce(operator.add, values),
        "div": lambda a, b: a / b,
        "max": lambda *values: max(values),
        "min": lambda *values: min(values),
    }
    for name, function in functions.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function)


@dataclass
class Resolved:
    """The tree with every resolvable value resolved; what could not be, by dotpath."""

    tree: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    broken_paths: list[str] = field(default_factory=list)


def resolve_tree(raw: dict[str, Any]) -> Resolved:
    """Resolve every ``${...}`` in ``raw`` (the user's keys only; defaults stay unwritten)."""
    register_resolvers()
    result = Resolved(tree={})
    raw = _drop_unparsable(raw, "", result)
    lookup = _merge_defaults(_defaults_tree(MasterConfig, raw), raw)
    conf = OmegaConf.create(lookup)
    for key, value in raw.items():
        extracted = _extract(value, conf, key, key, lookup, result)
        if extracted is not _MISSING:
            result.tree[key] = extracted
    return result


# --------------------------------------------------------------------------- extraction


def _extract(
    raw_value: Any, parent: Any, key: Any, path: str, lookup: dict[str, Any], result: Resolved
) -> Any:
    """The resolved value of ``parent[key]``, following ``raw_value``'s own structure."""
    try:
        value = parent[key]
    except OmegaConfBaseException as exc:
        _fail(path, raw_value, exc, lookup, result)
        return _MISSING
    if isinstance(raw_value, dict) and isinstance(value, DictConfig):
        out = {}
        for child_key, child_raw in raw_value.items():
            child = _extract(child_raw, value, child_key, f"{path}.{child_key}", lookup, result)
            if child is not _MISSING:
                out[child_key] = child
        return out
    if isinstance(raw_value, list) and isinstance(value, ListConfig):
        items = []
        for index, item_raw in enumerate(raw_value):
            item = _extract(item_raw, value, index, f"{path}[{index}]", lookup, result)
            if item is _MISSING:
                return _MISSING  # a list with a hole would shift every later item
            items.append(item)
        return items
    if isinstance(value, DictConfig | ListConfig):
        # A reference to a whole block: resolve the block's own references too.
        try:
            return OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException as exc:
            _fail(path, raw_value, exc, lookup, result)
            return _MISSING
    return value


def _fail(
    path: str, raw_value: Any, exc: OmegaConfBaseException, lookup: dict[str, Any], result: Resolved
) -> None:
    result.broken_paths.append(path)
    detail = " ".join(str(exc).splitlines()[0].split())
    shown = repr(raw_value)
    if isinstance(exc, MissingMandatoryValue):
        message = f"{path}: mandatory value (???) not set; set it in the file or with {path}=..."
    elif isinstance(exc, UnsupportedInterpolationType):
        name = detail.rsplit(" ", 1)[-1]
        message = (
            f"{path}: {shown} uses the unknown resolver {name!r}; TandemRL knows "
            f"{', '.join(RESOLVERS)} and OmegaConf's oc.* resolvers"
        )
    elif isinstance(exc, InterpolationKeyError):
        match = re.search(r"'([^']*)'", detail)
        reference = match.group(1) if match else detail
        message = f"{path}: {shown} refers to {reference}, which does not exist"
        message += _missing_reason(reference, path, lookup)
    elif "is not a container" in detail and "trying to access " in detail:
        reference = detail.split("trying to access ", 1)[1].split(":", 1)[0]
        message = f"{path}: {shown} refers to {reference}, which does not exist"
        message += _missing_reason(reference, path, lookup)
    elif "Recursive interpolation" in detail:
        message = f"{path}: reference cycle {' -> '.join(_cycle(path, lookup))}"
    else:
        message = f"{path}: cannot resolve {shown} ({detail})"
    if message not in result.problems:
        result.problems.append(message)


def _missing_reason(reference: str, from_path: str, lookup: dict[str, Any]) -> str:
    """Why an absolute reference is missing, with a close key when there is one."""
    if reference.startswith("."):
        return ""
    node: Any = lookup
    walked: list[str] = []
    for segment in reference.split("."):
        if isinstance(node, dict) and segment in node:
            node = node[segment]
            walked.append(segment)
            continue
        where = ".".join(walked)
        if not isinstance(node, dict):
            return f" ({where} is not set or not a mapping)"
        close = difflib.get_close_matches(segment, [str(k) for k in node], n=1, cutoff=0.75)
        hint = f"; did you mean {'.'.join([*walked, close[0]])}?" if close else ""
        return f" (no {segment!r} under {where or 'the top level'}){hint}"
    return ""


def _cycle(path: str, lookup: dict[str, Any]) -> list[str]:
    """The chain of plain references that leads from ``path`` back to itself."""
    chain = [path]
    current = path
    for _ in range(64):
        value = _get_dotted(lookup, current)
        targets = _REFERENCE.findall(value) if isinstance(value, str) else []
        absolute = [t.strip() for t in targets if t.strip() and not t.strip().startswith(".")]
        if not absolute:
            break
        current = absolute[0]
        chain.append(current)
        if current in chain[:-1]:
            return chain[chain.index(current) :]
    return [*chain, "..."]


def _get_dotted(tree: Any, dotted: str) -> Any:
    node = tree
    for segment in dotted.replace("[", ".").replace("]", "").split("."):
        if isinstance(node, dict) and segment in node:
            node = node[segment]
        elif isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
            node = node[int(segment)]
        else:
            return None
    return node


def _drop_unparsable(node: Any, path: str, result: Resolved) -> Any:
    """A copy of ``node`` without strings OmegaConf cannot parse (each reported)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            child_path = f"{path}.{key}" if path else str(key)
            kept = _drop_unparsable(value, child_path, result)
            if kept is not _MISSING:
                out[key] = kept
        return out
    if isinstance(node, list):
        items = [_drop_unparsable(item, f"{path}[{i}]", result) for i, item in enumerate(node)]
        return _MISSING if any(item is _MISSING for item in items) else items
    if isinstance(node, str) and "${" in node:
        try:
            OmegaConf.create({"value": node})
        except GrammarParseError as exc:
            detail = " ".join(str(exc).splitlines()[0].split())
            result.broken_paths.append(path)
            result.problems.append(
                f"{path}: {node!r} is not a valid ${{...}} expression ({detail}); write \\${{ "
                "for a literal ${"
            )
            return _MISSING
    return node


# --------------------------------------------------------------------------- defaults


def _merge_defaults(defaults: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    merged = dict(defaults)
    for key, value in raw.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_defaults(merged[key], value)
        else:
            merged[key] = value
    return merged


def _defaults_tree(model: type[BaseModel], raw: Any) -> dict[str, Any]:
    """The defaults of ``model`` that a reference may fall back to, following ``raw``'s blocks.

    A block the user writes takes the defaults of the model it holds (for a sampler, of the
    mode its ``name`` picks); a block left out takes its default value (``null`` for
    ``grpo``, ``ppo``, ``value``, ...). Keys the user writes as scalars need no default.
    """
    out: dict[str, Any] = {}
    written = raw if isinstance(raw, dict) else {}
    for name, info in model.model_fields.items():
        key = info.alias or name
        user = written.get(key, _MISSING)
        if isinstance(user, dict):
            chosen = model_for(info.annotation, user)
            if chosen is not None:
                out[key] = _defaults_tree(chosen, user)
            continue
        if user is not _MISSING or info.is_required():
            continue
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json", by_alias=True)
        elif isinstance(default, tuple):
            default = list(default)
        out[key] = default
    return out
